"""Plain files, read and written safely: bounded non-blocking reads of regular files only, and
crash-safe atomic replacement. No root and no resolution here: :class:`gpu_tune.host.fs.HostFS`
uses these for the host's files beneath its root; a profile or a GPU fixture file of this process's
own uses them directly (:func:`read_local_file`, :func:`atomic_write`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import stat
from pathlib import Path

# What one read of a host file may return, in bytes. One-value kernel files hold a few bytes
# (an 8,192-CPU affinity mask is 2.3 KB); tables that grow with the machine are larger.
READ_CAP = 1 << 20
# /proc/interrupts and /proc/cpuinfo: megabytes on a 224-CPU node with a few thousand IRQs.
TABLE_READ_CAP = 64 << 20

O_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY
O_WRITE = os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY


# What a file that is not a regular file is, in words, by its stat(2) type test.
_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISLNK, "a symlink"))


def file_kind(mode: int) -> str | None:
    """What a file that is not a regular file is, in words; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


def size_text(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n:,} bytes"


def read_capped(fd: int, limit: int) -> bytes | None:
    """At most ``limit`` bytes from ``fd``; None when it holds more (``limit + 1`` are read at
    most, whatever the file says its size is)."""
    chunks = []
    left = limit + 1
    while left > 0:
        b = os.read(fd, min(65536, left))
        if not b:
            break
        chunks.append(b)
        left -= len(b)
    return None if left <= 0 else b"".join(chunks)


def read_local_file(path: str | os.PathLike[str], limit: int, what: str = "file") -> bytes:
    """A file of this process's own (a profile, a GPU fixture), read as host files are: only a
    regular file, opened non-blocking, at most ``limit`` bytes. Raises OSError (its
    ``strerror`` says what the file is, or that it is too large for a ``what``)."""
    fd = os.open(path, O_READ | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
        kind = file_kind(st.st_mode)
        if kind is not None:
            raise OSError(errno.EINVAL, f"is {kind}, not a file", os.fspath(path))
        data = None if st.st_size > limit else read_capped(fd, limit)
        if data is None:
            raise OSError(errno.EFBIG, f"larger than {size_text(limit)}: too large for a {what}", os.fspath(path))
        return data
    finally:
        os.close(fd)



def os_reason(exc: OSError) -> str:
    code = errno.errorcode.get(exc.errno or 0, "")
    text = exc.strerror or str(exc)
    return f"{text} ({code})" if code else text


# The temporary file of an atomic_write: ``.<name>.<pid>-<8 hex digits>`` beside ``<name>``, named
# by the writing process, so that the one a killed writer left can be told from one in flight.
_TEMP_RE = re.compile(r"\.(?P<name>.+)\.(?P<pid>[0-9]+)-[0-9a-f]{8}")


def _running(pid: int) -> bool:
    """Whether a process ``pid`` runs (in this PID namespace: the writers of one fixture file)."""
    if pid == os.getpid():
        return True  # this process's own write, from another thread
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(path: Path) -> list[Path]:
    """Remove the temporary files an :func:`atomic_write` of ``path`` left beside it when its
    process was killed before the rename (SIGKILL, the OOM killer): those of a process that is no
    longer running. One of a writer still running is left alone. Returns what was removed;
    raises OSError only for a folder that cannot be listed."""
    removed = []
    for entry in os.scandir(path.parent):
        m = _TEMP_RE.fullmatch(entry.name)
        if m is None or m.group("name") != path.name or _running(int(m.group("pid"))):
            continue
        try:
            if entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        except FileNotFoundError:
            pass
    return removed


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` crash-safely: a temp file beside it, fsync, rename over, fsync the folder.

    For files this process owns (a GPU fixture file), not for host files: those go through
    :meth:`HostFS.write_file_atomic`. A crash at any point leaves either the old file or the new
    one, never a torn one; what a killed write left beside it is removed first
    (:func:`remove_stale_temporaries`). Raises OSError.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}.{os.getpid()}-{os.urandom(4).hex()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            break
        except FileExistsError:
            continue
    else:  # pragma: no cover
        raise OSError(errno.EEXIST, "no free temporary name", str(path))
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


# Their statfs(2) f_type magic numbers (linux/magic.h).
KERNEL_FS_MAGIC = frozenset({0x9FA0, 0x62656572, 0x27E0EB, 0x63677270, 0x64626720, 0x73636673, 0x62656570})

# The temporary file of an atomic write: ``.<name>.<12 hex digits>`` beside ``<name>``.
TEMP_RE = re.compile(r"\.(?P<name>.+)\.[0-9a-f]{12}")


def fs_magic(fd: int) -> int | None:
    """statfs(2) f_type of the filesystem holding ``fd``."""
    buf = ctypes.create_string_buffer(512)
    try:
        if _libc().fstatfs(ctypes.c_int(fd), buf) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return ctypes.c_long.from_buffer(buf).value


def _libc():
    from gpu_tune.host.resolve import libc

    return libc()
