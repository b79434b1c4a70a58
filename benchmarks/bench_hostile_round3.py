#!/usr/bin/env python3
"""Unbounded work inside the caps: inputs that stay under every size limit and still cost a
lot, each run as one ``gpu-tune`` command in a process of its own.

    .venv/bin/python benchmarks/bench_hostile_round3.py [--scale 1.0] [--only NAME] [--json]

Cases (``--scale`` multiplies the sizes; 1.0 is the size each was first found at):

- ``revert-100k``: ``gpu-tune revert`` of a journal of 100,000 sysctl entries (about 20 MB,
  under the journal's 64 MiB cap), every original restorable: the table printed, the journal
  emptied. ``revert-100k-kept``: the same journal with none of the files there, so that every
  entry is an error row and stays (what costs then is the table).
- ``interrupts-4.5M``: ``gpu-tune topology`` on the ``vm-virtio`` host (a virtio NIC, so
  ``/proc/interrupts`` is read) whose ``/proc/interrupts`` has 4.5 million lines (about 59 MiB,
  under the table cap of 64 MiB); the agent reads it the same way on every pass.
- ``profiles-10k``: ``gpu-tune profiles`` with 10,000 profiles in the policy folder, each
  including the shipped ``training.yaml`` (which includes ``_base.yaml``).

Printed per case: exit status, wall seconds, peak RSS of the command's process (``wait4``), and
bytes written to stdout. (A child's peak RSS starts from what the process that forked it held,
so this script writes its inputs piece by piece and stays small.) Targets: revert under 60 s and 400 MB (linear in the journal: it is
held whole) with a table of at most a few hundred lines; topology's peak RSS within 40 MB of the
same command on the host's own ``/proc/interrupts``; profiles under 15 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._util import report  # noqa: E402

from tests.fixtures import hostgen  # noqa: E402


def _run(argv: list[str], timeout: float, pythonpath: Path = REPO) -> dict:
    """Run one command; its exit, wall time, peak RSS (of that process alone) and stdout size.
    ``pythonpath``: the checkout whose ``gpu_tune`` it runs."""
    out = tempfile.TemporaryFile()
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.PIPE, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(pythonpath), "COLUMNS": "160"})
    deadline = t0 + timeout
    status: int | str = "hung"
    rusage = None
    while time.monotonic() < deadline:
        pid, st, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            status, rusage = os.waitstatus_to_exitcode(st), ru
            break
        time.sleep(0.02)
    else:
        proc.kill()
        _, _, rusage = os.wait4(proc.pid, 0)
    took = time.monotonic() - t0
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    proc.returncode = status if isinstance(status, int) else -9  # reaped above
    size = out.seek(0, os.SEEK_END)
    out.close()
    return {"exit": status, "seconds": round(took, 2), "peak_rss_mb": round(rusage.ru_maxrss / 1024, 1),
            "stdout_bytes": size, "stderr_tail": err.strip().splitlines()[-1][:200] if err.strip() else ""}


def case_revert(tmp: Path, scale: float, timeout: float, *, restorable: bool = True) -> dict:
    n = max(1, int(100_000 * scale))
    root = hostgen.build("small-2cpu", tmp / "host")
    vm = root / "proc/sys/vm"
    j = root / "var/lib/gpu-tune/journal.json"
    j.parent.mkdir(parents=True, exist_ok=True)
    with open(j, "w", encoding="ascii") as fh:  # written entry by entry: this process stays small
        fh.write('{"format": 1, "entries": [\n')
        for i in range(n):
            name = f"bench_{i}"
            if restorable:
                (vm / name).write_text("1\n")  # the tool's value; the original was 60
            entry = {"id": f"sysctl.vm.{name}", "target": "host", "family": "sysctl",
                     "path": f"/proc/sys/vm/{name}", "value": "60", "raw": "NjAK", "seq": i + 1,
                     "recorded_at": "2025-01-01T00:00:00Z"}
            fh.write(("," if i else "") + json.dumps(entry, indent=1, sort_keys=True) + "\n")
        fh.write("]}\n")
    size = j.stat().st_size
    r = _run([sys.executable, "-m", "gpu_tune", "revert", "--root", str(root), "--gpu-backend", "none"], timeout)
    r["input"] = f"{n:,} entries, {size / 1e6:.1f} MB journal" + ("" if restorable else ", no file")
    r["restored"] = (vm / "bench_0").read_text() == "60\n" if restorable else r["exit"] == 1
    return r


def case_interrupts(tmp: Path, scale: float, timeout: float, *, padded: bool = True) -> dict:
    root = hostgen.build("vm-virtio", tmp / "host")
    p = root / "proc/interrupts"
    text = p.read_text()
    n = max(0, int(4_500_000 * scale)) if padded else 0
    with open(p, "a", encoding="ascii") as fh:
        # short lines of IRQs no device has (13-14 bytes each: 4.5 M of them fit under 64 MiB)
        chunk = []
        for i in range(n):
            chunk.append(f"{1000 + i}: 0 X\n")
            if len(chunk) == 100_000:
                fh.write("".join(chunk))
                chunk = []
        fh.write("".join(chunk))
    r = _run([sys.executable, "-m", "gpu_tune", "-o", "json", "topology", "--root", str(root), "--gpu-backend", "none"],
             timeout)
    r["input"] = f"{len(text.splitlines()) + n:,} lines, {p.stat().st_size / (1 << 20):.1f} MiB"
    return r


def case_profiles(tmp: Path, scale: float, timeout: float) -> dict:
    n = max(1, int(10_000 * scale))
    pol = tmp / "pol"
    shutil.copytree(REPO / "policies", pol)
    for i in range(n):
        (pol / f"p{i}.yaml").write_text(f"include: training.yaml\nsummary: profile {i}\n")
    r = _run([sys.executable, "-m", "gpu_tune", "-o", "json", "profiles", "--policy-dir", str(pol)], timeout)
    r["input"] = f"{n:,} profiles including training.yaml"
    return r


CASES = {  # the smallest commands first: their peak RSS is not lifted by what this process held
    "interrupts-baseline": lambda tmp, scale, timeout: case_interrupts(tmp, scale, timeout, padded=False),
    "interrupts-4.5M": case_interrupts,
    "profiles-10k": case_profiles,
    "revert-100k": case_revert,
    "revert-100k-kept": lambda tmp, scale, timeout: case_revert(tmp, scale, timeout, restorable=False),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every case's size (default 1.0)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before a command is killed (default 300)")
    ap.add_argument("--only", default="", help="run only the cases whose name contains this")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    a = ap.parse_args()
    results = {}
    for name, fn in CASES.items():
        if a.only not in name:
            continue
        tmp = Path(tempfile.mkdtemp(prefix="bench-hostile3-"))
        try:
            results[name] = r = fn(tmp, a.scale, a.timeout)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if not a.json:
            print(f"{name:20} {r['input']:42} exit {str(r['exit']):5} {r['seconds']:7.2f} s "
                  f"{r['peak_rss_mb']:7.1f} MB peak RSS  {r['stdout_bytes']:>10,} bytes out  {r['stderr_tail'][:80]}",
                  flush=True)
    checks = {}
    for name in ("revert-100k", "revert-100k-kept"):
        if name in results:
            r = results[name]
            checks[f"{name}: {'restored' if name == 'revert-100k' else 'kept'}, under 60 s and 400 MB, "
                   "a table under 100 kB"] = (r["restored"] and r["seconds"] < 60 and r["peak_rss_mb"] < 400
                                              and r["stdout_bytes"] < 100_000)
    if "interrupts-4.5M" in results and "interrupts-baseline" in results:
        checks["topology: peak RSS within 40 MB of the host's own /proc/interrupts"] = (
            results["interrupts-4.5M"]["exit"] == 0
            and results["interrupts-4.5M"]["peak_rss_mb"] - results["interrupts-baseline"]["peak_rss_mb"] < 40)
    if "profiles-10k" in results:
        r = results["profiles-10k"]
        checks["profiles: under 15 s"] = r["exit"] == 0 and r["seconds"] < 15
    return report(checks, a.json, {"scale": a.scale, "results": results})


if __name__ == "__main__":
    sys.exit(main())
