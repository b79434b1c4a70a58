"""The NVML health readings of one GPU (docs/health.md), for :mod:`gpu_tune.gpu.nvml`.

``nv`` is the ``pynvml`` module the NVML backend imported (this module imports nothing of
NVML's itself). Every reading goes through :class:`~gpu_tune.gpu.nvml_read.Readings` and fails
alone: a call the GPU or the driver does not support leaves its field ``None``, never "healthy";
any other error is that reading's ("not read: <why>", a warning); only the GPU's own "lost" and
"reset required" answers end the GPU's reading.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

from gpu_tune.gpu.base import Fabric, NvLink, RemappedRows, SramEcc
from gpu_tune.gpu.nvml_read import GPU_STATES, Readings, error_kind, error_text  # noqa: F401

# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION's values (nvml.h nvmlDeviceGpuRecoveryAction_t)
RECOVERY_ACTIONS = {0: "none", 1: "reset", 2: "reboot", 3: "drain_p2p", 4: "drain_and_reset",
                    5: "recover_imex_domain", 6: "bus_reset", 7: "system_reboot"}
FIELD_RECOVERY_ACTION = 230
FABRIC_STATES = {0: "not_supported", 1: "not_started", 2: "in_progress", 3: "completed"}
FABRIC_SUMMARIES = {1: "healthy", 2: "unhealthy", 3: "limited_capacity"}
# nvml.h NVML_GPU_FABRIC_HEALTH_MASK_*: (name, shift, width, the values that are faults)
FABRIC_HEALTH = (
    ("degraded_bandwidth", 0, 0x3, {1: ""}),
    ("route_recovery_in_progress", 2, 0x3, {1: ""}),
    ("route_unhealthy", 4, 0x3, {1: ""}),
    ("access_timeout_recovery_in_progress", 6, 0x3, {1: ""}),
    ("incorrect_configuration", 8, 0xF, {2: "incorrect_sysguid", 3: "incorrect_chassis_sn", 4: "no_partition",
                                         5: "insufficient_nvlinks", 6: "incompatible_gpu_fw",
                                         7: "invalid_location", 8: "gpu_state_invalid"}),
)
MAX_LINKS = 18  # NVLink links per GPU up to Blackwell (H100 SXM: 18)
# nvmlValueType_t -> the c_nvmlValue_t member that holds it
VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def read_health(nv: Any, r: Readings, h: Any, index: int, peers: dict[int, tuple[Any, str]],
                mig_enabled: bool = False, peers_left: int = 0) -> dict[str, Any]:
    """The health fields of :class:`~gpu_tune.gpu.base.GpuInfo` for the GPU behind ``h``.
    ``peers``: the other GPUs that said who they are this pass whose P2P status with this one is
    read (index -> (handle, bus id)); ``peers_left``: how many more there are, not read."""
    links = _nvlink(nv, r, h)
    up = bool(links) and any(link.active for link in links)
    out: dict[str, Any] = {
        "recovery_action": _recovery_action(nv, r, h),
        "inforom_valid": _inforom(nv, r, h),
        "remapped_rows": _remapped_rows(r, h),
        "sram_ecc": _sram(nv, r, h),
        "nvlink": links,
        "nvlink_p2p": _p2p(nv, r, h, index, peers, peers_left) if up and not mig_enabled else None,
        "fabric": _fabric(nv, r, h),
        "pcie_replay_count": r.call("pcie_replay_count", "nvmlDeviceGetPcieReplayCounter", h),
        "sm_clock_mhz": r.call("sm_clock", "nvmlDeviceGetClockInfo", h, getattr(nv, "NVML_CLOCK_SM", 1)),
        "sm_clock_max_mhz": r.call("sm_clock", "nvmlDeviceGetMaxClockInfo", h, getattr(nv, "NVML_CLOCK_SM", 1)),
        "reset_required": False,
    }
    for key in ("pcie_replay_count", "sm_clock_mhz", "sm_clock_max_mhz"):
        if out[key] is not None:
            out[key] = int(out[key])
    return out


def field_value(v: Any) -> int | float | None:
    """The number one ``c_nvmlFieldValue_t`` carries, by its ``valueType``."""
    member = VALUE_MEMBERS.get(int(getattr(v, "valueType", 1)))
    if member is None:
        return None
    got = getattr(getattr(v, "value", None), member, None)
    return got if isinstance(got, (int, float)) else None


def _recovery_action(nv: Any, r: Readings, h: Any) -> str | None:
    field = getattr(nv, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", FIELD_RECOVERY_ACTION)
    values = r.call("recovery_action", "nvmlDeviceGetFieldValues", h, [field])
    if not values:
        return None
    v = values[0]
    ret = int(getattr(v, "nvmlReturn", 0))
    if ret != 0:  # the field's own answer: NOT_SUPPORTED from a driver that does not know it
        r.failed("recovery_action", nv.NVMLError(ret))
        return None
    code = field_value(v)
    if code is None:
        r.note("recovery_action", f"value type {int(getattr(v, 'valueType', -1))} is not a number")
        return None
    if not action_code(code):
        # NaN, infinity, 1.5, -1, NVML's all-ones "not available": no nvmlDeviceGpuRecoveryAction_t
        r.note("recovery_action", f"{code!r} is not a recovery action (a whole number from 0 to {2**31 - 1})")
        return None
    return RECOVERY_ACTIONS.get(int(code), f"unknown_{int(code)}")


def action_code(code: int | float) -> bool:
    """Whether a field value can be an ``nvmlDeviceGpuRecoveryAction_t`` (a C enum): a whole,
    finite number from 0 to 2^31-1, of whatever value type NVML said it sent. An action this
    version does not know (8, say) still gates, as ``unknown_8``: a newer driver asks something."""
    if isinstance(code, float) and not (math.isfinite(code) and code.is_integer()):
        return False
    return 0 <= code <= 2**31 - 1


def _inforom(nv: Any, r: Readings, h: Any) -> bool | None:
    fn = getattr(nv, "nvmlDeviceValidateInforom", None)
    if fn is None:
        return None
    try:
        fn(h)
        return True
    except nv.NVMLError as exc:
        if error_kind(exc) == "corrupted_inforom":
            return False
        return r.failed("inforom", exc)


def _remapped_rows(r: Readings, h: Any) -> RemappedRows | None:
    got = r.call("remapped_rows", "nvmlDeviceGetRemappedRows", h)
    if got is None:
        return None
    corr, unc, pending, failure = (int(x) for x in tuple(got)[:4])
    return RemappedRows(correctable=corr, uncorrectable=unc, pending=bool(pending), failure=bool(failure))


def _sram(nv: Any, r: Readings, h: Any) -> SramEcc | None:
    cls = getattr(nv, "c_nvmlEccSramErrorStatus_v1_t", None)
    if cls is not None and getattr(nv, "nvmlDeviceGetSramEccErrorStatus", None) is not None:
        status = cls()  # the binding's own constructor sets ``version``
        # filled through a pointer: nvidia-ml-py passes the argument on as it is
        if r.call("sram_ecc", "nvmlDeviceGetSramEccErrorStatus", h, ctypes.byref(status)) is not None:
            unc = int(status.volatileUncParity) + int(status.volatileUncSecDed)
            return SramEcc(uncorrected=unc, threshold_exceeded=bool(status.bThresholdExceeded))
        if "sram_ecc" in r.unread:
            return None  # it answered (no permission, ...): the older counter would not say more
    loc = getattr(nv, "NVML_MEMORY_LOCATION_SRAM", None)
    if loc is None:
        return None
    unc = r.call("sram_ecc", "nvmlDeviceGetMemoryErrorCounter", h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                 nv.NVML_VOLATILE_ECC, loc)
    return None if unc is None else SramEcc(uncorrected=int(unc), threshold_exceeded=None)


def _nvlink(nv: Any, r: Readings, h: Any) -> tuple[NvLink, ...] | None:
    state_fn = getattr(nv, "nvmlDeviceGetNvLinkState", None)
    if state_fn is None:
        return None
    enabled = getattr(nv, "NVML_FEATURE_ENABLED", 1)
    counters = (("replay_errors", getattr(nv, "NVML_NVLINK_ERROR_DL_REPLAY", 0)),
                ("recovery_errors", getattr(nv, "NVML_NVLINK_ERROR_DL_RECOVERY", 1)),
                ("crc_errors", getattr(nv, "NVML_NVLINK_ERROR_DL_CRC_FLIT", 2)))
    links = []
    unread = []
    for link in range(min(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", MAX_LINKS)), MAX_LINKS)):
        try:
            state = state_fn(h, link)
        except nv.NVMLError as exc:
            kind = error_kind(exc)
            if kind in ("not_supported", "invalid_argument"):
                continue  # this GPU has no such link (or no NVLink at all)
            if kind in GPU_STATES:
                r.failed("nvlink", exc)  # raises: the GPU's own state
            unread.append((link, error_text(exc)))
            continue
        if state not in (enabled, getattr(nv, "NVML_FEATURE_DISABLED", 0)):
            unread.append((link, f"state {state} is not an NVML link state (0 or 1)"))
            continue
        active = bool(state == enabled)
        errs: dict[str, int | None] = {}
        for key, counter in counters:
            # metrics only: one counter that does not answer is that counter's, never the link's
            v = r.call("nvlink_error_counters", "nvmlDeviceGetNvLinkErrorCounter", h, link, counter) if active else None
            errs[key] = None if v is None else int(v)
        links.append(NvLink(link=link, active=active, **errs))
    if unread:
        first = unread[0][1]
        r.note("nvlink", f"state of link(s) {', '.join(str(n) for n, _ in unread)}: {first}")
        return None  # a partial list would read as links down
    return tuple(links) or None


def _p2p(nv: Any, r: Readings, h: Any, index: int, peers: dict[int, tuple[Any, str]],
         peers_left: int = 0) -> tuple[tuple[str, bool], ...] | None:
    fn = getattr(nv, "nvmlDeviceGetP2PStatus", None)
    if fn is None:
        return None
    cap = getattr(nv, "NVML_P2P_CAPS_INDEX_NVLINK", 2)
    ok = getattr(nv, "NVML_P2P_STATUS_OK", 0)
    unknown = getattr(nv, "NVML_P2P_STATUS_UNKNOWN", 6)
    out = []
    failed = []
    if peers_left > 0:
        failed.append(f"{peers_left:,} of {len(peers) + peers_left:,} peers (at most {len(peers)} a GPU per pass)")
    for j, (peer, bus) in sorted(peers.items()):
        if j == index:
            continue
        try:
            status = fn(h, peer, cap)
        except nv.NVMLError as exc:
            kind = error_kind(exc)
            if kind == "not_supported":
                continue
            # lost / reset required on a pair is never this GPU's state: the GPU whose state it is
            # says so in its own readings (a peer's in its row); here it is one pair not read
            failed.append(f"{bus}: {error_text(exc)}")
            continue
        if status == unknown or not 0 <= status <= unknown:  # UNKNOWN, or no nvmlGpuP2PStatus_t at all
            failed.append(f"{bus}: " + ("NVML_P2P_STATUS_UNKNOWN" if status == unknown else
                                         f"status {status} is not an NVML P2P status (0 to {unknown})"))
            continue
        out.append((bus, bool(status == ok)))
    if failed:
        r.note("nvlink_p2p", "; ".join(failed[:3]) + (f"; and {len(failed) - 3} more" if len(failed) > 3 else ""))
    return tuple(out) or None


def fabric_health(mask: int) -> tuple[str, ...]:
    """The faults one ``healthMask`` names (nvml.h NVML_GPU_FABRIC_HEALTH_MASK_*)."""
    out = []
    for name, shift, width, faults in FABRIC_HEALTH:
        v = (int(mask) >> shift) & width
        if v in faults:
            out.append(f"{name}:{faults[v]}" if faults[v] else name)
    return tuple(out)


def _fabric(nv: Any, r: Readings, h: Any) -> Fabric | None:
    """``nvmlDeviceGetGpuFabricInfoV`` with the newest struct the binding and the driver share
    (v3: health mask and summary; v2: health mask), else the older ``nvmlDeviceGetGpuFabricInfo``
    (state and status only)."""
    for fn_name, cls_name in (("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfo_v3_t"),
                              ("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfo_v2_t"),
                              ("nvmlDeviceGetGpuFabricInfo", "c_nvmlGpuFabricInfo_t")):
        fn, cls = getattr(nv, fn_name, None), getattr(nv, cls_name, None)
        if fn is None or cls is None:
            continue
        info = cls()  # the binding's constructor sets ``version`` where the struct has one
        try:
            fn(h, ctypes.byref(info))
        except nv.NVMLError as exc:
            if error_kind(exc) == "not_supported":  # no such call or struct version here: an older one
                continue
            return r.failed("fabric", exc)
        state = FABRIC_STATES.get(int(info.state))
        if state is None:  # no nvmlGpuFabricState_t: a value NVML cannot hold, not a fabric fault
            r.note("fabric", f"state {int(info.state)} is not an NVML fabric state (0 to 3)")
            return None
        if state == "not_supported":
            return None  # not part of an NVSwitch fabric
        code = int(info.status)
        status = "success" if code == 0 else _error_name(nv, code)
        names = {f[0] for f in getattr(info, "_fields_", ())}
        health = fabric_health(int(info.healthMask)) if "healthMask" in names else ()
        summary = FABRIC_SUMMARIES.get(int(info.healthSummary)) if "healthSummary" in names else None
        return Fabric(state=state, status=status, health=health, summary=summary)
    return None


def _error_name(nv: Any, code: int) -> str:
    text = getattr(getattr(nv, "NVMLError", None), "_errcode_to_string", {}).get(code)
    return (text or f"NVML error {code}").lower().replace(" ", "_")
