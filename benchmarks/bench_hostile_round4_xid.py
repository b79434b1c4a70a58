#!/usr/bin/env python3
"""Hostile kernel logs: one ``gpu-tune check`` pass over each, on the 8-GPU fixture host, in a
process of its own; then the reader and the judge alone, in process.

    .venv/bin/python benchmarks/bench_hostile_round4_xid.py [--runs 3] [--scale 1.0] [--only NAME]
                                                            [--code DIR] [--json]

Cases (``--scale`` multiplies the record counts; 1.0 is the size each was first found at):

- ``healthy``: the fixture's own short kernel log (the reference the others are compared with).
- ``newest-10M``: 10,000,000 short records (about 250 MB; the newest 32 MiB hold 1.4 million of
  them, more than one read takes), the last one ``NVRM: Xid (PCI:0000:5d:00): 79``: the newest
  records must be the ones judged (not ready, ``FatalXid`` on GPU 3).
- ``flood-13``: 100,000 records of XID 13 on 100,000 distinct invented PCI addresses (far more
  than the 1,024 non-fatal sightings kept), then a real XID 79 on GPU 3: the 79 must be kept.
- ``forged-32M``: a 32 MiB ring (the largest ``CONFIG_LOG_BUF_SHIFT`` allows) of records at
  priority 14 (facility user, as any write to ``/dev/kmsg`` gets) each naming XID 79 on GPU 0:
  all ignored and counted (ready).
- ``xid13-32M``: a 32 MiB ring of the kernel's own XID 13 records on GPU 0 (an application
  faulting in a loop): every record is parsed and counted, the costliest read (ready).

Printed per case: whether the verdict is the right one, exit status, and the medians over
``--runs`` of wall seconds, CPU seconds and peak RSS (``wait4``) of the ``gpu-tune check``
process; then, in process, the median time of one read of the log by the XID reader with the
catalog's rank and of the judging (:func:`gpu_tune.judge.readiness.verdict`), and the reader's
peak traced memory (one more run, traced). ``--code DIR`` runs the commands with the ``gpu_tune``
package of another checkout (the revision before a change, for a before/after table; the in-process
figures are this checkout's only).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._util import report  # noqa: E402

from tests.fixtures import hostgen  # noqa: E402

FIXTURE = REPO / "tests" / "fixtures" / "gpu" / "dgx-8gpu.json"
XID79 = "NVRM: Xid (PCI:{bus}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
GPU0, GPU3 = "0000:18:00", "0000:5d:00"


def _write_records(path: Path, make, n: int, tail: str = "") -> None:
    """Append ``n`` records ``make(i)`` (then ``tail``) in pieces: this process stays small."""
    with open(path, "a", encoding="ascii") as f:
        for lo in range(0, n, 200_000):
            f.write("".join(make(i) for i in range(lo, min(n, lo + 200_000))))
        f.write(tail)


def case_healthy(root: Path, scale: float) -> str:
    return "the fixture's kernel log (7 records)"


def case_newest(root: Path, scale: float) -> str:
    n = max(1, int(10_000_000 * scale))
    _write_records(root / "dev/kmsg", lambda i: f"6,{100 + i},{20_000_000 + i},-;ok\n", n,
                   f"3,{100 + n},{20_000_000 + n},-;{XID79.format(bus=GPU3)}\n")
    return f"{n + 1:,} records, {(root / 'dev/kmsg').stat().st_size / 1e6:.0f} MB, XID 79 last"


def case_flood(root: Path, scale: float) -> str:
    n = max(1, int(100_000 * scale))
    _write_records(root / "dev/kmsg", lambda i: f"4,{100 + i},{20_000_000 + i},-;NVRM: Xid (PCI:{1 + i // 65536:04x}:"
                   f"{i // 256 % 256:02x}:{i % 256:02x}): 13, pid=4242, name=python3, Graphics Exception\n", n,
                   f"3,{100 + n},{20_000_000 + n},-;{XID79.format(bus=GPU3)}\n")
    return f"{n:,} distinct XID 13, then XID 79"


def case_forged(root: Path, scale: float) -> str:
    size = max(1, int((32 << 20) * scale))
    line = lambda i: f"14,{100 + i},{20_000_000 + i},-;{XID79.format(bus=GPU0)}\n"  # noqa: E731
    n = size // len(line(500_000))
    _write_records(root / "dev/kmsg", line, n)
    return f"{n:,} user-facility records, {(root / 'dev/kmsg').stat().st_size / (1 << 20):.1f} MiB"


def case_xid13(root: Path, scale: float) -> str:
    size = max(1, int((32 << 20) * scale))
    line = lambda i: f"4,{100 + i},{20_000_000 + i},-;NVRM: Xid (PCI:{GPU0}): 13, pid=4242, name=python3, Graphics Exception\n"  # noqa: E501,E731
    n = size // len(line(500_000))
    _write_records(root / "dev/kmsg", line, n)
    return f"{n:,} kernel XID 13 records, {(root / 'dev/kmsg').stat().st_size / (1 << 20):.1f} MiB"


CASES = {  # name: (build, expected exit, expected reason, words in the message or in gpu.xid's detail)
    "healthy": (case_healthy, 0, "AllChecksPassed", ""),
    "newest-10M": (case_newest, 1, "FatalXid", "GPU 3: XID 79"),
    "flood-13": (case_flood, 1, "FatalXid", "GPU 3: XID 79"),
    "forged-32M": (case_forged, 0, "AllChecksPassed", "not written by the kernel ignored"),
    "xid13-32M": (case_xid13, 0, "AllChecksPassed", "no fatal XID"),
}


# A small process that runs the command and reports its wait4 figures: a child's peak RSS counts
# what the process that forked it held at the fork, and this one is small (the benchmark is not).
LAUNCH = r"""
import json, os, signal, sys, time
out, limit, argv = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
t0 = time.monotonic()
pid = os.fork()
if pid == 0:
    try:
        os.execvp(argv[0], argv)
    finally:
        os._exit(127)
