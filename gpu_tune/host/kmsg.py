"""The kernel's log since boot, read record by record, bounded, and incrementally.

Three sources, tried in this order (:meth:`KernelLog.source` names the one in use):

1. ``<root>/dev/kmsg`` when it exists under ``--root``: a regular file there is a fixture, one
   record a line in ``/dev/kmsg``'s own format (``PRIORITY,SEQUENCE,MICROSECONDS,FLAGS;MESSAGE``;
   ``dmesg -r``'s ``<3>[   88.310022] MESSAGE`` and plain ``dmesg`` text are read too); the
   character device 1:11 is the kernel's.
2. On the running host only (``--root /``, or a root whose ``boot_id`` is this kernel's: the
   DaemonSet's ``/host``), the kernel's ``/dev/kmsg``: opened non-blocking, one record per
   ``read(2)`` until ``EAGAIN``; ``EPIPE`` says records were overwritten before they were read
   (counted from the sequence numbers, reading goes on). A privileged container has it; an
   unprivileged one has no such device (the container runtime's device rules).
3. ``syslog(2)`` (``SYSLOG_ACTION_READ_ALL``): the same ring buffer as text, without a device.
   Where ``kernel.dmesg_restrict`` is 1 it needs ``CAP_SYSLOG``: the unprivileged audit pod adds
   that one capability instead of running privileged (docs/security.md).

A root that is neither (a fixture tree without ``dev/kmsg``) has no kernel log: :meth:`read`
says so in ``error``, which the readiness check reports as a warning.

Whose record a line is, and which record it continues: :mod:`gpu_tune.host.kmsg_text`.

**Bounds: the newest records are the ones read.** A record is cut at :data:`MAX_RECORD` bytes
(the kernel's own are at most 8 KiB). A fixture file is read from its newest end: at most
``max_file_bytes`` (32 MiB, the largest ring ``CONFIG_LOG_BUF_SHIFT`` allows) and of those at most
``max_records`` lines (2^20: the ring keeps one record descriptor per 32 bytes of text, so a
32 MiB ring holds at most that many records); what is older is skipped and counted
(``skipped_bytes``, ``skipped_records``). The kernel's device holds only what its ring holds and
is read to its end, for at most ``max_seconds`` per read (a ring made larger with ``log_buf_len=``,
or one filled faster than it is read): the rest is left for the next read and ``more`` says so.
``syslog(2)`` gives the newest records that fit the kernel's buffer size (at most 64 MiB here).
Memory stays proportional to the records the caller keeps: :meth:`read` yields the records whose
line matches a pattern, one at a time, and only those lines cost more than a byte search.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import time
from typing import Iterator

from gpu_tune.errors import HostError
from gpu_tune.host.files import os_reason
from gpu_tune.host.fs import HostFS
from gpu_tune.host.kmsg_text import (CONTEXT, KERNEL_FACILITY, KMSG_RE, MAX_RECORD, SYSLOG_RE,  # noqa: F401
                                     KernelRecord, ReadStats, count_lines, fields, parse_record, scan, tail_lines,
                                     usec_of)

KMSG = "/dev/kmsg"
KMSG_DEVICE = frozenset({(1, 11)})
MAX_FILE_BYTES = 32 << 20
MAX_RECORDS = 1 << 20
MAX_SECONDS = 10.0
_CHUNK = 1 << 20
_SYSLOG_ACTION_READ_ALL = 3
_SYSLOG_ACTION_SIZE_BUFFER = 10
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def live_host(fs: HostFS) -> bool:
    """Whether ``fs``'s root is the host this kernel runs (the root ``/``, or a root whose boot id
    is this kernel's, as the DaemonSet's ``/host`` is): only then is the kernel's own log its log."""
    if str(fs.root) == "/":
        return True
    try:
        theirs = fs.read_optional(_BOOT_ID)
        ours = HostFS("/").read_optional(_BOOT_ID)
    except HostError:
        return False
    return bool(theirs) and theirs == ours


