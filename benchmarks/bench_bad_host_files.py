#!/usr/bin/env python3
"""Host files that are not files: a FIFO, a character device, a 2 GB sparse file where a
one-line kernel file (or the journal, the GPU fixture, an included profile) should be.

    .venv/bin/python benchmarks/bench_bad_host_files.py [--timeout 30] [--json]

Each case builds the ``link-degraded`` fixture host (2 GPUs) in a temp folder, plants one bad
file, and runs one ``gpu-tune`` command as its own process, with the chart's memory limit as
an address-space limit (4 GiB, so that a read without a bound ends in MemoryError instead of
taking the machine's memory) and a wall-clock timeout (the process is killed after it). Printed
per case: the exit status (``hung`` when killed at the timeout), the wall time, the process's
peak RSS, and the row or line that names the planted file.

Targets: every case ends within its timeout with an ``error`` row naming the file (exit 1), one
line of bad input (exit 2) or, for ``topology``, a warning naming it (exit 0); peak RSS within
20 MB of the same command on the clean host.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._util import report  # noqa: E402

from tests.fixtures import hostgen  # noqa: E402

ADDRESS_SPACE = 4 << 30
GPU_FIXTURE = REPO / "tests" / "fixtures" / "gpu" / "link-degraded.json"


def fifo(p: Path) -> str:
    p.unlink(missing_ok=True)
    os.mkfifo(p)
    return "FIFO"


def zero_device(p: Path) -> str:
    p.unlink(missing_ok=True)
    os.mknod(p, 0o644 | 0o020000, os.makedev(1, 5))  # a character device: /dev/zero's numbers
    return "/dev/zero"


def sparse(p: Path) -> str:
    p.unlink(missing_ok=True)
    with open(p, "wb") as fh:
        fh.truncate(2 << 30)
    return "2 GB sparse file"


class Case:
    def __init__(self, name: str, command: str, where: str, plant: Callable[[Path], str],
                 target: Callable[["Run"], Path], extra: Callable[["Run"], list[str]] = lambda r: []) -> None:
        self.name, self.command, self.where, self.plant, self.target, self.extra = name, command, where, plant, target, extra


class Run:
    """One fresh host, GPU fixture and policy folder."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.root = hostgen.build("link-degraded", tmp / "host")
        self.gpus = tmp / "gpus.json"
        shutil.copy(GPU_FIXTURE, self.gpus)
        self.pol = tmp / "pol"
        shutil.copytree(REPO / "policies", self.pol)

    def host(self, p: str) -> Path:
        return self.root / p.lstrip("/")

    def journal(self) -> Path:
        j = self.host("/var/lib/gpu-tune/journal.json")
        j.parent.mkdir(parents=True, exist_ok=True)
        return j

    def included(self) -> Path:
        (self.pol / "x.yaml").write_text("include: [training.yaml, extra.yaml]\n")
        return self.pol / "extra.yaml"


def _cases() -> list[Case]:
    out: list[Case] = []
    for plant, kind in ((fifo, "fifo"), (zero_device, "device"), (sparse, "sparse")):
        out.append(Case(f"{kind} at /proc/sys/vm/swappiness", "audit", "sysctl", plant,
                        lambda r: r.host("/proc/sys/vm/swappiness")))
    out += [
        Case("fifo at /proc/sys/vm/swappiness", "apply", "sysctl", fifo, lambda r: r.host("/proc/sys/vm/swappiness")),
        Case("fifo at /proc/cmdline", "audit", "cmdline", fifo, lambda r: r.host("/proc/cmdline")),
        Case("fifo at /proc/irq/120/smp_affinity_list", "audit", "irq", fifo,
             lambda r: r.host("/proc/irq/120/smp_affinity_list")),
        Case("device at node0/meminfo", "topology", "meminfo", zero_device,
             lambda r: r.host("/sys/devices/system/node/node0/meminfo")),
        Case("fifo as the journal", "revert", "journal", fifo, lambda r: r.journal()),
        Case("sparse journal", "revert", "journal", sparse, lambda r: r.journal()),
        Case("fifo as the GPU fixture", "audit", "fixture", fifo, lambda r: r.gpus),
        Case("fifo as an included profile", "audit", "include", fifo, lambda r: r.included(),
             lambda r: ["--policy-dir", str(r.pol), "--profile", "x"]),
        Case("device as an included profile", "audit", "include", zero_device, lambda r: r.included(),
             lambda r: ["--policy-dir", str(r.pol), "--profile", "x"]),
    ]
    return out


