#!/usr/bin/env python3
"""What the DRA-aware GPU count adds to the agent's pass, on a real kube-apiserver.

    .venv/bin/python benchmarks/bench_dra.py [--nodes 300] [--passes 3] [--workers 8]
    (on a shared machine: flock /tmp/gpu-tune-cluster.lock .venv/bin/python benchmarks/bench_dra.py)

A fresh etcd + kube-apiserver (the test harness's, tests/realkube), ``--nodes`` Nodes as on a DRA
cluster (no ``nvidia.com/gpu`` capacity), each with the ResourceSlices NVIDIA's DRA driver
publishes for 8 GPUs with partitionable devices (one slice per GPU: the whole GPU and its MIG
placements, 7 devices; tests/test_dra.py has the device shapes), and as many Nodes with the device
plugin's capacity. One :class:`~gpu_tune.cluster.publisher.KubePublisher` per Node (one shared
pool of ``--workers`` connections), ``--passes`` agent passes (``read()`` then ``publish()``, as
``gpu-tune serve`` makes them). Reported, per pass and node: requests (from the API server's audit
log: Node GETs, ResourceSlice LISTs, writes), response bytes, the read's latency; and, from the API
server's ``/metrics``, whether its ResourceSlice lists reached etcd: the agent's
(``resourceVersion=0``, the watch cache) against the same lists made consistent (no
resourceVersion), which a server whose etcd cannot confirm its cache is current (this one's,
3.4) answers with a range read of every slice in etcd.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_fleet_scale import AdminPool, agent_calls, dgx_topology, kubelet_node, want  # noqa: E402
from gpu_tune.cluster.api import CoreV1, reader_configuration  # noqa: E402
from gpu_tune.cluster.dra import SLICES_PATH, slice_query  # noqa: E402
from gpu_tune.cluster.publisher import KubePublisher  # noqa: E402
from tests.realkube.cleanup import Ledger, janitor, ledger_root  # noqa: E402
from tests.realkube.controlplane import ControlPlane, audit_policy  # noqa: E402
from tests.test_dra import gpu_device, mig_device, slice_doc  # noqa: E402

AUDIT_POLICY = audit_policy(watches=False, bodies=False)


def dra_node(i: int) -> dict[str, Any]:
    node = kubelet_node(i)
    node["metadata"]["name"] = f"dra-node-{i:05d}"
    for where in ("capacity", "allocatable"):
        node["status"][where].pop("nvidia.com/gpu")
    return node


def gpu_slices(node: str) -> list[dict[str, Any]]:
    migs = [("1g.10gb", 19, s) for s in range(4)] + [("3g.40gb", 9, 0), ("3g.40gb", 9, 4)]
    return [slice_doc(node, [gpu_device(g)] + [mig_device(g, p, pid, s) for p, pid, s in migs], count=8)
            for g in range(8)]


STORE_METRICS = {  # the API server's own counters of ResourceSlice lists
    "etcd_lists": "apiserver_storage_list_total", "etcd_objects_read": "apiserver_storage_list_fetched_objects_total",
    "cache_lists": "apiserver_cache_list_total", "cache_objects_read": "apiserver_cache_list_fetched_objects_total"}


def slice_store(cp: ControlPlane) -> dict[str, float]:
    """Where the API server's ResourceSlice lists were answered so far (etcd or its watch cache,
    and how many objects each read), from its /metrics."""
    import http.client

    conn = http.client.HTTPSConnection(cp.host, cp.port, context=cp.ssl_context(), timeout=60)
    try:
        conn.request("GET", "/metrics", headers={"Accept": "text/plain"})
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out = dict.fromkeys(STORE_METRICS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        for key, metric in STORE_METRICS.items():
            if name == metric and 'resource="resourceslices"' in line:
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def store_delta(cp: ControlPlane, before: dict[str, float], lists: int) -> dict[str, float]:
    after = slice_store(cp)
    return {k: round((after[k] - before[k]) / lists, 2) for k in STORE_METRICS} | {"per": "list"}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    led = Ledger(f"bench-dra-{os.getpid()}", ledger_root())
    cp = ControlPlane(work / "cp", led, audit_policy=AUDIT_POLICY)
    out: dict[str, Any] = {"nodes": a.nodes}
    try:
        cp.start(timeout=120)
        admin = AdminPool(cp)
        t0 = time.monotonic()
        with ThreadPoolExecutor(a.workers) as pool:
            list(pool.map(lambda i: admin.request("POST", "/api/v1/nodes", dra_node(i)), range(a.nodes)))
            list(pool.map(lambda i: admin.request("POST", "/api/v1/nodes", kubelet_node(i)), range(a.nodes)))
            list(pool.map(lambda d: admin.request("POST", SLICES_PATH, d),
                          [d for i in range(a.nodes) for d in gpu_slices(f"dra-node-{i:05d}")]))
        one = admin.request("GET", f"{SLICES_PATH}?{'&'.join(f'{k}={v}' for k, v in slice_query('dra-node-00000'))}")
        out["slices"] = 8 * a.nodes
        out["slice_list_bytes"] = len(json.dumps(one))
        print(f"{a.nodes} DRA nodes ({8 * a.nodes} ResourceSlices, one node's list {out['slice_list_bytes'] / 1024:.1f} KiB) "
              f"and {a.nodes} device-plugin nodes made in {time.monotonic() - t0:.1f} s", flush=True)

        kc = cp.dir / "admin.kubeconfig"
        cfg, source = reader_configuration(str(kc))
        api = CoreV1(cfg)
        host = dgx_topology()
        wanted = want(host)
        for kind, prefix in (("dra", "dra-node"), ("device_plugin", "gpu-node")):
            pubs = [KubePublisher(f"{prefix}-{i:05d}", cfg, source=source, api=api) for i in range(a.nodes)]
            with ThreadPoolExecutor(a.workers) as pool:  # the first pass: the first publish (writes)
                list(pool.map(lambda p: (p.read(), p.publish(wanted)), pubs))
            lat: list[float] = []

            def one_pass(p: KubePublisher) -> None:
                t = time.perf_counter()
                p.read()
                lat.append(time.perf_counter() - t)
                p.publish(wanted)

            store0 = slice_store(cp)
            mark = cp.audit_mark()
            t0 = time.monotonic()
            with ThreadPoolExecutor(a.workers) as pool:
                for _ in range(a.passes):
                    list(pool.map(one_pass, pubs))
            wall = time.monotonic() - t0
            cp.wait_audit_flushed(quiet_s=1.0, timeout=30)
            calls = agent_calls(cp, mark)
            n = a.nodes * a.passes
            out[kind] = {"requests_per_pass": round(calls["reads"] / n, 3), "writes_per_pass": calls["writes"] / n,
                         "read_p50_ms": round(statistics.median(lat) * 1000, 2), "read_p99_ms": round(pct(lat, 0.99) * 1000, 2),
                         "wall_s": round(wall, 2)}
            if kind == "dra":
                out[kind]["slice_lists"] = store_delta(cp, store0, n)
            print(f"{kind}: {json.dumps(out[kind])}", flush=True)
        # the same lists, consistent (no resourceVersion): what they cost this server
        for name, drop in (("consistent_list", True), ("watch_cache_list", False)):
            store0 = slice_store(cp)
            t0 = time.perf_counter()
            for i in range(a.nodes):
                q = [(k, v) for k, v in slice_query(f"dra-node-{i:05d}") if not (drop and k == "resourceVersion")]
                api.request("GET", SLICES_PATH, query=q)
            out[name] = {**store_delta(cp, store0, a.nodes), "ms": round((time.perf_counter() - t0) / a.nodes * 1000, 2)}
            print(f"{name}: {json.dumps(out[name])}", flush=True)
        api.close()
    finally:
        cp.stop()
        led.clean()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=300, help="DRA nodes, and as many device-plugin nodes (default 300)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    a = ap.parse_args()
    for line in janitor():
        print(f"realkube janitor: {line}")
    with tempfile.TemporaryDirectory(prefix="bench-dra-") as tmp:
        out = run(a, Path(tmp))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    dra, dp = out["dra"], out["device_plugin"]
    checks = {
        "a DRA node's pass: 2 reads (the Node, its slices), a device-plugin node's: 1":
            dra["requests_per_pass"] == 2 and dp["requests_per_pass"] == 1,
        "a steady pass writes nothing": dra["writes_per_pass"] == 0 and dp["writes_per_pass"] == 0,
        "the agent's slice lists never reach etcd (the watch cache)": dra["slice_lists"]["etcd_lists"] == 0,
    }
    for k, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {k}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
