"""Repeat rules (``readiness.xid: {N: {action, count, within}}``): the bursts of each XID a rule
counts, per GPU, kept in the health state (``repeats`` of ``health.json``) so that an agent that
restarts, ``gpu-tune check`` and a node that reboots count the same bursts; and whether a rule
applies (docs/health.md "Your policy").

A burst (:data:`~gpu_tune.discover.xids.BURST_GAP_USEC`) is timed by the kernel log's own clock:
microseconds since boot, compared within one boot whatever the wall clock does; and, for a window
``across boots``, its wall time too (the boot's start, read as now less ``/proc/uptime``, plus its
kernel time). A rule applies when ``count`` bursts on one GPU lie within the window of each other
(the first and the last at most the window apart; ``within: boot``: anywhere in this boot), and the
last of them is in this boot. What it then does is the policy's (:mod:`~gpu_tune.judge.checks.xid_policy`):
a fatal action is recorded as a fatal XID by the state; ``restart_app`` is a warning while that last
burst lies within the window of now. A clear (``gpu-tune set-healthy``) forgets the GPU's bursts up
to it: the count starts again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from gpu_tune.discover.xids import merge_burst
from gpu_tune.judge.checks.state_file import MAX_REPEAT_BURSTS, MAX_REPEAT_KEYS, bus_key

__all__ = ["Firing", "Recurring", "evaluate", "forget", "take"]


@dataclass(frozen=True)
class Firing:
    """A repeat rule that applies: on ``bus`` for XID ``code``, ``bursts`` of them within the
    window that ends at the last (``last_usec`` kernel time in this boot), ``earlier_boots`` of
    those in boots before this one; ``holds``: its action holds now (a warning's window has not
    passed since)."""

    bus: str
    code: int
    bursts: int
    first_usec: int | None
    last_usec: int
    earlier_boots: int
    holds: bool


@dataclass(frozen=True)
class Recurring:
    """A repeat rule whose action is ``restart_app`` and holds now: a warning (``gpu.xid_recurring``).
    ``rule``: the rule in words (``restart_app after 5 within 24h``); ``by``: where it comes from."""

    firing: Firing
    rule: str
    by: str


def key(bus: str, code: int) -> str:
    return f"xid/{bus_key(bus)}/{code}"


def take(doc: dict[str, Any], sighting: Any, boot: str | None, boot_epoch: float, since_usec: int | None) -> None:
    """Put one read's bursts of ``sighting`` (an XID a rule counts) into the state, for ``boot``
    (None: the boot cannot be known, nothing is kept); bursts up to ``since_usec`` (a clear in this
    boot) are not counted again."""
    if boot is None or not sighting.bursts:
        return
    k = key(sighting.bus, sighting.code)
    kept = doc.setdefault("repeats", {})
    if k not in kept and len(kept) >= MAX_REPEAT_KEYS:
        return
    mine = [[b["s"], b["e"], 1] for b in kept.get(k, []) if b["boot"] == boot]
    for first, last, _n in sighting.bursts:
        if since_usec is None or last > since_usec:
            merge_burst(mine, first, last)
    others = [b for b in kept.get(k, []) if b["boot"] != boot]
    fresh = [{"boot": boot, "s": s, "e": e, "at": round(boot_epoch + s / 1e6, 3)} for s, e, _n in mine]
    if others or fresh:
        kept[k] = sorted(others + fresh, key=lambda b: b["at"])[-MAX_REPEAT_BURSTS:]


def forget(doc: dict[str, Any], bus: str | None) -> None:
    """A clear: the bursts of one GPU's address (or all) are counted no more, in every boot."""
    kept = doc.get("repeats") or {}
    for k in list(kept):
        if bus is None or k.split("/")[1] == bus_key(bus):
            del kept[k]


def evaluate(doc: dict[str, Any], rules: dict[int, Any], boot: str | None, now_usec: int | None,
             now_epoch: float) -> Iterable[Firing]:
    """The rules that apply now (see the module's note); nothing when the boot cannot be known."""
    if boot is None:
        return
    for k, bursts in sorted((doc.get("repeats") or {}).items()):
        _, bus, code = k.split("/")
        rule = rules.get(int(code))
        if rule is None:
            continue
        win = rule.repeat.within
        if win.across_boots:
            times = [(b["at"], b) for b in bursts]
        else:
            times = [(b["s"] / 1e6, b) for b in bursts if b["boot"] == boot]
        times.sort(key=lambda t: t[0])
        span = float("inf") if win.seconds is None else float(win.seconds)
        n = rule.repeat.count
        for j in range(len(times) - 1, n - 2, -1):
            if times[j][0] - times[j - n + 1][0] <= span:
                break
        else:
            continue
        last = times[j][1]
        if last["boot"] != boot:
            continue  # the count was made in an earlier boot: a reboot followed it
        inside = [b for t, b in times[:j + 1] if times[j][0] - t <= span]
        now = now_epoch if win.across_boots else (None if now_usec is None else now_usec / 1e6)
        holds = win.seconds is None or now is None or now - times[j][0] <= span
        mine = [b["s"] for b in inside if b["boot"] == boot]
        yield Firing(bus, int(code), len(inside), min(mine) if mine else None, last["s"],
                     sum(1 for b in inside if b["boot"] != boot), holds)
