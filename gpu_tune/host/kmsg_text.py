"""The kernel log's text: one record in each of the three forms it is read in, and which record
a line belongs to (for :mod:`gpu_tune.host.kmsg`, which reads it).

**Whose record.** A record's priority is ``facility * 8 + level``. The kernel's own records have
facility 0; a record written to ``/dev/kmsg`` from user space never has (the kernel gives it
``LOG_USER``, 1, unless the writer names another non-zero facility). With ``kernel_only``,
``KernelLog.read`` hands out facility-0 records only and counts the others
(``ReadStats.foreign``). A line without a priority (a fixture of plain ``dmesg`` text) is taken as
the kernel's: the device and ``syslog(2)`` always give one.

**One record, several lines.** A record may hold newlines (the NVIDIA driver's "fallen off the
bus" at probe time is one record of three lines). ``/dev/kmsg`` escapes them (``\\x0a``, undone
here); ``syslog(2)`` and ``dmesg -r`` repeat the record's prefix on each of its lines
(``<3>[ 1843.308145] ``); plain ``dmesg`` indents the lines after the first. A line that continues
a record carries the start of that record's first line in :attr:`KernelRecord.head`, so that a
line inside another driver's record (a USB product string holding a newline) is never taken for
a record of its own. Two records with the same priority in the same microsecond read as one in
``syslog(2)`` text: nothing in that text tells them apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

MAX_RECORD = 8192
KERNEL_FACILITY = 0
CONTEXT = 16  # lines looked back for the first line of a record that a line continues
_HEAD = 160  # characters of that first line kept in KernelRecord.head

# "6,1207,88310022,-;message" (/dev/kmsg), "<6>[   88.310022] message" (syslog(2), dmesg -r; with
# CONFIG_PRINTK_CALLER "<6>[   88.310022][    T1] message"), "[   88.310022] message" (dmesg).
# Figures are ASCII digits of bounded length (int() of thousands of digits raises).
KMSG_RE = re.compile(rb"([0-9]{1,20}),([0-9]{1,20}),([0-9]{1,20}),[^;\n]*;")
SYSLOG_RE = re.compile(rb"<([0-9]{1,20})>(?:\[ *([0-9]{1,20})\.([0-9]{1,9})\])?(?:\[ *[TC][0-9]{1,10}\])? ?")
_DMESG_RE = re.compile(rb"\[ *([0-9]{1,20})\.([0-9]{1,9})\](?:\[ *[TC][0-9]{1,10}\])? ?")
_DICT_RE = re.compile(rb" [A-Z0-9_]+=")  # /dev/kmsg's " SUBSYSTEM=pci" lines after a record
_ESC_RE = re.compile(rb"\\x([0-9a-f]{2})")
_INDENT = (b" ", b"\t")


class KernelRecord(NamedTuple):
    """One record (or one line of a record of several): ``seq`` and ``usec`` (microseconds since
    boot) where the source gives them; ``priority`` is ``facility * 8 + level`` (None where the
    line gives none); ``head``: the start of the first line of the record this line continues
    (``""`` when that line could not be found), None when the line starts its record. A tuple:
    one is made for every record that matches, a million per read at most."""

    seq: int | None
    usec: int | None
    message: str
    priority: int | None = None
    head: str | None = None

    @property
    def facility(self) -> int | None:
        return None if self.priority is None else self.priority >> 3

    @property
    def kernel(self) -> bool:
        """The kernel's own record (facility 0), or a line that does not say."""
        return self.priority is None or self.priority >> 3 == KERNEL_FACILITY


@dataclass
class ReadStats:
    """What one :meth:`KernelLog.read` went through."""

    source: str = ""
    scanned: int = 0  # records read (lines that start a record)
    lost: int = 0  # records overwritten before they could be read (EPIPE)
    cut: int = 0  # records longer than MAX_RECORD, cut
    foreign: int = 0  # matching records not from the kernel (facility not 0): not handed out
    skipped_bytes: int = 0  # of a fixture file larger than max_file_bytes, not read (the oldest)
    skipped_records: int = 0  # lines older than the newest max_records, not read
    more: bool = False  # stopped before the end (max_seconds): the rest is left for the next read
    error: str | None = None  # the log could not be read at all
    notes: list[str] = field(default_factory=list)


def _unescape(msg: bytes) -> bytes:
    """/dev/kmsg escapes newlines, other control bytes and "\\" as \\xNN: undone."""
    return _ESC_RE.sub(lambda e: bytes((int(e.group(1), 16),)), msg)


def usec_of(sec: bytes | None, frac: bytes | None) -> int | None:
    if sec is None or frac is None:
        return None
    return int(sec) * 1_000_000 + int(frac.ljust(6, b"0")[:6])


def fields(line: bytes) -> tuple[int | None, int | None, int | None, bytes, bytes]:
    """(priority, seq, usec, message, prefix) of one line in any of the three forms; ``prefix`` is
    a syslog(2) line's ``<N>[time]`` (repeated on each line of one record), else empty."""
    m = KMSG_RE.match(line)
    if m:
        msg = line[m.end():]
        if b"\\x" in msg:
            msg = _unescape(msg)
        return int(m.group(1)), int(m.group(2)), int(m.group(3)), msg, b""
    m = SYSLOG_RE.match(line)
    if m:
        return (int(m.group(1)), None, usec_of(m.group(2), m.group(3)), line[m.end():],
                m.group(0) if m.group(2) is not None else b"")
    m = _DMESG_RE.match(line)
    if m:
        return None, None, usec_of(m.group(1), m.group(2)), line[m.end():], b""
    return None, None, None, line.strip(), b""


