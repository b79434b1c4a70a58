"""The agent loop with injected stages: faults, probe thread, enforce rate limit, SIGTERM."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gpu_tune.serve.app import create_app
from gpu_tune.errors import HostError, InputError
from gpu_tune.tune.profile import Profile
from gpu_tune.serve.agent import Agent
from gpu_tune.serve.options import ServeOptions
from gpu_tune.serve.stages import Stages

from .test_readiness import AUDIT_OK, Pub, h100
from tests.realkube.cleanup import alive

REPO = Path(__file__).resolve().parents[1]

TOPO = {"numa_nodes": [{"id": 0}], "gpus": [
    {"index": i, "uuid": f"GPU-{i:08d}", "name": "NVIDIA H100 80GB HBM3", "pci_bus_id": f"0000:{0x18 + i:02x}:00.0",
     "numa_node": 0, "pcie": {"gen_current": 5, "gen_max": 5, "width_current": 16, "width_max": 16,
                              "degraded": False}} for i in range(2)], "nics": [], "warnings": []}


def passed(gpu: str, acc: float = 0.98) -> dict:
    return {"gpu": gpu, "status": "passed", "passed": True, "reasons": [], "finished_at": "2025-01-01T00:00:00Z",
            "duration_seconds": 3.0, "result": {"accuracy": acc, "train_images_per_second": 5000.0}}


class World:
    """A fake node: every stage is a method whose behaviour a test changes."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.published: list = []
        self.published_modes: list[str] = []
        self.gpu_list = [h100(0), h100(1)]
        self.audit_doc = AUDIT_OK
        self.probe_out = [passed("0"), passed("1")]
        self.publish_out = Pub(True, "published: 0 writes")
        self.fail: dict[str, Exception] = {}
        self.boot_id = "b-1"
        self.probe_gate: threading.Event | None = None
        self.probe_started = threading.Event()
        self.enforce_doc = None
        self.profile = Profile(name="training", gpu={"persistence_mode": True})

    def _call(self, name: str):
        self.calls[name] += 1
        if name in self.fail:
            raise self.fail[name]

    def discover(self):
        self._call("discover")
        return TOPO

    def audit(self):
        self._call("audit")
        return self.audit_doc

    def enforce(self, only=None):
        self._call("enforce")
        self.enforce_only = only
        return self.enforce_doc or {**self.audit_doc, "settings": [
            {**s, "status": "ok", "current": s["desired"], "changed": True} for s in self.audit_doc["settings"]]}

    def gpus(self):
        self._call("gpus")
        return list(self.gpu_list)

    def identity(self):
        self._call("identity")
        return {"driver_version": "570.124.06", "boot_id": self.boot_id}

    def probe(self, topology, previous):
        self.probe_started.set()
        self._call("probe")
        if self.probe_gate is not None:
            assert self.probe_gate.wait(10)
        return self.probe_out

    def publish(self, verdict, topology, gpus, driver, *, audit=None, probes=None, mode="enforce"):
        self._call("publish")
        self.published_modes.append(mode)
        self.last_published = verdict
        self.last_summary_inputs = {"audit": audit, "probes": probes}
        self.published.append(verdict)
        return self.publish_out

    def stages(self, probe_interval: float = 0) -> Stages:
        return Stages(node="node-a", profile=self.profile, discover=self.discover, audit=self.audit,
                      enforce=self.enforce, gpus=self.gpus, probe=self.probe, publish=self.publish,
                      identity=self.identity, probe_interval=probe_interval)


class Mono:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def checks(snap) -> dict:
    return {c.name: c for c in snap.verdict.checks}


def collectors(snap) -> dict:
    return {c.name: c for c in snap.collectors}


def ready_agent(world: World, **kw) -> tuple[Agent, TestClient]:
    agent = Agent(world.stages(), **kw)
    agent.run_pass()  # discover: asks for a probe
    assert agent._probe_request.is_set()
    agent.run_probe_once()
    agent.run_pass()
    return agent, TestClient(create_app(agent.state))


