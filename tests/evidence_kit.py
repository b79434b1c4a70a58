"""What the evidence tests share (docs/health.md "Evidence"): ``gpu-tune check`` on the 8-GPU fixture
host with a fault, the stand-in ``nvidia-bug-report.sh`` (tests/fixtures/bugreport) first on PATH,
the root made "this machine" (its boot id this kernel's, so that the bug report is run), and a wait
for a bundle's bug report to say it is done."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO
from tests.healthkit import GPU_FIXTURE

STANDIN_DIR = Path(__file__).parent / "fixtures" / "bugreport"
FOLDER = "var/lib/gpu-tune/evidence"
DONE = ("finished", "cut at the deadline", "cut at the size cap", "failed", "not run")


def xid(seq: int, usec: int, bus: str = "5d", code: int = 79) -> str:
    return (f"3,{seq},{usec},-;NVRM: Xid (PCI:0000:{bus}:00): {code}, pid='<unknown>', name=<unknown>, "
            "GPU has fallen off the bus.\n")


def add_kmsg(root: Path, text: str) -> None:
    with open(root / "dev/kmsg", "a") as f:
        f.write(text)


def this_machine(root: Path) -> None:
    """The root's boot id made this kernel's: the root is the machine this runs on (as the
    DaemonSet's /host is), so nvidia-bug-report.sh is run for it."""
    (root / "proc/sys/kernel/random/boot_id").write_text(Path("/proc/sys/kernel/random/boot_id").read_text())


def standin(tmp_path: Path, mode: str, **env: str) -> dict[str, str]:
    """The environment that puts the stand-in first on PATH in ``mode`` (its pids in ``pids``)."""
    return {"PATH": f"{STANDIN_DIR}:{os.environ.get('PATH', '/usr/bin:/bin')}", "STANDIN_MODE": mode,
            "STANDIN_PIDS": str(tmp_path / "pids"), **env}


def check(root: Path, policies: Path, *extra: str, env: dict | None = None, fixture: Path = GPU_FIXTURE,
          wrap: tuple[str, ...] = ()) -> tuple[int, dict, str]:
    """``gpu-tune check -o json`` (``wrap``: the argv that runs it, e.g. in a mount namespace);
    (exit code, document, stderr)."""
    argv = [*wrap, sys.executable, "-m", "gpu_tune", "check", "--root", str(root), "--gpu-fixture", str(fixture),
            "--policy-dir", str(policies), "--profile", "health", "-o", "json", *extra]
    full = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    for k in list(full):
        if k.startswith(("GPU_TUNE_", "STANDIN_")):
            full.pop(k)
    full.update(env or {})
    r = subprocess.run(argv, capture_output=True, text=True, env=full, timeout=300)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout), r.stderr


def bundles(root: Path) -> list[str]:
    folder = root / FOLDER
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) if folder.is_dir() else []


def bundle_bytes(root: Path, name: str) -> int:
    return sum(p.stat().st_size for p in (root / FOLDER / name).iterdir() if p.is_file())


def status(root: Path, name: str) -> dict:
    return json.loads((root / FOLDER / name / "nvidia-bug-report.json").read_text())


def wait_done(root: Path, name: str, limit: float = 300.0) -> dict:
    """The bug report's status once its worker says it is done (the condition itself, polled;
    ``limit`` only ends a test whose worker never says)."""
    end = time.monotonic() + limit
    while True:
        st = status(root, name)
        if st.get("state") in DONE:
            return st
        assert time.monotonic() < end, f"the bug report of {name} never said it was done: {st}"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Whether a process with this id runs (a zombie, its exit status not yet taken, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def standin_pids(tmp_path: Path) -> list[int]:
    f = tmp_path / "pids"
    return [int(x) for x in f.read_text().split()] if f.exists() else []
