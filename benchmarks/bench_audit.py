"""`gpu-tune audit` cost: whole process on a 224-CPU node vs a 2-CPU node, and the engine in-process.

Targets: whole-process median < 0.5 s on the 224-CPU fixture and < 1.5x the 2-CPU fixture;
the engine's own audit of the 224-CPU fixture < 50 ms.

    .venv/bin/python benchmarks/bench_audit.py [--runs N]
"""

from __future__ import annotations

import argparse
import time

from _util import build_host, gpu_tune_argv, median_ms, time_process


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    a = ap.parse_args()

    big = build_host("two-socket-224")
    small = build_host("small-2cpu")
    cmd = gpu_tune_argv()
    t_big = time_process([*cmd, "audit", "--root", str(big), "--gpu-backend", "none", "--profile", "training"], a.runs)
    t_small = time_process([*cmd, "audit", "--root", str(small), "--gpu-backend", "none", "--profile", "training"], a.runs)
    t_json = time_process([*cmd, "audit", "--root", str(big), "--gpu-backend", "none", "-o", "json"], a.runs)

    from agent.engine import audit, make_context
    from agent.hostfs import HostFS
    from agent.policy import load_profile

    prof = load_profile("training")
    fs = HostFS(big)
    inproc = []
    for i in range(a.runs + 3):
        t0 = time.perf_counter()
        rep = audit(make_context(fs, prof, None))
        dt = time.perf_counter() - t0
        if i >= 3:
            inproc.append(dt)
    rows = len(rep.settings)

    mb, ms = median_ms(t_big), median_ms(t_small)
    print(f"gpu-tune audit, whole process, median of {a.runs} (table output):")
    print(f"  224-CPU fixture   {mb:7.1f} ms   (target < 500 ms)")
    print(f"  2-CPU fixture     {ms:7.1f} ms")
    print(f"  ratio 224/2       {mb / ms:7.2f} x  (target < 1.5 x)")
    print(f"  224-CPU, -o json  {median_ms(t_json):7.1f} ms")
    print(f"engine audit in-process, 224-CPU fixture, {rows} rows: median {median_ms(inproc):.1f} ms "
          f"(min {min(inproc) * 1000:.1f}, max {max(inproc) * 1000:.1f}) (target < 50 ms)")


if __name__ == "__main__":
    main()
