"""The blast-radius limit, ``readiness.max_out_of_service``: how many nodes gpu-tune holds out of
service at once. A decision about the fleet, not the node: both schedulers' adapters ask it before
they take a node out (a Slurm drain, a taint, the hardware condition set to False), and the race
handling lives here and nowhere else.

**The arithmetic** (:func:`allowed`): a count is that many nodes; a percentage is of M, the nodes
gpu-tune judges (which nodes those are is the adapter's to say: docs/slurm.md for Slurm), rounded
down, but never below one node while the percentage is above 0 (10% of 8 nodes is 1, of 5,000 is
500); 0 (or 0%) reports only: no node is taken out. N, the nodes out of service by gpu-tune, counts
only gpu-tune's own taking out (on Slurm: a drain whose reason starts ``gpu-tune:``), never an
administrator's.

**The decision** (:func:`admit`, pure): ``take_out`` while N < L; past it ``limit_reached``: the node
is reported not ready, truthfully, and left in service, and every surface says "limit reached: N of M
nodes out of service by gpu-tune (limit L)". A node already out counts itself and stays out: the limit
bounds taking out, never keeping out a node that is still not ready.

**The race** (:func:`take_out`, :func:`converge`), over a :class:`Store` each scheduler's adapter
implements. Many nodes turn not ready in the same second, and each counts before it writes:

- a store that can **compare and set** (:attr:`Store.compare_and_set`; the Kubernetes adapter: a
  shared object written with the ``resourceVersion`` it was read at) takes the node out only if the
  fleet is still as counted; a conflict counts again (at most :data:`TRIES` times, then the node is
  not taken out: the limit never yields to a busy store). It never overshoots, so it never converges;
- a store that cannot (Slurm: ``scontrol update`` is unconditional) counts, writes, waits one tick
  of the store's stamps (:attr:`Store.tick_s`; Slurm stamps a reason to the second), then counts
  again and **ranks**: the nodes out by gpu-tune in the order the store stamped them
  (:attr:`Out.since`, then the name), the same order on every node that reads the same fleet. A
  node ranked at or past L puts itself back (:meth:`Store.put_back`) and says so. The wait makes
  the rank final: a write that lands after this count was stamped in a later tick and ranks behind
  this node, and every write ranked ahead of it landed before the count. So the first L nodes in
  that order never put themselves back, and every node behind them does: the fleet converges within
  the racing passes to exactly min(L, nodes not ready) out, never fewer. A write whose writer never
  learnt that it landed (no answer in time), or a count after the write that could not be read,
  is left to a later pass of that node: the adapter calls :func:`settle` until a count read after
  every racing write could have landed (:data:`SETTLE_MARGIN_S` past the pass's deadline for its
  store) finds it within the limit.

Counting happens only when a node is about to be taken out (or is settling after it was): a ready
node, and a node already out and settled, never count the fleet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Protocol

from gpu_tune.tune.readiness import OutOfService

TAKE, KEPT, LIMIT, PUT_BACK, NOT_OUT = "take_out", "kept", "limit_reached", "put_back", "not_out"
TRIES = 5  # counts a compare-and-set store gets before the node is left in service
SETTLE_MARGIN_S = 5.0  # beyond a racing pass's deadline: a killed write that slurmctld still applies


def allowed(limit: OutOfService, judged: int) -> int:
    """L: the most nodes out of service by gpu-tune, of ``judged`` (M)."""
    if limit.report_only:
        return 0
    if limit.count is not None:
        return limit.count
    return max(1, judged * (limit.hundredths or 0) // 10_000)


@dataclass(frozen=True)
class Out:
    """One node out of service by gpu-tune: its name and the store's stamp of when it was taken
    out (text that sorts as time does; Slurm: the reason's time, in UTC)."""

    node: str
    since: str


@dataclass(frozen=True)
class Census:
    """One read of the fleet: M, the nodes out by gpu-tune, and the store's version of what was
    read (a compare-and-set token; "" for a store without one)."""

    judged: int
    out: tuple[Out, ...]
    version: str = ""

    def ranked(self) -> list[Out]:
        return sorted(self.out, key=lambda o: (o.since, o.node))

    def rank(self, node: str) -> int | None:
        """0-based place of ``node`` among the nodes out (None: not out)."""
        return next((i for i, o in enumerate(self.ranked()) if o.node == node), None)


class Store(Protocol):
    """What a scheduler's adapter gives the limit. ``census`` reads the fleet once. ``take_out``
    writes the node's taking out: with ``compare_and_set``, only if the fleet is still as
    ``census`` read it (False: it changed, count again); without, unconditionally (True).
    ``put_back`` undoes this node's own taking out (only ever called on a store without
    compare-and-set). ``failures``: the errors its calls raise when the store cannot be read or
    written; one raised before anything was written goes to the caller, one after it becomes the
    outcome's ``problem`` (the node stays as written, and a later pass counts again)."""

    compare_and_set: bool
    failures: tuple[type[Exception], ...]
    tick_s: float  # how finely the store stamps a taking out (Slurm: 1 s); 0 with compare-and-set

    def census(self) -> Census: ...

    def take_out(self, node: str, census: Census) -> bool: ...

    def put_back(self, node: str, says: str) -> None: ...


@dataclass(frozen=True)
class Outcome:
    """What the limit decided for one node: ``action`` (take_out, kept, limit_reached, put_back;
    not_out: written, but the count after it does not find it out: someone undid or replaced it),
    N (out by gpu-tune as counted, this node included when it is out), M, L, the limit as written,
    and this node's rank among the nodes out (0-based; None when not out or not ranked)."""

    action: str
    out: int
    judged: int
    allowed: int
    limit: str
    rank: int | None = None
    tries: int = 1  # counts a compare-and-set store took
    settled: bool = False  # no racing write can change this outcome any more (see settle())
    problem: str = ""  # what could not be done after the write (a count, a putting back)

    @property
    def taken(self) -> bool:
        """The node is (still) out of service by gpu-tune."""
        return self.action in (TAKE, KEPT)

    @property
    def reached(self) -> str:
        """``limit reached: 6 of 21 nodes out of service by gpu-tune (limit 5)``."""
        if self.allowed == 0:
            return f"report only: readiness.max_out_of_service is {self.limit}"
        shown = self.limit if self.limit.isdigit() else f"{self.limit} of {self.judged} = {self.allowed}"
        return f"limit reached: {self.out} of {self.judged} nodes out of service by gpu-tune (limit {shown})"

    @property
    def says(self) -> str:
        """One phrase for the scheduler's line."""
        if self.problem:
            counted = f"{self.out} of {self.judged} nodes out of service by gpu-tune" if self.judged else "out"
            return f"{counted} (limit {self.limit}); {self.problem}"
        if self.action == LIMIT:
            return self.reached
        if self.action == NOT_OUT:
            return (f"not out by gpu-tune when counted after the write ({self.out} of {self.judged} out, "
                    f"limit {self.limit})")
        if self.action == PUT_BACK:
            return (f"{self.reached}: put back in service, ranked {_nth(self.rank)} of the nodes out by the time "
                    "their taking out was stamped")
        return f"{self.out} of {self.judged} nodes out of service by gpu-tune, this one included (limit {self.limit})"

    def as_dict(self) -> dict:
        return {"action": self.action, "out": self.out, "judged": self.judged, "allowed": self.allowed,
                "max_out_of_service": self.limit, "rank": self.rank, "settled": self.settled,
                "problem": self.problem, "says": self.says}


def _nth(rank: int | None) -> str:
    n = (rank or 0) + 1
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def admit(limit: OutOfService, census: Census, node: str) -> Outcome:
    """Pure: may ``node`` be taken out, the fleet being as ``census`` read it?"""
    n, m = len(census.out), census.judged
    cap = allowed(limit, m)
    if any(o.node == node for o in census.out):
        return Outcome(KEPT, n, m, cap, limit.words(), census.rank(node))
    if n >= cap:
        return Outcome(LIMIT, n, m, cap, limit.words())
    return Outcome(TAKE, n + 1, m, cap, limit.words())


def report_only(limit: OutOfService) -> Outcome | None:
    """The outcome when the limit takes nothing out whatever the fleet (0): no count needed."""
    return Outcome(LIMIT, 0, 0, 0, limit.words()) if limit.report_only else None


def take_out(store: Store, node: str, limit: OutOfService) -> Outcome:
    """Take ``node`` out if the limit allows, handling the race as the store can (module doc)."""
    for attempt in range(1, TRIES + 1):
        census = store.census()
        first = replace(admit(limit, census, node), tries=attempt)
        if first.action != TAKE:
            return first
        written = store.take_out(node, census)
        if not store.compare_and_set:
            return replace(_after_write(store, node, limit, first), tries=attempt)
        if written:
            return replace(first, settled=True)
    return Outcome(LIMIT, len(census.out), census.judged, allowed(limit, census.judged), limit.words(),
                   tries=TRIES, problem=f"the fleet's record changed under each of {TRIES} counts: not taken out")


def rewritten(store: Store, node: str, limit: OutOfService) -> Outcome:
    """After the adapter rewrote the taking out of a node already out (Slurm: a new reason, which
    Slurm stamps anew, so the node ranks anew): count and rank as after a first write."""
    return _after_write(store, node, limit, None)


def _after_write(store: Store, node: str, limit: OutOfService, first: Outcome | None,
                 sleep: Callable[[float], None] = time.sleep) -> Outcome:
    sleep(store.tick_s + 0.1)  # every write stamped in this node's tick has landed when it counts
    try:
        return converge(store, node, limit)
    except store.failures as exc:
        o = first or Outcome(KEPT, 0, 0, 0, limit.words())
        return replace(o, problem=f"not counted after the write ({_one_line(exc)}): the next pass counts again")


def converge(store: Store, node: str, limit: OutOfService) -> Outcome:
    """Count again and rank (a store without compare-and-set): ``node`` ranked at or past L puts
    itself back. A count that cannot be read goes to the caller; a putting back that fails is the
    outcome's ``problem`` (still out, and not settled)."""
    census = store.census()
    n, m = len(census.out), census.judged
    cap = allowed(limit, m)
    rank = census.rank(node)
    if rank is None:  # not out (someone else put it back or replaced the reason): nothing to undo
        return Outcome(NOT_OUT, n, m, cap, limit.words(), settled=True)
    if rank < cap:
        return Outcome(KEPT, n, m, cap, limit.words(), rank)
    done = Outcome(PUT_BACK, n, m, cap, limit.words(), rank, settled=True)
    try:
        store.put_back(node, done.says)
    except store.failures as exc:
        return Outcome(KEPT, n, m, cap, limit.words(), rank,
                       problem=f"ranked {_nth(rank)}, past the limit, but not put back ({_one_line(exc)}): the next "
                               "pass tries again")
    return done


def settle(store: Store, node: str, limit: OutOfService, taken_at: float, deadline_s: float,
           clock: Callable[[], float] = time.time) -> Outcome:
    """A later pass of ``node``, out since ``taken_at`` (the taking-out pass's clock, seconds) and
    not yet settled: count and rank (:func:`converge`). Settled when it stays out and this count
    began ``deadline_s`` (the longest a racing pass may take to write, from its first call to its
    store) plus :data:`SETTLE_MARGIN_S` after the taking out: every write decided on a count that
    missed this node has landed by then, and any later one counted it and ranks behind it."""
    began = clock()
    o = converge(store, node, limit)
    if o.action == KEPT and not o.problem and began - taken_at >= deadline_s + SETTLE_MARGIN_S:
        return replace(o, settled=True)
    return o


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] or type(exc).__name__