def test_pass_to_ready_and_requests_run_no_stage():
    world = World()
    agent, client = ready_agent(world)
    r = client.get("/readiness")
    assert r.status_code == 200, r.json()
    assert r.json()["node"] == "node-a" and all(c["ok"] for c in r.json()["checks"])
    before = dict(world.calls)
    for path in ("/readiness", "/metrics", "/audit", "/topology", "/probe", "/healthz") * 20:
        assert client.get(path).status_code == 200
    assert dict(world.calls) == before  # a request never audits, probes or publishes
    assert world.last_published.ready is True
    assert b'gpu_tune_ready 1.0' in client.get("/metrics").content


def test_gpu_lost_while_serving():
    world = World()
    agent, client = ready_agent(world)
    world.gpu_list = [h100(0), h100(1, error="Unknown Error", error_kind="lost")]
    snap = agent.run_pass()
    c = checks(snap)
    present = c["gpu.present"]
    assert not present.ok and dict(present.gpus) == {"0": True, "1": False} and "GPU 1" in present.detail
    assert "lost" in present.detail and "GPU 0" not in present.detail
    r = client.get("/readiness")
    assert r.status_code == 503
    assert client.get("/healthz").status_code == 200
    assert b'gpu="0"' in client.get("/metrics").content
    assert world.last_published.ready is False  # the node's condition follows


def test_probe_timeout_is_a_failed_check():
    world = World()
    world.probe_out = [passed("0"), {"gpu": "1", "status": "timeout", "passed": False,
                                     "reasons": ["no result within 300s; process group killed"],
                                     "finished_at": "2025-01-01T00:05:00Z", "duration_seconds": 300.0,
                                     "result": None}]
    agent, client = ready_agent(world)
    body = client.get("/readiness").json()
    c = {x["name"]: x for x in body["checks"]}
    assert not c["probe.1.passed"]["ok"] and "timeout" in c["probe.1.passed"]["detail"]
    assert c["probe.0.passed"]["ok"]
    assert client.get("/healthz").status_code == 200


@pytest.mark.parametrize("stage,check", [("discover", "topology.published"), ("audit", "tuning.compliant"),
                                         ("gpus", "gpu.backend"), ("publish", "topology.published"),
                                         ("probe", "probe.ran")])
def test_stage_raising_is_collector_failure_and_failed_check(stage, check):
    world = World()
    agent, client = ready_agent(world)
    world.fail[stage] = HostError(f"{stage} exploded: Input/output error (EIO)")
    if stage == "probe":
        agent.run_probe_once()
    snap = agent.run_pass()
    assert collectors(snap)[stage].success is False
    assert f"{stage} exploded" in collectors(snap)[stage].error
    c = checks(snap)
    assert not c[check].ok and f"{stage} exploded" in c[check].detail
    # the per-stage series come with serve --metrics-detail; the failing check is there by default
    assert f'gpu_tune_collector_success{{collector="{stage}"}}'.encode() not in snap.metrics_body
    assert f'gpu_tune_check_ok{{check="{check}"}} 0.0'.encode() in snap.metrics_body
    agent.metrics_detail = True
    assert f'gpu_tune_collector_success{{collector="{stage}"}} 0.0'.encode() in agent.run_pass().metrics_body
    agent.metrics_detail = False
    assert client.get("/healthz").status_code == 200
    assert client.get("/readiness").status_code == 503
    # the last good documents are still served
    assert client.get("/topology").status_code == 200 and client.get("/audit").status_code == 200
    del world.fail[stage]
    if stage == "probe":
        agent.run_probe_once()
    assert agent.run_pass().verdict.ready


