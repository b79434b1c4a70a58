#!/usr/bin/env python3
"""`gpu-tune fleet` on a 1,000-node fleet: one paged list call against the local test API server.

    .venv/bin/python benchmarks/bench_fleet.py [--nodes 1000] [--runs 7] [--chunk-size 500]

The fleet is the test suite's mix (tests/fixtures/fleet.py) scaled to ``--nodes``: agents ready,
not ready (drift, failed probe, an agent without the summary annotation, a kubelet NotReady), not
reporting (no condition, NFD label only, stale heartbeat, kubelet Unknown) and CPU-only nodes, each
Node as the agents publish it (labels, topology and summary annotations, conditions). Prints the
medians of:

  * the list alone, in-process (the kubernetes client over HTTP, ``--chunk-size`` per page);
  * judging and rendering the table (pure, in-process);
  * the whole ``gpu-tune fleet`` process (table, and ``-o json``), the CLI's start included;
  * ``gpu-tune --version``, the floor of any command.

Target: whole process < 1 s for 1,000 nodes on a 2-core machine. The API server here is Python
(http.server, one JSON dump per page): a real kube-apiserver answers a 500-node page from its
watch cache in tens of milliseconds, so the server's share is reported apart.
"""

from __future__ import annotations

import argparse
import json
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
from tests.kubeapi import KubeAPIServer, write_kubeconfig  # noqa: E402

TARGET_S = 1.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--chunk-size", type=int, default=500)
    a = ap.parse_args()

    with KubeAPIServer() as api, tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        expected = populate_n(api, a.nodes, now=time.time())
        gpu_nodes = sum(e is not None for e in expected.values())
        kc = str(write_kubeconfig(Path(tmp) / "kubeconfig", api.url))
        page_bytes = len(json.dumps(api._list_nodes(f"Bearer {api.token}", f"limit={a.chunk_size}")[1]))
        print(f"{a.nodes} nodes ({gpu_nodes} GPU nodes) on the test API server in {time.perf_counter() - t0:.1f} s; "
              f"one {a.chunk_size}-node page is {page_bytes / 2**20:.1f} MiB of JSON")

        # the server's own share: building and serialising the pages (no HTTP, no client)
        server = []
        for _ in range(a.runs):
            t = time.perf_counter()
            token = None
            while True:
                q = f"limit={a.chunk_size}" + (f"&continue={token}" if token else "")
                doc = api._list_nodes(f"Bearer {api.token}", q)[1]
                json.dumps(doc).encode()
                token = doc["metadata"].get("continue")
                if not token:
                    break
            server.append(time.perf_counter() - t)

        cfg, source = reader_configuration(kc)
        listing = list_nodes(cfg, page_size=a.chunk_size, source=source)  # warm up
        lists, judge = [], []
        for _ in range(a.runs):
            api.list_calls.clear()
            cfg, source = reader_configuration(kc)
            t = time.perf_counter()
            listing = list_nodes(cfg, page_size=a.chunk_size, source=source)
            lists.append(time.perf_counter() - t)
            pages = len(api.list_calls)
            t = time.perf_counter()
            report = fleet_report(listing.items)
            render_table(report)
            judge.append(time.perf_counter() - t)
        assert len(listing.items) == a.nodes and len(report.nodes) == gpu_nodes, "the listing lost nodes"

        env_argv = [*gpu_tune_argv(), "fleet", "--kubeconfig", kc, "--chunk-size", str(a.chunk_size)]
        os.environ["COLUMNS"] = "200"
        whole = time_process(env_argv, a.runs, warmup=1, ok_codes=(1,))
        whole_json = time_process([*env_argv, "-o", "json"], a.runs, warmup=1, ok_codes=(1,))
        version = time_process([*gpu_tune_argv(), "--version"], a.runs, warmup=1)

    med = statistics.median(whole)
    print(f"list call, in-process ({pages} pages of {a.chunk_size}): median {median_ms(lists):7.1f} ms "
          f"(of which the test API server builds and serialises the pages: {median_ms(server):.1f} ms)")
    print(f"judge + render the table, in-process:          median {median_ms(judge):7.1f} ms")
    print(f"gpu-tune fleet, whole process (table):          median {median_ms(whole):7.1f} ms   target < {TARGET_S * 1000:.0f} ms")
    print(f"gpu-tune fleet -o json, whole process:          median {median_ms(whole_json):7.1f} ms")
    print(f"gpu-tune --version, whole process:              median {median_ms(version):7.1f} ms")
    ok = med < TARGET_S
    print(f"{'PASS' if ok else 'FAIL'}  {a.nodes}-node fleet listing, whole process {med:.2f} s < {TARGET_S:g} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
