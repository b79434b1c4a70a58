"""The journal: originals recorded on disk, crash-safely, before any write.

``<root>/var/lib/gpu-tune/journal.json`` holds one entry per (id, target) the tool has ever
changed and not yet reverted, in the order they were first recorded. An entry is written once:
a later apply never replaces a recorded original with a value the tool itself wrote. Writes are
temp file + fsync + rename + fsync of the folder, so a crash (even SIGKILL) leaves either the old
or the new journal, never a torn one. ``<root>/var/lib/gpu-tune/lock`` serialises apply/revert.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import json
import os
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any, Iterable, Iterator

from gpu_tune.errors import HostError, InputError, LockBusy
from gpu_tune.host.fs import HostFS, NotAFile
from gpu_tune.tune.paths import clean_path

STATE_DIR = "/var/lib/gpu-tune"
JOURNAL = f"{STATE_DIR}/journal.json"
LOCK = f"{STATE_DIR}/lock"
FORMAT = 1
# An entry is a few hundred bytes; a 224-CPU node's whole profile journals about 100 KB.
JOURNAL_CAP = 64 << 20


class JournalError(HostError, InputError):
    """The journal on disk is not one this tool wrote: bad input (exit 2) naming the file and the
    entry. Still a :class:`HostError`, so an apply reports it per setting and writes nothing."""

    exit_code = 2


_SCALAR = (str, int, float, bool, type(None))
MAX_SEQ = 2**63 - 1


def _is_path(v: Any) -> bool:
    return clean_path(v)


def _is_raw(v: Any) -> bool:
    if v is None:
        return True
    try:
        base64.b64decode(v, validate=True)
    except (TypeError, ValueError):
        return False
    return True


def _check_entry(e: Any) -> str:
    """What is wrong with one journal entry, or '' when it is well formed."""
    if not isinstance(e, dict):
        return f"expected an object, got {type(e).__name__}"
    for k in ("id", "target", "family"):
        if not isinstance(e.get(k), str) or not e[k]:
            return f"{k}: expected a non-empty string, got {e.get(k)!r}"[:160]
    checks: tuple[tuple[str, Any, str], ...] = (
        ("seq", lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_SEQ,
         f"an integer 0..{MAX_SEQ}"),
        ("index", lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1023, "an integer 0..1023"),
        ("ncpus", lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 8192),
         "an integer 1..8192"),
        ("path", lambda v: v is None or _is_path(v), "an absolute path without '.', '..' or '//'"),
        ("raw", _is_raw, "base64 text"),
        ("value", lambda v: isinstance(v, _SCALAR), "a string or a number"),
        ("uuid", lambda v: v is None or isinstance(v, str), "a string"),
        ("absent", lambda v: isinstance(v, bool), "true or false"),
        ("created_dirs", lambda v: isinstance(v, list) and all(_is_path(d) for d in v),
         "a list of absolute paths without '.', '..' or '//'"),
        ("files", lambda v: isinstance(v, list) and all(
            isinstance(f, dict) and _is_path(f.get("path"))
            and isinstance(f.get("value", "0"), _SCALAR) and _is_raw(f.get("raw"))
            for f in v), "a list of {path, value, raw} objects, each path absolute without '.', '..' or '//'"),
    )
    for key, ok, want in checks:
        if key in e and not ok(e[key]):
            return f"{key}: expected {want}, got {e[key]!r}"[:160]
    return ""


def _foreign(entry: dict[str, Any]) -> str:
    """What in a well-formed entry its family would never write ('' when nothing), by the knob's
    own declaration (:attr:`gpu_tune.tune.knobs.base.Knob.writes`). An entry of a family this
    version does not know is kept and never written (revert reports it)."""
    from gpu_tune.tune.knobs import BY_FAMILY

    knob = BY_FAMILY.get(entry["family"])
    return "" if knob is None else knob.entry_problem(entry)


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Journal:
    def __init__(self, fs: HostFS) -> None:
        self.fs = fs
        self.entries: list[dict[str, Any]] = []
        self._seq = 0
        self._keys: set[tuple[str, str]] = set()

    @staticmethod
    def key(entry_or_id: Any, target: str | None = None) -> tuple[str, str]:
        if isinstance(entry_or_id, dict):
            return entry_or_id["id"], entry_or_id["target"]
        return entry_or_id, str(target)

    def load(self) -> "Journal":
        if not self.fs.exists(JOURNAL):
            self.entries = []
            self._seq = 0
            self._keys = set()
            return self
        where = f"{JOURNAL} under {self.fs.root}"
        try:
            text = self.fs.read_text(JOURNAL, limit=JOURNAL_CAP)
        except NotAFile as exc:
            why = str(exc).split(": ", 1)[-1]
            raise JournalError(f"{where}: unreadable journal ({why}); fix or move the file by hand") from None
        from gpu_tune.strict import DuplicateKey, check_text, json_loads

        try:
            doc = json_loads(text)
            check_text(doc)
            if not isinstance(doc, dict) or "entries" not in doc:
                raise ValueError('expected an object with "entries"')
            entries = doc["entries"]
            if not isinstance(entries, list):
                raise ValueError("entries is not a list")
            for n, e in enumerate(entries):
                problem = _check_entry(e)
                if problem:
                    raise ValueError(f"entry {n}: {problem}")
            for n, e in enumerate(entries):
                problem = _foreign(e)
                if problem:
                    raise JournalError(f"{where}: refused: entry {n} ({e['id']}[{e['target']}]): {problem}; "
                                       "nothing was changed: a journal names only what gpu-tune writes "
                                       "(fix or move the file by hand)"[:900])
        except DuplicateKey as exc:
            raise JournalError(f"{JOURNAL}:{exc.second} under {self.fs.root}: unreadable journal ({exc}); "
                               "originals kept in it are not lost: fix or move the file by hand") from None
        except RecursionError:
            raise JournalError(f"{where}: unreadable journal (nested too deep); originals kept in it are "
                               "not lost: fix or move the file by hand") from None
        except ValueError as exc:
            raise JournalError(f"{where}: unreadable journal ({str(exc).splitlines()[0]}); originals kept "
                               "in it are not lost: fix or move the file by hand") from None
        self.entries = entries
        self._seq = max((int(e.get("seq", 0)) for e in entries), default=0)
        self._keys = {(e["id"], e["target"]) for e in entries}
        return self

    def has(self, sid: str, target: str) -> bool:
        return (sid, target) in self._keys

    def add(self, entry: dict[str, Any]) -> bool:
        """Add an original unless one is already recorded for (id, target). Not yet on disk."""
        if self.has(entry["id"], entry["target"]):
            return False
        self._seq += 1
        self.entries.append({**entry, "seq": self._seq, "recorded_at": _now()})
        self._keys.add((entry["id"], entry["target"]))
        return True

    def remove(self, sid: str, target: str) -> None:
        self.remove_all([(sid, target)])

    def remove_all(self, keys: Iterable[tuple[str, str]]) -> None:
        """Drop the entries of these (id, target) keys: one pass, however many (a revert of
        100,000 originals removes them all at once, not one scan each)."""
        gone = set(keys) & self._keys
        if gone:
            self.entries = [e for e in self.entries if (e["id"], e["target"]) not in gone]
            self._keys -= gone

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
