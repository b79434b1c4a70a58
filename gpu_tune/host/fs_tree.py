"""Folders of the tool's own beneath the root (the evidence bundles, docs/health.md "Evidence"): a
folder of files written whole and renamed into place, listed, read and removed, all through
descriptors of folders that :class:`~gpu_tune.host.fs.HostFS` resolved beneath ``--root``.

The folder these work in (``/var/lib/gpu-tune/evidence``) is never a symlink: one there is refused,
whatever it points at, and so is a symlink in place of anything inside it (every open is
``O_NOFOLLOW`` relative to a folder descriptor). Errors are :class:`~gpu_tune.errors.HostError`
naming the path and the reason in one line, with the OS error number (``ENOSPC``, ``EROFS``).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from dataclasses import dataclass
from typing import Iterator, Mapping

from gpu_tune.errors import HostError, NotAFile
from gpu_tune.host.files import file_kind, os_reason, read_capped
from gpu_tune.host.fs_write import replace_at
from gpu_tune.host.resolve import O_CLOEXEC

O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | O_CLOEXEC
O_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | O_CLOEXEC
TEMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class Entry:
    """One entry of a folder: a folder's ``bytes`` are those of the regular files in it (one level)."""

    name: str
    is_dir: bool
    bytes: int
    mtime: float


def _err(host_path: str, exc: OSError, what: str = "") -> HostError:
    return HostError(f"{what}{host_path}: {os_reason(exc)}", exc.errno)


