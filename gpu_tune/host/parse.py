"""Pure parsers for the kernel's file formats. Text in, plain data out; no I/O here."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from gpu_tune.host.numbers import MAX_DIGITS, Unreadable, shown, uint, uint_or_none


class ParseError(ValueError):
    pass


# -- CPU lists: "0-3,8,10-11" ---------------------------------------------------------------
# The kernel's own ceiling: NR_CPUS is at most 8192 (CONFIG_NR_CPUS_RANGE_END), so no CPU id is
# above 8191. Checked on every number before a range is expanded, so a list such as
# "0-4000000000" is refused in microseconds instead of allocating billions of ints.
MAX_CPU = 8191


def _cpu_id(text: str, what: str = "CPU") -> int:
    t = text.strip()
    if not t or not (t.isascii() and t.isdigit()):
        raise ParseError(f"bad {what} {text!r} in a CPU list")
    if len(t) > 5 or int(t) > MAX_CPU:
        raise ParseError(f"{what} {t} is above the kernel's largest CPU id {MAX_CPU}")
    return int(t)


def parse_cpulist(text: str) -> frozenset[int]:
    """Parse a kernel CPU list (``0-3,8,10-11``, ``0-15:2`` strides, empty string).

    Every id must be 0..:data:`MAX_CPU`; anything else is a :class:`ParseError`.
    """
    out: set[int] = set()
    text = text.strip()
    if not text:
        return frozenset()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        stride = 1
        if ":" in part:
            part, s = part.split(":", 1)
            if "/" in s:  # "0-15:2/4" group form: take the stride only
                s = s.split("/", 1)[0]
            stride = _cpu_id(s, "stride")
            if stride < 1:
                raise ParseError(f"bad stride {s!r} in a CPU list")
        if "-" in part:
            a, b = part.split("-", 1)
            lo, hi = _cpu_id(a), _cpu_id(b)
            if hi < lo:
                raise ParseError(f"bad CPU range {part!r}")
            out.update(range(lo, hi + 1, stride))
        else:
            out.add(_cpu_id(part))
    return frozenset(out)


def format_cpulist(cpus) -> str:
    """Format CPUs as the kernel does: ``0-3,8,10-11``."""
    nums = sorted(set(cpus))
    if not nums:
        return ""
    parts: list[str] = []
    start = prev = nums[0]
    for n in nums[1:]:
        if n == prev + 1:
            prev = n
            continue
        parts.append(f"{start}-{prev}" if prev != start else str(start))
        start = prev = n
    parts.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(parts)


def nesting(data, depth_limit: int, node_limit: int) -> tuple[int, int]:
    """(depth, values) of parsed JSON/YAML data, walked iteratively (never a RecursionError)
    and stopping past either limit (YAML aliases can make a small file repeat a value billions
    of times)."""
    deepest = nodes = 0
    stack = [(data, 1)]
    while stack:
        node, d = stack.pop()
        nodes += 1
        if nodes > node_limit:
            break
        if not isinstance(node, (dict, list)):
            continue
        deepest = max(deepest, d)
        if deepest > depth_limit:
            break
        stack.extend((v, d + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest, nodes


# -- CPU masks: "ffffffff,00000000,0000000f" ----------------------------------------------
def parse_cpumask(text: str) -> frozenset[int]:
    """Parse a hex CPU mask in the kernel's comma-separated 32-bit groups."""
    hexstr = text.strip().replace(",", "").lstrip("0")
    if not hexstr:
        return frozenset()
    if len(hexstr) > (MAX_CPU + 1) // 4:
        raise ParseError(f"CPU mask {text.strip()[:40]!r}... sets a CPU above the kernel's largest CPU id {MAX_CPU}")
    try:
        value = int(hexstr, 16)
    except ValueError:
        raise ParseError(f"bad CPU mask {text.strip()!r}") from None
    out = set()
    bit = 0
    while value:
        if value & 1:
            out.add(bit)
        value >>= 1
        bit += 1
    return frozenset(out)


