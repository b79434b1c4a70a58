"""The agent's modes and its pod readiness against the test API server over real HTTP, with the
real stages over a fixture host (only the probe is a stand-in: its verdict, not TensorFlow).

Rollouts (the pod's /agent-ready), the audit shape that never taints, taking a node back (mode
revert, by flag or by Node label), a GPU node whose GPUs the agent cannot see, and a steady node
that a restart does not write to.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gpu_tune.serve.app import create_app
from gpu_tune.host.fs import HostFS
from gpu_tune.cluster.labels import CONDITION_TYPE, PREFIX, TAINT_EFFECT, TAINT_KEY
from gpu_tune.serve.agent import Agent
from gpu_tune.serve.options import ServeOptions
from gpu_tune.serve.stages import default_stages
from gpu_tune.judge.probe.saved import save_probe_results
from tests.fixtures import hostgen
from tests.fixtures.probes import probe_result, probe_verdict
from tests.realkube.testapi import write_kubeconfig

OURS = {"key": TAINT_KEY, "effect": TAINT_EFFECT}
FOREIGN = {"key": "dedicated", "value": "ml", "effect": "NoSchedule"}
GPU_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gpu"


def cpu_probe(ips: float) -> list[dict]:
    return [probe_verdict("cpu", probe_result(launch=ips, device=ips * 2))]


def make_agent(root: Path, kubeconfig: str, node: str, *, mode: str, probes: list[dict] | None = None,
               gpu_backend: str = "none", gpu_fixture: str | None = None) -> Agent:
    opts = ServeOptions(root=str(root), gpu_backend=gpu_backend, gpu_fixture=gpu_fixture, kubeconfig=kubeconfig,
                        node=node, mode=mode)
    st = default_stages(opts)
    out = probes if probes is not None else cpu_probe(12000.0)
    st.probe = lambda topology, previous: out
    agent = Agent(st, mode=mode, interval=60, enforce_min_interval=0, jitter=0)
    agent._started_at = agent.monotonic()  # as start() does: the first publish waits for the probe
    return agent


def settle(agent: Agent):
    agent.run_pass()  # asks for the probe; the first publish is held for its verdict
    agent.run_probe_once()
    return agent.run_pass()


def condition(node: dict) -> dict | None:
    return next((c for c in node["status"]["conditions"] if c["type"] == CONDITION_TYPE), None)


def swappiness(root: Path) -> str:
    return (root / "proc/sys/vm/swappiness").read_text().strip()


@pytest.fixture()
def kubeconfig(api, tmp_path):
    return str(write_kubeconfig(tmp_path / "kubeconfig", api.url))


@pytest.fixture()
def host(tmp_path):
    return hostgen.build("small-2cpu", tmp_path / "host")  # untuned: swappiness 60, THP always ...


# -- the audit shape: never taints; its pod is ready on an untuned node --------------------------
@pytest.mark.parametrize("taints", [[FOREIGN], [OURS, FOREIGN]], ids=["untainted", "tainted-by-an-older-version"])
def test_audit_mode_untuned_node_pod_ready_node_not_and_no_taint(api, kubeconfig, host, taints):
    api.add_node("n1", taints=taints)
    agent = make_agent(host, kubeconfig, "n1", mode="audit")
    settle(agent)
    client = TestClient(create_app(agent.state))
    node_verdict = client.get("/readiness")
    assert node_verdict.status_code == 503  # the node's verdict: not tuned (docs/operations.md)
    assert {c["name"]: c["ok"] for c in node_verdict.json()["checks"]}["tuning.compliant"] is False
    pod = client.get("/agent-ready")
    assert pod.status_code == 200, pod.json()  # the pod: ready, so a rollout goes on
    n = api.node("n1")
    assert n["spec"]["taints"] == [FOREIGN]  # never added; one left by an older version taken off
    assert condition(n)["status"] == "False" and condition(n)["reason"] == "TuningNotCompliant"
    assert n["metadata"]["labels"][PREFIX + "ready"] == "false"
    # what was written: our labels and annotations, the condition, the Event; spec only to take ours off
    for method, path, _, body in api.bodies:
        if path.endswith("/nodes/n1"):
            assert set(body) <= {"metadata", "spec"}
            assert set(body["metadata"]) <= {"labels", "annotations", "resourceVersion"}
            assert all(k.startswith(PREFIX) for k in {**body["metadata"].get("labels", {}),
                                                       **body["metadata"].get("annotations", {})})
            if "spec" in body:
                assert taints != [FOREIGN] and body["spec"] == {"taints": [FOREIGN]}
        elif path.endswith("/nodes/n1/status"):
            assert set(body) == {"status"} and set(body["status"]) == {"conditions"}
        else:
            assert path.endswith("/events"), path
    assert swappiness(host) == "60"  # nothing changed on the host


def test_rollout_stops_where_the_new_version_breaks_a_ready_node(api, kubeconfig, host):
    """A node the old version kept ready (its GPUHostReady=True on the Node) that the new agent
    judges not ready: the pod is not ready, so the rollout under maxUnavailable stops there."""
    api.add_node("n1", conditions=[{"type": "Ready", "status": "True"},
                                   {"type": CONDITION_TYPE, "status": "True", "reason": "AllChecksPassed",
                                    "message": "all 3 checks passed", "lastHeartbeatTime": "2025-01-01T00:00:00Z",
                                    "lastTransitionTime": "2025-01-01T00:00:00Z"}])
    agent = make_agent(host, kubeconfig, "n1", mode="audit")  # the untuned host: this version says not ready
    settle(agent)
    pod = TestClient(create_app(agent.state)).get("/agent-ready")
    assert pod.status_code == 503
    assert "was ready (GPUHostReady=True) when this agent started" in pod.json()["detail"]
    assert "tuning.compliant" in pod.json()["detail"]

    # the same version on a node it keeps ready: pod ready
    api.add_node("n2", conditions=[{"type": CONDITION_TYPE, "status": "True", "reason": "AllChecksPassed",
                                    "message": "x"}])
    good = make_agent(host, kubeconfig, "n2", mode="enforce")
    settle(good)
    assert good.state.snapshot.verdict.ready
    assert TestClient(create_app(good.state)).get("/agent-ready").status_code == 200


def test_pod_not_ready_before_the_first_publish_and_when_publishing_fails(api, kubeconfig, host):
    api.add_node("n1")
    agent = make_agent(host, kubeconfig, "n1", mode="audit")
    client = TestClient(create_app(agent.state))
    assert client.get("/agent-ready").status_code == 503  # no pass yet
    agent.run_pass()  # held for the probe: nothing published
    r = client.get("/agent-ready")
    assert r.status_code == 503 and "not published" in r.json()["detail"]
    agent.run_probe_once()
    agent.run_pass()
    assert client.get("/agent-ready").status_code == 200
    api.fail(r"^/api/v1/nodes/n1$", 403, method="GET")  # e.g. a new version's RBAC lost `get nodes`
    agent.run_pass()
    r = client.get("/agent-ready")
    assert r.status_code == 503 and "latest publish failed" in r.json()["detail"]


# -- a steady node: restarts make no write ------------------------------------------------------
def test_second_start_on_a_steady_node_makes_zero_writes(api, kubeconfig, host):
    api.add_node("n1", taints=[OURS, FOREIGN])
    first = make_agent(host, kubeconfig, "n1", mode="enforce", probes=cpu_probe(9800.0))
    snap = settle(first)
    assert snap.verdict.ready, snap.verdict.as_dict()
    first.run_pass()
    cond = condition(api.node("n1"))
    # the condition names as many checks as /readiness shows
    assert cond["message"] == f"all {len(snap.verdict.checks)} checks passed"
    api.reset_counts()
    # a restart (new process, new client); the probe measured 15k images/s this time
    second = make_agent(host, kubeconfig, "n1", mode="enforce", probes=cpu_probe(15000.0))
    assert settle(second).verdict.ready
    second.run_pass()
    assert api.total_writes() == 0, api.bodies
    from gpu_tune import __version__

    assert set(api.user_agents) == {f"gpu-tune/{__version__}"}  # not the client generator's
    assert second.state.snapshot.probes[0]["result"]["regimes"]["launch_bound"]["images_per_second"] == 15000.0


# -- taking a node back: mode revert ----------------------------------------------------------------
@pytest.mark.parametrize("via", ["node-label", "flag"])
def test_revert_restores_reports_and_stops_enforcing(api, kubeconfig, host, via):
    api.add_node("n1", taints=[FOREIGN])
    enforcing = make_agent(host, kubeconfig, "n1", mode="enforce")
    assert settle(enforcing).verdict.ready
    assert swappiness(host) == "0"
    if via == "node-label":
        api.edit_node("n1", {"metadata": {"labels": {PREFIX + "mode": "revert"}}})
        agent = enforcing  # the very next pass reads the label and reverts
    else:
        agent = make_agent(host, kubeconfig, "n1", mode="revert")  # the DaemonSet's --mode revert
        agent.run_probe_once()
    snap = agent.run_pass()
    assert snap.mode == "revert"
    assert swappiness(host) == "60"  # the original, from the journal
    checks = {c.name: c for c in snap.verdict.checks}
    assert "tuning.compliant" not in checks and checks["tuning.reverted"].ok is False
    assert "originals are restored" in checks["tuning.reverted"].detail
    client = TestClient(create_app(agent.state))
    assert client.get("/readiness").status_code == 503
    assert client.get("/agent-ready").status_code == 200  # a fleet-wide revert rollout goes on
    assert 'gpu_tune_check_ok{check="tuning.reverted"} 0.0' in client.get("/metrics").text
    n = api.node("n1")
    assert condition(n)["reason"] == "Reverted" and condition(n)["status"] == "False"
    assert n["spec"]["taints"] == [FOREIGN]  # a reverted node is not tainted
    # it stays reverted: the agent does not re-apply, and a steady reverted node makes no write
    writes = api.writes["n1"]
    api.reset_counts()
    for _ in range(3):
        agent.run_pass()
    assert swappiness(host) == "60" and api.writes["n1"] == 0
    assert api.reads["n1"] == 3  # the Node read once a pass, at its start, and reused by the publish
    if via == "node-label":  # the label taken off: the agent enforces again
        api.edit_node("n1", {"metadata": {"labels": {PREFIX + "mode": None}}})
        assert agent.run_pass().mode == "enforce"  # in the next pass, not one later
        assert swappiness(host) == "0"


def test_node_label_cannot_raise_the_mode(api, kubeconfig, host):
    api.add_node("n1", labels={PREFIX + "mode": "enforce"})
    agent = make_agent(host, kubeconfig, "n1", mode="audit")
    settle(agent)
    assert agent.run_pass().mode == "audit" and swappiness(host) == "60"


# -- a GPU node whose GPUs the agent cannot see --------------------------------------------------
@pytest.mark.parametrize("node_kw", [
    {"labels": {"nvidia.com/gpu.present": "true"}},
    {"labels": {"feature.node.kubernetes.io/pci-10de.present": "true"}},
    {"capacity": {"nvidia.com/gpu": "8"}},
], ids=["gpu-operator-label", "nfd-label", "device-plugin-capacity"])
def test_gpu_node_with_no_visible_gpu_is_not_ready(api, kubeconfig, host, node_kw):
    api.add_node("n1", taints=[OURS], **node_kw)
    agent = make_agent(host, kubeconfig, "n1", mode="enforce")  # tuned, probe passed: only the GPUs are missing
    snap = settle(agent)
    assert not snap.verdict.ready
    (failed,) = snap.verdict.failed
    assert failed.name == "gpu.visible"
    for cause in ("runtimeClassName: nvidia", "NVIDIA_VISIBLE_DEVICES", "driver", "--gpu-backend none"):
        assert cause in failed.detail
    n = api.node("n1")
    assert condition(n)["reason"] == "GpusNotVisible"
    assert n["metadata"]["labels"][PREFIX + "gpu-count"] == "0"
    assert n["spec"]["taints"] == [OURS]  # never taken off, not even for one pass
    assert not any((b.get("metadata") or {}).get("labels", {}).get(PREFIX + "ready") == "true"
                   for _, _, _, b in api.bodies)


def test_node_without_gpu_signs_and_no_gpu_is_not_judged_on_gpus(api, kubeconfig, host):
    api.add_node("n1")
    agent = make_agent(host, kubeconfig, "n1", mode="enforce")
    snap = settle(agent)
    assert snap.verdict.ready and "gpu.visible" not in {c.name for c in snap.verdict.checks}


# -- one verdict: `gpu-tune label` judges as the agent does --------------------------------------
def test_label_judges_device_plugin_capacity_as_serve_does(api, kubeconfig, tmp_path):
    from tests.test_e2e import gpu_tune

    root = hostgen.build("dgx-8gpu", tmp_path / "host")
    fixture = tmp_path / "gpus.json"
    shutil.copy(GPU_FIXTURES / "dgx-8gpu.json", fixture)
    probes = [probe_verdict(str(i), probe_result()) for i in range(8)]
    assert save_probe_results(HostFS(root), "training", probes) is None
    api.add_node("n1", capacity={"nvidia.com/gpu": "7"})  # the device plugin offers 7 of 8
    out = gpu_tune("--root", str(root), "--gpu-backend", "fixture", "--gpu-fixture", str(fixture), "-o", "json",
                   "label", "--kubeconfig", kubeconfig, "--node", "n1")
    assert out.returncode in (0, 1), out.stderr
    doc = json.loads(out.stdout)
    by_name = {c["name"]: c for c in doc["checks"]}
    assert doc["ready"] is False and by_name["gpu.allocatable"]["ok"] is False
    assert "7 of 8 GPUs offered by the device plugin" in by_name["gpu.allocatable"]["detail"]
    assert "gpu.allocatable" in condition(api.node("n1"))["message"]

    api.add_node("n2", capacity={"nvidia.com/gpu": "7"})
    agent = make_agent(root, kubeconfig, "n2", mode="audit", probes=probes, gpu_backend="fixture",
                       gpu_fixture=str(fixture))
    snap = settle(agent)
    assert [c.name for c in snap.verdict.checks] == [c["name"] for c in doc["checks"]]
    assert [c.ok for c in snap.verdict.checks] == [c["ok"] for c in doc["checks"]]


# -- a stuck stage: one write, then none -----------------------------------------------------------
def agent_node_writes(api, since: int) -> list[tuple[str, str]]:
    """The agent's writes after ``since``, as the API server's audit log has them (the agent's
    client is told apart by its User-Agent: the test's own calls use the same admin user)."""
    api.cp.wait_audit_flushed()
    return [(ev["verb"], ev["requestURI"]) for ev in api.cp.writes_by("test-admin", since)
            if str(ev.get("userAgent", "")).startswith("gpu-tune/")]


def agent_node_reads(api, node: str, since: int) -> int:
    api.cp.wait_audit_flushed()
    return sum(1 for ev in api.cp.audit(since) if ev.get("verb") == "get"
               and ev.get("requestURI", "").startswith(f"/api/v1/nodes/{node}")
               and str(ev.get("userAgent", "")).startswith("gpu-tune/"))


@pytest.mark.parametrize("stage", ["audit", "discover"])
def test_a_stuck_stage_makes_no_node_write_after_the_first_pass(api, kubeconfig, host, stage):
    """A host file on a hung mount: the stage that reads it never returns. The first pass with it
    stuck publishes that (one write of each kind); the next passes, the stage still stuck and a
    second older each time, write nothing (the API server's audit log)."""
    api.add_node("n1")
    agent = make_agent(host, kubeconfig, "n1", mode="audit")
    agent.pass_deadline = 1.0
    gate = threading.Event()
    real = getattr(agent.stages, stage)

    def hung():
        gate.wait(120)
        return real()

    settle(agent)  # published: the node as it is, before the mount hangs
    setattr(agent.stages, stage, hung)
    try:
        mark = api.cp.audit_mark()
        first = agent.run_pass()
        summary = api.node("n1")["metadata"]["annotations"][PREFIX + "summary"]
        assert "stuck: did not return within the pass's deadline" in summary, summary
        assert first.mode == "audit" and agent_node_writes(api, mark), "the first stuck pass publishes it"
        mark = api.cp.audit_mark()
        for _ in range(3):
            time.sleep(1.1)  # the stuck stage a second older each pass
            snap = agent.run_pass()
            assert not {c.name: c for c in snap.collectors}[stage].success
    finally:
        gate.set()
    assert agent_node_reads(api, "n1", mark) >= 3  # three passes read the Node ...
    assert agent_node_writes(api, mark) == []      # ... and wrote nothing


# -- `gpu-tune label` decides as the agent does ------------------------------------------------------
def label_cli(root: Path, kubeconfig: str, node: str, *extra: str):
    from tests.test_e2e import gpu_tune

    return gpu_tune("--root", str(root), "--gpu-backend", "none", "-o", "json", "label", "--kubeconfig", kubeconfig,
                    "--node", node, *extra)


def test_label_never_taints_an_audited_node_and_the_agent_then_writes_nothing(api, kubeconfig, host):
    """`gpu-tune label` on a node the audit agent runs on: the node is not ready (untuned), and
    the label run publishes exactly what that agent publishes: no taint (audit never taints), so
    the agent's next pass writes nothing (no taint on, then off: no blink)."""
    probes = cpu_probe(12000.0)
    assert save_probe_results(HostFS(host), "training", probes) is None
    api.add_node("n1", taints=[FOREIGN])
    out = label_cli(host, kubeconfig, "n1")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["ready"] is False and doc["mode"] == "audit" and doc["want"]["taint"]["wanted"] == "absent"
    assert api.node("n1")["spec"]["taints"] == [FOREIGN]
    mark = api.cp.audit_mark()
    agent = make_agent(host, kubeconfig, "n1", mode="audit", probes=probes)
    settle(agent)
    assert agent_node_writes(api, mark) == []  # the agent and the label run want the same Node
    assert api.node("n1")["spec"]["taints"] == [FOREIGN]


def test_label_follows_the_nodes_mode_label_as_the_agent_does(api, kubeconfig, host):
    assert save_probe_results(HostFS(host), "training", cpu_probe(12000.0)) is None
    api.add_node("n1")
    out = label_cli(host, kubeconfig, "n1", "--mode", "enforce")  # as an enforcing agent: not ready, tainted
    assert out.returncode == 0, out.stderr
    assert api.node("n1")["spec"]["taints"] == [OURS]
    api.edit_node("n1", {"metadata": {"labels": {PREFIX + "mode": "audit"}}})  # a person: stop enforcing here
    out = label_cli(host, kubeconfig, "n1", "--mode", "enforce")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["mode"] == "audit"
    assert not api.node("n1")["spec"].get("taints")
    assert "gpu-tune.io/mode" in out.stderr  # said why


# -- mode revert asked of an agent that cannot revert ------------------------------------------------
def _tune_then_leave_to_an_audit_agent(api, kubeconfig, host):
    """An enforcing agent tunes the host; then the node's profile request goes (the audit agent
    replaces it; the host stays tuned) and a person labels it gpu-tune.io/mode=revert."""
    api.add_node("n1", taints=[FOREIGN])
    enforcing = make_agent(host, kubeconfig, "n1", mode="enforce")
    assert settle(enforcing).verdict.ready
    assert swappiness(host) == "0"
    api.edit_node("n1", {"metadata": {"labels": {PREFIX + "mode": "revert"}}})
    return make_agent(host, kubeconfig, "n1", mode="audit")


def test_an_audit_agent_never_reverts_and_says_what_is_left_and_who_can(api, kubeconfig, host):
    journal = host / "var/lib/gpu-tune/journal.json"
    auditor = _tune_then_leave_to_an_audit_agent(api, kubeconfig, host)
    before = journal.read_bytes()
    snap = settle(auditor)
    auditor.run_pass()
    assert snap.mode == "audit"
    assert swappiness(host) == "0" and journal.read_bytes() == before  # the host untouched
    cond = condition(api.node("n1"))
    assert cond["status"] == "False" and cond["reason"] == "RevertPending", cond
    msg = cond["message"]
    assert "runs in mode audit and never writes the host" in msg, msg
    journalled = len(json.loads(before)["entries"])
    assert f"{journalled} original(s) still to restore" in msg, msg
    detail = {c.name: c for c in auditor.state.snapshot.verdict.checks}["tuning.reverted"].detail
    from gpu_tune.tune import engine

    pending = engine.revert_pending(engine.make_context(HostFS(host), None))
    assert len(pending) == journalled and "sysctl.vm.swappiness" in {r.id for r in pending}
    first = pending[0]  # newest first, as a revert restores them
    assert f"{first.id}[{first.target}] " in detail and ", original " in detail, detail
    assert "an agent in mode enforce or revert on this node" in detail and "`gpu-tune revert`" in detail
    assert api.node("n1")["spec"]["taints"] == [FOREIGN]
    pod = TestClient(create_app(auditor.state)).get("/agent-ready").json()
    assert pod["mode"] == "audit" and "RevertPending" in pod["detail"], pod
    # steady: nothing written while it waits
    mark = api.cp.audit_mark()
    auditor.run_pass()
    assert agent_node_writes(api, mark) == []
    # someone reverts on the node: now every original is back, and only now it says Reverted
    ok, _ = engine.revert(engine.make_context(HostFS(host), None))
    assert ok and swappiness(host) == "60"
    auditor.run_pass()
    assert condition(api.node("n1"))["reason"] == "Reverted"


def test_label_on_a_node_labelled_revert_says_what_is_left_and_writes_no_host_file(api, kubeconfig, host):
    journal = host / "var/lib/gpu-tune/journal.json"
    _tune_then_leave_to_an_audit_agent(api, kubeconfig, host)
    assert save_probe_results(HostFS(host), "training", cpu_probe(12000.0)) is None
    before = journal.read_bytes()
    out = label_cli(host, kubeconfig, "n1", "--mode", "enforce")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["mode"] == "revert" and doc["want"]["condition"]["reason"] == "RevertPending", doc["want"]
    assert "gpu-tune label never writes the host" in doc["want"]["condition"]["message"]
    assert swappiness(host) == "0" and journal.read_bytes() == before
    assert condition(api.node("n1"))["reason"] == "RevertPending"


def test_reverted_only_when_every_original_is_back(api, kubeconfig, host):
    """An enforcing agent told to revert where one original cannot be written back: not
    ``Reverted`` but ``RevertFailed``, naming it; once it can be, ``Reverted``."""
    api.add_node("n1")
    agent = make_agent(host, kubeconfig, "n1", mode="enforce")
    assert settle(agent).verdict.ready
    target = host / "proc/sys/vm/swappiness"
    target.unlink()
    target.mkdir()  # a file that cannot be written back
    try:
        api.edit_node("n1", {"metadata": {"labels": {PREFIX + "mode": "revert"}}})
        snap = agent.run_pass()
        assert snap.mode == "revert"
        cond = condition(api.node("n1"))
        assert cond["reason"] == "RevertFailed" and "sysctl.vm.swappiness" in cond["message"], cond
    finally:
        target.rmdir()
        target.write_text("0\n")
    agent.run_pass()
    assert swappiness(host) == "60" and condition(api.node("n1"))["reason"] == "Reverted"
