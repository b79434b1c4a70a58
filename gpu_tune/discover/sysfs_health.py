"""The host's own health files in sysfs and procfs, read strictly and within bounds (docs/health.md):

- ``/sys/class/infiniband/DEV/ports/N/{state,phys_state,rate,link_layer,counters/link_downed}``;
- ``/sys/bus/pci/devices/BDF/aer_dev_{correctable,nonfatal,fatal}`` of every GPU (``TOTAL_ERR_*``);
- ``/sys/bus/pci/devices/BDF/{current,max}_link_{speed,width}`` of every GPU;
- ``/proc/sys/kernel/random/boot_id`` and ``/proc/uptime``.

Every number goes through :mod:`gpu_tune.host.numbers`: a value the kernel does not write is the
finding ``unreadable: <path> (<why>)`` of the reading it belongs to, never a crash and never a
healthy default. A file that is not there is "not reported" (no AER on this kernel, a VM without
link files), which is not the same thing.

InfiniBand, bounded: a node with SR-IOV has a device per virtual function (8 HCAs x 64 VFs is 520
RDMA devices), and an HCA in switchdev mode numbers a port per representor (thousands, past 999).
The ports read first are the ones a profile names (``mlx5_1/4096`` before the rest of ``mlx5_1``),
then the rest of the devices it names, then every physical function's; a virtual function's ports
are not the node's links and are read only when named. At most :data:`MAX_IB_DEVICES` names are
looked at and :data:`MAX_IB_PORTS` ports read per pass; what is left out is said
(:attr:`IbReading.not_read`, and which named ports it holds: :attr:`IbReading.unread_named`), never
dropped silently: a device whose ports cannot be listed counts as not read, and entries that are
no port number are named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

from gpu_tune.errors import HostError
from gpu_tune.host.numbers import Reading, Unreadable, read_value, shown, uint, uint_or_none, uptime_usec
from gpu_tune.host.parse import link_speed_gen, link_width

PCI_DIR = "/sys/bus/pci/devices"
IB_DIR = "/sys/class/infiniband"
BOOT_ID = "/proc/sys/kernel/random/boot_id"
UPTIME = "/proc/uptime"
MAX_IB_DEVICES = 4096  # names in /sys/class/infiniband looked at per pass
MAX_IB_PORTS = 1024  # ports read per pass (a port is five small files)
MAX_PORT_NUMBER_DIGITS = 10  # the kernel numbers RDMA ports with a u32 (a switchdev HCA: thousands)
MAX_PORT_NUMBER = 2**32 - 1
BOOT_ID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")

# "4: ACTIVE", "5: LinkUp", "7: Phy Test"; older kernels and fixtures: the bare word
_STATE_RE = re.compile(r"(?:[0-9]{1,2}: ?)?([A-Za-z<>_][A-Za-z<>_ ]{0,31})")
# "400 Gb/sec (4X NDR)", "2.5 Gb/sec (1X SDR)", "53.125 Gb/sec (1X HDR)"
_RATE_RE = re.compile(r"([0-9]{1,6}(?:\.[0-9]{1,3})?) Gb/sec(?: \([ -~]{0,32}\))?")
LINK_LAYERS = ("InfiniBand", "Ethernet", "Unknown")


@dataclass(frozen=True)
class AerCounts:
    """``TOTAL_ERR_COR`` / ``TOTAL_ERR_NONFATAL`` / ``TOTAL_ERR_FATAL`` since the device was found;
    ``problems``: (kind, ``unreadable: <path> (...)``) for a file that is there but not readable."""

    correctable: int | None = None
    nonfatal: int | None = None
    fatal: int | None = None
    problems: tuple[tuple[str, str], ...] = ()

    def problem(self, kind: str) -> str | None:
        return next((p for k, p in self.problems if k == kind), None)


@dataclass(frozen=True)
class IbPort:
    device: str  # mlx5_0
    port: int
    state: str | None  # "ACTIVE" (from "4: ACTIVE")
    phys_state: str | None  # "LinkUp" (from "5: LinkUp")
    rate_gbps: float | None  # 400.0 (from "400 Gb/sec (4X NDR)")
    link_layer: str | None  # "InfiniBand" | "Ethernet"
    link_downed: int | None = None  # counters/link_downed: times the link went down
    unreadable: tuple[str, ...] = ()  # state, phys_state, rate (while up), link_layer: "unreadable: <path> (...)"
    downed_problem: str | None = None  # counters/link_downed unreadable
    virtual: bool = False  # an SR-IOV virtual function's port (read because a profile names it)

    @property
    def name(self) -> str:
        return f"{self.device}/{self.port}"

    @property
    def up(self) -> bool:
        return (self.state or "").upper() == "ACTIVE" and (self.phys_state or "").lower() == "linkup"


@dataclass(frozen=True)
class IbReading:
    ports: tuple[IbPort, ...] = ()
    not_read: tuple[str, ...] = ()  # what was left out, in words
    unread_physical: int = 0  # physical functions' ports (or devices) left out by the bounds: not judged
    virtual_functions: int = 0  # SR-IOV virtual functions seen and not read (not named)
    errors: tuple[str, ...] = ()
    unread_named: tuple[str, ...] = ()  # named ports ("mlx5_1/4096") or devices not (wholly) read


def natural_key(name: str) -> tuple[Any, ...]:
    """``mlx5_2`` before ``mlx5_10``: digits compare as numbers (bounded: at most 20 of them)."""
    return tuple((0, int(p), "") if p.isascii() and p.isdigit() and len(p) <= 20 else (1, 0, p)
                 for p in re.split(r"([0-9]+)", name))


def _word(text: str) -> str:
    m = _STATE_RE.fullmatch(text.strip())
    if m is None:
        raise Unreadable(f"{shown(text.strip())} is not a port state")
    return m.group(1).strip()


def _rate(text: str) -> float:
    m = _RATE_RE.fullmatch(text.strip())
    if m is None:
        raise Unreadable(f"{shown(text.strip())} is not a rate")
    return float(m.group(1))


def _layer(text: str) -> str:
    t = text.strip()
    if t not in LINK_LAYERS:
        raise Unreadable(f"{shown(t)} is not a link layer")
    return t


def read_ib_port(fs: Any, dev: str, port: int, *, virtual: bool = False) -> IbPort:
    base = f"{IB_DIR}/{dev}/ports/{port}"
    state = read_value(fs, f"{base}/state", _word)
    phys = read_value(fs, f"{base}/phys_state", _word)
    rate = read_value(fs, f"{base}/rate", _rate)
    layer = read_value(fs, f"{base}/link_layer", _layer)
    downed = read_value(fs, f"{base}/counters/link_downed", uint)
    p = IbPort(device=dev, port=port, state=state.value, phys_state=phys.value, rate_gbps=rate.value,
               link_layer=layer.value, link_downed=downed.value, downed_problem=downed.problem, virtual=virtual)
    # a port that is down may have no rate to show (the kernel answers EINVAL): not a finding then
    problems = [r.problem for r in (state, phys, layer) if r.problem]
    if rate.problem and p.up:
        problems.append(rate.problem)
    if problems:
        from dataclasses import replace

        p = replace(p, unreadable=tuple(problems))
    return p


def _port_numbers(fs: Any, dev: str, not_read: list[str]) -> list[int] | None:
    """The port numbers under ``DEV/ports`` (the kernel's ``u32``), in order; None when the folder
    cannot be listed. What is there and is no port number is said in ``not_read``."""
    try:
        entries = fs.listdir(f"{IB_DIR}/{dev}/ports")
    except HostError as exc:
        not_read.append(f"{dev}: ports not listed ({exc})")
        return None
    if not entries:  # a device the kernel shows always has a port: this one cannot be judged
        not_read.append(f"{dev}: ports not listed (no port in {IB_DIR}/{dev}/ports)")
        return None
    numbers = sorted(n for n in (uint_or_none(e, max_digits=MAX_PORT_NUMBER_DIGITS) for e in entries)
                     if n is not None and n <= MAX_PORT_NUMBER)
    odd = len(entries) - len(numbers)
    if odd:
        not_read.append(f"{IB_DIR}/{dev}/ports: {odd:,} entr{'y' if odd == 1 else 'ies'} that are not port numbers")
    return numbers


def read_infiniband(fs: Any, named: Iterable[str] = ()) -> IbReading:
    """The RDMA ports under ``/sys/class/infiniband``: the ports a profile names (``mlx5_0/1``)
    first, then the rest of the devices it names (``mlx5_1``), then every physical function's,
    within the bounds above."""
    try:
        names = fs.listdir(IB_DIR)
    except HostError as exc:
        return IbReading(errors=(str(exc),))
    not_read: list[str] = []
    if len(names) > MAX_IB_DEVICES:
        not_read.append(f"{len(names) - MAX_IB_DEVICES:,} of {len(names):,} RDMA devices not looked at (at most "
                        f"{MAX_IB_DEVICES:,} per pass)")
    named_ports: dict[str, set[int]] = {}
    named_devs: set[str] = set()
    for n in named:
        dev, _, port = str(n).partition("/")
        number = uint_or_none(port, max_digits=MAX_PORT_NUMBER_DIGITS) if port else None
        if number is not None:
            named_ports.setdefault(dev, set()).add(number)
        else:
            named_devs.add(dev)
    all_named = named_devs | set(named_ports)
    looked = sorted(names, key=lambda n: (n not in all_named, natural_key(n)))[:MAX_IB_DEVICES]
    first, virtual = [], []
    for dev in looked:
        is_vf = fs.exists(f"{IB_DIR}/{dev}/device/physfn")
        if dev in all_named or not is_vf:
            first.append((dev, is_vf))
        else:
            virtual.append(dev)
    # the named devices first, the physical functions in natural order after them (sorted above)
    ports: dict[tuple[str, int], IbPort] = {}
    listed: dict[str, list[int] | None] = {}
    unread_ports = unread_devs = unlisted = 0
    unread_named: list[str] = []
    for dev, is_vf in first:  # the named ports first, whatever their number
        if dev in named_ports:
            listed[dev] = _port_numbers(fs, dev, not_read)
            if listed[dev] is None:
                unread_named += [f"{dev}/{n}" for n in sorted(named_ports[dev])]
            for n in sorted(named_ports[dev] & set(listed[dev] or ())):
                if len(ports) < MAX_IB_PORTS:
                    ports[(dev, n)] = read_ib_port(fs, dev, n, virtual=is_vf)
                else:
                    unread_named.append(f"{dev}/{n}")
    for dev, is_vf in first:
        if dev not in listed:
            if len(ports) >= MAX_IB_PORTS:
                unread_devs += 1
                unread_named += [dev] if dev in named_devs else []
                continue
            listed[dev] = _port_numbers(fs, dev, not_read)
        if listed[dev] is None:
            unlisted += 1  # its ports are unknown (said where it was listed): never a device with none
            unread_named += [dev] if dev in named_devs else []
            continue
        left = 0
        for n in listed[dev]:
            if (dev, n) in ports:
                continue
            if len(ports) >= MAX_IB_PORTS:
                left += 1
                continue
            ports[(dev, n)] = read_ib_port(fs, dev, n, virtual=is_vf)
        unread_ports += left
        if left and dev in named_devs:
            unread_named.append(dev)
    if unread_ports or unread_devs:
        not_read.append(f"{unread_ports:,} port(s) and {unread_devs:,} device(s) not read (at most "
                        f"{MAX_IB_PORTS:,} ports per pass)")
    if virtual:
        not_read.append(f"{len(virtual):,} SR-IOV virtual function(s) not read (their ports are not the node's links; "
                        "name one in readiness.expect.ib_ports to judge it)")
    return IbReading(ports=tuple(ports.values()), not_read=tuple(not_read),
                     unread_physical=unread_ports + unread_devs + unlisted,
                     virtual_functions=len(virtual), unread_named=tuple(unread_named))


def _total(name: str) -> Any:
    """The parser of an ``aer_dev_*`` file: its ``TOTAL_ERR_*`` line's count."""
    def parse(text: str) -> int:
        for line in text.splitlines():
            parts = line.split()
            if parts and parts[0] == name:
                if len(parts) != 2:
                    raise Unreadable(f"{name}: {shown(line.strip())} is not a count line")
                return uint(parts[1], what=f"a {name} count")
        raise Unreadable(f"no {name} line")
    return parse


def read_aer(fs: Any, bus: str) -> AerCounts | None:
    """A GPU's AER counters; None when the kernel has none for it (no file at all)."""
    base = f"{PCI_DIR}/{bus}"
    got = {kind: read_value(fs, f"{base}/aer_dev_{kind}", _total(total))
           for kind, total in (("correctable", "TOTAL_ERR_COR"), ("nonfatal", "TOTAL_ERR_NONFATAL"),
                               ("fatal", "TOTAL_ERR_FATAL"))}
    if all(r.value is None and r.problem is None for r in got.values()):
        return None
    return AerCounts(correctable=got["correctable"].value, nonfatal=got["nonfatal"].value, fatal=got["fatal"].value,
                     problems=tuple((k, r.problem) for k, r in got.items() if r.problem))


def read_pcie_link_problems(fs: Any, bus: str) -> tuple[str, ...]:
    """The GPU's PCIe link files that are there and hold what the kernel never writes (the
    topology reads the values; this says which ones it could not)."""
    base = f"{PCI_DIR}/{bus}"
    out = []
    for name, parse in (("current_link_speed", link_speed_gen), ("max_link_speed", link_speed_gen),
                        ("current_link_width", link_width), ("max_link_width", link_width)):
        r = read_value(fs, f"{base}/{name}", parse)
        if r.problem:
            out.append(r.problem)
    return tuple(out)


def _boot_id(text: str) -> str:
    t = text.strip()
    if not BOOT_ID_RE.fullmatch(t):
        raise Unreadable(f"{shown(t)} is not a boot id")
    return t


def read_boot_id(fs: Any) -> Reading[str]:
    """This boot's id; a value that is not the kernel's (a UUID) is unreadable, and so is none."""
    r = read_value(fs, BOOT_ID, _boot_id)
    if r.value is None and r.problem is None:
        return Reading(problem=f"unreadable: {BOOT_ID} (not there)")
    return r


def read_uptime_usec(fs: Any) -> Reading[int]:
    return read_value(fs, UPTIME, uptime_usec)
