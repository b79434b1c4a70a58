"""A fake ``libnvidia-ml.so.1`` for the REAL ``nvidia-ml-py`` module (``pynvml``).

Only the C library is replaced: ``pynvml.nvmlLib`` is set to a :class:`FakeNvmlLib` and the
binding's function-pointer cache is emptied, so every call goes through the binding's own
wrappers, ctypes structs, versioned C names (``nvmlDeviceGetHandleByIndex_v2``,
``nvmlDeviceGetPciInfo_v3``, ...), return-code checks and exception classes. A C function this
fake does not define is missing from the "library": the binding raises its own
``NVMLError_FunctionNotFound``, as with a driver that predates the call. Every name defined here is
checked against the binding (``tests/test_nvml_binding.py``): no C function the binding would never
look up, so the fake cannot drift from what a real driver offers.

Scenarios are :class:`FakeGpu` lists (:func:`hgx_h100` builds a healthy 8-GPU HGX H100 board,
:func:`many` a board of any size); faults are set per GPU: ``lost`` / ``reset_required`` (every
call on that GPU answers so, pair calls too), ``errors`` (C function name -> return code, for one
call), and the readings' values, hostile ones included: bytes that are not UTF-8 for the name, UUID
or bus id (what the C library writes into the binding's char buffers), field 230 as any
``nvmlValueType_t`` (``recovery_type``), a link state or a temperature outside what NVML defines.

Each C call is recorded in :attr:`FakeNvmlLib.calls` and, with its arguments (the GPU a handle
stands for, the numbers passed in), in :attr:`FakeNvmlLib.call_keys`.

``tests/nvmlcommand.py`` runs the real ``gpu-tune`` command line as a process of its own over
this fake library.
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import pynvml

SUCCESS = 0
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
NO_PERMISSION = 4
INSUFFICIENT_SIZE = 7
TIMEOUT = 10
CORRUPTED_INFOROM = 14
GPU_IS_LOST = 15
RESET_REQUIRED = 16
ARGUMENT_VERSION_MISMATCH = 25
UNKNOWN = 999

H100 = "NVIDIA H100 80GB HBM3"
HGX_BUSES = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")  # an HGX H100 board's GPUs


@dataclass
class FakeGpu:
    uuid: str | bytes  # bytes: written into the binding's buffer as they are (not UTF-8, say)
    bus_id: str | bytes  # NVML's form: "00000000:18:00.0"
    name: str | bytes = H100
    memory_mib: tuple[int, int] = (81559, 1024)  # total, used
    cc: tuple[int, int] = (9, 0)
    persistence: int = 1
    mig: tuple[int, int] | None = (0, 0)  # current, pending; None: no MIG (NOT_SUPPORTED)
    ecc: tuple[int, int] = (1, 1)
    ecc_uncorrected: int = 0
    retired_pending: int | None = None  # pre-Ampere page retirement; None: NOT_SUPPORTED (Ampere+)
    remap: tuple[int, int, int, int] = (0, 0, 0, 0)  # correctable, uncorrectable, pending, failure
    temperature: int = 34
    power_mw: int = 71_500
    utilization: int = 0
    clock_reasons: int = 0x1  # gpu_idle
    pcie: tuple[int, int, int, int, int] = (5, 5, 5, 16, 16)  # gen cur, gen max (system), GPU's own max, width cur, max
    replays: int = 0
    sm_clock: tuple[int, int] = (1980, 1980)
    recovery: int | float | None = 0  # field 230; None: the field answers NOT_SUPPORTED (older drivers)
    recovery_type: int = 1  # its nvmlValueType_t (NVML_VALUE_TYPE_UNSIGNED_INT; 0 double, 5 signed int, ...)
    inforom_ok: bool = True
    sram: tuple[int, int, int] = (0, 0, 0)  # volatile parity, volatile SEC-DED, threshold exceeded
    links: list[bool | int] | None = field(default_factory=lambda: [True] * 18)  # an int: that state
    link_errors: tuple[int, int, int] = (0, 0, 0)  # replay, recovery, CRC flit
    p2p: dict[int, int] = field(default_factory=dict)  # peer index -> P2P status (default OK)
    # (state, status, healthMask, healthSummary); None: not in a fabric (NOT_SUPPORTED)
    fabric: tuple[int, int, int, int] | None = (3, 0, 0, 1)
    fabric_versions: tuple[int, ...] = (1, 2, 3)  # the nvmlGpuFabricInfo struct versions the driver takes
    cpus: tuple[int, ...] = tuple(range(0, 56))
    procs: tuple[int, ...] = ()
    lost: bool = False
    reset_required: bool = False
    errors: dict[str, int] = field(default_factory=dict)  # C function -> return code


def healthy_mask() -> int:
    """A healthMask where every field says "fine" (value FALSE / NONE), as a healthy H100 reports."""
    return (2 << 0) | (2 << 2) | (2 << 4) | (2 << 6) | (1 << 8)


def hgx_h100(n: int = 8, **per_gpu: Any) -> list[FakeGpu]:
    """A healthy HGX H100 board: 8 SXM GPUs, 18 NVLinks each, NVSwitch fabric registered."""
    gpus = []
    for i in range(n):
        bus = HGX_BUSES[i] if i < len(HGX_BUSES) else f"{0xe0 + i:02x}"
        gpus.append(FakeGpu(uuid=f"GPU-{i:08x}-h100", bus_id=f"00000000:{bus.upper()}:00.0",
                            fabric=(3, 0, healthy_mask(), 1),
                            cpus=tuple(range(0, 56)) if i < 4 else tuple(range(56, 112))))
    for i, kw in per_gpu.items():
        gpus[int(i.lstrip("g"))] = dataclasses.replace(gpus[int(i.lstrip("g"))], **kw)
    return gpus


def many(n: int) -> list[FakeGpu]:
    """``n`` healthy H100s: the HGX board's eight at their bus ids, then the others on buses of
    PCI domains 1, 2, ... (256 a domain), each with 18 NVLinks up and the fabric registered."""
    gpus = hgx_h100(min(n, 8))
    for i in range(8, n):
        gpus.append(dataclasses.replace(gpus[i % 8], uuid=f"GPU-{i:08x}-h100",
                                        bus_id=f"0000{i // 256 + 1:04X}:{i % 256:02X}:00.0"))
    return gpus


# nvmlValueType_t -> the c_nvmlValue_t member that holds it
VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def _raw(v: str | bytes) -> bytes:
    return v if isinstance(v, bytes) else v.encode()


class _Ret(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def _out(arg: Any) -> Any:
    """The ctypes object behind ``byref(x)`` (what the C function writes through)."""
    return getattr(arg, "_obj", arg)


def _c(fn: Callable[..., Any]) -> Callable[..., int]:
    """A C entry point: returns the nvmlReturn_t; _Ret carries an error code out."""
    def entry(self: "FakeNvmlLib", *args: Any) -> int:
        if self.record:
            self.calls.append(fn.__name__[3:])
            self.call_keys.append((fn.__name__[3:], *(self._arg_key(a) for a in args)))
        try:
            fn(self, *args)
        except _Ret as r:
            return r.code
        return SUCCESS
    entry.__name__ = fn.__name__
    entry._c_entry = True  # type: ignore[attr-defined]
    return entry


class FakeNvmlLib:
    """The C library as the binding sees it: attributes named like the C functions."""

    def __init__(self, gpus: list[FakeGpu], driver: str = "570.124.06", cuda: int = 12080,
                 missing: frozenset[str] = frozenset(), init_error: int | None = None, record: bool = True) -> None:
        self.gpus = gpus
        self.record = record  # keep every call (off: a benchmark's thousands of GPUs cost no memory here)
        self.driver = driver
        self.cuda = cuda
        self.missing = set(missing)  # C functions this "driver" lacks
        self.init_error = init_error
        self.calls: list[str] = []
        self.call_keys: list[tuple[Any, ...]] = []  # (C function, its arguments: "gpuN" for a handle)
        self.events: list[tuple[int, int]] = []  # (GPU index, XID) waiting in the event set
        self.registered: list[int] = []
        self._cells = [ctypes.create_string_buffer(8) for _ in gpus]  # real memory for the handles
        self._addr = {ctypes.addressof(c): i for i, c in enumerate(self._cells)}
        self._event_cell = ctypes.create_string_buffer(8)

    def __getattr__(self, name: str) -> Any:
        # the binding does getattr(nvmlLib, "nvmlX"); AttributeError -> NVMLError_FunctionNotFound
        if name.startswith("nvml") and name not in self.missing:
            entry = type(self).__dict__.get("_c_" + name)
            if entry is not None:
                return entry.__get__(self)
        raise AttributeError(name)

    # -- helpers ----------------------------------------------------------------------------------
    def _arg_key(self, arg: Any) -> Any:
        """What one argument says: the GPU a handle stands for, a number passed in; None for what
        the function writes to (an out pointer, a buffer)."""
        if isinstance(arg, (int, str)):
            return arg
        if isinstance(arg, pynvml.c_nvmlDevice_t):
            addr = ctypes.cast(arg, ctypes.c_void_p).value
            return f"gpu{self._addr[addr]}" if addr in self._addr else "handle?"
        if isinstance(arg, ctypes._SimpleCData) and not isinstance(arg, (ctypes.c_char_p, ctypes.c_void_p)):
            return arg.value
        return None

    def _index(self, handle: Any) -> int:
        addr = ctypes.cast(handle, ctypes.c_void_p).value
        if addr not in self._addr:
            raise _Ret(INVALID_ARGUMENT)
        return self._addr[addr]

    def _dev(self, handle: Any, fn: str) -> FakeGpu:
        g = self.gpus[self._index(handle)]
        if g.lost:
            raise _Ret(GPU_IS_LOST)
        if g.reset_required:
            raise _Ret(RESET_REQUIRED)
        if fn in g.errors:
            raise _Ret(g.errors[fn])
        return g

    @staticmethod
    def _set_pointer(out: Any, addr: int) -> None:
        ctypes.memmove(ctypes.addressof(out), ctypes.byref(ctypes.c_void_p(addr)), ctypes.sizeof(ctypes.c_void_p))

    # -- library ---------------------------------------------------------------------------------
    @_c
    def _c_nvmlInitWithFlags(self, flags):
        if self.init_error:
            raise _Ret(self.init_error)

    @_c
    def _c_nvmlShutdown(self):
        pass

    def _c_nvmlErrorString(self, code):  # restype c_char_p: returns the text itself
        return f"NVML error {int(getattr(code, 'value', code))}".encode()

    @_c
    def _c_nvmlSystemGetDriverVersion(self, buf, size):
        buf.value = self.driver.encode()

    @_c
    def _c_nvmlSystemGetCudaDriverVersion(self, out):
        _out(out).value = self.cuda

    @_c
    def _c_nvmlDeviceGetCount_v2(self, out):
        _out(out).value = len(self.gpus)

    @_c
    def _c_nvmlDeviceGetHandleByIndex_v2(self, index, out):
        i = int(index.value)
        if i >= len(self.gpus):
            raise _Ret(INVALID_ARGUMENT)
        g = self.gpus[i]
        if "nvmlDeviceGetHandleByIndex_v2" in g.errors:
            raise _Ret(g.errors["nvmlDeviceGetHandleByIndex_v2"])
        self._set_pointer(_out(out), ctypes.addressof(self._cells[i]))

    # -- who the GPU is ---------------------------------------------------------------------------
    @_c
    def _c_nvmlDeviceGetUUID(self, h, buf, size):
        buf.value = _raw(self._dev(h, "nvmlDeviceGetUUID").uuid)

    @_c
    def _c_nvmlDeviceGetName(self, h, buf, size):
        buf.value = _raw(self._dev(h, "nvmlDeviceGetName").name)

    @_c
    def _c_nvmlDeviceGetPciInfo_v3(self, h, out):
        g = self._dev(h, "nvmlDeviceGetPciInfo_v3")
        info = _out(out)
        raw = _raw(g.bus_id)
        info.busId = raw[:31]  # bytes go into the binding's buffers as they are (a str it would encode)
        info.busIdLegacy = raw[-12:]  # the 4-digit domain form: "0000:18:00.0"
        try:
            dom, bus, rest = raw.decode("ascii").split(":")
            info.domain, info.bus, info.device = int(dom, 16), int(bus, 16), int(rest.split(".")[0], 16)
        except (UnicodeDecodeError, ValueError):
            pass  # a bus id that is no PCI address: the numbers stay 0
        info.pciDeviceId = 0x233010DE

    # -- state ------------------------------------------------------------------------------------
    @_c
    def _c_nvmlDeviceGetMemoryInfo(self, h, out):
        g = self._dev(h, "nvmlDeviceGetMemoryInfo")
        m = _out(out)
        m.total, m.used = g.memory_mib[0] << 20, g.memory_mib[1] << 20
        m.free = m.total - m.used

    @_c
    def _c_nvmlDeviceGetCudaComputeCapability(self, h, major, minor):
        g = self._dev(h, "nvmlDeviceGetCudaComputeCapability")
        _out(major).value, _out(minor).value = g.cc

    @_c
    def _c_nvmlDeviceGetPersistenceMode(self, h, out):
        _out(out).value = self._dev(h, "nvmlDeviceGetPersistenceMode").persistence

    @_c
    def _c_nvmlDeviceSetPersistenceMode(self, h, mode):
        self._dev(h, "nvmlDeviceSetPersistenceMode").persistence = int(mode.value)

    @_c
    def _c_nvmlDeviceGetMigMode(self, h, cur, pend):
        g = self._dev(h, "nvmlDeviceGetMigMode")
        if g.mig is None:
            raise _Ret(NOT_SUPPORTED)
        _out(cur).value, _out(pend).value = g.mig

    @_c
    def _c_nvmlDeviceGetEccMode(self, h, cur, pend):
        g = self._dev(h, "nvmlDeviceGetEccMode")
        _out(cur).value, _out(pend).value = g.ecc

    @_c
    def _c_nvmlDeviceGetTotalEccErrors(self, h, err_type, counter_type, out):
        _out(out).value = self._dev(h, "nvmlDeviceGetTotalEccErrors").ecc_uncorrected

    @_c
    def _c_nvmlDeviceGetRetiredPagesPendingStatus(self, h, out):
        g = self._dev(h, "nvmlDeviceGetRetiredPagesPendingStatus")
        if g.retired_pending is None:
            raise _Ret(NOT_SUPPORTED)
        _out(out).value = g.retired_pending

    @_c
    def _c_nvmlDeviceGetRemappedRows(self, h, corr, unc, pending, failure):
        g = self._dev(h, "nvmlDeviceGetRemappedRows")
        if g.mig and g.mig[0]:
            raise _Ret(NOT_SUPPORTED)  # nvml.h: NOT_SUPPORTED "If MIG is enabled"
        for o, v in zip((corr, unc, pending, failure), g.remap):
            _out(o).value = v

    @_c
    def _c_nvmlDeviceGetTemperature(self, h, sensor, out):
        _out(out).value = self._dev(h, "nvmlDeviceGetTemperature").temperature

    @_c
    def _c_nvmlDeviceGetPowerUsage(self, h, out):
        _out(out).value = self._dev(h, "nvmlDeviceGetPowerUsage").power_mw

    @_c
    def _c_nvmlDeviceGetUtilizationRates(self, h, out):
        g = self._dev(h, "nvmlDeviceGetUtilizationRates")
        if g.mig and g.mig[0]:
            raise _Ret(NOT_SUPPORTED)  # nvml.h: not supported on MIG-enabled GPUs
        _out(out).gpu, _out(out).memory = g.utilization, 0

    @_c
    def _c_nvmlDeviceGetCurrentClocksEventReasons(self, h, out):
        _out(out).value = self._dev(h, "nvmlDeviceGetCurrentClocksEventReasons").clock_reasons

    @_c
    def _c_nvmlDeviceGetCurrentClocksThrottleReasons(self, h, out):
        _out(out).value = self._dev(h, "nvmlDeviceGetCurrentClocksThrottleReasons").clock_reasons

    @_c
    def _c_nvmlDeviceGetCurrPcieLinkGeneration(self, h, out):
        _out(out).value = self._dev(h, "nvmlDeviceGetCurrPcieLinkGeneration").pcie[0]

    @_c
    def _c_nvmlDeviceGetMaxPcieLinkGeneration(self, h, out):
        _out(out).value = self._dev(h, "nvmlDeviceGetMaxPcieLinkGeneration").pcie[1]

    @_c
    def _c_nvmlDeviceGetGpuMaxPcieLinkGeneration(self, h, out):
        _out(out).value = self._dev(h, "nvmlDeviceGetGpuMaxPcieLinkGeneration").pcie[2]

    @_c
    def _c_nvmlDeviceGetCurrPcieLinkWidth(self, h, out):
        _out(out).value = self._dev(h, "nvmlDeviceGetCurrPcieLinkWidth").pcie[3]

    @_c
    def _c_nvmlDeviceGetMaxPcieLinkWidth(self, h, out):
        _out(out).value = self._dev(h, "nvmlDeviceGetMaxPcieLinkWidth").pcie[4]

    @_c
    def _c_nvmlDeviceGetPcieReplayCounter(self, h, out):
        _out(out).value = self._dev(h, "nvmlDeviceGetPcieReplayCounter").replays

    @_c
    def _c_nvmlDeviceGetClockInfo(self, h, kind, out):
        _out(out).value = self._dev(h, "nvmlDeviceGetClockInfo").sm_clock[0]

    @_c
    def _c_nvmlDeviceGetMaxClockInfo(self, h, kind, out):
        _out(out).value = self._dev(h, "nvmlDeviceGetMaxClockInfo").sm_clock[1]

    @_c
    def _c_nvmlDeviceGetComputeRunningProcesses_v3(self, h, count, procs):
        g = self._dev(h, "nvmlDeviceGetComputeRunningProcesses_v3")
        n = _out(count)
        if not g.procs:
            n.value = 0
            return
        if procs is None or n.value < len(g.procs):
            n.value = len(g.procs)
            raise _Ret(INSUFFICIENT_SIZE)
        for i, pid in enumerate(g.procs):
            procs[i].pid, procs[i].usedGpuMemory = pid, 1 << 30
        n.value = len(g.procs)

    @_c
    def _c_nvmlDeviceGetCpuAffinity(self, h, words, out):
        g = self._dev(h, "nvmlDeviceGetCpuAffinity")
        arr = _out(out)
        for c in g.cpus:
            if c // 64 < len(arr):
                arr[c // 64] |= 1 << (c % 64)

    # -- health -----------------------------------------------------------------------------------
    @_c
    def _c_nvmlDeviceGetFieldValues(self, h, count, out):
        g = self._dev(h, "nvmlDeviceGetFieldValues")
        values = _out(out)
        for i in range(int(count.value)):
            v = values[i]
            if v.fieldId == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and g.recovery is not None:
                v.nvmlReturn, v.valueType = SUCCESS, g.recovery_type
                setattr(v.value, VALUE_MEMBERS[g.recovery_type], g.recovery)
            else:
                v.nvmlReturn = NOT_SUPPORTED  # per field: the call itself succeeds

    @_c
    def _c_nvmlDeviceValidateInforom(self, h):
        if not self._dev(h, "nvmlDeviceValidateInforom").inforom_ok:
            raise _Ret(CORRUPTED_INFOROM)

    @_c
    def _c_nvmlDeviceGetSramEccErrorStatus(self, h, status):
        g = self._dev(h, "nvmlDeviceGetSramEccErrorStatus")
        s = _out(status)
        if s.version != pynvml.nvmlEccSramErrorStatus_v1:
            raise _Ret(ARGUMENT_VERSION_MISMATCH)
        s.volatileUncParity, s.volatileUncSecDed, s.bThresholdExceeded = g.sram

    @_c
    def _c_nvmlDeviceGetMemoryErrorCounter(self, h, err_type, counter_type, location, out):
        _out(out).value = sum(self._dev(h, "nvmlDeviceGetMemoryErrorCounter").sram[:2])

    @_c
    def _c_nvmlDeviceGetNvLinkState(self, h, link, out):
        g = self._dev(h, "nvmlDeviceGetNvLinkState")
        if g.links is None:
            raise _Ret(NOT_SUPPORTED)
        link = int(getattr(link, "value", link))
        if link >= len(g.links):
            raise _Ret(INVALID_ARGUMENT)
        # nvml.h / DCGM: NVML reports the links of a MIG-enabled GPU as down
        _out(out).value = 0 if (g.mig and g.mig[0]) else int(g.links[link])

    @_c
    def _c_nvmlDeviceGetNvLinkErrorCounter(self, h, link, counter, out):
        g = self._dev(h, "nvmlDeviceGetNvLinkErrorCounter")
        _out(out).value = g.link_errors[int(getattr(counter, "value", counter))]

    @_c
    def _c_nvmlDeviceGetP2PStatus(self, h1, h2, cap, out):
        g = self._dev(h1, "nvmlDeviceGetP2PStatus")
        peer = self._index(h2)
        self._dev(h2, "")  # a lost or reset-required peer answers for the pair
        _out(out).value = g.p2p.get(peer, pynvml.NVML_P2P_STATUS_OK)

    @_c
    def _c_nvmlDeviceGetGpuFabricInfoV(self, h, out):
        g = self._dev(h, "nvmlDeviceGetGpuFabricInfoV")
        info = _out(out)
        versions = {pynvml.nvmlGpuFabricInfo_v2: 2, pynvml.nvmlGpuFabricInfo_v3: 3}
        if versions.get(info.version) not in g.fabric_versions:
            raise _Ret(ARGUMENT_VERSION_MISMATCH)
        self._fill_fabric(g, info)

    @_c
    def _c_nvmlDeviceGetGpuFabricInfo(self, h, out):
        g = self._dev(h, "nvmlDeviceGetGpuFabricInfo")
        self._fill_fabric(g, _out(out))

    @staticmethod
    def _fill_fabric(g: FakeGpu, info: Any) -> None:
        if g.fabric is None:
            raise _Ret(NOT_SUPPORTED)
        state, status, mask, summary = g.fabric
        info.state, info.status = state, status
        names = {f[0] for f in info._fields_}
        if "healthMask" in names:
            info.healthMask = mask
        if "healthSummary" in names:
            info.healthSummary = summary

    # -- events -----------------------------------------------------------------------------------
    @_c
    def _c_nvmlEventSetCreate(self, out):
        self._set_pointer(_out(out), ctypes.addressof(self._event_cell))

    @_c
    def _c_nvmlDeviceRegisterEvents(self, h, types, event_set):
        self._dev(h, "nvmlDeviceRegisterEvents")
        self.registered.append(self._index(h))

    @_c
    def _c_nvmlEventSetWait_v2(self, event_set, out, timeout):
        if not self.events:
            raise _Ret(TIMEOUT)
        index, xid = self.events.pop(0)
        data = _out(out)
        data.device = ctypes.cast(ctypes.c_void_p(ctypes.addressof(self._cells[index])), pynvml.c_nvmlDevice_t)
        data.eventType = pynvml.nvmlEventTypeXidCriticalError
        data.eventData = xid

    @_c
    def _c_nvmlEventSetFree(self, event_set):
        pass


def c_functions() -> set[str]:
    """The C function names this fake library defines."""
    return {name[3:] for name, v in vars(FakeNvmlLib).items() if name.startswith("_c_nvml")}


def install(monkeypatch: Any, lib: FakeNvmlLib) -> FakeNvmlLib:
    """Make the real ``pynvml`` talk to ``lib`` for the rest of the test."""
    monkeypatch.setattr(pynvml, "nvmlLib", lib)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    monkeypatch.setattr(pynvml, "_nvmlLib_refcount", 0)
    return lib


def backend(monkeypatch: Any, gpus: list[FakeGpu] | None = None, **kw: Any):
    """(NvmlBackend over a fake library, the library)."""
    lib = install(monkeypatch, FakeNvmlLib(hgx_h100() if gpus is None else gpus, **kw))
    from gpu_tune.gpu.nvml import NvmlBackend

    return NvmlBackend(), lib


def pass_calls(keys: list) -> list[tuple]:
    """The calls after the backend's start (``nvmlInit``, the XID event set and each GPU's
    registration): what one pass of readings made."""
    keys = [tuple(k) for k in keys]
    start = [i for i, k in enumerate(keys) if k[0] in ("nvmlDeviceRegisterEvents", "nvmlEventSetCreate",
                                                       "nvmlInitWithFlags")]
    return keys[start[-1] + 1:] if start else keys
