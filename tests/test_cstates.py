"""cpu.cstates: idle states above the profile's exit-latency budget are disabled per CPU through
their ``disable`` files, journalled and reverted; the kernel command line is reported, never
changed; no cpuidle is unsupported; only the files needed are read."""

from __future__ import annotations

import base64

import pytest

from gpu_tune.tune.engine import apply, audit, make_context, revert
from gpu_tune.host.fs import HostFS
from gpu_tune.tune.journal import Journal
from gpu_tune.tune.knobs.base import Context
from gpu_tune.tune.knobs.cpu_cstates import CpuCstatesKnob
from gpu_tune.tune.profile import Profile
from gpu_tune.tune.policy import load_profile
from tests.conftest import snapshot_tree

CPU = "sys/devices/system/cpu"


def prof(budget: int, **kw) -> Profile:
    return Profile(name="t", cpu={"cstates": {"max_latency_us": budget}}, **kw)


def rows_of(root, profile):
    return [r for r in audit(make_context(HostFS(root), profile, None)).settings if r.id == "cpu.cstates"]


def test_shipped_budgets():
    assert load_profile("training").cpu.cstates.max_latency_us == 100
    assert load_profile("inference").cpu.cstates.max_latency_us == 10


def test_sapphire_rapids_c6_is_above_both_budgets(make_host):
    root = make_host("two-socket-224")  # POLL 0, C1 1, C1E 2, C6 290 µs
    for name in ("training", "inference"):
        rows = rows_of(root, load_profile(name))
        assert len(rows) == 224 and [r.target for r in rows] == [f"cpu{i}" for i in range(224)]
        budget = load_profile(name).cpu.cstates.max_latency_us
        assert {(r.current, r.desired, r.status) for r in rows} == {("C6 (290 µs)", f"≤ {budget} µs", "drift")}
        assert rows[0].detail == "enabled above the budget: apply disables them"
    rows = rows_of(root, prof(1))
    assert {r.current for r in rows} == {"C1E (2 µs), C6 (290 µs)"}


def test_apply_disables_only_the_deep_states_and_revert_restores_byte_for_byte(make_host):
    root = make_host("small-2cpu")
    before = snapshot_tree(root)
    p = prof(1)
    rep = apply(make_context(HostFS(root), p, None))
    rows = [r for r in rep.settings if r.id == "cpu.cstates"]
    assert [(r.current, r.status, r.changed) for r in rows] == [("C1E, C6 disabled", "ok", True)] * 2
    for cpu in (0, 1):
        flags = [(root / f"{CPU}/cpu{cpu}/cpuidle/state{k}/disable").read_text() for k in range(4)]
        assert flags == ["0\n", "0\n", "1", "1"]
    entry = next(e for e in Journal(HostFS(root)).load().entries if e["id"] == "cpu.cstates")
    assert entry["family"] == "cstates" and entry["value"] == "C1E (2 µs), C6 (290 µs)"
    assert [(f["state"], f["path"], f["value"]) for f in entry["files"]] == [
        ("C1E", "/sys/devices/system/cpu/cpu0/cpuidle/state2/disable", "0"),
        ("C6", "/sys/devices/system/cpu/cpu0/cpuidle/state3/disable", "0")]
    assert base64.b64decode(entry["files"][0]["raw"]) == b"0\n"
    # a second apply changes nothing and journals nothing more
    again = apply(make_context(HostFS(root), p, None))
    assert not any(r.changed for r in again.settings if r.id == "cpu.cstates")
    ok, restored = revert(Context(fs=HostFS(root), profile=None))
    cst = [r for r in restored if r.id == "cpu.cstates"]
    assert ok and [(r.current, r.desired) for r in cst] == [("C1E disabled, C6 disabled", "C1E (2 µs), C6 (290 µs)")] * 2
    assert snapshot_tree(root) == before


def test_states_disabled_by_someone_else_are_ok_and_not_journalled(make_host):
    root = make_host("small-2cpu")
    for cpu in (0, 1):
        (root / f"{CPU}/cpu{cpu}/cpuidle/state3/disable").write_text("1\n")
    rep = apply(make_context(HostFS(root), prof(100), None))
    rows = [r for r in rep.settings if r.id == "cpu.cstates"]
    assert {(r.current, r.status, r.changed) for r in rows} == {("C6 disabled", "ok", False)}
    assert not [e for e in Journal(HostFS(root)).load().entries if e["id"] == "cpu.cstates"]


def test_a_vm_with_haltpoll_has_nothing_above_the_budget(make_host):
    root = make_host("vm-virtio")  # POLL 0 µs, "haltpoll idle" 1 µs (a real KVM guest)
    rows = rows_of(root, load_profile("inference"))
    assert [(r.target, r.current, r.status, r.detail) for r in rows] == [
        (f"cpu{i}", "haltpoll idle (1 µs)", "ok", "no state above the budget") for i in (0, 1)]


def test_no_cpuidle_is_unsupported(make_host):
    root = make_host("vm-no-cpufreq")
    rows = rows_of(root, load_profile("training"))
    assert len(rows) == 8 and {r.status for r in rows} == {"unsupported"}
    assert "no cpuidle driver" in rows[0].detail
    root = make_host("small-2cpu")
    (root / f"{CPU}/cpuidle/current_driver").write_text("none\n")
    assert {r.status for r in rows_of(root, prof(10))} == {"unsupported"}


