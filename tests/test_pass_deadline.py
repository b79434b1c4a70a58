"""The agent's pass has a deadline: one stage that never returns (a read on a hung mount, a GPU
driver or an API server that does not answer) makes that pass report it as a failed stage,
never stops the loop, ``/healthz`` or SIGTERM, and never piles up stuck threads; a host file
that is a FIFO is an error row in the agent's audit, pass after pass."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from fastapi.testclient import TestClient

from gpu_tune.cluster.node_state import node_want

from gpu_tune.serve.agent import Agent
from gpu_tune.serve.app import create_app
from tests.conftest import REPO
from tests.test_service import World, _get, collectors


def _stage_threads(name: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name == f"gpu-tune-stage-{name}" and t.is_alive())


# How long a stuck stage stays stuck: far longer than any deadline here (a second or two), so a
# pass or a stop that waited for it takes minutes, and one that did not passes on a busy machine.
STUCK = 600.0


def test_a_stuck_stage_fails_its_pass_and_is_not_started_again_until_it_returns():
    world = World()
    gate = threading.Event()
    real = world.discover

    def discover():
        if not gate.is_set():
            gate.wait(STUCK)
        return real()

    st = world.stages()
    st.discover = discover
    agent = Agent(st, interval=0.1, pass_deadline=0.3, probe_enabled=False)
    try:
        t0 = time.monotonic()
        snap = agent.run_pass()
        assert time.monotonic() - t0 < STUCK / 10  # the deadline (at least 1 s per stage), not the stage's wait
        c = collectors(snap)["discover"]
        assert not c.success and c.error.startswith("stuck: did not return within the pass's deadline")
        first_error = c.error
        assert collectors(snap)["audit"].success and world.calls["publish"] == 1  # the rest went on
        assert any("discover" in ch.name or "stuck: did not return" in ch.detail for ch in snap.verdict.checks
                   if not ch.ok)
        # later passes say so at once and start no second worker: with a deadline as long as the
        # stuck stage's wait, a pass that waited for it again would take that long
        agent.pass_deadline = STUCK
        for _ in range(5):
            t0 = time.monotonic()
            snap = agent.run_pass()
            assert time.monotonic() - t0 < STUCK / 10
            assert collectors(snap)["discover"].error == first_error  # the same words: see below
        assert _stage_threads("discover") == 1
    finally:
        gate.set()
    deadline = time.monotonic() + 10
    while _stage_threads("discover") and time.monotonic() < deadline:
        time.sleep(0.05)
    snap = agent.run_pass()
    assert collectors(snap)["discover"].success  # it returned: started again, and fine


@pytest.mark.parametrize("stage", ["discover", "gpus", "audit", "identity"])
def test_a_stuck_stage_publishes_the_same_node_state_in_every_pass(stage):
    """What is published (labels, annotations, the condition) is the same from the first pass with
    the stuck stage on: a figure that moves (how long ago it started) would make every pass a Node
    write (tests/test_agent_modes.py counts them on a real API server)."""
    world = World()
    gate = threading.Event()
    real = getattr(world, stage)

    def stuck():
        if not gate.is_set():
            gate.wait(STUCK)
        return real()

    st = world.stages()
    seen = []

    def publish(v, topology, gpus, driver, *, audit=None, probes=None, mode="enforce"):
        seen.append(node_want(v, profile=world.profile, mode=mode, topology=topology, gpus=gpus,
                              driver_version=driver, audit=audit, probes=probes))
        return world.publish(v, topology, gpus, driver, audit=audit, probes=probes, mode=mode)

    st.publish = publish
    setattr(st, stage, stuck)
    agent = Agent(st, mode="audit", interval=0.1, pass_deadline=0.3, probe_enabled=False)
    try:
        agent.run_pass()  # the stage started, and left behind at the deadline
        for _ in range(3):
            time.sleep(1.1)  # its age moves on by a second each pass
            snap = agent.run_pass()
            assert stage == "identity" or not collectors(snap)[stage].success
    finally:
        gate.set()
    assert len(seen) == 4
    assert [w.as_dict() for w in seen[1:]] == [seen[0].as_dict()] * 3


def test_healthz_stays_200_and_stop_is_prompt_while_a_stage_is_stuck():
    world = World()
    gate = threading.Event()
    st = world.stages()
    st.audit = lambda: gate.wait(STUCK)
    agent = Agent(st, interval=0.2, pass_deadline=0.4, probe_enabled=False, jitter=0.0)
    client = TestClient(create_app(agent.state))
    agent.start()
    try:
        passes_before = None
        deadline = time.monotonic() + STUCK / 10
        # the loop keeps passing (each pass waits out the stuck stage's deadline, a second or more),
        # and /healthz answers 200 all the while
        while passes_before is None or agent.state.passes < passes_before + 3:
            assert time.monotonic() < deadline, f"{agent.state.passes} passes, {passes_before} at the first /healthz"
            time.sleep(0.25)
            r = client.get("/healthz")
            assert r.status_code == 200, r.text
            if passes_before is None and agent.state.passes:
                passes_before = agent.state.passes
        body = client.get("/readiness").json()
        assert not body["ready"] and "audit" in json.dumps(body)
        assert _stage_threads("audit") == 1
        t0 = time.monotonic()
        agent.stop(timeout=STUCK / 2)
        assert time.monotonic() - t0 < STUCK / 10  # did not wait for the stuck stage's thread
    finally:
        gate.set()


STUCK_SERVE = r"""
import json, sys, threading
sys.path.insert(0, {repo!r})
from gpu_tune.serve.options import ServeOptions
from gpu_tune.serve.server import serve
from tests.test_service import World
world = World()
st = world.stages()
st.audit = lambda: threading.Event().wait()   # never returns
opts = ServeOptions(host="127.0.0.1", port=0, interval=1.0)
def ready(port):
    print(json.dumps({{"port": port}}), flush=True)
