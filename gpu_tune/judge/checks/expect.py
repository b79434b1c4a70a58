"""What a healthy node is expected to have: the GPU model's figures (``expect:`` of its entry in
``policies/baselines.yaml``) under the profile's ``readiness.expect`` (a SKU that ships fewer
NVLinks, a node with 4 GPUs of a model usually sold by 8, the InfiniBand ports and their rate)."""

from __future__ import annotations

from typing import Any, Sequence

from gpu_tune.gpu.base import GpuInfo
from gpu_tune.judge.checks.base import Expect


def expectations(profile: Any, baselines: Any, gpus: Sequence[GpuInfo], *, device_ids: dict[str, str] | None = None) -> Expect:
    """``baselines``: a :class:`~gpu_tune.judge.probe.baselines.Baselines` (or None); ``device_ids``
    maps a GPU's bus id to its PCI device id (from the topology) for models NVML names differently."""
    want = getattr(getattr(profile, "readiness", None), "expect", None)
    model = None
    for g in gpus:
        if g.name and not g.error:
            entry = baselines.for_gpu(g.name, (device_ids or {}).get(g.pci_bus_id)) if baselines is not None else None
            if entry is not None and entry.expect is not None:
                model = (g.name, entry.expect)
                break
    figs: dict[str, Any] = {}
    sources = []
    fabric = any(g.fabric is not None for g in gpus)
    if model is not None and (model[1].applies_to == "any" or fabric):
        name, e = model
        base = {k: getattr(e, k) for k in ("gpus", "nvlink_active_per_gpu") if getattr(e, k) is not None}
        where = f"policies/baselines.yaml for {name}" + (" on an NVSwitch baseboard" if fabric else "")
        if base:
            figs.update(base)
            sources.append(where)
        if e.ib_rate_gbps is not None:
            figs.update(ib_default_rate_gbps=e.ib_rate_gbps, ib_default_ports=e.ib_ports_at_rate,
                        ib_default_source=where)
    if want is not None:
        mine = {k: getattr(want, k) for k in ("gpus", "nvlink_active_per_gpu", "ib_ports", "ib_rate_gbps")
                if getattr(want, k) is not None}
        if mine:
            figs.update(mine)
            sources.append(f"profile {getattr(profile, 'name', '?')} readiness.expect")
    if isinstance(figs.get("ib_ports"), list):
        figs["ib_ports"] = tuple(figs["ib_ports"])
    return Expect(**figs, source=", ".join(sources))


def device_ids(topology_doc: Any) -> dict[str, str]:
    """GPU bus id -> PCI device id, from a topology document (for GPU models matched by id)."""
    return {str(g.get("pci_bus_id")): str(g.get("device")) for g in (topology_doc or {}).get("gpus") or []
            if isinstance(g, dict) and g.get("pci_bus_id") and g.get("device")}
