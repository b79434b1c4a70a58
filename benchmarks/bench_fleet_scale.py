#!/usr/bin/env python3
"""gpu-tune's agents on 1,000 and 5,000 Nodes of a real kube-apiserver: what they cost it.

    .venv/bin/python benchmarks/bench_fleet_scale.py [--nodes 1000,5000] [--interval 60] [--workers 16]
    (on a shared machine: flock /tmp/gpu-tune-cluster.lock .venv/bin/python benchmarks/bench_fleet_scale.py)

For each fleet size: a fresh etcd + kube-apiserver (the test harness's, tests/realkube; the
binaries of KUBE_BIN_DIR, no root needed), that many Nodes as kubelets register them on GPU nodes
(GPU Operator and Node Feature Discovery labels, capacity, conditions, images: about 6 KiB each),
then the agent's own publishing code for every Node in this one process: a
:class:`~gpu_tune.cluster.publisher.KubePublisher` per Node (one GET at the start of a pass, the
publish at its end, as ``gpu-tune serve`` does), the Node wanted as ``desired_node_state`` makes
it for an 8-GPU DGX host (the fixture's topology: a 6.2 KiB annotation, the summary with 8 probe
entries), all of them sharing one connection pool of ``--workers`` connections and threads.
When each agent passes comes from the agent's own schedule (:func:`gpu_tune.serve.agent.pass_wait`):
the agents start within ``--start-spread`` seconds of each other (a DaemonSet rolled out), and
each fleet-wide change happens ``--passes`` passes after the previous one; the passes are then
replayed in real time. Measured, from the API server's audit log (the agents' requests: user
agent ``gpu-tune/``) and /proc (the apiserver's and etcd's CPU and memory):

* idle: the Nodes and no agent;
* first start: every agent's first publish (labels, annotations, condition, Event), as fast as
  this process sends them;
* steady: one interval of passes: reads and writes per second per 1,000 nodes (0 writes), and a
  pass with every agent's heartbeat due (the condition re-written every 10 minutes);
* three fleet-wide changes: a driver upgrade (labels and topology), a profile change, every
  verdict flipping to not ready (label, summary, taint, condition, Event): writes per node, the
  API server's p50/p99 latency, the most writes in one second, and the time until every Node
  shows it (from the change to the last agent's publish);
* ``gpu-tune fleet`` over the whole fleet (the CLI process, ``-o json``): time, peak memory, pages.

The API server runs with the harness's flags (blocking audit log, etcd without fsync), on the
same cores as this process: figures of the "as fast as it sends" kind are bounded by this
process, not by the server. Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpu_tune.cluster.api import CoreV1, reader_configuration  # noqa: E402
from gpu_tune.cluster.labels import desired_node_state  # noqa: E402
from gpu_tune.cluster.publisher import HEARTBEAT_S, KubePublisher  # noqa: E402
from gpu_tune.serve.agent import pass_wait  # noqa: E402
from tests.fixtures.probes import probe_result, probe_verdict  # noqa: E402
from tests.realkube.cleanup import Ledger, janitor, ledger_root  # noqa: E402
from tests.realkube.controlplane import ControlPlane, audit_policy  # noqa: E402

# Every request at Metadata level, watches too: verbs, users, times, no bodies (the agents' writes carry 8 KiB)
AUDIT_POLICY = audit_policy(watches=True, bodies=False)
AGENT_UA = "gpu-tune/"
WRITES = ("create", "update", "patch", "delete")
READS = ("get", "list")
JITTER = 0.1  # the agent's default (gpu_tune/serve/agent.py)


# -- the Nodes, as kubelets and the GPU Operator leave them ------------------------------------------
def kubelet_node(i: int) -> dict[str, Any]:
    name = f"gpu-node-{i:05d}"
    nfd = {f"feature.node.kubernetes.io/cpu-cpuid.{f}": "true" for f in (
        "ADX", "AESNI", "AMXBF16", "AMXINT8", "AMXTILE", "AVX", "AVX2", "AVX512BF16", "AVX512BW", "AVX512CD",
        "AVX512DQ", "AVX512F", "AVX512FP16", "AVX512VL", "AVX512VNNI", "FMA3", "SHA", "VAES", "VPCLMULQDQ")}
    nfd.update({"feature.node.kubernetes.io/kernel-version.full": "6.8.0-1019-nvidia",
                "feature.node.kubernetes.io/kernel-version.major": "6",
                "feature.node.kubernetes.io/kernel-version.minor": "8",
                "feature.node.kubernetes.io/pci-10de.present": "true",
                "feature.node.kubernetes.io/pci-15b3.present": "true",
                "feature.node.kubernetes.io/system-os_release.ID": "ubuntu",
                "feature.node.kubernetes.io/system-os_release.VERSION_ID": "22.04",
                "feature.node.kubernetes.io/memory-numa": "true",
                "feature.node.kubernetes.io/network-sriov.capable": "true"})
    gfd = {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
           "nvidia.com/gpu.count": "8", "nvidia.com/gpu.memory": "81559", "nvidia.com/gpu.family": "hopper",
           "nvidia.com/gpu.compute.major": "9", "nvidia.com/gpu.compute.minor": "0",
           "nvidia.com/cuda.driver.major": "570", "nvidia.com/cuda.driver.minor": "124",
           "nvidia.com/cuda.driver.rev": "06", "nvidia.com/cuda.runtime.major": "12",
           "nvidia.com/cuda.runtime.minor": "8", "nvidia.com/mig.capable": "true", "nvidia.com/gfd.timestamp": "1732600000"}
    now = "2026-11-26T00:00:00Z"
    conds = [{"type": t, "status": "False", "reason": r, "message": m, "lastHeartbeatTime": now,
              "lastTransitionTime": now} for t, r, m in (
        ("MemoryPressure", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
        ("DiskPressure", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
        ("PIDPressure", "KubeletHasSufficientPID", "kubelet has sufficient PID available"))]
    conds.append({"type": "Ready", "status": "True", "reason": "KubeletReady",
                  "message": "kubelet is posting ready status", "lastHeartbeatTime": now, "lastTransitionTime": now})
    cap = {"cpu": "224", "memory": "2113445612Ki", "pods": "110", "ephemeral-storage": "7440663740Ki",
           "hugepages-1Gi": "0", "hugepages-2Mi": "0", "nvidia.com/gpu": "8", "rdma/rdma_shared_device_a": "63"}
    images = [{"names": [f"nvcr.io/nvidia/{img}@sha256:{(i * 7919 + k):064x}", f"nvcr.io/nvidia/{img}:{tag}"],
               "sizeBytes": 10 ** 9 + k} for k, (img, tag) in enumerate((
                   ("pytorch", "24.10-py3"), ("k8s-device-plugin", "v0.17.0"), ("gpu-feature-discovery", "v0.17.0"),
                   ("dcgm-exporter", "3.3.8"), ("driver", "570.124.06"), ("container-toolkit", "v1.17.0"),
                   ("gpu-operator", "v24.9.0"), ("k8s/node-feature-discovery", "v0.16.6")))]
    ip = f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}"
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                                  "kubernetes.io/arch": "amd64",
                                                  "node.kubernetes.io/instance-type": "gpu-8x-h100",
                                                  "topology.kubernetes.io/zone": f"zone-{i % 4}", **nfd, **gfd}},
            "spec": {"podCIDR": f"10.{128 + i // 256 % 128}.{i % 256}.0/24"},
            "status": {"capacity": cap, "allocatable": {**cap, "cpu": "222", "memory": "2111245612Ki"},
                       "conditions": conds,
                       "addresses": [{"type": "InternalIP", "address": ip}, {"type": "Hostname", "address": name}],
                       "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
                       "nodeInfo": {"machineID": f"{i:032x}", "systemUUID": f"{i:08x}-0000-0000-0000-000000000000",
                                    "bootID": f"{i:08x}-b007-0000-0000-000000000000",
                                    "kernelVersion": "6.8.0-1019-nvidia", "osImage": "Ubuntu 22.04.5 LTS",
                                    "containerRuntimeVersion": "containerd://1.7.24", "kubeletVersion": "v1.36.2",
                                    "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64"},
                       "images": images}}


class AdminPool:
    """The admin's calls (client certificate) over one kept-alive connection per thread."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self._local = threading.local()

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        for attempt in (1, 2):
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = http.client.HTTPSConnection(self.cp.host, self.cp.port,
                                                                      context=self.cp.ssl_context(), timeout=120)
            try:
                conn.request(method, path, body=data, headers={"Content-Type": "application/json",
                                                               "Accept": "application/json"})
                resp = conn.getresponse()
                out = resp.read()
                break
            except (ConnectionError, http.client.HTTPException):  # an idle connection the server closed
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise
        if resp.status >= 300:
            raise RuntimeError(f"{method} {path}: HTTP {resp.status}: {out[:300]!r}")
        return json.loads(out) if out else None