def test_publisher_forbidden_shows_hint():
    world = World()
    world.publish_out = Pub(False, 'patch nodes/status "node-a": 403 Forbidden; grant the ClusterRole '
                                   'gpu-tune "patch" on nodes and nodes/status')
    agent, client = ready_agent(world)
    c = {x["name"]: x for x in client.get("/readiness").json()["checks"]}
    assert not c["topology.published"]["ok"] and "403" in c["topology.published"]["detail"]
    assert "grant the ClusterRole" in c["topology.published"]["detail"]
    assert b'gpu_tune_check_ok{check="topology.published"} 0.0' in client.get("/metrics").content
    assert world.last_published.ready is True  # what was asked for; the API refused it


def test_enforce_rate_limited_per_setting():
    world = World()
    world.audit_doc = {"profile": "training", "compliant": False, "settings": [
        {"id": "sysctl.vm.swappiness", "target": "host", "current": "60", "desired": "0", "status": "drift",
         "detail": ""}]}
    mono = Mono()
    agent = Agent(world.stages(), mode="enforce", enforce_min_interval=300, monotonic=mono)
    s1 = agent.run_pass()
    assert world.calls["enforce"] == 1 and s1.audit["settings"][0]["status"] == "ok"
    mono.t += 60  # something undid it; inside the limit: reported, not re-applied
    s2 = agent.run_pass()
    assert world.calls["enforce"] == 1
    row = s2.audit["settings"][0]
    assert row["status"] == "drift" and "next re-apply allowed in 240s" in row["detail"]
    mono.t += 241
    agent.run_pass()
    assert world.calls["enforce"] == 2
    assert world.enforce_only == {("sysctl.vm.swappiness", "host")}


def test_enforce_rewrites_only_the_settings_past_their_limit():
    world = World()
    sw = {"id": "sysctl.vm.swappiness", "target": "host", "current": "60", "desired": "0", "status": "drift", "detail": ""}
    thp = {"id": "thp.enabled", "target": "host", "current": "never", "desired": "always", "status": "ok", "detail": ""}
    world.audit_doc = {"profile": "training", "compliant": False, "settings": [sw, thp]}
    mono = Mono()
    agent = Agent(world.stages(), mode="enforce", enforce_min_interval=300, monotonic=mono)
    agent.run_pass()
    assert world.enforce_only == {("sysctl.vm.swappiness", "host")}
    mono.t += 60  # both drift now; only thp.enabled is due
    world.audit_doc = {"profile": "training", "compliant": False, "settings": [sw, {**thp, "status": "drift"}]}
    agent.run_pass()
    assert world.enforce_only == {("thp.enabled", "host")}


def test_enforce_row_held_back_by_the_rate_limit_says_so():
    world = World()
    sw = {"id": "sysctl.vm.swappiness", "target": "host", "current": "60", "desired": "0", "status": "drift", "detail": ""}
    thp = {"id": "thp.enabled", "target": "host", "current": "never", "desired": "always", "status": "ok", "detail": ""}
    world.audit_doc = {"profile": "training", "compliant": False, "settings": [sw, thp]}
    mono = Mono()
    agent = Agent(world.stages(), mode="enforce", enforce_min_interval=300, monotonic=mono)
    agent.run_pass()
    mono.t += 60  # swappiness drifted back (held back for 240 s more); thp drifts and is due
    world.audit_doc = {"profile": "training", "compliant": False, "settings": [sw, {**thp, "status": "drift"}]}
    world.enforce_doc = {"profile": "training", "compliant": False,  # what apply(only=thp) reports
                         "settings": [sw, {**thp, "status": "ok", "current": "always", "changed": True}]}
    snap = agent.run_pass()
    rows = {r["id"]: r for r in snap.audit["settings"]}
    assert rows["sysctl.vm.swappiness"]["status"] == "drift"
    assert rows["sysctl.vm.swappiness"]["detail"] == ("held back by the enforce rate limit: re-applied 60s ago, "
                                                      "next re-apply allowed in 240s")
    assert rows["thp.enabled"]["detail"] == ""
    detail = {c.name: c for c in snap.verdict.checks}["tuning.compliant"].detail
    assert "see the rows' detail" in detail


