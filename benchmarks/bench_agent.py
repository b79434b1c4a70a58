#!/usr/bin/env python3
"""The agent process: time to first ready, resident memory under requests, idle CPU.

    .venv/bin/python benchmarks/bench_agent.py [--idle 20] [--interval 10] [--kube on|off|both] [--json]

Starts the real ``gpu-tune serve`` (enforce mode, CPU probe) on a fresh copy of the
``small-2cpu`` fixture host and measures:
  * seconds from the process start to the first ``/readiness`` 200 (target < 30 s);
  * the agent's RSS after 10,000 and after 20,000 requests (/readiness and /metrics alternately,
    keep-alive, one client): without Kubernetes (``--no-kube``) target < 60 MB; publishing to a
    real kube-apiserver (the test harness's, tests/realkube, started for the run; ``--kubeconfig``:
    the kubernetes client loaded, as on every node of a cluster) target < 80 MB, the GPU node's budget less NVML, which needs a GPU to measure;
    growth from 10k to 20k requests < 2 MB;
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


def measure(a, kube: bool) -> dict:
    sys.path.insert(0, str(REPO))
    from tests.fixtures import hostgen
    from tests.realkube.cleanup import Ledger, ledger_root
    from tests.realkube.controlplane import ControlPlane
    from tests.realkube.testapi import RealAPI

    tmp = Path(tempfile.mkdtemp(prefix="bench-agent-"))
    root = hostgen.build("small-2cpu", tmp / "host")
    port = free_port()
    exe = Path(sys.executable).with_name("gpu-tune")
    cp = led = None
    mark = 0
    if kube:
        led = Ledger(f"bench-agent-{os.getpid()}", ledger_root())
        cp = ControlPlane(tmp / "cp", led).start(timeout=120)
        api = RealAPI(cp)
        api.add_node("bench-node")
        api.proxy.stop()
        mark = cp.audit_mark()
        where = ["--kubeconfig", str(cp.kubeconfig)]
    else:
        where = ["--no-kube"]
    argv = [str(exe) if exe.exists() else sys.executable, *([] if exe.exists() else ["-m", "gpu_tune"]),
            "--root", str(root), "--gpu-backend", "none", "serve", "--host", "127.0.0.1", "--port", str(port),
            *where, "--mode", "enforce", "--probe-device", "cpu", "--interval", f"{a.interval:g}",
            "--node", "bench-node"]
    t0 = time.monotonic()
    log = open(tmp / "agent.log", "w")  # a file, not a pipe: a full pipe would stall the agent
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True, env=env)
    doc: dict = {"kubernetes": "kube-apiserver" if kube else "off (--no-kube)", "argv": argv[1:]}
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
        print(f"ready after {ready_s:.1f}s ({doc['kubernetes']}); measuring", file=sys.stderr, flush=True)
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
        if cp is not None:
            cp.wait_audit_flushed()
            doc["node_writes"] = len([ev for ev in cp.writes_by("test-admin", mark)
                                      if (ev.get("objectRef") or {}).get("name") == "bench-node"])
        proc.send_signal(signal.SIGTERM)
        doc["exit_code_on_sigterm"] = proc.wait(20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if cp is not None:
            cp.stop()
            led.clean()
    limit = 80 if kube else 60
    tag = "with Kubernetes" if kube else "--no-kube"
    doc["checks"] = {
        f"{tag}: time to first ready < 30 s": doc["time_to_ready_s"] < 30,
        f"{tag}: RSS after 20k requests < {limit} MB": doc["rss_mib"]["after_20k"] < limit,
        f"{tag}: RSS growth 10k->20k < 2 MB": doc["rss_growth_10k_to_20k_mib"] < 2,
        f"{tag}: idle CPU < 1 % of one core": doc["idle_cpu_percent_of_one_core"] < 1,
        f"{tag}: SIGTERM exits 0": doc["exit_code_on_sigterm"] == 0,
    }
    return doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--idle", type=float, default=20.0, help="seconds of idle CPU measurement (default 20)")
    ap.add_argument("--interval", type=float, default=10.0, help="agent --interval (default 10)")
    ap.add_argument("--requests", type=int, default=10000, help="requests per memory step (default 10000)")
    ap.add_argument("--kube", choices=("off", "on", "both"), default="both",
                    help="publish to a real kube-apiserver: off, on, or one run of each (default)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    runs = [measure(a, kube) for kube in {"off": [False], "on": [True], "both": [False, True]}[a.kube]]
    checks = {k: v for r in runs for k, v in r["checks"].items()}
    if a.json:
        print(json.dumps(runs, indent=1))
    else:
        for r in runs:
            print(f"-- kubernetes {r['kubernetes']}")
            for k, v in r.items():
                if k not in ("checks", "argv", "kubernetes"):
                    print(f"{k}: {v}")
        for k, ok in checks.items():
            print(f"{'PASS' if ok else 'FAIL'}  {k}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
