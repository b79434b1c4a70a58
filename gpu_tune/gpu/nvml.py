"""The NVML GPU backend: the only module that imports ``pynvml`` (nvidia-ml-py).

Every NVML call that fails is mapped to a value, for one GPU and one reading
(:mod:`gpu_tune.gpu.nvml_read`): "not supported" leaves that field ``None``; any other error of one
reading ("no permission", "unknown", ...), and a value NVML cannot hold (a link state of 7, a
temperature of 2^32-1 C), leaves it ``None`` and is kept in ``GpuInfo.unread`` (a warning, never a
failure of the GPU); only the GPU's own "GPU is lost" / "reset required" answers, or a GPU that
cannot say who it is (an error, or bytes that are not UTF-8, to its UUID, name or bus id), set
``GpuInfo.error`` and ``error_kind`` ("lost", "reset_required", "no_permission", "identity",
"error") for that GPU only; the other GPUs still answer, and a pair reading (P2P) that fails
because the peer is lost is the peer's. Pairs are bounded: :data:`MAX_P2P_PEERS` a GPU per pass
(:func:`p2p_peers`), the rest said.

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
import re
from typing import Any

from gpu_tune.gpu.base import GpuError, GpuInfo
from gpu_tune.gpu.nvml_health import read_health
from gpu_tune.gpu.nvml_read import GpuGone, Readings, error_kind, error_text
from gpu_tune.host.numbers import shown

log = logging.getLogger("gpu_tune")

XID_KEEP = 32
# Pairs read per GPU per pass (nvmlDeviceGetP2PStatus): every pair up to 33 GPUs (an HGX board has
# 8, the largest NVLink node 16); past that, 32 peers a GPU: a node NVML says has 1,024 GPUs reads
# 32,768 pairs, not 1,047,552 (and says so: gpu.readings).
MAX_P2P_PEERS = 32
MAX_TEMPERATURE_C = 200  # above any GPU's shutdown temperature, below solder's melting point
MAX_PCIE_GEN = 8
MAX_PCIE_WIDTH = 32
IDENTITY_WORDS = {"uuid": "UUID", "name": "name", "bus": "PCI bus id"}
BUS_ID_RE = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")

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
        self._xid_unread: dict[int, str] = {}  # GPU -> why its XID events are not registered
        self._handles: dict[int, Any] = {}  # GPU -> its handle, from the latest reading
        self._register_xid_events()

    # -- error mapping --------------------------------------------------------------------------
    def _kind(self, exc: Exception) -> str:
        return error_kind(exc)

    def _gpu_error(self, index: int, what: str, exc: Exception) -> GpuError:
        kind = self._kind(exc)
        return GpuError(f"GPU {index}: {what}: {error_text(exc)}", kind)

    def _handle(self, index: int):
        """The GPU's handle: the one this pass's reading took (a handle stays valid until
        ``nvmlShutdown``), else asked now."""
        h = self._handles.get(index)
        if h is not None:
            return h
        try:
            return self.nv.nvmlDeviceGetHandleByIndex(index)
        except self.nv.NVMLError as exc:
            raise self._gpu_error(index, "no handle", exc) from None

    # -- events ---------------------------------------------------------------------------------
    def _register_xid_events(self) -> None:
        nv = self.nv
        try:
            count = nv.nvmlDeviceGetCount()
        except nv.NVMLError as exc:
            log.debug("nvmlDeviceGetCount failed: %s", error_text(exc))
            return
        try:
            self._event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            log.debug("NVML event set unavailable: %s", error_text(exc))
            self._event_set = None
            if self._kind(exc) != "not_supported":
                self._xid_unread = {i: f"NVML events: {error_text(exc)}" for i in range(count)}
            return
        for i in range(count):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, self._event_set)
                self._handle_index[_key(h)] = i
            except nv.NVMLError as exc:
                # NOT_SUPPORTED: this platform has no XID events (the kernel log still has them)
                log.debug("GPU %d: XID events not registered: %s", i, error_text(exc))
                if self._kind(exc) not in ("not_supported", "lost", "reset_required"):
                    self._xid_unread[i] = f"NVML events: {error_text(exc)}"

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
        """Every GPU: first who each is (handle, UUID, name, bus id), then each one's readings. A
        GPU that cannot say who it is, is lost or needs a reset is recorded alone; the others, and
        every pair reading (P2P) with a peer that answered, are read as usual."""
        nv = self.nv
        try:
            count = nv.nvmlDeviceGetCount()
        except nv.NVMLError as exc:
            log.warning("nvmlDeviceGetCount failed: %s", error_text(exc))
            return []
        self._drain_xids()
        ids: dict[int, tuple[Any, str, str, str] | GpuInfo] = {i: self._identity(i) for i in range(count)}
        self._handles = {i: v[0] for i, v in ids.items() if isinstance(v, tuple)}
        known = [(i, (v[0], v[3])) for i, v in ids.items() if isinstance(v, tuple)]
        place = {i: n for n, (i, _) in enumerate(known)}
        out = []
        for i, v in ids.items():
            if isinstance(v, GpuInfo):
                out.append(v)
                continue
            peers = p2p_peers(known, place[i])
            out.append(self._info(i, *v, peers, len(known) - 1 - len(peers)))
        return out

    def _identity(self, index: int) -> tuple[Any, str, str, str] | GpuInfo:
        """(handle, UUID, name, bus id), or the GPU's record when it cannot say who it is. Each
        of UUID, name and bus id is asked even after another failed: a lost GPU may still name
        its bus id, which is what an operator needs to find it."""
        nv = self.nv
        try:
            h = nv.nvmlDeviceGetHandleByIndex(index)
        except nv.NVMLError as exc:
            return self._unidentified(index, exc, "", "", "")
        got: dict[str, str] = {}
        first: Exception | str | None = None
        for key, call in (("uuid", nv.nvmlDeviceGetUUID), ("name", nv.nvmlDeviceGetName),
                          ("bus", nv.nvmlDeviceGetPciInfo)):
            try:
                v = call(h)
                got[key] = (_norm(_text(getattr(v, "busId", None) or getattr(v, "busIdLegacy", "")))
                            if key == "bus" else _text(v))
            except nv.NVMLError as exc:
                first = first or exc
            except UnicodeDecodeError as exc:  # the binding decodes the C library's bytes strictly
                first = first or f"its {IDENTITY_WORDS[key]} is not UTF-8: {shown(_escaped(exc.object))}"
        if "bus" in got and not BUS_ID_RE.fullmatch(got["bus"]):
            first = first or f"its PCI bus id {shown(got['bus'])} is not a PCI address"
            got["bus"] = ""
        if first is not None:
            return self._unidentified(index, first, got.get("uuid", ""), got.get("name", ""), got.get("bus", ""))
        return h, got["uuid"], got["name"], got["bus"]

    def _unidentified(self, index: int, why: Exception | str, uuid: str, name: str, bus: str) -> GpuInfo:
        """A GPU that cannot say who it is: NVML's error, or what it said that is no name, UUID or
        bus id (``error_kind`` "identity"); what it did say is kept, escaped."""
        kind = self._kind(why) if isinstance(why, Exception) else "identity"
        text = error_text(why) if isinstance(why, Exception) else why
        return GpuInfo(index=index, uuid=_printable(uuid), name=_printable(name), pci_bus_id=bus, error=text,
                       error_kind=kind, reset_required=True if kind == "reset_required" else None,
                       xid_events=tuple(self._xids.get(index, ())))

    def _info(self, index: int, h: Any, uuid: str, name: str, bus_id: str,
              peers: dict[int, tuple[Any, str]], peers_left: int) -> GpuInfo:
        r = Readings(self.nv)
        try:
            return self._fill(r, index, h, uuid, name, bus_id, peers, peers_left)
        except GpuGone as gone:
            return GpuInfo(index=index, uuid=uuid, name=name, pci_bus_id=bus_id,
                           error=f"{gone.text}, reading {gone.reading}", error_kind=gone.kind,
                           reset_required=True if gone.kind == "reset_required" else None,
                           xid_events=tuple(self._xids.get(index, ())))

    def _fill(self, r: Readings, index: int, h: Any, uuid: str, name: str, bus_id: str,
              peers: dict[int, tuple[Any, str]], peers_left: int) -> GpuInfo:
        nv = self.nv
        mem = r.call("memory", "nvmlDeviceGetMemoryInfo", h)
        cc = r.call("compute_capability", "nvmlDeviceGetCudaComputeCapability", h)
        pm = r.call("persistence_mode", "nvmlDeviceGetPersistenceMode", h)
        mig = self._mig_mode(r, h)
        ecc = r.call("ecc_mode", "nvmlDeviceGetEccMode", h)
        ecc_on = None if ecc is None else bool(ecc[0] == nv.NVML_FEATURE_ENABLED)
        ecc_unc = None
        if ecc_on:
            ecc_unc = r.call("ecc_uncorrected_volatile", "nvmlDeviceGetTotalEccErrors", h,
                             nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
        pending = None
        retired = r.call("retired_pages_pending", "nvmlDeviceGetRetiredPagesPendingStatus", h)
        if retired is not None:
            pending = bool(retired == nv.NVML_FEATURE_ENABLED)
        temp = r.within("temperature", r.call("temperature", "nvmlDeviceGetTemperature", h, nv.NVML_TEMPERATURE_GPU),
                        0, MAX_TEMPERATURE_C, "a GPU temperature in C")
        power = r.call("power", "nvmlDeviceGetPowerUsage", h)
        util = r.call("utilization", "nvmlDeviceGetUtilizationRates", h)
        busy = None if util is None else r.within("utilization", int(util.gpu), 0, 100, "a utilization in percent")
        reasons = self._throttle_mask(r, h)
        if index in self._xid_unread:
            r.note("xid_events", self._xid_unread[index])
        health = read_health(nv, r, h, index, peers, mig_enabled=bool(mig and mig[0]), peers_left=peers_left)
        if health["remapped_rows"] is not None:
            pending = bool(pending) or bool(health["remapped_rows"].pending)
        return GpuInfo(
            index=index, uuid=uuid, name=name, pci_bus_id=bus_id,
            memory_total_mib=None if mem is None else int(mem.total) // (1024 * 1024),
            compute_capability=None if cc is None else f"{cc[0]}.{cc[1]}",
            persistence_mode=None if pm is None else bool(pm == nv.NVML_FEATURE_ENABLED),
            mig_mode=None if mig is None else mig[0], mig_mode_pending=None if mig is None else mig[1],
            pcie_link_gen_current=self._pcie(r, "nvmlDeviceGetCurrPcieLinkGeneration", h),
            pcie_link_gen_max=self._pcie(r, "nvmlDeviceGetMaxPcieLinkGeneration", h),
            pcie_link_gen_gpu_max=self._pcie(r, "nvmlDeviceGetGpuMaxPcieLinkGeneration", h),
            pcie_link_width_current=self._pcie(r, "nvmlDeviceGetCurrPcieLinkWidth", h),
            pcie_link_width_max=self._pcie(r, "nvmlDeviceGetMaxPcieLinkWidth", h),
            ecc_mode=ecc_on, ecc_uncorrected_volatile=_int(ecc_unc), retired_pages_pending=pending,
            temperature_c=None if temp is None else float(temp),
            power_w=None if power is None else round(power / 1000.0, 3),
            utilization_percent=None if busy is None else float(busy),
            memory_used_mib=None if mem is None else int(mem.used) // (1024 * 1024),
            clock_throttle_reasons=() if reasons is None else throttle_names(int(reasons)),
            xid_events=tuple(self._xids.get(index, ())),
            unread=tuple(sorted(r.unread.items())),
            **health,
        )

    @staticmethod
    def _pcie(r: Readings, call: str, h: Any) -> int | None:
        """A PCIe link generation (1 to 8) or width (1 to 32 lanes), else not read."""
        v = _int(r.call("pcie_link", call, h))
        if "Generation" in call:
            return r.within("pcie_link", v, 1, MAX_PCIE_GEN, "a PCIe generation")
        return r.within("pcie_link", v, 1, MAX_PCIE_WIDTH, "a PCIe link width")

    def _mig_mode(self, r: Readings, h: Any) -> tuple[bool, bool] | None:
        """(current, pending) MIG mode; None where the GPU has no MIG ("not supported") or the
        binding predates nvmlDeviceGetMigMode."""
        got = r.call("mig_mode", "nvmlDeviceGetMigMode", h)
        if got is None:
            return None
        enabled = getattr(self.nv, "NVML_DEVICE_MIG_ENABLE", 1)
        current, pending = got
        # older bindings returned the ctypes values themselves
        current, pending = getattr(current, "value", current), getattr(pending, "value", pending)
        return bool(current == enabled), bool(pending == enabled)

    def _throttle_mask(self, r: Readings, h: Any) -> int | None:
        """nvmlDeviceGetCurrentClocksEventReasons, or its older name where the driver lacks it."""
        nv = self.nv
        fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if fn is not None:
            try:
                return int(fn(h))
            except nv.NVMLError as exc:
                if self._kind(exc) != "not_supported":
                    return r.failed("clock_event_reasons", exc)
        return _int(r.call("clock_event_reasons", "nvmlDeviceGetCurrentClocksThrottleReasons", h))

    def set_persistence_mode(self, index: int, enabled: bool) -> None:
        nv = self.nv
        h = self._handle(index)
        mode = nv.NVML_FEATURE_ENABLED if enabled else nv.NVML_FEATURE_DISABLED
        try:
            nv.nvmlDeviceSetPersistenceMode(h, mode)
        except nv.NVMLError as exc:
            hint = " (needs root: nvml.h)" if self._kind(exc) == "no_permission" else ""
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
            h = self._handles.get(index) or nv.nvmlDeviceGetHandleByIndex(index)
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


def _int(v: Any) -> int | None:
    return None if v is None else int(v)


def p2p_peers(known: list[tuple[int, Any]], place: int) -> dict[int, Any]:
    """The GPUs whose P2P status with the GPU at ``known[place]`` is read this pass: every other
    GPU that said who it is, up to :data:`MAX_P2P_PEERS`; past that, the next ones in index order,
    wrapping round (each GPU then reads as many pairs as it is read in: every GPU judged, the
    pairs bounded). ``known``: (index, (handle, bus id)) in index order."""
    n = len(known)
    return dict(known[(place + j) % n] for j in range(1, min(n, MAX_P2P_PEERS + 1)))


def _escaped(raw: bytes) -> str:
    return raw.decode("utf-8", "backslashreplace")


def _printable(text: str) -> str:
    """An identity string as kept for a GPU that cannot say who it is: ASCII, escaped."""
    return text if text.isascii() and text.isprintable() else ascii(text)[1:-1]


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
