"""The host's own health readings for the GPU checks (docs/health.md), read under ``--root``:

- the kernel log (:mod:`gpu_tune.host.kmsg`): NVIDIA XIDs (``NVRM: Xid (PCI:0000:1b:00): 79, ...``)
  and NVSwitch SXids (``nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Fatal, ...``), each
  attributed to the PCI address the line names and counted per (address, code);
- ``/proc/sys/kernel/random/boot_id`` and ``/proc/uptime``;
- ``/sys/bus/pci/devices/BDF/aer_dev_{correctable,nonfatal,fatal}`` of every GPU (the kernel's
  PCIe Advanced Error Reporting counters, ``TOTAL_ERR_*`` lines);
- ``/sys/class/infiniband/DEV/ports/N/{state,phys_state,rate,link_layer,counters/link_downed}``;
- the GPUs' ``{current,max}_link_{speed,width}`` (only to say which ones cannot be read).

The sysfs and procfs files are read by :mod:`gpu_tune.discover.sysfs_health`, strictly and within
bounds. Nothing here judges: :mod:`gpu_tune.judge.checks` does. What cannot be read is ``None``
(with a finding naming it), never a healthy default. Memory stays bounded whatever the log holds: the
kernel log is read record by record and only sightings are kept, at most
:data:`MAX_SIGHTINGS` distinct (kind, address, code) of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from gpu_tune.discover.sysfs_health import (AerCounts, IbPort, read_aer, read_boot_id, read_infiniband,
                                            read_pcie_link_problems, read_uptime_usec)
from gpu_tune.host.fs import HostFS
from gpu_tune.host.kmsg import KernelLog, ReadStats

MAX_SIGHTINGS = 1024
MAX_MESSAGE = 240

# The driver's three forms (open-gpu-kernel-modules kernel_rc.c), and older drivers' without "PCI:":
#   NVRM: Xid (PCI:0000:1b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
#   NVRM: Xid (PCI:0000:1b:00 GPU-I:01 GPU-CI:00): 31, pid=1234, name=python, ...   (MIG)
#   NVRM: Xid (0000:03:00): 14, Channel 00000001
# The address is domain:bus:device (no function).
XID_RE = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<bus>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.[0-7])?"
                    r"(?: GPU-I:\d+)?(?: GPU-CI:\d+)?\): (?P<code>\d{1,10})(?:,\s*(?P<rest>.*)|\s*$)")
# A GPU lost without an Xid line (the driver's other wording): counted as XID 79.
FALLEN_RE = re.compile(r"NVRM: GPU (?:at )?(?P<bus>(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2})\.[0-7]:? "
                       r"(?:GPU )?has fallen off the bus")
# nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error
# One event prints several records (the headline with Fatal/Non-fatal, then Severity ..., Data {...}):
# only the headline is counted.
SXID_RE = re.compile(r"(?P<dev>nvidia-nvswitch\d*): SXid \((?:PCI:)?(?P<bus>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:"
                     r"[0-9a-fA-F]{2}(?:\.[0-7])?)\): (?P<code>\d{1,10}), (?P<sev>Non-fatal|Fatal),?\s*(?P<rest>.*)")
SXID_ANY = re.compile(r"SXid \(")
# what a line must hold to be looked at (checked on the raw bytes, before decoding)
WANT = re.compile(rb"Xid \(|fallen off the bus")


@dataclass(frozen=True)
class XidSighting:
    """Every record of one (kind, address, code) in one read of the kernel log."""

    kind: str  # "xid" (a GPU's) | "sxid" (an NVSwitch's)
    bus: str  # as the line names it, lower-case: "0000:1b:00" for an XID, "0000:05:00.0" for an SXid
    code: int
    count: int
    first_usec: int | None
    last_usec: int | None
    message: str  # the first record's text after the code
    severity_word: str | None = None  # an SXid's own "Fatal" / "Non-fatal"
    device: str | None = None  # an SXid's "nvidia-nvswitchN"

    def key(self) -> tuple[str, str, int]:
        return (self.kind, self.bus, self.code)


@dataclass(frozen=True)
class KernelLogStatus:
    source: str
    error: str | None = None
    scanned: int = 0
    lost: int = 0
    cut: int = 0
    malformed: int = 0  # lines that look like XIDs and do not parse
    dropped: int = 0  # sightings beyond MAX_SIGHTINGS (counted, not kept)
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class HostHealth:
    boot_id: str | None
    uptime_usec: int | None
    kernel_log: KernelLogStatus
    xids: tuple[XidSighting, ...] = ()  # new since the previous read of the same KernelLog
    aer: tuple[tuple[str, AerCounts], ...] = ()  # (GPU bus id, counters)
    ib_ports: tuple[IbPort, ...] = ()
    errors: tuple[str, ...] = field(default_factory=tuple)  # host files that could not be read
    ib_not_read: tuple[str, ...] = ()  # InfiniBand devices and ports left out, in words
    ib_unread_physical: int = 0  # physical functions' ports left out by the bounds: not judged
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


def parse_kernel_line(message: str) -> tuple[str, str, int, str, str | None, str | None] | None:
    """(kind, bus, code, rest, severity word, device) of an XID or SXid line; None otherwise."""
    m = XID_RE.search(message)
    if m:
        return "xid", m.group("bus").lower(), int(m.group("code")), (m.group("rest") or "").strip(), None, None
    m = SXID_RE.search(message)
    if m:
        return ("sxid", m.group("bus").lower(), int(m.group("code")), m.group("rest").strip(), m.group("sev"),
                m.group("dev"))
    m = FALLEN_RE.search(message)
    if m:
        bus = m.group("bus").lower()
        return "xid", bus if bus.count(":") == 2 else f"0000:{bus}", 79, "GPU has fallen off the bus", None, None
    return None


def is_sxid_detail(message: str) -> bool:
    """The second and later records of one SXid event (Severity ..., Data {...}): not an event."""
    return bool(SXID_ANY.search(message)) and SXID_RE.search(message) is None


def read_kernel_xids(log: KernelLog) -> tuple[tuple[XidSighting, ...], KernelLogStatus]:
    """The XID and SXid sightings among the records ``log`` has not handed out yet."""
    stats = ReadStats()
    seen: dict[tuple[str, str, int], dict[str, Any]] = {}
    malformed = dropped = 0
    for rec in log.read(WANT, stats):
        parsed = parse_kernel_line(rec.message)
        if parsed is None:
            if not is_sxid_detail(rec.message):
                malformed += 1
            continue
        kind, bus, code, rest, sev, dev = parsed
        key = (kind, bus, code)
        s = seen.get(key)
        if s is None:
            if len(seen) >= MAX_SIGHTINGS:
                dropped += 1
                continue
            seen[key] = {"count": 1, "first_usec": rec.usec, "last_usec": rec.usec, "message": rest[:MAX_MESSAGE],
                         "severity_word": sev, "device": dev}
        else:
            s["count"] += 1
            s["last_usec"] = rec.usec if rec.usec is not None else s["last_usec"]
    status = KernelLogStatus(source=stats.source, error=stats.error, scanned=stats.scanned, lost=stats.lost,
                             cut=stats.cut, malformed=malformed, dropped=dropped,
                             notes=tuple(stats.notes) + (("more records than one pass reads: the rest next pass",)
                                                         if stats.more else ()))
    sightings = tuple(XidSighting(kind=k[0], bus=k[1], code=k[2], **v) for k, v in seen.items())
    return sightings, status


def read_host_health(fs: HostFS, log: KernelLog | None, gpu_bus_ids: Iterable[str], *,
                     ib_named: Iterable[str] = ()) -> HostHealth:
    """Everything above; ``log`` None leaves the kernel log unread (its status says so).
    ``ib_named``: the InfiniBand ports a profile names (read first)."""
    boot = read_boot_id(fs)
    up = read_uptime_usec(fs)
    errors = [r.problem for r in (up,) if r.problem]
    if log is None:
        xids, status = (), KernelLogStatus(source="", error="the kernel log is not read here")
    else:
        xids, status = read_kernel_xids(log)
    aer, links = [], []
    for bus in sorted(set(gpu_bus_ids)):
        counts = read_aer(fs, bus)
        if counts is not None:
            aer.append((bus, counts))
        bad = read_pcie_link_problems(fs, bus)
        if bad:
            links.append((bus, bad))
    ib = read_infiniband(fs, ib_named)
    return HostHealth(boot_id=boot.value, uptime_usec=up.value, kernel_log=status, xids=xids, aer=tuple(aer),
                      ib_ports=ib.ports, errors=tuple(errors) + ib.errors, ib_not_read=ib.not_read,
                      ib_unread_physical=ib.unread_physical, pcie_unreadable=tuple(links),
                      boot_problem=boot.problem)
