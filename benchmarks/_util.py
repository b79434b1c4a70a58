"""Small helpers shared by the benchmarks: medians of whole-process runs, fixture trees."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build_host(scenario: str) -> Path:
    from tests.fixtures import hostgen

    return hostgen.build(scenario, Path(tempfile.mkdtemp(prefix=f"gpu-tune-bench-{scenario}-")))


def gpu_tune_argv() -> list[str]:
    exe = Path(sys.executable).with_name("gpu-tune")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "gpu_tune"]


def time_process(argv: list[str], runs: int = 15, warmup: int = 2, ok_codes=(0, 1),
                 cpu: list[float] | None = None) -> list[float]:
    """Wall seconds of ``runs`` whole-process runs (after ``warmup``); with ``cpu`` given, the CPU
    seconds (user + system) of each run are appended to it: on a shared machine they move far less
    with the neighbours' load than the wall time does."""
    import resource

    env = {**os.environ}
    times = []
    for i in range(warmup + runs):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        p = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        dt = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        if p.returncode not in ok_codes:
            raise SystemExit(f"{' '.join(argv)} exited {p.returncode}: {p.stderr.decode()[-500:]}")
        if i >= warmup:
            times.append(dt)
            if cpu is not None:
                cpu.append((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime))
    return times


def median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1000.0


def report(checks: dict[str, bool], as_json: bool, doc: dict) -> int:
    """Print the figures (``doc`` with the checks, as JSON) or one PASS/FAIL line per check; the
    exit code: 0 when every check holds."""
    import json

    if as_json:
        print(json.dumps({**doc, "checks": checks}, indent=1))
    else:
        for k, ok in checks.items():
            print(f"{'PASS' if ok else 'FAIL'}  {k}")
    return 0 if all(checks.values()) else 1
