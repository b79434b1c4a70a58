"""limits.memlock: the container runtime's RLIMIT_MEMLOCK (pods inherit it) against the profile's
floor. Read-only: a runtime below the floor is drift with the remedy; apply never writes."""

from __future__ import annotations

import shutil

import pytest

from gpu_tune.tune.engine import apply, audit, make_context, plan
from gpu_tune.host.fs import HostFS
from gpu_tune.tune.journal import Journal
from gpu_tune.tune.knobs import fixable
from gpu_tune.tune.profile import Profile
from gpu_tune.tune.policy import load_profile
from tests.conftest import snapshot_tree
from tests.fixtures.hostgen import proc_limits


def small(make_host, memlock: str = "8388608"):
    """small-2cpu with containerd's locked-memory limit set to ``memlock``."""
    root = make_host("small-2cpu")
    (root / "proc/1187/limits").write_text(proc_limits(memlock))
    return root


def rows_of(root, profile):
    return [r for r in audit(make_context(HostFS(root), profile, None)).settings if r.id == "limits.memlock"]


def floor(value) -> Profile:
    return Profile(name="t", limits={"memlock": {"min": value}})


def test_systemd_default_8mib_is_below_the_shipped_floor(make_host):
    root = make_host("irqbalance")  # containerd (pid 1187) with systemd's default 8 MiB
    (row,) = rows_of(root, load_profile("training"))
    assert (row.target, row.current, row.desired, row.status) == ("containerd", "8388608", "≥ unlimited", "drift")
    assert row.detail.startswith("8388608 < unlimited: containers started by containerd (pid 1187) inherit it")
    assert "LimitMEMLOCK=infinity for containerd.service (systemctl edit containerd" in row.detail
    assert not fixable("limits.memlock")


def test_read_only_apply_never_writes_and_reports_not_compliant(make_host):
    root = small(make_host)
    before = (root / "proc/1187/limits").read_bytes()
    prof = floor("unlimited")
    ctx = make_context(HostFS(root), prof, None)
    rep = audit(ctx)
    assert plan(rep.settings) == ()
    dry = apply(make_context(HostFS(root), prof, None), dry=True)
    assert "would change" not in dry.settings[0].detail and "LimitMEMLOCK" in dry.settings[0].detail
    rep = apply(make_context(HostFS(root), prof, None))
    assert not rep.compliant and rep.settings[0].status == "drift" and rep.settings[0].changed is False
    assert (root / "proc/1187/limits").read_bytes() == before
    assert not (root / "var/lib/gpu-tune/journal.json").exists() or not Journal(HostFS(root)).load().entries


def test_an_unlimited_runtime_passes(tmp_path_factory):
    from tests.fixtures import pcigen

    root = pcigen.build_shared("dgx-8gpu", tmp_path_factory)  # containerd with LimitMEMLOCK=infinity
    (row,) = rows_of(root, load_profile("inference"))
    assert (row.current, row.status) == ("unlimited", "ok")
    assert row.detail == "unlimited ≥ unlimited: containers started by containerd (pid 1187) inherit it"


@pytest.mark.parametrize("value,status", [("64M", "drift"), ("8MiB", "ok"), (4194304, "ok"), ("1G", "drift")])
def test_byte_floors(make_host, value, status):
    root = small(make_host)
    (row,) = rows_of(root, floor(value))
    assert row.status == status


def test_several_runtimes_and_the_hard_limit(make_host):
    root = make_host("small-2cpu")
    shutil.rmtree(root / "proc/1187")
    (root / "proc/2001").mkdir(parents=True)
    (root / "proc/2001/comm").write_text("dockerd\n")
    (root / "proc/2001/limits").write_text(proc_limits("65536").replace(
        "Max locked memory         65536                65536  ", "Max locked memory         65536                unlimited"))
    (root / "proc/2002").mkdir()
    (root / "proc/2002/comm").write_text("crio\n")
    (root / "proc/2002/limits").write_text(proc_limits("unlimited"))
    rows = rows_of(root, floor("unlimited"))
    assert [(r.target, r.current, r.status) for r in rows] == [("crio", "unlimited", "ok"), ("dockerd", "65536", "drift")]
    assert "hard limit unlimited" in rows[1].detail and "--default-ulimit memlock=-1:-1" in rows[1].detail
    assert "LimitMEMLOCK=infinity for docker.service" in rows[1].detail


def test_no_runtime_is_unsupported_and_unreadable_limits_an_error(make_host):
    root = small(make_host)
    (root / "proc/1187/limits").unlink()  # the process exited after its comm was read
    (row,) = rows_of(root, floor("unlimited"))
    assert (row.target, row.status) == ("containerd", "unsupported") and "/proc/1187/limits" in row.detail
    (root / "proc/1187/limits").mkdir()  # there but unreadable
    (row,) = rows_of(root, floor("unlimited"))
    assert (row.target, row.status) == ("containerd", "error") and "is a directory" in row.detail
    (root / "proc/1187/limits").rmdir()
    shutil.rmtree(root / "proc/1187")
    (row,) = rows_of(root, floor("unlimited"))
    assert (row.target, row.status) == ("-", "unsupported") and "no container runtime process" in row.detail


def test_lowest_pid_is_the_runtime(make_host):
    """A nested runtime (a kind node, a test container) runs under the host's: the host's is the
    oldest process of that name."""
    root = small(make_host)
    (root / "proc/9000").mkdir()
    (root / "proc/9000/comm").write_text("containerd\n")
    (root / "proc/9000/limits").write_text(proc_limits("unlimited"))
    (row,) = rows_of(root, floor("unlimited"))
    assert row.detail.startswith("8388608 < unlimited: containers started by containerd (pid 1187)")


def test_the_fixture_tree_is_untouched_by_audit(make_host):
    root = small(make_host)
    before = snapshot_tree(root)
    rows_of(root, load_profile("training"))
    assert snapshot_tree(root) == before


def test_enforce_mode_keeps_the_remedy_of_a_read_only_row(make_host):
    """The agent re-applies drift at most every 5 minutes and says so in the row; a read-only
    check is never re-applied, so its row keeps the remedy pass after pass."""
    from gpu_tune.serve.agent import Agent
    from gpu_tune.serve.options import ServeOptions
    from gpu_tune.serve.stages import default_stages

    root = small(make_host)
    st = default_stages(ServeOptions(root=str(root), gpu_backend="none", no_kube=True))
    agent = Agent(st, mode="enforce", probe_enabled=False)
    for _ in range(2):
        snap = agent.run_pass()
        row = next(s for s in snap.audit["settings"] if s["id"] == "limits.memlock")
        assert row["status"] == "drift" and "LimitMEMLOCK=infinity" in row["detail"], row
    st.close()
