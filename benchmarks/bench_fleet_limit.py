#!/usr/bin/env python3
"""The blast-radius limit on a real kube-apiserver: 1,000 agents turning not ready in the same second.

    .venv/bin/python benchmarks/bench_fleet_limit.py [--nodes 1000] [--limit 50] [--workers 64]
    (on a shared machine: flock /tmp/gpu-tune-cluster.lock .venv/bin/python benchmarks/bench_fleet_limit.py)

A fresh etcd + kube-apiserver (tests/realkube, as ``bench_fleet_scale.py``), ``--nodes`` Nodes as
kubelets register GPU nodes, the ledger ConfigMap as the manifests ship it, and one
:class:`~gpu_tune.cluster.publisher.KubePublisher` per Node with ``readiness.max_out_of_service:
--limit`` (as ``gpu-tune serve`` makes it), sharing one connection pool of ``--workers``
connections and threads. Every agent first publishes its Node ready (the DaemonSet's start), then
every agent's verdict turns not ready (a fatal XID: the taint and the hardware condition False
wanted) and all of them publish at once. Printed: the nodes tainted (at most the limit), the
``GPUHostReady`` conditions False (all), the hardware conditions False (as many as tainted), the
write calls per node in that pass (max / median; the ledger's updates among them), the ledger's
409s, the time until every agent's pass is done, and the API server's p50 / p99 from its audit
log; then a second pass of every agent (the held nodes count again only if the ledger changed).
Exits 1 when more nodes than the limit are tainted or a condition is not False.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_fleet_scale import AUDIT_POLICY, AdminPool, agent_calls, dgx_topology, kubelet_node  # noqa: E402
from gpu_tune.cluster.api import CoreV1, reader_configuration  # noqa: E402
from gpu_tune.cluster.labels import TAINT_KEY, desired_node_state  # noqa: E402
from gpu_tune.cluster.limit import LEDGER  # noqa: E402
from gpu_tune.cluster.publisher import KubePublisher  # noqa: E402
from tests.realkube.cleanup import Ledger, janitor, ledger_root  # noqa: E402
from tests.realkube.controlplane import ControlPlane  # noqa: E402

NS = "gpu-tune"
HW = "GpuHardwareHealthy"


def want(host: dict[str, Any], ready: bool):
    why = "" if ready else "gpu.xid: GPU 3: XID 79 (fallen off the bus)"
    return desired_node_state(profile="training", ready=ready, reason="" if ready else "FatalXid",
                              message=why or "all checks passed", topology=host["topology"], gpus=host["gpus"],
                              driver_version="570.124.06", audit={"settings": []},
                              hardware=(HW, ready, "" if ready else "FatalXid", why or "all checks passed"))


def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    led = Ledger(f"bench-limit-{a.nodes}", ledger_root())
    cp = ControlPlane(work / "cp", led, audit_policy=AUDIT_POLICY)
    host = dgx_topology()
    out: dict[str, Any] = {"nodes": a.nodes, "limit": a.limit}
    pool = api = None
    try:
        cp.start(timeout=120)
        admin = AdminPool(cp)
        pool = ThreadPoolExecutor(a.workers)
        list(pool.map(lambda i: admin.request("POST", "/api/v1/nodes", kubelet_node(i)), range(a.nodes)))
        try:
            admin.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        except RuntimeError:
            pass
        admin.request("POST", f"/api/v1/namespaces/{NS}/configmaps",
                      {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": LEDGER}})
        cfg, source = reader_configuration(str(cp.kubeconfig))
        cfg.connection_pool_maxsize = a.workers
        api = CoreV1(cfg)
        names = [f"gpu-node-{i:05d}" for i in range(a.nodes)]
        pubs = [KubePublisher(n, cfg, source=source, api=api, limit=a.limit, ledger_namespace=NS) for n in names]
        ready, down = want(host, True), want(host, False)
        t0 = time.monotonic()
        first = list(pool.map(lambda p: p.publish(ready), pubs))
        assert all(r.ok for r in first), [r.detail for r in first if not r.ok][:3]
        print(f"{a.nodes} Nodes created and published ready by their agents in {time.monotonic() - t0:.1f} s",
              flush=True)

        def storm(label: str) -> dict[str, Any]:
            mark = cp.audit_mark()
            done: list[float] = []
            lock = threading.Lock()

            def one(p: KubePublisher) -> Any:
                p.read()  # a pass: the GET at its start, the publish at its end (gpu-tune serve)
                r = p.publish(down)
                with lock:
                    done.append(time.monotonic())
                return r

            before = [(p.gate.writes, p.gate.conflicts) for p in pubs]
            t0 = time.monotonic()
            results = list(pool.map(one, pubs))  # every pass submitted in the same instant
            wall = max(done) - t0
            cp.wait_audit_flushed(quiet_s=1.0, timeout=60)
            calls = agent_calls(cp, mark)
            nodes = admin.request("GET", "/api/v1/nodes")["items"]
            taints = sum(1 for n in nodes if any(t.get("key") == TAINT_KEY for t in n["spec"].get("taints") or []))

            def cond(n: dict[str, Any], ctype: str) -> str | None:
                return next((c["status"] for c in n["status"].get("conditions") or [] if c["type"] == ctype), None)

            row = {"tainted": taints, "ready_false": sum(cond(n, "GPUHostReady") == "False" for n in nodes),
                   "hw_false": sum(cond(n, HW) == "False" for n in nodes),
                   "ledger_entries": len(admin.request("GET", f"/api/v1/namespaces/{NS}/configmaps/{LEDGER}")
                                         .get("data") or {}),
                   "writes_max": max(r.writes for r in results),
                   "writes_median": statistics.median(r.writes for r in results),
                   "ledger_writes_max": max(p.gate.writes - b[0] for p, b in zip(pubs, before)),
                   "ledger_writes_median": statistics.median(p.gate.writes - b[0] for p, b in zip(pubs, before)),
                   "conflicts": sum(p.gate.conflicts - b[1] for p, b in zip(pubs, before)),
                   "exhausted": sum(1 for r in results if r.limit is not None and "changed under each" in r.limit.says),
                   "failed": [r.detail for r in results if not r.ok][:3],
                   "all_done_s": wall, **{k: calls[k] for k in ("reads", "writes", "p50_ms", "p99_ms",
                                                                   "peak_writes_per_s")}}
            print(f"{label:<18} tainted {row['tainted']:>4} (limit {a.limit})  GPUHostReady False {row['ready_false']:>5}  "
                  f"{HW} False {row['hw_false']:>4}  ledger {row['ledger_entries']:>3} entries  "
                  f"writes/node max {row['writes_max']} median {row['writes_median']:g} "
                  f"(ledger updates max {row['ledger_writes_max']} median {row['ledger_writes_median']:g})  "
                  f"409s {row['conflicts']}  tries spent {row['exhausted']}  all done after {row['all_done_s']:.1f} s  "
                  f"API reads {row['reads']} writes {row['writes']} p50 {row['p50_ms']:.0f} ms p99 {row['p99_ms']:.0f} ms"
                  + (f"  FAILED {row['failed']}" if row["failed"] else ""), flush=True)
            return row

        out["storm"] = storm("all turn not ready")
        out["again"] = storm("the next pass")
    finally:
        if pool is not None:
            pool.shutdown()
        if api is not None:
            api.close()
        cp.stop()
        led.clean()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--limit", default="50", help="readiness.max_out_of_service (default 50)")
    ap.add_argument("--workers", type=int, default=64, help="connections and threads of the agents (default 64)")
    a = ap.parse_args()
    for line in janitor():
        print(f"realkube janitor: {line}")
    with tempfile.TemporaryDirectory(prefix="bench-limit-") as tmp:
        r = run(a, Path(tmp))
    s = r["storm"]
    from gpu_tune.judge.fleet_limit import allowed
    from gpu_tune.tune.readiness import parse_out_of_service

    cap = allowed(parse_out_of_service(a.limit), a.nodes)
    ok = s["tainted"] <= cap and s["ready_false"] == a.nodes and s["hw_false"] == s["tainted"] and not s["failed"]
    print(f"\nnodes tainted {s['tainted']} (target <= {cap}), GPUHostReady False {s['ready_false']} (target {a.nodes}), "
          f"writes per node max {s['writes_max']}, converged in {s['all_done_s']:.1f} s: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
