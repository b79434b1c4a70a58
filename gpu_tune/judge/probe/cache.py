"""The probe's persistent XLA compilation cache folder, in the agent's state folder: sound and bounded.

``<root>/var/lib/gpu-tune/xla-cache/`` holds one folder per TensorFlow version, device model,
driver and compilation settings (named by the workload, ``gpu_tune.workload.compile_cache``); in
each, the executables TensorFlow compiled (one file per program: the probe's two throughput
regimes). TensorFlow in the probe process writes them itself, so the state folder is created here
beneath ``--root`` through :class:`~gpu_tune.host.fs.HostFS` (:func:`cache_folder`) and the cache's
path in it handed over.

Sound: the cache holds code the probe loads and runs, so before each probe run :func:`upkeep`
checks all of it (``gpu_tune.workload.cache_guard``: every entry a regular file or a folder of
this process' user, writable by no one else, no symbolic link, bounded in depth and entries). A
cache folder that is not sound is set aside whole (renamed to ``.xla-cache.trash-*`` beside it)
and made afresh; a key folder that is not sound is set aside (``xla-cache/.trash-*``) and the
workload makes it afresh; each is said in the verdicts' notes. What was set aside is removed by
this and later runs, at most :data:`REMOVE_BUDGET` entries a run, never following a link. Where
the cache cannot be made sound (the state folder refuses a rename, the lock is held for
:data:`LOCK_WAIT_S`), the probe runs without it, and the notes say why.

Bounded: key folders are set aside, least recently used first (the workload touches the one it
uses), until at most :data:`MAX_FOLDERS` remain and together they hold at most :data:`MAX_BYTES`;
and temporary files a killed compilation left behind (TensorFlow writes ``*.tmp`` and renames)
are removed once they are an hour old. One probe's entries on an H100 are a few MB; a driver or
TensorFlow upgrade starts a new folder and the old one ages out.
"""

from __future__ import annotations

import fcntl
import fnmatch
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpu_tune.errors import HostError
from gpu_tune.workload import cache_guard as guard

STATE_DIR = "/var/lib/gpu-tune"
CACHE_NAME = "xla-cache"
CACHE_DIR = f"{STATE_DIR}/{CACHE_NAME}"
LOCK_NAME = ".xla-cache.lock"
LOCK = f"{STATE_DIR}/{LOCK_NAME}"
TRASH = ".xla-cache.trash-"  # a whole cache set aside, in the state folder
KEY_TRASH = ".trash-"  # a key folder set aside, in the cache folder
OLD_LOCK = ".lock"  # where earlier versions locked, inside the cache folder
MAX_BYTES = 512 << 20
MAX_FOLDERS = 8
MAX_TOP = 64  # entries of the cache folder (key folders and what is being removed)
MAX_STATE_SCAN = 4096  # entries of the state folder looked through for a cache set aside
REMOVE_BUDGET = 20_000  # entries removed per run
STALE_TMP_S = 3600.0
LOCK_WAIT_S = 5.0


def cache_folder(fs) -> tuple[str | None, str | None]:
    """(the cache's path in this process' filesystem, None), or (None, why there is none). Makes
    the state folder and the cache's lock file beneath the root, refusing links out; the cache
    folder itself is :func:`upkeep`'s."""
    try:
        os.close(fs.open_lock_file(LOCK))
        return str(fs.path(fs.realpath(STATE_DIR)) / CACHE_NAME), None
    except (HostError, OSError) as exc:
        return None, f"compilation cache not used: {exc}"


@dataclass
class Upkeep:
    """The cache folder to hand the workload (None: run without it), what the run should say
    about it, and what the bound removed."""

    folder: str | None
    notes: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