def parse_record(line: bytes) -> KernelRecord:
    """One line alone, in kmsg's, syslog(2)'s (``dmesg -r``) or ``dmesg``'s format; any other line
    is a message without figures."""
    prio, seq, usec, msg, _ = fields(line)
    return KernelRecord(seq, usec, msg.decode("utf-8", "replace"), prio)


def _line_before(buf: bytes, s: int) -> int | None:
    """Where the line before the one starting at ``s`` starts (None at the start of ``buf``)."""
    if s <= 0:
        return None
    return buf.rfind(b"\n", 0, s - 1) + 1


def _record_start(buf: bytes, s: int, same) -> int | None:
    """The start of the first line of the record whose line starts at ``s``: walk back while the
    line before belongs to the same record (``same(line)``). None when the walk runs out of the
    lines kept before (the record's start is not known)."""
    cur = s
    for _ in range(CONTEXT):
        prev = _line_before(buf, cur)
        if prev is None:
            return cur
        if not same(buf[prev:cur - 1]):
            return cur
        cur = prev
    return None


def count_lines(buf: bytes, start: int = 0) -> int:
    """Lines in ``buf[start:]`` that start a record (continuation lines begin with a blank)."""
    n = buf.count(b"\n", start) - buf.count(b"\n ", start) - buf.count(b"\n\t", start) - buf.count(b"\n\n", start)
    return max(0, n - (1 if buf[start:start + 1] in _INDENT else 0))


def tail_lines(buf: bytes, n: int) -> bytes:
    """The last ``n`` complete lines of ``buf`` (kept as the context of the next block), at most
    ``n * MAX_RECORD`` bytes."""
    i = len(buf) - 1
    for _ in range(n):
        j = buf.rfind(b"\n", 0, i)
        if j < 0:
            i = -1
            break
        i = j
    tail = buf[i + 1:]
    if len(tail) > n * MAX_RECORD:
        tail = tail[-n * MAX_RECORD:]
        tail = tail[tail.find(b"\n") + 1:]
    return tail


def scan(buf: bytes, start: int, want: re.Pattern[bytes] | None, st: ReadStats,
         kernel_only: bool) -> Iterator[KernelRecord]:
    """The records among the complete lines of ``buf[start:]`` whose line matches ``want`` (every
    line when None); ``buf[:start]`` holds the lines before them (to find the record a line
    continues). Only matching lines are looked at one by one."""
    pos, n = start, len(buf)
    while pos < n:
        if want is None:
            s = pos
        else:
            m = want.search(buf, pos)
            if m is None:
                return
            nl = buf.rfind(b"\n", pos, m.start())
            s = nl + 1 if nl >= 0 else pos
        e = buf.find(b"\n", s)
        e = n if e < 0 else e
        pos = e + 1
        line = buf[s:e]
        if line[:1] in _INDENT and (_DICT_RE.match(line) or line.isspace()) or not line:
            continue
        if len(line) > MAX_RECORD:
            line, st.cut = line[:MAX_RECORD], st.cut + 1
        m = KMSG_RE.match(line)
        if m is None:
            rec = _record(buf, s, line, st, kernel_only)
            if rec is not None:
                yield rec
            continue
        prio = int(m.group(1))  # /dev/kmsg's form, the common one: no line before it matters
        if kernel_only and prio >> 3 != KERNEL_FACILITY:
            st.foreign += 1
            continue
        msg = line[m.end():]
        if b"\\x" in msg:
            msg = _unescape(msg)
        yield KernelRecord(int(m.group(2)), int(m.group(3)), msg.decode("utf-8", "replace"), prio)


def _record(buf: bytes, s: int, line: bytes, st: ReadStats, kernel_only: bool) -> KernelRecord | None:
    """The record of the line at ``s`` (None: not the kernel's, and ``kernel_only``)."""
    head: str | None = None
    if line[:1] in _INDENT:  # plain dmesg: a record's later lines are indented, its first is not
        chain = _record_start(buf, s, lambda x: x[:1] in _INDENT)
        first = _line_before(buf, chain) if chain is not None else None
        hf = fields(buf[first:buf.find(b"\n", first)][:MAX_RECORD]) if first is not None else None
        prio, seq, usec, msg = (hf[0], None, hf[2], line.strip()) if hf else (None, None, None, line.strip())
        head = hf[3][:_HEAD * 4].decode("utf-8", "replace")[:_HEAD] if hf else ""
    else:
        prio, seq, usec, msg, prefix = fields(line)
        if kernel_only and prio is not None and prio >> 3 != KERNEL_FACILITY:
            st.foreign += 1  # before looking further: a flood of them costs little
            return None
        if prefix:  # syslog(2): the lines of one record repeat its prefix
            first = _record_start(buf, s, lambda x: x.startswith(prefix))
            if first is None:
                head = ""
            elif first != s:
                head = buf[first + len(prefix):buf.find(b"\n", first)][:_HEAD * 4].decode("utf-8", "replace")[:_HEAD]
    if kernel_only and prio is not None and prio >> 3 != KERNEL_FACILITY:  # an indented line: its record's
        st.foreign += 1
        return None
    return KernelRecord(seq, usec, msg.decode("utf-8", "replace"), prio, head)
