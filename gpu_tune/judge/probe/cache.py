"""The probe's persistent XLA compilation cache folder, in the agent's state folder, kept bounded.

``<root>/var/lib/gpu-tune/xla-cache/`` holds one folder per TensorFlow version, device model,
driver and compilation settings (named by the workload, ``gpu_tune.workload.compile_cache``); in
each, the executables TensorFlow compiled (one file per program: the probe's two throughput
regimes). TensorFlow in the probe process writes them itself, so the folder is created here,
beneath ``--root`` through :class:`~gpu_tune.host.fs.HostFS`, and handed over as a path.

Bounded: before each probe run :func:`prune` removes whole key folders, least recently used
first (the workload touches the one it uses), until at most :data:`MAX_FOLDERS` remain and
together they hold at most :data:`MAX_BYTES`; and temporary files a killed compilation left
behind (TensorFlow writes ``*.tmp`` and renames) once they are an hour old. One probe's entries on
an H100 are a few MB; a driver or TensorFlow upgrade starts a new folder and the old one ages out.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from pathlib import Path

from gpu_tune.errors import HostError

CACHE_DIR = "/var/lib/gpu-tune/xla-cache"
LOCK = CACHE_DIR + "/.lock"
MAX_BYTES = 512 << 20
MAX_FOLDERS = 8
STALE_TMP_S = 3600.0


def cache_folder(fs) -> tuple[str | None, str | None]:
    """(the folder's path in this process' filesystem, None), or (None, why there is none)."""
    try:
        os.close(fs.open_lock_file(LOCK))  # creates the folders beneath the root, refusing links out
        return str(fs.path(fs.realpath(CACHE_DIR))), None
    except (HostError, OSError) as exc:
        return None, f"compilation cache not used: {exc}"


def _size(folder: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(folder):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def prune(folder: str, *, max_bytes: int = MAX_BYTES, max_folders: int = MAX_FOLDERS,
          now: float | None = None) -> list[str]:
    """Keep the cache under its bound; returns what was removed. Another gpu-tune pruning at the
    same moment (the lock is held) leaves it to that one."""
    base = Path(folder)
    now = time.time() if now is None else now
    try:
        fd = os.open(base / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return []
    removed: list[str] = []
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return []
        try:
            entries = [p for p in base.iterdir() if p.is_dir() and not p.is_symlink()]
        except OSError:
            return []
        for d in entries:
            for tmp in d.glob("*.tmp*"):
                try:
                    if now - tmp.lstat().st_mtime > STALE_TMP_S:
                        tmp.unlink()
                        removed.append(f"{d.name}/{tmp.name}")
                except OSError:
                    pass
        sized = []
        for d in entries:
            try:
                sized.append((d.stat().st_mtime, d, _size(d)))
            except OSError:
                continue
        sized.sort(key=lambda x: x[0], reverse=True)  # most recently used first
        kept, total = 0, 0
        for _mtime, d, size in sized:
            if kept < max_folders and total + size <= max_bytes:
                kept, total = kept + 1, total + size
                continue
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    finally:
        os.close(fd)
    return removed
