"""The probe's data-path measurement, run while TensorFlow imports.

Host memory -> PCIe -> GPU is what the probe's NUMA binding exists for. :class:`DataPath` runs
``python -m gpu_tune.gpu.bandwidth`` (host<->GPU and GPU memory bandwidth; see that module) in a
process of its own, in a background thread started before TensorFlow's import, so the seconds it
takes are hidden behind the import's instead of added to the time to verdict, and no CUDA state is
shared with TensorFlow:

1. ``local``: with the probe's own binding (CPUs and memory of the GPU's NUMA node), host<->GPU
   copies and the GPU's device-to-device memory bandwidth;
2. ``remote`` (``--remote-numa-node``, given where the machine has more than one NUMA node): the
   same host<->GPU copies with the host buffer bound to that node (``numactl --membind``, or the
   project's own binder without numactl), on the same CPUs: what the pinning buys.

The two run one after the other (they share the link), and both finish before the workload puts
anything on the GPU. The result is ``{"bandwidth": {...}, "memory_bandwidth": {...}}`` for the
workload's JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any, Sequence

from gpu_tune.host.parse import format_cpulist

MODULE = "gpu_tune.gpu.bandwidth"
NO_GPU = "no GPU: bandwidth not measured"


def not_measured(reason: str = NO_GPU) -> dict[str, Any]:
    return {"status": "not_measured", "reason": reason}


def membind_prefix(node: int, cpus: Sequence[int] | frozenset[int]) -> list[str]:
    """Run what follows on ``cpus`` with its memory bound to NUMA node ``node``."""
    cpulist = format_cpulist(frozenset(cpus))
    numactl = shutil.which("numactl")
    if numactl:
        return [numactl, f"--physcpubind={cpulist}", f"--membind={node}", "--"]
    return [sys.executable, "-m", "gpu_tune.launch.bind", "--cpus", cpulist, "--node", str(node), "--"]


def run_child(cmd: list[str], timeout: float) -> dict[str, Any]:
    """One measurement process: its JSON document, or an ``error`` naming how it ended."""
    try:
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "error", "reason": f"the bandwidth measurement ran past {timeout:g} s: killed"}
    except OSError as exc:
        return {"status": "error", "reason": f"could not start {cmd[0]!r}: {exc.strerror or exc}"}
    lines = p.stdout.decode(errors="replace").strip().splitlines()
    try:
        doc = json.loads(lines[-1]) if lines else None
    except ValueError:
        doc = None
    if p.returncode != 0 or not isinstance(doc, dict):
        err = p.stderr.decode(errors="replace").strip().splitlines()
        return {"status": "error", "reason": f"the bandwidth measurement exited {p.returncode}: "
                                             f"{err[-1] if err else 'no output'}"}
    return doc


def combine(local: dict[str, Any], remote: dict[str, Any] | None, *, local_node: int | None,
            remote_node: int | None, seconds: float) -> dict[str, Any]:
    """The workload's ``bandwidth`` and ``memory_bandwidth`` from the children's documents."""
    def side(doc: dict[str, Any], node: int | None) -> dict[str, Any]:
        out = {"numa_node": node, "status": doc.get("status")}
        if doc.get("status") == "measured":
            out.update({k: doc[k] for k in ("h2d", "d2h") if k in doc})
        else:
            out["reason"] = doc.get("reason")
        out.update({k: doc[k] for k in ("mempolicy", "cpus", "cleanup_errors") if k in doc})
        return out

    if local.get("status") != "measured":
        reason = str(local.get("reason") or "not measured")
        gone = {"status": local.get("status") or "error", "reason": reason}
        return {"bandwidth": {**gone, "seconds": round(seconds, 3)}, "memory_bandwidth": dict(gone)}
    bw: dict[str, Any] = {"status": "measured", "size_bytes": local.get("size_bytes"), "samples": local.get("samples"),
                          "cuda_runtime": local.get("cuda_runtime"), "cuda_driver": local.get("cuda_driver"),
                          "local": side(local, local_node)}
    if remote is not None:
        bw["remote"] = side(remote, remote_node)
    else:
        bw["remote"] = {"numa_node": None, **not_measured("one NUMA node (or none known): no remote node to measure from")}
    bw["seconds"] = round(seconds, 3)
    mem = local.get("device_memory")
    memory = ({"status": "measured", **mem} if isinstance(mem, dict)
              else not_measured("device-to-device copies were not run"))
    return {"bandwidth": bw, "memory_bandwidth": memory}


class DataPath:
    """The measurement in a background thread: :meth:`start`, then :meth:`result` (waits)."""

    def __init__(self, *, size_mib: int, samples: int, local_node: int | None, remote_node: int | None,
                 timeout: float = 60.0) -> None:
        self.size_mib, self.samples, self.timeout = size_mib, samples, timeout
        self.local_node, self.remote_node = local_node, remote_node
        self.seconds = 0.0
        self._out: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._run, name="datapath", daemon=True)

    def command(self, *, device_memory: bool) -> list[str]:
        cmd = [sys.executable, "-m", MODULE, "--size-mib", str(self.size_mib), "--samples", str(self.samples)]
        return cmd + ([] if device_memory else ["--no-device-memory"])

    def _run(self) -> None:
        t0 = time.perf_counter()
        local = run_child(self.command(device_memory=True), self.timeout)
        remote = None
        if local.get("status") == "measured" and self.remote_node is not None:
            cpus = os.sched_getaffinity(0)
            remote = run_child(membind_prefix(self.remote_node, cpus) + self.command(device_memory=False),
                               self.timeout)
        self.seconds = time.perf_counter() - t0
        self._out = combine(local, remote, local_node=self.local_node, remote_node=self.remote_node,
                            seconds=self.seconds)

    def start(self) -> "DataPath":
        self._thread.start()
        return self

    def result(self) -> dict[str, Any]:
        self._thread.join(2 * self.timeout + 10)
        if self._out is None:
            gone = {"status": "error", "reason": "the bandwidth measurement did not finish"}
            return {"bandwidth": gone, "memory_bandwidth": dict(gone)}
        return self._out
