"""HostFS: the only place that opens the host's files, always beneath one root (docs/security.md).

Every path handed to HostFS is written the way the kernel names it (``/proc/sys/vm/swappiness``)
and is resolved *beneath* ``root`` (``/`` on a node, ``/host`` in the DaemonSet, a fixture tree in
tests) as if the root were ``/``: the semantics of the kernel's ``openat2(RESOLVE_IN_ROOT)``. An
absolute symlink found under the root (``/host/etc/x -> /usr/y``) means ``/host/usr/y``, never this
process's ``/usr/y``; ``..`` stops at the root. sysfs's own relative links
(``/sys/bus/pci/devices/X -> ../../../devices/...``) work as they do on the host.

Writes are stricter: they follow only links that stay beneath the root by their own text (the
relative ones sysfs uses). A write through an absolute link, or through a relative one that
climbs above the root, is refused with a :class:`HostError` naming the link, and nothing is
written, neither outside the root nor at the link's reading beneath it.

Resolution uses ``openat2(2)`` (Linux 5.6+) where the kernel offers it, and otherwise a walk of
the path one component at a time (``O_PATH|O_NOFOLLOW``, ``readlink``, restarting from the root on
an absolute link, at most 40 links) that gives the same answers. With the root ``/`` resolution
is the ordinary one (nothing lies outside it). Errors come back as :class:`HostError` with the
path and the reason in one line.

Only regular files are read or written (the kernel's pseudo-files in /proc and /sys are regular
files too): a FIFO, a device or a socket where a host file should be is refused on the opened
descriptor, which is opened non-blocking, so nothing waits for a writer that never comes. Every
read is bounded (:data:`READ_CAP` unless the caller gives a cap that suits the file): kernel files
report sizes of 0 or 4096 whatever they hold, so the cap bounds what is read (cap + 1 bytes, then
refused), never trusting the reported size. A file with more than one name (hard links) is never
written: another name may lie outside the root.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path
from typing import Callable

from gpu_tune.errors import HostError, InputError, NotAFile
from gpu_tune.host.files import (KERNEL_FS_MAGIC, O_READ, READ_CAP, file_kind, fs_magic, os_reason, read_capped,
                                 size_text)
from gpu_tune.host.fs_write import HostWrites
from gpu_tune.host.resolve import O_CLOEXEC, O_PATH, Escape, Openat2Resolver, WalkResolver

# Filesystems whose files are kernel interfaces: a write is a request, not a byte copy.
KERNEL_FS_TYPES = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "securityfs", "configfs"})
RESOLVERS = ("auto", "openat2", "walk")


class HostFS(HostWrites):
    """Read and write the host's files beneath ``root``.

    ``resolver``: ``auto`` (openat2 where the kernel has it, else the walk), ``openat2`` or
    ``walk``; default from the environment variable ``GPU_TUNE_RESOLVER``, else ``auto``.
    ``self.resolver`` names the one in use (``plain`` for the root ``/``).
    """

    def __init__(self, root: str | os.PathLike[str] = "/", *, resolver: str | None = None) -> None:
        path = Path(root)
        if not path.exists():
            raise InputError(f"--root {root}: no such directory")
        if not path.is_dir():
            raise InputError(f"--root {root}: not a directory")
        missing = [d for d in ("proc", "sys") if not (path / d).is_dir()]
        if missing:
            # An unmounted /host or a mistyped --root must not read as a compliant host.
            raise InputError(f"--root {root}: no {' or '.join(d + '/' for d in missing)} under it: "
                             "not a host root (mount the host's /proc and /sys there)")
        self.root = path.resolve()
        choice = resolver or os.environ.get("GPU_TUNE_RESOLVER") or "auto"
        if choice not in RESOLVERS:
            raise InputError(f"GPU_TUNE_RESOLVER={choice}: expected one of {', '.join(RESOLVERS)}")
        self._root_fd = -1
        self._plain = str(self.root) == "/" and choice == "auto"
        if self._plain:
            self.resolver = "plain"
            return
        self._root_fd = os.open(self.root, O_PATH | os.O_DIRECTORY | O_CLOEXEC)
        self._walker = WalkResolver(self._root_fd)
        self._resolve: Openat2Resolver | WalkResolver = self._walker
        why = "GPU_TUNE_RESOLVER=walk"
        if choice != "walk":
            try:
                self._resolve = Openat2Resolver(self._root_fd)
                why = "the kernel has openat2"
            except OSError as exc:
                if choice == "openat2":
                    raise InputError(f"openat2 is not available here: {os_reason(exc)}") from None
                why = f"openat2 is not available ({os_reason(exc)})"
        self.resolver = self._resolve.name
        logging.getLogger("gpu_tune").debug("host paths resolve beneath %s with %s: %s", self.root,
                                            self.resolver, why)

    def __del__(self) -> None:
        fd = getattr(self, "_root_fd", -1)
        if fd >= 0:
            self._root_fd = -1
            try:
                os.close(fd)
            except OSError:
                pass

    # -- paths -----------------------------------------------------------------------------
    @staticmethod
    def _rel(host_path: str) -> str:
        rel = host_path.strip("/")
        if "//" not in rel and "." not in rel:
            return rel
        parts = [p for p in rel.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise HostError(f"{host_path}: '..' is not allowed in host paths")
        return "/".join(parts)

    def path(self, host_path: str) -> Path:
        """Where ``host_path`` lies under the root, for messages: the lexical join, before any
        link is resolved. Never open it: HostFS's methods resolve beneath the root."""
        rel = self._rel(host_path)
        return self.root / rel if rel else self.root

    def host_path(self, real: str | os.PathLike[str]) -> str:
        """The kernel-style path of a real path under the root (inverse of :meth:`path`)."""
        real_s = os.fspath(real)
        root_s = os.fspath(self.root)
        if root_s == "/":
            return real_s
        if real_s == root_s:
            return "/"
        if real_s.startswith(root_s + os.sep):
            return real_s[len(root_s):]
        return real_s

    def realpath(self, host_path: str) -> str:
        """Resolve symlinks beneath the root (sysfs uses relative ones); the kernel-style path."""
        rel = self._rel(host_path)
        if self._plain:
            return os.path.realpath("/" + rel)
        return "/" + "/".join(self._walker.resolve(rel))

    def escape(self, host_path: str) -> str | None:
        """Where a symlink on the way to ``host_path`` leads outside the root by its own text
        (an absolute link, or '..' above the root): that link in words; else None."""
        if self._plain:
            return None
        esc = self._walker.escape(self._rel(host_path))
        return None if esc is None else f"the symlink {esc.link} -> {esc.target} leads outside --root {self.root}"

    def _open(self, rel: str, flags: int, mode: int = 0, *, write: bool = False) -> int:
        """A descriptor for ``rel`` resolved beneath the root; writes only through links that
        stay beneath it. Raises OSError (:class:`Escape` where a link leads outside)."""
        if self._plain:
            return os.open("/" + rel, flags | O_CLOEXEC, mode)
        try:
            return self._resolve.open(rel, flags, mode, beneath=write)
        except Escape:
            raise
        except OSError as exc:
            if write and exc.errno == errno.EXDEV:
                raise self._walker.escape(rel) or exc from None
            raise

    def _error(self, host_path: str, exc: OSError, *, write: bool = False, what: str = "") -> HostError:
        """One line naming the path, the reason and, where one is on the way, the link that
        leads outside the root."""
        if isinstance(exc, Escape):
            return HostError(f"{host_path}: not written: the symlink {exc.link} -> {exc.target} leads "
                             f"outside --root {self.root}", errno.EXDEV)
        if exc.errno == errno.EISDIR:
            return HostError(f"{host_path}: is a directory, expected a file", exc.errno)
        msg = f"{what}{host_path}: {os_reason(exc)}"
        esc = self.escape(host_path)
        if esc is not None:
            msg += f" ({esc}; it is followed beneath the root)"
        return HostError(msg, exc.errno)

    # -- reading ---------------------------------------------------------------------------
    def exists(self, host_path: str) -> bool:
        """Whether ``host_path`` exists beneath the root; False for a path HostFS refuses (``..``)."""
        try:
            os.close(self._open(self._rel(host_path), O_PATH))
            return True
        except (OSError, HostError):
            return False

    def is_dir(self, host_path: str) -> bool:
        try:
            os.close(self._open(self._rel(host_path), O_PATH | os.O_DIRECTORY))
            return True
        except (OSError, HostError):
            return False

    def _open_regular(self, host_path: str, limit: int) -> int:
        """A read descriptor of a regular file (the caller closes it); refused as :meth:`read_bytes`
        says, a file that says it holds more than ``limit`` bytes included."""
        rel = self._rel(host_path)
        try:
            fd = self._open(rel, O_READ)
        except OSError as exc:
            kind = self._kind_at(rel) if exc.errno in (errno.ENXIO, errno.ENODEV) else None
            if kind is not None:  # a socket, a device with nothing behind it
                raise NotAFile(f"{host_path}: is {kind}, not a file: not read", errno.EINVAL) from None
            raise self._error(host_path, exc) from None
        try:
            st = os.fstat(fd)
            kind = file_kind(st.st_mode)
            if kind == "a directory":
                raise HostError(f"{host_path}: is a directory, expected a file", errno.EISDIR)
            if kind is not None:
                raise NotAFile(f"{host_path}: is {kind}, not a file: not read", errno.EINVAL)
            # a regular file on an ordinary filesystem says its size; a kernel file does not
            if st.st_size > limit and fs_magic(fd) not in KERNEL_FS_MAGIC:
                raise NotAFile(f"{host_path}: larger than {size_text(limit)}, too large for this file: not read",
                               errno.EFBIG)
            return fd
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, OSError) and not isinstance(exc, HostError):
                raise self._error(host_path, exc) from None
            raise

    def _read_file(self, host_path: str, limit: int) -> bytes:
        fd = self._open_regular(host_path, limit)
        try:
            data = read_capped(fd, limit)
            if data is None:
                raise NotAFile(f"{host_path}: larger than {size_text(limit)}, too large for this file: not read",
                               errno.EFBIG)
            return data
        except OSError as exc:
            raise self._error(host_path, exc) from None
        finally:
            os.close(fd)

    def read_lines(self, host_path: str, keep: Callable[[int, str], bool], *, limit: int = READ_CAP,
                   line_limit: int = READ_CAP) -> list[str]:
        """The lines of a file (text, without their newline) for which ``keep(number, line)`` is
        true, numbered from 0; read in 64 KiB pieces, so what this costs in memory is the lines
        kept and one piece, not the file (a 59 MiB ``/proc/interrupts`` is 4.5 million lines).
        At most ``limit`` bytes in all and ``line_limit`` per line, else :class:`NotAFile` as
        :meth:`read_bytes` says; other failures are :class:`HostError` naming the path."""
        fd = self._open_regular(host_path, limit)
        kept: list[str] = []
        try:
            total, number, rest = 0, 0, b""
            while True:
                chunk = os.read(fd, 65536)
                total += len(chunk)
                if total > limit:
                    raise NotAFile(f"{host_path}: larger than {size_text(limit)}, too large for this file: not read",
                                   errno.EFBIG)
                if not chunk:
                    if rest:
                        line = rest.decode("utf-8", "replace")
                        if keep(number, line):
                            kept.append(line)
                    return kept
                pieces = (rest + chunk).split(b"\n")
                rest = pieces.pop()
                if len(rest) > line_limit:
                    raise NotAFile(f"{host_path}: a line longer than {size_text(line_limit)}: not read", errno.EFBIG)
                for raw in pieces:
                    line = raw.decode("utf-8", "replace")
                    if keep(number, line):
                        kept.append(line)
                    number += 1
        except OSError as exc:
            raise self._error(host_path, exc) from None
        finally:
            os.close(fd)

    def read_bytes(self, host_path: str, *, limit: int = READ_CAP) -> bytes:
        """The whole file (at most ``limit`` bytes); :class:`HostError` naming the path when it
        cannot be read, :class:`NotAFile` when it is no regular file or larger than ``limit``."""
        return self._read_file(host_path, limit)

    def read_text(self, host_path: str, *, limit: int = READ_CAP) -> str:
        """The whole file as text (see :meth:`read_bytes`)."""
        return self._read_file(host_path, limit).decode("utf-8", "replace")

    def read_value(self, host_path: str) -> str:
        """A one-value kernel file, stripped."""
        return self.read_text(host_path).strip()

    def read_optional(self, host_path: str, *, limit: int = READ_CAP) -> str | None:
        """The stripped value, or None when the file does not exist or cannot be read. A file
        refused for what it is or its size (:class:`NotAFile`) is not "missing": it raises."""
        try:
            return self.read_text(host_path, limit=limit).strip()
        except NotAFile:
            raise
        except HostError:
            return None

    def open_stream(self, host_path: str, *, devices: frozenset[tuple[int, int]] = frozenset()) -> tuple[int, bool]:
        """A non-blocking read descriptor for a log read record by record: a regular file, or a
        character device whose (major, minor) is in ``devices`` (e.g. ``/dev/kmsg``, 1:11) and no
        other. Returns ``(fd, is_device)``; the caller closes it. :class:`HostError` (``errno``
        set) when it cannot be opened, :class:`NotAFile` for anything else."""
        rel = self._rel(host_path)
        try:
            fd = self._open(rel, O_READ)
        except OSError as exc:
            raise self._error(host_path, exc) from None
        try:
            st = os.fstat(fd)
            if stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) in devices:
                return fd, True
            kind = file_kind(st.st_mode)
            if kind is not None:
                raise NotAFile(f"{host_path}: is {kind}, not a file: not read", errno.EINVAL)
            return fd, False
        except BaseException:
            os.close(fd)
            raise

    def listdir(self, host_path: str) -> list[str]:
        """Names in a directory, sorted; empty when it does not exist."""
        try:
            fd = self._open(self._rel(host_path), os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise self._error(host_path, exc) from None
        try:
            return sorted(os.listdir(fd))
        except OSError as exc:
            raise self._error(host_path, exc) from None
        finally:
            os.close(fd)

    def pids(self) -> list[int]:
        from gpu_tune.host.numbers import uint_or_none

        return [n for n in (uint_or_none(name, max_digits=10) for name in self.listdir("/proc")) if n is not None]

    def is_kernel_file(self, host_path: str) -> bool:
        """True when the file lives on procfs/sysfs (a knob), False for a regular file (and for
        a path HostFS refuses)."""
        try:
            fd = self._open(self._rel(host_path), O_PATH)
        except (OSError, HostError):
            return False
        try:
            return fs_magic(fd) in KERNEL_FS_MAGIC
        finally:
            os.close(fd)

    # -- writing ---------------------------------------------------------------------------
    def _one_name(self, host_path: str, st: os.stat_result) -> None:
        """Refuse to write a file that is not a regular file or that has another name."""
        kind = file_kind(st.st_mode)
        if kind is not None:
            raise NotAFile(f"{host_path}: not written: it is {kind}, not a file", errno.EINVAL)
        if st.st_nlink > 1:
            raise NotAFile(f"{host_path}: not written: it has {st.st_nlink} hard links (another name may lie "
                           f"outside --root {self.root}); only a file with one name is written", errno.EMLINK)

    def _kind_at(self, rel: str) -> str | None:
        try:
            fd = self._open(rel, O_PATH)
        except OSError:
            return None
        try:
            return file_kind(os.fstat(fd).st_mode)
        finally:
            os.close(fd)
