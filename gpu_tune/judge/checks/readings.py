"""NVML readings that answered with an error of their own.

``gpu.readings`` (warning): a reading that answered ``NO_PERMISSION``, ``UNKNOWN``, a timeout or
any error other than "not supported" or the GPU's own "lost" / "reset required" is that reading's
fault, for that GPU (:mod:`gpu_tune.gpu.nvml_read`): it is named here with the GPU, why it was
not read and what is judged without it, and never fails the GPU. The fatal checks judge what
they did read; GPUd and DCGM skip such a reading and say so the same way. The unprivileged audit
agent cannot read what ``nvml.h`` reserves for root (SRAM ECC status): docs/security.md.
"""

from __future__ import annotations

from gpu_tune.gpu.nvml_calls import READING_CHECKS, ROOT_READINGS
from gpu_tune.judge.checks.base import WARNING, Check, Facts, Family, answering, listed


def unread_of(gpus, reading: str) -> list[int]:
    """Indices of the GPUs whose ``reading`` was not read (for the other families' details)."""
    return [g.index for g in gpus if reading in dict(g.unread or ())]


def not_read_note(gpus, *readings: str) -> str:
    """"; not read on GPU 2, 5: sram_ecc (see gpu.readings)", or ""."""
    parts = []
    for reading in readings:
        idx = unread_of(gpus, reading)
        if idx:
            parts.append(f"{reading} on GPU {', '.join(str(i) for i in idx)}")
    return f"; not read: {'; '.join(parts)} (see gpu.readings)" if parts else ""


class Readings(Family):
    name = "readings"
    category = "presence"
    severity = WARNING
    source = "NVML"
    reads = "every NVML reading of every GPU that answered, and the error of each that did not"
    thresholds = "every reading answers (or is not supported by this GPU or driver)"
    remedy = ("a reading that needs root (nvml.h: SRAM ECC status) is read by the enforcing (privileged) agent "
              "or `gpu-tune check` as root; other errors: check the driver with nvidia-smi -q")
    checks = ("gpu.readings",)

    def evaluate(self, facts: Facts) -> list[Check]:
        gpus = answering(facts.gpus)
        if not gpus:
            return []
        groups: dict[tuple[str, str], list[int]] = {}
        for g in gpus:
            for reading, why in g.unread or ():
                groups.setdefault((reading, why), []).append(g.index)
        per = tuple((str(g.index), not g.unread) for g in sorted(gpus, key=lambda g: g.index))
        if not groups:
            return [self.check("gpu.readings", True, f"every NVML reading answered on {len(gpus)} GPU(s)", gpus=per)]
        texts = []
        for (reading, why), idx in sorted(groups.items(), key=lambda kv: (kv[1][0], kv[0])):
            shown = ", ".join(map(str, idx[:16])) + (f", ... {idx[-1]}" if len(idx) > 16 else "")
            who = f"GPU {idx[0]}" if len(idx) == 1 else f"{len(idx)} of {len(gpus)} GPUs ({shown})"
            need = "; nvml.h: requires root" if reading in ROOT_READINGS and "ermission" in why else ""
            judged = READING_CHECKS.get(reading, "")
            texts.append(f"{reading} on {who} {why}{need}" + (f" ({judged} judged without it)" if judged else ""))
        return [self.check("gpu.readings", False, listed(texts), listed(texts, 2), gpus=per)]