def test_enforce_a_refused_write_reports_the_kernels_reason_not_the_rate_limit(caplog):
    """kernel.numa_balancing needs CAP_SYS_ADMIN, outside gpu-tune.service's bounding set: its
    re-apply fails. Until the next try the row says why (the kernel's words, status error), never
    that a rate limit holds back a write that never happened; each refused try is one warning."""
    world = World()
    nb = {"id": "sysctl.kernel.numa_balancing", "target": "host", "current": "1", "desired": "0",
          "status": "drift", "detail": ""}
    refused = "cannot write '0' to /proc/sys/kernel/numa_balancing: Operation not permitted"
    world.audit_doc = {"profile": "training", "compliant": False, "settings": [nb]}
    world.enforce_doc = {"profile": "training", "compliant": False,
                         "settings": [{**nb, "status": "error", "changed": False, "detail": refused}]}
    mono = Mono()
    agent = Agent(world.stages(), mode="enforce", enforce_min_interval=300, monotonic=mono)
    with caplog.at_level("WARNING", logger="gpu_tune"):
        first = agent.run_pass()
        mono.t += 60
        second = agent.run_pass()
    assert world.calls["enforce"] == 1
    assert first.audit["settings"][0]["detail"] == refused
    row = second.audit["settings"][0]
    assert row["status"] == "error" and row["detail"].startswith(refused), row
    assert "rate limit" not in row["detail"] and "next try in 240s" in row["detail"]
    warned = [r.getMessage() for r in caplog.records if "numa_balancing" in r.getMessage()]
    assert len(warned) == 1 and refused in warned[0], warned
    mono.t += 241  # tried again at the limit; this time it takes
    world.enforce_doc = {"profile": "training", "compliant": True, "settings": [{**nb, "status": "ok", "current": "0"}]}
    agent.run_pass()
    mono.t += 60  # drifted again since: now the rate limit is the reason
    third = agent.run_pass()
    assert third.audit["settings"][0]["status"] == "drift" and "held back by the enforce rate limit" in \
        third.audit["settings"][0]["detail"]


def test_readiness_change_is_logged_at_info(caplog):
    world = World()
    agent, _ = ready_agent(world)
    assert agent.state.snapshot.verdict.ready
    world.fail["gpus"] = RuntimeError("NVML went away")
    with caplog.at_level("DEBUG", logger="gpu_tune"):
        agent.run_pass()
    (rec,) = [r for r in caplog.records if "readiness changed" in r.getMessage()]
    assert rec.levelname == "INFO"


def test_enforce_apply_raising_marks_rows_error():
    world = World()
    world.audit_doc = {"profile": "training", "compliant": False, "settings": [
        {"id": "thp.enabled", "target": "host", "current": "always", "desired": "madvise", "status": "drift",
         "detail": ""}]}
    world.fail["enforce"] = HostError("/var/lib/gpu-tune: Read-only file system (EROFS)")
    agent = Agent(world.stages(), mode="enforce")
    snap = agent.run_pass()
    row = snap.audit["settings"][0]
    assert row["status"] == "error" and "Read-only file system" in row["detail"]
    assert not checks(snap)["tuning.compliant"].ok


