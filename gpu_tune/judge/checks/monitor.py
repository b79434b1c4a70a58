"""The health readings of one pass, and what is remembered across passes, for the agent and for
``gpu-tune check``: :class:`HealthMonitor` owns the kernel log reader (incremental: the agent
reads only what is new each pass) and the :class:`~gpu_tune.judge.checks.state.HealthState`."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from gpu_tune.discover.health import HostHealth, read_host_health
from gpu_tune.gpu.base import GpuInfo
from gpu_tune.host.fs import HostFS
from gpu_tune.host.kmsg import KernelLog
from gpu_tune.judge.checks.state import HealthState, HealthView


def gpu_bus_ids(gpus: Sequence[GpuInfo], topology: Mapping[str, Any] | None) -> list[str]:
    ids = {g.pci_bus_id.lower() for g in gpus if g.pci_bus_id}
    for t in (topology or {}).get("gpus") or []:
        if isinstance(t, Mapping) and t.get("pci_bus_id") and t.get("on_pci_bus", True):
            ids.add(str(t["pci_bus_id"]).lower())
    return sorted(ids)


class HealthMonitor:
    """``persist``: keep the remembered facts in the state folder under the root (the agent and
    ``gpu-tune check`` do; tests may not)."""

    def __init__(self, fs: HostFS, *, persist: bool = True, clock=None) -> None:
        self.fs = fs
        self.log = KernelLog(fs)
        kw = {"clock": clock} if clock is not None else {}
        self.state = HealthState(fs if persist else None, **kw)

    def read(self, gpus: Sequence[GpuInfo], topology: Mapping[str, Any] | None = None, *,
             clear_tokens: Iterable[str] = (), ib_named: Iterable[str] = ()) -> tuple[HostHealth, HealthView]:
        """``ib_named``: the InfiniBand ports a profile names (read first, whatever the bounds)."""
        host = read_host_health(self.fs, self.log, gpu_bus_ids(gpus, topology), ib_named=ib_named)
        view = self.state.observe(host, gpus, clear_tokens=clear_tokens)
        return host, view

    def close(self) -> None:
        self.log.close()
