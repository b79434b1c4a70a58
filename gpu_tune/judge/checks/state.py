"""What the health checks remember between passes (docs/health.md "What is remembered").

On disk, ``<root>/var/lib/gpu-tune/health.json`` (the agent's state folder), so an agent that
restarts, and ``gpu-tune check`` / ``gpu-tune set-healthy`` run beside it, agree:

- the fatal XIDs (and fatal SXids) seen in this boot, per PCI address and code. A fatal XID keeps
  the node not ready until the boot id changes (the node rebooted) or an operator clears it after
  a GPU reset (``gpu-tune set-healthy``, or the Node label ``gpu-tune.io/set-healthy``): a clear
  records the kernel's time, and only records after it count again;
- per fatal XID, the boots it was seen in (at most :data:`MAX_BOOTS`): the same fatal XID in a
  third boot escalates to "inspect the hardware".

In memory only (the agent's own readings over time; ``gpu-tune check`` has one reading):

- clock event reasons per GPU and minute, over the last :data:`WINDOW_MINUTES` minutes;
- PCIe replay counter readings per GPU over the same window (a rate);
- InfiniBand ports' ``link_downed`` counters and states between passes (flaps).

A state file this tool cannot have written (:mod:`gpu_tune.judge.checks.state_file`) is set aside
(renamed to ``health.json.bad``): its reason is a warning of the ``gpu.health_state`` check and a
new file is started.

What this process has seen in this boot is kept in memory too, whatever the disk does: a state
folder that is full, or a file that cannot be written, loses nothing while the process runs (the
agent reads the kernel log once, so the disk is not where it would find an XID again); the
``gpu.health_state`` warning says what could not be saved.

The boot: fatal XIDs and clears belong to one boot. When the boot cannot be known (no readable
boot id, or one that changes under a running process, which no real reboot does) nothing is
cleared and nothing is forgotten: an older boot's clear never hides this boot's XID.
"""

from __future__ import annotations

import copy
import errno
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from gpu_tune.errors import HostError
from gpu_tune.gpu.base import GpuInfo
from gpu_tune.judge.checks import repeats, state_file
from gpu_tune.judge.checks.catalog import FATAL_ACTIONS, catalog
from gpu_tune.judge.checks.xid_policy import CATALOG, XidPolicy
from gpu_tune.judge.checks.state_file import (HEALTH_LOCK, HEALTH_STATE, MAX_BOOTS, MAX_HISTORY, MAX_RECORDS,
                                              MAX_COUNT, MAX_TOKENS, MAX_WORDS, STATE_CAP, bus_key)

__all__ = ["ESCALATE_BOOTS", "HEALTH_LOCK", "HEALTH_STATE", "MAX_BOOTS", "MAX_HISTORY", "MAX_RECORDS", "STATE_CAP",
           "ClearResult", "HealthState", "HealthView", "ReplayRate", "XidRecord"]

ESCALATE_BOOTS = 3  # seen in this many boots: inspect the hardware
WINDOW_MINUTES = 10
FLAP_WINDOW_S = 3600.0
SLOWDOWNS = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")


@dataclass(frozen=True)
class XidRecord:
    """A fatal XID (or SXid) seen in this boot and not cleared."""

    kind: str  # "xid" | "sxid"
    bus: str
    code: int
    count: int
    first_seen: float  # epoch seconds this agent (or check) first saw it
    first_usec: int | None  # kernel time (microseconds since boot); None from NVML events
    last_usec: int | None
    message: str
    boots: int  # boots this (address, code) was seen in, this one included
    source: str = "kernel log"  # or "NVML events", or "repeat rule" (the rule's count made it fatal)
    action: str = "reset_gpu"  # the policy's action for it (gpu_tune.judge.checks.xid_policy)
    by: str = ""  # where that action comes from: "" the catalog, else the profile's rule in words

    @property
    def key(self) -> str:
        return f"{self.kind}/{self.bus}/{self.code}"

    @property
    def escalated(self) -> bool:
        return self.boots >= ESCALATE_BOOTS


@dataclass(frozen=True)
class ReplayRate:
    per_minute: float
    minutes: float  # the span it was measured over


