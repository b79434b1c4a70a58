"""The GPU backend interface (``--gpu-backend``, docs/cli.md). Implementations: nvml, fixture, null."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable


class GpuError(Exception):
    """An NVML-level failure for one GPU or call (lost, not supported, no permission)."""

    def __init__(self, message: str, kind: str = "error") -> None:
        super().__init__(message)
        # kind: "lost" | "not_supported" | "no_permission" | "error"
        self.kind = kind


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
    pcie_link_gen_max: int | None = None
    pcie_link_width_current: int | None = None
    pcie_link_width_max: int | None = None
    ecc_mode: bool | None = None
    ecc_uncorrected_volatile: int | None = None
    retired_pages_pending: bool | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    utilization_percent: float | None = None
    memory_used_mib: int | None = None
    clock_throttle_reasons: tuple[str, ...] = ()
    xid_events: tuple[int, ...] = ()
    # Set when the GPU answered with an error (e.g. "lost"): the other fields may be None.
    error: str | None = None
    error_kind: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["clock_throttle_reasons"] = list(self.clock_throttle_reasons)
        d["xid_events"] = list(self.xid_events)
        d.pop("extra", None)
        return d


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
