#!/usr/bin/env python3
"""`gpu-tune fleet` on a 1,000-node fleet: one paged list call against a real kube-apiserver.

    .venv/bin/python benchmarks/bench_fleet.py [--nodes 1000] [--runs 7] [--chunk-size 500]
    (on a shared machine: flock /tmp/gpu-tune-cluster.lock ...)

The fleet is the test suite's mix (tests/fixtures/fleet.py) scaled to ``--nodes``: agents ready,
not ready (drift, failed probe, an agent without the summary annotation, a kubelet NotReady), not
reporting (no condition, NFD label only, stale heartbeat, kubelet Unknown) and CPU-only nodes, each
Node as the agents publish it (labels, topology and summary annotations, conditions). Prints the
medians of:

  * the list alone, in-process (the kubernetes client over HTTPS, ``--chunk-size`` per page), and
    the API server's own share of it (from its audit log: each page's request received to response
    complete);
  * judging and rendering the table (pure, in-process);
  * the whole ``gpu-tune fleet`` process (table, and ``-o json``), the CLI's start included;
  * ``gpu-tune --version``, the floor of any command.

Target: whole process < 1 s for 1,000 nodes on a 2-core machine. The API server is the test
harness's (tests/realkube: etcd + kube-apiserver on 127.0.0.1, the binaries of KUBE_BIN_DIR; no
root needed), started for the run and removed after it. benchmarks/bench_fleet_scale.py measures
the same command over 5,000 Nodes, with the API server's CPU and memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _util import REPO, gpu_tune_argv, median_ms, time_process

sys.path.insert(0, str(REPO))

from gpu_tune.cluster.fleet import fleet_report, render_table  # noqa: E402
from gpu_tune.cluster.api import list_nodes, reader_configuration  # noqa: E402
from tests.fixtures.fleet import populate_n  # noqa: E402
from tests.realkube.cleanup import Ledger, janitor, ledger_root  # noqa: E402
from tests.realkube.controlplane import ControlPlane  # noqa: E402
from tests.realkube.testapi import RealAPI  # noqa: E402

TARGET_S = 1.0


def measure(cp: ControlPlane, a: argparse.Namespace) -> tuple:
    api = RealAPI(cp)
    try:
        t0 = time.perf_counter()
        expected = populate_n(api, a.nodes, now=time.time())
    finally:
        api.proxy.stop()
    gpu_nodes = sum(e is not None for e in expected.values())
    kc = str(cp.kubeconfig)
    page_bytes = len(cp.get_raw(f"/api/v1/nodes?limit={a.chunk_size}"))
    print(f"{a.nodes} nodes ({gpu_nodes} GPU nodes) on a real kube-apiserver in {time.perf_counter() - t0:.1f} s; "
          f"one {a.chunk_size}-node page is {page_bytes / 2**20:.1f} MiB of JSON")

    cfg, source = reader_configuration(kc)
    listing = list_nodes(cfg, page_size=a.chunk_size, source=source)  # warm up
    lists, server, judge = [], [], []
    for _ in range(a.runs):
        cfg, source = reader_configuration(kc)
        mark = cp.audit_mark()
        t = time.perf_counter()
        listing = list_nodes(cfg, page_size=a.chunk_size, source=source)
        lists.append(time.perf_counter() - t)
        cp.wait_audit_flushed()
        spans = [_ts(ev["stageTimestamp"]) - _ts(ev["requestReceivedTimestamp"]) for ev in cp.audit(mark)
                 if ev.get("verb") == "list" and str(ev.get("userAgent", "")).startswith("gpu-tune/")]
        server.append(sum(spans))
        pages = len(spans)
        t = time.perf_counter()
        report = fleet_report(listing.items)
        render_table(report)
        judge.append(time.perf_counter() - t)
    assert len(listing.items) == a.nodes and len(report.nodes) == gpu_nodes, "the listing lost nodes"

    env_argv = [*gpu_tune_argv(), "fleet", "--kubeconfig", kc, "--chunk-size", str(a.chunk_size)]
    os.environ["COLUMNS"] = "200"
    for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        os.environ.pop(k, None)
    whole = time_process(env_argv, a.runs, warmup=1, ok_codes=(1,))
    whole_json = time_process([*env_argv, "-o", "json"], a.runs, warmup=1, ok_codes=(1,))
    version = time_process([*gpu_tune_argv(), "--version"], a.runs, warmup=1)
    return lists, server, judge, whole, whole_json, version, pages


def _ts(stamp: str) -> float:
    base, _, frac = stamp.rstrip("Z").partition(".")
    return time.mktime(time.strptime(base, "%Y-%m-%dT%H:%M:%S")) + float(f"0.{frac or 0}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--chunk-size", type=int, default=500)
    a = ap.parse_args()

    for line in janitor():
        print(f"realkube janitor: {line}")
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        led = Ledger(f"bench-fleet-{os.getpid()}", ledger_root())
        cp = ControlPlane(Path(tmp) / "cp", led)
        try:
            cp.start(timeout=120)
            figures = measure(cp, a)
        finally:
            cp.stop()
            led.clean()
    lists, server, judge, whole, whole_json, version, pages = figures
    med = statistics.median(whole)
    print(f"list call, in-process ({pages} pages of {a.chunk_size}): median {median_ms(lists):7.1f} ms "
          f"(of which the API server's own time, its audit log: {median_ms(server):.1f} ms)")
    print(f"judge + render the table, in-process:          median {median_ms(judge):7.1f} ms")
    print(f"gpu-tune fleet, whole process (table):          median {median_ms(whole):7.1f} ms   target < {TARGET_S * 1000:.0f} ms")
    print(f"gpu-tune fleet -o json, whole process:          median {median_ms(whole_json):7.1f} ms")
    print(f"gpu-tune --version, whole process:              median {median_ms(version):7.1f} ms")
    ok = med < TARGET_S
    print(f"{'PASS' if ok else 'FAIL'}  {a.nodes}-node fleet listing, whole process {med:.2f} s < {TARGET_S:g} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
