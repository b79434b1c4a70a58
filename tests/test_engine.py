"""audit / apply / revert on fixture trees in the kernel's layout (in-process)."""

from __future__ import annotations

import subprocess

import pytest

from gpu_tune.tune.engine import apply, audit, make_context, plan, revert
from gpu_tune.errors import InputError
from gpu_tune.host.fs import HostFS
from gpu_tune.tune.journal import JOURNAL, Journal
from gpu_tune.tune.knobs.base import Context
from gpu_tune.tune.policy import load_profile
from tests import skips
from tests.conftest import snapshot_tree

CORE = """name: core
sysctl:
  vm.swappiness: 0
  vm.dirty_ratio: 15
thp:
  enabled: always
  defrag: always
cpu:
  governor: [performance, schedutil]
"""


@pytest.fixture
def core_profile(tmp_path):
    d = tmp_path / "policies"
    d.mkdir()
    (d / "core.yaml").write_text(CORE)
    return load_profile("core", d)


def ctx_for(root, profile):
    return make_context(HostFS(root), profile, None)


def rows_by(report):
    return {(r.id, r.target): r for r in report.settings}


def test_audit_two_socket_reads_every_cpu(make_host, core_profile):
    root = make_host("two-socket-224")
    rep = audit(ctx_for(root, core_profile))
    rows = rows_by(rep)
    assert rows[("sysctl.vm.swappiness", "host")].current == "60"
    assert rows[("sysctl.vm.swappiness", "host")].status == "drift"
    assert rows[("thp.enabled", "host")].current == "madvise"
    gov = [r for r in rep.settings if r.id == "cpu.governor"]
    assert len(gov) == 224 and {r.target for r in gov} == {f"cpu{i}" for i in range(224)}
    assert all(r.current == "schedutil" and r.desired == "performance" and r.status == "drift" for r in gov)
    assert not rep.compliant
    assert len(plan(rep.settings)) == 2 + 2 + 224


def test_apply_then_audit_compliant_then_revert_byte_for_byte(make_host, core_profile):
    root = make_host("two-socket-224")
    before = snapshot_tree(root)
    rep = apply(ctx_for(root, core_profile))
    assert rep.compliant, [r for r in rep.settings if r.status != "ok"]
    assert all(r.changed for r in rep.settings)
    assert (root / "proc/sys/vm/swappiness").read_text() == "0"
    assert (root / "sys/kernel/mm/transparent_hugepage/enabled").read_text() == "always"
    assert audit(ctx_for(root, core_profile)).compliant
    # a second apply changes nothing and records nothing new
    j1 = (root / JOURNAL.lstrip("/")).read_text()
    rep2 = apply(ctx_for(root, core_profile))
    assert rep2.compliant and not any(r.changed for r in rep2.settings)
    assert (root / JOURNAL.lstrip("/")).read_text() == j1
    ok, rows = revert(Context(fs=HostFS(root), profile=None))
    assert ok and len(rows) == 228
    assert snapshot_tree(root) == before
    # newest first
    seqs = [r.id for r in rows]
    assert seqs[0] == "cpu.governor" and seqs[-1] == "sysctl.vm.swappiness"
    assert Journal(HostFS(root)).load().entries == []


def test_second_apply_never_records_its_own_value(make_host, core_profile):
    root = make_host("small-2cpu")
    before = snapshot_tree(root)
    apply(ctx_for(root, core_profile))
    # someone changes the value behind our back; a second apply puts ours back ...
    (root / "proc/sys/vm/swappiness").write_text("33\n")
    rep = apply(ctx_for(root, core_profile))
    assert rows_by(rep)[("sysctl.vm.swappiness", "host")].changed
    entries = Journal(HostFS(root)).load().entries
    sw = [e for e in entries if e["id"] == "sysctl.vm.swappiness"]
    assert len(sw) == 1 and sw[0]["value"] == "60"  # ... and the first original stays
    revert(Context(fs=HostFS(root), profile=None))
    assert snapshot_tree(root) == before


def test_dry_run_changes_nothing(make_host, core_profile):
    root = make_host("small-2cpu")
    before = snapshot_tree(root)
    rep = apply(ctx_for(root, core_profile), dry=True)
    assert not rep.compliant
    drift = [r for r in rep.settings if r.status == "drift"]
    assert drift and all(r.changed is False and "would change" in r.detail for r in drift)
    assert snapshot_tree(root) == before
    assert not (root / "var/lib/gpu-tune").exists()


def test_vm_without_cpufreq_is_unsupported_not_drift(make_host, core_profile):
    root = make_host("vm-no-cpufreq")
    rep = apply(ctx_for(root, core_profile))
    gov = [r for r in rep.settings if r.id == "cpu.governor"]
    assert len(gov) == 8 and all(r.status == "unsupported" and "no cpufreq" in r.detail for r in gov)
    assert rep.compliant  # unsupported does not make a host non-compliant


