"""Cost and repeatability of ``gpu-tune gain``: two back-to-back comparisons on a fixture host tree.

    .venv/bin/python benchmarks/bench_gain.py [--pairs N] [--window S] [--profile training] [--no-per-setting]

Runs ``gpu-tune gain --root <fixture copy of small-2cpu> --gpu-backend none -o json`` twice, one
after the other (the real probe workload on this machine's CPU; no host file outside the fixture
is written). Prints, per run: wall seconds for the pairs asked for, seconds per probe process, the
images/s ratio with its 95 % interval and the verdict; then whether the two runs' images/s
intervals overlap (they should: two measurements of the same thing) and whether the fixture tree
was left byte for byte as found.

Then one ``--per-setting`` run with its default rounds: its cost in seconds and per probe process,
and each family's verdict.

Goals: the two intervals overlap, the host tree is restored, the comparison with the default pairs
(6, after a warm-up run) costs under 180 s on a 2-core machine, and ``--per-setting`` under 600 s.
Exit 0 when every goal is met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import build_host, gpu_tune_argv  # noqa: E402

BUDGET_S = 180.0
PER_SETTING_BUDGET_S = 600.0


def tree(root: Path) -> dict[str, bytes]:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if rel.startswith("var/lib/gpu-tune") or p.is_symlink() or not p.is_file():
            continue
        out[rel] = p.read_bytes()
    return out


def one(root: Path, a, *extra: str) -> tuple[dict, float]:
    argv = gpu_tune_argv() + ["gain", "--root", str(root), "--gpu-backend", "none", "--profile", a.profile,
                              "-o", "json", *extra]
    if a.pairs:
        argv += ["--pairs", str(a.pairs)]
    if a.window:
        argv += ["--window", str(a.window)]
    t0 = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    took = time.monotonic() - t0
    if p.returncode not in (0, 1) or not p.stdout.strip():
        print(f"gpu-tune gain failed (exit {p.returncode}): {p.stderr.strip()[-400:]}")
        sys.exit(1)
    return json.loads(p.stdout), took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=None, help="[default: gain's own]")
    ap.add_argument("--no-per-setting", action="store_true", help="skip the --per-setting run")
    ap.add_argument("--window", type=float, default=None, help="seconds per launch-bound window")
    ap.add_argument("--profile", default="training")
    a = ap.parse_args()
    root = build_host("small-2cpu")
    before = tree(root)
    intervals = []
    ok = True
    for k in (1, 2):
        doc, took = one(root, a)
        t = doc["targets"][0]
        m = t["measures"]["images_per_second"]
        runs = len(t["runs"])
        print(f"run {k}: {took:.1f} s for {doc['pairs']} pairs ({runs} probe processes, {took / max(runs, 1):.1f} s "
              f"each, {len(doc['switches'])} host switches); images/s untuned {m['median_untuned']}, tuned "
              f"{m['median_tuned']}: {m['change']} -> {m['verdict']}; jitter "
              f"{t['measures']['jitter_p99_over_p50']['change']}")
        intervals.append(m["ci95"])
        if a.pairs is None and took > BUDGET_S:
            print(f"MISSED: {took:.1f} s for the default {doc['pairs']} pairs (goal < {BUDGET_S:.0f} s)")
            ok = False
        elif a.pairs is None:
            print(f"PASS: {took:.1f} s for the default {doc['pairs']} pairs (goal < {BUDGET_S:.0f} s)")
    (a1, b1), (a2, b2) = intervals if all(intervals) else ((None, None), (None, None))
    if a1 is None:
        print("FAIL: a run gave no interval (too few complete pairs)")
        ok = False
    else:
        overlap = max(a1, a2) <= min(b1, b2)
        print(f"{'PASS' if overlap else 'FAIL'}: images/s intervals [{a1}, {b1}] and [{a2}, {b2}] "
              f"{'overlap' if overlap else 'do not overlap'} (goal: they overlap)")
        ok &= overlap
    if not a.no_per_setting:
        doc, took = one(root, a, "--per-setting")
        t = doc["targets"][0]
        runs = len(t["runs"])
        fams = ", ".join(f"{f} {v['verdict']} {v['measures']['images_per_second']['change']}"
                         for f, v in (t.get("families") or {}).items())
        print(f"--per-setting: {took:.1f} s for {doc['pairs']} rounds of {len(doc['arms'])} arms ({runs} probe "
              f"processes, {took / max(runs, 1):.1f} s each, {len(doc['switches'])} host switches): {fams}; "
              f"the whole profile {t['verdict']} {t['measures']['images_per_second']['change']}")
        if a.pairs is None:
            good = took <= PER_SETTING_BUDGET_S
            print(f"{'PASS' if good else 'MISSED'}: --per-setting with its default {doc['pairs']} rounds in "
                  f"{took:.1f} s (goal < {PER_SETTING_BUDGET_S:.0f} s)")
            ok &= good
    restored = tree(root) == before
    print(f"{'PASS' if restored else 'FAIL'}: fixture host tree {'restored byte for byte' if restored else 'CHANGED'}")
    return 0 if ok and restored else 1


if __name__ == "__main__":
    sys.exit(main())