def _lock(pfd: int, wait_s: float, notes: list[str], where: Path) -> tuple[int | None, str | None]:
    """The cache's lock, held (a lock file that is not a regular file is set aside and made
    afresh, said in ``notes``); or (None, why not)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        st = os.stat(LOCK_NAME, dir_fd=pfd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            new = _aside(pfd, LOCK_NAME, TRASH)
            notes.append(f"compilation cache: {where / LOCK_NAME} is a {guard.kind(st.st_mode)}, not a regular file; "
                         f"set aside as {where / new} (removed by this and later runs) and made afresh")
    except FileNotFoundError:
        pass
    except OSError as exc:
        return None, exc.strerror or str(exc)
    try:
        fd = os.open(LOCK_NAME, flags, 0o600, dir_fd=pfd)
    except OSError as exc:
        return None, exc.strerror or str(exc)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # replaced meanwhile
        os.close(fd)
        return None, f"a {guard.kind(st.st_mode)}, not a regular file"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd, None
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None, f"held by another process for {wait_s:g} s"
            time.sleep(0.05)
        except OSError as exc:
            os.close(fd)
            return None, exc.strerror or str(exc)


def _aside(dir_fd: int, name: str, prefix: str) -> str:
    """Rename ``name`` to a fresh ``prefix...`` name in the same folder (the entry itself, never
    what a link points at); the new name. Raises OSError."""
    new = f"{prefix}{time.time_ns()}-{os.getpid()}"
    os.rename(name, new, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    return new


class _Run:
    """One upkeep: the notes, what was removed, and the removal budget left."""

    def __init__(self, path: Path, budget: int) -> None:
        self.path, self.budget = path, budget
        self.notes: list[str] = []
        self.removed: list[str] = []
        self.uid = os.geteuid()

    def empty_trash(self, dir_fd: int, names: list[str], where: Path) -> None:
        for name in names:
            if self.budget <= 0:
                return
            r = guard.remove(dir_fd, name, budget=self.budget)
            self.budget -= r.removed
            if r.error:
                self.notes.append(f"compilation cache: could not remove {where / name}: {r.error}")

    def cache_root(self, pfd: int) -> int:
        """A descriptor of the cache folder, sound at its top (set aside and made afresh where it
        was not). Raises OSError."""
        path = self.path
        try:
            st = os.stat(CACHE_NAME, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None:
            why = guard.fault(st, str(path), uid=self.uid, folder=True)
            if why is None:
                cfd = guard.open_dir(CACHE_NAME, pfd)
                fst = os.fstat(cfd)
                if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
                    why = f"{path} was replaced while it was checked"
                else:
                    with os.scandir(cfd) as it:
                        if sum(1 for _ in zip(range(MAX_TOP + 1), it)) <= MAX_TOP:
                            return cfd
                    why = f"{path} holds more than {MAX_TOP} entries"
                os.close(cfd)
            new = _aside(pfd, CACHE_NAME, TRASH)
            self.notes.append(f"compilation cache: {why}; set aside as {path.parent / new} (removed by this "
                              "and later runs) and made afresh")
        os.mkdir(CACHE_NAME, 0o700, dir_fd=pfd)
        cfd = guard.open_dir(CACHE_NAME, pfd)
        why = guard.fault(os.fstat(cfd), str(path), uid=self.uid, folder=True)
        if why:
            os.close(cfd)
            raise OSError(0, why)
        return cfd

    def keys(self, cfd: int, now: float) -> list[tuple[float, str, int]]:
        """(mtime, name, bytes) of each sound key folder; the others set aside, each said."""
        sound = []
        for name in sorted(os.listdir(cfd)):
            if name.startswith(KEY_TRASH):
                continue
            what = f"{self.path}/{name}"
            try:
                st = os.stat(name, dir_fd=cfd, follow_symlinks=False)
                if name == OLD_LOCK and stat.S_ISREG(st.st_mode):
                    os.unlink(name, dir_fd=cfd)  # an earlier version's lock, no longer used
                    continue
                why, size = self.key(cfd, name, st, what, now)
            except OSError as exc:
                why, size = f"{what}: {exc.strerror or exc}", 0
            if why is None:
                sound.append((st.st_mtime, name, size))
                continue
            try:
                _aside(cfd, name, KEY_TRASH)
            except OSError as exc:
                raise OSError(exc.errno, f"{why}, and it could not be set aside ({exc.strerror or exc})") from None
            self.notes.append(f"compilation cache: {why}; {what} set aside (removed by this and later runs): "
                              "the probe compiles afresh")
        return sound

    def key(self, cfd: int, name: str, st: os.stat_result, what: str, now: float) -> tuple[str | None, int]:
        """(why the key folder ``name`` is not sound or None, the bytes it holds); its stale
        temporary files removed. Raises OSError."""
        why = guard.fault(st, what, uid=self.uid, folder=True)
        if why:
            return why, 0
        kfd = guard.open_dir(name, cfd)
        try:
            walked = guard.walk(kfd, what, uid=self.uid)
            if walked.fault is None:
                self.stale_tmp(kfd, name, now)
            return walked.fault, walked.bytes
        finally:
            os.close(kfd)

    def stale_tmp(self, kfd: int, key: str, now: float) -> None:
        for name in os.listdir(kfd):
            if fnmatch.fnmatch(name, "*.tmp*"):
                try:
                    st = os.stat(name, dir_fd=kfd, follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode) and now - st.st_mtime > STALE_TMP_S:
                        os.unlink(name, dir_fd=kfd)
                        self.removed.append(f"{key}/{name}")
                except OSError:
                    pass  # gone meanwhile: nothing to remove


def upkeep(folder: str, *, max_bytes: int = MAX_BYTES, max_folders: int = MAX_FOLDERS, now: float | None = None,
           budget: int = REMOVE_BUDGET, lock_wait_s: float = LOCK_WAIT_S) -> Upkeep:
    """Make the cache at ``folder`` (``<state folder>/xla-cache``, as :func:`cache_folder` gives
    it) sound and keep it under its bound; say what it did. Never raises for what it finds on
    disk: a cache it cannot make sound is not used, and the notes say why."""
    path = Path(folder)
    now = time.time() if now is None else now
    run = _Run(path, budget)

    def off(why: str) -> Upkeep:
        return Upkeep(None, run.notes + [f"compilation cache not used: {why}"], run.removed)

    try:
        pfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        return off(f"{path.parent}: {exc.strerror or exc}")
    try:
        lfd, why = _lock(pfd, lock_wait_s, run.notes, path.parent)
        if lfd is None:
            return off(f"{path.parent / LOCK_NAME}: {why}")
        try:
            try:
                cfd = run.cache_root(pfd)
            except OSError as exc:
                return off(f"{path}: {exc.strerror or exc}")
            try:
                try:
                    sound = run.keys(cfd, now)
                except OSError as exc:
                    return off(exc.strerror or str(exc))
                sound.sort(reverse=True)  # most recently used first
                kept, total = 0, 0
                for _mtime, name, size in sound:
                    if kept < max_folders and total + size <= max_bytes:
                        kept, total = kept + 1, total + size
                        continue
                    try:
                        _aside(cfd, name, KEY_TRASH)
                        run.removed.append(name)
                    except OSError as exc:
                        run.notes.append(f"compilation cache: could not remove {path / name}: {exc.strerror or exc}")
                run.empty_trash(cfd, sorted(n for n in os.listdir(cfd) if n.startswith(KEY_TRASH)), path)
            finally:
                os.close(cfd)
            with os.scandir(pfd) as it:
                aside = [e.name for _, e in zip(range(MAX_STATE_SCAN), it) if e.name.startswith(TRASH)]
            run.empty_trash(pfd, sorted(aside), path.parent)
        finally:
            os.close(lfd)
    except OSError as exc:
        return off(f"{path}: {exc.strerror or exc}")
    finally:
        os.close(pfd)
    return Upkeep(str(path), run.notes, run.removed)