def test_thp_fixed_on_cmdline_is_not_fought(make_host, core_profile):
    root = make_host("thp-cmdline")
    before = (root / "sys/kernel/mm/transparent_hugepage/enabled").read_bytes()
    rep = apply(ctx_for(root, core_profile))
    row = rows_by(rep)[("thp.enabled", "host")]
    assert row.status == "unsupported" and "transparent_hugepage=never" in row.detail
    assert not row.changed
    assert (root / "sys/kernel/mm/transparent_hugepage/enabled").read_bytes() == before
    # defrag is not fixed by the command line: it is applied
    assert rows_by(rep)[("thp.defrag", "host")].status == "ok"


def test_intel_pstate_falls_back_and_reports_missing_governor(make_host, tmp_path):
    root = make_host("thp-cmdline")  # intel_pstate: performance powersave
    d = tmp_path / "p"
    d.mkdir()
    (d / "a.yaml").write_text("name: a\ncpu:\n  governor: [schedutil, performance]\n")
    (d / "b.yaml").write_text("name: b\ncpu:\n  governor: [schedutil, ondemand]\n")
    rows = audit(ctx_for(root, load_profile("a", d))).settings
    assert {r.desired for r in rows} == {"performance"}
    rows = audit(ctx_for(root, load_profile("b", d))).settings
    assert all(r.status == "unsupported" and "performance powersave" in r.detail for r in rows)


def test_missing_and_directory_targets(make_host, tmp_path):
    root = make_host("small-2cpu")
    d = tmp_path / "p"
    d.mkdir()
    (d / "m.yaml").write_text("name: m\nsysctl:\n  vm.nonexistent_knob: 1\n  vm.dirty_ratio: 15\n")
    (root / "proc/sys/vm/dirty_ratio").unlink()
    (root / "proc/sys/vm/dirty_ratio").mkdir()
    rep = apply(ctx_for(root, load_profile("m", d)))
    rows = rows_by(rep)
    assert rows[("sysctl.vm.nonexistent_knob", "host")].status == "unsupported"
    assert rows[("sysctl.vm.dirty_ratio", "host")].status == "error"
    assert "is a directory" in rows[("sysctl.vm.dirty_ratio", "host")].detail


def _make_readonly(path):
    r = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
    return r.returncode == 0


def test_read_only_target_is_an_error_row_and_the_rest_applies(make_host, core_profile):
    root = make_host("small-2cpu")
    target = root / "proc/sys/vm/swappiness"
    if not _make_readonly(target):
        skips.condition("no-immutable-attr", "chattr +i not supported on this filesystem")
    try:
        rep = apply(ctx_for(root, core_profile))
        rows = rows_by(rep)
        sw = rows[("sysctl.vm.swappiness", "host")]
        assert sw.status == "error" and "Operation not permitted" in sw.detail
        assert rows[("thp.enabled", "host")].status == "ok"
        assert not rep.compliant
        # the original of the failed row is recorded; revert restores everything else
        ok, _ = revert(Context(fs=HostFS(root), profile=None))
    finally:
        subprocess.run(["chattr", "-i", str(target)])
    assert (root / "sys/kernel/mm/transparent_hugepage/enabled").read_text().startswith("always [madvise]")


def test_unwritable_journal_changes_nothing(make_host, core_profile):
    root = make_host("small-2cpu")
    before = snapshot_tree(root)
    (root / "var/lib").mkdir(parents=True)
    (root / "var/lib/gpu-tune").write_text("a file where the journal folder should be")
    rep = apply(ctx_for(root, core_profile))
    assert not rep.compliant
    drift = [r for r in rep.settings if r.status != "ok"]
    assert drift and all(r.status == "error" and "cannot record the original first" in r.detail for r in drift)
    assert not any(r.changed for r in rep.settings)
    assert snapshot_tree(root) == before


def test_root_must_exist(tmp_path):
    with pytest.raises(InputError, match="no such directory"):
        HostFS(tmp_path / "nope")


def test_revert_with_empty_journal(make_host):
    root = make_host("small-2cpu")
    ok, rows = revert(Context(fs=HostFS(root), profile=None))
    assert ok and rows == ()


def test_corrupt_journal_is_reported_not_overwritten(make_host, core_profile):
    root = make_host("small-2cpu")
    j = root / JOURNAL.lstrip("/")
    j.parent.mkdir(parents=True)
    j.write_text("{not json")
    rep = apply(ctx_for(root, core_profile))
    assert all(r.status in ("ok", "error") for r in rep.settings)
    assert any("unreadable journal" in r.detail for r in rep.settings)
    assert j.read_text() == "{not json"
    assert (root / "proc/sys/vm/swappiness").read_text() == "60\n"


def test_apply_only_limits_the_writes(make_host, core_profile):
    root = make_host("small-2cpu")
    rep = apply(ctx_for(root, core_profile), only={("sysctl.vm.swappiness", "host")})
    rows = rows_by(rep)
    assert rows[("sysctl.vm.swappiness", "host")].status == "ok" and rows[("sysctl.vm.swappiness", "host")].changed
    assert rows[("thp.enabled", "host")].status == "drift" and not rows[("thp.enabled", "host")].changed
    assert (root / "sys/kernel/mm/transparent_hugepage/enabled").read_text().startswith("always [madvise]")
    assert [e["id"] for e in Journal(HostFS(root)).load().entries] == ["sysctl.vm.swappiness"]
