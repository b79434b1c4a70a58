"""HostFS's writes (:class:`gpu_tune.host.fs.HostFS` takes them from :class:`HostWrites`): into an
existing kernel file, crash-safe replacement of a regular file, lock files, interrupted writes'
temporaries, setting a bad file aside, removal. They follow only links that stay beneath the root
by their own text, and never write a file with more than one name (docs/security.md)."""

from __future__ import annotations

import errno
import os
import stat

from gpu_tune.errors import HostError, NotAFile
from gpu_tune.host.files import KERNEL_FS_MAGIC, O_WRITE, TEMP_RE, fs_magic
from gpu_tune.host.resolve import O_CLOEXEC


def replace_at(dfd: int, name: str, data: bytes, mode: int = 0o644) -> None:
    """Create or replace the file ``name`` in the folder ``dfd`` crash-safely: a temporary file
    beside it (``.NAME.HEX``, never through a link), written, synced, renamed over it, the folder
    synced; on an error the temporary file is removed. Raises OSError."""
    tmp = ""
    try:
        for _ in range(100):
            tmp = f".{name}.{os.urandom(6).hex()}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | O_CLOEXEC, 0o600, dir_fd=dfd)
                break
            except FileExistsError:
                continue
        else:  # pragma: no cover
            tmp = ""
            raise OSError(errno.EEXIST, "no free temporary name")
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        tmp = ""
        os.fsync(dfd)
    finally:
        if tmp:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass


class HostWrites:
    """The writing half of HostFS; it uses the reading half's ``_open``, ``_rel``, ``_error``,
    ``_kind_at`` and ``_one_name``."""

    def _write_into(self, host_path: str, data: bytes, what: str) -> None:
        rel = self._rel(host_path)
        try:
            fd = self._open(rel, O_WRITE, write=True)
        except OSError as exc:
            kind = self._kind_at(rel) if exc.errno in (errno.ENXIO, errno.ENODEV) else None
            if kind is not None:  # a FIFO with no reader, a device with nothing behind it
                raise NotAFile(f"{host_path}: not written: it is {kind}, not a file", errno.EINVAL) from None
            raise self._error(host_path, exc, write=True) from None
        try:
            self._one_name(host_path, os.fstat(fd))
            if fs_magic(fd) not in KERNEL_FS_MAGIC:  # a regular file: replace its bytes
                os.ftruncate(fd, 0)
            os.write(fd, data)
        except OSError as exc:
            raise self._error(host_path, exc, write=True, what=what) from None
        finally:
            os.close(fd)

    def write_text(self, host_path: str, value: str) -> None:
        """Write a value into an existing file (a kernel knob): never creates it.

        Kernel files take the bare choice (``madvise``, not ``always [madvise] never``).
        """
        self._write_into(host_path, value.encode(), f"cannot write {value!r} to ")

    def write_bytes_exact(self, host_path: str, data: bytes) -> None:
        """Write raw bytes into an existing regular file (restoring a fixture byte-for-byte)."""
        self._write_into(host_path, data, "")

    def _dir_for_write(self, host_dir: str, *, create: bool, for_path: str = "") -> int:
        """An ``O_RDONLY|O_DIRECTORY`` descriptor of ``host_dir`` resolved beneath the root
        for writing, its missing folders created (0755) when ``create``. Raises HostError."""
        rel = self._rel(host_dir)
        parts = rel.split("/") if rel else []
        flags = os.O_RDONLY | os.O_DIRECTORY
        try:
            return self._open(rel, flags, write=True)
        except FileNotFoundError:
            if not create:
                raise
        except OSError as exc:
            raise self._error(for_path or host_dir, exc, write=True) from None
        # create the missing folders one level at a time, each beneath the root
        for i in range(1, len(parts) + 1):
            here = "/".join(parts[:i])
            try:
                fd = self._open(here, flags, write=True)
            except FileNotFoundError:
                try:
                    pfd = self._open("/".join(parts[:i - 1]), flags, write=True)
                    try:
                        os.mkdir(parts[i - 1], 0o755, dir_fd=pfd)
                    except FileExistsError:
                        pass
                    finally:
                        os.close(pfd)
                    fd = self._open(here, flags, write=True)
                except OSError as exc:
                    raise self._error("/" + here, exc, write=True) from None
            except OSError as exc:
                raise self._error("/" + here, exc, write=True) from None
            if i == len(parts):
                return fd
            os.close(fd)
        raise HostError(f"{host_dir}: cannot be created")  # pragma: no cover (parts is never empty here)

    def write_file_atomic(self, host_path: str, data: bytes, mode: int = 0o644) -> None:
        """Create or replace a regular file crash-safely: temp file, fsync, rename, fsync dir.

        The folder is resolved beneath the root (missing ones created); the file itself must be
        a regular file or absent: a symlink there is refused, not followed or replaced.
        """
        rel = self._rel(host_path)
        if not rel:
            raise HostError(f"{host_path}: not a file")
        parent, _, name = rel.rpartition("/")
        dfd = self._dir_for_write("/" + parent, create=True, for_path=host_path)
        try:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISLNK(st.st_mode):
                target = os.readlink(name, dir_fd=dfd)
                raise HostError(f"{host_path}: not written: it is a symlink (-> {target}); only a regular "
                                "file is replaced", errno.ELOOP)
            if st is not None and stat.S_ISDIR(st.st_mode):
                raise HostError(f"{host_path}: is a directory, expected a file", errno.EISDIR)
            if st is not None:
                self._one_name(host_path, st)
            replace_at(dfd, name, data, mode)
        except OSError as exc:
            raise self._error(host_path, exc, write=True) from None
        finally:
            os.close(dfd)

    def open_lock_file(self, host_path: str) -> int:
        """A read-write descriptor of a lock file (created 0600, with its folders), beneath the
        root. The caller closes it. Raises HostError."""
        rel = self._rel(host_path)
        parent = rel.rpartition("/")[0]
        os.close(self._dir_for_write("/" + parent, create=True, for_path=host_path))
        try:
            fd = self._open(rel, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY, 0o600, write=True)
        except OSError as exc:
            raise self._error(host_path, exc, write=True) from None
        try:
            self._one_name(host_path, os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def remove_temporaries(self, host_path: str) -> list[str]:
        """Remove what an interrupted :meth:`write_file_atomic` of ``host_path`` left beside it
        (``.<name>.<hex>``, a regular file): the caller holds the lock that serialises those
        writes. Returns the host paths removed."""
        parent, _, name = self._rel(host_path).rpartition("/")
        return self.remove_temporaries_in("/" + parent, {name})

    def remove_temporaries_in(self, host_dir: str, names: set[str]) -> list[str]:
        """:meth:`remove_temporaries` for the files ``names`` of one folder, in one listing of it."""
        parent = self._rel(host_dir)
        try:
            dfd = self._dir_for_write("/" + parent, create=False, for_path=host_dir)
        except (FileNotFoundError, NotADirectoryError):
            return []
        removed = []
        try:
            for n in os.listdir(dfd):
                m = TEMP_RE.fullmatch(n)
                if m is None or m.group("name") not in names:
                    continue
                try:
                    if stat.S_ISREG(os.stat(n, dir_fd=dfd, follow_symlinks=False).st_mode):
                        os.unlink(n, dir_fd=dfd)
                        removed.append(f"/{parent}/{n}" if parent else f"/{n}")
                except FileNotFoundError:
                    pass
        except OSError as exc:
            raise self._error(host_dir, exc, write=True) from None
        finally:
            os.close(dfd)
        return removed

    def set_aside(self, host_path: str, aside: str) -> None:
        """Rename ``host_path`` (whatever it is: a file, a FIFO, a symlink, which is renamed itself
        and never followed) to ``aside``, a name in the same folder, replacing an earlier one there:
        so one bad file is kept for a person to look at, never more. Raises HostError."""
        rel = self._rel(host_path)
        parent, _, name = rel.rpartition("/")
        if not name or "/" in aside or aside in ("", ".", ".."):
            raise HostError(f"{host_path}: cannot be set aside as {aside!r}")
        try:
            dfd = self._dir_for_write("/" + parent, create=False, for_path=host_path)
        except FileNotFoundError as exc:
            raise self._error(host_path, exc, write=True, what="set aside: ") from None
        try:
            os.replace(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd)
            os.fsync(dfd)
        except OSError as exc:
            raise self._error(host_path, exc, write=True, what="set aside: ") from None
        finally:
            os.close(dfd)

    def remove(self, host_path: str) -> None:
        """Remove a file (a symlink there is removed itself, never followed)."""
        rel = self._rel(host_path)
        parent, _, name = rel.rpartition("/")
        try:
            dfd = self._dir_for_write("/" + parent, create=False, for_path=host_path)
        except FileNotFoundError:
            return
        try:
            os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._error(host_path, exc, write=True) from None
        finally:
            os.close(dfd)

    def rmdir_if_empty(self, host_path: str) -> bool:
        """Remove an empty folder (one the tool created); leave it when anything is in it."""
        rel = self._rel(host_path)
        parent, _, name = rel.rpartition("/")
        try:
            dfd = self._dir_for_write("/" + parent, create=False)
        except FileNotFoundError:
            return True
        except HostError:
            return False
        try:
            os.rmdir(name, dir_fd=dfd)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            return False
        finally:
            os.close(dfd)