def format_cpumask(cpus, ncpus: int | None = None) -> str:
    value = 0
    for c in cpus:
        value |= 1 << c
    width = max((ncpus or (max(cpus, default=0) + 1)), 1)
    groups = (width + 31) // 32
    hexstr = f"{value:0{groups * 8}x}"
    return ",".join(hexstr[i:i + 8] for i in range(0, len(hexstr), 8))


# -- "always [madvise] never" -----------------------------------------------------------------
@dataclass(frozen=True)
class Choice:
    active: str | None
    options: tuple[str, ...]


def parse_bracketed(text: str) -> Choice:
    """``always [madvise] never`` -> active madvise; a bare ``never`` (after a write) -> never."""
    words = text.split()
    active = None
    options = []
    for w in words:
        if w.startswith("[") and w.endswith("]"):
            w = w[1:-1]
            active = w
        options.append(w)
    if active is None and len(options) == 1:
        active = options[0]
    return Choice(active, tuple(options))


# -- /proc/cmdline ----------------------------------------------------------------------------
def parse_cmdline(text: str) -> dict[str, str]:
    """Kernel command line to {key: value}; flags without ``=`` map to ``""``. Last one wins."""
    out: dict[str, str] = {}
    for tok in text.split():
        if "=" in tok:
            k, v = tok.split("=", 1)
            out[k] = v.strip('"')
        else:
            out[tok] = ""
    return out


# -- /proc/interrupts ---------------------------------------------------------------------------
@dataclass(frozen=True)
class IrqLine:
    irq: str
    total: int
    chip: str
    name: str
    # Every handler ("action") named on the line: a shared line lists them comma-separated
    # ("uhci_hcd:usb1, virtio2"); a virtio device's queues are "virtio2-input.0", ...
    names: tuple[str, ...] = ()


def parse_interrupts(text: str | Iterable[str]) -> dict[str, IrqLine]:
    """Parse /proc/interrupts (any number of CPU columns) into {irq: IrqLine}: the whole text,
    or its lines (the header first; a caller may leave out the lines it does not want, as
    :meth:`gpu_tune.host.fs.HostFS.read_lines` does while reading).

    Only the first line's column count is used to split counts from the description, so a
    224-column file costs one split per line.
    """
    lines = iter(text.splitlines() if isinstance(text, str) else text)
    header = next(lines, None)
    if header is None:
        return {}
    ncols = len(header.split())
    out: dict[str, IrqLine] = {}
    for line in lines:
        fields = line.split()
        if not fields or not fields[0].endswith(":"):
            continue
        irq = fields[0][:-1]
        counts = fields[1:1 + ncols]
        total = 0
        n = 0
        for c in counts:
            count = uint_or_none(c)
            if count is None:
                break
            total += count
            n += 1
        rest = fields[1 + n:]
        chip = rest[0] if rest else ""
        name = rest[-1] if len(rest) > 1 else ""
        # the handler names end the line; after the chip comes at least the hwirq/type word
        names: list[str] = []
        for tok in reversed(rest[2:]):
            if names and not tok.endswith(","):
                break
            names.append(tok.rstrip(","))
        out[irq] = IrqLine(irq, total, chip, name, tuple(reversed(names)))
    return out


def irqs_named(lines: dict[str, IrqLine], device: str) -> list[int]:
    """The IRQs whose handler is ``device`` or one of its queues (``device-...``), e.g. the
    ``virtio2``, ``virtio2-config``, ``virtio2-input.0`` lines of a virtio device."""
    prefix = device + "-"
    return sorted(int(ln.irq) for ln in lines.values() if uint_or_none(ln.irq) is not None
                  and any(n == device or n.startswith(prefix) for n in ln.names))


# -- PCIe link speed: "16.0 GT/s PCIe" -> gen 4 -------------------------------------------------
_GTS_TO_GEN = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6, 128.0: 7}
_SPEED_RE = re.compile(r"([0-9]{1,4}(?:\.[0-9]{1,3})?) ?GT/s(?: PCIe)?")
# what the kernel writes for a link it cannot tell the speed of (pci_speed_string)
_UNKNOWN_SPEED = ("Unknown", "Unknown speed")


