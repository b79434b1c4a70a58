"""Limits are floors: a bound ({min: N} / {max: N}) is ok while the current value satisfies it,
apply never moves such a value, and a bad bound is one line naming the file and the key."""

from __future__ import annotations

import pytest

from gpu_tune.tune.engine import apply, audit, make_context, plan, revert
from gpu_tune.errors import InputError
from gpu_tune.host.fs import HostFS
from gpu_tune.tune.knobs.base import Context
from gpu_tune.tune.profile import UNLIMITED, Bound, parse_size
from gpu_tune.tune.policy import load_profile
from tests.conftest import snapshot_tree


def _profile(tmp_path, body: str, name: str = "b"):
    d = tmp_path / "pol"
    d.mkdir(exist_ok=True)
    (d / f"{name}.yaml").write_text(f"name: {name}\n" + body)
    return load_profile(name, d)


def _rows(report):
    return {(r.id, r.target): r for r in report.settings}


def test_shipped_profiles_use_a_floor_for_max_map_count():
    for name in ("training", "inference"):
        b = load_profile(name).sysctl["vm.max_map_count"]
        assert b == Bound(min=1048576)


def test_bound_judge_and_describe():
    b = Bound(min=1048576)
    assert b.describe() == "≥ 1048576"
    assert b.judge(8249672) == (True, "8249672 ≥ 1048576", None)
    assert b.judge(1048576)[0] is True
    assert b.judge(65530) == (False, "65530 < 1048576", 1048576)
    r = Bound(min=10, max=200)
    assert r.describe() == "≥ 10, ≤ 200"
    assert r.judge(300) == (False, "300 > 200", 200) and r.judge(5) == (False, "5 < 10", 10)
    assert r.judge(50) == (True, "50 ≥ 10 and 50 ≤ 200", None)
    assert Bound(min=UNLIMITED).describe() == "≥ unlimited"
    assert Bound(min=UNLIMITED).judge(8388608) == (False, "8388608 < unlimited", UNLIMITED)
    assert Bound(min=UNLIMITED).judge(UNLIMITED)[0] is True


@pytest.mark.parametrize("text,value", [(65536, 65536), ("64K", 65536), ("8MiB", 8388608), ("1g", 1 << 30),
                                        ("unlimited", UNLIMITED), ("infinity", UNLIMITED)])
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_audit_keeps_a_higher_value_and_apply_never_lowers_it(make_host, tmp_path):
    """The field report: vm.max_map_count 8,249,672 was lowered to 1,048,576 by apply."""
    root = make_host("small-2cpu")
    (root / "proc/sys/vm/max_map_count").write_text("8249672\n")
    prof = load_profile("training")
    row = _rows(audit(make_context(HostFS(root), prof, None)))[("sysctl.vm.max_map_count", "host")]
    assert (row.current, row.desired, row.status, row.detail) == ("8249672", "≥ 1048576", "ok", "8249672 ≥ 1048576")
    rep = apply(make_context(HostFS(root), prof, None))
    row = _rows(rep)[("sysctl.vm.max_map_count", "host")]
    assert row.status == "ok" and row.changed is False
    assert (root / "proc/sys/vm/max_map_count").read_text() == "8249672\n"
    from gpu_tune.tune.journal import Journal

    assert "sysctl.vm.max_map_count" not in {e["id"] for e in Journal(HostFS(root)).load().entries}


def test_below_the_floor_is_raised_to_it_and_reverted_byte_for_byte(make_host):
    root = make_host("small-2cpu")  # 65530, the kernel's default
    before = snapshot_tree(root)
    prof = load_profile("training")
    ctx = make_context(HostFS(root), prof, None)
    row = _rows(audit(ctx))[("sysctl.vm.max_map_count", "host")]
    assert (row.current, row.status, row.detail) == ("65530", "drift", "65530 < 1048576: apply writes 1048576")
    assert row in plan(audit(ctx).settings)
    dry = _rows(apply(make_context(HostFS(root), prof, None), dry=True))[("sysctl.vm.max_map_count", "host")]
    assert dry.detail == "65530 < 1048576: apply writes 1048576"
    rep = apply(make_context(HostFS(root), prof, None))
    row = _rows(rep)[("sysctl.vm.max_map_count", "host")]
    assert row.changed and row.status == "ok" and row.detail == "1048576 ≥ 1048576"
    assert (root / "proc/sys/vm/max_map_count").read_text() == "1048576"
    ok, _ = revert(Context(fs=HostFS(root), profile=None))
    assert ok and snapshot_tree(root) == before


