"""NVIDIA XIDs and NVSwitch SXids in the kernel log: the driver's record forms, parsed, and the
sightings of one read, per (kind, PCI address, code), kept within bounds that never cost a fatal
one (docs/health.md "XIDs").

Only the driver's records count: a record the kernel did not write (facility not 0: anything
written to ``/dev/kmsg`` from user space) is counted and ignored, and so is text naming an XID
anywhere but at the start of a record (a USB product string, a line inside another driver's
record). Nothing here judges: which codes are fatal is the catalog's (a judge passes its
:data:`Rank`), and :mod:`gpu_tune.judge.checks` decides.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

from gpu_tune.host.kmsg import KernelLog, KernelRecord, ReadStats

MAX_SIGHTINGS = 1024  # sightings kept per read that are not fatal (counted beyond)
MAX_FATAL_PER_BUS = 128  # distinct fatal codes kept per address: more than the catalog has (41 XIDs, 63 SXids)
MAX_FATAL_BUSES = 64  # addresses with a fatal sighting besides the node's own GPUs: more GPUs and
#                       NVSwitches than a node has (HGX: 8 and 4; the largest: 16 and 12)
MAX_NOTED = 64  # sightings to name in a warning (unknown codes), kept per read
MAX_MESSAGE = 240
# Bursts (docs/health.md "Your policy"): the records of one XID on one GPU less than this far apart are
# one burst, one fault (a fault prints a line per SM or channel within milliseconds; a job torn down
# logs its 43s and 45s within seconds). Kept, with their kernel times, for the XIDs a repeat rule
# counts (a judge's ``timed``), at most MAX_BURSTS per sighting (the newest).
BURST_GAP_USEC = 10_000_000
MAX_BURSTS = 256

# How much a sighting matters, for what is kept when the bounds are reached (a judge passes its
# own rank: gpu_tune.judge.checks.catalog.sighting_rank): fatal ones are always kept (within
# bounds a real node cannot reach), then the ones to name in a warning, then the rest.
OTHER, NOTED, FATAL = 0, 1, 2
Rank = Callable[[str, int, str, "str | None"], int]  # (kind, code, text after the code, SXid's word)

_HEX = "[0-9a-fA-F]"
_BUS = f"{_HEX}{{4,8}}:{_HEX}{{2}}:{_HEX}{{2}}"
_UUID = f"GPU-{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}"
# The driver's record forms, matched at the start of the message (after the prefixes of the three
# source forms, which gpu_tune.host.kmsg takes off), never anywhere in a record; numbers in ASCII
# digits only. The XID lines (open-gpu-kernel-modules kernel_rc.c), and older drivers' without "PCI:":
#   NVRM: Xid (PCI:0000:1b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
#   NVRM: Xid (PCI:0000:1b:00 GPU-I:01 GPU-CI:00): 31, pid=1234, name=python, ...   (MIG)
#   NVRM: Xid (0000:03:00): 14, Channel 00000001
# The address is domain:bus:device (no function).
XID_RE = re.compile(rf"NVRM: Xid \((?:PCI:)?(?P<bus>{_BUS})(?:\.[0-7])?(?: GPU-I:[0-9]+)?(?: GPU-CI:[0-9]+)?\): "
                    r"(?P<code>[0-9]{1,10})(?:,[ \t]*(?P<rest>[^\n]*)|[ \t]*(?:\n|$))", re.ASCII)
# A GPU lost without an Xid line, counted as XID 79 (NVIDIA treats it as 79), one line:
#   NVRM: GPU 0000:b3:00.0: GPU has fallen off the bus.
#   NVRM: GPU at PCI:0000:b3:00: GPU-5f2a0c4e-...: has fallen off the bus   (and without "PCI:")
FALLEN_RE = re.compile(rf"NVRM: GPU (?:at )?(?:PCI:)?(?P<bus>(?:{_HEX}{{4,8}}:)?{_HEX}{{2}}:{_HEX}{{2}})(?:\.[0-7])?:? "
                       rf"(?:{_UUID}:? )?(?:GPU )?(?:has )?fallen off the bus", re.ASCII)
# ... or at probe time, one record of three lines (drivers 525 to 570, nv.c):
#   NVRM: The NVIDIA GPU 0000:b3:00.0
#   NVRM: (PCI ID: 10de:26b5) installed in this system has
#   NVRM: fallen off the bus and is not responding to commands.
# /dev/kmsg gives it as one message; syslog(2) and dmesg as three lines of one record, the third
# one read with the first as its head.
FALLEN_HEAD_RE = re.compile(rf"NVRM: The NVIDIA GPU (?P<bus>{_BUS})(?:\.[0-7])?[ \t]*(?:\n|$)", re.ASCII)
FALLEN_TAIL = "NVRM: fallen off the bus and is not responding to commands"
FALLEN3_RE = re.compile(FALLEN_HEAD_RE.pattern + r"(?:NVRM: [^\n]*\n)?" + FALLEN_TAIL, re.ASCII)
# nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error
# One event prints several records (the headline with Fatal/Non-fatal, then Severity ..., Data {...}):
# only the headline is counted.
SXID_RE = re.compile(rf"(?P<dev>nvidia-nvswitch[0-9]*): SXid \((?:PCI:)?(?P<bus>{_BUS}(?:\.[0-7])?)\): "
                     r"(?P<code>[0-9]{1,10}), (?P<sev>Non-fatal|Fatal),?[ \t]*(?P<rest>[^\n]*)", re.ASCII)
SXID_ANY = re.compile(r"nvidia-nvswitch[0-9]*: SXid \(", re.ASCII)
# how the driver's records start: one that starts so and does not parse is malformed; text naming
# an XID anywhere else is not the driver's record
DRIVER_RE = re.compile(r"NVRM: |nvidia-nvswitch[0-9]*: ", re.ASCII)
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
    message: str  # the text after the code of the worst record (by rank; the first of equals)
    severity_word: str | None = None  # an SXid's own "Fatal" / "Non-fatal"
    device: str | None = None  # an SXid's "nvidia-nvswitchN"
    rank: int = FATAL  # OTHER, NOTED or FATAL, as the reader's rank said
    # for an XID a repeat rule counts: its bursts, (first usec, last usec, records), oldest first
    bursts: tuple[tuple[int, int, int], ...] = ()

    def key(self) -> tuple[str, str, int]:
        return (self.kind, self.bus, self.code)


@dataclass(frozen=True)
class KernelLogStatus:
    """What reading the kernel log for XIDs went through (one read; the health monitor sums the
    reads of one boot)."""

    source: str
    error: str | None = None
    scanned: int = 0
    lost: int = 0
    cut: int = 0
    malformed: int = 0  # records in the driver's form that do not parse
    dropped: int = 0  # sightings not fatal beyond MAX_SIGHTINGS (counted, not kept)
    notes: tuple[str, ...] = ()
    foreign: int = 0  # records naming an XID that the kernel did not write (facility not 0): ignored
    embedded: int = 0  # XID text inside another record (not the driver's record form): ignored
    dropped_fatal: int = 0  # fatal sightings beyond MAX_FATAL_PER_BUS / MAX_FATAL_BUSES
    skipped: int = 0  # older lines not read, the newest were (a log larger than one read takes)
    skipped_bytes: int = 0
    incomplete: bool = False  # the read stopped before the log's end (its time bound): the rest next read

    def plus(self, earlier: "KernelLogStatus") -> "KernelLogStatus":
        """This read's status with an earlier read's counts added (source, error and notes: this
        read's)."""
        counts = ("scanned", "lost", "cut", "malformed", "dropped", "foreign", "embedded", "dropped_fatal",
                  "skipped", "skipped_bytes")
        return replace(self, **{k: getattr(self, k) + getattr(earlier, k) for k in counts})


def _device(bus: str) -> str:
    """``0000:1b:00.0`` -> ``0000:1b:00`` (an XID names no function)."""
    bus = bus.lower()
    return bus.rsplit(".", 1)[0] if bus.count(":") == 2 and "." in bus.rsplit(":", 1)[1] else bus


def _bus(bus: str) -> str:
    bus = bus.lower()
    return bus if bus.count(":") == 2 else f"0000:{bus}"


def parse_kernel_line(message: str, head: str | None = None
                      ) -> tuple[str, str, int, str, str | None, str | None] | None:
    """(kind, bus, code, rest, severity word, device) of a record in one of the driver's forms;
    None otherwise. ``head``: the first line of the record this line continues (a syslog(2) or
    dmesg line after the first of its record), None when the line starts its record."""
    if head is not None:  # a later line of a record: only the three-line "fallen off the bus"
        m = FALLEN_HEAD_RE.match(head)
        if m and message.startswith(FALLEN_TAIL):
            return "xid", _bus(m.group("bus")), 79, "GPU has fallen off the bus (at probe time)", None, None
        if not DRIVER_RE.match(head):
            return None
    m = XID_RE.match(message)
    if m:
        return "xid", m.group("bus").lower(), int(m.group("code")), (m.group("rest") or "").strip(), None, None
    m = SXID_RE.match(message)
    if m:
        return ("sxid", m.group("bus").lower(), int(m.group("code")), m.group("rest").strip(), m.group("sev"),
                m.group("dev"))
    m = FALLEN_RE.match(message) or FALLEN3_RE.match(message)
    if m:
        at_probe = " (at probe time)" if m.re is FALLEN3_RE else ""
        return "xid", _bus(m.group("bus")), 79, "GPU has fallen off the bus" + at_probe, None, None
    return None


def is_sxid_detail(message: str) -> bool:
    """The second and later records of one SXid event (Severity ..., Data {...}): not an event."""
    return bool(SXID_ANY.match(message)) and SXID_RE.match(message) is None


def merge_burst(bursts: list[list[int]], start: int, end: int, n: int = 1, gap: int = BURST_GAP_USEC) -> None:
    """Put the span ``[start, end]`` (``n`` records) into ``bursts`` (``[first, last, records]``
    lists, sorted, each more than ``gap`` from the next), merging the ones it comes within ``gap``
    of. Putting a span in again changes no span: a log read twice gives the same bursts."""
    i = bisect.bisect_left(bursts, [start])
    lo = i - 1 if i > 0 and bursts[i - 1][1] + gap >= start else i
    hi = i
    while hi < len(bursts) and bursts[hi][0] - gap <= end:
        hi += 1
    if lo == hi:
        bursts.insert(i, [start, end, n])
        return
    near = bursts[lo:hi]
    bursts[lo:hi] = [[min(start, near[0][0]), max(end, max(b[1] for b in near)), n + sum(b[2] for b in near)]]


def keep_all(kind: str, code: int, rest: str, severity_word: str | None) -> int:
    """The rank without a catalog: every sighting may be fatal, except what says it is not
    (an SXid's ``Non-fatal``, an NVLink5 XID's ``Nonfatal``)."""
    words = rest.split()
    if severity_word == "Non-fatal" or "Nonfatal" in words or "Non-fatal" in words:
        return OTHER
    return FATAL


class Sightings:
    """The sightings of one read, bounded: a fatal one is always kept (at most
    :data:`MAX_FATAL_PER_BUS` codes per address and :data:`MAX_FATAL_BUSES` addresses besides the
    node's own GPUs, which a real node never reaches); the others up to :data:`MAX_SIGHTINGS`
    (:data:`MAX_NOTED` of those to name in a warning). A sighting seen again keeps its worst
    record's text: the rank decides, never the order of the records."""

    def __init__(self, rank: Rank | None = None, own_buses: Iterable[str] = (),
                 timed: Callable[[str, int], bool] | None = None) -> None:
        self.rank = rank or keep_all
        self.timed = timed  # the codes whose bursts are kept (a repeat rule counts them)
        self.own = {_device(b) for b in own_buses}
        self.items: dict[tuple[str, str, int], dict[str, Any]] = {}
        self.fatal_codes: dict[str, int] = {}  # address -> fatal codes kept
        self.kept = {OTHER: 0, NOTED: 0}
        self.dropped = self.dropped_fatal = 0

    def _room(self, bus: str, rank: int, timed: bool = False) -> bool:
        if timed and _device(bus) in self.own:
            return True  # a node's own GPU's record that a repeat rule counts: kept, as a fatal one is
        if rank >= FATAL:
            n = self.fatal_codes.get(bus, 0)
            if n >= MAX_FATAL_PER_BUS or (n == 0 and _device(bus) not in self.own
                                          and len(self.fatal_codes) >= MAX_FATAL_BUSES):
                self.dropped_fatal += 1
                return False
            self.fatal_codes[bus] = n + 1
            return True
        if self.kept[OTHER] + self.kept[NOTED] >= MAX_SIGHTINGS or (rank == NOTED and self.kept[NOTED] >= MAX_NOTED):
            self.dropped += 1
            return False
        self.kept[rank] += 1
        return True

    def add(self, kind: str, bus: str, code: int, rest: str, sev: str | None, dev: str | None,
            rec: KernelRecord) -> None:
        key = (kind, bus, code)
        s = self.items.get(key)
        if s is None:
            rank = max(OTHER, min(FATAL, int(self.rank(kind, code, rest, sev))))
            timed = self.timed is not None and kind == "xid" and self.timed(kind, code)
            if self._room(bus, rank, timed):
                self.items[key] = {"count": 1, "first_usec": rec.usec, "last_usec": rec.usec,
                                   "message": rest[:MAX_MESSAGE], "severity_word": sev, "device": dev, "rank": rank,
                                   "bursts": ([] if rec.usec is None else [[rec.usec, rec.usec, 1]]) if timed else None}
            return
        s["count"] += 1
        u = rec.usec
        if s["bursts"] is not None and u is not None:
            merge_burst(s["bursts"], u, u)
            if len(s["bursts"]) > MAX_BURSTS:
                del s["bursts"][0]
        if u is not None:
            if s["first_usec"] is None or u < s["first_usec"]:
                s["first_usec"] = u
            if s["last_usec"] is None or u > s["last_usec"]:
                s["last_usec"] = u
        if s["rank"] >= FATAL:
            return  # nothing worse to find
        rank = max(OTHER, min(FATAL, int(self.rank(kind, code, rest, sev))))
        if rank > s["rank"]:  # the worst record speaks for the sighting (NVLink5: any Fatal makes it fatal)
            if rank >= FATAL:
                self.kept[s["rank"]] -= 1
                self.fatal_codes[bus] = self.fatal_codes.get(bus, 0) + 1
            else:
                self.kept[s["rank"]] -= 1
                self.kept[rank] += 1
            s.update(message=rest[:MAX_MESSAGE], severity_word=sev, rank=rank)

    def sightings(self) -> tuple[XidSighting, ...]:
        return tuple(XidSighting(kind=k[0], bus=k[1], code=k[2], **{**v, "bursts": tuple(map(tuple, v["bursts"] or ()))})
                     for k, v in self.items.items())


def read_kernel_xids(log: KernelLog, rank: Rank | None = None, own_buses: Iterable[str] = (),
                     timed: Callable[[str, int], bool] | None = None
                     ) -> tuple[tuple[XidSighting, ...], KernelLogStatus]:
    """The XID and SXid sightings among the kernel's records that ``log`` has not handed out yet.
    ``rank`` says how much each matters (:func:`keep_all` without one); ``own_buses``: the node's
    GPUs, whose fatal sightings are kept whatever else the log holds; ``timed``: the XIDs whose
    bursts are kept (with their kernel times), those of the node's own GPUs whatever else the log
    holds."""
    stats = ReadStats()
    table = Sightings(rank, own_buses, timed)
    malformed = embedded = 0
    add, xid = table.add, XID_RE.match
    for rec in log.read(WANT, stats, kernel_only=True):
        m = xid(rec.message) if rec.head is None else None
        if m is not None:  # the common case, without a call more
            add("xid", m.group("bus").lower(), int(m.group("code")), (m.group("rest") or "").strip(), None, None, rec)
            continue
        parsed = parse_kernel_line(rec.message, rec.head)
        if parsed is None:
            if rec.head is None and DRIVER_RE.match(rec.message):
                malformed += not is_sxid_detail(rec.message)
            elif rec.head is None or not DRIVER_RE.match(rec.head):
                embedded += 1  # XID text inside another record: not the driver's
            continue
        add(*parsed, rec)
    notes = list(stats.notes)
    status = KernelLogStatus(source=stats.source, error=stats.error, scanned=stats.scanned, lost=stats.lost,
                             cut=stats.cut, malformed=malformed, dropped=table.dropped, notes=tuple(notes),
                             foreign=stats.foreign, embedded=embedded, dropped_fatal=table.dropped_fatal,
                             skipped=stats.skipped_records, skipped_bytes=stats.skipped_bytes,
                             incomplete=stats.more)
    return table.sightings(), status