# -- what the agents publish ---------------------------------------------------------------------------
def dgx_topology() -> dict[str, Any]:
    """The topology ``gpu-tune`` discovers on the 8-GPU DGX fixture host."""
    from gpu_tune.discover.topology import discover
    from gpu_tune.gpu import select_backend
    from gpu_tune.host.fs import HostFS
    from tests.fixtures import hostgen

    with tempfile.TemporaryDirectory() as tmp:
        root = hostgen.build("dgx-8gpu", Path(tmp) / "host")
        backend = select_backend("fixture", str(REPO / "tests" / "fixtures" / "gpu" / "dgx-8gpu.json"))
        topo = discover(HostFS(str(root)), backend).as_dict()
        gpus = [g.as_dict() for g in backend.gpus()]
    return {"topology": topo, "gpus": gpus}


def want(host: dict[str, Any], *, ready: bool = True, profile: str = "training", driver: str = "570.124.06"):
    topo = {**host["topology"], "driver_version": driver, "cuda_driver_version": "12.8" if driver < "58" else "13.0"}
    checks = [{"name": "probe.3.passed", "ok": False, "detail": "failed: accuracy 0.41 < 0.90"}] if not ready else []
    probes = [probe_verdict(str(g), probe_result(accuracy=0.41 if (g == 3 and not ready) else 0.9812),
                            passed=ready or g != 3) for g in range(8)]
    return desired_node_state(profile=profile, ready=ready, reason="" if ready else "ProbeFailed",
                              message="all checks passed" if ready else "probe.3.passed: failed: accuracy 0.41 < 0.90",
                              topology=topo, gpus=host["gpus"], driver_version=driver, checks=checks,
                              audit={"settings": []}, probes=probes, mode="enforce")


