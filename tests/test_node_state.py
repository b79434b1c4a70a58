"""One decision of what a Node carries (gpu_tune/cluster/node_state.py), for the agent and for
`gpu-tune label`: the mode a Node's gpu-tune.io/mode label leaves, the taint per mode, and the
condition's reason in mode revert (``Reverted`` only once every original is back)."""

from __future__ import annotations

import pytest

from gpu_tune.cluster.node_state import choose_mode, node_want
from gpu_tune.judge.readiness import reverted_check, verdict
from gpu_tune.tune.profile import Profile


@pytest.mark.parametrize("own, label, mode, judged", [
    ("enforce", None, "enforce", "enforce"),
    ("enforce", "audit", "audit", "audit"),
    ("enforce", "revert", "revert", "revert"),
    ("enforce", "enforce", "enforce", "enforce"),  # not a mode a label may ask for: ignored
    ("revert", "audit", "audit", "audit"),          # writes less: obeyed
    ("revert", None, "revert", "revert"),
    ("audit", "revert", "audit", "revert"),         # writes more: not obeyed, judged
    ("audit", "enforce", "audit", "audit"),
    ("audit", "bogus", "audit", "audit"),
    ("audit", "audit", "audit", "audit"),
])
def test_the_label_only_lowers_what_is_written(own, label, mode, judged):
    c = choose_mode(own, label)
    assert (c.mode, c.judged) == (mode, judged)
    assert c.revert_read_only is (judged == "revert" and mode != "revert")
    assert (c.note is None) is (label is None)


def test_a_revert_asked_of_a_read_only_run_says_it_is_not_carried_out():
    note = choose_mode("audit", "revert", who="gpu-tune label").note
    assert "gpu-tune label runs in mode audit and never writes the host" in note


PROFILE = Profile(name="training")  # readiness.taint true by default


def _not_ready(mode: str, **kw):
    v = verdict(profile=PROFILE, audit={"settings": [{"id": "sysctl.vm.swappiness", "target": "host",
                                                      "current": "60", "desired": "0", "status": "drift"}]},
                gpus=[], probes=[{"gpu": "cpu", "status": "passed", "passed": True}], mode=mode, **kw)
    assert not v.ready
    return v


@pytest.mark.parametrize("mode, taint", [("enforce", True), ("audit", False), ("revert", False)])
def test_only_enforce_taints_a_node_that_is_not_ready(mode, taint):
    want = node_want(_not_ready(mode), profile=PROFILE, mode=mode, topology={}, gpus=[], driver_version=None)
    assert want.taint_wanted is taint


REVERTED = {"ok": True, "settings": [{"id": "sysctl.vm.swappiness", "target": "host", "status": "ok"}]}
FAILED = {"ok": False, "settings": [{"id": "sysctl.vm.swappiness", "target": "host", "status": "error",
                                     "detail": "not restored: Read-only file system"}]}
PENDING = {"ok": False, "read_only": True, "by": "this agent runs in mode audit and never writes the host",
           "settings": [{"id": "sysctl.vm.swappiness", "target": "host", "status": "drift", "current": "0",
                         "desired": "60"}]}
NOTHING_LEFT = {"ok": True, "read_only": True, "by": "this agent runs in mode audit and never writes the host",
                "settings": []}


@pytest.mark.parametrize("revert, error, reason", [
    (REVERTED, None, "Reverted"),
    ({"ok": True, "settings": []}, None, "Reverted"),  # nothing was recorded: nothing to restore
    (NOTHING_LEFT, None, "Reverted"),
    (FAILED, None, "RevertFailed"),
    (PENDING, None, "RevertPending"),
    (None, None, "RevertPending"),
    (None, "JournalError: not this tool's", "RevertFailed"),
])
def test_reverted_only_when_every_original_is_back(revert, error, reason):
    check = reverted_check(revert, error=error)
    assert not check.ok
    v = _not_ready("revert", revert=revert, errors={"revert": error} if error else None)
    assert v.reason() == reason
    want = node_want(v, profile=PROFILE, mode="audit", topology={}, gpus=[], driver_version=None)
    assert want.condition["reason"] == reason and want.taint_wanted is False


def test_what_is_left_and_who_can_do_it():
    c = reverted_check(PENDING)
    assert c.detail.startswith("mode revert asked for, but this agent runs in mode audit and never writes the "
                               "host: 1 original(s) still to restore (sysctl.vm.swappiness[host] 0, original 60)")
    assert "an agent in mode enforce or revert on this node" in c.detail and "`gpu-tune revert`" in c.detail
    failed = reverted_check(FAILED)
    assert "could not be restored" in failed.detail and "Read-only file system" in failed.detail
