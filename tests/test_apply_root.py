"""apply and revert never write outside --root through a symlink planted under it: the outside
file stays byte-identical, the setting behind the link is an ``error`` row naming the link, and
every other setting is applied and reverted as usual."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import pytest

from gpu_tune.tune import engine
from gpu_tune.gpu import select_backend
from gpu_tune.host.fs import HostFS
from gpu_tune.tune.journal import Journal
from gpu_tune.tune.knobs.base import Context
from gpu_tune.tune.policy import load_profile
from tests.conftest import jdoc, snapshot_tree


def _move_out(root: Path, outside: Path, host_path: str, name: str, *, link: str | None = None,
              twin: bool = False) -> Path:
    """Move ``<root><host_path>`` to ``outside/name`` and leave a symlink to it in its place:
    absolute (its real path) unless ``link`` gives the link's text. ``twin`` copies it also to
    where the absolute link points beneath the root, so the audit reads a value there."""
    src = root / host_path.lstrip("/")
    dst = outside / name
    shutil.move(src, dst)
    if twin:
        where = root / str(dst).lstrip("/") if link is None else _in_root(root, src.parent, link)
        where.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if dst.is_dir() else shutil.copy2)(dst, where)
    os.symlink(link or str(dst), src)
    # the case is real: read as any other process reads it, the link leads outside the root
    assert os.path.realpath(src) == str(dst)
    return dst


def _in_root(root: Path, base: Path, link: str) -> Path:
    """Where a relative ``link`` found in ``base`` lands when '..' stops at ``root``."""
    parts = list(base.relative_to(root).parts)
    for c in link.split("/"):
        if c == "..":
            parts = parts[:-1]
        elif c not in ("", "."):
            parts.append(c)
    return root.joinpath(*parts)


def _first_irq(root: Path) -> int:
    """An IRQ that the training profile moves on this host."""
    rows = engine.audit(engine.make_context(HostFS(root), load_profile("training"), None)).settings
    return min(int(r.target) for r in rows if r.id == "irq.affinity" and r.status == "drift")


# (name, plant(root, outside) -> the link's host path, the settings it carries)
CASES: dict[str, Callable[[Path, Path], tuple[str, set[str]]]] = {
    "swappiness absolute, nothing beneath": lambda r, o: (
        _move_out(r, o, "/proc/sys/vm/swappiness", "swappiness") and "/proc/sys/vm/swappiness",
        {"sysctl.vm.swappiness"}),
    "swappiness absolute, a twin beneath": lambda r, o: (
        _move_out(r, o, "/proc/sys/vm/swappiness", "swappiness", twin=True) and "/proc/sys/vm/swappiness",
        {"sysctl.vm.swappiness"}),
    "swappiness relative ../../../..": lambda r, o: (
        _move_out(r, o, "/proc/sys/vm/swappiness", "swappiness", link="../../../../outside/swappiness")
        and "/proc/sys/vm/swappiness", {"sysctl.vm.swappiness"}),
    "swappiness relative, a twin beneath": lambda r, o: (
        _move_out(r, o, "/proc/sys/vm/swappiness", "swappiness", link="../../../../outside/swappiness",
                  twin=True) and "/proc/sys/vm/swappiness", {"sysctl.vm.swappiness"}),
    "an IRQ's smp_affinity_list": lambda r, o: (lambda path: (
        _move_out(r, o, path, "irq", twin=True) and path, {"irq.affinity"}))(
        f"/proc/irq/{_first_irq(r)}/smp_affinity_list"),
    "a scaling_governor": lambda r, o: (
        _move_out(r, o, "/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor", "governor", twin=True)
        and "/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor", {"cpu.governor"}),
    "the transparent_hugepage folder": lambda r, o: (
        _move_out(r, o, "/sys/kernel/mm/transparent_hugepage", "thp", twin=True)
        and "/sys/kernel/mm/transparent_hugepage", {"thp.enabled", "thp.defrag"}),
    "the proc/sys folder, relative": lambda r, o: (
        _move_out(r, o, "/proc/sys", "procsys", link="../../outside/procsys", twin=True) and "/proc/sys",
        {"sysctl.vm.swappiness", "sysctl.vm.dirty_background_ratio", "sysctl.kernel.numa_balancing",
         "sysctl.vm.max_map_count"}),
    "etc/gpu-tune": lambda r, o: (
        (r / "etc").mkdir(exist_ok=True) or (o / "etc-gpu-tune").mkdir() or
        os.symlink(str(o / "etc-gpu-tune"), r / "etc/gpu-tune") or "/etc/gpu-tune", {"allocator.preload"}),
}


@pytest.fixture(params=["walk", "auto"])
def host(request, make_host, gpu_fixture, tmp_path, monkeypatch):
    """Each case runs with the component walk and with what ``auto`` picks (openat2 where the
    kernel has it)."""
    monkeypatch.setenv("GPU_TUNE_RESOLVER", request.param)
    root = make_host("link-degraded")
    outside = tmp_path / "outside"
    outside.mkdir()
    backend = select_backend("fixture", str(gpu_fixture("link-degraded")))
    return root, outside, backend


def _files(d: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else None) for p in sorted(d.rglob("*"))}


@pytest.mark.parametrize("case", list(CASES))
def test_apply_and_revert_never_write_through_a_link_outside(host, case):
    root, outside, backend = host
    link, ids = CASES[case](root, outside)
    assert (root.parent / "outside") == outside  # the relative links above count on it
    planted = snapshot_tree(root)
    before = _files(outside)
    fs = HostFS(root)
    assert fs.resolver in ("walk", "openat2")
    rep = engine.apply(engine.make_context(fs, load_profile("training"), backend))
    bad = [r for r in rep.settings if r.status == "error"]
    assert bad and {r.id for r in bad} <= ids, [(r.id, r.detail) for r in bad]
    hit = [r for r in bad if r.id in ids]
    assert all(f"the symlink {link} -> " in r.detail and "leads outside --root" in r.detail for r in hit), \
        [r.detail for r in hit]
    assert not any(r.changed for r in hit)
    # everything else was applied
    assert any(r.changed for r in rep.settings if r.id == "thp.enabled") or "thp.enabled" in ids
    assert _files(outside) == before

    ok, rows = engine.revert(Context(fs=HostFS(root), profile=None, gpu=backend))
    assert ok, [(r.id, r.target, r.detail) for r in rows if r.status != "ok"]
    assert _files(outside) == before
    assert snapshot_tree(root) == planted  # the twins beneath the root were not written either


def test_a_symlinked_state_folder_gets_no_journal_and_no_lock(host):
    root, outside, backend = host
    (root / "var/lib").mkdir(parents=True)
    (outside / "state").mkdir()
    os.symlink("../../../outside/state", root / "var/lib/gpu-tune")
    assert os.path.realpath(root / "var/lib/gpu-tune") == str(outside / "state")
    before_tree, before_out = snapshot_tree(root), _files(outside)
    rep = engine.apply(engine.make_context(HostFS(root), load_profile("training"), backend))
    drift = [r for r in rep.settings if r.status not in ("ok", "unsupported")]
    assert drift and all(r.status == "error" and "cannot record the original first" in r.detail
                         and "the symlink /var/lib/gpu-tune -> ../../../outside/state leads outside" in r.detail
                         for r in drift)
    assert not any(r.changed for r in rep.settings)
    assert snapshot_tree(root) == before_tree and _files(outside) == before_out == {"state": None}
    ok, rows = engine.revert(Context(fs=HostFS(root), profile=None, gpu=backend))
    assert ok and rows == ()
    assert _files(outside) == before_out


def test_cli_apply_names_the_link_and_revert_restores_the_rest(make_host, tmp_path, cli):
    root = make_host("small-2cpu")
    outside = tmp_path / "outside"
    outside.mkdir()
    _move_out(root, outside, "/proc/sys/vm/swappiness", "swappiness", twin=True)
    before = _files(outside)
    thp = (root / "sys/kernel/mm/transparent_hugepage/enabled").read_bytes()
    r = cli("--root", str(root), "--gpu-backend", "none", "-o", "json", "apply", "--profile", "training")
    assert r.returncode == 1, r.stderr
    rows = {(x["id"], x["target"]): x for x in jdoc(r)["settings"]}
    sw = rows[("sysctl.vm.swappiness", "host")]
    assert sw["status"] == "error" and "the symlink /proc/sys/vm/swappiness -> " in sw["detail"]
    assert rows[("thp.enabled", "host")]["status"] == "ok" and rows[("thp.enabled", "host")]["changed"]
    r = cli("--root", str(root), "-o", "json", "revert")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "sysctl.vm.swappiness" not in {x["id"] for x in jdoc(r)["settings"]}  # never written: nothing to restore
    assert (root / "sys/kernel/mm/transparent_hugepage/enabled").read_bytes() == thp
    assert _files(outside) == before


def test_a_link_planted_after_apply_is_not_written_by_revert(host):
    root, outside, backend = host
    engine.apply(engine.make_context(HostFS(root), load_profile("training"), backend))
    (outside / "swappiness").write_bytes(b"30\n")
    (root / "proc/sys/vm/swappiness").unlink()
    os.symlink(str(outside / "swappiness"), root / "proc/sys/vm/swappiness")
    ok, rows = engine.revert(Context(fs=HostFS(root), profile=None, gpu=backend))
    assert not ok
    bad = [r for r in rows if r.status != "ok"]
    assert [r.id for r in bad] == ["sysctl.vm.swappiness"]
    assert "not restored" in bad[0].detail and "the symlink /proc/sys/vm/swappiness -> " in bad[0].detail
    assert (outside / "swappiness").read_bytes() == b"30\n"
    assert [e["id"] for e in Journal(HostFS(root)).load().entries] == ["sysctl.vm.swappiness"]  # kept
