"""Topology and audit cost on the 8-GPU fixture (224 CPUs, ~1,000 MSI-X IRQs).

    .venv/bin/python benchmarks/bench_topology.py [--runs N]

Prints the in-process medians of ``discover`` (target < 50 ms) and of the ``irq.affinity`` read,
and the whole-process medians of ``gpu-tune topology`` and ``gpu-tune audit`` (targets < 0.6 s).
Exit 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpu_tune.gpu import select_backend  # noqa: E402
from gpu_tune.host.fs import HostFS  # noqa: E402
from gpu_tune.tune.knobs.base import Context  # noqa: E402
from gpu_tune.tune.knobs.irq_affinity import IrqAffinityKnob  # noqa: E402
from gpu_tune.tune.policy import load_profile  # noqa: E402
from gpu_tune.discover.topology import discover  # noqa: E402
from tests.fixtures import hostgen, pcigen  # noqa: E402

GPU_JSON = pcigen.GPU_JSON_DIR / "dgx-8gpu.json"


def median_s(fn, runs: int) -> float:
    fn()  # warm the page cache
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gpu_tune() -> list[str]:
    exe = Path(sys.executable).parent / "gpu-tune"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "gpu_tune"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--process-runs", type=int, default=7)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-topology-"))
    ok = True
    try:
        root = hostgen.build("dgx-8gpu", tmp / "host")
        fs = HostFS(root)
        backend = select_backend("fixture", str(GPU_JSON))
        topo = discover(fs, backend)
        nirq = sum(len(d.irqs) for d in (*topo.gpus, *topo.nics))
        print(f"fixture dgx-8gpu: {len(topo.cpus_online)} CPUs, {len(topo.gpus)} GPUs, {len(topo.nics)} NICs, "
              f"{nirq} device IRQs")
        d = median_s(lambda: discover(fs, backend), a.runs)
        ok &= d < 0.050
        print(f"discover (in-process)           median {d * 1000:7.1f} ms   target < 50 ms")
        prof = load_profile("training")
        r = median_s(lambda: IrqAffinityKnob().read(Context(fs=fs, profile=prof, gpu=backend)), a.runs)
        print(f"irq.affinity read (in-process)  median {r * 1000:7.1f} ms   (discover included)")
        env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
        base = gpu_tune() + ["--root", str(root), "--gpu-backend", "fixture", "--gpu-fixture", str(GPU_JSON)]
        for name, args in (("topology", ["topology"]), ("topology -o json", ["-o", "json", "topology"]),
                           ("audit", ["audit"]), ("audit -o json", ["-o", "json", "audit"])):
            probe = subprocess.run(base + args, capture_output=True, text=True, env=env, timeout=120)
            if probe.returncode not in (0, 1):
                print(f"gpu-tune {name:<16} skipped (exit {probe.returncode}: {probe.stderr.strip()[:120]})")
                continue
            t = median_s(lambda: subprocess.run(base + args, capture_output=True, env=env, timeout=120),
                         a.process_runs)
            ok &= t < 0.6
            print(f"gpu-tune {name:<22} median {t * 1000:7.1f} ms   target < 600 ms (whole process)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("all targets met" if ok else "TARGET MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
