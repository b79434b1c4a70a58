"""The blast-radius limit's own arithmetic and algorithm (gpu_tune/judge/fleet_limit.py), pure: the
limit's figures, the decision and its words, and the race handled over two stores of the test's own
making, one with compare-and-set (the shape of the Kubernetes adapter: a shared object written at
the version it was read) and one without (the shape of Slurm's), each raced by 40 threads. The Slurm
adapter on the real Slurm: tests/test_slurm_fleet.py."""

from __future__ import annotations

import threading

import pytest

from gpu_tune.judge import fleet_limit as fl
from gpu_tune.tune.readiness import parse_out_of_service


def limit(text) -> object:
    return parse_out_of_service(text)


@pytest.mark.parametrize("text,judged,want", [
    ("5", 21, 5), (5, 3, 5), ("0", 5000, 0), ("0%", 5000, 0),
    ("10%", 8, 1), ("10%", 5000, 500), ("10%", 21, 2), ("10%", 19, 1), ("2.5%", 1000, 25), ("0.01%", 5000, 1),
    ("100%", 7, 7), ("10%", 1, 1),
])
def test_the_limit_of_a_fleet(text, judged, want):
    assert fl.allowed(limit(text), judged) == want


def test_the_decision_and_its_words():
    census = fl.Census(21, (fl.Out("b", "2026-12-07T16:00:01"), fl.Out("a", "2026-12-07T16:00:01"),
                            fl.Out("c", "2026-12-07T16:00:00")))
    assert [o.node for o in census.ranked()] == ["c", "a", "b"]  # the stamp, then the name
    assert fl.admit(limit(5), census, "x").action == fl.TAKE
    full = fl.admit(limit(3), census, "x")
    assert (full.action, full.out, full.judged, full.allowed) == (fl.LIMIT, 3, 21, 3)
    assert full.says == "limit reached: 3 of 21 nodes out of service by gpu-tune (limit 3)"
    assert fl.admit(limit("10%"), census, "x").says == \
        "limit reached: 3 of 21 nodes out of service by gpu-tune (limit 10% of 21 = 2)"
    kept = fl.admit(limit(1), census, "b")  # out already: counts itself, stays out
    assert (kept.action, kept.rank) == (fl.KEPT, 2)
    assert fl.report_only(limit(0)).says == "report only: readiness.max_out_of_service is 0"
    assert fl.report_only(limit("10%")) is None


class CasStore:
    """Compare-and-set: a version bumped on every write; a write at another version is refused."""

    compare_and_set = True
    failures = (RuntimeError,)
    tick_s = 0.0

    def __init__(self, judged: int) -> None:
        self.lock, self.version, self.out, self.judged, self.conflicts = threading.Lock(), 0, [], judged, 0

    def census(self) -> fl.Census:
        with self.lock:
            return fl.Census(self.judged, tuple(fl.Out(n, str(i)) for i, n in enumerate(self.out)), str(self.version))

    def take_out(self, node: str, census: fl.Census) -> bool:
        with self.lock:
            if census.version != str(self.version):
                self.conflicts += 1
                return False
            self.out.append(node)
            self.version += 1
            return True

    def put_back(self, node: str, says: str) -> None:
        raise AssertionError("a store with compare-and-set is never asked to put a node back")


class BlindStore(CasStore):
    """No compare-and-set: every write lands, stamped with a counter (the store's clock)."""

    compare_and_set = False

    def __init__(self, judged: int) -> None:
        super().__init__(judged)
        self.stamps: dict[str, int] = {}
        self.written: dict[str, int] = {}
        self.peak = 0

    def census(self) -> fl.Census:
        with self.lock:
            return fl.Census(self.judged, tuple(fl.Out(n, f"{s:06d}") for n, s in self.stamps.items()))

    def take_out(self, node: str, census: fl.Census) -> bool:
        with self.lock:
            self.version += 1
            self.stamps[node] = self.written[node] = self.version
            self.peak = max(self.peak, len(self.stamps))
            return True

    def put_back(self, node: str, says: str) -> None:
        assert "limit reached:" in says and "put back in service" in says, says
        with self.lock:
            del self.stamps[node]


def race(store, n: int, lim) -> dict[str, fl.Outcome]:
    out: dict[str, fl.Outcome] = {}
    start = threading.Barrier(n)

    def one(name: str) -> None:
        start.wait()
        out[name] = fl.take_out(store, name, lim)

    threads = [threading.Thread(target=one, args=(f"n{i:02d}",)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_a_store_with_compare_and_set_never_overshoots():
    store = CasStore(judged=100)
    out = race(store, 40, limit(5))
    assert len(store.out) == 5 and sorted(n for n, o in out.items() if o.taken) == sorted(store.out)
    assert all(o.settled for o in out.values() if o.taken)
    assert {o.action for n, o in out.items() if n not in store.out} == {fl.LIMIT}


def test_a_store_without_compare_and_set_converges_to_the_limit():
    store = BlindStore(judged=100)
    out = race(store, 40, limit(5))
    assert len(store.stamps) == 5, (store.stamps, {n: o.action for n, o in out.items()})
    assert {o.action for n, o in out.items() if n in store.stamps} == {fl.KEPT}
    assert {o.action for n, o in out.items() if n not in store.stamps} <= {fl.LIMIT, fl.PUT_BACK}
    assert sorted(store.stamps) == sorted(sorted(store.written, key=store.written.get)[:5]), \
        "the nodes left out are not the first five the store stamped"
    print(f"blind store: {len(store.written)} written, peak {store.peak}, {len(store.stamps)} left")


def test_a_drain_settles_only_past_the_longest_racing_pass():
    store = BlindStore(judged=10)
    store.stamps = {"a": 1}
    early = fl.settle(store, "a", limit(5), taken_at=100.0, deadline_s=40.0, clock=lambda: 140.0)
    late = fl.settle(store, "a", limit(5), taken_at=100.0, deadline_s=40.0, clock=lambda: 145.0)
    assert (early.action, early.settled, late.action, late.settled) == (fl.KEPT, False, fl.KEPT, True)
    store.stamps = {f"x{i}": i for i in range(6)} | {"a": 99}  # ranked 7th of 7, limit 5: put back
    past = fl.settle(store, "a", limit(5), taken_at=100.0, deadline_s=40.0, clock=lambda: 101.0)
    assert past.action == fl.PUT_BACK and "a" not in store.stamps and past.rank == 6


def test_a_store_that_changes_under_every_count_takes_nothing_out():
    class Busy(CasStore):
        def take_out(self, node: str, census: fl.Census) -> bool:
            self.conflicts += 1
            return False

    o = fl.take_out(Busy(judged=10), "a", limit(5))
    assert (o.action, o.tries, o.taken) == (fl.LIMIT, fl.TRIES, False)
    assert o.says == ("0 of 10 nodes out of service by gpu-tune (limit 5); the fleet's record changed under each of "
                      "5 counts: not taken out")
