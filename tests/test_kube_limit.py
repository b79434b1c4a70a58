"""The blast-radius limit on Kubernetes (gpu_tune/cluster/limit.py) on a real kube-apiserver: the
agents' own publishers, one per Node, turning not ready together against the ledger ConfigMap.

Each simulated agent is a :class:`~gpu_tune.cluster.publisher.KubePublisher` as ``gpu-tune serve``
makes it (the profile's ``readiness.max_out_of_service`` as ``limit``); they start their pass at
the same instant (a barrier), on their own threads and connections.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from gpu_tune.cluster.labels import TAINT_KEY, desired_node_state
from gpu_tune.cluster.limit import LEDGER, LEDGER_REASON
from gpu_tune.cluster.publisher import KubePublisher, make_publisher
from gpu_tune.judge import fleet_limit
from gpu_tune.judge.checks.cluster import Published
from tests.realkube.testapi import write_kubeconfig
from tests.test_kube import FAST, _topology

NS = "gpu-tune-limit"
HW = "GpuHardwareHealthy"  # the hardware condition, as options.hardware_condition names it
CM_PATH = f"/api/v1/namespaces/{NS}/configmaps"


def want(ready: bool, hw: bool = True):
    """The Node wanted for a verdict: not ready from a fatal XID (taint and hardware condition False;
    ``hw`` False: an agent that keeps no hardware condition)."""
    gpus = [{"index": i, "uuid": f"GPU-{i}", "name": "NVIDIA H100 80GB HBM3", "pci_bus_id": f"0000:{0x18 + i:02x}:00.0",
             "memory_total_mib": 81559, "compute_capability": "9.0"} for i in range(8)]
    why = "" if ready else "gpu.xid: GPU 3: XID 79 (fallen off the bus)"
    return desired_node_state(profile="training", ready=ready, reason="" if ready else "FatalXid",
                              message=why or "all checks passed", topology=_topology(8), gpus=gpus,
                              driver_version="570.124.06",
                              hardware=(HW, ready, "" if ready else "FatalXid", why or "all checks passed") if hw else None)


@pytest.fixture()
def fleet(api, tmp_path):
    """``fleet(n, limit)`` -> publishers of n Nodes (gpu-00 ...) that gpu-tune already judges
    (their gpu-tune.io/ready label set), the ledger shipped empty."""
    api.namespace(NS)
    api.create(CM_PATH, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": LEDGER}})
    kc = str(write_kubeconfig(tmp_path / "kubeconfig", api.url))
    made: list[KubePublisher] = []

    def make(n: int, limit: Any) -> list[KubePublisher]:
        names = [f"gpu-{i:02d}" for i in range(n)]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda name: api.add_node(name, labels={"gpu-tune.io/ready": "true"}), names))
        pubs = [make_publisher(name, kc, False, limit=limit, ledger_namespace=NS, **FAST) for name in names]
        made.extend(pubs)
        return pubs

    yield make
    for p in made:
        p.close()


def together(pubs: list[KubePublisher], ready: bool | list[bool]) -> list[Any]:
    """One pass of every agent, all starting at once."""
    states = ready if isinstance(ready, list) else [ready] * len(pubs)
    gate = threading.Barrier(len(pubs))

    def one(i: int) -> Any:
        gate.wait()
        return pubs[i].publish(want(states[i]))

    with ThreadPoolExecutor(len(pubs)) as pool:
        results = list(pool.map(one, range(len(pubs))))
    assert all(r.ok for r in results), [r.detail for r in results if not r.ok][:3]
    return results


def tainted(api, pubs) -> set[str]:
    return {p.node for p in pubs if any(t.get("key") == TAINT_KEY for t in api.node(p.node)["spec"].get("taints") or [])}


def condition(api, node: str, ctype: str) -> str | None:
    return next((c["status"] for c in api.node(node)["status"].get("conditions") or [] if c["type"] == ctype), None)


def ledger(api) -> dict[str, str]:
    return api.cp.request("GET", f"{CM_PATH}/{LEDGER}").get("data") or {}


def limit_events(api, node: str) -> list[str]:
    return [e["message"] for e in api.events_for(node) if e["reason"] == LEDGER_REASON]


def test_a_hundred_nodes_turning_not_ready_at_once_take_out_at_most_five(api, fleet):
    pubs = fleet(100, 5)
    results = together(pubs, False)
    out = tainted(api, pubs)
    assert len(out) == 5, f"{len(out)} nodes tainted by gpu-tune, readiness.max_out_of_service 5"
    assert set(ledger(api)) == out
    says = "limit reached: 5 of 100 nodes out of service by gpu-tune (limit 5)"
    for p, r in zip(pubs, results):
        assert condition(api, p.node, "GPUHostReady") == "False"  # every node reported truthfully
        if p.node in out:
            assert r.limit.action == fleet_limit.TAKE and condition(api, p.node, HW) == "False"
            assert not limit_events(api, p.node)
        else:  # held in service: no taint, the hardware condition not set to False
            assert r.limit.action == fleet_limit.LIMIT and r.limit.says == says, r.limit.says
            assert condition(api, p.node, HW) is None
            assert limit_events(api, p.node) == [says]
            (check,) = Published()._limit(r.limit)
            assert check.name == "fleet.limit" and not check.ok and check.severity == "warning"
            assert check.detail.startswith(says)
        assert p.gate.writes <= fleet_limit.TRIES  # writes to the ledger per node bounded
    # a second pass: the held nodes count again only if the ledger changed; nothing is written
    again = together(pubs, False)
    assert sum(r.writes for r in again) == 0, [(r.changed, r.detail) for r in again if r.writes][:2]
    assert tainted(api, pubs) == out


def test_a_node_that_recovers_frees_its_slot(api, fleet):
    pubs = fleet(6, 2)
    together(pubs, False)
    out = sorted(tainted(api, pubs))
    assert len(out) == 2
    first = next(p for p in pubs if p.node == out[0])
    assert first.publish(want(True)).ok
    assert first.node not in tainted(api, pubs) and set(ledger(api)) == {out[1]}
    held = [p for p in pubs if p.node not in out]
    assert held[0].publish(want(False)).limit.action == fleet_limit.TAKE  # the ledger changed: counted again
    assert tainted(api, pubs) == {out[1], held[0].node}
    assert held[1].publish(want(False)).limit.says == "limit reached: 2 of 6 nodes out of service by gpu-tune (limit 2)"


def test_a_node_that_disappears_frees_its_slot_and_its_entry_is_pruned(api, fleet):
    pubs = fleet(4, 1)
    together(pubs, False)
    (gone,) = tainted(api, pubs)
    api.delete_node(gone)
    held = [p for p in pubs if p.node != gone]
    held[0].gate.recount_s = 0  # its next pass counts again (by default RECOUNT_S after its last count)
    r = held[0].publish(want(False))
    assert r.limit.action == fleet_limit.TAKE, r.limit.says
    assert r.limit.says == "1 of 3 nodes out of service by gpu-tune, this one included (limit 1)"
    assert set(ledger(api)) == {held[0].node}


def test_limit_0_reports_only_and_never_reads_the_ledger(api, fleet):
    pubs = fleet(5, 0)
    before = api.cp.request("GET", f"{CM_PATH}/{LEDGER}")["metadata"]["resourceVersion"]
    results = together(pubs, False)
    assert not tainted(api, pubs)
    assert api.cp.request("GET", f"{CM_PATH}/{LEDGER}")["metadata"]["resourceVersion"] == before
    assert not any("configmaps" in c for c in map(str, api.calls))
    for p, r in zip(pubs, results):
        assert condition(api, p.node, "GPUHostReady") == "False" and condition(api, p.node, HW) is None
        assert r.limit.says == "report only: readiness.max_out_of_service is 0"
        assert limit_events(api, p.node) == ["report only: readiness.max_out_of_service is 0"]


def test_a_storm_of_flapping_nodes_never_overshoots(api, fleet):
    pubs = fleet(30, 3)
    rng = random.Random(41)
    for _ in range(5):
        states = [rng.random() < 0.3 for _ in pubs]  # most not ready, some recovering, every pass
        together(pubs, states)
        out = tainted(api, pubs)
        entries = set(ledger(api))
        assert len(out) <= 3 and out <= entries and len(entries) <= 3, (sorted(out), sorted(entries))
        for p, ready in zip(pubs, states):
            assert condition(api, p.node, "GPUHostReady") == ("True" if ready else "False")


def test_a_ledger_that_always_conflicts_takes_no_node_out(api, fleet):
    pubs = fleet(2, 5)
    api.fail(rf"configmaps/{LEDGER}", 409, method="PUT")  # every update answered 409
    r = pubs[0].publish(want(False))
    assert r.ok and r.limit.action == fleet_limit.LIMIT
    assert f"changed under each of {fleet_limit.TRIES} counts: not taken out" in r.limit.says
    assert not tainted(api, pubs) and condition(api, "gpu-00", "GPUHostReady") == "False"
    assert pubs[0].gate.writes == fleet_limit.TRIES


def test_without_a_ledger_the_limit_is_not_enforced_and_says_so(api, fleet):
    """A deployment that predates the limit (its manifests ship no ledger): nodes are taken out as
    before, and the fleet.limit check says why the limit does not hold."""
    pubs = fleet(1, 5)
    api.cp.request("DELETE", f"{CM_PATH}/{LEDGER}")
    r = pubs[0].publish(want(False))
    assert r.ok and tainted(api, pubs) == {"gpu-00"} and condition(api, "gpu-00", HW) == "False"
    assert f"the ledger ConfigMap {NS}/{LEDGER} does not exist" in r.limit.says, r.limit.says
    assert r.limit.says.endswith("the limit is not enforced")
    (check,) = Published()._limit(r.limit)
    assert not check.ok and check.severity == "warning"
    assert pubs[0].publish(want(True)).ok and not tainted(api, pubs)


def test_a_node_tainted_since_it_registered_keeps_its_taint_and_takes_no_slot(api, fleet):
    pubs = fleet(3, 1)
    api.edit_node("gpu-00", {"spec": {"taints": [{"key": TAINT_KEY, "effect": "NoSchedule"}]}})  # the startup taint
    results = [p.publish(want(False, hw=False)) for p in pubs]
    assert results[0].limit is None  # nothing to take out: the limit never removes a taint
    assert results[1].limit.action == fleet_limit.TAKE and results[2].limit.action == fleet_limit.LIMIT
    assert tainted(api, pubs) == {"gpu-00", "gpu-01"} and set(ledger(api)) == {"gpu-01"}


def test_a_node_out_before_a_restart_stays_out_and_a_ready_one_reads_the_ledger_once(api, fleet, tmp_path):
    pubs = fleet(2, 1)
    together(pubs, False)
    (out,) = tainted(api, pubs)
    kc = str(write_kubeconfig(tmp_path / "kc2", api.url))
    again = make_publisher(out, kc, False, limit=1, ledger_namespace=NS, **FAST)  # the agent restarted
    r = again.publish(want(False))
    assert r.limit is None and r.writes == 0 and tainted(api, pubs) == {out} and set(ledger(api)) == {out}
    r = again.publish(want(True))
    assert not tainted(api, pubs) and not ledger(api)
    try:
        assert again.publish(want(True)).writes == 0 and again.gate.listed is False
    finally:
        again.close()


def test_readiness_and_metrics_say_the_limit():
    """/readiness carries the limit's outcome; the metrics its figures (none on a ready node)."""
    from gpu_tune.judge.readiness import Check, Verdict
    from gpu_tune.serve.metrics import render_metrics
    from gpu_tune.serve.snapshot import Snapshot

    held = fleet_limit.Outcome(fleet_limit.LIMIT, 5, 100, 5, "5")
    down = Verdict(False, (Check("gpu.xid", False, "GPU 3: XID 79"), *Published()._limit(held)))
    snap = Snapshot.build(node="gpu-07", profile="training", verdict=down, since=0.0, created=0.0, limit=held)
    assert 'gpu_tune_check_ok{check="fleet.limit"} 0.0' in render_metrics(snap).decode()
    assert snap.readiness_doc()["limit"]["says"] == "limit reached: 5 of 100 nodes out of service by gpu-tune (limit 5)"
    text = render_metrics(snap).decode()
    for line in ("gpu_tune_out_of_service_limit_reached 1.0", "gpu_tune_out_of_service_nodes 5.0",
                 "gpu_tune_out_of_service_judged_nodes 100.0", "gpu_tune_out_of_service_allowed_nodes 5.0"):
        assert line in text, line
    ready = Snapshot.build(node="gpu-07", profile="training", verdict=Verdict(True), since=0.0, created=0.0)
    assert "limit" not in ready.readiness_doc() and "gpu_tune_out_of_service" not in render_metrics(ready).decode()
