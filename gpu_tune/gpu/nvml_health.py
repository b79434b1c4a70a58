"""The NVML health readings of one GPU (docs/health.md), for :mod:`gpu_tune.gpu.nvml`.

``nv`` is the ``pynvml`` module the NVML backend imported (this module imports nothing of
NVML's itself). Every reading is optional: a call the GPU or the driver does not support
(``NotSupported``, ``FunctionNotFound``, an older nvidia-ml-py without the function) leaves its
field ``None``, never "healthy". ``NVMLError_ResetRequired`` and a lost GPU raise to the caller,
which records them for the whole GPU.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

from gpu_tune.gpu.base import Fabric, NvLink, RemappedRows, SramEcc

# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION's values (nvml.h nvmlDeviceGpuRecoveryAction_t)
RECOVERY_ACTIONS = {0: "none", 1: "reset", 2: "reboot", 3: "drain_p2p", 4: "drain_and_reset",
                    5: "recover_imex_domain", 6: "reset", 7: "reboot"}
FIELD_RECOVERY_ACTION = 230
FABRIC_STATES = {0: "not_supported", 1: "not_started", 2: "in_progress", 3: "completed"}
MAX_LINKS = 18  # NVLink links per GPU up to Blackwell (H100 SXM: 18)


def read_health(nv: Any, h: Any, index: int, peers: dict[int, Any], opt: Callable[[Callable[[], Any]], Any]) -> dict[str, Any]:
    """The health fields of :class:`~gpu_tune.gpu.base.GpuInfo` for the GPU behind ``h``."""
    links = _nvlink(nv, h, opt)
    out: dict[str, Any] = {
        "recovery_action": _recovery_action(nv, h, opt),
        "inforom_valid": _inforom(nv, h),
        "remapped_rows": _remapped_rows(nv, h, opt),
        "sram_ecc": _sram(nv, h, opt),
        "nvlink": links,
        "nvlink_p2p": _p2p(nv, h, index, peers) if links and any(link.active for link in links) else None,
        "fabric": _fabric(nv, h, opt),
        "pcie_replay_count": _call(nv, opt, "nvmlDeviceGetPcieReplayCounter", h),
        "sm_clock_mhz": _call(nv, opt, "nvmlDeviceGetClockInfo", h, getattr(nv, "NVML_CLOCK_SM", 1)),
        "sm_clock_max_mhz": _call(nv, opt, "nvmlDeviceGetMaxClockInfo", h, getattr(nv, "NVML_CLOCK_SM", 1)),
        "reset_required": False,
    }
    for key in ("pcie_replay_count", "sm_clock_mhz", "sm_clock_max_mhz"):
        if out[key] is not None:
            out[key] = int(out[key])
    return out


def _call(nv: Any, opt: Callable[[Callable[[], Any]], Any], name: str, *args: Any) -> Any:
    fn = getattr(nv, name, None)
    if fn is None:
        return None
    return opt(lambda: fn(*args))


def _recovery_action(nv: Any, h: Any, opt: Callable[[Callable[[], Any]], Any]) -> str | None:
    field = getattr(nv, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", FIELD_RECOVERY_ACTION)
    values = _call(nv, opt, "nvmlDeviceGetFieldValues", h, [field])
    if not values:
        return None
    v = values[0]
    if int(getattr(v, "nvmlReturn", 0)) != 0:  # this driver does not know the field
        return None
    raw = getattr(v, "value", None)
    code = int(getattr(raw, "uiVal", raw if isinstance(raw, int) else 0))
    return RECOVERY_ACTIONS.get(code, f"unknown_{code}")


def _inforom(nv: Any, h: Any) -> bool | None:
    fn = getattr(nv, "nvmlDeviceValidateInforom", None)
    if fn is None:
        return None
    try:
        fn(h)
        return True
    except nv.NVMLError as exc:
        corrupted = getattr(nv, "NVMLError_CorruptedInforom", None)
        if corrupted is not None and isinstance(exc, corrupted):
            return False
        if _unsupported(nv, exc):
            return None
        raise


def _remapped_rows(nv: Any, h: Any, opt: Callable[[Callable[[], Any]], Any]) -> RemappedRows | None:
    got = _call(nv, opt, "nvmlDeviceGetRemappedRows", h)
    if got is None:
        return None
    corr, unc, pending, failure = (int(x) for x in tuple(got)[:4])
    return RemappedRows(correctable=corr, uncorrectable=unc, pending=bool(pending), failure=bool(failure))


def _sram(nv: Any, h: Any, opt: Callable[[Callable[[], Any]], Any]) -> SramEcc | None:
    cls = getattr(nv, "c_nvmlEccSramErrorStatus_v1_t", None)
    if cls is not None and getattr(nv, "nvmlDeviceGetSramEccErrorStatus", None) is not None:
        status = cls()  # filled through a pointer: nvidia-ml-py passes the argument on as it is
        if opt(lambda: nv.nvmlDeviceGetSramEccErrorStatus(h, ctypes.byref(status))) is not None:
            unc = int(status.volatileUncParity) + int(status.volatileUncSecDed)
            return SramEcc(uncorrected=unc, threshold_exceeded=bool(status.bThresholdExceeded))
    loc = getattr(nv, "NVML_MEMORY_LOCATION_SRAM", None)
    if loc is None:
        return None
    unc = _call(nv, opt, "nvmlDeviceGetMemoryErrorCounter", h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nv.NVML_VOLATILE_ECC, loc)
    return None if unc is None else SramEcc(uncorrected=int(unc), threshold_exceeded=None)


def _nvlink(nv: Any, h: Any, opt: Callable[[Callable[[], Any]], Any]) -> tuple[NvLink, ...] | None:
    state_fn = getattr(nv, "nvmlDeviceGetNvLinkState", None)
    if state_fn is None:
        return None
    enabled = getattr(nv, "NVML_FEATURE_ENABLED", 1)
    counters = (("replay_errors", getattr(nv, "NVML_NVLINK_ERROR_DL_REPLAY", 0)),
                ("recovery_errors", getattr(nv, "NVML_NVLINK_ERROR_DL_RECOVERY", 1)),
                ("crc_errors", getattr(nv, "NVML_NVLINK_ERROR_DL_CRC_FLIT", 2)))
    links = []
    for link in range(min(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", MAX_LINKS)), MAX_LINKS)):
        try:
            state = state_fn(h, link)
        except nv.NVMLError as exc:
            if _unsupported(nv, exc) or _invalid(nv, exc):
                continue  # this GPU has no such link (or no NVLink at all)
            raise
        active = bool(state == enabled)
        errs: dict[str, int | None] = {}
        for key, counter in counters:
            v = _call(nv, opt, "nvmlDeviceGetNvLinkErrorCounter", h, link, counter) if active else None
            errs[key] = None if v is None else int(v)
        links.append(NvLink(link=link, active=active, **errs))
    return tuple(links) or None


def _p2p(nv: Any, h: Any, index: int, peers: dict[int, Any]) -> tuple[tuple[str, bool], ...] | None:
    from gpu_tune.host.parse import normalize_bus_id

    fn = getattr(nv, "nvmlDeviceGetP2PStatus", None)
    if fn is None:
        return None
    cap = getattr(nv, "NVML_P2P_CAPS_INDEX_NVLINK", 2)
    ok = getattr(nv, "NVML_P2P_STATUS_OK", 0)
    out = []
    for j, peer in sorted(peers.items()):
        if j == index:
            continue
        try:
            bus = getattr(nv.nvmlDeviceGetPciInfo(peer), "busId", b"")
            bus = bus.decode() if isinstance(bus, bytes) else str(bus)
            status = fn(h, peer, cap)
        except nv.NVMLError as exc:
            if _unsupported(nv, exc):
                continue
            raise
        out.append((normalize_bus_id(bus), bool(status == ok)))
    return tuple(out) or None


def _fabric(nv: Any, h: Any, opt: Callable[[Callable[[], Any]], Any]) -> Fabric | None:
    for fn_name, cls_name in (("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfoV_t"),
                              ("nvmlDeviceGetGpuFabricInfo", "c_nvmlGpuFabricInfo_t")):
        fn, cls = getattr(nv, fn_name, None), getattr(nv, cls_name, None)
        if fn is None or cls is None:
            continue
        info = cls()
        if opt(lambda: fn(h, ctypes.byref(info))) is None:
            continue
        state = FABRIC_STATES.get(int(info.state), f"unknown_{int(info.state)}")
        if state == "not_supported":
            return None  # not part of an NVSwitch fabric
        code = int(info.status)
        status = "success" if code == 0 else _error_name(nv, code)
        return Fabric(state=state, status=status)
    return None


def _error_name(nv: Any, code: int) -> str:
    text = getattr(getattr(nv, "NVMLError", None), "_errcode_to_string", {}).get(code)
    return (text or f"NVML error {code}").lower().replace(" ", "_")


def _unsupported(nv: Any, exc: Exception) -> bool:
    return any(isinstance(exc, c) for c in (getattr(nv, "NVMLError_NotSupported", ()),
                                             getattr(nv, "NVMLError_FunctionNotFound", ())) if c)


def _invalid(nv: Any, exc: Exception) -> bool:
    cls = getattr(nv, "NVMLError_InvalidArgument", None)
    return cls is not None and isinstance(exc, cls)
