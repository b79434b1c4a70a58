"""Host files that are not files: a FIFO, a device, a socket, a 2 GB sparse file, a file with a
second name outside the root, the leftovers of a write killed before its rename.

Every read is bounded and cannot block (only regular files are read, opened non-blocking, at
most a cap); every such file is an ``error`` row naming it and what it is, the rest of the run
goes on, and nothing is ever written through a hard link. Each case runs with an alarm: a read
that blocks fails the test instead of hanging it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_tune.errors import NotAFile
from gpu_tune.host.files import READ_CAP
from gpu_tune.host.fs import HostFS
from tests import skips
from tests.conftest import REPO, jdoc, run_cli, snapshot_tree

SWAPPINESS = "/proc/sys/vm/swappiness"
BASE = ("--gpu-backend", "none")


@contextlib.contextmanager
def within(seconds: float):
    """Fail (instead of hanging) when the body takes longer than ``seconds``: SIGALRM
    interrupts a blocked open() or read()."""

    def ring(signum, frame):
        raise TimeoutError(f"blocked for more than {seconds:g} s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _fifo(p: Path) -> str:
    p.unlink(missing_ok=True)
    os.mkfifo(p)
    return "FIFO"


def _device(p: Path) -> str:
    if os.geteuid() != 0:
        skips.condition("not-root", "mknod needs root")
    p.unlink(missing_ok=True)
    os.mknod(p, 0o644 | 0o020000, os.makedev(1, 5))  # /dev/zero: endless zeros
    return "character device"


def _socket(p: Path) -> str:
    p.unlink(missing_ok=True)
    s = socket.socket(socket.AF_UNIX)
    # bound by a name relative to its folder: a socket's path is at most 107 bytes, and a test's
    # folder (a pytest-xdist worker's, deep in a fixture tree) may be longer
    here = os.getcwd()
    os.chdir(p.parent)
    try:
        s.bind(p.name)
    finally:
        os.chdir(here)
        s.close()
    return "socket"


def _sparse(p: Path) -> str:
    p.unlink(missing_ok=True)
    with open(p, "wb") as fh:
        fh.truncate(2 << 30)
    return "larger than 1 MiB"


def _just_over(p: Path) -> str:
    p.write_bytes(b"1" * (READ_CAP + 1))
    return "larger than 1 MiB"


KINDS = {"fifo": _fifo, "device": _device, "socket": _socket, "sparse-2GB": _sparse, "cap+1": _just_over}


@pytest.fixture(params=["openat2", "walk"])
def resolver(request, monkeypatch):
    monkeypatch.setenv("GPU_TUNE_RESOLVER", request.param)
    return request.param


@pytest.mark.parametrize("kind", KINDS)
def test_a_host_file_that_is_not_a_file_is_refused_at_once(make_host, resolver, kind):
    root = make_host("small-2cpu")
    says = KINDS[kind](root / SWAPPINESS.lstrip("/"))
    fs = HostFS(root)
    for read in (fs.read_text, fs.read_bytes, fs.read_optional):
        with within(30), pytest.raises(NotAFile) as err:  # a blocked open() or read() never returns
            read(SWAPPINESS)
        assert str(err.value).startswith(f"{SWAPPINESS}: ") and says in str(err.value)


def test_the_cap_suits_the_file(make_host):
    root = make_host("small-2cpu")
    big = root / "proc/interrupts"
    big.write_bytes(b"x" * (2 * READ_CAP))
    fs = HostFS(root)
    with pytest.raises(NotAFile):
        fs.read_text("/proc/interrupts")
    assert len(fs.read_text("/proc/interrupts", limit=4 * READ_CAP)) == 2 * READ_CAP


def test_a_kernel_file_is_read_up_to_the_cap_whatever_its_reported_size():
    """procfs says 0 bytes; the read goes on until the end or the cap, never trusting it."""
    fs = HostFS("/")
    text = fs.read_text("/proc/self/status")
    assert os.stat("/proc/self/status").st_size == 0 and "Pid:" in text
    with pytest.raises(NotAFile, match="larger than 64 bytes"):
        fs.read_text("/proc/self/status", limit=64)


def _plant_fifo(root: Path, host_path: str) -> None:
    p = root / host_path.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    _fifo(p)


def _error_rows(doc: dict) -> list[dict]:
    return [s for s in doc["settings"] if s["status"] == "error"]


@pytest.mark.parametrize("host_path,setting", [
    (SWAPPINESS, "sysctl.vm.swappiness"),
    ("/proc/cmdline", "thp.enabled"),
    ("/sys/kernel/mm/transparent_hugepage/enabled", "thp.enabled"),
    ("/sys/devices/system/cpu/cpu1/cpufreq/scaling_governor", "cpu.governor"),
])
def test_a_fifo_at_a_host_path_is_an_error_row_and_the_run_goes_on(make_host, host_path, setting):
    root = make_host("small-2cpu")
    _plant_fifo(root, host_path)
    for cmd in ("audit", "apply"):
        p = run_cli(cmd, "--root", str(root), *BASE, "-o", "json", timeout=60)
        assert p.returncode == 1, p.stderr
        doc = jdoc(p)
        err = [s for s in _error_rows(doc) if s["id"] == setting]
        assert err and any(f"{host_path}: is a FIFO" in s["detail"] for s in err), err
        # everything else was read (and, by apply, written)
        assert any(s["status"] in ("ok", "drift") for s in doc["settings"] if s["id"] != setting)
    assert run_cli("revert", "--root", str(root), *BASE, timeout=60).returncode == 0


def test_a_fifo_at_an_irq_affinity_file_is_not_passed_over(make_host, gpu_fixture):
    root = make_host("link-degraded")
    fixture = gpu_fixture("link-degraded")
    _plant_fifo(root, "/proc/irq/120/smp_affinity_list")
    p = run_cli("audit", "--root", str(root), "--gpu-backend", "fixture", "--gpu-fixture", str(fixture),
                "-o", "json", timeout=60)
    assert p.returncode == 1, p.stderr
    rows = [s for s in jdoc(p)["settings"] if s["id"] == "irq.affinity" and s["target"] == "120"]
    assert rows[0]["status"] == "error" and "smp_affinity_list: is a FIFO" in rows[0]["detail"]


@pytest.mark.parametrize("what", ["journal", "gpu-fixture", "include", "probe-state"])
def test_a_fifo_as_a_file_of_the_tool_is_bad_input(make_host, tmp_path, gpu_fixture, what):
    root = make_host("link-degraded")
    fixture = gpu_fixture("link-degraded")
    args = ["--root", str(root), "--gpu-backend", "fixture", "--gpu-fixture", str(fixture)]
    cmd = "audit"
    if what == "journal":
        _plant_fifo(root, "/var/lib/gpu-tune/journal.json")
        cmd, needle = "revert", "journal.json under"
    elif what == "gpu-fixture":
        _fifo(fixture)
        needle = str(fixture)
    elif what == "include":
        pol = tmp_path / "pol"
        pol.mkdir()
        (pol / "x.yaml").write_text("include: [training.yaml, extra.yaml]\n")
        _fifo(pol / "extra.yaml")
        args += ["--policy-dir", str(pol), "--profile", "x"]
        needle = "extra.yaml"
    else:
        _plant_fifo(root, "/var/lib/gpu-tune/probe.json")
        cmd, needle = "label", "probe.json under"
        args += ["--dry-run", "--kubeconfig", str(tmp_path / "none")]
    before = snapshot_tree(root)
    p = run_cli(cmd, *args, timeout=60)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and needle in lines[0] and "FIFO" in lines[0], lines
    assert snapshot_tree(root) == before


# -- hard links ----------------------------------------------------------------------------------
def test_a_hard_link_to_a_file_outside_the_root_is_never_written(make_host, tmp_path):
    root = make_host("small-2cpu")
    outside = tmp_path / "outside-swappiness"
    outside.write_text("60\n")
    target = root / SWAPPINESS.lstrip("/")
    target.unlink()
    os.link(outside, target)
    before = snapshot_tree(root)
    p = run_cli("apply", "--root", str(root), *BASE, "-o", "json", timeout=60)
    assert p.returncode == 1, p.stderr
    row = next(s for s in jdoc(p)["settings"] if s["id"] == "sysctl.vm.swappiness")
    assert row["status"] == "error" and "2 hard links" in row["detail"] and not row["changed"]
    assert outside.read_text() == "60\n"
    assert run_cli("revert", "--root", str(root), *BASE, timeout=60).returncode == 0
    assert snapshot_tree(root) == before and outside.read_text() == "60\n"


@pytest.mark.parametrize("host_path", ["/etc/gpu-tune/allocator.env", "/var/lib/gpu-tune/lock",
                                       "/var/lib/gpu-tune/journal.json"])
def test_files_of_the_tool_with_a_second_name_are_refused(make_host, tmp_path, host_path):
    root = make_host("small-2cpu")
    outside = tmp_path / "outside"
    outside.write_text("keep\n")
    p = root / host_path.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    os.link(outside, p)
    if host_path.endswith("journal.json"):
        outside.write_text('{"format": 1, "entries": []}\n')
    kept = outside.read_bytes()
    fs = HostFS(root)
    with pytest.raises(NotAFile, match="2 hard links"):
        if host_path.endswith("lock"):
            fs.open_lock_file(host_path)
        else:
            fs.write_file_atomic(host_path, b"new\n")
    assert outside.read_bytes() == kept and p.read_bytes() == kept


# -- a write killed just before its rename ---------------------------------------------------------
KILL_AT_RENAME = """
import os, signal, sys
real = os.replace
def replace(src, dst, *a, **kw):
    if dst == os.environ["KILL_AT_RENAME_OF"]:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(src, dst, *a, **kw)