class KernelLog:
    """The kernel log under ``fs``'s root, read incrementally: each :meth:`read` yields the
    records that arrived since the previous one (all since boot the first time, within the
    bounds above: the newest first kept)."""

    def __init__(self, fs: HostFS, *, max_records: int = MAX_RECORDS, max_file_bytes: int = MAX_FILE_BYTES,
                 max_seconds: float = MAX_SECONDS, syslog: bool = True) -> None:
        self.fs = fs
        self.max_records = max_records
        self.max_file_bytes = max_file_bytes
        self.max_seconds = max_seconds
        self._syslog_allowed = syslog
        self._fd = -1
        self._kind = ""  # "file" | "device" | "syslog" | ""
        self._source = ""
        self._file_pos = 0
        self._file_ino: tuple[int, int] | None = None
        self._last_seq: int | None = None
        self._last_usec = -1
        self._last_texts: set[bytes] = set()

    @property
    def source(self) -> str:
        return self._source

    def close(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = -1
        self._kind = ""

    def __enter__(self) -> "KernelLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- choosing the source -----------------------------------------------------------------
    def _open(self) -> str | None:
        """Open the first source that works; None, or why none does."""
        if self._kind:
            return None
        fs = self.fs
        if fs.exists(KMSG):
            try:
                fd, device = fs.open_stream(KMSG, devices=KMSG_DEVICE)
            except HostError as exc:
                return f"{fs.path(KMSG)}: {exc}".replace(f"{fs.path(KMSG)}: {KMSG}: ", f"{fs.path(KMSG)}: ")
            self._fd, self._kind = fd, "device" if device else "file"
            self._source = f"{fs.path(KMSG)}" + (" (the kernel's)" if device else " (a file)")
            return None
        if not live_host(fs):
            return (f"no kernel log: {fs.path(KMSG)} does not exist and {fs.root} is not the host this kernel "
                    "runs (its boot_id differs)")
        why = []
        try:
            fd, device = HostFS("/").open_stream(KMSG, devices=KMSG_DEVICE)
        except HostError as exc:
            why.append(str(exc))
        else:
            if device:
                self._fd, self._kind, self._source = fd, "device", KMSG
                return None
            os.close(fd)
            why.append(f"{KMSG}: not the kernel's device")
        if self._syslog_allowed:
            err = _syslog_probe()
            if err is None:
                self._kind, self._source = "syslog", "syslog(2)"
                return None
            why.append(f"syslog(2): {err}")
        return "kernel log not readable: " + "; ".join(why)

    # -- reading ---------------------------------------------------------------------------
    def read(self, want: re.Pattern[bytes] | None = None, stats: ReadStats | None = None, *,
             kernel_only: bool = False) -> Iterator[KernelRecord]:
        """The new records whose line matches ``want`` (all when None), oldest first; with
        ``kernel_only`` the kernel's own only (the others counted in ``stats.foreign``).
        ``stats`` (filled while iterating) says what was read and what was not."""
        st = stats if stats is not None else ReadStats()
        err = self._open()
        st.source = self._source
        if err is not None:
            st.error = err
            return
        if self._kind == "file":
            yield from self._read_file(want, st, kernel_only)
        elif self._kind == "device":
            yield from self._read_device(want, st, kernel_only)
        else:
            yield from self._read_syslog(want, st, kernel_only)

    def _newest(self, fd: int, start: int, end: int, st: ReadStats) -> int:
        """Where the newest ``max_records`` lines of ``[start, end)`` begin (``start`` when it holds
        no more): counted backwards, newlines only; the lines before are counted as skipped."""
        need, count, p = self.max_records, 0, end
        while p > start:
            q = max(start, p - _CHUNK)
            chunk = os.pread(fd, p - q, q)
            c = chunk.count(b"\n")
            if count + c > need:  # the newline before the oldest line kept is in this chunk
                i = len(chunk)
                for _ in range(need + 1 - count):
                    i = chunk.rfind(b"\n", 0, i)
                cut = q + i + 1
                skipped = chunk.count(b"\n", 0, i + 1)
                while q > start:  # the lines further back, counted
                    q2 = max(start, q - _CHUNK)
                    skipped += os.pread(fd, q - q2, q2).count(b"\n")
                    q = q2
                st.skipped_records += skipped
                return cut
            count, p = count + c, q
        return start

    def _read_file(self, want: re.Pattern[bytes] | None, st: ReadStats, kernel_only: bool) -> Iterator[KernelRecord]:
        fd = self._fd
        try:
            info = os.fstat(fd)
        except OSError as exc:
            st.error = f"{self._source}: {os_reason(exc)}"
            return
        ino = (info.st_dev, info.st_ino)
        if ino != self._file_ino or info.st_size < self._file_pos:
            self._file_ino, self._file_pos = ino, 0  # a new file (a new boot's), or one cut shorter
        end, begin = info.st_size, self._file_pos
        start = max(begin, end - self.max_file_bytes)
        try:
            if start > begin:
                st.skipped_bytes = start - begin
                st.notes.append(f"only the newest {self.max_file_bytes >> 20} MiB of {end - begin:,} bytes read")
            drop = start > 0 and os.pread(fd, 1, start - 1) != b"\n"  # we start inside a line: drop it
            newest = self._newest(fd, start, end, st)
        except OSError as exc:
            st.error = f"{self._source}: {os_reason(exc)}"
            return
        if newest > start:
            start, drop = newest, False
            st.notes.append(f"only the newest {self.max_records:,} lines read ({st.skipped_records:,} older not read)")
        ctx = b""  # the lines before the block (for a line that continues a record)
        carry = b""  # a line not ended in the chunk read, carried into the next (MAX_RECORD + 1 bytes kept)
        p = start
        while p < end:
            try:
                chunk = os.pread(fd, min(_CHUNK, end - p), p)
            except OSError as exc:
                st.error = f"{self._source}: {os_reason(exc)}"
                return
            if not chunk:
                break
            p += len(chunk)
            last = chunk.rfind(b"\n")
            if last < 0:  # no line ends in this chunk
                if not drop:
                    carry += chunk[:MAX_RECORD + 1 - len(carry)]
                continue
            first = chunk.find(b"\n")
            if drop:
                block, drop = chunk[first + 1:last + 1], False
            else:
                line0 = carry + chunk[:first]
                if len(line0) > MAX_RECORD:
                    line0, st.cut = line0[:MAX_RECORD], st.cut + 1
                block = line0 + chunk[first:last + 1]
            carry = chunk[last + 1:last + 2 + MAX_RECORD]
            buf = ctx + block
            st.scanned += count_lines(buf, len(ctx))
            yield from scan(buf, len(ctx), want, st, kernel_only)
            ctx = tail_lines(buf, CONTEXT)
        if carry.strip() and not drop:  # a last line without its newline
            if len(carry) > MAX_RECORD:
                carry, st.cut = carry[:MAX_RECORD], st.cut + 1
            buf = ctx + carry + b"\n"
            st.scanned += count_lines(buf, len(ctx))
            yield from scan(buf, len(ctx), want, st, kernel_only)
        self._file_pos = p

    def _read_device(self, want: re.Pattern[bytes] | None, st: ReadStats, kernel_only: bool) -> Iterator[KernelRecord]:
        fd = self._fd
        until = time.monotonic() + self.max_seconds
        overwritten = False
        while True:
            if st.scanned & 1023 == 1023 and time.monotonic() > until:
                st.more = True
                st.notes.append(f"{st.scanned:,} records read in {self.max_seconds:g} s, the limit of one read: "
                                "the newer ones are read next")
                return
            try:
                rec = os.read(fd, 16384)
            except BlockingIOError:
                st.lost += overwritten
                return
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # overwritten before read: the next read gives the oldest left
                    overwritten = True  # how many: the sequence numbers say
                    continue
                if exc.errno == errno.EINTR:
                    continue
                st.error = f"{self._source}: {os_reason(exc)}"
                return
            if not rec:
                st.lost += overwritten
                return
            st.scanned += 1
            line = rec.split(b"\n", 1)[0]  # the record's dictionary lines (" KEY=value") follow
            m = KMSG_RE.match(line)
            if m:
                seq = int(m.group(2))
                if overwritten:
                    st.lost += max(1, seq - self._last_seq - 1) if self._last_seq is not None else 1
                overwritten, self._last_seq = False, seq
            if want is not None and not want.search(line):
                continue
            if len(line) > MAX_RECORD:
                line, st.cut = line[:MAX_RECORD], st.cut + 1
            prio, seq2, usec, msg, _ = fields(line)
            if kernel_only and prio is not None and prio >> 3 != KERNEL_FACILITY:
                st.foreign += 1
                continue
            yield KernelRecord(seq2, usec, msg.decode("utf-8", "replace"), prio)

    def _syslog_new(self, data: bytes) -> int:
        """Where the lines not handed out by an earlier read start in ``data`` (syslog(2) text,
        which has no sequence numbers): after the newest line an earlier read saw, by time."""
        if self._last_usec < 0:
            return 0
        e = len(data)
        while e > 0:
            s = data.rfind(b"\n", 0, e - 1) + 1
            line = data[s:e - 1] if data[e - 1:e] == b"\n" else data[s:e]
            m = SYSLOG_RE.match(line)
            usec = usec_of(m.group(2), m.group(3)) if m else None
            if usec is None:
                if not line.strip():
                    e = s
                    continue
                return 0  # no time on the lines (printk.time=0): every read reads all
            if usec < self._last_usec or (usec == self._last_usec and line in self._last_texts):
                return e
            e = s
        return 0

    def _read_syslog(self, want: re.Pattern[bytes] | None, st: ReadStats, kernel_only: bool) -> Iterator[KernelRecord]:
        data, err = _syslog_read_all()
        if err is not None:
            st.error = f"syslog(2): {err}"
            return
        if data and not data.endswith(b"\n"):
            data += b"\n"
        start = self._syslog_new(data)
        # the newest time seen, and the lines with that time (to tell them from new ones next read)
        newest, texts, e = -1, set(), len(data)
        while e > start and len(texts) < 1024:
            s = data.rfind(b"\n", 0, e - 1) + 1
            line = data[s:e - 1]
            m = SYSLOG_RE.match(line)
            usec = usec_of(m.group(2), m.group(3)) if m else None
            if usec is None or (newest >= 0 and usec != newest):
                break
            newest = usec
            texts.add(line)
            e = s
        st.scanned += count_lines(data, start)
        yield from scan(data, start, want, st, kernel_only)
        if newest > self._last_usec:
            self._last_usec, self._last_texts = newest, texts
        elif newest == self._last_usec:
            self._last_texts |= texts


def _klogctl(action: int, buf: ctypes.Array | None, size: int) -> tuple[int, int]:
    from gpu_tune.host.resolve import libc

    lib = libc()
    n = lib.klogctl(ctypes.c_int(action), buf, ctypes.c_int(size))
    return n, ctypes.get_errno() if n < 0 else 0


def _syslog_probe() -> str | None:
    n, err = _klogctl(_SYSLOG_ACTION_SIZE_BUFFER, None, 0)
    if n < 0:
        return os.strerror(err)
    # the size is always allowed; reading may not be (dmesg_restrict): try a small read
    buf = ctypes.create_string_buffer(64)
    n, err = _klogctl(_SYSLOG_ACTION_READ_ALL, buf, 64)
    if n < 0:
        hint = " (kernel.dmesg_restrict is 1: CAP_SYSLOG is needed)" if err == errno.EPERM else ""
        return os.strerror(err) + hint
    return None


def _syslog_read_all() -> tuple[bytes, str | None]:
    size, err = _klogctl(_SYSLOG_ACTION_SIZE_BUFFER, None, 0)
    if size < 0:
        return b"", os.strerror(err)
    size = min(max(size, 4096), 1 << 26)
    buf = ctypes.create_string_buffer(size)
    n, err = _klogctl(_SYSLOG_ACTION_READ_ALL, buf, size)
    if n < 0:
        return b"", os.strerror(err)
    return buf.raw[:n], None
