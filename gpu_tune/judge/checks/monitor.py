"""The health readings of one pass, and what is remembered across passes, for the agent and for
``gpu-tune check``: :class:`HealthMonitor` owns the kernel log reader (incremental: the agent
reads only what is new each pass) and the :class:`~gpu_tune.judge.checks.state.HealthState`.

What the kernel log reads told in this boot is summed here, in memory (the reader hands out each
record once): the counts of records ignored, skipped or dropped, and the XIDs the catalog does not
know (at most :data:`MAX_NOTED` of them), so that the agent's later passes say what its first one
read, as ``gpu-tune check`` (one read of the whole log) does."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable, Mapping, Sequence

from gpu_tune.discover.health import HostHealth, read_host_health
from gpu_tune.discover.xids import MAX_NOTED, KernelLogStatus, XidSighting
from gpu_tune.gpu.base import GpuInfo
from gpu_tune.host.fs import HostFS
from gpu_tune.host.kmsg import KernelLog
from gpu_tune.judge.checks.state import HealthState, HealthView
from gpu_tune.judge.checks.xid_policy import CATALOG, XidPolicy


def gpu_bus_ids(gpus: Sequence[GpuInfo], topology: Mapping[str, Any] | None) -> list[str]:
    ids = {g.pci_bus_id.lower() for g in gpus if g.pci_bus_id}
    for t in (topology or {}).get("gpus") or []:
        if isinstance(t, Mapping) and t.get("pci_bus_id") and t.get("on_pci_bus", True):
            ids.add(str(t["pci_bus_id"]).lower())
    return sorted(ids)


class HealthMonitor:
    """``persist``: keep the remembered facts in the state folder under the root (the agent and
    ``gpu-tune check`` do; tests may not); ``read_only``: read them, write nothing (``check --slurm
    --dry-run``); ``policy``: what each XID
    weighs (the profile's ``readiness.xid`` over the catalog: gpu_tune.judge.policy.policy_of)."""

    def __init__(self, fs: HostFS, *, persist: bool = True, clock=None, policy: XidPolicy | None = None,
                 read_only: bool = False) -> None:
        self.fs = fs
        self.log = KernelLog(fs)
        self.policy = policy or CATALOG
        kw = {"clock": clock} if clock is not None else {}
        self.state = HealthState(fs if persist else None, policy=self.policy, read_only=read_only, **kw)
        self._boot: str | None = None
        self._log_total: KernelLogStatus | None = None
        self._noted: dict[tuple[str, str, int], XidSighting] = {}

    def read(self, gpus: Sequence[GpuInfo], topology: Mapping[str, Any] | None = None, *,
             clear_tokens: Iterable[str] = (), ib_named: Iterable[str] = ()) -> tuple[HostHealth, HealthView]:
        """``ib_named``: the InfiniBand ports a profile names (read first, whatever the bounds)."""
        host = read_host_health(self.fs, self.log, gpu_bus_ids(gpus, topology), rank=self.policy.rank,
                                ib_named=ib_named, timed=self.policy.timed)
        host = self._this_boot(host)
        view = self.state.observe(host, gpus, clear_tokens=clear_tokens)
        return host, view

    def _this_boot(self, host: HostHealth) -> HostHealth:
        """``host`` with the kernel log's counts and the noted XIDs of every read in this boot."""
        if host.boot_id != self._boot:
            self._boot, self._log_total, self._noted = host.boot_id, None, {}
        status = host.kernel_log
        if self._log_total is not None:
            status = status.plus(self._log_total)
        self._log_total = status
        for s in host.noted:
            had = self._noted.get(s.key())
            if had is not None:
                firsts = [u for u in (had.first_usec, s.first_usec) if u is not None]
                lasts = [u for u in (had.last_usec, s.last_usec) if u is not None]
                self._noted[s.key()] = replace(had, count=had.count + s.count, first_usec=min(firsts, default=None),
                                               last_usec=max(lasts, default=None))
            elif len(self._noted) < MAX_NOTED:
                self._noted[s.key()] = s
            else:
                status = replace(status, dropped=status.dropped + 1)
                self._log_total = status
        return replace(host, kernel_log=status, noted=tuple(self._noted.values()))

    def close(self) -> None:
        self.log.close()
