"""What the real-Slurm test modules share: the 8-GPU host tree (built once per module, put back
before each test instead of copied), the GPU fixture's JSON with a GPU left out, ``gpu-tune check
--slurm`` run by the test itself (not by slurmd), optionally with gpu-tune's state folder
read-only, and stand-in ``scontrol`` scripts for what a real slurmctld cannot be made to print.
Test modules import the fixtures by name."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.fixtures import hostgen
from tests.healthkit import GPU_FIXTURE
from tests.realslurm.cluster import FLEET, NODE

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


def check_command(slurm, host: Path, fixture: Path, policies: Path, *extra: str, env: dict | None = None,
                  read_only: bool = False, node: str | None = NODE) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of ``gpu-tune check --slurm -o json`` on the fixture host against
    the real Slurm (``SLURM_CONF``): :func:`check` runs it, a race test starts many at once."""
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
    return argv, full


def check(slurm, host: Path, fixture: Path, policies: Path, *extra: str, env: dict | None = None,
          read_only: bool = False, node: str | None = NODE, timeout: float = 120) -> subprocess.CompletedProcess:
    """``gpu-tune check --slurm -o json`` on the fixture host, run by the test against the real
    Slurm (``SLURM_CONF``); ``read_only``: with ``<root>/var/lib/gpu-tune`` a read-only bind mount,
    in a mount namespace of its own (as root, a folder's mode bits would not stop a write)."""
    argv, full = check_command(slurm, host, fixture, policies, *extra, env=env, read_only=read_only, node=node)
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


# -- the blast-radius limit's race: many passes started together ---------------------------------------
WRITE = "REQUEST_UPDATE_NODE"  # scontrol update
READS = ("REQUEST_NODE_INFO", "REQUEST_PARTITION_INFO")  # scontrol show node (one node or all): both
_LOG = re.compile(r"^\[([0-9T:.-]+)\] update_node: node (\S+) (reason set to: (.*)|state set to (\S+))$")
BARRIER = ('case "$*" in "-a -o show node gpu-slurm-"*)\n'
           '  : > "$BARRIER/$$"; n=0\n'
           '  while [ "$(ls "$BARRIER" | wc -l)" -lt "$WAVE" ] && [ $n -lt 1200 ]; do sleep 0.05; n=$((n+1)); done;;\n'
           'esac\nexec "$REAL" "$@"\n')


def ours(slurm) -> dict[str, str]:
    """The nodes drained by gpu-tune (a drain whose reason starts ``gpu-tune:``), with their reasons."""
    return {k: n.reason for k, n in slurm.nodes().items() if n.drain and n.reason.startswith("gpu-tune:")}


def last_line(r) -> str:
    """The last line a pass wrote on stderr ("" when none)."""
    lines = r.stderr.strip().splitlines()
    return lines[-1] if lines else ""


def fleet_roots(base: Path, folder: Path, names=FLEET) -> dict[str, Path]:
    """A host of its own for every fleet node (its record, its health state): hard links of one tree
    (``cp -al``), since gpu-tune writes only its state folder, never through a file with a second name."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {name: folder / name for name in names}
    for root in out.values():
        subprocess.run(["cp", "-al", str(base), str(root)], check=True)
    return out


def wave(slurm, roots, fixture, policies, tmp_path, names=FLEET, tag="1") -> dict[str, subprocess.CompletedProcess]:
    """One pass for each of ``names``, all started together and held at their first ``scontrol``
    call until all of them are there."""
    barrier = tmp_path / f"barrier-{tag}"
    barrier.mkdir(parents=True)
    env = {**standin(tmp_path / f"standin-{tag}", BARRIER), "BARRIER": str(barrier), "WAVE": str(len(names))}
    procs = {}
    for name in names:
        argv, full = check_command(slurm, roots[name], fixture, policies, env=env, node=name)
        procs[name] = subprocess.Popen(argv, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        out[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return out


def race(slurm, roots, fixture, policies, tmp_path, tag="1") -> tuple[dict[str, subprocess.CompletedProcess], dict]:
    """One :func:`wave` of the fleet and its figures: nodes drained by gpu-tune at the peak and at
    the end, ``scontrol update`` writes and reads of nodes counted by slurmctld (``sdiag``), the
    seconds from the first write to the last (slurmctld's log) and from the start to the last pass's end."""
    log = slurm.log / "slurmctld.log"
    mark, before, t0 = len(log.read_text()), slurm.sdiag(), time.time()
    runs = wave(slurm, roots, fixture, policies, tmp_path, tag=tag)
    wall, after = time.time() - t0, slurm.sdiag()
    peak, times = replay(log.read_text()[mark:])
    return runs, {"peak": peak, "out": sorted(ours(slurm)), "writes": after.get(WRITE, 0) - before.get(WRITE, 0),
                  "reads": sum(after.get(k, 0) - before.get(k, 0) for k in READS),
                  "first to last write (s)": round(times[-1] - times[0], 2) if times else 0.0,
                  "start to end (s)": round(wall, 1)}


def replay(log: str) -> tuple[int, list[float]]:
    """From slurmctld's log: the most nodes drained by gpu-tune at one time, and the times (s)
    of the updates, in order."""
    reason: dict[str, str] = {}
    out: set[str] = set()
    peak, times = 0, []
    for line in log.splitlines():
        m = _LOG.match(line)
        if not m:
            continue
        times.append(datetime.fromisoformat(m.group(1)).timestamp())
        node = m.group(2)
        if m.group(4) is not None:
            reason[node] = m.group(4)
            continue
        if m.group(5).startswith("DRAIN") and reason.get(node, "").startswith("gpu-tune:"):
            out.add(node)
        else:
            out.discard(node)
        peak = max(peak, len(out))
    return peak, times