def test_enforce_real_engine_read_only_journal(make_host, monkeypatch):
    """The real engine over a fixture host whose journal folder cannot be written."""
    from contextlib import contextmanager

    from gpu_tune.tune import engine
    from gpu_tune.host.fs import HostFS

    root = make_host("small-2cpu")
    fs = HostFS(root)
    prof = Profile(name="training", sysctl={"vm.swappiness": 1})

    @contextmanager
    def read_only_lock(fs, timeout=30.0):
        raise HostError("/var/lib/gpu-tune: cannot record originals: Read-only file system")
        yield  # pragma: no cover

    monkeypatch.setattr(engine, "locked", read_only_lock)
    world = World()
    stages = world.stages()
    stages.audit = lambda: engine.audit(engine.make_context(fs, prof, None))
    stages.enforce = lambda only=None: engine.apply(engine.make_context(fs, prof, None), only=only)
    agent = Agent(stages, mode="enforce")
    snap = agent.run_pass()
    rows = {r["id"]: r for r in snap.audit["settings"]}
    assert rows["sysctl.vm.swappiness"]["status"] == "error"
    assert "Read-only file system" in rows["sysctl.vm.swappiness"]["detail"]
    assert fs.read_value("/proc/sys/vm/swappiness") != "1"  # nothing written without its original
    client = TestClient(create_app(agent.state))
    assert client.get("/healthz").status_code == 200 and client.get("/readiness").status_code == 503


def test_probe_triggers_on_identity_change_and_interval():
    world = World()
    mono = Mono()
    agent = Agent(world.stages(probe_interval=600), monotonic=mono, jitter=0.0)
    agent.run_pass()
    assert agent._probe_request.is_set()
    agent._probe_request.clear()
    agent.run_probe_once()
    agent.run_pass()
    assert not agent._probe_request.is_set()
    world.boot_id = "b-2"  # rebooted under us
    agent.run_pass()
    assert agent._probe_request.is_set()
    agent._probe_request.clear()
    world.gpu_list = [h100(0)]  # GPU set changed
    agent.run_pass()
    assert agent._probe_request.is_set()
    agent._probe_request.clear()
    agent.run_probe_once()
    mono.t += 599
    agent.run_pass()
    assert not agent._probe_request.is_set()
    mono.t += 2
    agent.run_pass()
    assert agent._probe_request.is_set()


def test_threads_keep_answering_during_a_long_probe():
    world = World()
    world.probe_gate = threading.Event()
    agent = Agent(world.stages(), interval=0.05, jitter=0.0)
    client = TestClient(create_app(agent.state))
    agent.start()
    try:
        assert world.probe_started.wait(5)
        passes = agent.state.passes
        t0 = time.monotonic()
        while agent.state.passes < passes + 3 and time.monotonic() - t0 < 5:
            assert client.get("/healthz").status_code == 200
            r = client.get("/readiness")
            assert r.status_code == 503
            time.sleep(0.01)
        assert agent.state.passes >= passes + 3  # the loop went on while the probe ran
        c = {x["name"]: x for x in client.get("/readiness").json()["checks"]}
        assert c["probe.ran"]["detail"] == "the probe has not completed yet"
        world.probe_gate.set()
        t0 = time.monotonic()
        while client.get("/readiness").status_code != 200 and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert client.get("/readiness").status_code == 200
    finally:
        world.probe_gate.set()
        agent.stop()
    assert all(not t.is_alive() for t in agent._threads)


def test_first_publish_waits_for_the_first_probe_verdict():
    world = World()
    world.probe_gate = threading.Event()
    agent = Agent(world.stages(), interval=0.05, jitter=0.0)
    agent.start()
    try:
        assert world.probe_started.wait(5)
        passes = agent.state.passes
        t0 = time.monotonic()
        while agent.state.passes < passes + 3 and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert agent.state.passes >= passes + 3
        assert world.calls.get("publish", 0) == 0  # not "not ready" now and "ready" seconds later
        world.probe_gate.set()
        t0 = time.monotonic()
        while world.calls.get("publish", 0) == 0 and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert world.calls.get("publish", 0) >= 1
        assert world.published[0].ready is True  # the first thing published is the real verdict
    finally:
        world.probe_gate.set()
        agent.stop()