os.replace = replace
from gpu_tune.cli import main
main(sys.argv[1:])
"""


def _killed_at_rename(name: str, *argv: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "KILL_AT_RENAME_OF": name}
    p = subprocess.run([sys.executable, "-c", KILL_AT_RENAME, *argv], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr[-2000:])


@pytest.mark.parametrize("then", ["revert", "apply-then-revert"])
def test_an_apply_killed_at_the_rename_leaves_no_trace_after_revert(make_host, then):
    root = make_host("small-2cpu")
    assert not (root / "etc/gpu-tune").exists()
    before = snapshot_tree(root)
    _killed_at_rename("allocator.env", "apply", "--root", str(root), *BASE)
    left = sorted(p.name for p in (root / "etc/gpu-tune").iterdir())
    assert len(left) == 1 and left[0].startswith(".allocator.env."), left  # the case is real
    if then == "apply-then-revert":
        p = run_cli("apply", "--root", str(root), *BASE, timeout=60)
        assert p.returncode in (0, 1), p.stderr
        assert sorted(p.name for p in (root / "etc/gpu-tune").iterdir()) == ["allocator.env"]
    p = run_cli("revert", "--root", str(root), *BASE, "-o", "json", timeout=60)
    assert p.returncode == 0 and jdoc(p)["restored"] is True, p.stdout + p.stderr
    assert snapshot_tree(root) == before
    assert not (root / "etc/gpu-tune").exists()
    assert not [n for n in os.listdir(root / "var/lib/gpu-tune") if n.startswith(".")]


def test_a_revert_killed_at_the_rename_is_finished_by_the_next(make_host, tmp_path):
    root = make_host("small-2cpu")
    env_file = root / "etc/gpu-tune/allocator.env"
    env_file.parent.mkdir(parents=True)
    env_file.write_text("LD_PRELOAD=/old/lib.so\n")
    before = snapshot_tree(root)
    assert run_cli("apply", "--root", str(root), *BASE, timeout=60).returncode in (0, 1)
    assert env_file.read_text() != "LD_PRELOAD=/old/lib.so\n"
    _killed_at_rename("allocator.env", "revert", "--root", str(root), *BASE)
    assert [n for n in os.listdir(env_file.parent) if n.startswith(".allocator.env.")]
    assert run_cli("revert", "--root", str(root), *BASE, timeout=60).returncode == 0
    assert snapshot_tree(root) == before