@dataclass(frozen=True)
class HealthView:
    """The remembered facts a pass judges by (frozen: one per pass)."""

    boot_id: str | None = None
    records: tuple[XidRecord, ...] = ()  # fatal XIDs and SXids of this boot, not cleared
    cleared: tuple[str, ...] = ()  # what the latest clears covered, in words
    slowdown_minutes: Mapping[int, Mapping[str, int]] = field(default_factory=dict)  # GPU -> reason -> minutes
    minutes_observed: Mapping[int, int] = field(default_factory=dict)  # GPU -> minutes with a reading
    replay_rates: Mapping[int, ReplayRate] = field(default_factory=dict)
    ib_flaps: Mapping[str, int] = field(default_factory=dict)  # port -> flaps within FLAP_WINDOW_S
    state_error: str | None = None  # the state file could not be used (set aside, a new one was started)
    save_error: str | None = None  # the state could not be written: what this process saw is kept in memory
    unsaved: tuple[str, ...] = ()  # the fatal XIDs, in words, that are in memory only
    boot_note: str | None = None  # the boot cannot be known: no clear applies, nothing is forgotten
    recurring: tuple[repeats.Recurring, ...] = ()  # repeat rules whose restart_app holds now (warnings)


@dataclass(frozen=True)
class ClearResult:
    """What ``set-healthy`` did: the records cleared (in words), or why nothing was."""

    cleared: tuple[str, ...] = ()
    error: str | None = None  # nothing was saved: the node stays as it was
    note: str | None = None  # the state file was set aside first


_bus_key = bus_key


