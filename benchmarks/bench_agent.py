#!/usr/bin/env python3
"""The agent process: time to first ready, resident memory under requests, idle CPU.

    .venv/bin/python benchmarks/bench_agent.py [--idle 20] [--interval 10] [--json]

Starts the real ``gpu-tune serve`` (enforce mode, CPU probe, no Kubernetes) on a fresh copy of
the ``small-2cpu`` fixture host and measures:
  * seconds from the process start to the first ``/readiness`` 200 (target < 30 s);
  * the agent's RSS after 10,000 and after 20,000 requests (/readiness and /metrics alternately,
    keep-alive, one client) (target < 80 MB, growth < 2 MB);
  * CPU used by the agent over ``--idle`` seconds with passes every ``--interval`` seconds and no
    requests (target < 1 % of one core).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hammer(port: int, n: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    paths = ("/readiness", "/metrics")
    for i in range(n):
        conn.request("GET", paths[i % 2])
        r = conn.getresponse()
        r.read()
        if r.status not in (200, 503):
            raise SystemExit(f"GET {paths[i % 2]}: {r.status}")
    conn.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--idle", type=float, default=20.0, help="seconds of idle CPU measurement (default 20)")
    ap.add_argument("--interval", type=float, default=10.0, help="agent --interval (default 10)")
    ap.add_argument("--requests", type=int, default=10000, help="requests per memory step (default 10000)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    sys.path.insert(0, str(REPO))
    from tests.fixtures import hostgen

    tmp = Path(tempfile.mkdtemp(prefix="bench-agent-"))
    root = hostgen.build("small-2cpu", tmp / "host")
    port = free_port()
    exe = Path(sys.executable).with_name("gpu-tune")
    argv = [str(exe) if exe.exists() else sys.executable, *([] if exe.exists() else ["-m", "agent.cli"]),
            "--root", str(root), "--gpu-backend", "none", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--no-kube", "--mode", "enforce", "--probe-device", "cpu", "--interval", f"{a.interval:g}",
            "--node", "bench-node"]
    t0 = time.monotonic()
    log = open(tmp / "agent.log", "w")  # a file, not a pipe: a full pipe would stall the agent
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    doc: dict = {"argv": argv[1:]}
    try:
        ready_s = None
        last = ""
        while time.monotonic() - t0 < 120 and proc.poll() is None:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/readiness")
                r = c.getresponse()
                body = r.read()
                c.close()
                if r.status == 200:
                    ready_s = time.monotonic() - t0
                    break
                last = body.decode()
            except OSError:
                pass
            time.sleep(0.1)
        if ready_s is None:
            raise SystemExit(f"never ready within 120 s; last /readiness: {last[:600]}")
        doc["time_to_ready_s"] = round(ready_s, 2)
        print(f"ready after {ready_s:.1f}s; measuring", file=sys.stderr, flush=True)
        agent = psutil.Process(proc.pid)
        time.sleep(1.0)  # let the probe process be reaped
        rss = {"start": agent.memory_info().rss}
        hammer(port, a.requests)
        rss["after_10k"] = agent.memory_info().rss
        hammer(port, a.requests)
        rss["after_20k"] = agent.memory_info().rss
        doc["rss_mib"] = {k: round(v / 2**20, 2) for k, v in rss.items()}
        doc["rss_growth_10k_to_20k_mib"] = round((rss["after_20k"] - rss["after_10k"]) / 2**20, 2)
        cpu0 = agent.cpu_times()
        w0 = time.monotonic()
        time.sleep(a.idle)
        cpu1 = agent.cpu_times()
        used = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
        doc["idle_cpu_percent_of_one_core"] = round(100 * used / (time.monotonic() - w0), 3)
        doc["idle_window_s"] = a.idle
        doc["passes_in_window"] = f"~{a.idle / a.interval:.0f} (interval {a.interval:g}s)"
        proc.send_signal(signal.SIGTERM)
        doc["exit_code_on_sigterm"] = proc.wait(20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    checks = {
        "time to first ready < 30 s": doc["time_to_ready_s"] < 30,
        "RSS after 20k requests < 80 MB": doc["rss_mib"]["after_20k"] < 80,
        "RSS growth 10k->20k < 2 MB": doc["rss_growth_10k_to_20k_mib"] < 2,
        "idle CPU < 1 % of one core": doc["idle_cpu_percent_of_one_core"] < 1,
        "SIGTERM exits 0": doc["exit_code_on_sigterm"] == 0,
    }
    doc["checks"] = checks
    if a.json:
        print(json.dumps(doc, indent=1))
    else:
        for k, v in doc.items():
            if k not in ("checks", "argv"):
                print(f"{k}: {v}")
        for k, ok in checks.items():
            print(f"{'PASS' if ok else 'FAIL'}  {k}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
