"""The hardware findings of one verdict that keep evidence, each with the key the health state
keeps it under (docs/health.md "Evidence"): pure, no reading.

- a fatal XID or SXid: the health state's own record key, ``xid/0000:5d:00/79`` (one per GPU
  address and code, as ``health.json`` keeps it: seen again, it is the same finding);
- a per-GPU check (a lost GPU, a recovery action, memory, NVLink, the fabric, PCIe, thermals):
  ``gpu.memory/0000:5d:00``, one per check and GPU address;
- a check about the node as a whole (``gpu.count``, ``gpu.backend``): its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from gpu_tune.judge.checks.base import CATEGORIES
from gpu_tune.judge.checks.state_file import bus_key
from gpu_tune.judge.evidence import is_evidence

MAX_FINDINGS = 64  # named per verdict (a bundle names what it is for; more are counted)


@dataclass(frozen=True)
class Finding:
    key: str
    check: str
    bus: str | None = None  # the GPU's (or NVSwitch's) PCI address as the finding names it
    gpu: int | None = None  # the GPU's index, where one is named
    detail: str = ""
    first_usec: int | None = None  # kernel time of its first and last records (an XID's)
    last_usec: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "check": self.check, "bus": self.bus, "gpu": self.gpu, "detail": self.detail}


def _field(g: Any, key: str) -> Any:
    return g.get(key) if isinstance(g, Mapping) else getattr(g, key, None)


def gpu_index(gpus: Iterable[Any]) -> dict[str, tuple[int, str]]:
    """GPU address (without its function) -> (index, full address), of the GPUs NVML lists."""
    out = {}
    for g in gpus or ():
        bus, i = _field(g, "pci_bus_id"), _field(g, "index")
        if bus and isinstance(i, int):
            out[bus_key(str(bus))] = (i, str(bus).lower())
    return out


def _rank(c: Any) -> int:
    return CATEGORIES.index(c.category) if c.category in CATEGORIES else len(CATEGORIES)


def findings(verdict: Any, gpus: Sequence[Any], view: Any = None) -> list[Finding]:
    """The findings of ``verdict`` that keep evidence (:func:`~gpu_tune.judge.evidence.is_evidence`),
    the most urgent first; ``view`` (the health state's HealthView) names each fatal XID."""
    by_bus = gpu_index(gpus)
    by_index = {i: bus for i, bus in by_bus.values()}
    out: dict[str, Finding] = {}
    records = tuple(getattr(view, "records", ()) or ())
    for c in sorted((c for c in verdict.checks if is_evidence(c)), key=_rank):
        kind = {"gpu.xid": "xid", "nvswitch.sxid": "sxid"}.get(c.name)
        mine = [r for r in records if r.kind == kind] if kind else []
        if mine:
            for r in mine:
                gpu = by_bus.get(bus_key(r.bus))
                out.setdefault(r.key, Finding(r.key, c.name, r.bus, gpu[0] if gpu else None,
                                              f"{r.kind.upper()} {r.code} on {r.bus}: {r.message}"[:300],
                                              r.first_usec, r.last_usec))
            continue
        bad = [int(i) for i, ok in c.gpus if not ok and str(i).isdigit()]
        if bad:
            for i in bad:
                bus = by_index.get(i)
                key = f"{c.name}/{bus_key(bus)}" if bus else f"{c.name}/gpu{i}"
                out.setdefault(key, Finding(key, c.name, bus, i, c.detail[:300]))
        else:
            out.setdefault(c.name, Finding(c.name, c.name, None, None, c.detail[:300]))
    return list(out.values())[:MAX_FINDINGS]