def test_first_publish_is_not_held_forever():
    world = World()
    world.probe_gate = threading.Event()
    agent = Agent(world.stages(), interval=0.05, jitter=0.0, first_publish_max_wait=0.2)
    agent.start()
    try:
        assert world.probe_started.wait(5)
        t0 = time.monotonic()
        while world.calls.get("publish", 0) == 0 and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert world.calls.get("publish", 0) >= 1 and world.published[0].ready is False
    finally:
        world.probe_gate.set()
        agent.stop()


def test_options_validation():
    for bad in (dict(mode="fix"), dict(interval=0), dict(port=70000), dict(probe_device="tpu"),
                dict(probe_interval=-1)):
        with pytest.raises(InputError):
            ServeOptions(**bad).validate()
    ServeOptions().validate()


# -- the process: SIGTERM, --revert-on-exit ---------------------------------------------------
SERVE_SCRIPT = r"""
import json, sys
sys.path.insert(0, {repo!r})
from gpu_tune.serve.options import ServeOptions
from gpu_tune.serve.server import serve
from tests.test_service import World
marker = {marker!r}
world = World()
st = world.stages()
def revert():
    open(marker, "w").write("reverted")
    return True, ()
st.revert = revert
opts = ServeOptions(host="127.0.0.1", port=0, interval=0.2, revert_on_exit={revert_on_exit})
def ready(port):
    print(json.dumps({{"port": port}}), flush=True)
sys.exit(serve(opts, stages=st, ready_callback=ready))
"""


def _get(port: int, path: str, method: str = "GET") -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.parametrize("revert_on_exit", [False, True])
def test_serve_process_sigterm_exits_0(tmp_path, revert_on_exit):
    marker = tmp_path / "reverted"
    script = SERVE_SCRIPT.format(repo=str(REPO), marker=str(marker), revert_on_exit=revert_on_exit)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=REPO, text=True)
    try:
        port = json.loads(proc.stdout.readline())["port"]
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                code, body = _get(port, "/readiness")
                if code == 200:
                    break
            except OSError:
                pass
            time.sleep(0.05)
        assert code == 200, body
        assert _get(port, "/healthz")[0] == 200
        assert _get(port, "/readiness", "POST")[0] == 405
        assert _get(port, "/nope")[0] == 404
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        for _ in range(50):  # kept alive (TCP_NODELAY: tests/test_http_limits.py, on the server's sockets)
            conn.request("GET", "/readiness")
            assert conn.getresponse().read()
        conn.close()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:  # not HTTP at all
            s.sendall(b"\x16\x03\x01garbage\r\n\r\n")
            reply = s.recv(100)
        assert not reply.startswith(b"HTTP/1.1 5")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, proc.stderr.read()
    assert marker.exists() == revert_on_exit


def test_serve_port_in_use_is_input_error():
    from gpu_tune.serve.server import _bind

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        with pytest.raises(InputError, match="cannot listen"):
            _bind("127.0.0.1", s.getsockname()[1])
    finally:
        s.close()


# -- the real probe stage: verdicts saved for `gpu-tune label`, loaded back at start ----------
def _busy_gpu_host(tmp_path, busy=True):
    from tests.fixtures import hostgen

    root = hostgen.build("link-degraded", tmp_path / "host")
    doc = json.loads((REPO / "tests/fixtures/gpu/link-degraded.json").read_text())
    for g in doc["gpus"]:
        g["processes"] = [4242] if busy else []
    fixture = tmp_path / "gpus.json"
    fixture.write_text(json.dumps(doc))
    return root, fixture


