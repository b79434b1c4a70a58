#!/usr/bin/env python3
"""Series per node on /metrics: the 8-GPU, 224-CPU fixture with the default flags and with
``serve --metrics-detail``, and what that makes for a 1,000-node fleet.

    .venv/bin/python benchmarks/bench_metrics.py [--runs 5]

One real agent pass (real stages: discovery, audit of 1,225 rows, GPUs from the fixture backend)
with a passing probe result of the current shape for every GPU; the exposition is counted series
by series with prometheus_client's own parser. Also times the exposition's rendering (done once per
pass, never per request).

Target: at most 174 series with the default flags (150 before the GPU's data path: + 3 per GPU),
independent of the number of CPUs and IRQs. What there is grows per GPU (15 series with a full
probe result), per readiness check and per setting id (1 + one per status in use), never per CPU
or IRQ (docs/monitoring.md, "Cardinality").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpu_tune.serve.metrics import render_metrics  # noqa: E402
from tests.fixtures.probes import count_series, probed_pass  # noqa: E402

BUDGET = 174


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="renderings timed (default 5)")
    a = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        default = probed_pass(Path(tmp) / "default")
        targets = probed_pass(Path(tmp) / "targets", metrics_detail=True)
    rows = len(default.audit["settings"])
    ids = len({s["id"] for s in default.audit["settings"]})
    fams = count_series(default.metrics_body)
    n_default, n_targets = sum(fams.values()), sum(count_series(targets.metrics_body).values())
    times = []
    for _ in range(a.runs):
        t0 = time.perf_counter()
        render_metrics(default)
        times.append(time.perf_counter() - t0)

    print(f"fixture dgx-8gpu: 224 CPUs, 8 GPUs, {rows} audit rows in {ids} settings; every GPU probed")
    width = max(len(n) for n in fams)
    for name, n in sorted(fams.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<{width}} {n:5d}")
    print(f"series, default flags:      {n_default:6d}   ({len(default.metrics_body) / 1024:.1f} KiB; "
          f"x 1,000 nodes = {n_default * 1000:,})   target <= {BUDGET}")
    print(f"series, --metrics-detail:   {n_targets:6d}   ({len(targets.metrics_body) / 1024:.1f} KiB; "
          f"x 1,000 nodes = {n_targets * 1000:,})")
    print(f"rendering the default exposition (once per pass): median {statistics.median(times) * 1000:.1f} ms")
    gpus = len(default.gpus)
    per_gpu = sum(n for name, n in fams.items() if name.startswith(("gpu_tune_gpu_", "gpu_tune_probe_")))
    print(f"made of: {per_gpu} per-GPU series ({per_gpu / max(gpus, 1):.0f} x {gpus} GPUs), "
          f"{fams.get('gpu_tune_check_ok', 0)} checks, "
          f"{fams.get('gpu_tune_setting_compliant', 0) + fams.get('gpu_tune_setting_targets', 0)} setting series "
          f"({ids} ids), {n_default - per_gpu - fams.get('gpu_tune_check_ok', 0) - fams.get('gpu_tune_setting_compliant', 0) - fams.get('gpu_tune_setting_targets', 0)} others")
    detail = count_series(targets.metrics_body)
    extra = n_targets - n_default - rows
    # per GPU: the launch-bound busy ratio, the remote node's two bandwidth figures, the probe's phases
    per_gpu_detail = detail.get("gpu_tune_probe_phase_seconds", 0) + 3 * gpus
    ok = n_default <= BUDGET and extra == 2 * detail.get("gpu_tune_collector_success", 0) + per_gpu_detail
    over = f"; {n_default - BUDGET} over" if n_default > BUDGET else ""
    print(f"{'PASS' if ok else 'FAIL'}  {n_default} series per node with the default flags (target <= {BUDGET}{over}); "
          f"--metrics-detail adds one per audit row and {extra} per-stage, launch-bound busy, remote-bandwidth "
          "and probe-phase series")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