def open_folder(fs, host_dir: str, *, create: bool, mode: int = 0o750) -> int:
    """A descriptor of the folder ``host_dir``: the folders above it resolved beneath the root as
    every write is (created when ``create``), the folder itself opened without following a link:
    a symlink there is refused (``ELOOP``), whatever it points at. The caller closes it.
    ``FileNotFoundError`` when it is not there and not ``create``."""
    rel = fs._rel(host_dir)
    parent, _, name = rel.rpartition("/")
    if not name:
        raise HostError(f"{host_dir}: not a folder of the tool's own")
    pfd = fs._dir_for_write("/" + parent, create=create, for_path=host_dir)
    try:
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            if not create:
                raise
            try:
                os.mkdir(name, mode, dir_fd=pfd)
            except FileExistsError:
                pass
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(name, dir_fd=pfd)
            raise HostError(f"{host_dir}: refused: it is a symlink (-> {target}); only a real folder is used",
                            errno.ELOOP)
        if not stat.S_ISDIR(st.st_mode):
            raise NotAFile(f"{host_dir}: refused: it is {file_kind(st.st_mode) or 'a file'}, not a folder",
                           errno.ENOTDIR)
        return os.open(name, O_DIR, dir_fd=pfd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _err(host_dir, exc) from None
    finally:
        os.close(pfd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_new(dfd: int, name: str, data: bytes, mode: int = 0o640) -> None:
    """A new file ``name`` in the folder ``dfd`` (never an existing one, never through a link),
    written whole and synced. Raises OSError."""
    fd = os.open(name, O_NEW, mode, dir_fd=dfd)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def make_folder(fs, host_dir: str, name: str, files: Mapping[str, bytes], *, mode: int = 0o640) -> None:
    """The folder ``host_dir/name`` holding ``files``, or nothing: written in a temporary folder
    beside it (``.tmp-NAME-HEX``), synced, then renamed into place. A name that is taken is
    refused (``EEXIST``); on any error the temporary folder is removed and nothing is left."""
    dfd = open_folder(fs, host_dir, create=True)
    tmp = f"{TEMP_PREFIX}{name}-{os.urandom(4).hex()}"
    made = False
    try:
        try:
            os.stat(name, dir_fd=dfd, follow_symlinks=False)
            raise HostError(f"{host_dir}/{name}: already there", errno.EEXIST)
        except FileNotFoundError:
            pass
        os.mkdir(tmp, 0o750, dir_fd=dfd)
        made = True
        tfd = os.open(tmp, O_DIR, dir_fd=dfd)
        try:
            for fname, data in files.items():
                write_new(tfd, fname, data, mode)
            os.fsync(tfd)
        finally:
            os.close(tfd)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        made = False
        os.fsync(dfd)
    except OSError as exc:
        raise _err(f"{host_dir}/{name}", exc, "not written: ") from None
    finally:
        if made:
            _remove(dfd, tmp)
        os.close(dfd)


def open_entry(fs, host_dir: str, name: str) -> int:
    """A descriptor of the folder ``host_dir/name`` (no link followed on the way). The caller
    closes it. Raises HostError (``FileNotFoundError`` when ``host_dir`` is not there)."""
    dfd = open_folder(fs, host_dir, create=False)
    try:
        return os.open(name, O_DIR, dir_fd=dfd)
    except OSError as exc:
        raise _err(f"{host_dir}/{name}", exc) from None
    finally:
        os.close(dfd)


def replace_in(fs, host_dir: str, name: str, fname: str, data: bytes, *, mode: int = 0o640) -> None:
    """Replace (or create) the file ``fname`` in the folder ``host_dir/name`` whole (a temporary
    file beside it renamed over it: :func:`~gpu_tune.host.fs_write.replace_at`). Raises HostError."""
    bfd = open_entry(fs, host_dir, name)
    try:
        replace_at(bfd, fname, data, mode)
    except OSError as exc:
        raise _err(f"{host_dir}/{name}/{fname}", exc, "not written: ") from None
    finally:
        os.close(bfd)


def _scan(fd: int) -> Iterator[tuple[str, os.stat_result]]:
    """(name, lstat) of the entries of the folder ``fd`` (an entry gone meanwhile left out)."""
    with os.scandir(fd) as it:
        for e in it:
            try:
                yield e.name, e.stat(follow_symlinks=False)
            except OSError:
                continue


def _size(dfd: int, name: str) -> int:
    """The bytes of the regular files in the folder ``name`` (one level, no link followed)."""
    try:
        fd = os.open(name, O_DIR, dir_fd=dfd)
    except OSError:
        return 0
    try:
        return sum(st.st_size for _, st in _scan(fd) if stat.S_ISREG(st.st_mode))
    except OSError:
        return 0
    finally:
        os.close(fd)


def entries(fs, host_dir: str) -> list[Entry]:
    """The entries of ``host_dir`` (none when it is not there), links as what they are. Raises
    HostError when the folder cannot be read (a symlink in its place among the reasons)."""
    try:
        dfd = open_folder(fs, host_dir, create=False)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    try:
        for n, st in _scan(dfd):
            is_dir = stat.S_ISDIR(st.st_mode)
            size = _size(dfd, n) if is_dir else (st.st_size if stat.S_ISREG(st.st_mode) else 0)
            out.append(Entry(n, is_dir, size, st.st_mtime))
    except OSError as exc:
        raise _err(host_dir, exc) from None
    finally:
        os.close(dfd)
    return sorted(out, key=lambda e: e.name)


def files_in(fs, host_dir: str, name: str) -> list[tuple[str, int]]:
    """(file, bytes) of the regular files in ``host_dir/name``, by name. Raises HostError."""
    bfd = open_entry(fs, host_dir, name)
    try:
        return sorted((n, st.st_size) for n, st in _scan(bfd) if stat.S_ISREG(st.st_mode))
    except OSError as exc:
        raise _err(f"{host_dir}/{name}", exc) from None
    finally:
        os.close(bfd)


def read_in(fs, host_dir: str, name: str, fname: str, limit: int) -> bytes | None:
    """At most ``limit`` bytes of the regular file ``host_dir/name/fname`` (None when it is not
    there; its first ``limit`` bytes when it is larger). Raises HostError (a link, a FIFO...)."""
    where = f"{host_dir}/{name}/{fname}"
    try:
        bfd = open_entry(fs, host_dir, name)
    except FileNotFoundError:
        return None
    except HostError as exc:
        if exc.errno == errno.ENOENT:
            return None
        raise
    try:
        fd = os.open(fname, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | O_CLOEXEC, dir_fd=bfd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotAFile(f"{where}: not read: it is a symlink, never followed", errno.ELOOP) from None
        raise _err(where, exc) from None
    finally:
        os.close(bfd)
    try:
        kind = file_kind(os.fstat(fd).st_mode)
        if kind is not None:
            raise NotAFile(f"{where}: not read: it is {kind}, not a file", errno.EINVAL)
        data = read_capped(fd, limit)
        if data is None:
            os.lseek(fd, 0, os.SEEK_SET)
            data = os.read(fd, limit)
        return data
    except OSError as exc:
        raise _err(where, exc) from None
    finally:
        os.close(fd)


def _remove(dfd: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=dfd)  # descriptor-based: never follows a link out
        else:
            os.unlink(name, dir_fd=dfd)
    except FileNotFoundError:
        pass


def remove(fs, host_dir: str, name: str) -> None:
    """Remove the entry ``name`` of ``host_dir`` (a folder with what is in it; a link itself, never
    what it points at). Raises HostError."""
    dfd = open_folder(fs, host_dir, create=False)
    try:
        _remove(dfd, name)
    except OSError as exc:
        raise _err(f"{host_dir}/{name}", exc, "not removed: ") from None
    finally:
        os.close(dfd)
