"""The GPU's data path, measured: host<->GPU copy bandwidth and the GPU's memory bandwidth.

``python -m gpu_tune.gpu.bandwidth [--size-mib 256] [--samples 5] [--warmup 1] [--no-device-memory]``
prints ONE JSON document and exits 0 (a GPU it cannot measure is a ``status`` in it, never a
crash); 2 for a bad argument. The probe workload runs it in its own process (``CUDA_VISIBLE_DEVICES``
naming the probed GPU), once with the probe's own NUMA binding and, on a machine with more than
one NUMA node, once with its host memory bound to a remote node (``numactl --membind``): no CUDA
state is shared with TensorFlow.

How it measures, as nvbandwidth's ``host_to_device_memcpy_ce`` / ``device_to_host_memcpy_ce``
(what azurehpc-health-checks' ``check_gpu_bw`` runs) do: a page-locked host buffer
(``cudaHostAlloc``) and a device buffer of ``--size-mib`` each, copies by the copy engines
(``cudaMemcpyAsync`` on a non-blocking stream), each timed by CUDA events recorded around it on
that stream; ``--warmup`` copies first, untimed, then the median of ``--samples`` timed ones.
Bandwidth is bytes copied / seconds, in bytes per second (1 GB/s = 1e9).

The GPU's memory bandwidth: device-to-device copies between two device buffers, counted as
bytes read plus bytes written (2 x the size per copy), as DCGM's memory-bandwidth figures are
(``dcgmproftester``'s DRAM test adds ``2 * bufferSize`` per ``cuMemcpy``), so they compare with
DCGM's per-SKU baselines.

:func:`measure` takes a :class:`gpu_tune.gpu.cudart.Runtime` (over the real library or a fake),
so every decision is tested without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack
from typing import Any

from gpu_tune.gpu.cudart import (DEVICE_TO_DEVICE, DEVICE_TO_HOST, HOST_TO_DEVICE, CudaError, CudartUnavailable,
                                 Runtime, load)

MIB = 1 << 20
DEFAULT_SIZE_MIB = 256
DEFAULT_SAMPLES = 5
NO_GPU = "no GPU: bandwidth not measured"


def not_measured(reason: str) -> dict[str, Any]:
    return {"status": "not_measured", "reason": reason}


def _own_memory_policy() -> str:
    """This process's memory policy word (``bind:1``, ``default``), from its own numa_maps."""
    try:
        with open("/proc/self/numa_maps", encoding="ascii", errors="replace") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) >= 2:
                    return fields[1]
    except OSError:
        pass
    return "unavailable"


def _cleanup(failed: list[str], call: Any, *args: Any) -> None:
    """A clean-up call: its failure is recorded, and never hides the error that ended the
    measurement."""
    try:
        call(*args)
    except CudaError as exc:
        failed.append(str(exc))


def _figures(size: int, seconds: list[float], factor: int = 1) -> dict[str, Any]:
    rates = [factor * size / s for s in seconds]
    return {"bytes_per_second": round(statistics.median(rates), 1),
            "samples_bytes_per_second": [round(r, 1) for r in rates],
            "samples_seconds": [round(s, 7) for s in seconds]}


def _timed(rt: Runtime, dst: int, src: int, size: int, kind: int, stream: int, start: int, stop: int, *,
           warmup: int, samples: int) -> list[float]:
    out = []
    for i in range(warmup + samples):
        rt.event_record(start, stream)
        rt.memcpy_async(dst, src, size, kind, stream)
        rt.event_record(stop, stream)
        rt.event_synchronize(stop)
        ms = rt.elapsed_ms(start, stop)
        if i < warmup:
            continue
        if not ms > 0:
            raise CudaError("cudaEventElapsedTime", 0, f"a {size} byte copy timed at {ms} ms")
        out.append(ms / 1000.0)
    return out


