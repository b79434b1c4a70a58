"""Resolving a host path beneath the root, as the kernel's ``openat2(RESOLVE_IN_ROOT)`` does.

:class:`Openat2Resolver` asks the kernel (Linux 5.6+); :class:`WalkResolver` walks the path one
component at a time (``O_PATH|O_NOFOLLOW``, ``readlink``, restarting from the root on an absolute
link, at most :data:`MAX_SYMLINKS` links) and gives the same answers where the kernel has no
``openat2``. Both open a path relative to a root descriptor; with ``beneath=True`` (writes) a link
that leaves the root by its own text is refused with :class:`Escape` instead of being re-rooted.
Used by :class:`gpu_tune.host.fs.HostFS` only.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat

# openat2(2): struct open_how.resolve flags (linux/openat2.h).
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10
# The syscall number is the same on every architecture of the unified table (since Linux 5.6).
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437, "arm64": 437}.get(os.uname().machine)
# The kernel's MAXSYMLINKS: more links in one resolution is ELOOP.
MAX_SYMLINKS = 40

O_CLOEXEC = os.O_CLOEXEC
O_PATH = getattr(os, "O_PATH", 0)


class Escape(OSError):
    """A symlink on the way leads outside the root (EXDEV); ``link`` is its kernel-style path."""

    def __init__(self, link: str, target: str) -> None:
        super().__init__(errno.EXDEV, f"the symlink {link} -> {target} leads outside the root", link)
        self.link = link
        self.target = target


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_LIBC: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


class Openat2Resolver:
    """``openat2(root_fd, path, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`` (reads) or
    ``RESOLVE_BENEATH`` (writes): the kernel keeps every step beneath the root."""

    name = "openat2"

    def __init__(self, root_fd: int) -> None:
        if _SYS_OPENAT2 is None:
            raise OSError(errno.ENOSYS, f"openat2: no syscall number known for {os.uname().machine}")
        self.root_fd = root_fd
        proto = ctypes.CFUNCTYPE(ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_char_p,
                                 ctypes.c_void_p, ctypes.c_size_t, use_errno=True)
        self._syscall = proto(("syscall", libc()))
        self._hows: dict[tuple[int, int, bool], _OpenHow] = {}  # kept alive: their addresses are passed
        # Probe once: seccomp profiles of older container runtimes answer ENOSYS or EPERM.
        os.close(self.open("", os.O_RDONLY | os.O_DIRECTORY))

    def _how(self, flags: int, mode: int, beneath: bool) -> _OpenHow:
        key = (flags, mode, beneath)
        how = self._hows.get(key)
        if how is None:
            how = self._hows.setdefault(key, _OpenHow(
                flags | O_CLOEXEC, mode if flags & os.O_CREAT else 0,
                RESOLVE_NO_MAGICLINKS | (RESOLVE_BENEATH if beneath else RESOLVE_IN_ROOT)))
        return how

    def open(self, rel: str, flags: int, mode: int = 0, *, beneath: bool = False) -> int:
        how = self._how(flags, mode, beneath)  # held here while the kernel reads it
        addr = ctypes.addressof(how)
        path = os.fsencode(rel) if rel else b"."
        err = 0
        for _ in range(16):  # EAGAIN: a concurrent rename or mount moved a '..' step; retry
            fd = self._syscall(_SYS_OPENAT2, self.root_fd, path, addr, 24)
            if fd >= 0:
                return fd
            err = ctypes.get_errno()
            if err not in (errno.EAGAIN, errno.EINTR):
                break
        raise OSError(err, os.strerror(err), rel)


def _readlink(name: str, dir_fd: int) -> str | None:
    """The target of ``name`` in ``dir_fd`` when it is a symlink, else None."""
    try:
        return os.readlink(name, dir_fd=dir_fd)
    except OSError:
        return None


class WalkResolver:
    """The same resolution without openat2: one component at a time from the root's descriptor,
    each opened ``O_PATH|O_NOFOLLOW`` (so no component is followed by the kernel), symlinks read
    and expanded here: an absolute one restarts from the root (or is refused, beneath), ``..``
    never climbs above the root, more than :data:`MAX_SYMLINKS` links is ELOOP.

    Magic links (``/proc/<pid>/fd/N``) are read as ordinary symlinks: followed by their text,
    beneath the root, where ``openat2`` refuses them (``RESOLVE_NO_MAGICLINKS``). Either way
    nothing outside the root is reached.
    """

    name = "walk"

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd

    def open(self, rel: str, flags: int, mode: int = 0, *, beneath: bool = False) -> int:
        fd, _ = self._walk(rel, flags | O_CLOEXEC, mode, beneath=beneath)
        assert fd is not None
        return fd

    def resolve(self, rel: str) -> list[str]:
        """The components of ``rel`` after resolving every link in-root (like realpath(3):
        a missing component ends the resolution; the rest is kept as written)."""
        return self._walk(rel, None, 0, beneath=False)[1]

    def escape(self, rel: str) -> Escape | None:
        """The first link on the way to ``rel`` that leads outside the root, if any."""
        try:
            self._walk(rel, None, 0, beneath=True)
        except Escape as exc:
            return exc
        except OSError:
            return None
        return None

    def _walk(self, rel: str, flags: int | None, mode: int, *, beneath: bool) -> tuple[int | None, list[str]]:
        # ``todo`` is a stack (next component last); each carries the link that produced it
        todo: list[tuple[str, tuple[str, str] | None]] = [(c, None) for c in reversed(rel.split("/")) if c]
        fds: list[int] = []      # owned descriptors of the directories walked below the root
        names: list[str] = []    # and their names
        links = 0
        try:
            while todo:
                name, origin = todo.pop()
                if name == ".":
                    continue
                if name == "..":
                    if fds:
                        os.close(fds.pop())
                        names.pop()
                    elif beneath and origin is not None:
                        raise Escape(*origin)
                    continue
                cur = fds[-1] if fds else self.root_fd
                last = not todo
                if last and flags is not None:
                    fl, m = flags | os.O_NOFOLLOW, mode
                elif last:
                    fl, m = O_PATH | os.O_NOFOLLOW | O_CLOEXEC, 0
                else:
                    fl, m = O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | O_CLOEXEC, 0
                target: str | None = None
                try:
                    fd = os.open(name, fl, m, dir_fd=cur)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                        target = _readlink(name, cur)
                    if target is None:
                        if flags is None and exc.errno in (errno.ENOENT, errno.ENOTDIR):
                            return None, names + [name] + [c for c, _ in reversed(todo)]
                        raise
                else:
                    if fl & O_PATH and not fl & os.O_DIRECTORY and stat.S_ISLNK(os.fstat(fd).st_mode):
                        os.close(fd)
                        target = _readlink(name, cur)
                        if target is None:  # replaced under us
                            raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN), rel)
                    elif last:
                        if flags is not None:
                            return fd, names + [name]
                        os.close(fd)
                        return None, names + [name]
                    else:
                        fds.append(fd)
                        names.append(name)
                        continue
                # a symlink: expand it in place
                links += 1
                if links > MAX_SYMLINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), rel)
                link = (("/" + "/".join(names + [name])), target)
                if target.startswith("/"):
                    if beneath:
                        raise Escape(*link)
                    while fds:
                        os.close(fds.pop())
                    names.clear()
                todo.extend((c, link) for c in reversed(target.split("/")) if c)
            # the path ended on a folder reached through '..', '.' or a link to one
            if flags is not None:
                return os.open(".", flags, mode, dir_fd=fds[-1] if fds else self.root_fd), list(names)
            return None, list(names)
        finally:
            for fd in fds:
                os.close(fd)
