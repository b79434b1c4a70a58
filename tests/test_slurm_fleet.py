"""The blast-radius limit, ``readiness.max_out_of_service``, on the real Slurm (tests/realslurm): the
cluster's 20 fleet nodes (no slurmd of their own, idle and drainable) each judged by ``gpu-tune check
--slurm --slurm-node gpu-slurm-K`` on a host of its own (a hard-linked copy of the 8-GPU fixture tree)
with a fault (NVML lists 7 of the 8 GPUs). Slurm has no compare-and-set: the passes count, drain,
count again and rank, and a node ranked past the limit resumes itself (docs/slurm.md).

The race: all 20 passes started together, and held by a stand-in ``scontrol`` (first on PATH) at
their first call until all 20 are there, so that they read the fleet in the same instant; every call
then goes to the real slurmctld. Figures (pytest's summary, docs/slurm.md): nodes drained by gpu-tune
at the peak (slurmctld's log replayed) and at the end of each wave, ``scontrol update`` writes
(slurmctld's own counters, ``sdiag``), and the time from the first write to the last.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.fixtures import hostgen
from tests.healthkit import profiles_folder
from tests.realkube.plugin import TIMINGS
from tests.realslurm.cluster import FLEET, NODE
from tests.slurmkit import (STATE, check, check_command, dgx_tree, fleet_roots, gpu_json, host,  # noqa: F401
                            last_line, ours, race)

pytestmark = pytest.mark.slow

LIMIT = 5


def figure(name: str, value: float) -> None:
    """A figure for pytest's summary (beside the real clusters' timings) and this test's output."""
    TIMINGS[name] = value
    print(f"slurm fleet: {name}: {value:g}")


@pytest.fixture(scope="module")
def fleet_base(tmp_path_factory) -> Path:
    return hostgen.build("dgx-8gpu", tmp_path_factory.mktemp("fleet") / "base")


@pytest.fixture
def roots(fleet_base, tmp_path) -> dict[str, Path]:
    return fleet_roots(fleet_base, tmp_path / "hosts")


def policy(tmp_path: Path, limit: str) -> Path:
    return profiles_folder(tmp_path / f"limit-{limit.strip('%')}", health=f"  max_out_of_service: {limit}\n")


def test_twenty_nodes_failing_at_once_take_out_at_most_the_limit(slurm, roots, tmp_path):
    pol = policy(tmp_path, str(LIMIT))
    fixture = gpu_json(tmp_path, drop=5)  # NVML lists 7 of 8: not ready
    first, one = race(slurm, roots, fixture, pol, tmp_path)
    bad = {k: (r.returncode, last_line(r)) for k, r in first.items() if r.returncode != 1}
    assert not bad, f"passes that did not end not ready (exit 1): {bad}"
    second, two = race(slurm, roots, fixture, pol, tmp_path, tag="2")  # the next pass of each
    figure("drained by gpu-tune at the peak (nodes)", one["peak"])
    figure("drained by gpu-tune after the first wave (nodes)", len(one["out"]))
    figure("drained by gpu-tune after the second wave (nodes)", len(two["out"]))
    for key in ("writes", "reads", "first to last write (s)", "start to end (s)"):
        figure(f"{key}, first wave", one[key])
        figure(f"{key}, second wave", two[key])

    lines = {k: last_line(r) for k, r in first.items()}
    assert len(one["out"]) == LIMIT, (f"{len(one['out'])} of {len(FLEET)} nodes drained by gpu-tune after their "
                                      f"passes, with readiness.max_out_of_service {LIMIT}: {one['out']}; the lines: "
                                      f"{lines}")
    for name, line in lines.items():
        assert ("limit reached:" in line) == (name not in one["out"]), line
    lines = {k: last_line(r) for k, r in second.items()}
    assert two["out"] == one["out"] and two["writes"] == 0, \
        f"the next pass of each changed the fleet: {one['out']} -> {two['out']}; the lines: {lines}"
    for name, r in second.items():
        doc = json.loads(r.stdout)
        if name in two["out"]:
            assert "not ready; stays drained" in lines[name], lines[name]
            continue
        m = re.search(r"not ready; not drained: limit reached: ([0-9]+) of ([0-9]+) nodes out of service by "
                      r"gpu-tune \(limit ([0-9]+)\)", lines[name])
        assert m and m.groups() == (str(LIMIT), str(len(FLEET) + 1), str(LIMIT)), lines[name]
        assert doc["slurm"]["action"] == "limit_reached" and not doc["ready"], doc["slurm"]


def test_report_only_drains_nothing_and_a_prolog_past_the_limit_exits_0(slurm, roots, tmp_path):
    fixture = gpu_json(tmp_path, drop=5)
    node = FLEET[0]
    r = check(slurm, roots[node], fixture, policy(tmp_path, "0"), node=node)
    assert r.returncode == 1 and not ours(slurm), f"limit 0 drained: {last_line(r)}; {ours(slurm)}"
    said, _, evidence = last_line(r).partition("; evidence: ")  # the lost GPU's bundle, named after
    assert said == (f"gpu-tune: slurm node {node} (command): not ready; not drained: report only: "
                    "readiness.max_out_of_service is 0"), last_line(r)
    assert evidence.startswith("/var/lib/gpu-tune/evidence/"), last_line(r)
    doc = json.loads(r.stdout)
    assert not doc["ready"] and doc["slurm"]["action"] == "limit_reached"

    # a prolog: its exit 1 would make slurmd drain the node itself (Prolog error): 0, and said
    env = {"SLURM_SCRIPT_CONTEXT": "prolog_slurmd", "SLURM_JOB_ID": "7", "SLURMD_NODENAME": node}
    r = check(slurm, roots[node], fixture, policy(tmp_path, "0%"), node=None, env=env)
    assert r.returncode == 0, f"a prolog past the limit exited {r.returncode}: slurmd would drain the node"
    assert "(prolog of job 7): not ready; not drained: report only" in last_line(r), last_line(r)
    assert last_line(r).partition("; evidence: ")[0].endswith(
        "; exit 0: slurmd drains a node whose prolog fails (Prolog error)"), last_line(r)
    assert not ours(slurm) and not json.loads(r.stdout)["ready"]