# -- measuring ----------------------------------------------------------------------------------------
def proc_cpu_rss(pid: int) -> tuple[float, float]:
    """(CPU seconds, RSS MiB) of a process."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return (int(stat[11]) + int(stat[12])) / ticks, rss


class Meter:
    """CPU (share of one core) and peak RSS of the API server and etcd over a phase, sampled
    every 0.5 s; this process's CPU beside them."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.peak = {k: 0.0 for k in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.5):
            for k, pid in self.pids.items():
                self.peak[k] = max(self.peak[k], proc_cpu_rss(pid)[1])

    def __enter__(self) -> "Meter":
        self.t0 = time.monotonic()
        self.cpu0 = {k: proc_cpu_rss(p)[0] for k, p in self.pids.items()}
        r = resource.getrusage(resource.RUSAGE_SELF)
        self.self0 = r.ru_utime + r.ru_stime
        for k, pid in self.pids.items():
            self.peak[k] = proc_cpu_rss(pid)[1]
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.wall = time.monotonic() - self.t0
        self.cpu = {k: (proc_cpu_rss(p)[0] - self.cpu0[k]) / self.wall * 100 for k, p in self.pids.items()}
        r = resource.getrusage(resource.RUSAGE_SELF)
        self.self_cpu = (r.ru_utime + r.ru_stime - self.self0) / self.wall * 100


