"""The compilation cache's guard: is a folder of it this process' own, and removing one safely.

The persistent XLA compilation cache holds executables the probe loads and runs, so a folder of it
is used only when it is this process' own: every entry a regular file or a folder, owned by this
process' user, writable by no one else, at most :data:`MAX_DEPTH` folders deep and
:data:`MAX_ENTRIES` entries in all. Anything else (a symbolic link, which could lead out of the
agent's state folder or to executables someone else compiled; a FIFO, which blocks whoever opens
it; a socket or a device; another user's file) is a fault, named by :func:`walk`.

Everything here works on open folder descriptors (``openat`` and friends): no symbolic link is
ever followed, no function recurses (a folder 1,500 deep costs one loop turn per level, not a
Python frame), and the work is bounded: :func:`walk` stops at its entry and depth bounds,
:func:`remove` after its budget of removals (what is left is removed by the next call). Used by
the workload (``gpu_tune.workload.compile_cache``) on the folder it is about to hand TensorFlow and
by the agent (``gpu_tune.judge.probe.cache``) on the whole cache before each probe run.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
MAX_DEPTH = 4  # folders below a key folder (TensorFlow writes none: its entries are the key folder's files)
MAX_ENTRIES = 1024  # entries below one key folder, every level counted (one probe writes two)


def kind(mode: int) -> str:
    """What a file is, in words."""
    for test, name in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "folder"), (stat.S_ISLNK, "symbolic link"),
                       (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return f"file of type {stat.S_IFMT(mode):o}"


def fault(st: os.stat_result, what: str, *, uid: int, folder: bool | None = None) -> str | None:
    """Why the entry ``what`` (lstat result ``st``) may not be in the cache, or None. ``folder``:
    True or False where only that kind is allowed; None for either."""
    mode = st.st_mode
    allowed = {None: ("regular file", "folder"), True: ("folder",), False: ("regular file",)}[folder]
    if kind(mode) not in allowed:
        return f"{what} is a {kind(mode)}, not a {' or a '.join(allowed)}"
    if st.st_uid != uid:
        return f"{what} belongs to uid {st.st_uid}, not to this process' uid {uid}"
    if mode & 0o022:
        return f"{what} is writable by its group or by others (mode {stat.S_IMODE(mode):04o})"
    return None


def open_dir(name: str | os.PathLike[str], dir_fd: int | None = None) -> int:
    """A descriptor of the folder ``name`` (relative to ``dir_fd``); OSError where it is a link
    (ELOOP), not a folder (ENOTDIR: a FIFO is never opened) or missing."""
    return os.open(name, O_DIR, dir_fd=dir_fd)


@dataclass(frozen=True)
class Walk:
    """What :func:`walk` found: the first fault (None: sound), and the files and bytes it counted."""

    fault: str | None
    files: int = 0
    bytes: int = 0


def _open_below(fd: int, names: tuple[str, ...]) -> int:
    cur = os.dup(fd)
    for name in names:
        nxt = open_dir(name, cur)
        os.close(cur)
        cur = nxt
    return cur


def walk(fd: int, what: str, *, uid: int | None = None, max_depth: int = MAX_DEPTH,
         max_entries: int = MAX_ENTRIES) -> Walk:
    """Look at every entry below the open folder ``fd`` (named ``what`` in messages; the folder
    itself is the caller's to judge), without recursion and without following a link; stop at the
    first fault or bound. The folders are opened one level at a time from ``fd``: a descriptor or
    two at a time, whatever the shape."""
    uid = os.geteuid() if uid is None else uid
    pending: list[tuple[str, ...]] = [()]
    seen = files = size = 0
    while pending:
        below = pending.pop()
        try:
            dfd = _open_below(fd, below)
        except OSError as exc:
            return Walk(f"{'/'.join((what,) + below)}: {exc.strerror or exc}", files, size)
        try:
            with os.scandir(dfd) as it:
                for entry in it:
                    seen += 1
                    name = "/".join((what,) + below + (entry.name,))
                    if seen > max_entries:
                        return Walk(f"{what} holds more than {max_entries} entries", files, size)
                    try:
                        st = os.stat(entry.name, dir_fd=dfd, follow_symlinks=False)
                    except OSError as exc:
                        return Walk(f"{name}: {exc.strerror or exc}", files, size)
                    why = fault(st, name, uid=uid)
                    if why:
                        return Walk(why, files, size)
                    if stat.S_ISDIR(st.st_mode):
                        if len(below) + 1 > max_depth:
                            return Walk(f"{what} has folders more than {max_depth} deep ({name})", files, size)
                        pending.append(below + (entry.name,))
                    else:
                        files, size = files + 1, size + st.st_size
        except OSError as exc:
            return Walk(f"{'/'.join((what,) + below)}: {exc.strerror or exc}", files, size)
        finally:
            os.close(dfd)
    return Walk(None, files, size)


@dataclass(frozen=True)
class Removal:
    done: bool
    removed: int
    error: str | None = None


def remove(dir_fd: int, name: str, *, budget: int) -> Removal:
    """Remove the entry ``name`` of the open folder ``dir_fd``, whatever it is and however deep,
    never following a link (a link is removed, not what it points at). Depth first, one level at a
    time: it goes down by opening a subfolder and back up through ``..`` (checked to be the folder
    it came down from), so it holds two descriptors at most whatever the depth. Stops after
    ``budget`` removals (``done`` False: call again)."""
    used = 0
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=dir_fd)
            return Removal(True, 1)
        cur = open_dir(name, dir_fd)
    except FileNotFoundError:
        return Removal(True, 0)
    except OSError as exc:
        return Removal(False, 0, f"{name}: {exc.strerror or exc}")
    trail: list[tuple[str, int, int]] = []  # (name, dev, inode) of each folder above ``cur``, below dir_fd
    here = name
    try:
        while True:
            sub = None
            with os.scandir(cur) as it:
                for entry in it:
                    if entry.is_dir(follow_symlinks=False):
                        sub = entry.name
                        break
                    if used >= budget:
                        return Removal(False, used)
                    try:
                        os.unlink(entry.name, dir_fd=cur)
                    except FileNotFoundError:
                        pass
                    used += 1
            if sub is not None:
                nxt = open_dir(sub, cur)
                cst = os.fstat(cur)
                trail.append((here, cst.st_dev, cst.st_ino))
                os.close(cur)
                cur, here = nxt, sub
                continue
            if used >= budget:
                return Removal(False, used)
            if not trail:  # the top folder is empty
                os.close(cur)
                cur = -1
                os.rmdir(name, dir_fd=dir_fd)
                return Removal(True, used + 1)
            above, dev, ino = trail.pop()
            up = os.open("..", O_DIR, dir_fd=cur)
            ust = os.fstat(up)
            if (ust.st_dev, ust.st_ino) != (dev, ino):
                os.close(up)
                return Removal(False, used, f"{name}: moved while it was being removed")
            os.close(cur)
            cur = up
            os.rmdir(here, dir_fd=cur)
            used += 1
            here = above
    except OSError as exc:
        return Removal(False, used, f"{name}: {exc.strerror or exc}")
    finally:
        if cur >= 0:
            os.close(cur)