def test_one_cpu_without_cpuidle(make_host):
    import shutil

    root = make_host("small-2cpu")
    shutil.rmtree(root / f"{CPU}/cpu1/cpuidle")
    rows = rows_of(root, prof(10))
    assert [(r.target, r.status) for r in rows] == [("cpu0", "drift"), ("cpu1", "unsupported")]
    assert "no cpuidle for this CPU" in rows[1].detail


def test_a_missing_disable_file_is_unsupported_an_unreadable_one_an_error(make_host):
    root = make_host("small-2cpu")
    (root / f"{CPU}/cpu1/cpuidle/state3/disable").unlink()
    (root / f"{CPU}/cpu0/cpuidle/state3/disable").unlink()
    (root / f"{CPU}/cpu0/cpuidle/state3/disable").mkdir()
    rows = rows_of(root, prof(10))
    assert [(r.target, r.status) for r in rows] == [("cpu0", "error"), ("cpu1", "unsupported")]
    assert "no such file" in rows[1].detail


def test_kernel_command_line_is_reported_never_changed(make_host):
    import shutil

    root = make_host("small-2cpu")
    cmdline = "BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro intel_idle.max_cstate=1 processor.max_cstate=1\n"
    (root / "proc/cmdline").write_text(cmdline)
    for cpu in (0, 1):  # with max_cstate=1 intel_idle registers POLL and C1 only
        for k in (2, 3):
            shutil.rmtree(root / f"{CPU}/cpu{cpu}/cpuidle/state{k}")
    rows = [r for r in apply(make_context(HostFS(root), prof(10), None)).settings if r.id == "cpu.cstates"]
    assert {(r.current, r.status) for r in rows} == {("C1 (1 µs)", "ok")}
    assert rows[0].detail == ("no state above the budget; kernel command line: intel_idle.max_cstate=1 "
                              "processor.max_cstate=1 (reported, not changed)")
    assert (root / "proc/cmdline").read_text() == cmdline
    # with a looser command line the states are there and are disabled; the command line stays
    root2 = make_host("small-2cpu")
    (root2 / "proc/cmdline").write_text("ro intel_idle.max_cstate=6\n")
    rows = [r for r in apply(make_context(HostFS(root2), prof(10), None)).settings if r.id == "cpu.cstates"]
    assert {(r.status, r.changed) for r in rows} == {("ok", True)}
    assert rows[0].detail == "kernel command line: intel_idle.max_cstate=6 (reported, not changed)"
    assert (root2 / "proc/cmdline").read_text() == "ro intel_idle.max_cstate=6\n"


def test_per_cpu_drivers_read_states_per_cpu(make_host):
    """CONFIG_CPU_IDLE_MULTIPLE_DRIVERS (big.LITTLE): each CPU has its own driver and states."""
    root = make_host("small-2cpu")
    for cpu in (0, 1):
        (root / f"{CPU}/cpu{cpu}/cpuidle/driver").mkdir()
        (root / f"{CPU}/cpu{cpu}/cpuidle/driver/name").write_text("psci_idle\n")
    (root / f"{CPU}/cpu1/cpuidle/state3/latency").write_text("5\n")  # a core with a shallow deepest state
    rows = rows_of(root, prof(10))
    assert [(r.target, r.current, r.status) for r in rows] == [
        ("cpu0", "C6 (290 µs)", "drift"), ("cpu1", "C6 (5 µs)", "ok")]


def test_unreadable_state_is_an_error_row_not_a_crash(make_host):
    root = make_host("small-2cpu")
    (root / f"{CPU}/cpu0/cpuidle/state3/latency").write_text("soon\n")
    rep = audit(make_context(HostFS(root), prof(10), None))
    rows = [r for r in rep.settings if r.id == "cpu.cstates"]
    assert [(r.target, r.status) for r in rows] == [("-", "error")] and "state3" in rows[0].detail
    assert not rep.compliant


def test_reads_only_what_it_needs(make_host, monkeypatch):
    """Names and latencies once (4 states), then one disable file per CPU (C6): 8 + 224 reads."""
    root = make_host("two-socket-224")
    fs = HostFS(root)
    seen: list[str] = []
    orig = fs.read_text

    def counting(path, **kw):
        if "/cpuidle/" in path:
            seen.append(path)
        return orig(path, **kw)

    monkeypatch.setattr(fs, "read_text", counting)
    rows = CpuCstatesKnob().read(Context(fs=fs, profile=prof(100)))
    assert len(rows) == 224
    assert len([p for p in seen if p.endswith("/disable")]) == 224
    assert len([p for p in seen if p.endswith(("/name", "/latency"))]) == 8
    assert len(seen) == 8 + 224 + 1  # + current_driver


@pytest.mark.parametrize("body,needle", [
    ("cpu:\n  cstates: {max_latency_us: -1}\n", "cpu.cstates.max_latency_us"),
    ("cpu:\n  cstates: {max_latency: 10}\n", "cpu.cstates.max_latency: unknown key"),
    ("cpu:\n  cstates: 10\n", "cpu.cstates"),
])
def test_bad_budget_is_input_error(tmp_path, body, needle):
    from gpu_tune.errors import InputError

    (tmp_path / "p.yaml").write_text("name: p\n" + body)
    with pytest.raises(InputError) as ei:
        load_profile("p", tmp_path)
    assert needle in str(ei.value) and "\n" not in str(ei.value)
