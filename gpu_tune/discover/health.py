"""The host's own health readings for the GPU checks (docs/health.md), read under ``--root``:

- the kernel log (:mod:`gpu_tune.host.kmsg`): NVIDIA XIDs (``NVRM: Xid (PCI:0000:1b:00): 79, ...``)
  and NVSwitch SXids (``nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Fatal, ...``) in the
  kernel's own records, each attributed to the PCI address the line names and counted per
  (address, code) (:mod:`gpu_tune.discover.xids`);
- ``/proc/sys/kernel/random/boot_id`` and ``/proc/uptime``;
- ``/sys/bus/pci/devices/BDF/aer_dev_{correctable,nonfatal,fatal}`` of every GPU (the kernel's
  PCIe Advanced Error Reporting counters, ``TOTAL_ERR_*`` lines);
- ``/sys/class/infiniband/DEV/ports/N/{state,phys_state,rate,link_layer,counters/link_downed}``;
- the GPUs' ``{current,max}_link_{speed,width}`` (only to say which ones cannot be read).

The sysfs and procfs files are read by :mod:`gpu_tune.discover.sysfs_health`, strictly and within
bounds. Nothing here judges: :mod:`gpu_tune.judge.checks` does. What cannot be read is ``None``
(with a finding naming it), never a healthy default. Memory stays bounded whatever the log holds: the
kernel log is read record by record and only sightings are kept, within bounds that never cost a
fatal one (:class:`gpu_tune.discover.xids.Sightings`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from gpu_tune.discover.xids import (FATAL, MAX_SIGHTINGS, NOTED, OTHER, WANT, XID_RE, KernelLogStatus, Rank,  # noqa: F401
                                    XidSighting, is_sxid_detail, parse_kernel_line, read_kernel_xids)
from gpu_tune.discover.sysfs_health import (AerCounts, IbPort, read_aer, read_boot_id, read_infiniband,
                                            read_pcie_link_problems, read_uptime_usec)
from gpu_tune.host.fs import HostFS
from gpu_tune.host.kmsg import KernelLog


@dataclass(frozen=True)
class HostHealth:
    boot_id: str | None
    uptime_usec: int | None
    kernel_log: KernelLogStatus
    xids: tuple[XidSighting, ...] = ()  # new since the previous read of the same KernelLog
    noted: tuple[XidSighting, ...] = ()  # to name in a warning (rank NOTED): this read's, or this boot's (the monitor's)
    aer: tuple[tuple[str, AerCounts], ...] = ()  # (GPU bus id, counters)
    ib_ports: tuple[IbPort, ...] = ()
    errors: tuple[str, ...] = field(default_factory=tuple)  # host files that could not be read
    ib_not_read: tuple[str, ...] = ()  # InfiniBand devices and ports left out, in words
    ib_unread_physical: int = 0  # physical functions' ports left out by the bounds: not judged
    ib_unread_named: tuple[str, ...] = ()  # ports or devices the profile names among them
    pcie_unreadable: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (GPU bus id, unreadable link files)
    boot_problem: str | None = None  # why the boot id could not be read (None: it was)

    def pcie_problems(self, bus_id: str) -> tuple[str, ...]:
        return dict(self.pcie_unreadable).get(bus_id, ())

    def aer_of(self, bus_id: str) -> AerCounts | None:
        return dict(self.aer).get(bus_id)

    def as_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        d = asdict(self)
        d["aer"] = {bus: asdict(c) for bus, c in self.aer}
        return d


def read_host_health(fs: HostFS, log: KernelLog | None, gpu_bus_ids: Iterable[str], rank: Rank | None = None,
                     *, ib_named: Iterable[str] = (), timed: Callable[[str, int], bool] | None = None) -> HostHealth:
    """Everything above; ``log`` None leaves the kernel log unread (its status says so); ``rank``:
    how much each XID sighting matters and ``timed``: the XIDs whose bursts are kept
    (:mod:`gpu_tune.discover.xids`); ``ib_named``: the InfiniBand ports a profile names (read first)."""
    gpu_bus_ids = sorted(set(gpu_bus_ids))
    boot = read_boot_id(fs)
    up = read_uptime_usec(fs)
    errors = [r.problem for r in (up,) if r.problem]
    if log is None:
        xids, status = (), KernelLogStatus(source="", error="the kernel log is not read here")
    else:
        xids, status = read_kernel_xids(log, rank, gpu_bus_ids, timed)
    aer, links = [], []
    for bus in gpu_bus_ids:
        counts = read_aer(fs, bus)
        if counts is not None:
            aer.append((bus, counts))
        bad = read_pcie_link_problems(fs, bus)
        if bad:
            links.append((bus, bad))
    ib = read_infiniband(fs, ib_named)
    return HostHealth(boot_id=boot.value, uptime_usec=up.value, kernel_log=status, xids=xids,
                      noted=tuple(s for s in xids if s.rank == NOTED), aer=tuple(aer),
                      ib_ports=ib.ports, errors=tuple(errors) + ib.errors, ib_not_read=ib.not_read,
                      ib_unread_physical=ib.unread_physical, ib_unread_named=ib.unread_named,
                      pcie_unreadable=tuple(links), boot_problem=boot.problem)