signal.signal(signal.SIGALRM, lambda *_: os.kill(pid, signal.SIGKILL))
signal.setitimer(signal.ITIMER_REAL, limit)
_, st, ru = os.wait4(pid, 0)
took = time.monotonic() - t0
with open(out, "w") as f:
    json.dump({"exit": os.waitstatus_to_exitcode(st), "seconds": took, "cpu_seconds": ru.ru_utime + ru.ru_stime,
               "peak_rss_mb": ru.ru_maxrss / 1024}, f)
"""


def run_check(root: Path, code: Path, timeout: float) -> dict:
    """One ``gpu-tune check -o json`` process: exit, verdict, wall and CPU seconds, peak RSS."""
    argv = [sys.executable, "-m", "gpu_tune", "check", "--root", str(root), "--gpu-fixture", str(FIXTURE),
            "--profile", "health", "--policy-dir", str(root.parent / "policies"), "-o", "json"]
    figures = root.parent / "figures.json"
    p = subprocess.run([sys.executable, "-c", LAUNCH, str(figures), str(timeout), *argv], capture_output=True,
                       cwd=code, env={**os.environ, "PYTHONPATH": str(code)})
    r = json.loads(figures.read_text())
    err = p.stderr.decode(errors="replace").strip()
    try:
        doc = json.loads(p.stdout or b"{}")
    except ValueError:
        doc = {}
    xid = next((c["detail"] for c in doc.get("checks", []) if c["name"] == "gpu.xid"), "")
    return {**r, "reason": doc.get("reason", ""), "message": doc.get("message", ""), "xid_detail": xid,
            "stderr_tail": err.splitlines()[-1][:200] if err else ""}


def in_process(root: Path, runs: int) -> dict:
    """The XID reader over the whole log (catalog rank, the fixture's GPUs) and the verdict."""
    from gpu_tune.discover.xids import read_kernel_xids
    from gpu_tune.host.fs import HostFS
    from gpu_tune.host.kmsg import KernelLog
    from gpu_tune.judge.checks.catalog import sighting_rank
    from gpu_tune.judge.checks.monitor import HealthMonitor
    from gpu_tune.judge.readiness import verdict
    from gpu_tune.tune.policy import load_profile
    from gpu_tune.gpu import select_backend

    gpus = select_backend("fixture", str(FIXTURE)).gpus()
    own = [g.pci_bus_id for g in gpus]
    reads, judges = [], []
    status = None
    for _ in range(runs):
        t0 = time.perf_counter()
        sightings, status = read_kernel_xids(KernelLog(HostFS(root)), sighting_rank, own)
        reads.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        host, view = HealthMonitor(HostFS(root), persist=False).read(gpus)
        verdict(profile=load_profile("training"), audit={"settings": []}, gpus=gpus, topology={},
                probes=[{"gpu": "0", "passed": True}], host=host, history=view)
        judges.append(time.perf_counter() - t0)
    tracemalloc.start()
    read_kernel_xids(KernelLog(HostFS(root)), sighting_rank, own)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"read_s": statistics.median(reads), "read_and_judge_s": statistics.median(judges),
            "reader_peak_mb": peak / 1e6, "scanned": status.scanned if status else 0,
            "sightings": len(sightings), "foreign": status.foreign if status else 0,
            "skipped": status.skipped if status else 0, "skipped_bytes": status.skipped_bytes if status else 0,
            "dropped": status.dropped if status else 0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="gpu-tune check runs per case (default 3): medians")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every case's size (default 1.0)")
    ap.add_argument("--only", default="", help="run only the cases whose name contains this")
    ap.add_argument("--code", type=Path, default=REPO, help="the checkout whose gpu_tune the commands run")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before a command is killed")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    a = ap.parse_args()
    results, checks = {}, {}
    dgx = hostgen.build("dgx-8gpu", Path(tempfile.mkdtemp(prefix="bench-hostile4-")) / "h")
    for name, (build, want_exit, want_reason, words) in CASES.items():
        if a.only not in name:
            continue
        tmp = Path(tempfile.mkdtemp(prefix="bench-hostile4-"))
        try:
            root = tmp / "h"
            shutil.copytree(dgx, root, symlinks=True)
            (tmp / "policies").mkdir()
            (tmp / "policies/health.yaml").write_text("include: training.yaml\nreadiness:\n  require_compliant: false\n")
            shutil.copy(REPO / "policies" / "baselines.yaml", tmp / "policies")
            what = build(root, a.scale)
            runs = [run_check(root, a.code.resolve(), a.timeout) for _ in range(a.runs)]
            r = runs[-1]
            right = (r["exit"] == want_exit and r["reason"] == want_reason
                     and (words in r["message"] or words in r["xid_detail"]))
            res = {"input": what, "right": right, "exit": r["exit"], "reason": r["reason"],
                   "seconds": statistics.median(x["seconds"] for x in runs),
                   "cpu_seconds": statistics.median(x["cpu_seconds"] for x in runs),
                   "peak_rss_mb": statistics.median(x["peak_rss_mb"] for x in runs),
                   "xid_detail": r["xid_detail"][:400], "stderr_tail": r["stderr_tail"]}
            if a.code.resolve() == REPO:
                res["in_process"] = in_process(root, max(1, a.runs))
            results[name] = res
            checks[f"{name}: exit {want_exit}, {want_reason}"] = right
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if not a.json:
            print(f"{name:11} {res['input']:48} {'right' if right else 'WRONG'}: exit {res['exit']} {res['reason']:16} "
                  f"median {res['seconds']:6.2f} s wall, {res['cpu_seconds']:6.2f} s CPU, "
                  f"{res['peak_rss_mb']:6.1f} MB peak RSS", flush=True)
            ip = res.get("in_process")
            if ip:
                print(f"{'':11} in process: read {ip['read_s']:.2f} s ({ip['scanned']:,} records), read and judge "
                      f"{ip['read_and_judge_s']:.2f} s, reader peak {ip['reader_peak_mb']:.1f} MB traced; "
                      f"{ip['sightings']} sightings kept, {ip['dropped']:,} dropped, {ip['foreign']:,} foreign, "
                      f"{ip['skipped']:,} older lines and {ip['skipped_bytes'] / 1e6:,.0f} MB skipped", flush=True)
    shutil.rmtree(dgx.parent, ignore_errors=True)
    return report(checks, a.json, {"scale": a.scale, "runs": a.runs, "code": str(a.code), "results": results})


if __name__ == "__main__":
    sys.exit(main())
