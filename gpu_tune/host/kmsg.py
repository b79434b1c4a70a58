"""The kernel's log since boot, read record by record, bounded, and incrementally.

Three sources, tried in this order (:meth:`KernelLog.source` names the one in use):

1. ``<root>/dev/kmsg`` when it exists under ``--root``: a regular file there is a fixture, one
   record a line in ``/dev/kmsg``'s own format (``PRIORITY,SEQUENCE,MICROSECONDS,FLAGS;MESSAGE``);
   the character device 1:11 is the kernel's.
2. On the running host only (``--root /``, or a root whose ``boot_id`` is this kernel's: the
   DaemonSet's ``/host``), the kernel's ``/dev/kmsg``: opened non-blocking, one record per
   ``read(2)`` until ``EAGAIN``; ``EPIPE`` says records were overwritten before they were read
   (counted, reading goes on). A privileged container has it; an unprivileged one has no such
   device (the container runtime's device rules).
3. ``syslog(2)`` (``SYSLOG_ACTION_READ_ALL``): the same ring buffer as text, without a device.
   Where ``kernel.dmesg_restrict`` is 1 it needs ``CAP_SYSLOG``: the unprivileged audit pod adds
   that one capability instead of running privileged (docs/security.md).

A root that is neither (a fixture tree without ``dev/kmsg``) has no kernel log: :meth:`read`
says so in ``error``, which the readiness check reports as a warning.

Bounds: a record is cut at :data:`MAX_RECORD` bytes (the kernel's own records are at most 8 KiB);
a fixture file larger than :data:`MAX_FILE_BYTES` is read from its newest ``MAX_FILE_BYTES``
(the kernel's ring buffer is at most 32 MiB); one :meth:`read` scans at most ``max_records``
records and leaves the rest for the next call. Memory stays proportional to the records the
caller keeps: :meth:`read` yields the records whose message matches a pattern, one at a time.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
from dataclasses import dataclass, field
from typing import Iterator

from gpu_tune.errors import HostError
from gpu_tune.host.files import os_reason
from gpu_tune.host.fs import HostFS

KMSG = "/dev/kmsg"
KMSG_DEVICE = frozenset({(1, 11)})
MAX_RECORD = 8192
MAX_FILE_BYTES = 32 << 20
MAX_RECORDS = 1_000_000
_CHUNK = 1 << 20
_SYSLOG_ACTION_READ_ALL = 3
_SYSLOG_ACTION_SIZE_BUFFER = 10
_BOOT_ID = "/proc/sys/kernel/random/boot_id"

# "6,1207,88310022,-;message" (kmsg) and "<6>[   88.310022] message" (syslog(2), dmesg -r)
_KMSG_RE = re.compile(rb"(\d+),(\d+),(\d+),[^;]*;")
_SYSLOG_RE = re.compile(rb"<(\d+)>(?:\[\s*(\d+)\.(\d+)\]\s?)?")


@dataclass(frozen=True)
class KernelRecord:
    """One record: ``seq`` and ``usec`` (microseconds since boot) where the source gives them."""

    seq: int | None
    usec: int | None
    message: str


@dataclass
class ReadStats:
    """What one :meth:`KernelLog.read` went through."""

    source: str = ""
    scanned: int = 0  # records read
    lost: int = 0  # records overwritten before they could be read (EPIPE)
    cut: int = 0  # records longer than MAX_RECORD, cut
    skipped_bytes: int = 0  # of a fixture file larger than MAX_FILE_BYTES, not read
    more: bool = False  # max_records reached: the rest is left for the next read
    error: str | None = None  # the log could not be read at all
    notes: list[str] = field(default_factory=list)


def parse_record(line: bytes) -> KernelRecord:
    """A record in kmsg's or syslog(2)'s format; any other line is a message without figures."""
    m = _KMSG_RE.match(line)
    if m:
        msg = line[m.end():]
        return KernelRecord(int(m.group(2)), int(m.group(3)), msg.decode("utf-8", "replace"))
    m = _SYSLOG_RE.match(line)
    if m:
        usec = int(m.group(2)) * 1_000_000 + int(m.group(3).ljust(6, b"0")[:6]) if m.group(2) else None
        return KernelRecord(None, usec, line[m.end():].decode("utf-8", "replace"))
    return KernelRecord(None, None, line.decode("utf-8", "replace"))


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
    records that arrived since the previous one (all since boot the first time)."""

    def __init__(self, fs: HostFS, *, max_records: int = MAX_RECORDS, max_file_bytes: int = MAX_FILE_BYTES,
                 syslog: bool = True) -> None:
        self.fs = fs
        self.max_records = max_records
        self.max_file_bytes = max_file_bytes
        self._syslog_allowed = syslog
        self._fd = -1
        self._kind = ""  # "file" | "device" | "syslog" | ""
        self._source = ""
        self._file_pos = 0
        self._file_ino: tuple[int, int] | None = None
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
    def read(self, want: re.Pattern[bytes] | None = None, stats: ReadStats | None = None) -> Iterator[KernelRecord]:
        """The new records whose raw line matches ``want`` (all when None), oldest first.
        ``stats`` (filled while iterating) says what was read and what could not be."""
        st = stats if stats is not None else ReadStats()
        err = self._open()
        st.source = self._source
        if err is not None:
            st.error = err
            return
        if self._kind == "file":
            yield from self._read_file(want, st)
        elif self._kind == "device":
            yield from self._read_device(want, st)
        else:
            yield from self._read_syslog(want, st)

    def _read_file(self, want: re.Pattern[bytes] | None, st: ReadStats) -> Iterator[KernelRecord]:
        fd = self._fd
        try:
            info = os.fstat(fd)
        except OSError as exc:
            st.error = f"{self._source}: {os_reason(exc)}"
            return
        ino = (info.st_dev, info.st_ino)
        if ino != self._file_ino or info.st_size < self._file_pos:
            self._file_ino, self._file_pos = ino, 0  # a new file (a new boot's), or one cut shorter
        pos = self._file_pos
        partial = False  # whether we start inside a line (its head was not read): drop it
        if info.st_size - pos > self.max_file_bytes:
            st.skipped_bytes = info.st_size - self.max_file_bytes - pos
            pos, partial = info.st_size - self.max_file_bytes, True
            st.notes.append(f"only the newest {self.max_file_bytes >> 20} MiB of {info.st_size:,} bytes read")
        head = b""  # the unfinished line carried into the next chunk (at most MAX_RECORD bytes)
        cut = False  # that line is longer than MAX_RECORD: the rest of it is dropped
        while True:
            try:
                chunk = os.pread(fd, _CHUNK, pos)
            except OSError as exc:
                st.error = f"{self._source}: {os_reason(exc)}"
                return
            if not chunk:
                break
            base, pos = pos, pos + len(chunk)
            last_nl = chunk.rfind(b"\n")
            if last_nl < 0:  # no line ends in this chunk
                if not partial and not cut:
                    head += chunk[:MAX_RECORD - len(head)]
                    cut = len(head) >= MAX_RECORD
                continue
            lines = chunk[:last_nl].split(b"\n")
            tail = chunk[last_nl + 1:]
            # the first line continues the carried one
            if partial:
                lines[0], partial = None, False
            elif cut:
                lines[0], st.cut = head, st.cut + 1
            else:
                lines[0] = head + lines[0]
            head, cut = tail[:MAX_RECORD], len(tail) > MAX_RECORD
            if (want is not None and st.scanned + len(lines) < self.max_records
                    and not any(want.search(x) for x in (lines[0] or b"", chunk[:last_nl]))):
                st.scanned += sum(1 for x in lines if x and x[:1] != b" " and x.strip())
                continue  # nothing wanted in these lines: counted, not parsed
            after = 0  # where the line being read ends in the chunk (after its newline)
            for line in lines:
                after = chunk.find(b"\n", after) + 1
                if line is None or not line.strip() or line[:1] == b" ":  # " KEY=value": a continuation
                    continue
                if len(line) > MAX_RECORD:
                    line, st.cut = line[:MAX_RECORD], st.cut + 1
                st.scanned += 1
                if want is None or want.search(line):
                    yield parse_record(line)
                if st.scanned >= self.max_records:
                    st.more = True
                    self._file_pos = base + after
                    return
        if head.strip() and head[:1] != b" " and not partial:  # a last line without its newline
            st.cut += cut
            st.scanned += 1
            if want is None or want.search(head):
                yield parse_record(head)
        self._file_pos = pos

    def _read_device(self, want: re.Pattern[bytes] | None, st: ReadStats) -> Iterator[KernelRecord]:
        fd = self._fd
        while st.scanned < self.max_records:
            try:
                rec = os.read(fd, 16384)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    st.lost += 1
                    continue
                if exc.errno == errno.EINTR:
                    continue
                st.error = f"{self._source}: {os_reason(exc)}"
                return
            if not rec:
                return
            st.scanned += 1
            line = rec.split(b"\n", 1)[0]  # the record's continuation (KEY=value) lines follow
            if len(line) > MAX_RECORD:
                line, st.cut = line[:MAX_RECORD], st.cut + 1
            if want is None or want.search(line):
                yield parse_record(line)
        st.more = True

    def _read_syslog(self, want: re.Pattern[bytes] | None, st: ReadStats) -> Iterator[KernelRecord]:
        data, err = _syslog_read_all()
        if err is not None:
            st.error = f"syslog(2): {err}"
            return
        newest = self._last_usec
        texts: set[bytes] = set()
        for line in data.split(b"\n"):
            if not line:
                continue
            m = _SYSLOG_RE.match(line)
            usec = None
            if m and m.group(2):
                usec = int(m.group(2)) * 1_000_000 + int(m.group(3).ljust(6, b"0")[:6])
            if usec is not None:
                if usec < self._last_usec or (usec == self._last_usec and line in self._last_texts):
                    continue  # read by an earlier call
                if usec > newest:
                    newest, texts = usec, set()
                if usec == newest:
                    texts.add(line)
            st.scanned += 1
            if len(line) > MAX_RECORD:
                line, st.cut = line[:MAX_RECORD], st.cut + 1
            if want is None or want.search(line):
                yield parse_record(line)
            if st.scanned >= self.max_records:
                st.more = True
                break
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
