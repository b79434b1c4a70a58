"""HostFS: the only place that opens the host's files, always under one root (CONTRACT §1).

Every path handed to HostFS is written the way the kernel names it (``/proc/sys/vm/swappiness``)
and is resolved under ``root`` (``/`` on a node, ``/host`` in the DaemonSet, a fixture tree in
tests). Errors come back as :class:`HostError` with the path and the reason in one line.
"""

from __future__ import annotations

import errno
import os
import tempfile
from functools import cached_property
from pathlib import Path

from .errors import HostError, InputError

# Filesystems whose files are kernel interfaces: a write is a request, not a byte copy.
KERNEL_FS_TYPES = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "securityfs", "configfs"})


def _reason(exc: OSError) -> str:
    code = errno.errorcode.get(exc.errno or 0, "")
    text = exc.strerror or str(exc)
    return f"{text} ({code})" if code else text


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` crash-safely: a temp file beside it, fsync, rename over, fsync the folder.

    A crash at any point leaves either the old file or the new one, never a torn one.
    Raises OSError.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
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


class HostFS:
    """Read and write the host's files under ``root``."""

    def __init__(self, root: str | os.PathLike[str] = "/") -> None:
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

    # -- paths -----------------------------------------------------------------------------
    def path(self, host_path: str) -> Path:
        """The real path of ``host_path`` (a kernel-style absolute path) under the root."""
        rel = host_path.lstrip("/")
        parts = [p for p in rel.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise HostError(f"{host_path}: '..' is not allowed in host paths")
        return self.root.joinpath(*parts) if parts else self.root

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
        """Resolve symlinks (sysfs uses relative ones) and return the kernel-style path."""
        return self.host_path(os.path.realpath(self.path(host_path)))

    # -- reading ---------------------------------------------------------------------------
    def exists(self, host_path: str) -> bool:
        return self.path(host_path).exists()

    def is_dir(self, host_path: str) -> bool:
        return self.path(host_path).is_dir()

    def read_text(self, host_path: str) -> str:
        """The whole file as text; :class:`HostError` naming the path when it cannot be read."""
        p = self.path(host_path)
        try:
            with open(p, "rb") as fh:
                return fh.read().decode("utf-8", "replace")
        except IsADirectoryError:
            raise HostError(f"{host_path}: is a directory, expected a file") from None
        except OSError as exc:
            raise HostError(f"{host_path}: {_reason(exc)}", exc.errno) from None

    def read_bytes(self, host_path: str) -> bytes:
        p = self.path(host_path)
        try:
            with open(p, "rb") as fh:
                return fh.read()
        except IsADirectoryError:
            raise HostError(f"{host_path}: is a directory, expected a file") from None
        except OSError as exc:
            raise HostError(f"{host_path}: {_reason(exc)}", exc.errno) from None

    def read_value(self, host_path: str) -> str:
        """A one-value kernel file, stripped."""
        return self.read_text(host_path).strip()

    def read_optional(self, host_path: str) -> str | None:
        """The stripped value, or None when the file does not exist or cannot be read."""
        try:
            return self.read_text(host_path).strip()
        except HostError:
            return None

    def listdir(self, host_path: str) -> list[str]:
        """Names in a directory, sorted; empty when it does not exist."""
        try:
            return sorted(os.listdir(self.path(host_path)))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise HostError(f"{host_path}: {_reason(exc)}", exc.errno) from None

    def pids(self) -> list[int]:
        return [int(n) for n in self.listdir("/proc") if n.isdigit()]

    # -- writing ---------------------------------------------------------------------------
    def write_text(self, host_path: str, value: str) -> None:
        """Write a value into an existing file (a kernel knob): never creates it.

        Kernel files take the bare choice (``madvise``, not ``always [madvise] never``).
        """
        p = self.path(host_path)
        if p.is_dir():
            raise HostError(f"{host_path}: is a directory, expected a file")
        try:
            fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
        except OSError as exc:
            raise HostError(f"{host_path}: {_reason(exc)}", exc.errno) from None
        try:
            data = value.encode()
            os.write(fd, data)
        except OSError as exc:
            raise HostError(f"cannot write {value!r} to {host_path}: {_reason(exc)}", exc.errno) from None
        finally:
            os.close(fd)

    def write_bytes_exact(self, host_path: str, data: bytes) -> None:
        """Write raw bytes into an existing regular file (restoring a fixture byte-for-byte)."""
        p = self.path(host_path)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
        except OSError as exc:
            raise HostError(f"{host_path}: {_reason(exc)}", exc.errno) from None
        try:
            os.write(fd, data)
        except OSError as exc:
            raise HostError(f"{host_path}: {_reason(exc)}", exc.errno) from None
        finally:
            os.close(fd)

    def write_file_atomic(self, host_path: str, data: bytes, mode: int = 0o644) -> None:
        """Create or replace a regular file crash-safely: temp file, fsync, rename, fsync dir."""
        p = self.path(host_path)
        try:
            atomic_write(p, data, mode)
        except OSError as exc:
            where = host_path if p.parent.exists() else self.host_path(p.parent)
            raise HostError(f"{where}: {_reason(exc)}", exc.errno) from None

    def remove(self, host_path: str) -> None:
        try:
            self.path(host_path).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise HostError(f"{host_path}: {_reason(exc)}", exc.errno) from None

    def rmdir_if_empty(self, host_path: str) -> bool:
        """Remove an empty folder (one the tool created); leave it when anything is in it."""
        try:
            self.path(host_path).rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            return False

    # -- what kind of file -----------------------------------------------------------------
    @cached_property
    def _mounts(self) -> list[tuple[str, str]]:
        """(mount point, fs type) of this process's mounts, longest mount point first."""
        out: list[tuple[str, str]] = []
        try:
            with open("/proc/self/mounts", encoding="utf-8") as fh:
                for line in fh:
                    fields = line.split()
                    if len(fields) >= 3:
                        mnt = fields[1].replace("\\040", " ")
                        out.append((mnt, fields[2]))
        except OSError:
            pass
        out.sort(key=lambda m: len(m[0]), reverse=True)
        return out

    def is_kernel_file(self, host_path: str) -> bool:
        """True when the file lives on procfs/sysfs (a knob), False for a regular file."""
        real = os.path.realpath(self.path(host_path))
        for mnt, fstype in self._mounts:
            if real == mnt or real.startswith(mnt.rstrip("/") + "/"):
                return fstype in KERNEL_FS_TYPES
        return False