sys.exit(serve(opts, stages=st, ready_callback=ready))
"""


def test_serve_with_a_stuck_stage_answers_and_exits_on_sigterm():
    proc = subprocess.Popen([sys.executable, "-c", STUCK_SERVE.format(repo=str(REPO))], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=REPO, text=True)
    try:
        port = json.loads(proc.stdout.readline())["port"]
        # the first pass waits out its deadline (2 x 1 s + 5 s), then passes follow every second
        deadline = time.monotonic() + 120
        passes = []
        while time.monotonic() < deadline and len(passes) < 3:
            code, body = _get(port, "/healthz")
            assert code == 200, body
            doc = json.loads(body)
            if doc["detail"].startswith("last pass"):
                passes.append(doc["detail"])
            time.sleep(1.0)
        assert len(passes) >= 3, passes
        code, body = _get(port, "/readiness")
        assert code == 503 and b"audit" in body
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(STUCK / 10)  # the stuck stage never returns: an exit that waited for it never comes
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, proc.stderr.read()


FIFO_SERVE = r"""
import json, sys
sys.path.insert(0, {repo!r})
from gpu_tune.serve.options import ServeOptions
from gpu_tune.serve.server import serve
from gpu_tune.serve.stages import default_stages
opts = ServeOptions(root={root!r}, gpu_backend="none", host="127.0.0.1", port=0, interval=1.0, no_kube=True,
                    node="node-a")
st = default_stages(opts)
st.probe = lambda topology, previous: []   # no TensorFlow here
def ready(port):
    print(json.dumps({{"port": port}}), flush=True)
sys.exit(serve(opts, stages=st, ready_callback=ready))
"""


def test_serve_with_fifos_at_host_files_reports_them_pass_after_pass(make_host):
    root = make_host("small-2cpu")
    for p in ("proc/sys/vm/swappiness", "proc/cmdline"):
        os.unlink(root / p)
        os.mkfifo(root / p)
    proc = subprocess.Popen([sys.executable, "-c", FIFO_SERVE.format(repo=str(REPO), root=str(root))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, text=True)
    try:
        port = json.loads(proc.stdout.readline())["port"]
        deadline = time.monotonic() + 30
        rows = []
        while time.monotonic() < deadline:
            code, body = _get(port, "/audit")
            if code == 200:
                rows = json.loads(body)["settings"]
                break
            time.sleep(0.2)
        errors = {r["id"]: r["detail"] for r in rows if r["status"] == "error"}
        assert "is a FIFO" in errors.get("sysctl.vm.swappiness", ""), rows
        assert any("/proc/cmdline: is a FIFO" in d for d in errors.values()), errors
        deadline = time.monotonic() + 60  # a pass completes with the FIFOs in place (a condition, not a time)
        while True:
            code, body = _get(port, "/healthz")
            assert code == 200, body
            if json.loads(body)["detail"].startswith("last pass"):
                break
            assert time.monotonic() < deadline, body
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, proc.stderr.read()