def test_ceiling_and_range(make_host, tmp_path):
    root = make_host("small-2cpu")  # dirty_ratio 20, swappiness 60
    prof = _profile(tmp_path, "sysctl:\n  vm.dirty_ratio: {max: 10}\n  vm.swappiness: {min: 1, max: 10}\n"
                              "  vm.zone_reclaim_mode: {max: 0}\n")
    rows = _rows(audit(make_context(HostFS(root), prof, None)))
    assert rows[("sysctl.vm.dirty_ratio", "host")].detail == "20 > 10: apply writes 10"
    assert rows[("sysctl.vm.swappiness", "host")].desired == "≥ 1, ≤ 10"
    assert rows[("sysctl.vm.zone_reclaim_mode", "host")].status == "ok"
    rep = _rows(apply(make_context(HostFS(root), prof, None)))
    assert (root / "proc/sys/vm/dirty_ratio").read_text() == "10"
    assert (root / "proc/sys/vm/swappiness").read_text() == "10"
    assert rep[("sysctl.vm.swappiness", "host")].status == "ok"


def test_a_non_numeric_current_value_is_an_error_row(make_host, tmp_path):
    root = make_host("small-2cpu")
    (root / "proc/sys/vm/max_map_count").write_text("lots\n")
    rows = _rows(audit(make_context(HostFS(root), load_profile("training"), None)))
    row = rows[("sysctl.vm.max_map_count", "host")]
    assert row.status == "error" and "'lots' is not a number" in row.detail


def test_the_table_shows_a_satisfied_bound_without_an_arrow(make_host, cli):
    root = make_host("small-2cpu")
    (root / "proc/sys/vm/max_map_count").write_text("8249672\n")
    p = cli("audit", "--root", str(root), "--gpu-backend", "none")
    line = next(ln for ln in p.stdout.splitlines() if "max_map_count" in ln)
    assert "8249672" in line and "→" not in line and "8249672 ≥ 1048576" in line


def test_readiness_names_a_bound_as_wanted():
    from gpu_tune.judge.readiness import tuning_check

    doc = {"profile": "t", "settings": [{"id": "sysctl.vm.max_map_count", "target": "host", "current": "65530",
                                         "desired": "≥ 1048576", "status": "drift", "detail": ""}]}
    assert "sysctl.vm.max_map_count[host] drift: 65530 wants ≥ 1048576" in tuning_check(doc).detail


@pytest.mark.parametrize("body,needle", [
    ("sysctl:\n  vm.max_map_count: {mni: 1048576}\n", "sysctl: vm.max_map_count: unknown key 'mni'"),
    ("sysctl:\n  vm.max_map_count: {min: 5}\n", "sysctl: vm.max_map_count.min: 5 is out of range 65530..2147483647"),
    ("sysctl:\n  vm.max_map_count: {min: lots}\n", "vm.max_map_count.min: expected an integer, got 'lots'"),
    ("sysctl:\n  vm.max_map_count: '>=1048576'\n", "write a bound as {min: N} or {max: N}"),
    ("sysctl:\n  vm.dirty_ratio: {min: 30, max: 10}\n", "vm.dirty_ratio: min 30 is greater than max 10"),
    ("sysctl:\n  vm.dirty_ratio: {}\n", "vm.dirty_ratio: expected {min: N} or {max: N}"),
    ("sysctl:\n  vm.dirty_ratio: [1, 2]\n", "vm.dirty_ratio: expected a number, a string or a bound"),
    ("limits:\n  memlock: 65536\n", "limits.memlock: a limit is a floor: write {min: 65536}"),
    ("limits:\n  memlock: {min: lots}\n", "limits.memlock: min: expected a size"),
    ("limits:\n  memlock: {max: 1G}\n", "limits.memlock: only a floor {min: SIZE} is checked"),
])
def test_bad_bounds_are_one_line_naming_file_and_key(tmp_path, body, needle):
    with pytest.raises(InputError) as ei:
        _profile(tmp_path, body)
    msg = str(ei.value)
    assert needle in msg and str(tmp_path / "pol" / "b.yaml") in msg and "\n" not in msg
    assert ei.value.exit_code == 2


def test_bad_bound_exits_2_with_one_line(tmp_path, make_host, cli):
    root = make_host("small-2cpu")
    d = tmp_path / "pol"
    d.mkdir()
    (d / "b.yaml").write_text("name: b\nsysctl:\n  vm.max_map_count: {min: 1048576, above: 2}\n")
    before = snapshot_tree(root)
    p = cli("apply", "--root", str(root), "--policy-dir", str(d), "--profile", "b", "--gpu-backend", "none")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().count("\n") == 0 and "b.yaml: sysctl: vm.max_map_count: unknown key 'above'" in p.stderr
    assert snapshot_tree(root) == before