def _ts(stamp: str) -> float:
    # 2026-11-26T20:55:24.123456Z
    base, _, frac = stamp.rstrip("Z").partition(".")
    return time.mktime(time.strptime(base, "%Y-%m-%dT%H:%M:%S")) + float(f"0.{frac or 0}")


def agent_calls(cp: ControlPlane, since: int) -> dict[str, Any]:
    """The agents' requests after ``since`` in the audit log: reads, writes, the server's
    latency (received to response complete), the most writes in one second."""
    reads = writes = 0
    lat: list[float] = []
    per_second: Counter[int] = Counter()
    verbs: Counter[str] = Counter()
    for ev in cp.audit(since):
        if not str(ev.get("userAgent", "")).startswith(AGENT_UA):
            continue
        verb = ev.get("verb", "")
        verbs[f"{verb} {(ev.get('objectRef') or {}).get('subresource') or (ev.get('objectRef') or {}).get('resource')}"] += 1
        done = _ts(ev["stageTimestamp"])
        lat.append(done - _ts(ev["requestReceivedTimestamp"]))
        if verb in WRITES:
            writes += 1
            per_second[int(done)] += 1
        elif verb in READS:
            reads += 1
    lat.sort()

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(p * len(lat)))] * 1000 if lat else float("nan")

    return {"reads": reads, "writes": writes, "p50_ms": pct(0.50), "p99_ms": pct(0.99),
            "peak_writes_per_s": max(per_second.values(), default=0), "verbs": dict(verbs)}


# -- the agents -------------------------------------------------------------------------------------
class Fleet:
    """One publisher per Node (shared connection pool), and each agent's pass times."""

    def __init__(self, cp: ControlPlane, n: int, workers: int, interval: float, start_spread: float, seed: int) -> None:
        self.n, self.workers, self.interval = n, workers, interval
        cfg, source = reader_configuration(str(cp.kubeconfig))
        cfg.connection_pool_maxsize = workers
        self.cfg, self.source = cfg, source
        self.api = CoreV1(cfg)
        self.names = [f"gpu-node-{i:05d}" for i in range(n)]
        self.pubs = [KubePublisher(name, cfg, source=source, api=self.api) for name in self.names]
        self.rngs = [random.Random(seed * 1_000_003 + i) for i in range(n)]
        # a DaemonSet rolled out: each agent's first publish within start_spread seconds
        self.next = [r.uniform(0, start_spread) for r in self.rngs]
        self.first = [True] * n
        self.pool = ThreadPoolExecutor(workers)

    def advance(self, i: int) -> None:
        self.next[i] += pass_wait(self.rngs[i], self.interval, JITTER, after_first_publish=self.first[i])
        self.first[i] = False

    def passes_from(self, t: float) -> list[tuple[float, int]]:
        """Each agent's first pass at or after ``t`` (agent time), as (seconds after t, agent)."""
        for i in range(self.n):
            while self.next[i] < t:
                self.advance(i)
        return sorted((self.next[i] - t, i) for i in range(self.n))

    def replay(self, plan: list[tuple[float, int]], what: Callable[[int], Any], *, real_time: bool,
               publishers: list[KubePublisher] | None = None) -> dict[str, Any]:
        """Run one pass (read, then publish ``what(i)``) for each (offset, agent) of ``plan``, at
        its offset (``real_time``) or as fast as the pool goes; then advance those agents."""
        pubs = publishers or self.pubs
        done: list[float] = []
        failed: list[str] = []
        lock = threading.Lock()

        def one(i: int) -> None:
            pub = pubs[i]
            pub.read()
            r = pub.publish(what(i))
            with lock:
                done.append(time.monotonic())
                if not r.ok:
                    failed.append(r.detail)

        t0 = time.monotonic()
        futures = []
        for off, i in plan:
            if real_time:
                delay = t0 + off - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            futures.append(self.pool.submit(one, i))
        for f in futures:
            f.result()
        for _, i in plan:  # each agent of the plan made that pass
            self.advance(i)
        return {"all_done_s": max(done) - t0 if done else 0.0, "failed": failed}

    def close(self) -> None:
        self.pool.shutdown()
        self.api.close()