def run_case(case: Case | None, timeout: float) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-badfile-"))
    try:
        r = Run(tmp)
        what = "clean host"
        if case is not None:
            what = case.plant(case.target(r))
        argv = [sys.executable, "-m", "gpu_tune", "-o", "json", case.command if case else "audit",
                "--root", str(r.root), "--gpu-backend", "fixture", "--gpu-fixture", str(r.gpus),
                *(case.extra(r) if case else [])]

        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO)}, preexec_fn=limit,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
            status: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            status = "hung"
        took = time.monotonic() - t0
        # the peak RSS of that child (it is the only one reaped since the last call)
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        said = ""
        if case is not None:
            try:
                doc = json.loads(out)
                rows = doc.get("settings", [])
                said = next((s["detail"] for s in rows if s.get("status") == "error"), "")
                # topology: what it could not read is left unknown and named in its warnings
                said = said or next((w for w in doc.get("warnings", []) if "not read" in w), "")
            except (ValueError, AttributeError):
                pass
            if not said:
                lines = [ln for ln in err.decode(errors="replace").splitlines() if ln.strip()]
                said = lines[-1] if lines else ""
        return {"case": case.name if case else "clean host", "command": case.command if case else "audit",
                "planted": what, "exit": status, "seconds": round(took, 2), "peak_rss_mb": round(peak_mb, 1),
                "said": said[:200]}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds before a command is killed (default 30)")
    ap.add_argument("--only", default="", help="run only the cases whose name contains this")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    a = ap.parse_args()
    # RUSAGE_CHILDREN's ru_maxrss is the largest of all reaped children: run each case from a
    # fresh process of this script so that each figure is its own.
    if os.environ.get("BENCH_BADFILE_CASE") is not None:
        i = int(os.environ["BENCH_BADFILE_CASE"])
        print(json.dumps(run_case(_cases()[i] if i >= 0 else None, a.timeout)))
        return 0
    results = []
    for i in [-1, *range(len(_cases()))]:
        if i >= 0 and a.only not in _cases()[i].name:
            continue
        p = subprocess.run([sys.executable, __file__, "--timeout", str(a.timeout)], capture_output=True, text=True,
                           env={**os.environ, "BENCH_BADFILE_CASE": str(i)})
        if p.returncode != 0:
            raise SystemExit(p.stderr)
        results.append(json.loads(p.stdout))
        if not a.json:
            r = results[-1]
            print(f"{r['case']:42} {r['command']:8} exit {str(r['exit']):5} {r['seconds']:6.2f} s "
                  f"{r['peak_rss_mb']:7.1f} MB  {r['said'][:110]}", flush=True)
    base = results[0]["peak_rss_mb"]
    checks = {
        "every case ends before the timeout with exit 1 or 2 (topology: 0 and a warning) naming the file":
            all((r["exit"] in (1, 2) or (r["command"] == "topology" and r["exit"] == 0)) and r["said"]
                for r in results[1:]),
        "peak RSS within 20 MB of the clean host's": all(r["peak_rss_mb"] - base < 20 for r in results[1:]),
    }
    return report(checks, a.json, {"address_space_limit_bytes": ADDRESS_SPACE, "timeout_s": a.timeout, "results": results})


if __name__ == "__main__":
    sys.exit(main())
