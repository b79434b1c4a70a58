"""Evidence through the agent's own pass (docs/health.md "Evidence"): the real stages over the 8-GPU
fixture host, ``/readiness``'s ``evidence``, one bundle per fault across passes and a restart,
``nvidia-bug-report.sh`` (a slow stand-in) never waited for and its worker reaped by a later pass,
and the Events on the real API server (tests/realkube's control plane) naming the bundle."""

from __future__ import annotations

import json
from pathlib import Path

from gpu_tune.serve.agent import Agent
from gpu_tune.serve.options import ServeOptions
from gpu_tune.serve.stages import default_stages
from tests.evidence_kit import FOLDER, add_kmsg, bundles, standin, status, this_machine, wait_done, xid
from tests.fixtures.probes import probe_result, probe_verdict
from tests.healthkit import GPU_FIXTURE, dgx_tree, host, policies  # noqa: F401 (fixtures)
from tests.realkube.testapi import write_kubeconfig

NODE = "gpu-evidence-0"


def agent(root: Path, policies: Path, **kw) -> Agent:
    """The agent over ``root``; with ``kw`` (a cluster), a stand-in probe's verdicts (not
    TensorFlow) and settled: its first pass, the probe, the pass that publishes."""
    opts = ServeOptions(root=str(root), gpu_backend="fixture", gpu_fixture=str(GPU_FIXTURE), policy_dir=str(policies),
                        profile="health", **({"no_kube": True} if not kw else kw))
    st = default_stages(opts)
    if not kw:
        return Agent(st, probe_enabled=False)
    st.probe = lambda topology, previous: [probe_verdict(str(i), probe_result()) for i in range(8)]
    a = Agent(st)
    a._started_at = a.monotonic()
    a.run_pass()
    a.run_probe_once()
    return a


def readiness(a: Agent) -> dict:
    return json.loads(a.run_pass().readiness_body)


def test_the_agents_pass_keeps_one_bundle_across_passes_and_a_restart_and_never_waits(host, tmp_path, policies,
                                                                                       monkeypatch):
    this_machine(host)
    go = tmp_path / "go"
    for k, v in standin(tmp_path, "slow", STANDIN_GO=str(go)).items():
        monkeypatch.setenv(k, v)
    a = agent(host, policies)
    doc = readiness(a)
    assert "evidence" not in doc  # healthy (but for the probe this agent does not run): nothing said
    assert not (host / FOLDER).exists()
    add_kmsg(host, xid(90, 88_310_022))
    doc = readiness(a)
    assert not doc["ready"] and doc["reason"] == "FatalXid"
    [b] = doc["evidence"]["bundles"]
    assert b["new"] and b["findings"] == ["xid/0000:5d:00/79"] and bundles(host) == [b["name"]]
    # the pass is over while the stand-in still waits for a file only this test writes
    assert status(host, b["name"])["state"] in ("starting", "running")
    worker = int(doc["evidence"]["bug_report"].split("worker pid ")[1].split(")")[0])

    doc = readiness(a)  # the same finding: nothing new
    assert doc["evidence"]["bundles"] == [{**b, "new": False}] and bundles(host) == [b["name"]]
    go.touch()
    st = wait_done(host, b["name"])
    assert st["state"] == "finished" and st["left"] == 0
    readiness(a)  # the next pass reaps its worker
    assert not Path(f"/proc/{worker}").exists(), "the worker was not reaped by the next pass"
    a.stages.close()

    again = agent(host, policies)  # a restart: the health state's mark holds
    doc = readiness(again)
    assert doc["evidence"]["bundles"] == [{**b, "new": False}] and bundles(host) == [b["name"]]
    again.stages.close()


def test_the_events_name_the_bundle(api, host, tmp_path, policies):
    api.add_node(NODE)
    kc = str(write_kubeconfig(tmp_path / "kc", api.url))
    a = agent(host, policies, kubeconfig=kc, node=NODE)
    try:
        doc = readiness(a)
        assert doc["ready"] and "evidence" not in doc, doc["message"]
        add_kmsg(host, xid(90, 88_310_022))
        doc = readiness(a)
        first = doc["evidence"]["bundles"][0]["path"]
        events = api.events_for(NODE)
        down = [e for e in events if e["reason"] == "GPUHostNotReady"]
        assert len(down) == 1 and down[0]["message"].startswith(f"evidence: {first}; FatalXid: "), down

        add_kmsg(host, xid(91, 95_000_000, "18"))  # another fault, the condition already False
        doc = readiness(a)
        new = next(b["path"] for b in doc["evidence"]["bundles"] if b["new"])
        more = [e for e in api.events_for(NODE) if e["reason"] == "GPUHostEvidence"]
        assert len(more) == 1 and new in more[0]["message"] and more[0]["type"] == "Warning", more

        n = len(api.events_for(NODE))
        readiness(a)  # nothing new: no Event
        assert len(api.events_for(NODE)) == n
    finally:
        a.stages.close()


def test_a_healthy_agent_never_imports_the_evidence_code(host, policies):
    """The agent's memory does not grow with evidence until a fault appears (imported lazily)."""
    import subprocess
    import sys

    from tests.conftest import REPO

    script = (
        "import sys\n"
        "from gpu_tune.serve.agent import Agent\n"
        "from gpu_tune.serve.options import ServeOptions\n"
        "from gpu_tune.serve.stages import default_stages\n"
        f"opts = ServeOptions(root={str(host)!r}, gpu_backend='fixture', gpu_fixture={str(GPU_FIXTURE)!r}, "
        f"no_kube=True, policy_dir={str(policies)!r}, profile='health')\n"
        "a = Agent(default_stages(opts), probe_enabled=False)\n"
        "a.run_pass(); a.run_pass()\n"
        "print(sorted(m for m in sys.modules if m.startswith(('gpu_tune.judge.evidence.', 'gpu_tune.host.fs_tree'))))\n"
        f"open({str(host / 'dev/kmsg')!r}, 'a').write({xid(90, 88_310_022)!r})\n"
        "a.run_pass()\n"
        "print(sorted(m for m in sys.modules if m.startswith(('gpu_tune.judge.evidence.', 'gpu_tune.host.fs_tree'))))\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env={"PYTHONPATH": str(REPO),
                       "PATH": "/usr/bin:/bin"}, timeout=300)
    assert r.returncode == 0, r.stderr
    healthy, faulty = r.stdout.splitlines()
    assert healthy == "[]", healthy
    assert "gpu_tune.judge.evidence.keeper" in faulty
