"""Facts the probe reads about its own process and CPU, and the NVML sampler.

These read ``/proc/self/...`` of the probe process itself and the CPU it runs on (not the host
tree): they prove from inside what CPU affinity, memory policy and allocator the workload really
ran with.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from typing import Any

from gpu_tune.host.parse import format_cpulist  # pure and light: no agent runtime is imported


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


def mems_allowed(status_text: str | None) -> str | None:
    for line in (status_text or "").splitlines():
        if line.startswith("Mems_allowed_list:"):
            return line.split(":", 1)[1].strip()
    return None


def mempolicy(numa_maps_text: str | None) -> str:
    """The first mapping's policy word (``default``, ``bind:0``, ``interleave:0-1``, ...)."""
    for line in (numa_maps_text or "").splitlines():
        fields = line.split()
        if len(fields) >= 2:
            return fields[1]
    return "unavailable"


def jemalloc_mapped(maps_text: str | None) -> bool:
    return any("libjemalloc" in line for line in (maps_text or "").splitlines())


def peak_rss_mib() -> float:
    # Linux reports ru_maxrss in KiB.
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)


def cpuinfo_field(key: str) -> str | None:
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        if line.startswith(key):
            return line.split(":", 1)[1].strip()
    return None


def cpu_has_bf16() -> bool:
    flags = set((cpuinfo_field("flags") or "").split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def cpu_name() -> str:
    return cpuinfo_field("model name") or "CPU"


def nvml_identity() -> tuple[str, str] | None:
    """(GPU model, driver version) of the GPU that ``CUDA_VISIBLE_DEVICES`` names first, through
    NVML, without TensorFlow; None where NVML or that GPU is not there."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        if visible.startswith(("GPU-", "MIG-")):
            h = pynvml.nvmlDeviceGetHandleByUUID(visible)
        else:
            h = pynvml.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else 0)
        name, driver = pynvml.nvmlDeviceGetName(h), pynvml.nvmlSystemGetDriverVersion()
        return tuple(v.decode() if isinstance(v, bytes) else str(v) for v in (name, driver))  # type: ignore[return-value]
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def process_facts() -> dict[str, Any]:
    return {
        "peak_rss_mib": peak_rss_mib(),
        "cpu_affinity": format_cpulist(os.sched_getaffinity(0)),
        "mems_allowed": mems_allowed(_read("/proc/self/status")),
        "mempolicy": mempolicy(_read("/proc/self/numa_maps")),
        "jemalloc_mapped": jemalloc_mapped(_read("/proc/self/maps")),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
    }


# The longest sample period of NVML's utilization ("between 1 second and 1/6 second depending on
# the product", nvmlDeviceGetUtilizationRates).
NVML_PERIOD_S = 1.0


class NvmlSampler:
    """Samples GPU utilization and memory every ``interval_s`` in a background thread.

    Absent NVML (no driver, CPU host) gives ``{"status": "unavailable", "reason": ...}``.
    """

    def __init__(self, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, float, float]] = []  # (t, util %, used MiB)
        self.status = "unavailable"
        self.reason = ""
        self.gpu: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = None
        self._handle = None

    def start(self) -> "NvmlSampler":
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
        except Exception as exc:  # no library, no driver: a fact, not an error
            self.reason = f"NVML not available: {exc}"
            return self
        self._nvml = pynvml
        try:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
            if visible.startswith(("GPU-", "MIG-")):
                self._handle = pynvml.nvmlDeviceGetHandleByUUID(visible)
            else:
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else 0)
            self.gpu = visible or "0"
        except Exception as exc:
            self.reason = f"NVML has no device for CUDA_VISIBLE_DEVICES={visible!r}: {exc}"
            self._shutdown()
            return self
        self.status = "ok"
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        nv, h = self._nvml, self._handle
        while not self._stop.is_set():
            try:
                util = nv.nvmlDeviceGetUtilizationRates(h).gpu
                mem = nv.nvmlDeviceGetMemoryInfo(h).used / 2**20
                self.samples.append((time.monotonic(), float(util), float(mem)))
            except Exception as exc:
                self.status = "error"
                self.reason = f"NVML sampling failed: {exc}"
                return
            self._stop.wait(self.interval_s)

    def _shutdown(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._shutdown()

    def driver_version(self) -> str | None:
        """The NVIDIA driver version (while sampling; None without NVML)."""
        if self._nvml is None:
            return None
        try:
            v = self._nvml.nvmlSystemGetDriverVersion()
        except Exception:
            return None
        return v.decode() if isinstance(v, bytes) else str(v)

    def window(self, window: tuple[float, float] | None) -> dict[str, Any]:
        """Utilization during one timed window, as 0..1.

        NVML's utilization is the share of time a kernel ran over its own past sample period,
        up to :data:`NVML_PERIOD_S` long: a sample taken early in a window also covers what came
        before it (the compilation, the GPU idle). ``gpu_busy_fraction`` is therefore the mean
        over the samples taken at least that period after the window began (where there are
        such samples), and ``gpu_busy_fraction_all`` the mean over every sample inside it. (An
        H100 read 72-80 % with every sample of its 2 s window counted: what a GPU busy through
        the whole window reads when a 1 s period lets the first second of samples average in the
        idle compilation before it; docs/probe.md.)"""
        out: dict[str, Any] = {"gpu_busy_fraction": None, "gpu_samples": 0}
        if self.status == "unavailable" or window is None:
            return out
        inside = [s for s in list(self.samples) if window[0] <= s[0] <= window[1]]
        settled = [s for s in inside if s[0] >= window[0] + NVML_PERIOD_S]
        counted = settled or inside
        out["gpu_samples"] = len(counted)
        if counted:
            utils = [s[1] for s in counted]
            out["gpu_busy_fraction"] = round(sum(utils) / len(utils) / 100.0, 3)
            out["gpu_busy_settled"] = bool(settled)
            out["gpu_busy_fraction_all"] = round(sum(s[1] for s in inside) / len(inside) / 100.0, 3)
            out["gpu_samples_all"] = len(inside)
            out["gpu_utilization_percent_max"] = max(s[1] for s in inside)
            out["gpu_memory_used_mib_max"] = round(max(s[2] for s in inside), 1)
        return out

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.status, "interval_ms": round(self.interval_s * 1000)}
        if self.reason:
            out["reason"] = self.reason
        if self.status == "unavailable":
            return out
        out["gpu"] = self.gpu
        samples = list(self.samples)
        out["count"] = len(samples)
        if samples:
            out["memory_used_mib_max"] = round(max(s[2] for s in samples), 1)
        return out
