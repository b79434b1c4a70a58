"""The GPU backend interface (``--gpu-backend``, docs/cli.md). Implementations: nvml, fixture, null."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping, Protocol, runtime_checkable


class GpuError(Exception):
    """An NVML-level failure for one GPU or call (lost, not supported, no permission)."""

    def __init__(self, message: str, kind: str = "error") -> None:
        super().__init__(message)
        # kind: "lost" | "not_supported" | "no_permission" | "error"
        self.kind = kind


@dataclass(frozen=True)
class RemappedRows:
    """``nvmlDeviceGetRemappedRows``: rows remapped for correctable and uncorrectable errors, a
    remapping pending (done at the next GPU reset) and a remapping that failed (no spare row)."""

    correctable: int | None = None
    uncorrectable: int | None = None
    pending: bool | None = None
    failure: bool | None = None


@dataclass(frozen=True)
class SramEcc:
    """Uncorrected SRAM ECC errors (volatile) and whether the driver says their threshold is
    exceeded (``nvmlDeviceGetSramEccErrorStatus``)."""

    uncorrected: int | None = None
    threshold_exceeded: bool | None = None


@dataclass(frozen=True)
class NvLink:
    """One NVLink: up or not, and its error counters (reported, never judged)."""

    link: int
    active: bool
    crc_errors: int | None = None
    replay_errors: int | None = None
    recovery_errors: int | None = None


@dataclass(frozen=True)
class Fabric:
    """``nvmlDeviceGetGpuFabricInfoV``: the NVSwitch fabric's registration of this GPU, and (v2 and
    later) its health: the ``healthMask`` fields that say something is wrong, by name
    (``degraded_bandwidth``, ``route_recovery_in_progress``, ``route_unhealthy``,
    ``access_timeout_recovery_in_progress``, ``incorrect_configuration:<why>``), and the v3
    ``healthSummary`` (``healthy``, ``unhealthy``, ``limited_capacity``; None where not reported)."""

    state: str  # not_supported | not_started | in_progress | completed
    status: str = "success"  # success, or the failure's name
    health: tuple[str, ...] = ()
    summary: str | None = None


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    pci_bus_id: str  # "0000:18:00.0", lower-case, 4-digit domain (sysfs form)
    memory_total_mib: int | None = None
    compute_capability: str | None = None
    persistence_mode: bool | None = None
    # MIG (Multi-Instance GPU) mode: None where the GPU has no MIG (or the driver does not say).
    # ``mig_mode_pending`` is the mode after the next GPU reset (NVML's "pending").
    mig_mode: bool | None = None
    mig_mode_pending: bool | None = None
    pcie_link_gen_current: int | None = None
    # the top generation of the link: NVML's nvmlDeviceGetMaxPcieLinkGeneration ("possible with this
    # device and system"); the GPU's own capability (nvmlDeviceGetGpuMaxPcieLinkGeneration) apart
    pcie_link_gen_max: int | None = None
    pcie_link_gen_gpu_max: int | None = None
    pcie_link_width_current: int | None = None
    pcie_link_width_max: int | None = None
    ecc_mode: bool | None = None
    ecc_uncorrected_volatile: int | None = None
    retired_pages_pending: bool | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    utilization_percent: float | None = None
    memory_used_mib: int | None = None
    # names of nvmlDeviceGetCurrentClocksEventReasons bits (docs/health.md; the fixture's
    # ``clock_event_reasons``, or its older name ``clock_throttle_reasons``)
    clock_throttle_reasons: tuple[str, ...] = ()
    xid_events: tuple[int, ...] = ()
    # Health readings (docs/health.md): None = not reported by this GPU (or this driver), never
    # "healthy" by assumption.
    recovery_action: str | None = None  # NVML field 230: none | reset | reboot | drain_p2p | drain_and_reset
    reset_required: bool | None = None  # NVML answered NVMLError_ResetRequired
    inforom_valid: bool | None = None  # nvmlDeviceValidateInforom
    remapped_rows: RemappedRows | None = None
    sram_ecc: SramEcc | None = None
    nvlink: tuple[NvLink, ...] | None = None  # one per link the GPU has
    nvlink_p2p: tuple[tuple[str, bool], ...] | None = None  # (peer bus id, P2P over NVLink OK)
    fabric: Fabric | None = None  # None: not part of an NVSwitch fabric
    pcie_replay_count: int | None = None  # since the driver loaded
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    # Readings that answered with an error of their own (no permission, unknown, ...): (reading,
    # "not read: <why>"). The field stays None and only a warning names it (docs/health.md).
    unread: tuple[tuple[str, str], ...] = ()
    # Set when the GPU answered with an error (e.g. "lost"): the other fields may be None.
    error: str | None = None
    error_kind: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["clock_throttle_reasons"] = list(self.clock_throttle_reasons)
        d["xid_events"] = list(self.xid_events)
        if self.nvlink is not None:
            d["nvlink"] = [asdict(n) for n in self.nvlink]
        if self.nvlink_p2p is not None:
            d["nvlink_p2p"] = dict(self.nvlink_p2p)
        if self.fabric is not None:
            d["fabric"]["health"] = list(self.fabric.health)
        d["unread"] = dict(self.unread)
        d.pop("extra", None)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "GpuInfo":
        """The inverse of :meth:`as_dict` (what the agent keeps between passes); unknown keys are
        left out."""
        kw: dict[str, Any] = {k: d[k] for k in _FIELDS if k in d}
        for key in ("uuid", "name", "pci_bus_id"):  # a document of a GPU that could not say them
            kw.setdefault(key, "")
        kw["clock_throttle_reasons"] = tuple(d.get("clock_throttle_reasons") or ())
        kw["xid_events"] = tuple(int(x) for x in (d.get("xid_events") or ()))
        if isinstance(d.get("remapped_rows"), Mapping):
            kw["remapped_rows"] = RemappedRows(**_known(RemappedRows, d["remapped_rows"]))
        if isinstance(d.get("sram_ecc"), Mapping):
            kw["sram_ecc"] = SramEcc(**_known(SramEcc, d["sram_ecc"]))
        if isinstance(d.get("fabric"), Mapping):
            fab = _known(Fabric, d["fabric"])
            fab["health"] = tuple(str(x) for x in (fab.get("health") or ()))
            kw["fabric"] = Fabric(**fab)
        if isinstance(d.get("unread"), Mapping):
            kw["unread"] = tuple((str(k), str(v)) for k, v in d["unread"].items())
        if d.get("nvlink") is not None:
            kw["nvlink"] = tuple(NvLink(**_known(NvLink, n)) for n in d["nvlink"] if isinstance(n, Mapping))
        if isinstance(d.get("nvlink_p2p"), Mapping):
            kw["nvlink_p2p"] = tuple((str(k), bool(v)) for k, v in d["nvlink_p2p"].items())
        return cls(**kw)


@runtime_checkable
class GpuBackend(Protocol):
    """Chosen once at start (see :func:`gpu_tune.gpu.select_backend`)."""

    name: str  # "nvml" | "fixture" | "none"
    reason: str  # why it was chosen, logged once

    def driver_version(self) -> str | None: ...

    def cuda_driver_version(self) -> str | None: ...

    def gpus(self) -> list[GpuInfo]:
        """Every GPU with its current state; a GPU that fails to answer has ``error`` set."""
        ...

    def set_persistence_mode(self, index: int, enabled: bool) -> None:
        """Raises GpuError on failure."""
        ...

    def processes(self, index: int) -> list[int]:
        """PIDs of compute processes on the GPU (empty when unknown)."""
        ...

    def cpu_affinity(self, index: int) -> frozenset[int] | None:
        """CPUs NVML considers local to the GPU, or None when it cannot say."""
        ...

    def close(self) -> None: ...


_FIELDS = frozenset(f.name for f in fields(GpuInfo)) - {"extra"}


def _known(cls: type, d: Mapping[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names}
