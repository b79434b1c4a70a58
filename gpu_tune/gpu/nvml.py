"""The NVML GPU backend: the only module that imports ``pynvml`` (nvidia-ml-py).

Every NVML call that fails is mapped to a value: "not supported" leaves that field ``None``,
"GPU is lost" / "no permission" / other errors while reading a GPU set ``GpuInfo.error`` and
``error_kind`` ("lost", "no_permission", "error") for that GPU only; the other GPUs still answer.

XID errors: NVML reports them only as events. At start the backend registers every GPU for
``nvmlEventTypeXidCriticalError`` in one event set; each :meth:`gpus` call drains the pending
events without waiting (timeout 0) and keeps the last 32 XIDs per GPU seen by this process, in
``GpuInfo.xid_events``. XIDs raised before the agent started are not visible through NVML (the
kernel log has them). A driver that refuses event registration leaves the list empty.

Retired pages: ``retired_pages_pending`` is True when either the page-retirement list (pre-Ampere)
or the row-remapper (Ampere and later) has a pending action that needs a GPU reset.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from gpu_tune.gpu.base import GpuError, GpuInfo
from gpu_tune.gpu.nvml_health import read_health

log = logging.getLogger("gpu_tune")

XID_KEEP = 32

# NVML clock event (throttle) reason bits -> names (nvidia-smi's words, snake_case).
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x0000000000000001, "gpu_idle"),
    (0x0000000000000002, "applications_clocks_setting"),
    (0x0000000000000004, "sw_power_cap"),
    (0x0000000000000008, "hw_slowdown"),
    (0x0000000000000010, "sync_boost"),
    (0x0000000000000020, "sw_thermal_slowdown"),
    (0x0000000000000040, "hw_thermal_slowdown"),
    (0x0000000000000080, "hw_power_brake_slowdown"),
    (0x0000000000000100, "display_clock_setting"),
)


def throttle_names(mask: int) -> tuple[str, ...]:
    return tuple(name for bit, name in THROTTLE_REASONS if mask & bit)


def _text(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


class NvmlUnavailable(Exception):
    """nvmlInit failed (no driver, no library): the auto choice falls back to the null backend."""


class NvmlBackend:
    name = "nvml"

    def __init__(self) -> None:
        try:
            import pynvml  # noqa: PLC0415 - the only pynvml import in the project
        except ImportError as exc:
            raise NvmlUnavailable(f"nvidia-ml-py is not installed ({exc})") from None
        self.nv = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(f"nvmlInit failed: {exc}") from None
        except OSError as exc:  # some versions surface a failed dlopen directly
            raise NvmlUnavailable(f"libnvidia-ml.so.1 did not load: {exc}") from None
        self.reason = "libnvidia-ml.so.1 loaded and nvmlInit succeeded"
        self._xids: dict[int, list[int]] = {}
        self._event_set = None
        self._handle_index: dict[Any, int] = {}
        self._pass_handles: dict[int, Any] = {}
        self._register_xid_events()

    # -- error mapping --------------------------------------------------------------------------
    def _kind(self, exc: Exception) -> str:
        nv = self.nv
        mapping = (
            ("NVMLError_GPUIsLost", "lost"),
            ("NVMLError_NotSupported", "not_supported"),
            ("NVMLError_NoPermission", "no_permission"),
            ("NVMLError_NotFound", "not_found"),
            ("NVMLError_InvalidArgument", "not_found"),
            ("NVMLError_ResetRequired", "reset_required"),
            ("NVMLError_FunctionNotFound", "not_supported"),
        )
        for cls_name, kind in mapping:
            cls = getattr(nv, cls_name, None)
            if cls is not None and isinstance(exc, cls):
                return kind
        return "error"

    def _gpu_error(self, index: int, what: str, exc: Exception) -> GpuError:
        kind = self._kind(exc)
        return GpuError(f"GPU {index}: {what}: {exc}", kind)

    def _handle(self, index: int):
        try:
            return self.nv.nvmlDeviceGetHandleByIndex(index)
        except self.nv.NVMLError as exc:
            raise self._gpu_error(index, "no handle", exc) from None

    def _opt(self, fn: Callable[[], Any]) -> Any:
        """A field read: None when not supported; lost/permission/other errors propagate."""
        try:
            return fn()
        except self.nv.NVMLError as exc:
            if self._kind(exc) == "not_supported":
                return None
            raise

    # -- events ---------------------------------------------------------------------------------
    def _register_xid_events(self) -> None:
        nv = self.nv
        try:
            count = nv.nvmlDeviceGetCount()
            self._event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            log.debug("NVML event set unavailable: %s", exc)
            self._event_set = None
            return
        for i in range(count):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, self._event_set)
                self._handle_index[_key(h)] = i
            except nv.NVMLError as exc:
                log.debug("GPU %d: XID events not registered: %s", i, exc)

    def _drain_xids(self) -> None:
        if self._event_set is None:
            return
        nv = self.nv
        for _ in range(1024):  # bounded: never spin on a misbehaving driver
            try:
                data = nv.nvmlEventSetWait(self._event_set, 0)
            except nv.NVMLError:
                return  # NVML_ERROR_TIMEOUT: nothing pending (or the set is unusable)
            if data.eventType != nv.nvmlEventTypeXidCriticalError:
                continue
            idx = self._handle_index.get(_key(data.device))
            if idx is None:
                continue
            lst = self._xids.setdefault(idx, [])
            lst.append(int(data.eventData))
            del lst[:-XID_KEEP]

    # -- GpuBackend -----------------------------------------------------------------------------
    def driver_version(self) -> str | None:
        try:
            return _text(self.nv.nvmlSystemGetDriverVersion())
        except self.nv.NVMLError:
            return None

    def cuda_driver_version(self) -> str | None:
        try:
            v = int(self.nv.nvmlSystemGetCudaDriverVersion())
        except self.nv.NVMLError:
            return None
        return f"{v // 1000}.{(v % 1000) // 10}"

    def gpus(self) -> list[GpuInfo]:
        nv = self.nv
        try:
            count = nv.nvmlDeviceGetCount()
        except nv.NVMLError as exc:
            log.warning("nvmlDeviceGetCount failed: %s", exc)
            return []
        self._drain_xids()
        self._pass_handles = self._handles_by_index()  # the peers for NVLink P2P, once per call
        try:
            return [self._info(i) for i in range(count)]
        finally:
            self._pass_handles = {}

    def _info(self, index: int) -> GpuInfo:
        nv = self.nv
        try:
            h = nv.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nv.nvmlDeviceGetUUID(h))
            name = _text(nv.nvmlDeviceGetName(h))
            pci = nv.nvmlDeviceGetPciInfo(h)
            bus_id = _norm(_text(getattr(pci, "busId", None) or getattr(pci, "busIdLegacy", "")))
        except nv.NVMLError as exc:
            kind = self._kind(exc)
            return GpuInfo(index=index, uuid="", name="", pci_bus_id="",
                           error=f"GPU {index}: {exc}", error_kind=kind)
        try:
            return self._fill(index, h, uuid, name, bus_id)
        except nv.NVMLError as exc:
            kind = self._kind(exc)
            return GpuInfo(index=index, uuid=uuid, name=name, pci_bus_id=bus_id,
                           error=f"GPU {index}: {exc}", error_kind=kind,
                           reset_required=True if kind == "reset_required" else None,
                           xid_events=tuple(self._xids.get(index, ())))

    def _fill(self, index: int, h: Any, uuid: str, name: str, bus_id: str) -> GpuInfo:
        nv = self.nv
        opt = self._opt
        mem = opt(lambda: nv.nvmlDeviceGetMemoryInfo(h))
        cc = opt(lambda: nv.nvmlDeviceGetCudaComputeCapability(h))
        pm = opt(lambda: nv.nvmlDeviceGetPersistenceMode(h))
        mig = self._mig_mode(h)
        ecc = opt(lambda: nv.nvmlDeviceGetEccMode(h))
        ecc_on = None if ecc is None else bool(ecc[0] == nv.NVML_FEATURE_ENABLED)
        ecc_unc = None
        if ecc_on:
            ecc_unc = opt(lambda: int(nv.nvmlDeviceGetTotalEccErrors(
                h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)))
        pending = None
        retired = opt(lambda: nv.nvmlDeviceGetRetiredPagesPendingStatus(h))
        if retired is not None:
            pending = bool(retired == nv.NVML_FEATURE_ENABLED)
        remap = opt(lambda: nv.nvmlDeviceGetRemappedRows(h))
        if remap is not None:
            pending = bool(pending) or bool(remap[2])
        temp = opt(lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        power = opt(lambda: nv.nvmlDeviceGetPowerUsage(h))
        util = opt(lambda: nv.nvmlDeviceGetUtilizationRates(h))
        reasons = opt(lambda: self._throttle_mask(h))
        return GpuInfo(
            index=index, uuid=uuid, name=name, pci_bus_id=bus_id,
            memory_total_mib=None if mem is None else int(mem.total) // (1024 * 1024),
            compute_capability=None if cc is None else f"{cc[0]}.{cc[1]}",
            persistence_mode=None if pm is None else bool(pm == nv.NVML_FEATURE_ENABLED),
            mig_mode=None if mig is None else mig[0], mig_mode_pending=None if mig is None else mig[1],
            pcie_link_gen_current=opt(lambda: int(nv.nvmlDeviceGetCurrPcieLinkGeneration(h))),
            pcie_link_gen_max=opt(lambda: int(nv.nvmlDeviceGetMaxPcieLinkGeneration(h))),
            pcie_link_width_current=opt(lambda: int(nv.nvmlDeviceGetCurrPcieLinkWidth(h))),
            pcie_link_width_max=opt(lambda: int(nv.nvmlDeviceGetMaxPcieLinkWidth(h))),
            ecc_mode=ecc_on, ecc_uncorrected_volatile=ecc_unc, retired_pages_pending=pending,
            temperature_c=None if temp is None else float(temp),
            power_w=None if power is None else round(power / 1000.0, 3),
            utilization_percent=None if util is None else float(util.gpu),
            memory_used_mib=None if mem is None else int(mem.used) // (1024 * 1024),
            clock_throttle_reasons=() if reasons is None else throttle_names(int(reasons)),
            xid_events=tuple(self._xids.get(index, ())),
            **read_health(nv, h, index, self._pass_handles, opt),
        )

    def _handles_by_index(self) -> dict[int, Any]:
        nv = self.nv
        out = {}
        try:
            count = nv.nvmlDeviceGetCount()
        except nv.NVMLError:
            return out
        for i in range(count):
            try:
                out[i] = nv.nvmlDeviceGetHandleByIndex(i)
            except nv.NVMLError:
                continue
        return out

    def _mig_mode(self, h: Any) -> tuple[bool, bool] | None:
        """(current, pending) MIG mode; None where the GPU has no MIG ("not supported") or the
        bindings predate nvmlDeviceGetMigMode."""
        nv = self.nv
        fn = getattr(nv, "nvmlDeviceGetMigMode", None)
        if fn is None:
            return None
        enabled = getattr(nv, "NVML_DEVICE_MIG_ENABLE", 1)
        try:
            current, pending = fn(h)
        except nv.NVMLError as exc:
            if self._kind(exc) == "not_supported" or isinstance(exc, getattr(nv, "NVMLError_FunctionNotFound", ())):
                return None
            raise
        # older bindings returned the ctypes values themselves
        current, pending = getattr(current, "value", current), getattr(pending, "value", pending)
        return bool(current == enabled), bool(pending == enabled)

    def _throttle_mask(self, h: Any) -> int:
        nv = self.nv
        fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if fn is not None:
            try:
                return int(fn(h))
            except nv.NVMLError as exc:
                if self._kind(exc) != "not_supported" and not isinstance(exc, getattr(nv, "NVMLError_FunctionNotFound", ())):
                    raise
        return int(nv.nvmlDeviceGetCurrentClocksThrottleReasons(h))

    def set_persistence_mode(self, index: int, enabled: bool) -> None:
        nv = self.nv
        h = self._handle(index)
        mode = nv.NVML_FEATURE_ENABLED if enabled else nv.NVML_FEATURE_DISABLED
        try:
            nv.nvmlDeviceSetPersistenceMode(h, mode)
        except nv.NVMLError as exc:
            hint = " (needs root)" if self._kind(exc) == "no_permission" else ""
            raise self._gpu_error(index, f"set persistence mode {'on' if enabled else 'off'}{hint}", exc) from None

    def processes(self, index: int) -> list[int]:
        nv = self.nv
        h = self._handle(index)
        try:
            procs = nv.nvmlDeviceGetComputeRunningProcesses(h)
        except nv.NVMLError as exc:
            if self._kind(exc) == "not_supported":
                return []
            raise self._gpu_error(index, "compute processes", exc) from None
        return sorted({int(p.pid) for p in procs})

    def cpu_affinity(self, index: int) -> frozenset[int] | None:
        nv = self.nv
        try:
            h = nv.nvmlDeviceGetHandleByIndex(index)
            words = (max(os.cpu_count() or 1, 1024) + 63) // 64
            arr = nv.nvmlDeviceGetCpuAffinity(h, words)
        except nv.NVMLError:
            return None
        cpus = set()
        for w, value in enumerate(arr):
            value = int(value)
            bit = 0
            while value:
                if value & 1:
                    cpus.add(w * 64 + bit)
                value >>= 1
                bit += 1
        return frozenset(cpus) or None

    def close(self) -> None:
        nv = self.nv
        if self._event_set is not None:
            try:
                nv.nvmlEventSetFree(self._event_set)
            except nv.NVMLError:
                pass
            self._event_set = None
        try:
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass


def _key(handle: Any) -> Any:
    """A hashable key for an NVML device handle (a ctypes pointer compares by address)."""
    try:
        import ctypes

        return ctypes.cast(handle, ctypes.c_void_p).value
    except Exception:
        return handle


def _norm(bus_id: str) -> str:
    from gpu_tune.host.parse import normalize_bus_id

    return normalize_bus_id(bus_id)
