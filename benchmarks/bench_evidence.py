#!/usr/bin/env python3
"""Evidence kept at a hardware fault (docs/health.md "Evidence"): what the pass costs, and the
stand-in ``nvidia-bug-report.sh`` (tests/fixtures/bugreport) that is slow, huge or never exits.

    .venv/bin/python benchmarks/bench_evidence.py [--runs 3] [--deadline 5] [--huge-mib 256]

``gpu-tune check`` on the 8-GPU fixture host (its boot id made this machine's, so the bug report is
run) with a fatal XID, a fresh state folder each run; per case the median of ``--runs``:

- ``healthy``: no fault (no evidence; the floor);
- ``no bug report``: the fault, its bundle written, no ``nvidia-bug-report.sh`` on PATH;
- ``slow``: the stand-in waits until told (it is told after the pass returned);
- ``huge``: it prints ``--huge-mib`` MiB and writes as much into its report (the bundle's cap:
  64 MiB, the default);
- ``hang``: it ignores SIGTERM, starts a child and one that leaves its group, never exits
  (deadline ``--deadline`` s).

Printed per case (the cases interleaved run by run): the pass's wall and CPU time, the time until the bug report said it was done (from the
pass's start), the bytes kept in the bundle (the report's, and its output kept of produced), and the
stand-in's processes left running afterwards. Then the memory the evidence code costs a process
that imports it (the agent does only when a fault appears).

Targets: a pass with any stand-in within 0.5 s of the pass without one (it never waits); every
bundle within its cap; 0 processes left.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._util import REPO, build_host, gpu_tune_argv  # noqa: E402
from tests.evidence_kit import STANDIN_DIR, alive, this_machine, xid  # noqa: E402

FIXTURE = REPO / "tests" / "fixtures" / "gpu" / "dgx-8gpu.json"
FOLDER = "var/lib/gpu-tune/evidence"
DONE = ("finished", "cut at the deadline", "cut at the size cap", "failed", "not run")
SLACK_S = 0.5


def policies(tmp: Path) -> Path:
    folder = tmp / "policies"
    folder.mkdir()
    shutil.copy(REPO / "policies" / "baselines.yaml", folder)
    (folder / "health.yaml").write_text("include: training.yaml\nreadiness:\n  require_compliant: false\n")
    return folder


def one(root: Path, pol: Path, tmp: Path, mode: str | None, fault: bool, args) -> dict:
    shutil.rmtree(root / "var/lib/gpu-tune", ignore_errors=True)
    (tmp / "pids").unlink(missing_ok=True)
    (tmp / "go").unlink(missing_ok=True)
    (root / "dev/kmsg").write_text(args.kmsg + (xid(90, 88_310_022) if fault else ""))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_TUNE_", "STANDIN_"))}
    env["PYTHONPATH"] = str(REPO)
    if mode is None:
        env["PATH"] = "/usr/sbin:/usr/bin:/sbin:/bin"
    else:
        env.update(PATH=f"{STANDIN_DIR}:{env.get('PATH', '/usr/bin:/bin')}", STANDIN_MODE=mode,
                   STANDIN_PIDS=str(tmp / "pids"), STANDIN_GO=str(tmp / "go"), STANDIN_MIB=str(args.huge_mib),
                   GPU_TUNE_EVIDENCE_BUG_REPORT_TIMEOUT=str(args.deadline))
    argv = gpu_tune_argv() + ["check", "--root", str(root), "--gpu-fixture", str(FIXTURE), "--policy-dir", str(pol),
                              "--profile", "health", "-o", "json"]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, env=env)
    took = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the pass's own (the worker is not our child)
    out = {"pass_s": took, "cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), "rc": r.returncode}
    if not fault:
        return out
    doc = json.loads(r.stdout)
    name = doc["evidence"]["bundles"][0]["name"]
    folder = root / FOLDER / name
    if mode == "slow":
        (tmp / "go").touch()  # told only now: the pass above could not have waited for it
    while True:
        st = json.loads((folder / "nvidia-bug-report.json").read_text())
        if st.get("state") in DONE:
            break
        if time.perf_counter() - t0 > args.deadline + 120:
            raise SystemExit(f"{mode}: the bug report never said it was done: {st}")
        time.sleep(0.02)
    out["done_s"] = time.perf_counter() - t0
    out["state"] = st["state"]
    out["bundle_bytes"] = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    out["report_bytes"] = sum(f.get("bytes", 0) for f in st.get("files", []))
    out["output"] = st.get("output", {})
    pids = [int(x) for x in (tmp / "pids").read_text().split()] if (tmp / "pids").exists() else []
    out["left"] = sum(1 for p in pids if alive(p)) + int(st.get("left", 0))
    out["started"] = len(pids)
    return out


def import_cost() -> float:
    """MB of RSS that importing the evidence code adds to a process that has the agent's modules."""
    code = ("import resource, gc\n"
            "from gpu_tune.serve import agent, stages\n"
            "from gpu_tune.judge.checks import monitor\n"
            "def rss():\n"
            "    return int(open('/proc/self/statm').read().split()[1]) * resource.getpagesize() / 1e6\n"
            "gc.collect(); a = rss()\n"
            "from gpu_tune.judge.evidence import keeper, listing, bugreport\n"
            "gc.collect(); print(rss() - a)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ,
                       "PYTHONPATH": str(REPO)}, check=True)
    return float(r.stdout.strip())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--deadline", type=int, default=5)
    ap.add_argument("--huge-mib", type=int, default=256)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpu-tune-bench-evidence-"))
    root = build_host("dgx-8gpu")
    this_machine(root)
    args.kmsg = (root / "dev/kmsg").read_text()
    pol = policies(tmp)
    cases = [("healthy", None, False), ("no bug report", None, True), ("slow", "slow", True), ("huge", "huge", True),
             ("hang", "hang", True)]
    rows: dict[str, list[dict]] = {label: [] for label, _, _ in cases}
    for _ in range(args.runs):  # interleaved: a neighbour's load falls on every case alike
        for label, mode, fault in cases:
            rows[label].append(one(root, pol, tmp, mode, fault, args))
    floor = statistics.median(r["pass_s"] for r in rows["no bug report"])
    ok = True
    print(f"gpu-tune check, 8-GPU fixture, {args.runs} run(s) each (median; bundle cap 64 MiB, deadline "
          f"{args.deadline} s):")
    for label, runs in rows.items():
        p = statistics.median(r["pass_s"] for r in runs)
        line = f"  {label:14s} pass {p:6.3f} s wall, {statistics.median(r['cpu_s'] for r in runs):5.3f} s CPU"
        if "done_s" in runs[0]:
            last = runs[-1]
            out = last["output"]
            line += (f"; bug report {last['state']} at {statistics.median(r['done_s'] for r in runs):6.2f} s; "
                     f"bundle {last['bundle_bytes']:,} bytes (report {last['report_bytes']:,}, its output "
                     f"{out.get('kept', 0):,} of {out.get('produced', 0):,}); processes started "
                     f"{last['started']}, left {max(r['left'] for r in runs)}")
            ok &= all(r["bundle_bytes"] <= 64 << 20 and r["left"] == 0 for r in runs)
            if label in ("slow", "huge", "hang"):
                ok &= p <= floor + SLACK_S
        print(line)
    mb = import_cost()
    print(f"  the evidence code imported: +{mb:.1f} MB RSS (only once a fault appears; a healthy agent never "
          "imports it)")
    print(f"{'PASS' if ok else 'MISSED'}: the pass never waits for the bug report (within {SLACK_S} s of the pass "
          "without one), every bundle within its cap, 0 processes left")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
