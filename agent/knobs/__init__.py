"""The knob registry: every setting family, registered explicitly, in apply order."""

from __future__ import annotations

from .allocator import AllocatorKnob
from .base import Context, Knob
from .cpu_governor import CpuGovernorKnob
from .gpu_persistence import GpuPersistenceKnob
from .irq_affinity import IrqAffinityKnob
from .sysctl import SysctlKnob
from .thp import ThpKnob

KNOBS: tuple[Knob, ...] = (
    SysctlKnob(),
    ThpKnob(),
    CpuGovernorKnob(),
    GpuPersistenceKnob(),
    IrqAffinityKnob(),
    AllocatorKnob(),
)

BY_FAMILY: dict[str, Knob] = {k.family: k for k in KNOBS}

__all__ = ["BY_FAMILY", "KNOBS", "Context", "Knob"]
