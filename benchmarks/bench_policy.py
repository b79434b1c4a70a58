#!/usr/bin/env python3
"""`gpu-tune check` on the 8-GPU fixture with an operator's policy of 50 rules (docs/health.md "Your
policy"): what the policy step costs, whole process and in process.

    .venv/bin/python benchmarks/bench_policy.py [--runs 9] [--json]

Prints the median wall and CPU seconds of `gpu-tune check -o json` on the DGX-like fixture
(224 CPUs, 8 H100, 8 InfiniBand ports):

- with the shipped training profile (4 repeat rules, the default);
- with a profile of 50 rules: 20 under readiness.checks (names, family names, the probe's pattern),
  30 under readiness.xid (15 repeat rules, 15 actions, some for XIDs the catalog does not know);
- the same, with a kernel log of 8,000 XID records that those rules count (20 bursts of 50
  records for each of 8 GPUs): the bursts are kept and counted in health.json.

and, in process: loading and checking the 50 rules, and weighing one verdict's checks by them.
Target: < 1 s for `check` with the 50 rules (what a Slurm prolog can afford on every job).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._util import build_host, gpu_tune_argv, report, time_process  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TARGET_S = 1.0
GPUS = ("0000:18:00", "0000:2a:00", "0000:3a:00", "0000:5d:00", "0000:9a:00", "0000:ab:00", "0000:ba:00", "0000:db:00")
CHECKS = {"gpu.inforom": "fatal", "gpu.clocks": "fatal", "gpu.pcie_errors": "off", "network.link_flaps": "fatal",
          "gpu.readings": "off", "gpu.health_state": "warning", "gpu.kernel_log": "fatal", "gpu.xid_unknown": "off",
          "gpu.xid_recurring": "fatal", "gpu.recovery_p2p": "fatal", "network": "warning", "thermal": "warning",
          "device_plugin": "off", "driver": "warning", "published": "fatal", "probe.*.passed": "off",
          "probe.0.passed": "warning", "probe.cpu.passed": "fatal", "slurm.gres": "warning", "tuning.compliant": "off"}
REPEAT = (8, 11, 13, 14, 25, 31, 32, 37, 38, 39, 40, 41, 43, 44, 45)  # not fatal at their first record
PLAIN = {**{c: "reset_gpu" for c in (1000, 1001, 1002, 1003, 1004)}, **{c: "ignore" for c in (79, 48, 74, 63, 64)},
         **{c: "inspect_hw" for c in (94, 92, 95, 119, 120)}}


def policy_yaml() -> str:
    lines = ["include: training.yaml", "readiness:", "  checks:"]
    lines += [f"    {k}: {v}" for k, v in CHECKS.items()]
    lines += ["  xid:"]
    lines += [f"    {c}: {{action: reset_gpu, count: 30, within: 6h}}" for c in REPEAT]
    lines += [f"    {c}: {a}" for c, a in PLAIN.items()]
    return "\n".join(lines) + "\n"


def burst_log(path: Path, base: str) -> int:
    """20 bursts of 50 records of XID 13 on each GPU (one a minute): 8,000 records."""
    n = 0
    with open(path, "w") as f:
        f.write(base)
        for burst in range(20):
            for g, bus in enumerate(GPUS):
                for k in range(50):
                    usec = 600_000_000 + burst * 60_000_000 + g * 1_000_000 + k * 1000
                    f.write(f"4,{1000 + n},{usec},-;NVRM: Xid (PCI:{bus}): 13, pid=42, name=python3, Graphics "
                            "Exception\n")
                    n += 1
    return n


def in_process(policy_dir: Path, runs: int) -> tuple[float, float]:
    """(ms to load and check the 50 rules, µs to weigh one verdict's checks by them), medians."""
    from gpu_tune.judge.checks.base import Check
    from gpu_tune.judge.policy import DECLARED, policy_of
    from gpu_tune.tune.policy import load_profile

    loads, weighs = [], []
    checks = [Check(n.replace("*", "3"), True, "ok") for n in DECLARED] * 3
    for _ in range(runs):
        t0 = time.perf_counter()
        prof = load_profile("fifty", policy_dir)
        pol = policy_of(prof)
        loads.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        pol.weigh(checks)
        weighs.append(time.perf_counter() - t0)
    return statistics.median(loads) * 1000, statistics.median(weighs) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    root = build_host("dgx-8gpu")
    work = Path(tempfile.mkdtemp(prefix="gpu-tune-bench-policy-"))
    policies = work / "policies"
    policies.mkdir()
    (policies / "fifty.yaml").write_text(policy_yaml())
    shutil.copy(REPO / "policies" / "baselines.yaml", policies)
    rules = len(CHECKS) + len(REPEAT) + len(PLAIN)
    fixture = REPO / "tests" / "fixtures" / "gpu" / "dgx-8gpu.json"
    figures: dict[str, dict[str, float]] = {}

    def measure(name: str, *extra: str) -> float:
        argv = gpu_tune_argv() + ["check", "--root", str(root), "--gpu-fixture", str(fixture), "-o", "json", *extra]
        cpu: list[float] = []
        wall = time_process(argv, runs=a.runs, cpu=cpu)
        figures[name] = {"wall_s": round(statistics.median(wall), 3), "cpu_s": round(statistics.median(cpu), 3)}
        if not a.json:
            print(f"gpu-tune check, {name}: median {figures[name]['wall_s']:.3f} s wall, "
                  f"{figures[name]['cpu_s']:.3f} s CPU ({a.runs} runs)")
        return figures[name]["wall_s"]

    measure("training (the shipped default)")
    fifty = measure(f"a policy of {rules} rules", "--policy-dir", str(policies), "--profile", "fifty")
    records = burst_log(root / "dev/kmsg", (root / "dev/kmsg").read_text())
    shutil.rmtree(root / "var/lib/gpu-tune", ignore_errors=True)
    busy = measure(f"a policy of {rules} rules, {records:,} XID records counted", "--policy-dir", str(policies),
                   "--profile", "fifty")
    load_ms, weigh_us = in_process(policies, max(a.runs, 20))
    figures["in process"] = {"load_and_check_ms": round(load_ms, 2), "weigh_us": round(weigh_us, 1)}
    if not a.json:
        print(f"in process: loading and checking the {rules} rules {load_ms:.1f} ms; weighing one verdict's checks "
              f"{weigh_us:.0f} µs")
        print(f"target: check with {rules} rules < {TARGET_S:.1f} s")
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    return report({f"check with {rules} rules < {TARGET_S:.0f} s": fifty < TARGET_S,
                   f"check with {rules} rules and {records:,} XID records < {TARGET_S:.0f} s": busy < TARGET_S},
                  a.json, {"rules": rules, "figures": figures})


if __name__ == "__main__":
    sys.exit(main())
