"""End to end with real processes: `gpu-tune serve` against a Kubernetes API, `gpu-tune label`
through the CLI, and a real Prometheus scraping the agent.

Every process is started here, waited on with a deadline and ended by its own pid.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest

from gpu_tune.tune import engine
from gpu_tune.host.fs import HostFS
from gpu_tune.cluster.labels import ANNOTATION_OWNED, ANNOTATION_TOPOLOGY, CONDITION_TYPE, PREFIX, TAINT_EFFECT, TAINT_KEY
from gpu_tune.tune.policy import load_profile
from gpu_tune.judge.probe.saved import load_probe_results, save_probe_results
from tests import skips
from tests.fixtures import hostgen
from tests.realkube.testapi import write_kubeconfig

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
OUR_TAINT = {"key": TAINT_KEY, "effect": TAINT_EFFECT}
FOREIGN_TAINT = {"key": "dedicated", "value": "ml", "effect": "NoSchedule"}
# (not nvidia.com/gpu.present=true: these nodes run the agent without GPUs, and a Node that says it
# has GPUs the agent cannot see is not ready, see tests/test_agent_modes.py)
FOREIGN_LABELS = {"team": "ml", "nvidia.com/cuda.driver.major": "570", "topology.kubernetes.io/zone": "z1"}


# -- helpers ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GPU_TUNE_") and k not in ("KUBECONFIG", "NODE_NAME", "KUBERNETES_SERVICE_HOST")}
    env.update(PYTHONPATH=str(REPO), COLUMNS="400", **extra)
    return env


def gpu_tune(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpu_tune", *args], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=timeout)


def http_get(url: str, timeout: float = 3) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_for(what: str, fn: Callable[[], Any], timeout: float, *, proc: subprocess.Popen | None = None,
             log: Path | None = None, step: float = 0.2) -> Any:
    """Poll ``fn`` until it returns something true; fail naming ``what`` (with the log's tail)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            break
        try:
            last = fn()
        except OSError as exc:  # not listening yet
            last = exc
        else:
            if last:
                return last
        time.sleep(step)
    tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
    exited = f" (process exited with {proc.returncode})" if proc is not None and proc.poll() is not None else ""
    pytest.fail(f"{what}: not within {timeout:.0f}s{exited}; last: {last!r}\n{tail}")


class Procs:
    """Processes started by a test; whatever is still running at the end is killed by pid."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen] = []

    def start(self, argv: list[str], log: Path, **kw: Any) -> subprocess.Popen:
        fh = open(log, "wb")
        p = subprocess.Popen(argv, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, **kw)
        fh.close()
        self.started.append(p)
        return p

    def serve(self, root: Path, log: Path, *args: str) -> subprocess.Popen:
        return self.start([sys.executable, "-m", "gpu_tune", "--root", str(root), "--gpu-backend", "none",
                           "serve", "--host", "127.0.0.1", *args], log, env=child_env())

    def cleanup(self) -> None:
        for p in self.started:
            if p.poll() is None:
                p.kill()
                p.wait(10)


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.cleanup()


def ours(labels: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in labels.items() if k.startswith(PREFIX)}


def condition(node: dict) -> dict | None:
    return next((c for c in node["status"]["conditions"] if c["type"] == CONDITION_TYPE), None)


# -- a. the agent: enforce, CPU probe, publish to the Node, then quiet ----------------------------
def test_serve_enforce_publishes_node_then_writes_nothing(tmp_path, procs, api):
    root = hostgen.build("small-2cpu", tmp_path / "host")
    node = "gpu-e2e-1"
    api.add_node(node, labels=FOREIGN_LABELS, taints=[OUR_TAINT, FOREIGN_TAINT])
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url)
    port = free_port()
    log = tmp_path / "serve.log"
    proc = procs.serve(root, log, "--port", str(port), "--mode", "enforce", "--probe-device", "cpu",
                       "--interval", "1", "--kubeconfig", str(kubeconfig), "--node", node)
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    body = wait_for("/readiness 200", lambda: (lambda r: r[1] if r[0] == 200 else None)(http_get(base + "/readiness")),
                    120, proc=proc, log=log)
    ready_after = time.monotonic() - t0
    writes_at_ready = api.writes[node]
    bodies = list(api.bodies)
    doc = json.loads(body)
    assert doc["ready"] is True and doc["node"] == node and doc["profile"] == "training"
    assert {c["name"] for c in doc["checks"]} >= {"tuning.compliant", "topology.published", "probe.cpu.passed"}
    audit = json.loads(http_get(base + "/audit")[1])
    assert audit["compliant"] is True and audit["profile"] == "training"
    probes = json.loads(http_get(base + "/probe")[1])
    assert probes[0]["gpu"] == "cpu" and probes[0]["passed"] is True
    metrics = http_get(base + "/metrics")[1].decode()
    assert "gpu_tune_ready 1.0" in metrics
    assert 'gpu_tune_check_ok{check="topology.published"} 1.0' in metrics
    assert 'gpu_tune_check_ok{check="tuning.compliant"} 1.0' in metrics
    assert "gpu_tune_collector_success" not in metrics  # per-stage series: serve --metrics-detail

    # what the Node carries now (docs/cli.md, `gpu-tune label`)
    n = api.node(node)
    labels = n["metadata"]["labels"]
    mine = ours(labels)
    assert mine[PREFIX + "profile"] == "training" and mine[PREFIX + "ready"] == "true"
    assert mine[PREFIX + "numa-nodes"] == "1" and mine[PREFIX + "gpu-count"] == "0"
    assert all(len(v) <= 63 for v in mine.values())
    ann = n["metadata"]["annotations"]
    assert ann[ANNOTATION_OWNED] == ",".join(sorted(mine))
    topo = json.loads(ann[ANNOTATION_TOPOLOGY])
    assert len(topo["numa_nodes"]) == 1 and topo["gpus"] == []
    summary = json.loads(ann[PREFIX + "summary"])  # what `gpu-tune fleet` reads
    assert summary["drift"] == 0 and summary["failing"] == []
    assert summary["probe"]["cpu"]["status"] == "passed" and summary["probe"]["cpu"]["accuracy"] > 0.5
    cond = condition(n)
    assert cond is not None and cond["status"] == "True" and cond["reason"] == "AllChecksPassed"
    assert n["spec"]["taints"] == [FOREIGN_TAINT]  # ours removed, the other kept as it was
    for k, v in FOREIGN_LABELS.items():
        assert labels[k] == v
    assert labels["kubernetes.io/hostname"] == node
    assert not any(k.startswith(("nvidia.com/", "feature.node.kubernetes.io/")) and k not in FOREIGN_LABELS
                   for k in labels)
    events = api.events_for(node)
    assert events and events[-1]["reason"] == "GPUHostReady" and events[-1]["type"] == "Normal"

    # writes on a first start: the agent holds its first publish until the first probe verdict,
    # so the node is written once: labels+annotations+taint, the condition, the Event (<= 4)
    first_true = next(i for i, (m, path, _, b) in enumerate(bodies)
                      if path.endswith(f"/nodes/{node}") and
                      (b.get("metadata") or {}).get("labels", {}).get(PREFIX + "ready") == "true")
    ready_pass = bodies[first_true:]
    assert len(ready_pass) <= 4, ready_pass
    assert [p.rsplit("/", 1)[-1] for _, p, _, _ in ready_pass] == [node, "status", "events"]
    assert writes_at_ready == len(ready_pass) == 3, bodies

    # steady: two more full passes (one GET each) write nothing
    reads = api.reads[node]
    wait_for("3 more passes", lambda: api.reads[node] >= reads + 3, 20, proc=proc, log=log, step=0.1)
    assert api.writes[node] == writes_at_ready, api.bodies[len(bodies):]

    # the agent saved its probe verdict for `gpu-tune label`
    saved = load_probe_results(HostFS(root), "training")
    assert saved and saved[0]["gpu"] == "cpu" and saved[0]["passed"] is True

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0, log.read_text()[-2000:]
    # no --revert-on-exit: the settings enforce wrote stay
    assert (root / "proc/sys/vm/swappiness").read_text().strip() == "0"
    assert (root / "sys/kernel/mm/transparent_hugepage/enabled").read_text().strip() == "always"
    print(f"serve: ready after {ready_after:.1f}s, {writes_at_ready} node writes")


# -- b. `gpu-tune label` through the CLI ------------------------------------------------------------
def _ready_host(tmp_path: Path) -> Path:
    """A fixture host with the training profile applied and a passing CPU probe verdict saved."""
    root = hostgen.build("small-2cpu", tmp_path / "host")
    fs = HostFS(root)
    report = engine.apply(engine.make_context(fs, load_profile("training"), None))
    assert report.compliant, report.as_dict()
    verdict = {"gpu": "cpu", "status": "passed", "passed": True, "reasons": [],
               "notes": ["no throughput baseline for 'cpu': measured and reported, not judged"],
               "attempts": 1, "started_at": "2025-06-01T10:00:00.000Z", "finished_at": "2025-06-01T10:00:14.900Z",
               "duration_seconds": 14.9, "expected_cpus": "0-1", "expected_node": None,
               "result": {"ok": True, "error": None, "error_kind": None, "requested_device": "cpu",
                          "device": {"kind": "cpu", "name": "AMD EPYC", "compute_capability": None},
                          "accuracy": 0.955, "train_images_per_second": 7634.0,
                          "inference_images_per_second": {"1": 1158.0, "32": 16244.0, "64": 17159.0, "256": 16067.0}},
               "stderr_tail": ""}
    assert save_probe_results(fs, "training", [verdict]) is None
    return root


def test_label_cli_publishes_once_then_nothing(tmp_path, api):
    root = _ready_host(tmp_path)
    node = "gpu-e2e-2"
    api.add_node(node, labels=FOREIGN_LABELS, taints=[OUR_TAINT, FOREIGN_TAINT])
    api.add_node("locked-down")
    kc = str(write_kubeconfig(tmp_path / "kubeconfig", api.url))
    cmd = ("--root", str(root), "--gpu-backend", "none", "label", "--kubeconfig", kc)

    first = gpu_tune(*cmd, "--node", node)
    assert first.returncode == 0, first.stdout + first.stderr
    out = first.stdout
    assert f"node {node}: ready" in out
    assert "changed: label gpu-tune.io/ready=true" in out and "changed: label gpu-tune.io/profile=training" in out
    assert f"changed: taint {TAINT_KEY}:{TAINT_EFFECT} removed" in out
    assert f"changed: condition {CONDITION_TYPE}=True (AllChecksPassed) added" in out
    assert "changed: event GPUHostReady" in out
    assert api.writes[node] == 3  # labels+annotations+taint, condition, Event
    n = api.node(node)
    assert n["spec"]["taints"] == [FOREIGN_TAINT] and condition(n)["status"] == "True"
    assert ours(n["metadata"]["labels"])[PREFIX + "ready"] == "true"
    assert all(n["metadata"]["labels"][k] == v for k, v in FOREIGN_LABELS.items())
    summary = json.loads(n["metadata"]["annotations"][PREFIX + "summary"])
    assert summary == {"v": 1, "drift": 0, "failing": [],
                       "probe": {"cpu": {"status": "passed", "accuracy": 0.955}}}

    second = gpu_tune(*cmd, "--node", node)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "changed: nothing" in second.stdout and "writes: 0" in second.stdout
    assert api.writes[node] == 3

    # someone drops one of our labels: a dry run names the change and writes nothing
    api.edit_node(node, {"metadata": {"labels": {PREFIX + "numa-nodes": None}}})
    dry = gpu_tune(*cmd, "--node", node, "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "would change: label gpu-tune.io/numa-nodes=1" in dry.stdout
    assert api.writes[node] == 3 and PREFIX + "numa-nodes" not in api.node(node)["metadata"]["labels"]

    # no RBAC for nodes/status: exit 1 and the rule that is missing
    api.fail(r"^/api/v1/nodes/locked-down/status$", 403, method="PATCH")
    denied = gpu_tune(*cmd, "--node", "locked-down")
    assert denied.returncode == 1, denied.stdout + denied.stderr
    text = denied.stdout + denied.stderr
    assert "forbidden: may not patch nodes/status" in text
    assert 'resources: ["nodes/status"], verbs: ["patch"]' in text
    assert "Traceback" not in text
    assert condition(api.node("locked-down")) is None


# -- c. a real Prometheus scrapes the agent ---------------------------------------------------------
def _prometheus() -> str | None:
    return shutil.which("prometheus") or ("/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None)


def test_prometheus_scrapes_the_agent(tmp_path, procs):
    exe = _prometheus()
    if exe is None:
        skips.missing("tool", "the prometheus binary is missing: install the Debian package `prometheus` (make tools)")
    root = hostgen.build("small-2cpu", tmp_path / "host")
    agent_port, prom_port = free_port(), free_port()
    agent_log = tmp_path / "serve.log"
    # no MNIST data: the probe ends at once with an error verdict (no TensorFlow started)
    agent = procs.serve(root, agent_log, "--port", str(agent_port), "--no-kube", "--interval", "1",
                        "--probe-device", "cpu", "--probe-data", str(tmp_path / "no-mnist.npz"), "--metrics-detail")
    wait_for("agent /metrics", lambda: http_get(f"http://127.0.0.1:{agent_port}/metrics")[0] == 200, 30,
             proc=agent, log=agent_log)
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [{"job_name": "gpu-tune", "static_configs": [{"targets": [f"127.0.0.1:{agent_port}"]}]}],
    }))
    prom_log = tmp_path / "prometheus.log"
    prom = procs.start([exe, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                        f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"], prom_log)
    api = f"http://127.0.0.1:{prom_port}/api/v1/query?query="

    def query(q: str) -> list[dict]:
        code, body = http_get(api + urllib.parse.quote(q))
        if code != 200:
            return []
        doc = json.loads(body)
        return doc["data"]["result"] if doc.get("status") == "success" else []

    def scraped() -> dict[str, list[dict]] | None:
        got = {q: query(q) for q in ('up{job="gpu-tune"}', 'gpu_tune_build_info{job="gpu-tune"}',
                                     'gpu_tune_setting_compliant{job="gpu-tune"}', 'gpu_tune_ready{job="gpu-tune"}',
                                     'gpu_tune_setting_targets{job="gpu-tune"}',
                                     'gpu_tune_setting_target_compliant{job="gpu-tune"}')}
        return got if all(got.values()) and got['up{job="gpu-tune"}'][0]["value"][1] == "1" else None

    got = wait_for("prometheus: up == 1 and gpu_tune_* series for job gpu-tune", scraped, 30, proc=prom,
                   log=prom_log, step=0.5)
    build = got['gpu_tune_build_info{job="gpu-tune"}'][0]["metric"]
    assert build["instance"] == f"127.0.0.1:{agent_port}" and build.get("version")
    settings = {s["metric"]["id"]: s["value"][1] for s in got['gpu_tune_setting_compliant{job="gpu-tune"}']}
    assert settings["sysctl.vm.swappiness"] == "0"  # audit mode: 60 != 0, not compliant
    targets = {(s["metric"]["id"], s["metric"]["status"]): s["value"][1]
               for s in got['gpu_tune_setting_targets{job="gpu-tune"}']}
    assert targets[("cpu.governor", "drift")] == "2"  # both CPUs run schedutil, the profile wants performance
    # --metrics-detail: the per-target series too
    per_target = {(s["metric"]["id"], s["metric"]["target"]): s["value"][1]
                  for s in got['gpu_tune_setting_target_compliant{job="gpu-tune"}']}
    assert per_target[("cpu.governor", "cpu0")] == per_target[("cpu.governor", "cpu1")] == "0"
    assert got['gpu_tune_ready{job="gpu-tune"}'][0]["value"][1] == "0"  # drift and a failed probe
    for p in (prom, agent):
        p.send_signal(signal.SIGTERM)
    assert agent.wait(20) == 0, agent_log.read_text()[-2000:]
    prom.wait(20)