class HealthState:
    """The remembered health facts of the host under ``fs`` (None: nothing is kept on disk)."""

    def __init__(self, fs: Any = None, *, clock=time.time, policy: XidPolicy | None = None,
                 read_only: bool = False) -> None:
        self.fs = fs
        self.read_only = read_only  # read the state file, never write it (nor its lock, nor set it aside)
        self.clock = clock
        self.policy = policy or CATALOG  # what each XID weighs (the profile's readiness.xid over the catalog)
        self._clocks: dict[int, deque[tuple[int, frozenset[str]]]] = {}
        self._replays: dict[int, deque[tuple[float, int]]] = {}
        self._ib: dict[str, tuple[bool, int | None]] = {}
        self._flaps: dict[str, deque[float]] = {}
        self._mem: dict[str, Any] | None = None  # the document, where nothing is kept on disk
        self._first_boot: str | None = None  # the boot id this process read first
        self._kept: dict[str, dict[str, Any]] = {}  # this process's fatal records of its boot
        self.aside_note: str | None = None  # the last save set a symlink aside first

    # -- disk ------------------------------------------------------------------------------
    def _empty(self, boot_id: str | None) -> dict[str, Any]:
        return state_file.empty(boot_id)

    def load(self) -> tuple[dict[str, Any], str | None]:
        if self.fs is None:
            return copy.deepcopy(self._mem) if self._mem is not None else self._empty(None), None
        return state_file.load(self.fs, read_only=self.read_only)

    def save(self, doc: dict[str, Any]) -> str | None:
        if self.fs is None or self.read_only:
            self._mem = copy.deepcopy(doc)
            return None
        try:
            data = state_file.dump(doc)
            state_file.parse(data.decode())  # never a file the reader would set aside
        except ValueError as exc:
            return f"{HEALTH_STATE} not written: the state does not fit the file's form ({exc})"
        for attempt in (1, 2):
            try:
                self.fs.write_file_atomic(HEALTH_STATE, data, mode=0o644)
                return None
            except HostError as exc:
                if attempt == 1 and exc.errno == errno.ELOOP:  # a symlink the reader could not follow
                    self.aside_note = state_file.set_aside(self.fs, "a symlink")
                    continue
                return f"{HEALTH_STATE} not written: {str(exc).removeprefix(HEALTH_STATE + ': ')}"
        return None  # pragma: no cover

    def locked(self):
        """The state folder's lock (``with state.locked(): ...``), as :meth:`observe` holds it."""
        return self._locked()

    def _locked(self):
        """An exclusive lock on the state folder's lock file (None where it cannot be had)."""
        import contextlib
        import fcntl
        import os

        @contextlib.contextmanager
        def held():
            fd = -1
            if self.fs is not None and not self.read_only:
                try:
                    fd = self.fs.open_lock_file(HEALTH_LOCK)
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except (HostError, OSError):
                    fd = -1
            try:
                yield
            finally:
                if fd >= 0:
                    os.close(fd)

        return held()

    def _boot(self, host: Any) -> tuple[str | None, str | None]:
        """(this boot's id, None), or (None, why the boot cannot be known)."""
        read = getattr(host, "boot_id", None) if host is not None else None
        if read and self._first_boot is None:
            self._first_boot = read
        if not read:
            why = getattr(host, "boot_problem", None) if host is not None else "the host was not read"
            return None, (f"the boot id cannot be read ({why or 'not there'}): no clear applies and no fatal XID "
                          "is forgotten")
        if read != self._first_boot:
            return None, (f"the boot id changed while this process runs ({self._first_boot} -> {read}), which no "
                          "reboot does: the boot cannot be known, no clear applies and no fatal XID is forgotten")
        return read, None

    @staticmethod
    def _new_boot(doc: dict[str, Any], boot: str) -> dict[str, Any]:
        """A new boot: what the last one saw is history only."""
        fresh = state_file.empty(boot)
        fresh["history"], fresh["applied_tokens"] = doc.get("history", {}), doc.get("applied_tokens", [])
        fresh["repeats"] = doc.get("repeats", {})  # a window across boots counts the boots before
        return fresh

    # -- one pass --------------------------------------------------------------------------
    def observe(self, host: Any, gpus: Sequence[GpuInfo], *, clear_tokens: Iterable[str] = ()) -> HealthView:
        """Take this pass's readings in (``host``: a HostHealth, or None when not read) and say
        what is remembered. ``clear_tokens``: values of the Node's set-healthy label."""
        now = self.clock()
        boot, boot_note = self._boot(host)
        with self._locked():
            doc, err = self.load()
            before = state_file.dump(doc)
            if boot is not None and doc.get("boot_id") != boot:
                doc = self._new_boot(doc, boot)
            # what this process has seen in this boot, whatever the disk kept (a full disk, a file
            # set aside, another process that read another boot id): never forgotten, unless cleared
            for key, r in self._kept.items():
                if key in doc["records"] or len(doc["records"]) >= MAX_RECORDS:
                    continue
                if boot is not None and self._is_cleared(doc, r["bus"], r.get("last_usec"), r["first_seen"]):
                    continue
                doc["records"][key] = dict(r)
            for token in clear_tokens:
                if not token or token in doc["applied_tokens"]:
                    continue
                if boot is None:
                    boot_note = f"{boot_note}; the Node's set-healthy label {token} is not acted on"
                    continue
                self._clear(doc, None, getattr(host, "uptime_usec", None), now, f"the Node's set-healthy label {token}")
                doc["applied_tokens"] = (doc["applied_tokens"] + [token])[-MAX_TOKENS:]
            gpu_buses = frozenset(_bus_key(g.pci_bus_id) for g in gpus if g.pci_bus_id)
            uptime = getattr(host, "uptime_usec", None)
            if boot is not None and doc.get("boot_started") is None and uptime is not None:
                doc["boot_started"] = float(max(0, round(now - uptime / 1e6)))
            self._take_kernel(doc, host, now, clears=boot is not None, gpu_buses=gpu_buses, boot=boot)
            self._take_nvml(doc, gpus, now, clears=boot is not None)
            recurring = self._take_repeats(doc, boot, uptime, now, gpu_buses)
            self.aside_note = None
            werr = self.save(doc) if state_file.dump(doc) != before else None
            err = err or self.aside_note
        self._kept = {k: dict(r) for k, r in doc["records"].items()}
        self._take_windows(host, gpus, now)
        unsaved = tuple(f"{r['kind'].upper()} {r['code']} on {r['bus']}"
                        for _, r in sorted(doc["records"].items())) if werr else ()
        return self._view(doc, err, werr, unsaved, boot_note, recurring)

    def clear(self, bus: str | None = None, *, uptime_usec: int | None, why: str) -> ClearResult:
        """Forget this boot's fatal XIDs (of one GPU's address, or all): an operator reset the GPU.
        Refused when the boot cannot be known (a clear holds for one boot) or nothing can be saved."""
        now = self.clock()
        boot = None
        if self.fs is not None:
            from gpu_tune.discover.sysfs_health import read_boot_id

            got = read_boot_id(self.fs)
            if got.value is None:
                return ClearResult(error=f"nothing cleared: {got.problem}: a clear holds for one boot, and this "
                                         "one cannot be known")
            boot = got.value
        with self._locked():
            doc, err = self.load()
            if boot is not None and doc.get("boot_id") != boot:
                doc = self._new_boot(doc, boot)
            gone = self._clear(doc, bus, uptime_usec, now, why)
            self.aside_note = None
            werr = self.save(doc)
            err = err or self.aside_note
        if werr:
            return ClearResult(error=f"nothing cleared: {werr}", note=err)
        return ClearResult(cleared=tuple(gone), note=err)

    def _clear(self, doc: dict[str, Any], bus: str | None, uptime_usec: int | None, now: float, why: str) -> list[str]:
        key = _bus_key(bus) if bus else "*"
        newest = max([r.get("last_usec") or 0 for r in doc["records"].values()] + [uptime_usec or 0])
        doc["cleared"][key] = {"usec": newest, "epoch": now}
        repeats.forget(doc, bus)
        marks = doc.get("evidence") or {}
        for k in [k for k in marks if key == "*" or _bus_key((k.split("/") + [""])[1]) == key]:
            del marks[k]  # that GPU's findings are new again: the next one keeps its own evidence
        gone = []
        for k in list(doc["records"]):
            r = doc["records"][k]
            if key == "*" or _bus_key(r["bus"]) == key:
                gone.append(f"{r['kind'].upper()} {r['code']} on {r['bus']}")
                del doc["records"][k]
        doc["cleared_words"] = (doc.get("cleared_words", []) + [
            f"{why}: {', '.join(gone) if gone else 'nothing to clear'}"[:4096]])[-MAX_WORDS:]
        return gone

    def _is_cleared(self, doc: dict[str, Any], bus: str, usec: int | None, seen: float) -> bool:
        for key in ("*", _bus_key(bus)):
            c = doc["cleared"].get(key)
            if not c:
                continue
            if usec is not None and usec <= int(c.get("usec") or 0):
                return True
            if usec is None and seen <= float(c.get("epoch") or 0):
                return True
        return False

    def _record(self, doc: dict[str, Any], kind: str, bus: str, code: int, count: int, first_usec: int | None,
                last_usec: int | None, message: str, now: float, source: str,
                gpu_buses: frozenset[str] = frozenset()) -> None:
        key = f"{kind}/{_bus_key(bus)}/{code}"
        boot = doc.get("boot_id") or ""
        hist = doc["history"].setdefault(key, [])
        if boot and boot not in hist:
            hist.append(boot)
            del hist[:-MAX_BOOTS]
        if len(doc["history"]) > MAX_HISTORY:
            for old in list(doc["history"])[:len(doc["history"]) - MAX_HISTORY]:
                del doc["history"][old]
        r = doc["records"].get(key)
        if r is None:
            if len(doc["records"]) >= MAX_RECORDS and not self._make_room(doc, bus, gpu_buses):
                return
            doc["records"][key] = {"kind": kind, "bus": bus, "code": code, "count": count, "first_seen": now,
                                   "first_usec": first_usec, "last_usec": last_usec, "message": message[:240],
                                   "source": source}
        else:
            prev_last = r.get("last_usec")
            if first_usec is not None and prev_last is not None and first_usec <= int(prev_last):
                # a reader that read the log from its start again (a restart, gpu-tune check): these
                # records include the ones already counted
                r["count"] = max(int(r.get("count", 0)), count)
            else:
                r["count"] = min(int(r.get("count", 0)) + count, MAX_COUNT)
            if last_usec is not None and (prev_last is None or last_usec > int(prev_last)):
                r["last_usec"] = last_usec

    @staticmethod
    def _make_room(doc: dict[str, Any], bus: str, gpu_buses: frozenset[str]) -> bool:
        """The records are full: a record of one of this host's GPUs takes the place of the oldest
        one of an address where no GPU is (a flood of invented addresses never crowds out a GPU's)."""
        if _bus_key(bus) not in gpu_buses:
            return False
        others = [(r["first_seen"], k) for k, r in doc["records"].items() if _bus_key(r["bus"]) not in gpu_buses]
        if not others:
            return False
        del doc["records"][min(others)[1]]
        return True

    def _since(self, doc: dict[str, Any], bus: str) -> int | None:
        """The kernel time of the latest clear that covers ``bus`` in this boot (None: none)."""
        marks = [int((doc["cleared"].get(k) or {}).get("usec") or 0) for k in ("*", _bus_key(bus))
                 if doc["cleared"].get(k)]
        return max(marks) if marks else None

    def _take_kernel(self, doc: dict[str, Any], host: Any, now: float, *, clears: bool = True,
                     gpu_buses: frozenset[str] = frozenset(), boot: str | None = None) -> None:
        started = doc.get("boot_started")
        for s in getattr(host, "xids", ()) or ():
            if s.bursts and self.policy.timed(s.kind, s.code):
                repeats.take(doc, s, boot, started if started is not None else now, self._since(doc, s.bus))
            if not self.policy.fatal_for(s.kind, s.code, s.message, s.severity_word):
                continue
            if clears and s.last_usec is not None and self._is_cleared(doc, s.bus, s.last_usec, now):
                continue
            self._record(doc, s.kind, s.bus, s.code, min(s.count, MAX_COUNT), s.first_usec, s.last_usec, s.message,
                         now, "kernel log", gpu_buses)

    def _take_nvml(self, doc: dict[str, Any], gpus: Sequence[GpuInfo], now: float, *, clears: bool = True) -> None:
        """XIDs from NVML's events (what the GPU backend saw while running, no kernel time): a
        code counts as new when it shows up more often than at the previous pass; a clear after
        that pass makes every one seen so far old."""
        base = doc["nvml_baseline"]
        for g in gpus:
            if not g.pci_bus_id:
                continue
            counts: dict[int, int] = {}
            for code in g.xid_events:
                counts[int(code)] = counts.get(int(code), 0) + 1
            bus = _bus_key(g.pci_bus_id)
            cleared_at = max(float((doc["cleared"].get(k) or {}).get("epoch") or 0) for k in ("*", bus)) if clears else 0.0
            for code, n in counts.items():
                if not self.policy.fatal_for("xid", code):
                    continue
                entry = catalog().xid(code)
                bkey = f"{bus}/{code}"
                b = base.get(bkey)
                if isinstance(b, dict) and cleared_at > float(b.get("at") or 0):
                    base[bkey] = {"n": n, "at": now}
                    continue
                prev = int(b.get("n") or 0) if isinstance(b, dict) else 0
                if n > prev:
                    self._record(doc, "xid", bus, code, n - prev, None, None, entry.name if entry else f"XID {code}",
                                 now, "NVML events")
                    base[bkey] = {"n": n, "at": now}

    def _take_repeats(self, doc: dict[str, Any], boot: str | None, uptime: int | None, now: float,
                      gpu_buses: frozenset[str]) -> tuple[repeats.Recurring, ...]:
        """The repeat rules that apply (gpu_tune.judge.checks.repeats): a fatal action is recorded as
        a fatal XID of this boot (held until a reboot or a clear, like any other); ``restart_app`` is
        returned, a warning, while it holds."""
        rules = self.policy.repeats
        out = []
        for f in repeats.evaluate(doc, rules, boot, uptime, now):
            rule = rules[f.code]
            if rule.action not in FATAL_ACTIONS:
                if f.holds:
                    out.append(repeats.Recurring(f, rule.words(), self.policy.source(f.code)))
                continue
            k = repeats.key(f.bus, f.code)
            r = doc["records"].get(k)
            if r is not None:
                r["count"] = max(int(r.get("count", 0)), f.bursts)
                r["last_usec"] = max(int(r.get("last_usec") or 0), f.last_usec)
            elif not self._is_cleared(doc, f.bus, f.last_usec, now):
                earlier = f" ({f.earlier_boots} in earlier boots)" if f.earlier_boots else ""
                words = f"{f.bursts} bursts{earlier}; {rule.words()}"  # the rule's words: see _weighed
                self._record(doc, "xid", f.bus, f.code, f.bursts, f.first_usec, f.last_usec, words, now,
                             "repeat rule", gpu_buses)
        return tuple(out)

    def _weighed(self, r: dict[str, Any]) -> tuple[str, str] | None:
        """(action, where it comes from) of a remembered record under this policy; None when the
        policy does not weigh it fatal (any more: a profile changed since it was recorded)."""
        code = int(r["code"])
        if r["kind"] == "sxid":
            return "reboot", ""
        if r.get("source") == "repeat rule":  # made by the rule the profile has now (its words end the message)?
            rule = self.policy.repeat(code)
            mine = rule is not None and rule.action in FATAL_ACTIONS and str(r.get("message") or "").endswith(
                f"; {rule.words()}")
            return (rule.action, self.policy.source(code)) if mine else None
        if not self.policy.fatal_for("xid", code, str(r.get("message") or "")):
            return None
        return self.policy.action(code) or "reset_gpu", self.policy.source(code)

    def _take_windows(self, host: Any, gpus: Sequence[GpuInfo], now: float) -> None:
        minute = int(now // 60)
        for g in gpus:
            if g.error:
                continue
            q = self._clocks.setdefault(g.index, deque())
            reasons = frozenset(r for r in g.clock_throttle_reasons if r in SLOWDOWNS)
            if q and q[-1][0] == minute:
                q[-1] = (minute, q[-1][1] | reasons)
            else:
                q.append((minute, reasons))
            while q and q[0][0] <= minute - WINDOW_MINUTES:
                q.popleft()
            if g.pcie_replay_count is not None:
                r = self._replays.setdefault(g.index, deque())
                if r and g.pcie_replay_count < r[-1][1]:
                    r.clear()  # the counter started again (driver reloaded)
                r.append((now, int(g.pcie_replay_count)))
                while len(r) > 1 and r[0][0] < now - WINDOW_MINUTES * 60:
                    r.popleft()
        for p in getattr(host, "ib_ports", ()) or ():
            prev = self._ib.get(p.name)
            flaps = 0
            if prev is not None:
                was_up, downed = prev
                if p.link_downed is not None and downed is not None and p.link_downed > downed:
                    flaps = p.link_downed - downed
                elif was_up != p.up:
                    flaps = 1
            self._ib[p.name] = (p.up, p.link_downed)
            q2 = self._flaps.setdefault(p.name, deque())
            q2.extend([now] * min(flaps, 1000))
            while q2 and q2[0] < now - FLAP_WINDOW_S:
                q2.popleft()

    def _view(self, doc: dict[str, Any], err: str | None, save_error: str | None = None, unsaved: tuple[str, ...] = (),
              boot_note: str | None = None, recurring: tuple[repeats.Recurring, ...] = ()) -> HealthView:
        records = []
        for key, r in sorted(doc["records"].items()):
            weighed = self._weighed(r)
            if weighed is None:
                continue
            boots = len(doc["history"].get(key, [])) or 1
            records.append(XidRecord(kind=r["kind"], bus=r["bus"], code=int(r["code"]), count=int(r.get("count", 1)),
                                     first_seen=float(r.get("first_seen") or 0), first_usec=r.get("first_usec"),
                                     last_usec=r.get("last_usec"), message=str(r.get("message") or ""), boots=boots,
                                     source=str(r.get("source") or "kernel log"), action=weighed[0], by=weighed[1]))
        slow = {i: {reason: sum(1 for _, rs in q if reason in rs) for reason in SLOWDOWNS}
                for i, q in self._clocks.items()}
        observed = {i: len(q) for i, q in self._clocks.items()}
        rates = {}
        for i, q in self._replays.items():
            if len(q) >= 2 and q[-1][0] - q[0][0] >= 30:
                span = (q[-1][0] - q[0][0]) / 60.0
                rates[i] = ReplayRate((q[-1][1] - q[0][1]) / span, span)
        flaps = {name: len(q) for name, q in self._flaps.items()}
        return HealthView(boot_id=doc.get("boot_id"), records=tuple(records),
                          cleared=tuple(doc.get("cleared_words", [])), slowdown_minutes=slow,
                          minutes_observed=observed, replay_rates=rates, ib_flaps=flaps, state_error=err,
                          save_error=save_error, unsaved=unsaved, boot_note=boot_note, recurring=recurring)
