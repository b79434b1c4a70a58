"""Many agents publishing at once against the local test API server.

    .venv/bin/python benchmarks/bench_kube.py [--agents 500] [--gpus 8] [--latency-ms 0]

Each simulated agent is a real publisher (kubernetes client, own connection pool, own thread) for
its own Node. All start together (a barrier) and publish a not-ready state (first start), then
publish the same state again (steady pass), then all turn ready (a transition). Prints write
calls per phase against the targets (first start <= 4 per node, steady 0) and wall times.
Exit status 1 when a target is missed or a publish failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_tune.cluster.publisher import make_publisher  # noqa: E402
from gpu_tune.cluster.labels import desired_node_state  # noqa: E402
from tests.kubeapi import KubeAPIServer, write_kubeconfig  # noqa: E402


def _want(ready: bool, gpus: int):
    topo = {"numa_nodes": [{"id": 0, "cpus": "0-55"}, {"id": 1, "cpus": "56-111"}],
            "gpus": [{"index": i, "pci_bus_id": f"0000:{0x18 + i:02x}:00.0", "name": "NVIDIA H100 80GB HBM3",
                      "numa_node": i * 2 // max(gpus, 1)} for i in range(gpus)], "nics": []}
    rows = [{"index": i, "uuid": f"GPU-{i}", "name": "NVIDIA H100 80GB HBM3", "pci_bus_id": f"0000:{0x18 + i:02x}:00.0",
             "memory_total_mib": 81559, "compute_capability": "9.0"} for i in range(gpus)]
    return desired_node_state(profile="training", ready=ready, reason="" if ready else "ProbePending",
                              message="all checks passed" if ready else "probe has not run yet",
                              topology=topo, gpus=rows, driver_version="570.124.06")


def _phase(name: str, pubs, want, api: KubeAPIServer) -> tuple[int, int, float]:
    api.reset_counts()
    barrier = threading.Barrier(len(pubs))
    results = [None] * len(pubs)

    def run(i: int) -> None:
        barrier.wait()
        results[i] = pubs[i].publish(want)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(pubs))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    failed = [r for r in results if r is None or not r.ok]
    writes = api.total_writes()
    worst = max(api.writes.values(), default=0)
    print(f"{name:<14} writes {writes:>6} (max {worst} per node)  reads {sum(api.reads.values()):>6}  "
          f"failed {len(failed):>4}  wall {wall:6.2f} s")
    for r in failed[:3]:
        print(f"  failure: {r.detail if r else 'no result'}")
    return writes, len(failed), wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=500)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--latency-ms", type=float, default=0.0, help="added to every API call")
    args = ap.parse_args()

    with KubeAPIServer() as api, tempfile.TemporaryDirectory() as tmp:
        api.latency_s = args.latency_ms / 1000
        kc = str(write_kubeconfig(Path(tmp) / "kubeconfig", api.url))
        names = [f"gpu-node-{i:04d}" for i in range(args.agents)]
        for n in names:
            api.add_node(n, taints=[{"key": "gpu-tune.io/not-ready", "effect": "NoSchedule"}])
        t0 = time.perf_counter()
        pubs = [make_publisher(n, kc, False) for n in names]
        print(f"{args.agents} agents, {args.gpus} GPUs each; publishers built in {time.perf_counter() - t0:.2f} s")
        first, f1, _ = _phase("first start", pubs, _want(False, args.gpus), api)
        steady, f2, _ = _phase("steady pass", pubs, _want(False, args.gpus), api)
        flip, f3, _ = _phase("turn ready", pubs, _want(True, args.gpus), api)
        steady2, f4, _ = _phase("steady ready", pubs, _want(True, args.gpus), api)
        for p in pubs:
            p.close()
    ok = first <= 4 * args.agents and steady == 0 and steady2 == 0 and not (f1 or f2 or f3 or f4)
    print(f"targets: first start <= {4 * args.agents} writes: {first}; steady passes 0 writes: "
          f"{steady} and {steady2}; ready transition: {flip} -> {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