def spread(plan: list[tuple[float, int]]) -> str:
    offs = [o for o, _ in plan]
    q = statistics.quantiles(offs, n=10) if len(offs) > 1 else [0.0] * 9
    return f"{q[0]:.0f}-{q[-1]:.0f} s"


# -- one fleet size ------------------------------------------------------------------------------------
def run_size(n: int, a: argparse.Namespace, host: dict[str, Any], work: Path) -> dict[str, Any]:
    led = Ledger(f"bench-fleet-{os.getpid()}-{n}", ledger_root())
    cp = ControlPlane(work / f"cp-{n}", led, audit_policy=AUDIT_POLICY)
    out: dict[str, Any] = {"nodes": n}
    fleet = None
    try:
        cp.start(timeout=120)
        pids = {p.name: p.pid for p in cp.procs}
        admin = AdminPool(cp)
        t0 = time.monotonic()
        with ThreadPoolExecutor(a.workers) as pool:
            list(pool.map(lambda i: admin.request("POST", "/api/v1/nodes", kubelet_node(i)), range(n)))
        node_bytes = len(json.dumps(admin.request("GET", "/api/v1/nodes/gpu-node-00000")))
        out["create_s"] = time.monotonic() - t0
        print(f"\n== {n} nodes: created in {out['create_s']:.1f} s ({node_bytes / 1024:.1f} KiB each as kubelets "
              f"register them)", flush=True)

        def phase(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
            mark = cp.audit_mark()
            with Meter(pids) as m:
                extra = fn()
            cp.wait_audit_flushed(quiet_s=1.0, timeout=30)
            row = {**agent_calls(cp, mark), **extra, "wall_s": m.wall,
                   "apiserver_cpu_pct": m.cpu["kube-apiserver"], "etcd_cpu_pct": m.cpu["etcd"],
                   "apiserver_rss_mib": m.peak["kube-apiserver"], "etcd_rss_mib": m.peak["etcd"],
                   "client_cpu_pct": m.self_cpu}
            out[name] = row
            print(f"{name:<16} reads {row['reads']:>6} writes {row['writes']:>6} "
                  f"({row['writes'] / n:.2f}/node)  p50 {row['p50_ms']:6.1f} ms p99 {row['p99_ms']:7.1f} ms  "
                  f"peak {row['peak_writes_per_s']:>4} writes/s  apiserver {row['apiserver_cpu_pct']:5.1f} % "
                  f"{row['apiserver_rss_mib']:6.0f} MiB  etcd {row['etcd_cpu_pct']:5.1f} %  "
                  f"this process {row['client_cpu_pct']:5.1f} %  {row['wall_s']:5.1f} s"
                  + (f"  all shown after {row['all_done_s']:.1f} s" if "all_done_s" in row else "")
                  + (f"  passes spread {row['spread']}" if "spread" in row else "")
                  + (f"  FAILED {len(row['failed'])}: {row['failed'][:2]}" if row.get("failed") else ""), flush=True)
            return row

        phase("idle", lambda: (time.sleep(a.idle), {})[1])
        fleet = Fleet(cp, n, a.workers, a.interval, a.start_spread, a.seed)
        states = {"first": want(host), "driver": want(host, driver="580.65.06"),
                  "profile": want(host, driver="580.65.06", profile="inference"),
                  "flip": want(host, ready=False, driver="580.65.06", profile="inference")}
        plan = fleet.passes_from(0.0)
        phase("first start", lambda: fleet.replay(plan, lambda i: states["first"], real_time=False))
        clock = max(o for o, _ in plan) + a.interval
        plan = fleet.passes_from(clock)

        def steady() -> dict[str, Any]:  # one whole interval, whenever the passes fall in it
            t0 = time.monotonic()
            row = fleet.replay(plan, lambda i: states["first"], real_time=True)
            time.sleep(max(0.0, t0 + a.interval - time.monotonic()))
            return {**row, "spread": spread(plan)}

        phase("steady", steady)
        heart = [KubePublisher(name, fleet.cfg, source=fleet.source, api=fleet.api, heartbeat_s=1e-6)
                 for name in fleet.names]
        clock += a.interval
        plan = fleet.passes_from(clock)
        phase("heartbeat due", lambda: fleet.replay(plan, lambda i: states["first"], real_time=False,
                                                     publishers=heart))
        for name in ("driver", "profile", "flip"):
            clock += a.passes * a.interval
            plan = fleet.passes_from(clock)
            phase(name, lambda: {**fleet.replay(plan, lambda i, s=states[name]: s, real_time=True),
                                 "spread": spread(plan)})
        out["node_kib_after"] = len(json.dumps(admin.request("GET", "/api/v1/nodes/gpu-node-00000"))) / 1024
        out["node_kib"] = node_bytes / 1024
        out["fleet"] = fleet_view(cp, n, a, pids)
    finally:
        if fleet is not None:
            fleet.close()
        cp.stop()
        led.clean()
    return out


def fleet_view(cp: ControlPlane, n: int, a: argparse.Namespace, pids: dict[str, int]) -> dict[str, Any]:
    """``gpu-tune fleet -o json`` as a person runs it: the whole process, median of ``--fleet-runs``."""
    exe = Path(sys.executable).with_name("gpu-tune")
    argv = [str(exe) if exe.exists() else sys.executable, *([] if exe.exists() else ["-m", "gpu_tune"]),
            "fleet", "--kubeconfig", str(cp.kubeconfig), "-o", "json"]
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy")}
    walls, rss = [], []
    with Meter(pids) as m:
        for _ in range(a.fleet_runs):
            with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
                t0 = time.monotonic()
                proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env)
                _, status, usage = os.wait4(proc.pid, 0)  # (its own peak memory: ru_maxrss, KiB)
                walls.append(time.monotonic() - t0)
                proc.returncode = os.waitstatus_to_exitcode(status)
                out.seek(0)
                err.seek(0)
                if proc.returncode not in (0, 1):
                    raise SystemExit(f"gpu-tune fleet exited {proc.returncode}: {err.read().decode()[-500:]}")
                doc = json.loads(out.read())
            assert doc["nodes_listed"] == n and len(doc["nodes"]) == n, "the fleet view lost nodes"
            rss.append(usage.ru_maxrss / 1024)
    row = {"median_s": statistics.median(walls), "peak_rss_mib": max(rss), "pages": math.ceil(n / 500),
           "apiserver_cpu_pct": m.cpu["kube-apiserver"], "apiserver_rss_mib": m.peak["kube-apiserver"]}
    print(f"gpu-tune fleet   {n} nodes in {row['pages']} pages: median {row['median_s']:.2f} s, peak RSS "
          f"{row['peak_rss_mib']:.0f} MiB; apiserver {row['apiserver_cpu_pct']:.1f} % "
          f"{row['apiserver_rss_mib']:.0f} MiB", flush=True)
    return row