def test_a_recovered_node_frees_its_slot_and_an_administrators_drain_never_counts(slurm, roots, tmp_path):
    pol = policy(tmp_path, "1")
    sick, ok = gpu_json(tmp_path, drop=5), gpu_json(tmp_path)
    a, b, admin, spaced = FLEET[:4]
    slurm.scontrol("update", f"NodeName={admin}", "State=DRAIN", "Reason=maint")
    slurm.scontrol("update", f"NodeName={spaced}", "State=DRAIN", "Reason= gpu-tune: x")  # not gpu-tune's
    r = check(slurm, roots[a], sick, pol, node=a)
    assert r.returncode == 1 and set(ours(slurm)) == {a}, \
        f"an administrator's drain was counted against the limit: {last_line(r)}; {ours(slurm)}"
    assert json.loads(r.stdout)["slurm"]["limit"]["out"] == 1

    r = check(slurm, roots[b], sick, pol, node=b)
    assert set(ours(slurm)) == {a}, f"{b} drained past the limit of 1: {last_line(r)}"
    assert f"not ready; not drained: limit reached: 1 of {len(FLEET) + 1} nodes out of service by gpu-tune " \
           "(limit 1)" in last_line(r), last_line(r)

    for _ in range(2):  # a recovers: resumed on its second ready pass
        check(slurm, roots[a], ok, pol, node=a)
    assert not ours(slurm), ours(slurm)
    r = check(slurm, roots[b], sick, pol, node=b)  # the slot is free
    assert set(ours(slurm)) == {b}, f"{b} not drained once {a} recovered: {last_line(r)}"
    assert slurm.nodes()[admin].reason == "maint" and slurm.nodes()[spaced].reason == " gpu-tune: x"


def test_a_dry_run_shows_the_limit_and_writes_nothing(slurm, roots, tmp_path):
    pol = policy(tmp_path, "1")
    sick = gpu_json(tmp_path, drop=5)
    a, b = FLEET[:2]
    check(slurm, roots[a], sick, pol, node=a)
    before = {k: (n.state, n.reason) for k, n in slurm.nodes().items()}
    r = check(slurm, roots[b], sick, pol, "--dry-run", node=b)
    assert r.returncode == 1, said(r)
    doc = json.loads(r.stdout)
    assert doc["slurm"]["action"] == "limit_reached" and doc["slurm"]["limit"]["out"] == 1, doc["slurm"]
    assert {k: (n.state, n.reason) for k, n in slurm.nodes().items()} == before
    assert not (roots[b] / STATE / "slurm.json").exists()
    argv, env = check_command(slurm, roots[b], sick, pol, "--dry-run", node=b)
    t = subprocess.run([a for a in argv if a not in ("-o", "json")], env=env, capture_output=True, text=True)
    assert f"dry run: would not drain {b}: limit reached: 1 of {len(FLEET) + 1} nodes out of service by gpu-tune " \
           "(limit 1)" in t.stdout, t.stdout
    assert last_line(t).startswith(f"gpu-tune: dry run, nothing written: slurm node {b} (command): not ready; not "
                              "drained: limit reached"), last_line(t)


def test_fleet_nodes_have_no_slurmd_and_stay_drainable(slurm):
    """The harness itself: the fleet is idle, in its own partition, 8 GPUs each."""
    nodes = slurm.nodes()
    assert {nodes[k].state for k in FLEET} == {"IDLE"} and nodes[NODE].state == "IDLE"
    assert {nodes[k].gres for k in FLEET} == {"gpu:8"} and {nodes[k].partitions for k in FLEET} == {("fleet",)}
    assert shutil.which("sdiag") and slurm.sdiag().get("user:root", 0) > 0


def test_a_node_without_gres_gpu_counts_the_nodes_of_its_partitions(slurm, host, tmp_path):
    """M on Slurm: the GPU nodes (gres/gpu) where the node offers gres/gpu (21 here), else the nodes
    that share a partition with it: gpu-slurm-0 alone in partition gpu once it offers Gres=gpu:0."""
    sick = gpu_json(tmp_path, drop=5)
    slurm.scontrol("update", f"NodeName={NODE}", "Gres=gpu:0")  # the cluster's reset puts gpu:8 back
    r = check(slurm, host, sick, policy(tmp_path, "10%"), node=NODE)
    doc = json.loads(r.stdout)["slurm"]
    assert r.returncode == 1 and doc["action"] == "drain", doc
    assert (doc["limit"]["judged"], doc["limit"]["allowed"], doc["limit"]["out"]) == (1, 1, 1), doc["limit"]
