"""The journal: originals recorded on disk, crash-safely, before any write.

``<root>/var/lib/gpu-tune/journal.json`` holds one entry per (id, target) the tool has ever
changed and not yet reverted, in the order they were first recorded. An entry is written once:
a later apply never replaces a recorded original with a value the tool itself wrote. Writes are
temp file + fsync + rename + fsync of the folder, so a crash (even SIGKILL) leaves either the old
or the new journal, never a torn one. ``<root>/var/lib/gpu-tune/lock`` serialises apply/revert.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any, Iterator

from .errors import HostError, LockBusy
from .hostfs import HostFS

STATE_DIR = "/var/lib/gpu-tune"
JOURNAL = f"{STATE_DIR}/journal.json"
LOCK = f"{STATE_DIR}/lock"
FORMAT = 1


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Journal:
    def __init__(self, fs: HostFS) -> None:
        self.fs = fs
        self.entries: list[dict[str, Any]] = []
        self._seq = 0

    @staticmethod
    def key(entry_or_id: Any, target: str | None = None) -> tuple[str, str]:
        if isinstance(entry_or_id, dict):
            return entry_or_id["id"], entry_or_id["target"]
        return entry_or_id, str(target)

    def load(self) -> "Journal":
        if not self.fs.exists(JOURNAL):
            self.entries = []
            self._seq = 0
            return self
        text = self.fs.read_text(JOURNAL)
        try:
            doc = json.loads(text)
            entries = doc["entries"]
            if not isinstance(entries, list):
                raise ValueError("entries is not a list")
            for n, e in enumerate(entries):
                if not isinstance(e, dict) or not all(isinstance(e.get(k), str) for k in ("id", "target", "family")):
                    raise ValueError(f"entry {n} lacks id/target/family")
        except (ValueError, KeyError, TypeError) as exc:
            raise HostError(f"{JOURNAL}: unreadable journal ({exc}); originals kept in it are not lost: "
                            "fix or move the file by hand") from None
        self.entries = entries
        self._seq = max((int(e.get("seq", 0)) for e in entries), default=0)
        return self

    def has(self, sid: str, target: str) -> bool:
        return any(e["id"] == sid and e["target"] == target for e in self.entries)

    def add(self, entry: dict[str, Any]) -> bool:
        """Add an original unless one is already recorded for (id, target). Not yet on disk."""
        if self.has(entry["id"], entry["target"]):
            return False
        self._seq += 1
        self.entries.append({**entry, "seq": self._seq, "recorded_at": _now()})
        return True

    def remove(self, sid: str, target: str) -> None:
        self.entries = [e for e in self.entries if not (e["id"] == sid and e["target"] == target)]

    def save(self) -> None:
        doc = {"format": FORMAT, "entries": self.entries}
        data = json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"
        self.fs.write_file_atomic(JOURNAL, data, mode=0o600)

    def newest_first(self) -> list[dict[str, Any]]:
        return sorted(self.entries, key=lambda e: int(e.get("seq", 0)), reverse=True)


def acquire(fs: HostFS, timeout: float = 30.0) -> int:
    """Take the apply/revert lock: a descriptor of ``<root>/var/lib/gpu-tune/lock`` holding an
    exclusive flock (closing it releases the lock). Waits up to ``timeout`` seconds, then raises
    :class:`LockBusy`; :class:`HostError` when the lock file cannot be created."""
    try:
        fd = fs.open_lock_file(LOCK)
    except HostError as exc:
        raise HostError(f"cannot take the apply/revert lock: {exc}", exc.errno) from None
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise HostError(f"{LOCK}: {exc.strerror}") from None
                if time.monotonic() >= deadline:
                    holder = ""
                    try:
                        holder = os.pread(fd, 32, 0).decode().strip()
                    except OSError:
                        pass
                    who = f" (pid {holder})" if holder.isdigit() else ""
                    raise LockBusy(f"another gpu-tune apply or revert is running{who}; "
                                   f"it holds {LOCK}; waited {timeout:.0f}s") from None
                time.sleep(0.1)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        except OSError:
            pass
    except BaseException:
        os.close(fd)
        raise
    return fd


def release(fd: int) -> None:
    """Let go of the lock taken by :func:`acquire`."""
    os.close(fd)  # closing the descriptor releases the flock


@contextmanager
def locked(fs: HostFS, timeout: float = 30.0) -> Iterator[None]:
    """Hold the apply/revert lock; wait up to ``timeout`` seconds, then raise :class:`LockBusy`."""
    fd = acquire(fs, timeout)
    try:
        yield
    finally:
        release(fd)
