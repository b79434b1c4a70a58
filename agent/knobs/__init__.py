"""The knob registry: every setting family, registered explicitly, in apply order."""

from __future__ import annotations

from .base import Context, Knob
from .cpu_governor import CpuGovernorKnob
from .sysctl import SysctlKnob
from .thp import ThpKnob

KNOBS: tuple[Knob, ...] = (
    SysctlKnob(),
    ThpKnob(),
    CpuGovernorKnob(),
)

BY_FAMILY: dict[str, Knob] = {k.family: k for k in KNOBS}

__all__ = ["BY_FAMILY", "KNOBS", "Context", "Knob"]
