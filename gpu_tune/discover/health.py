"""The host's own health readings for the GPU checks (docs/health.md), read under ``--root``:

- the kernel log (:mod:`gpu_tune.host.kmsg`): NVIDIA XIDs (``NVRM: Xid (PCI:0000:1b:00): 79, ...``)
  and NVSwitch SXids (``nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Fatal, ...``) in the
  kernel's own records, each attributed to the PCI address the line names and counted per
  (address, code) (:mod:`gpu_tune.discover.xids`);
- ``/proc/sys/kernel/random/boot_id`` and ``/proc/uptime``;
- ``/sys/bus/pci/devices/BDF/aer_dev_{correctable,nonfatal,fatal}`` of every GPU (the kernel's
  PCIe Advanced Error Reporting counters, ``TOTAL_ERR_*`` lines);
- ``/sys/class/infiniband/DEV/ports/N/{state,phys_state,rate,link_layer,counters/link_downed}``.

Nothing here judges: :mod:`gpu_tune.judge.checks` does. What cannot be read is ``None`` (or an
``error`` naming it), never a healthy default. Memory stays bounded whatever the log holds: the
kernel log is read record by record and only sightings are kept, within bounds that never cost a
fatal one (:class:`gpu_tune.discover.xids.Sightings`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from gpu_tune.discover.xids import (FATAL, MAX_SIGHTINGS, NOTED, OTHER, WANT, XID_RE, KernelLogStatus, Rank,  # noqa: F401
                                    XidSighting, is_sxid_detail, parse_kernel_line, read_kernel_xids)
from gpu_tune.errors import HostError
from gpu_tune.host.fs import HostFS
from gpu_tune.host.kmsg import KernelLog

PCI_DIR = "/sys/bus/pci/devices"
IB_DIR = "/sys/class/infiniband"
MAX_IB_PORTS = 256

@dataclass(frozen=True)
class AerCounts:
    """``TOTAL_ERR_COR`` / ``TOTAL_ERR_NONFATAL`` / ``TOTAL_ERR_FATAL`` since the device was found."""

    correctable: int | None = None
    nonfatal: int | None = None
    fatal: int | None = None


@dataclass(frozen=True)
class IbPort:
    device: str  # mlx5_0
    port: int
    state: str | None  # "ACTIVE" (from "4: ACTIVE")
    phys_state: str | None  # "LinkUp" (from "5: LinkUp")
    rate_gbps: float | None  # 400.0 (from "400 Gb/sec (4X NDR)")
    link_layer: str | None  # "InfiniBand" | "Ethernet"
    link_downed: int | None = None  # counters/link_downed: times the link went down

    @property
    def name(self) -> str:
        return f"{self.device}/{self.port}"

    @property
    def up(self) -> bool:
        return (self.state or "").upper() == "ACTIVE" and (self.phys_state or "").lower() == "linkup"


@dataclass(frozen=True)
class HostHealth:
    boot_id: str | None
    uptime_usec: int | None
    kernel_log: KernelLogStatus
    xids: tuple[XidSighting, ...] = ()  # new since the previous read of the same KernelLog
    noted: tuple[XidSighting, ...] = ()  # to name in a warning (rank NOTED): this read's, or this boot's (the monitor's)
    aer: tuple[tuple[str, AerCounts], ...] = ()  # (GPU bus id, counters)
    ib_ports: tuple[IbPort, ...] = ()
    errors: tuple[str, ...] = field(default_factory=tuple)  # sysfs files that could not be read

    def aer_of(self, bus_id: str) -> AerCounts | None:
        return dict(self.aer).get(bus_id)

    def as_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        d = asdict(self)
        d["aer"] = {bus: asdict(c) for bus, c in self.aer}
        return d


def _state_word(text: str | None) -> str | None:
    """``4: ACTIVE`` -> ``ACTIVE``; ``5: LinkUp`` -> ``LinkUp``."""
    if text is None:
        return None
    return text.split(":", 1)[1].strip() if ":" in text else text.strip()


_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec")


def parse_rate(text: str | None) -> float | None:
    m = _RATE_RE.match(text or "")
    return float(m.group(1)) if m else None


def parse_aer(text: str | None, total: str) -> int | None:
    """The ``TOTAL_ERR_*`` line of an ``aer_dev_*`` file (``NAME COUNT`` lines)."""
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == total and parts[1].isdigit():
            return int(parts[1])
    return None


def read_host_health(fs: HostFS, log: KernelLog | None, gpu_bus_ids: Iterable[str], rank: Rank | None = None
                     ) -> HostHealth:
    """Everything above; ``log`` None leaves the kernel log unread (its status says so); ``rank``:
    how much each XID sighting matters (:mod:`gpu_tune.discover.xids`)."""
    gpu_bus_ids = sorted(set(gpu_bus_ids))
    errors: list[str] = []

    def optional(path: str) -> str | None:
        try:
            return fs.read_optional(path)
        except HostError as exc:  # refused for what it is (a FIFO, a device, too large)
            errors.append(str(exc))
            return None

    boot = optional("/proc/sys/kernel/random/boot_id")
    uptime = None
    up = optional("/proc/uptime")
    if up:
        try:
            uptime = int(float(up.split()[0]) * 1_000_000)
        except (ValueError, IndexError):
            uptime = None
    if log is None:
        xids, status = (), KernelLogStatus(source="", error="the kernel log is not read here")
    else:
        xids, status = read_kernel_xids(log, rank, gpu_bus_ids)
    aer = []
    for bus in sorted(set(gpu_bus_ids)):
        base = f"{PCI_DIR}/{bus}"
        texts = [optional(f"{base}/aer_dev_{kind}") for kind in ("correctable", "nonfatal", "fatal")]
        if all(t is None for t in texts):
            continue  # no AER on this device (or this kernel): not reported
        aer.append((bus, AerCounts(correctable=parse_aer(texts[0], "TOTAL_ERR_COR"),
                                   nonfatal=parse_aer(texts[1], "TOTAL_ERR_NONFATAL"),
                                   fatal=parse_aer(texts[2], "TOTAL_ERR_FATAL"))))
    ports = []
    try:
        devices = fs.listdir(IB_DIR)
    except HostError as exc:
        errors.append(str(exc))
        devices = []
    for dev in devices:
        try:
            names = fs.listdir(f"{IB_DIR}/{dev}/ports")
        except HostError as exc:
            errors.append(str(exc))
            continue
        for name in names:
            if not name.isdigit() or len(ports) >= MAX_IB_PORTS:
                continue
            base = f"{IB_DIR}/{dev}/ports/{name}"
            downed = optional(f"{base}/counters/link_downed")
            ports.append(IbPort(device=dev, port=int(name), state=_state_word(optional(f"{base}/state")),
                                phys_state=_state_word(optional(f"{base}/phys_state")),
                                rate_gbps=parse_rate(optional(f"{base}/rate")),
                                link_layer=optional(f"{base}/link_layer"),
                                link_downed=int(downed) if downed and downed.isdigit() else None))
    return HostHealth(boot_id=boot, uptime_usec=uptime, kernel_log=status, xids=xids,
                      noted=tuple(s for s in xids if s.rank == NOTED), aer=tuple(aer),
                      ib_ports=tuple(ports), errors=tuple(errors))