# -- the table -------------------------------------------------------------------------------------
def table(results: list[dict[str, Any]], a: argparse.Namespace) -> str:
    def row(label: str, fn: Callable[[dict[str, Any]], str]) -> str:
        return f"| {label} | " + " | ".join(fn(r) for r in results) + " |"

    def change(name: str, label: str) -> list[str]:
        return [row(f"{label}: writes per node", lambda r: f"{r[name]['writes'] / r['nodes']:.2f}"),
                row(f"{label}: API server p50 / p99 (ms)", lambda r: f"{r[name]['p50_ms']:.0f} / {r[name]['p99_ms']:.0f}"),
                row(f"{label}: most writes in one second", lambda r: f"{r[name]['peak_writes_per_s']}"),
                row(f"{label}: every Node shows it after (s)", lambda r: f"{r[name]['all_done_s']:.1f}"),
                row(f"{label}: API server CPU (% of a core)", lambda r: f"{r[name]['apiserver_cpu_pct']:.0f}")]

    ivl = a.interval
    lines = ["| | " + " | ".join(f"{r['nodes']:,} nodes" for r in results) + " |",
             "| --- | " + " | ".join("---" for _ in results) + " |",
             row("a Node as kubelets register it / with the agent's keys (KiB)",
                 lambda r: f"{r['node_kib']:.1f} / {r['node_kib_after']:.1f}"),
             row("no agents: API server CPU (% of a core) / RSS (MiB)",
                 lambda r: f"{r['idle']['apiserver_cpu_pct']:.1f} / {r['idle']['apiserver_rss_mib']:.0f}"),
             row("first start: writes per node", lambda r: f"{r['first start']['writes'] / r['nodes']:.2f}"),
             row("first start: API server p50 / p99 (ms)",
                 lambda r: f"{r['first start']['p50_ms']:.0f} / {r['first start']['p99_ms']:.0f}"),
             row(f"steady, interval {ivl:g} s: reads/s per 1,000 nodes",
                 lambda r: f"{r['steady']['reads'] / r['nodes'] * 1000 / ivl:.1f}"),
             row("steady: writes on a steady pass", lambda r: f"{r['steady']['writes']}"),
             row(f"steady: heartbeat writes/s per 1,000 nodes (every {HEARTBEAT_S / 60:g} min)",
                 lambda r: f"{r['heartbeat due']['writes'] / r['nodes'] * 1000 / HEARTBEAT_S:.2f}"),
             row("steady: API server p50 / p99 (ms)", lambda r: f"{r['steady']['p50_ms']:.0f} / {r['steady']['p99_ms']:.0f}"),
             row("steady: API server CPU (% of a core) / RSS (MiB)",
                 lambda r: f"{r['steady']['apiserver_cpu_pct']:.1f} / {r['steady']['apiserver_rss_mib']:.0f}"),
             *change("driver", "driver upgrade (labels, topology)"),
             *change("profile", "profile change"),
             *change("flip", "every verdict flips"),
             row("`gpu-tune fleet -o json`: time (s) / peak RSS (MiB) / pages",
                 lambda r: f"{r['fleet']['median_s']:.2f} / {r['fleet']['peak_rss_mib']:.0f} / {r['fleet']['pages']}"),
             row("`gpu-tune fleet`: API server CPU (% of a core)", lambda r: f"{r['fleet']['apiserver_cpu_pct']:.0f}")]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="1000,5000", help="fleet sizes, comma-separated (default 1000,5000)")
    ap.add_argument("--interval", type=float, default=60.0, help="the agents' --interval (the chart's default: 60)")
    ap.add_argument("--workers", type=int, default=16, help="connections and threads publishing (default 16)")
    ap.add_argument("--start-spread", type=float, default=10.0,
                    help="seconds within which the agents first publish after a rollout (default 10)")
    ap.add_argument("--passes", type=int, default=3, help="passes between one fleet-wide change and the next")
    ap.add_argument("--idle", type=float, default=15.0, help="seconds of the no-agent baseline")
    ap.add_argument("--fleet-runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    a = ap.parse_args()
    sizes = [int(x) for x in a.nodes.split(",") if x.strip()]
    for line in janitor():
        print(f"realkube janitor: {line}")
    host = dgx_topology()
    print(f"agents' interval {a.interval:g} s, jitter {JITTER:.0%}, {a.workers} connections; started within "
          f"{a.start_spread:g} s; a fleet-wide change every {a.passes} passes; load {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        for n in sizes:
            results.append(run_size(n, a, host, Path(tmp)))
            if a.json:  # what is measured so far, should a later size fail
                Path(a.json).write_text(json.dumps({"args": vars(a), "results": results}, indent=1, default=str))
    print("\n" + table(results, a))
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": results}, indent=1, default=str))
    failed = [(r["nodes"], k) for r in results for k, v in r.items() if isinstance(v, dict) and v.get("failed")]
    steady_writes = [r["steady"]["writes"] for r in results]
    print(f"\nsteady passes: {steady_writes} writes (want 0); failed publishes: {failed or 'none'}")
    return 0 if not failed and not any(steady_writes) else 1


if __name__ == "__main__":
    sys.exit(main())
