#!/usr/bin/env python3
"""``gpu-tune check --slurm`` at its bounds: what an ``scontrol`` that prints too much, streams
without end, answers slowly or hangs costs one pass, in memory and time. Each pass is one process
on the 8-GPU fixture host, with a stand-in ``scontrol`` first on PATH (no Slurm needed).

    .venv/bin/python benchmarks/bench_slurm_bounds.py [--only NAME] [--code DIR] [--json]

Cases:

- ``baseline``: ``scontrol show node`` answers one node line at once; the node is ready.
- ``out-50MB``, ``out-300MB``: the node line, then 50 MB or 300 MB more on it.
- ``stream-10MBps``: the node line, then 1 MB every 0.1 s until it is stopped.
- ``slow-25s``: every call answers after 25 s; the node is found by its ``NodeHostName`` and is
  not ready, so a pass makes three calls (list the nodes, show the node, drain it).
- ``hang``: ``scontrol show node`` never answers.

Printed per case: exit status, wall seconds, peak RSS of the pass's process (``wait4``, from a
small launcher), and its last line on stderr. Targets: the pass's peak RSS under 100 MB for every
output case (the issue: 300 MB of output took 899 MB), within 10 MB of the baseline's; a pass
whose scontrol hangs or is slow ends within 50 s (slurmd kills a ``HealthCheckProgram`` at 60 s;
the calls of a pass share 40 s, ``GPU_TUNE_SLURM_TIMEOUT``). ``--code DIR`` runs another
checkout's ``gpu_tune`` (the "before" figures: ``git archive <rev> | tar -x -C DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._util import report  # noqa: E402
from benchmarks.bench_hostile_round4_xid import LAUNCH  # noqa: E402
from tests.fixtures import hostgen  # noqa: E402

GPU_FIXTURE = REPO / "tests/fixtures/gpu/dgx-8gpu.json"
PROFILE = "include: training.yaml\nreadiness:\n  require_compliant: false\n  require_probe: false\n"
NODE = "gpu-a"
LINE = (f"NodeName={NODE} Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=0.10 "
        "AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:8 NodeAddr=127.0.0.1 NodeHostName={host} "
        "Version=22.05.8 OS=Linux 6.1.0 #1 SMP RealMemory=1000 AllocMem=0 FreeMem=900 Sockets=2 Boards=1 "
        "State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=gpu "
        "CfgTRES=cpu=2,mem=1000M,billing=2 AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 "
        "ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s")
STANDIN = r"""#!{python}
import os, sys, time
mode, args = os.environ["BENCH_SCONTROL"], sys.argv[1:]
if mode == "hang":
    time.sleep(3600)
if mode.startswith("slow:"):
    time.sleep(float(mode[5:]))
if args[:1] == ["update"]:
    sys.exit(0)
out, chunk = sys.stdout.buffer, b"x" * (1 << 20)
out.write({line!r}.encode())
if mode.startswith("bytes:"):
    left = int(mode[6:])
    while left > 0:
        out.write(chunk[:left])
        left -= len(chunk)
elif mode.startswith("stream:"):
    while True:
        out.write(chunk)
        out.flush()
        time.sleep(len(chunk) / float(mode[7:]))
out.write(b"\n")
"""
CASES = {  # name: (stand-in mode, found by --slurm-node, GPUs in NVML)
    "baseline": ("plain", True, 8),
    "out-50MB": ("bytes:50000000", True, 8),
    "out-300MB": ("bytes:300000000", True, 8),
    "stream-10MBps": ("stream:10000000", True, 8),
    "slow-25s": ("slow:25", False, 7),
    "hang": ("hang", True, 8),
}


def run_pass(work: Path, root: Path, code: Path, name: str, timeout: float) -> dict:
    mode, by_flag, gpus = CASES[name]
    fixture = work / f"gpus-{gpus}.json"
    if not fixture.exists():
        data = json.loads(GPU_FIXTURE.read_text())
        data["gpus"] = data["gpus"][:gpus]
        fixture.write_text(json.dumps(data))
    shutil.rmtree(root / "var/lib/gpu-tune", ignore_errors=True)
    argv = [sys.executable, "-m", "gpu_tune", "check", "--slurm", "--root", str(root), "--gpu-backend", "fixture",
            "--gpu-fixture", str(fixture), "--policy-dir", str(work / "policies"), "--profile", "health",
            *(("--slurm-node", NODE) if by_flag else ())]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "GPU_TUNE_"))}
    env.update(PYTHONPATH=str(code), BENCH_SCONTROL=mode, PATH=f"{work / 'bin'}:{os.environ.get('PATH', '')}")
    figures = work / "figures.json"
    p = subprocess.run([sys.executable, "-c", LAUNCH, str(figures), str(timeout), *argv], capture_output=True,
                       cwd=code, env=env)
    r = json.loads(figures.read_text())
    err = p.stderr.decode(errors="replace").strip().splitlines()
    return {"exit": r["exit"], "seconds": round(r["seconds"], 2), "peak_rss_mb": round(r["peak_rss_mb"], 1),
            "said": err[-1][:160] if err else ""}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="run only the cases whose name contains this (baseline always runs)")
    ap.add_argument("--code", type=Path, default=REPO, help="the checkout whose gpu_tune the passes run")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds before a pass is killed (default 150)")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-slurm-"))
    results: dict[str, dict] = {}
    try:
        root = hostgen.build("dgx-8gpu", work / "h")
        (work / "policies").mkdir()
        (work / "policies/health.yaml").write_text(PROFILE)
        shutil.copy(REPO / "policies/baselines.yaml", work / "policies")
        (work / "bin").mkdir()
        script = work / "bin/scontrol"
        script.write_text(STANDIN.format(python=sys.executable, line=LINE.format(host=socket.gethostname())))
        script.chmod(0o755)
        for name in CASES:
            if a.only not in name and name != "baseline":
                continue
            results[name] = r = run_pass(work, root, a.code.resolve(), name, a.timeout)
            if not a.json:
                print(f"{name:14} exit {str(r['exit']):4} {r['seconds']:7.2f} s {r['peak_rss_mb']:7.1f} MB peak RSS  "
                      f"{r['said'][:110]}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = results["baseline"]["peak_rss_mb"]
    checks = {"baseline: ready, exit 0": results["baseline"]["exit"] == 0}
    for name, r in results.items():
        if name.startswith(("out-", "stream-")):
            checks[f"{name}: exit 3, the output too long"] = r["exit"] == 3 and "more than 4 MiB" in r["said"]
            checks[f"{name}: peak RSS under 100 MB"] = r["peak_rss_mb"] < 100
            checks[f"{name}: peak RSS within 10 MB of the baseline's"] = r["peak_rss_mb"] - base < 10
        if name in ("slow-25s", "hang"):
            checks[f"{name}: exit 3 within 50 s (slurmd's limit: 60 s)"] = r["exit"] == 3 and r["seconds"] < 50
    return report(checks, a.json, {"code": str(a.code), "results": results})


if __name__ == "__main__":
    sys.exit(main())
