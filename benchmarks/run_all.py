#!/usr/bin/env python3
"""Run every ``benchmarks/bench_*.py`` in turn and summarise them (``make bench``).

    .venv/bin/python benchmarks/run_all.py [--only NAME ...] [--skip NAME ...] [--quick]
                                           [--timeout S] [--list]

Each benchmark runs as a child process with this interpreter, one after another (they measure
the machine, so never two at once), with the settings in :data:`SETTINGS` (about 5 minutes in all
on a 2-core machine; ``--quick``: shorter runs, about 3 minutes, noisier figures). Their output is
streamed under a header as it comes. At the end a table gives each benchmark's exit status and wall time,
followed by the lines where it states its figures against its targets (lines with PASS/FAIL,
``target``, ``goal``, ``MISSED``). A benchmark exits 1 when it misses a target; this script exits
0 when every benchmark exited 0, else 1 (130 when interrupted).

A ``bench_*.py`` not listed in :data:`SETTINGS` runs with its own defaults. Six start a real
kube-apiserver (``bench_fleet.py``, ``bench_fleet_scale.py``, ``bench_fleet_limit.py``,
``bench_agent.py``, ``bench_dra.py``, ``bench_rss.py``): on a machine shared with others running the
cluster tests, run this under ``flock /tmp/gpu-tune-cluster.lock``.
``bench_fleet_scale.py`` runs here at 1,000 nodes and a 20 s interval; its full run (1,000 and 5,000
nodes at the default 60 s interval, about 15 minutes) is run on its own (docs/fleet.md).
``bench_slurm_fleet.py`` starts a real Slurm (root, ``make slurm-tools``; it says SKIP without them).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# Arguments per benchmark (the order here is the order they run in; others follow by name).
# SETTINGS are the figures the README reports; QUICK trades precision for time.
SETTINGS: dict[str, list[str]] = {
    "bench_audit.py": ["--runs", "15"],
    "bench_metrics.py": ["--runs", "5"],
    "bench_topology.py": ["--runs", "15", "--process-runs", "7"],
    "bench_fleet.py": ["--nodes", "1000", "--runs", "7"],
    "bench_fleet_scale.py": ["--nodes", "1000", "--interval", "20", "--passes", "2", "--fleet-runs", "1"],
    "bench_dra.py": ["--nodes", "300", "--passes", "3"],
    "bench_fleet_limit.py": ["--nodes", "1000", "--limit", "50"],
    "bench_probe.py": ["--runs", "2", "--busy-runs", "1", "--repeats", "3"],
    "bench_agent.py": ["--idle", "20", "--interval", "10"],
    "bench_rss.py": ["--requests", "10000"],
    "bench_http.py": ["--duration", "10", "--repeat", "2"],
    "bench_http_limits.py": ["--duration", "5", "--repeat", "3"],
    "bench_gain.py": ["--pairs", "3"],
    "bench_policy.py": ["--runs", "9"],
    "bench_slurm_fleet.py": ["--jobs", "5", "--rounds", "3"],
    "bench_evidence.py": ["--runs", "3"],
}
QUICK: dict[str, list[str]] = {
    "bench_audit.py": ["--runs", "7"],
    "bench_metrics.py": ["--runs", "3"],
    "bench_topology.py": ["--runs", "7", "--process-runs", "3"],
    "bench_fleet.py": ["--nodes", "1000", "--runs", "3"],
    "bench_fleet_scale.py": ["--nodes", "300", "--interval", "10", "--passes", "1", "--fleet-runs", "1",
                             "--idle", "5"],
    "bench_dra.py": ["--nodes", "100", "--passes", "1"],
    "bench_fleet_limit.py": ["--nodes", "300", "--limit", "15"],
    "bench_probe.py": ["--runs", "1", "--busy-runs", "1", "--repeats", "2", "--seconds", "2"],
    "bench_agent.py": ["--idle", "10", "--interval", "5"],
    "bench_rss.py": ["--requests", "4000", "--passes", "1", "--kube", "off"],
    "bench_http.py": ["--duration", "3", "--repeat", "1"],
    "bench_http_limits.py": ["--duration", "3", "--repeat", "1"],
    "bench_gain.py": ["--pairs", "3", "--window", "0.5"],
    "bench_hostile_round3.py": ["--scale", "0.2"],
    "bench_hostile_round4_cache.py": ["--only", "fifo"],
    "bench_slurm_bounds.py": ["--only", "out"],
    "bench_policy.py": ["--runs", "3"],
    "bench_slurm_fleet.py": ["--jobs", "3", "--rounds", "1"],
    "bench_evidence.py": ["--runs", "1", "--huge-mib", "96"],
}
DEFAULT_TIMEOUT = 420.0  # seconds per benchmark
HEADLINE = re.compile(r"\b(PASS|FAIL|MISSED|TARGET|targets?|goal)\b")


@dataclass
class Outcome:
    name: str
    argv: list[str]
    rc: int | None = None  # None: did not finish (timeout or interrupted)
    seconds: float = 0.0
    note: str = ""
    headlines: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        if self.note:
            return self.note
        return "ok" if self.rc == 0 else f"exit {self.rc}"


def discover(bench_dir: Path) -> list[Path]:
    found = {p.name: p for p in sorted(bench_dir.glob("bench_*.py"))}
    ordered = [found[n] for n in SETTINGS if n in found]
    return ordered + [p for n, p in found.items() if n not in SETTINGS]


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(5)
            return
        except subprocess.TimeoutExpired:
            continue


def run_one(script: Path, args: list[str], timeout: float, out=sys.stdout) -> Outcome:
    argv = [sys.executable, str(script), *args]
    res = Outcome(script.name, argv)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    except OSError as exc:
        res.note = f"could not start: {exc.strerror or exc}"
        return res

    def pump() -> None:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            out.write(f"  {line}\n")
            out.flush()
            if HEADLINE.search(line):
                res.headlines.append(line.strip())

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        res.rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        res.note = f"timeout after {timeout:g} s (killed)"
    except KeyboardInterrupt:
        _kill_group(proc)
        res.note = "interrupted"
        raise
    finally:
        reader.join(5)
        res.seconds = time.monotonic() - t0
    return res


def summary(outcomes: list[Outcome], total: float, out=sys.stdout) -> None:
    w = max([len(o.name) for o in outcomes] + [9])
    out.write("\n" + "=" * 78 + "\n")
    out.write(f"{'benchmark':<{w}}  {'status':<28} {'seconds':>8}\n")
    for o in outcomes:
        out.write(f"{o.name:<{w}}  {o.status:<28} {o.seconds:8.1f}\n")
    out.write(f"{'total':<{w}}  {'':<28} {total:8.1f}\n")
    for o in outcomes:
        if o.headlines:
            out.write(f"\n{o.name}: figures vs targets\n")
            for line in o.headlines:
                out.write(f"  {line}\n")
    bad = [o.name for o in outcomes if o.rc != 0]
    out.write("\n" + (f"{len(bad)} of {len(outcomes)} benchmark(s) missed a target or failed: {', '.join(bad)}\n"
                      if bad else f"all {len(outcomes)} benchmark(s) met their targets\n"))
    out.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="run only this benchmark (e.g. http or bench_http.py); repeatable")
    ap.add_argument("--skip", action="append", default=[], metavar="NAME", help="leave this benchmark out; repeatable")
    ap.add_argument("--quick", action="store_true", help="shorter runs (about 3 minutes in all; noisier figures)")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                    help=f"seconds allowed per benchmark (default {DEFAULT_TIMEOUT:g})")
    ap.add_argument("--list", action="store_true", help="print the command lines and exit")
    ap.add_argument("--bench-dir", type=Path, default=HERE, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if not a.timeout > 0:
        ap.error(f"--timeout {a.timeout:g}: must be greater than 0")

    def norm(n: str) -> str:
        n = n.strip()
        n = n if n.startswith("bench_") else f"bench_{n}"
        return n if n.endswith(".py") else f"{n}.py"

    scripts = discover(a.bench_dir)
    known = {p.name for p in scripts}
    for n in a.only + a.skip:
        if norm(n) not in known:
            ap.error(f"no benchmark {n!r} in {a.bench_dir} (have: {', '.join(sorted(known)) or 'none'})")
    if a.only:
        scripts = [p for p in scripts if p.name in {norm(n) for n in a.only}]
    scripts = [p for p in scripts if p.name not in {norm(n) for n in a.skip}]
    table = QUICK if a.quick else SETTINGS
    plan = [(p, table.get(p.name, [])) for p in scripts]
    if a.list:
        for p, args in plan:
            print(" ".join([Path(sys.executable).name, str(p.relative_to(REPO) if p.is_relative_to(REPO) else p), *args]))
        return 0
    if not plan:
        print("no benchmarks to run", file=sys.stderr)
        return 1

    print(f"{len(plan)} benchmark(s), {os.cpu_count()} CPUs, {'quick' if a.quick else 'standard'} settings, "
          f"timeout {a.timeout:g} s each", flush=True)
    outcomes: list[Outcome] = []
    t0 = time.monotonic()
    try:
        for p, args in plan:
            print(f"\n== {p.name} {' '.join(args)}".rstrip(), flush=True)
            o = run_one(p, args, a.timeout)
            outcomes.append(o)
            print(f"-- {p.name}: {o.status} in {o.seconds:.1f} s", flush=True)
    except KeyboardInterrupt:
        outcomes.append(Outcome(p.name, [], note="interrupted"))
        summary(outcomes, time.monotonic() - t0)
        return 130
    summary(outcomes, time.monotonic() - t0)
    return 0 if all(o.rc == 0 for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
