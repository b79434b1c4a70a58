"""The knob registry: every setting family, registered explicitly, in apply order."""

from __future__ import annotations

from gpu_tune.tune.knobs.allocator import AllocatorKnob
from gpu_tune.tune.knobs.base import Context, Knob
from gpu_tune.tune.knobs.cpu_cstates import CpuCstatesKnob
from gpu_tune.tune.knobs.cpu_governor import CpuGovernorKnob
from gpu_tune.tune.knobs.gpu_mig import GpuMigKnob
from gpu_tune.tune.knobs.gpu_persistence import GpuPersistenceKnob
from gpu_tune.tune.knobs.gpudirect import GpuDirectKnob
from gpu_tune.tune.knobs.irq_affinity import IrqAffinityKnob
from gpu_tune.tune.knobs.limits import MemlockKnob
from gpu_tune.tune.knobs.sysctl import SysctlKnob
from gpu_tune.tune.knobs.thp import ThpKnob

KNOBS: tuple[Knob, ...] = (
    SysctlKnob(),
    ThpKnob(),
    CpuGovernorKnob(),
    CpuCstatesKnob(),
    GpuPersistenceKnob(),
    IrqAffinityKnob(),
    AllocatorKnob(),
    MemlockKnob(),
    GpuMigKnob(),
    GpuDirectKnob(),
)

# Journal entries name the family that wrote them (revert finds the knob by it).
BY_FAMILY: dict[str, Knob] = {k.family: k for k in KNOBS}


def knob_for(setting_id: str) -> Knob | None:
    """The knob that reports ``setting_id`` (several knobs share an id prefix: ``cpu.governor``
    and ``cpu.cstates``, ``gpu.persistence_mode`` and ``gpu.mig_mode``)."""
    for knob in KNOBS:
        if knob.owns(setting_id):
            return knob
    return None


def fixable(setting_id: str) -> bool:
    """Whether ``apply`` may change a row of this id (read-only checks only report)."""
    knob = knob_for(setting_id)
    return knob is not None and knob.writable


__all__ = ["BY_FAMILY", "KNOBS", "Context", "Knob", "fixable", "knob_for"]
