"""The one writer of evidence (docs/health.md "Evidence"): at the pass where a hardware finding
first appears, one bundle for what appeared together, marked in the health state so that the same
finding on a later pass, in a restarted agent or in ``gpu-tune check`` beside it writes nothing new.

A pass (:meth:`EvidenceKeeper.keep`): the findings (:mod:`.findings`); those not marked yet in this
boot (first in this process's memory, then in ``health.json``, under its lock); their bundle
gathered, written whole, the marks saved; the bounds kept; ``nvidia-bug-report.sh`` started out of
the pass (:mod:`.bugreport`). A failure of any step is a note in the result (``/readiness``'s
``evidence``, ``gpu-tune check``'s output, the agent's log), never an exception out of the pass and
never a change of the verdict; the health state is written as before. A bundle that could not be
written is not marked: the next pass tries again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from gpu_tune.errors import HostError
from gpu_tune.judge.checks.state_file import MAX_MARKS
from gpu_tune.judge.evidence import FOLDER, Settings
from gpu_tune.judge.evidence import bugreport
from gpu_tune.judge.evidence.bundle import (BUG_STATUS, bundle_entries, bundle_name, gather, manifest, path_of,
                                            prune, write)
from gpu_tune.judge.evidence.findings import Finding, findings

log = logging.getLogger("gpu_tune")
MAX_NAMED = 3  # bundles named in one line (the Event, the Slurm line)
RETRY_S = 300.0  # a bundle that could not be written is tried again after this long (a full disk)


@dataclass(frozen=True)
class EvidenceNote:
    """What a pass says of evidence: the bundles of its findings (newest first), the one it wrote
    (``new``), and what could not be done (``notes``)."""

    bundles: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (name, finding keys)
    new: str | None = None
    notes: tuple[str, ...] = ()
    bug_report: str = ""  # the new bundle's bug report, in words
    removed: tuple[str, ...] = ()

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(path_of(n) for n, _ in self.bundles)

    @property
    def new_path(self) -> str | None:
        return path_of(self.new) if self.new else None

    def line(self) -> str:
        """One line: ``evidence: PATH (written now; ...)``, or what could not be done."""
        parts = []
        shown = self.paths[:MAX_NAMED]
        if shown:
            more = len(self.paths) - len(shown)
            parts.append(", ".join(shown) + (f" and {more} more" if more > 0 else ""))
            if self.new:
                parts[-1] += f" (written now; nvidia-bug-report.sh: {self.bug_report})" if self.bug_report \
                    else " (written now)"
        parts += list(self.notes)
        return "evidence: " + "; ".join(parts) if parts else ""

    def as_dict(self) -> dict[str, Any]:
        return {"folder": FOLDER,
                "bundles": [{"name": n, "path": path_of(n), "findings": list(keys), "new": n == self.new}
                            for n, keys in self.bundles],
                **({"bug_report": self.bug_report} if self.new else {}), "notes": list(self.notes)}


@dataclass
class EvidenceKeeper:
    """``fs``: the host; ``state``: the health state whose file holds the marks (the monitor's own);
    ``node``: named in each bundle; ``live``: whether ``--root`` is the machine this runs on (the
    bug report describes that machine: run only then; None: found from the boot ids)."""

    fs: Any
    state: Any
    settings: Settings
    node: str = ""
    live: bool | None = None
    log_notes: bool = True  # say each note once in the log (the agent); gpu-tune check prints them itself
    clock: Any = time.time
    _known: dict[str, str] = field(default_factory=dict)  # finding key -> bundle, of this boot
    _boot: Any = "?"
    _loaded: bool = False
    _workers: list[bugreport.Worker] = field(default_factory=list)
    _said: set[str] = field(default_factory=set)
    _retry_at: float = 0.0  # a write failed: the next try (this process)
    _failed: EvidenceNote = field(default_factory=lambda: EvidenceNote())

    def reap(self) -> None:
        """Workers of earlier passes that have finished, reaped (never waited for)."""
        self._workers = [w for w in self._workers if not w.reaped()]

    @property
    def running(self) -> tuple[str, ...]:
        return tuple(w.name for w in self._workers)

    def keep(self, verdict: Any, gpus: Sequence[Any], topology: Mapping[str, Any] | None, view: Any,
             doc: Mapping[str, Any]) -> EvidenceNote | None:
        """This pass's evidence (None: no finding keeps any). ``doc``: the verdict as /readiness
        has it."""
        self.reap()
        if self.settings.keep == 0:
            return None
        found = findings(verdict, gpus, view)
        if not found:
            return None
        boot = getattr(view, "boot_id", None)
        if boot != self._boot:
            self._known, self._loaded, self._boot = {}, False, boot
        if not self._loaded and any(f.key not in self._known for f in found):
            self._known.update(self._marks())
            self._loaded = True
        new = [f for f in found if f.key not in self._known]
        note = EvidenceNote()
        if new and self.clock() < self._retry_at:  # the last write failed (a full disk): not every pass
            note = self._failed
        elif new:
            note = self._failed = self._write(new, found, verdict, gpus, topology, doc, boot)
        bundles: dict[str, list[str]] = {}
        for f in found:
            name = self._known.get(f.key)
            if name is not None:
                bundles.setdefault(name, []).append(f.key)
        ordered = sorted(bundles.items(), key=lambda kv: kv[0], reverse=True)
        for text in note.notes if self.log_notes else ():
            if text not in self._said:  # said once at the default level; every pass's note carries it
                self._said.add(text)
                log.warning("%s", text)
        return EvidenceNote(tuple((n, tuple(k)) for n, k in ordered), note.new, note.notes, note.bug_report,
                            note.removed)

    def _marks(self) -> dict[str, str]:
        try:
            doc, _ = self.state.load()
        except Exception:  # noqa: BLE001 - the health state reports its own file
            return {}
        return {k: m["bundle"] for k, m in (doc.get("evidence") or {}).items() if isinstance(m, dict)}

    def _write(self, new: list[Finding], found: list[Finding], verdict: Any, gpus: Sequence[Any],
               topology: Mapping[str, Any] | None, doc: Mapping[str, Any], boot: Any) -> EvidenceNote:
        now = self.clock()
        notes: list[str] = []
        try:
            got = gather(self.fs, new, doc, gpus, topology, self.settings)
        except Exception as exc:  # noqa: BLE001 - a reading that failed is said, the pass goes on
            return EvidenceNote(notes=(f"evidence not gathered: {type(exc).__name__}: {exc}"[:300],))
        script, why = self._bug_report()
        with self.state.locked():
            state_doc, _ = self.state.load()
            marks = state_doc.setdefault("evidence", {})
            self._known.update({k: m["bundle"] for k, m in marks.items()})
            new = [f for f in new if f.key not in marks]
            if not new:  # another process (gpu-tune check beside the agent) kept it meanwhile
                return EvidenceNote()
            try:
                taken = [e.name for e in bundle_entries(self.fs)]
            except HostError:
                taken = []
            name = bundle_name(new[0], now, taken)
            status = ({"state": "starting", "script": script, "until": now + self.settings.bug_report_timeout + 5,
                       "timeout_s": self.settings.bug_report_timeout, "cap_bytes": got.log_cap}
                      if script else {"state": "not run", "why": why})
            files = {**got.files, BUG_STATUS: (_dumps(status)),
                     "manifest.json": manifest(name, new, got, now=now, node=self.node, boot=boot,
                                               settings=self.settings, bug_report=status)}
            try:
                write(self.fs, name, files)
            except HostError as exc:
                self._retry_at = now + RETRY_S
                why = str(exc).replace(f"/{name}", "")  # the same words every pass: said once
                return EvidenceNote(notes=(f"evidence of {new[0].key}: {why}; tried again at a later pass",))
            for f in new:
                marks[f.key] = {"bundle": name, "at": float(now)}
                self._known[f.key] = name
            for k in sorted(marks, key=lambda k: marks[k]["at"])[:max(0, len(marks) - MAX_MARKS)]:
                del marks[k]
            err = self.state.save(state_doc)
            if err:
                notes.append(f"{path_of(name)} is written, but not marked in the health state ({err}): this process "
                             "remembers it; a restarted one may keep another bundle of the same finding")
            removed, more = prune(self.fs, self.settings, now, keep=name)
            notes += more
        words = f"not run: {status.get('why', '')}"
        if script:
            words = self._start(name, script, got.log_cap, got.out_cap)
        return EvidenceNote(((name, tuple(f.key for f in new)),), name, tuple(notes), words, tuple(removed))

    def _bug_report(self) -> tuple[str | None, str]:
        """(the script to run, "") or (None, why it is not run)."""
        if self.settings.bug_report_timeout <= 0:
            return None, "GPU_TUNE_EVIDENCE_BUG_REPORT_TIMEOUT=0"
        live = self.live
        if live is None:
            from gpu_tune.host.kmsg import live_host

            live = self.live = live_host(self.fs)
        if not live:
            return None, f"--root {self.fs.root} is not the machine this runs on (its boot id differs)"
        if self._workers:
            return None, f"another one still runs (for {self._workers[0].name})"
        script = bugreport.find_script()
        if script is None:
            return None, f"not installed here (no {bugreport.SCRIPT} on PATH or in /usr/bin)"
        return script, ""

    def _start(self, name: str, script: str, log_cap: int, out_cap: int) -> str:
        if log_cap <= 0:
            why = "no room left in the bundle's cap (GPU_TUNE_EVIDENCE_BUNDLE_BYTES)"
            bugreport.save(self.fs, name, {"state": "not run", "why": why})
            return f"not run: {why}"
        try:
            proc = bugreport.spawn(str(self.fs.root), name, script, self.settings.bug_report_timeout, log_cap,
                                   out_cap)
        except OSError as exc:
            why = f"its worker could not start: {exc.strerror or exc}"
            bugreport.save(self.fs, name, {"state": "failed", "why": why})
            return f"failed: {why}"
        self._workers.append(bugreport.Worker(proc, name))
        return (f"running in the background (worker pid {proc.pid}), stopped after "
                f"{self.settings.bug_report_timeout:g} s")


def _dumps(doc: Mapping[str, Any]) -> bytes:
    import json

    return (json.dumps(dict(doc), indent=1) + "\n").encode()