def test_probe_stage_saves_its_verdicts(make_host, monkeypatch):
    """Each probe run is saved where `gpu-tune label` reads it (a quick error verdict: no data)."""
    from gpu_tune.host.fs import HostFS
    from gpu_tune.serve.stages import default_stages
    from gpu_tune.judge.probe.saved import load_probe_results

    monkeypatch.setenv("PYTHONPATH", str(REPO))
    root = make_host("small-2cpu")
    st = default_stages(ServeOptions(root=str(root), gpu_backend="none", no_kube=True, probe_device="cpu",
                                     probe_data=str(root / "no-such-mnist.npz")))
    agent = Agent(st)
    agent.run_pass()
    agent.run_probe_once()
    (v,) = agent._probe.results
    assert v["gpu"] == "cpu" and v["status"] == "error" and not v["passed"]
    assert load_probe_results(HostFS(root), "training") == [v]
    assert load_probe_results(HostFS(root), "inference") is None  # saved for its own profile only
    snap = agent.run_pass()
    assert not checks(snap)["probe.cpu.passed"].ok
    st.close()


def test_saved_verdict_stands_for_a_busy_gpu_across_restarts(tmp_path):
    from gpu_tune.host.fs import HostFS
    from gpu_tune.serve.stages import default_stages
    from gpu_tune.judge.probe.saved import load_probe_results, save_probe_results

    root, fixture = _busy_gpu_host(tmp_path)
    fs = HostFS(root)
    before = [passed("0", acc=0.975), {**passed("1"), "status": "failed", "passed": False,
                                         "reasons": ["accuracy 0.41 < 0.90"], "result": {"accuracy": 0.41}}]
    assert save_probe_results(fs, "training", before) is None

    def start():  # what `gpu-tune serve` builds at start
        return default_stages(ServeOptions(root=str(root), gpu_backend="fixture", gpu_fixture=str(fixture),
                                           no_kube=True, probe_device="gpu"))

    st = start()
    v = {x.gpu: x for x in st.probe(st.discover(), None)}
    assert v["0"].status == "skipped" and v["0"].passed and v["0"].result["accuracy"] == 0.975
    assert "previous verdict stands (passed, finished 2025-01-01T00:00:00Z)" in v["0"].reasons[0]
    assert v["1"].status == "skipped" and not v["1"].passed and "accuracy 0.41" in " ".join(v["1"].notes)
    saved = {d["gpu"]: d for d in load_probe_results(fs, "training")}
    assert saved["0"]["status"] == "skipped" and saved["0"]["passed"] is True

    st = start()  # restarted: the GPUs are still busy, the verdicts still stand
    v = {x.gpu: x for x in st.probe(st.discover(), None)}
    assert v["0"].passed and v["0"].result["accuracy"] == 0.975 and not v["1"].passed

    # the agent's own latest verdict wins over the saved one
    own = {"0": {**passed("0"), "status": "failed", "passed": False, "reasons": ["accuracy 0.5 < 0.9"]}}
    v = {x.gpu: x for x in st.probe(st.discover(), own)}
    assert v["0"].status == "skipped" and not v["0"].passed and v["1"].status == "skipped" and not v["1"].passed

    # nothing saved (or saved for another profile): a busy GPU has no verdict to stand on
    fs.write_file_atomic("/var/lib/gpu-tune/probe.json", json.dumps({"profile": "inference", "results": before}).encode())
    st = start()
    v = {x.gpu: x for x in st.probe(st.discover(), None)}
    assert not v["0"].passed and "no previous verdict" in v["0"].reasons[0]


def test_publish_stage_gets_the_summary_facts():
    """The node summary annotation is made from the pass's audit and probe documents."""
    world = World()
    agent, _ = ready_agent(world)
    assert world.last_summary_inputs["audit"] == AUDIT_OK
    assert [p["gpu"] for p in world.last_summary_inputs["probes"]] == ["0", "1"]
    assert world.last_summary_inputs["probes"][0]["result"]["accuracy"] == 0.98


SLOW_PROBE = '''
import os, subprocess, sys, time
child = subprocess.Popen(["sleep", "300"])  # a grandchild in the probe's process group
with open(os.environ["SLOW_PROBE_PIDS"] + ".tmp", "w") as fh:
    fh.write(f"{os.getpid()} {child.pid}")
os.rename(os.environ["SLOW_PROBE_PIDS"] + ".tmp", os.environ["SLOW_PROBE_PIDS"])
time.sleep(300)
'''


