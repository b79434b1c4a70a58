"""What ``gpu-tune gain`` says on this machine, counted over many runs: A/A (``--null``: both sides
untuned, so every gain or LOSS is a false alarm), the profile, and ``--per-setting``.

    .venv/bin/python benchmarks/bench_gain_calibration.py [--mode null|profile|per-setting]
        [--runs N] [--hogs K] [--pairs P] [--window S] [--profile training] [--out FILE.jsonl]
        [--old-rule]
    .venv/bin/python benchmarks/bench_gain_calibration.py --mode synthetic [--runs 1000]

Each run is one real ``gpu-tune gain --root <fixture copy of small-2cpu> --gpu-backend none -o
json`` (the probe on this machine's CPU; nothing outside the fixture tree is written). ``--hogs K``
keeps K busy loops running for the whole series (``K = nproc``: every CPU busy). Prints one line per
run (verdict, images/s change and interval, seconds, median CPU pressure) and then the counts:
how many runs said gain, LOSS, no significant difference and inconclusive, and the false-alarm
rate of the A/A runs with its 95 % upper bound (Clopper-Pearson), against the 5 % (2.5 % each way)
a 95 % verdict promises.

``--mode synthetic`` runs no process: the A/A experiments of ``tests/test_gain_stats.py`` (3 noise
kinds x 5 load shapes, at 3, 6 and 8 pairs, in the order gpu-tune gain runs its pairs; ``--runs``
experiments per shape, default 1,000), each judged by today's rule and by the t interval alone,
and prints the false LOSS and gain counts per shape and in all (about 30 s).

``--old-rule`` re-judges every run's pairs with the t interval alone (the rule before the exact
test, no warm-up run discarded is not replayed): what the same runs would have been called then.
``--out`` appends every run's document (one JSON per line) for later study.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import build_host, gpu_tune_argv  # noqa: E402


def clopper_pearson_upper(k: int, n: int, conf: float = 0.95) -> float:
    """The one-sided upper bound of a binomial proportion (bisection on the binomial tail)."""
    if n == 0:
        return 1.0
    if k >= n:
        return 1.0
    alpha = 1 - conf

    def tail(p: float) -> float:  # P(X <= k)
        return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1))

    lo, hi = k / n, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if tail(mid) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def t_only(logs: list[float]) -> str:
    """The verdict by the t interval (95 %) of the pairs' log ratios alone: the rule before the
    exact test."""
    from gpu_tune.judge.gain.stats import GAIN, INCONCLUSIVE, LOSS, SAME, TOLERANCE, t975

    n = len(logs)
    if n < 3:
        return INCONCLUSIVE
    m = sum(logs) / n
    half = t975(n - 1) * math.sqrt(sum((x - m) ** 2 for x in logs) / (n - 1)) / math.sqrt(n)
    lo, hi = math.exp(m - half), math.exp(m + half)
    if lo > 1:
        return GAIN
    if hi < 1:
        return LOSS
    return SAME if lo >= 1 - TOLERANCE and hi <= 1 + TOLERANCE else INCONCLUSIVE


def old_rule(doc: dict) -> str:
    """The images/s verdict of a ``gpu-tune gain`` document by the t interval alone."""
    t = doc["targets"][0]
    by: dict[int, dict] = {}
    for r in t["runs"]:
        if not r.get("warmup") and r.get("ok"):
            by.setdefault(r["pair"], {})[r["side"]] = r
    names = [a["name"] for a in doc["arms"]]
    a_name, b_name = names[0], names[-1]
    return t_only([math.log(p[b_name]["images_per_second"] / p[a_name]["images_per_second"])
                   for p in by.values() if a_name in p and b_name in p])


def synthetic(per_shape: int) -> int:
    import zlib

    from gpu_tune.judge.gain.stats import GAIN, LOSS, compare
    from tests.test_gain_stats import aa_experiment

    LOADS = ("steady", "drift", "bursts", "hogs", "periodic")

    print(f"A/A experiments, {per_shape} per shape: false LOSS and gain, by the t interval alone and by "
          "today's rule (interval and sign-flip test)")
    print(f"{'noise':7} {'load':7} {'pairs':>5}   {'t alone: loss':>13} {'gain':>5}   {'now: loss':>9} {'gain':>5}")
    for n in (3, 6, 8):
        tot = [0, 0, 0, 0]
        for kind in ("normal", "heavy", "skewed"):
            for load in LOADS:
                c = [0, 0, 0, 0]
                for s in range(per_shape):
                    a, b = aa_experiment(n, kind, load, seed=zlib.crc32(f"doc/{kind}/{load}/{n}/{s}".encode()))
                    o = t_only([math.log(y / x) for x, y in zip(a, b)])
                    v = compare("images_per_second", a, b).verdict
                    c[0] += o == LOSS
                    c[1] += o == GAIN
                    c[2] += v == LOSS
                    c[3] += v == GAIN
                tot = [x + y for x, y in zip(tot, c)]
                print(f"{kind:7} {load:7} {n:5}   {c[0]:13} {c[1]:5}   {c[2]:9} {c[3]:5}")
        k = 3 * len(LOADS) * per_shape
        print(f"{n} pairs, all {k:,}: t alone LOSS {tot[0]} ({tot[0] / k:.1%}), gain {tot[1]} ({tot[1] / k:.1%}); "
              f"now LOSS {tot[2]} ({tot[2] / k:.1%}), gain {tot[3]} ({tot[3] / k:.1%}); promised at most 2.5% each")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("null", "profile", "per-setting", "synthetic"), default="null")
    ap.add_argument("--runs", type=int, default=None, help="runs [default: 10; 1,000 per shape with synthetic]")
    ap.add_argument("--hogs", type=int, default=0, help="busy loops kept running (nproc: every CPU busy)")
    ap.add_argument("--pairs", type=int, default=None, help="gpu-tune gain --pairs [default: gain's own]")
    ap.add_argument("--window", type=float, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--profile", default="training")
    ap.add_argument("--out", default=None, help="append each run's JSON document to this file")
    ap.add_argument("--old-rule", action="store_true", help="also judge by the t interval alone")
    a = ap.parse_args()
    if a.mode == "synthetic":
        return synthetic(a.runs or 1000)
    a.runs = a.runs or 10

    hogs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(a.hogs)]
    counts: dict[str, int] = {}
    old_counts: dict[str, int] = {}
    seconds: list[float] = []
    fams: dict[str, dict[str, int]] = {}
    try:
        print(f"mode {a.mode}, {a.runs} run(s), {a.hogs} busy loop(s), load average {os.getloadavg()[0]:.2f}",
              flush=True)
        for i in range(a.runs):
            root = build_host("small-2cpu")
            argv = gpu_tune_argv() + ["gain", "--root", str(root), "--gpu-backend", "none", "--profile", a.profile,
                                      "-o", "json"]
            argv += {"null": ["--null"], "profile": [], "per-setting": ["--per-setting"]}[a.mode]
            if a.pairs:
                argv += ["--pairs", str(a.pairs)]
            if a.window:
                argv += ["--window", str(a.window)]
            if a.warmup is not None:
                argv += ["--warmup", str(a.warmup)]
            t0 = time.monotonic()
            p = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
            took = time.monotonic() - t0
            if p.returncode not in (0, 1) or not p.stdout.strip():
                print(f"run {i + 1}: gpu-tune gain failed (exit {p.returncode}): {p.stderr.strip()[-300:]}")
                return 1
            doc = json.loads(p.stdout)
            if a.out:
                with open(a.out, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps({"mode": a.mode, "hogs": a.hogs, "seconds": took, "doc": doc}) + "\n")
            seconds.append(took)
            t = doc["targets"][0]
            m = t["measures"]["images_per_second"]
            counts[doc["verdict"]] = counts.get(doc["verdict"], 0) + 1
            extra = ""
            if a.old_rule:
                o = old_rule(doc)
                old_counts[o] = old_counts.get(o, 0) + 1
                extra = f"; t interval alone: {o}"
            for fam, f in (t.get("families") or {}).items():
                fams.setdefault(fam, {})
                fams[fam][f["verdict"]] = fams[fam].get(f["verdict"], 0) + 1
            busy = t.get("busy") or {}
            pr = busy.get("cpu_pressure_median")
            print(f"run {i + 1}: {doc['verdict']}: {m['change']} ({doc['pairs']} pairs, {took:.0f} s, CPU pressure "
                  f"{'-' if pr is None else f'{pr * 100:.0f}%'}, load {os.getloadavg()[0]:.2f}){extra}", flush=True)
    finally:
        for h in hogs:
            h.kill()
    n = a.runs
    print(f"\nverdicts over {n} runs: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if a.old_rule:
        print("the t interval alone would have said: " + ", ".join(f"{k} {v}" for k, v in sorted(old_counts.items())))
    for fam, c in fams.items():
        print(f"  {fam}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    secs = sorted(seconds)
    print(f"seconds per run: median {secs[len(secs) // 2]:.0f} (min {secs[0]:.0f}, max {secs[-1]:.0f})")
    if a.mode == "null":
        alarms = counts.get("gain", 0) + counts.get("loss", 0)
        up = clopper_pearson_upper(alarms, n)
        print(f"A/A false alarms (gain or LOSS): {alarms} of {n} ({alarms / n:.0%}); 95% upper bound {up:.0%}; "
              "a 95% verdict promises at most 5%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
