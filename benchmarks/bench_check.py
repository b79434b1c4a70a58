#!/usr/bin/env python3
"""`gpu-tune check` on the 224-CPU, 8-GPU fixture: time to a verdict, whole process, and the kernel
log's cost (docs/health.md).

    .venv/bin/python benchmarks/bench_check.py [--runs 9]

Prints the median wall and CPU seconds of `gpu-tune check -o json` on:

- the healthy DGX-like fixture (8 H100 with NVLink, fabric, 8 InfiniBand ports, a short kernel log);
- the same with a kernel log of 200,000 records, 10,000 of them XIDs (one fatal);
- in process: reading that log alone (records per second, peak memory of the reader).

Target: < 1 s for the healthy fixture (what a Slurm prolog can afford on every job).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._util import build_host, gpu_tune_argv, time_process  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TARGET_S = 1.0


def big_log(path: Path, records: int = 200_000, xids: int = 10_000) -> None:
    every = records // xids
    with open(path, "w") as f:
        for i in range(records):
            if i % every == 0:
                code = 79 if i == records // 2 else 13
                f.write(f"4,{i},{i * 1000},-;NVRM: Xid (PCI:0000:18:00): {code}, pid=42, name=python3, fault\n")
            else:
                f.write(f"6,{i},{i * 1000},-;eth0: link becomes ready; nothing to see here at all\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=9)
    a = ap.parse_args()
    root = build_host("dgx-8gpu")
    fixture = REPO / "tests" / "fixtures" / "gpu" / "dgx-8gpu.json"
    argv = gpu_tune_argv() + ["check", "--root", str(root), "--gpu-fixture", str(fixture), "-o", "json"]
    cpu: list[float] = []
    wall = time_process(argv, runs=a.runs, cpu=cpu)
    healthy = statistics.median(wall)
    print(f"gpu-tune check, 8-GPU 224-CPU fixture: median {healthy:.3f} s wall, {statistics.median(cpu):.3f} s CPU "
          f"({a.runs} runs; target < {TARGET_S:.1f} s): {'PASS' if healthy < TARGET_S else 'MISSED'}")

    busy = Path(tempfile.mkdtemp(prefix="gpu-tune-bench-check-")) / "h"
    shutil.copytree(root, busy, symlinks=True)
    big_log(busy / "dev" / "kmsg")
    size = (busy / "dev" / "kmsg").stat().st_size
    argv2 = gpu_tune_argv() + ["check", "--root", str(busy), "--gpu-fixture", str(fixture), "-o", "json"]
    cpu2: list[float] = []
    wall2 = time_process(argv2, runs=a.runs, cpu=cpu2)
    print(f"... with a kernel log of 200,000 records ({size / 1e6:.1f} MB, 10,000 XIDs, one fatal): median "
          f"{statistics.median(wall2):.3f} s wall, {statistics.median(cpu2):.3f} s CPU")

    from gpu_tune.discover.health import read_kernel_xids
    from gpu_tune.host.fs import HostFS
    from gpu_tune.host.kmsg import KernelLog

    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        sightings, status = read_kernel_xids(KernelLog(HostFS(busy)))
        times.append(time.perf_counter() - t0)
    tracemalloc.start()  # one more run, traced (tracing slows it: not timed)
    read_kernel_xids(KernelLog(HostFS(busy)))
    peaks = [tracemalloc.get_traced_memory()[1]]
    tracemalloc.stop()
    t = statistics.median(times)
    print(f"reading that log in process: median {t * 1000:.0f} ms ({status.scanned / t:,.0f} records/s), "
          f"peak {max(peaks) / 1e6:.1f} MB traced, {len(sightings)} sightings kept "
          f"({', '.join(f'XID {s.code} x{s.count}' for s in sightings)})")
    shutil.rmtree(busy.parent, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    return 0 if healthy < TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