GRACE_PERIOD_S = 30  # the DaemonSet's terminationGracePeriodSeconds (the Kubernetes default)


def test_sigterm_during_a_probe_kills_it_and_exits_fast(tmp_path):
    """A real `gpu-tune serve` with a probe that would run for minutes: SIGTERM ends the agent, with
    exit code 0, within the pod's grace period (30 s: the kubelet's SIGKILL comes after it) and
    leaves no probe process behind. How fast (about a second) is benchmarks/bench_stop.py's figure."""
    import os

    from tests.fixtures import hostgen

    root = hostgen.build("small-2cpu", tmp_path / "host")
    pkg = tmp_path / "slowprobe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "sleep.py").write_text(SLOW_PROBE)
    pids = tmp_path / "pids"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_TUNE_") and k not in ("KUBECONFIG", "NODE_NAME")}
    env.update(PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}", GPU_TUNE_PROBE_MODULE="slowprobe.sleep",
               SLOW_PROBE_PIDS=str(pids))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "gpu_tune", "--root", str(root), "--gpu-backend", "none", "serve",
                             "--no-kube", "--host", "127.0.0.1", "--port", str(port), "--probe-device", "cpu",
                             "--interval", "1"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not pids.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert pids.exists(), proc.stderr.read() if proc.poll() is not None else "the probe did not start"
        probe_pid, grandchild = map(int, pids.read_text().split())
        assert alive(probe_pid, None) and alive(grandchild, None)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(120)  # the probe sleeps 300 s: an agent that waited for it is still here
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    assert rc == 0, err
    assert took < GRACE_PERIOD_S, f"SIGTERM to exit took {took:.1f}s, past the pod's grace period"
    deadline = time.monotonic() + 30
    while (alive(probe_pid, None) or alive(grandchild, None)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(probe_pid, None) and not alive(grandchild, None), "a probe process outlived the agent"
    assert "Traceback" not in err
    from gpu_tune.host.fs import HostFS
    from gpu_tune.judge.probe.saved import load_probe_results

    assert load_probe_results(HostFS(root), "training") is None  # a probe cut short is no verdict to keep


# -- passes of agents a rollout started together ----------------------------------------------------------
def test_the_wait_after_the_first_publish_spreads_over_the_whole_interval():
    """A rollout starts a fleet's agents within seconds of each other; +-10 % a pass keeps them
    together for hours. The wait after the first publish is drawn over the whole interval."""
    import random

    from gpu_tune.serve.agent import pass_wait

    rng = random.Random(7)
    first = [pass_wait(rng, 60.0, 0.1, after_first_publish=True) for _ in range(2000)]
    later = [pass_wait(rng, 60.0, 0.1) for _ in range(2000)]
    assert all(0.0 <= w <= 60.0 for w in first) and min(first) < 3.0 and max(first) > 57.0
    assert sum(w < 30.0 for w in first) > 800  # as many early as late, not bunched at the interval
    assert all(54.0 <= w <= 66.0 for w in later)


def test_the_loop_draws_the_wait_after_its_first_publish_over_the_interval(monkeypatch):
    import gpu_tune.serve.agent as agent_module

    drawn: list[bool] = []

    def record(rng, interval, jitter, *, after_first_publish=False):
        drawn.append(after_first_publish)
        return 0.01

    monkeypatch.setattr(agent_module, "pass_wait", record)
    world = World()
    agent = Agent(world.stages(), interval=0.05, probe_enabled=False)  # the first pass publishes
    agent.start()
    try:
        t0 = time.monotonic()
        while len(drawn) < 3 and time.monotonic() - t0 < 10:
            time.sleep(0.01)
    finally:
        agent.stop()
    assert world.calls.get("publish", 0) >= 1
    assert drawn[:3] == [True, False, False], drawn
