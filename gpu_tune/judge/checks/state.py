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

A state file this tool cannot have written (not JSON, not a regular file, too large) is set aside:
its reason is a warning of the ``gpu.xid`` check and a new file is started.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from gpu_tune.errors import HostError
from gpu_tune.gpu.base import GpuInfo
from gpu_tune.judge.checks.catalog import catalog

HEALTH_STATE = "/var/lib/gpu-tune/health.json"
HEALTH_LOCK = "/var/lib/gpu-tune/.health.lock"
STATE_CAP = 4 << 20
MAX_RECORDS = 512  # fatal (S)XID records kept per boot
MAX_BOOTS = 8  # boots remembered per fatal XID
MAX_HISTORY = 512
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
    source: str = "kernel log"

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
    state_error: str | None = None  # the state file could not be used (a new one was started)


def _bus_key(bus: str) -> str:
    """An XID names ``0000:1b:00`` (no function); GPUs are ``0000:1b:00.0``: compare without it."""
    b = bus.lower()
    return b.rsplit(".", 1)[0] if b.count(":") == 2 and "." in b.rsplit(":", 1)[1] else b


class HealthState:
    """The remembered health facts of the host under ``fs`` (None: nothing is kept on disk)."""

    def __init__(self, fs: Any = None, *, clock=time.time) -> None:
        self.fs = fs
        self.clock = clock
        self._clocks: dict[int, deque[tuple[int, frozenset[str]]]] = {}
        self._replays: dict[int, deque[tuple[float, int]]] = {}
        self._ib: dict[str, tuple[bool, int | None]] = {}
        self._flaps: dict[str, deque[float]] = {}

    # -- disk ------------------------------------------------------------------------------
    def _empty(self, boot_id: str | None) -> dict[str, Any]:
        return {"version": 1, "boot_id": boot_id, "records": {}, "cleared": {}, "history": {},
                "nvml_baseline": {}, "applied_tokens": [], "cleared_words": []}

    def load(self) -> tuple[dict[str, Any], str | None]:
        if self.fs is None:
            return getattr(self, "_mem", None) or self._empty(None), None
        try:
            text = self.fs.read_optional(HEALTH_STATE, limit=STATE_CAP)
        except HostError as exc:
            return self._empty(None), f"{HEALTH_STATE}: {exc}; a new one is started"
        if not text:
            return self._empty(None), None
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict) or doc.get("version") != 1 or not isinstance(doc.get("records"), dict):
                raise ValueError("not a health state of this tool")
            for key in ("cleared", "history", "nvml_baseline"):
                if not isinstance(doc.get(key, {}), dict):
                    raise ValueError(f"{key} is not an object")
        except (ValueError, RecursionError) as exc:
            return self._empty(None), f"{HEALTH_STATE}: {str(exc)[:120]}; a new one is started"
        for key, empty in self._empty(None).items():
            doc.setdefault(key, empty)
        return doc, None

    def save(self, doc: dict[str, Any]) -> str | None:
        if self.fs is None:
            self._mem = doc
            return None
        try:
            self.fs.write_file_atomic(HEALTH_STATE, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode(),
                                      mode=0o644)
        except HostError as exc:
            return f"{HEALTH_STATE} not written: {exc}"
        return None

    def _locked(self):
        """An exclusive lock on the state folder's lock file (None where it cannot be had)."""
        import contextlib
        import fcntl
        import os

        @contextlib.contextmanager
        def held():
            fd = -1
            if self.fs is not None:
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

    # -- one pass --------------------------------------------------------------------------
    def observe(self, host: Any, gpus: Sequence[GpuInfo], *, clear_tokens: Iterable[str] = ()) -> HealthView:
        """Take this pass's readings in (``host``: a HostHealth, or None when not read) and say
        what is remembered. ``clear_tokens``: values of the Node's set-healthy label."""
        now = self.clock()
        with self._locked():
            doc, err = self.load()
            before = json.dumps(doc, sort_keys=True)
            boot = getattr(host, "boot_id", None) or doc.get("boot_id")
            if boot and doc.get("boot_id") != boot:
                history, tokens = doc.get("history", {}), doc.get("applied_tokens", [])
                doc = self._empty(boot)  # a new boot: what the last one saw is history only
                doc["history"], doc["applied_tokens"] = history, tokens
            for token in clear_tokens:
                if token and token not in doc["applied_tokens"]:
                    self._clear(doc, None, getattr(host, "uptime_usec", None), now, f"the Node's set-healthy label {token}")
                    doc["applied_tokens"] = (doc["applied_tokens"] + [token])[-16:]
            self._take_kernel(doc, host, now)
            self._take_nvml(doc, gpus, now)
            if json.dumps(doc, sort_keys=True) != before:
                werr = self.save(doc)
                err = err or werr
        self._take_windows(host, gpus, now)
        return self._view(doc, err)

    def clear(self, bus: str | None = None, *, uptime_usec: int | None, why: str) -> list[str]:
        """Forget this boot's fatal XIDs (of one GPU's address, or all): an operator reset the GPU.
        Returns the records cleared, in words."""
        now = self.clock()
        with self._locked():
            doc, _ = self.load()
            gone = self._clear(doc, bus, uptime_usec, now, why)
            self.save(doc)
        return gone

    def _clear(self, doc: dict[str, Any], bus: str | None, uptime_usec: int | None, now: float, why: str) -> list[str]:
        key = _bus_key(bus) if bus else "*"
        newest = max([r.get("last_usec") or 0 for r in doc["records"].values()] + [uptime_usec or 0])
        doc["cleared"][key] = {"usec": newest, "epoch": now}
        gone = []
        for k in list(doc["records"]):
            r = doc["records"][k]
            if key == "*" or _bus_key(r["bus"]) == key:
                gone.append(f"{r['kind'].upper()} {r['code']} on {r['bus']}")
                del doc["records"][k]
        doc["cleared_words"] = (doc.get("cleared_words", []) + [
            f"{why}: {', '.join(gone) if gone else 'nothing to clear'}"])[-4:]
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
                last_usec: int | None, message: str, now: float, source: str) -> None:
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
            if len(doc["records"]) >= MAX_RECORDS:
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
                r["count"] = int(r.get("count", 0)) + count
            if last_usec is not None and (prev_last is None or last_usec > int(prev_last)):
                r["last_usec"] = last_usec

    def _take_kernel(self, doc: dict[str, Any], host: Any, now: float) -> None:
        cat = catalog()
        for s in getattr(host, "xids", ()) or ():
            entry = cat.xid(s.code) if s.kind == "xid" else cat.sxid(s.code)
            fatal = entry.fatal_for(s.message) if entry is not None else (s.kind == "sxid" and s.severity_word == "Fatal")
            if not fatal:
                continue
            if s.last_usec is not None and self._is_cleared(doc, s.bus, s.last_usec, now):
                continue
            self._record(doc, s.kind, s.bus, s.code, s.count, s.first_usec, s.last_usec, s.message, now, "kernel log")

    def _take_nvml(self, doc: dict[str, Any], gpus: Sequence[GpuInfo], now: float) -> None:
        """XIDs from NVML's events (what the GPU backend saw while running, no kernel time): a
        code counts as new when it shows up more often than at the previous pass; a clear after
        that pass makes every one seen so far old."""
        cat = catalog()
        base = doc["nvml_baseline"]
        for g in gpus:
            if not g.pci_bus_id:
                continue
            counts: dict[int, int] = {}
            for code in g.xid_events:
                counts[int(code)] = counts.get(int(code), 0) + 1
            bus = _bus_key(g.pci_bus_id)
            cleared_at = max(float((doc["cleared"].get(k) or {}).get("epoch") or 0) for k in ("*", bus))
            for code, n in counts.items():
                entry = cat.xid(code)
                if entry is None or not entry.fatal:
                    continue
                bkey = f"{bus}/{code}"
                b = base.get(bkey)
                if isinstance(b, dict) and cleared_at > float(b.get("at") or 0):
                    base[bkey] = {"n": n, "at": now}
                    continue
                prev = int(b.get("n") or 0) if isinstance(b, dict) else 0
                if n > prev:
                    self._record(doc, "xid", bus, code, n - prev, None, None, entry.name, now, "NVML events")
                    base[bkey] = {"n": n, "at": now}

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

    def _view(self, doc: dict[str, Any], err: str | None) -> HealthView:
        records = []
        for key, r in sorted(doc["records"].items()):
            boots = len(doc["history"].get(key, [])) or 1
            records.append(XidRecord(kind=r["kind"], bus=r["bus"], code=int(r["code"]), count=int(r.get("count", 1)),
                                     first_seen=float(r.get("first_seen") or 0), first_usec=r.get("first_usec"),
                                     last_usec=r.get("last_usec"), message=str(r.get("message") or ""), boots=boots,
                                     source=str(r.get("source") or "kernel log")))
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
                          minutes_observed=observed, replay_rates=rates, ib_flaps=flaps, state_error=err)