def link_speed_gen(text: str | None) -> int | None:
    """PCIe generation from a sysfs link speed (``32.0 GT/s PCIe``; older kernels: ``5 GT/s``),
    strictly: None for no file or the kernel's ``Unknown``; :class:`~gpu_tune.host.numbers.Unreadable`
    for text the kernel does not write."""
    if text is None:
        return None
    t = text.strip()
    if t in _UNKNOWN_SPEED:
        return None
    m = _SPEED_RE.fullmatch(t)
    gen = _GTS_TO_GEN.get(float(m.group(1))) if m else None
    if gen is None:
        raise Unreadable(f"{shown(t)} is not a PCIe link speed")
    return gen


def link_width(text: str | None) -> int | None:
    """Lanes from a sysfs link width (``16``; some kernels ``x16``), strictly: 0 (no link) and a
    missing file are None; anything but 1-3 ASCII digits is :class:`~gpu_tune.host.numbers.Unreadable`."""
    if text is None:
        return None
    t = text.strip()
    n = uint(t[1:] if t.startswith("x") else t, max_digits=3, what="a PCIe link width")
    return n or None


def parse_link_speed(text: str | None) -> int | None:
    """:func:`link_speed_gen`, with text it cannot read as None (the topology's view)."""
    try:
        return link_speed_gen(text)
    except Unreadable:
        return None


def parse_link_width(text: str | None) -> int | None:
    """:func:`link_width`, with text it cannot read as None (the topology's view)."""
    try:
        return link_width(text)
    except Unreadable:
        return None


# -- meminfo ------------------------------------------------------------------------------------
def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo or nodeN/meminfo to {key: kB}."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        if ":" not in line:
            continue
        k, v = line.split(":", 1)
        k = k.split()[-1]  # "Node 0 MemTotal" -> "MemTotal"
        num = v.split()
        value = uint_or_none(num[0]) if num else None
        if value is not None:
            out[k] = value
    return out


def parse_int(text: str | None, default: int | None = None) -> int | None:
    """An integer as the kernel writes one (``-1``, ``0x10de``); ``default`` for anything else,
    digits that are not ASCII (``int()`` reads ``'٧'`` as 7) and overlong ones included."""
    if text is None:
        return default
    t = text.strip()
    if not t.isascii() or len(t) > 2 + MAX_DIGITS:
        return default
    try:
        return int(t, 0)
    except ValueError:
        return default


# -- /proc/<pid>/limits --------------------------------------------------------------------------
@dataclass(frozen=True)
class Rlimit:
    soft: int | None  # None: unlimited
    hard: int | None
    units: str


_LIMIT_RE = re.compile(r"^(Max [a-z ]+?)\s{2,}(\S+)\s+(\S+)\s*(\S*)\s*$")


def parse_limits(text: str) -> dict[str, Rlimit]:
    """``/proc/<pid>/limits`` -> {"Max locked memory": Rlimit(soft, hard, "bytes"), ...};
    ``unlimited`` is None. Lines that do not parse are skipped."""
    out: dict[str, Rlimit] = {}
    for line in text.splitlines():
        m = _LIMIT_RE.match(line)
        if not m:
            continue
        name, soft, hard, units = m.groups()

        def val(v: str) -> int | None:
            if v == "unlimited":
                return None
            n = uint_or_none(v)
            return -1 if n is None else n

        s, h = val(soft), val(hard)
        if s == -1 or h == -1:
            continue
        out[name] = Rlimit(s, h, units)
    return out


def normalize_bus_id(bus_id: str) -> str:
    """NVML's ``00000000:18:00.0`` (or ``0000:18:00.0``, any case) -> sysfs ``0000:18:00.0``."""
    s = bus_id.strip().lower()
    parts = s.split(":")
    if len(parts) == 3:
        dom = parts[0][-4:].rjust(4, "0")
        return f"{dom}:{parts[1].rjust(2, '0')}:{parts[2]}"
    if len(parts) == 2:  # "18:00.0" without a domain
        return f"0000:{parts[0].rjust(2, '0')}:{parts[1]}"
    return s