def measure(rt: Runtime, *, size: int = DEFAULT_SIZE_MIB * MIB, samples: int = DEFAULT_SAMPLES, warmup: int = 1,
            device_memory: bool = True) -> dict[str, Any]:
    """Host->GPU, GPU->host and (``device_memory``) GPU memory bandwidth of device 0.

    ``{"status": "measured", "h2d": {...}, "d2h": {...}, "device_memory": {...}}`` (each with
    ``bytes_per_second``, the median, and the samples); ``not_measured`` when there is no GPU;
    ``error`` with the failing call when a CUDA call fails. Every allocation is freed, and the
    device reset, whatever happens."""
    if samples < 3:
        raise ValueError(f"samples {samples}: at least 3 timed copies are needed for a median")
    t0 = time.perf_counter()
    out: dict[str, Any] = {"status": "measured", "size_bytes": int(size), "samples": int(samples),
                           "warmup": int(warmup)}
    try:
        count = rt.device_count()
    except CudaError as exc:
        if exc.no_gpu:
            return not_measured(f"{NO_GPU} ({exc})")
        return {"status": "error", "reason": str(exc)}
    if count < 1:
        return not_measured(f"{NO_GPU} (the CUDA runtime sees no device)")
    cleanup: list[str] = []
    try:
        out["cuda_runtime"], out["cuda_driver"] = rt.runtime_version(), rt.driver_version()
        rt.set_device(0)
        with ExitStack() as stack:
            stack.callback(_cleanup, cleanup, rt.device_reset)  # last: the process leaves the GPU as it found it
            host = rt.host_alloc(size)
            stack.callback(_cleanup, cleanup, rt.free_host, host)
            dev = rt.malloc(size)
            stack.callback(_cleanup, cleanup, rt.free, dev)
            stream = rt.stream_create()
            stack.callback(_cleanup, cleanup, rt.stream_destroy, stream)
            start = rt.event_create()
            stack.callback(_cleanup, cleanup, rt.event_destroy, start)
            stop = rt.event_create()
            stack.callback(_cleanup, cleanup, rt.event_destroy, stop)
            kw = {"warmup": warmup, "samples": samples}
            out["h2d"] = _figures(size, _timed(rt, dev, host, size, HOST_TO_DEVICE, stream, start, stop, **kw))
            out["d2h"] = _figures(size, _timed(rt, host, dev, size, DEVICE_TO_HOST, stream, start, stop, **kw))
            if device_memory:
                dev2 = rt.malloc(size)
                stack.callback(_cleanup, cleanup, rt.free, dev2)
                d2d = _timed(rt, dev2, dev, size, DEVICE_TO_DEVICE, stream, start, stop, **kw)
                out["device_memory"] = {**_figures(size, d2d, factor=2), "counted": "bytes read + bytes written"}
    except CudaError as exc:
        out = {"status": "error", "reason": str(exc)}
    if cleanup:
        out["cleanup_errors"] = cleanup
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def run(size_mib: int, samples: int, warmup: int, device_memory: bool, library: str | None = None) -> dict[str, Any]:
    """Load the runtime and measure; the process's binding is recorded beside the figures."""
    try:
        rt = Runtime(load(library))
    except CudartUnavailable as exc:
        doc = not_measured(f"{NO_GPU}: {exc}")
    else:
        doc = measure(rt, size=size_mib * MIB, samples=samples, warmup=warmup, device_memory=device_memory)
    doc["mempolicy"] = _own_memory_policy()
    try:
        from gpu_tune.host.parse import format_cpulist

        doc["cpus"] = format_cpulist(os.sched_getaffinity(0))
    except OSError:
        pass
    return doc


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gpu_tune.gpu.bandwidth", description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=DEFAULT_SIZE_MIB, help="bytes per copy, MiB (16..4096)")
    p.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="timed copies per direction (3..100)")
    p.add_argument("--warmup", type=int, default=1, help="untimed copies first (0..10)")
    p.add_argument("--no-device-memory", action="store_true", help="host<->GPU only, no device-to-device copies")
    p.add_argument("--library", default=None, help="the CUDA runtime to load [default: $GPU_TUNE_CUDART, else searched]")
    a = p.parse_args(argv)
    for flag, value, lo, hi in (("--size-mib", a.size_mib, 16, 4096), ("--samples", a.samples, 3, 100),
                                ("--warmup", a.warmup, 0, 10)):
        if not lo <= value <= hi:
            p.error(f"{flag} {value}: expected {lo}..{hi}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    doc = run(a.size_mib, a.samples, a.warmup, not a.no_device_memory, a.library)
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
