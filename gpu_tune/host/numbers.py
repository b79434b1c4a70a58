"""One strict reader for the numbers the kernel writes in sysfs and procfs (and for numbers a
person types, such as ``gpu-tune set-healthy --gpu 3``), as :mod:`gpu_tune.strict` is for profiles.

The kernel writes counters, widths and ids as plain ASCII decimal digits (``%u``, ``%llu``): a
u64 has at most 20 of them. Anything else is not the kernel's: ``²`` and ``٧٩`` (Python's
``isdigit()`` says yes, ``int()`` then fails or reads another number), 5,000 digits (``int()``
refuses more than 4,300), ``inf`` and ``nan`` (``float()`` takes them), signs, exponents, blanks
inside. Such a value is :class:`Unreadable`, and a reader turns it into the finding
``unreadable: <path> (<why>)``: never a crash, never a number taken for what it is not, never a
pass. Each check that reads the value says what an unreadable one means for it.
"""

from __future__ import annotations

import errno
import re
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

from gpu_tune.errors import HostError, NotAFile

MAX_DIGITS = 20  # 2**64 - 1 is 18446744073709551615
MAX_SHOWN = 24
_UINT = re.compile(r"[0-9]{1,%d}" % MAX_DIGITS)
# /proc/uptime: "86400.25 1382400.00" (seconds with two decimals); at most 9 decimals accepted
_SECONDS = re.compile(r"([0-9]{1,%d})(?:\.([0-9]{1,9}))?" % 12)

T = TypeVar("T")


class Unreadable(ValueError):
    """A value that is not a number the kernel writes; the message says why, in a few words."""


def shown(text: str) -> str:
    """``text`` for a message: at most :data:`MAX_SHOWN` characters, control and non-ASCII
    characters escaped (``'\\x1b[2J'``), so a hostile value never reaches a terminal raw."""
    cut = text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."
    return ascii(cut)


def uint(text: str | None, *, max_digits: int = MAX_DIGITS, what: str = "a count") -> int:
    """A non-negative decimal integer of ASCII digits (surrounding white space allowed, as the
    kernel ends its files with a newline); :class:`Unreadable` for anything else."""
    if text is None:
        raise Unreadable("empty")
    t = text.strip()
    if not t:
        raise Unreadable("empty")
    if len(t) > max_digits or not _UINT.fullmatch(t):
        if t.isascii() and t.isdigit():
            raise Unreadable(f"{len(t)} digits, more than the {max_digits} {what} may have")
        raise Unreadable(f"{shown(t)} is not {what}")
    return int(t)


def uint_or_none(text: str | None, *, max_digits: int = MAX_DIGITS) -> int | None:
    """:func:`uint`, or None where it raises (for callers that skip what they cannot read)."""
    try:
        return uint(text, max_digits=max_digits)
    except Unreadable:
        return None


def seconds(text: str | None) -> float:
    """Seconds as /proc/uptime writes them (``86400.25``): ASCII digits, an optional decimal
    part; ``inf``, ``nan``, exponents and signs are :class:`Unreadable`."""
    t = (text or "").strip()
    m = _SECONDS.fullmatch(t)
    if m is None:
        raise Unreadable(f"{shown(t)} is not a number of seconds" if t else "empty")
    return int(m.group(1)) + (int(m.group(2)) / 10 ** len(m.group(2)) if m.group(2) else 0.0)


def uptime_usec(text: str | None) -> int:
    """Microseconds since boot from /proc/uptime's text (its first field)."""
    first = (text or "").split(None, 1)
    return int(round(seconds(first[0] if first else "") * 1_000_000))


@dataclass(frozen=True)
class Reading(Generic[T]):
    """One value read from a host file: ``value`` (None when absent or unreadable) and, when the
    file is there but its value cannot be used, ``problem`` (``unreadable: <path> (<why>)``)."""

    value: T | None = None
    problem: str | None = None


def read_value(fs: Any, path: str, parse: Callable[[str], T], *, limit: int = 4096) -> Reading[T]:
    """``parse`` over the text of ``path`` under ``fs`` (a HostFS). A missing file reads as
    nothing (``Reading()``); a file that cannot be read (a FIFO, too large, EIO, EACCES) or whose
    text ``parse`` refuses is a problem naming it."""
    try:
        text = fs.read_text(path, limit=limit)
    except NotAFile as exc:
        return Reading(problem=f"unreadable: {path} ({_why(exc, path)})")
    except HostError as exc:
        if getattr(exc, "errno", None) in (errno.ENOENT, errno.ENOTDIR):
            return Reading()
        return Reading(problem=f"unreadable: {path} ({_why(exc, path)})")
    try:
        return Reading(value=parse(text))
    except Unreadable as exc:
        return Reading(problem=f"unreadable: {path} ({exc})")


def _why(exc: Exception, path: str) -> str:
    text = str(exc)
    if text.startswith(path + ": "):
        text = text[len(path) + 2:]
    return text.split(": not read")[0][:160]
