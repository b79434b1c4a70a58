"""audit -> plan -> apply (journal first) -> verify, and revert. Each step takes plain data.

- :func:`audit` reads every knob the profile asks for (read-only).
- :func:`plan` is pure: the rows to change.
- :func:`apply` records originals for the planned rows (one crash-safe journal write), then
  writes, then verifies with a fresh audit.
- :func:`revert` restores every journalled original, newest first; :func:`revert_pending` only
  reads what it would still restore.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import ExitStack
from typing import Collection, Iterable, Mapping, Sequence

from gpu_tune.errors import GpuTuneError, HostError, InputError, UnsupportedWrite
from gpu_tune.gpu.base import GpuError
from gpu_tune.host.fs import HostFS
from gpu_tune.tune.journal import JOURNAL, Journal, locked
from gpu_tune.tune.knobs import BY_FAMILY, KNOBS, Context, Knob, fixable, knob_for
from gpu_tune.tune.model import Report, Setting

log = logging.getLogger("gpu_tune")


def env_seconds(name: str, default: float, most: float = 86400.0, *, least: float = 0.0,
                env: Mapping[str, str] | None = None) -> float:
    """A number of seconds from the environment variable ``name`` (``default`` when unset or
    empty): ``least`` (0) to ``most``, else :class:`InputError` naming the variable, read before
    anything is written. ``env``: where to look (this process's environment)."""
    raw = (os.environ if env is None else env).get(name, "")
    if not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not least <= value <= most:  # NaN too
        raise InputError(f"{name}={raw[:40]!r}: expected a number of seconds from {least:g} to {most:g}")
    return value


def lock_wait() -> float:
    """How long apply/revert wait for another holder of the lock (``GPU_TUNE_LOCK_TIMEOUT``)."""
    return env_seconds("GPU_TUNE_LOCK_TIMEOUT", 30.0)


def write_delay() -> float:
    """Failpoint for crash tests (``GPU_TUNE_FAILPOINT_WRITE_DELAY``): pause this many seconds
    before each write, so a test can SIGKILL an apply half-way through its writes. 0 (off)
    unless set; at most 60 s."""
    return env_seconds("GPU_TUNE_FAILPOINT_WRITE_DELAY", 0.0, most=60.0)


def make_context(fs: HostFS, profile, gpu_backend=None) -> Context:
    return Context(fs=fs, profile=profile, gpu=gpu_backend)


def _knob_for(row_id: str) -> Knob | None:
    return knob_for(row_id)


def audit(ctx: Context, knobs: Sequence[Knob] = KNOBS) -> Report:
    rows: list[Setting] = []
    for knob in knobs:
        if not knob.wanted(ctx.profile):
            continue
        try:
            rows.extend(knob.read(ctx))
        except (GpuTuneError, GpuError, OSError, ValueError) as exc:
            # one family failing to read is a row, not a failed audit
            rows.append(Setting(knob.error_id or knob.family, "-", None, "", "error", f"cannot read: {exc}"))
    return Report(ctx.profile.name, tuple(_planted_link(ctx, r) for r in rows))


def _planted_link(ctx: Context, row: Setting) -> Setting:
    """A kernel file that is missing only because a symlink in its place leads outside the root
    (followed beneath it, to nothing) is not a knob this kernel lacks: an ``error`` naming it."""
    if row.status != "unsupported" or not row.path:
        return row
    link = ctx.fs.escape(row.path)
    if link is None:
        return row
    return row.with_(status="error", detail=f"{row.path}: {link}; beneath the root it leads to no file")


def plan(rows: Iterable[Setting], only: Collection[tuple[str, str]] | None = None) -> tuple[Setting, ...]:
    """Pure: which rows apply should change: those that drift, belong to a knob that writes
    (read-only checks are reported, never changed) and, given ``only``, are in it."""
    return tuple(r for r in rows if r.status == "drift" and fixable(r.id)
                 and (only is None or (r.id, r.target) in only))


def _key(row: Setting) -> tuple[str, str]:
    return row.id, row.target


def dry_run(report: Report) -> Report:
    rows = []
    for r in report.settings:
        knob = _knob_for(r.id)
        if r.status == "drift" and knob is not None and knob.writable:
            r = r.with_(changed=False, detail=r.detail or f"would change {r.current} -> {knob.planned(r)}")
        else:
            r = r.with_(changed=False)
        rows.append(r)
    return Report(report.profile, tuple(rows))


def apply(ctx: Context, *, dry: bool = False, lock_timeout: float | None = None,
          knobs: Sequence[Knob] = KNOBS, only: Collection[tuple[str, str]] | None = None) -> Report:
    """Apply the profile. ``only`` limits the writes to these (id, target) keys (the agent's
    per-setting rate limit); the returned rows still cover every setting.

    One hold of the apply/revert lock covers the whole run, audit -> plan -> write -> verify, so
    a concurrent apply or revert can neither change what this run planned from nor show its
    values to this run's verify. ``dry`` only reads and takes no lock."""
    if dry:
        return dry_run(audit(ctx, knobs))
    wait = lock_wait() if lock_timeout is None else lock_timeout
    delay = write_delay()
    with ExitStack() as held:
        try:
            held.enter_context(locked(ctx.fs, timeout=wait))
            no_lock = ""
        except HostError as exc:  # the lock file cannot be created (read-only or full state folder)
            no_lock = f"not changed: cannot record the original first: {exc}"
        return _apply_locked(ctx, knobs, only, no_lock, delay)


def _apply_locked(ctx: Context, knobs: Sequence[Knob], only: Collection[tuple[str, str]] | None,
                  no_lock: str, delay: float = 0.0) -> Report:
    before = audit(ctx, knobs)
    changes = plan(before.settings, only)
    if not changes:
        return Report(before.profile, tuple(r.with_(changed=False) for r in before.settings))
    if no_lock:
        return Report(before.profile, tuple(
            (r.with_(status="error", detail=no_lock) if r in changes else r).with_(changed=False)
            for r in before.settings))

    failed: dict[tuple[str, str], str] = {}
    unsupported: dict[tuple[str, str], str] = {}
    written: set[tuple[str, str]] = set()
    recorded: dict[tuple[str, str], dict] = {}  # originals first recorded by this run
    try:
        try:
            journal = Journal(ctx.fs).load()
        except HostError as exc:
            raise _JournalDown(str(exc)) from None
        clear_interrupted_writes(ctx.fs, journal)
        for row in changes:
            knob = _knob_for(row.id)
            if knob is None:
                failed[_key(row)] = "no knob for this id"
                continue
            if journal.has(row.id, row.target):
                continue  # the first original stays; never record our own value
            try:
                snap = knob.snapshot(ctx, row)
            except (HostError, GpuError) as exc:
                failed[_key(row)] = f"cannot record original: {exc}"
                continue
            entry = {"id": row.id, "target": row.target, "family": knob.family, **snap}
            journal.add(entry)
            recorded[_key(row)] = entry
        try:
            journal.save()
        except HostError as exc:
            raise _JournalDown(str(exc)) from None
        # originals are on disk: now write
        never_written: list[tuple[str, str]] = []
        for row in changes:
            k = _key(row)
            if k in failed:
                continue
            knob = _knob_for(row.id)
            if delay:
                time.sleep(delay)
            try:
                knob.apply(ctx, row)
                written.add(k)
            except UnsupportedWrite as exc:
                unsupported[k] = str(exc)
            except (HostError, GpuError) as exc:
                failed[k] = str(exc)
            else:
                continue
            # the write failed: an original recorded by this run for a target that still holds
            # it byte for byte was never overwritten; revert has nothing to restore there
            if k in recorded and knob.unchanged(ctx, recorded[k]):
                never_written.append(k)
        if never_written:
            journal.remove_all(never_written)
            try:
                journal.save()
            except HostError as exc:  # the entries stay; revert finds them unchanged and skips them
                log.warning("journal: could not drop originals that were never overwritten: %s", exc)
    except _JournalDown as exc:
        for row in changes:
            failed[_key(row)] = f"not changed: cannot record the original first: {exc}"

    # verify with a fresh read (a new context: nothing cached from before the writes)
    vctx = Context(fs=ctx.fs, profile=ctx.profile, gpu=ctx.gpu, _topology=ctx._topology)
    after = audit(vctx, knobs)
    rows = []
    for r in after.settings:
        k = _key(r)
        changed = k in written
        if k in unsupported:
            r = r.with_(status="unsupported", detail=unsupported[k])
        elif k in failed and r.status in ("drift", "error"):
            r = r.with_(status="error", detail=failed[k])
        elif changed and r.status == "drift":
            r = r.with_(status="error", detail=f"wrote {r.desired!r} but it reads back {r.current!r}")
        rows.append(r.with_(changed=changed))
    return Report(after.profile, tuple(rows))


class _JournalDown(Exception):
    pass


def clear_interrupted_writes(fs: HostFS, journal: Journal) -> list[str]:
    """Remove what an apply or revert killed in the middle of a crash-safe write left behind:
    the temporary files beside the journal and beside every regular file it records (a kill
    just before the rename of ``allocator.env`` leaves ``.allocator.env.<hex>``, which would
    keep the folder made for it from being removed). Called with the lock held, so no write
    of those files is in flight. Returns the host paths removed."""
    paths = {JOURNAL}
    for e in journal.entries:
        if e.get("family") not in BY_FAMILY:
            continue  # a family this version does not know: its files are never touched here
        files = e.get("files") if isinstance(e.get("files"), list) else [e]
        paths.update(f["path"] for f in files if isinstance(f, dict) and isinstance(f.get("path"), str))
    # one listing per folder, however many of its files the journal names
    folders: dict[str, set[str]] = {}
    kernel: dict[str, bool] = {}  # per folder: a kernel file's folder holds kernel files only
    for path in sorted(paths):
        parent, _, name = path.rpartition("/")
        if path != JOURNAL:
            if parent not in kernel:
                kernel[parent] = fs.is_kernel_file(path)
            if kernel[parent]:
                continue  # written in place: no temporary file
        folders.setdefault(parent or "/", set()).add(name)
    removed: list[str] = []
    for folder, names in folders.items():
        try:
            removed += fs.remove_temporaries_in(folder, names)
        except HostError as exc:
            log.warning("cannot clear what an interrupted write left in %s: %s", folder, exc)
    if removed:
        log.info("removed what interrupted writes left: %s", ", ".join(removed))
    return removed


def revert(ctx: Context, *, lock_timeout: float | None = None) -> tuple[bool, tuple[Setting, ...]]:
    """Restore every recorded original, newest first. Returns (all restored, rows).

    An original whose target still holds it byte for byte (the apply's write never happened)
    is not written again. A failure is a row, never an exception: a target that cannot be
    written keeps its entry; a journal that cannot be updated afterwards (a full disk) is a
    last row with id ``journal``, and the journal stays as it was, so a later revert restores
    what is still missing (the targets already restored are then found unchanged)."""
    rows: list[Setting] = []
    wait = lock_wait() if lock_timeout is None else lock_timeout
    if not ctx.fs.exists(JOURNAL):
        return True, ()  # nothing recorded: nothing to restore (and nothing to lock)
    with ExitStack() as held:
        try:
            held.enter_context(locked(ctx.fs, timeout=wait))
        except HostError as exc:
            return False, (Setting("journal", "-", None, "", "error", f"nothing restored: {exc}", JOURNAL),)
        journal = Journal(ctx.fs).load()
        clear_interrupted_writes(ctx.fs, journal)
        done: list[tuple[str, str]] = []  # restored or in place: dropped from the journal at the end
        for entry in journal.newest_first():
            sid, target = entry["id"], entry["target"]
            original = entry.get("value")
            knob = BY_FAMILY.get(entry.get("family", ""))
            if knob is None:
                rows.append(Setting(sid, target, None, str(original), "error",
                                    f"no knob {entry.get('family')!r} in this version; entry kept"))
                continue
            if knob.unchanged(ctx, entry):
                done.append((sid, target))
                rows.append(Setting(sid, target, str(original), str(original), "ok",
                                    "the original is in place: nothing to write", entry.get("path"),
                                    changed=False))
                continue
            try:
                current = knob.current_value(ctx, entry)
            except (HostError, GpuError, OSError):
                current = None
            try:
                knob.restore(ctx, entry)
            except (HostError, GpuError, OSError) as exc:
                rows.append(Setting(sid, target, current, str(original), "error", f"not restored: {exc}",
                                    entry.get("path")))
                continue
            done.append((sid, target))
            rows.append(Setting(sid, target, current, str(original), "ok", "restored", entry.get("path"),
                                changed=True))
        if done:
            journal.remove_all(done)
            try:
                journal.save()
            except HostError as exc:
                rows.append(Setting("journal", "-", None, "", "error",
                                    f"cannot update the journal: {exc}; it keeps all "
                                    f"{len(journal.entries) + len(done)} originals for the next revert", JOURNAL))
    ok = all(r.status == "ok" for r in rows)
    return ok, tuple(rows)


def revert_pending(ctx: Context) -> tuple[Setting, ...]:
    """What :func:`revert` would still restore, read only (no lock, no write): one ``drift`` row
    (current value, ``desired`` the original) per journalled original that is not back in place,
    newest first. Empty: every original is back (or nothing was recorded). A journal that is not
    this tool's raises :class:`~gpu_tune.tune.journal.JournalError`."""
    if not ctx.fs.exists(JOURNAL):
        return ()
    rows: list[Setting] = []
    for entry in Journal(ctx.fs).load().newest_first():
        sid, target, original = entry["id"], entry["target"], entry.get("value")
        knob = BY_FAMILY.get(entry.get("family", ""))
        if knob is None:
            rows.append(Setting(sid, target, None, str(original), "error",
                                f"no knob {entry.get('family')!r} in this version", entry.get("path")))
            continue
        if knob.unchanged(ctx, entry):
            continue
        try:
            current = knob.current_value(ctx, entry)
        except (HostError, GpuError, OSError):
            current = None
        if current is not None and original is not None and current == str(original):
            continue
        rows.append(Setting(sid, target, current, str(original), "drift", "original not restored yet",
                            entry.get("path")))
    return tuple(rows)
