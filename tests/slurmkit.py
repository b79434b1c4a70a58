"""What the real-Slurm test modules share: the 8-GPU host tree (built once per module, put back
before each test instead of copied), the GPU fixture's JSON with a GPU left out, ``gpu-tune check
--slurm`` run by the test itself (not by slurmd), optionally with gpu-tune's state folder
read-only, and stand-in ``scontrol`` scripts for what a real slurmctld cannot be made to print.
Test modules import the fixtures by name."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.fixtures import hostgen
from tests.healthkit import GPU_FIXTURE
from tests.realslurm.cluster import NODE

# what a test changes in the host tree (gpu-tune check writes only its state folder): put back
# before each test instead of copying 16,000 files
CHANGED = ("dev/kmsg", "proc/sys/kernel/random/boot_id")
STATE = "var/lib/gpu-tune"
COUNT = f"{STATE}/slurm.json"
SCONTROL = shutil.which("scontrol") or "/usr/bin/scontrol"


@pytest.fixture(scope="module")
def dgx_tree(tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    root = hostgen.build("dgx-8gpu", tmp_path_factory.mktemp("dgx") / "h")
    return root, {p: (root / p).read_bytes() for p in CHANGED}


@pytest.fixture
def host(dgx_tree) -> Path:
    root, saved = dgx_tree
    for p, data in saved.items():
        (root / p).write_bytes(data)
    shutil.rmtree(root / STATE, ignore_errors=True)
    return root


def gpu_json(tmp_path: Path, drop: int | None = None) -> Path:
    """The 8-GPU fixture (``gpus.json``), or with GPU ``drop`` left out (``gpus-without-N.json``:
    NVML lists 7 where the PCI bus and Slurm have 8, so the node is not ready)."""
    data = json.loads(GPU_FIXTURE.read_text())
    if drop is not None:
        del data["gpus"][drop]
    f = tmp_path / ("gpus.json" if drop is None else f"gpus-without-{drop}.json")
    f.write_text(json.dumps(data))
    return f


def check(slurm, host: Path, fixture: Path, policies: Path, *extra: str, env: dict | None = None,
          read_only: bool = False, node: str | None = NODE, timeout: float = 120) -> subprocess.CompletedProcess:
    """``gpu-tune check --slurm -o json`` on the fixture host, run by the test against the real
    Slurm (``SLURM_CONF``); ``read_only``: with ``<root>/var/lib/gpu-tune`` a read-only bind mount,
    in a mount namespace of its own (as root, a folder's mode bits would not stop a write)."""
    argv = [sys.executable, "-m", "gpu_tune", "check", "--slurm", "--root", str(host), "--gpu-backend", "fixture",
            "--gpu-fixture", str(fixture), "--policy-dir", str(policies), "--profile", "health", "-o", "json",
            *(("--slurm-node", node) if node is not None else ()), *extra]
    if read_only:
        state = host / STATE
        state.mkdir(parents=True, exist_ok=True)
        q = shlex.quote(str(state))
        argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                f'mount --bind {q} {q} && mount -o remount,ro,bind {q} {q} && exec "$@"', "sh", *argv]
    full = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", "SLURM_CONF": str(slurm.conf)}
    for k in ("GPU_TUNE_ROOT", "GPU_TUNE_PROFILE", "GPU_TUNE_POLICY_DIR", "GPU_TUNE_GPU_BACKEND",
              "GPU_TUNE_GPU_FIXTURE", "SLURMD_NODENAME", "SLURM_JOB_ID", "SLURM_SCRIPT_CONTEXT"):
        full.pop(k, None)
    full.update(env or {})
    return subprocess.run(argv, capture_output=True, text=True, env=full, timeout=timeout)


def said(r: subprocess.CompletedProcess) -> str:
    """The one line ``check --slurm`` wrote on stderr."""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}: {r.stderr[-2000:]}"
    return lines[0]


def standin(folder: Path, body: str) -> dict[str, str]:
    """A stand-in ``scontrol`` (a shell script, ``body``; ``$REAL`` is the real scontrol, ``$LOG``
    a file it may log to) first on PATH; returns the environment that puts it there."""
    bin_dir = folder / "standin-bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "scontrol"
    script.write_text(f"#!/bin/sh\nREAL={shlex.quote(SCONTROL)}\nLOG={shlex.quote(str(folder / 'standin.log'))}\n"
                      + body)
    script.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"}


def standin_log(folder: Path) -> list[str]:
    try:
        return (folder / "standin.log").read_text().splitlines()
    except FileNotFoundError:
        return []
