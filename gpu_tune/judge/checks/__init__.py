"""The readiness checks as a registry: one family per file, each declaring what it reads, its
severity, its thresholds and its remedy (:class:`~gpu_tune.judge.checks.base.Family`), walked in
:data:`REGISTRY` order by :func:`gpu_tune.judge.readiness.verdict`. docs/health.md has the table.

Health families (the hardware's): presence (lost or missing GPUs, counts), readings (NVML readings
that answered with an error: warnings), xid (the kernel log),
recovery (NVML's recovery action), memory, nvlink (and the fabric), network (InfiniBand), pcie,
thermal. Beside them: tuning (the profile's settings: a preference, never the hardware's health),
the device plugin's count, the driver's CUDA, the agent's publishing and the probe.
"""

from __future__ import annotations

from gpu_tune.judge.checks.base import (CATEGORIES, FATAL, HARDWARE, WARNING, Check, Expect, Facts,
                                        Family)
from gpu_tune.judge.checks.cluster import DevicePlugin, Published
from gpu_tune.judge.checks.driver import Driver
from gpu_tune.judge.checks.memory import Memory
from gpu_tune.judge.checks.network import Network
from gpu_tune.judge.checks.nvlink import NvLinkFamily
from gpu_tune.judge.checks.pcie import Pcie
from gpu_tune.judge.checks.presence import Presence
from gpu_tune.judge.checks.probe import Probe
from gpu_tune.judge.checks.readings import Readings
from gpu_tune.judge.checks.recovery import Recovery
from gpu_tune.judge.checks.stage import HealthStage
from gpu_tune.judge.checks.thermal import Thermal
from gpu_tune.judge.checks.tuning import Tuning
from gpu_tune.judge.checks.xid import Xid

# Listed in this order (/readiness, gpu-tune check); urgency goes by category (base.CATEGORIES).
REGISTRY: tuple[Family, ...] = (
    Tuning(),
    Presence(),
    HealthStage(),
    Readings(),
    Xid(),
    Recovery(),
    Memory(),
    NvLinkFamily(),
    Network(),
    Pcie(),
    Thermal(),
    DevicePlugin(),
    Driver(),
    Published(),
    Probe(),
)

HEALTH: tuple[Family, ...] = tuple(f for f in REGISTRY if f.category in HARDWARE)

__all__ = ["CATEGORIES", "FATAL", "HARDWARE", "HEALTH", "REGISTRY", "WARNING", "Check", "Expect", "Facts", "Family"]
