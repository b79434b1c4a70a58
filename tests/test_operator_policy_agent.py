"""The operator's policy in the agent's own pass, mode enforce, against the real API server the suite
runs (a control plane, tests/realkube): the GPUHostReady condition, its Event and the startup taint
follow ``readiness.checks`` and ``readiness.xid``; the profile's digest and each weight the profile
set are on the Node; a repeat rule's count is held across an agent restart through health.json
(the kernel log having lost the earlier bursts). The real stages over the 8-GPU fixture host; only
the probe is a stand-in (its verdict, not TensorFlow)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from gpu_tune.cluster.labels import ANNOTATION_DIGEST, ANNOTATION_SUMMARY, CONDITION_TYPE, TAINT_KEY
from gpu_tune.serve.agent import Agent
from gpu_tune.serve.options import ServeOptions
from gpu_tune.serve.stages import default_stages
from tests.fixtures.probes import probe_result, probe_verdict
from tests.healthkit import XID79, dgx_tree, gpu_json, profiles_folder as policies  # noqa: F401 (fixtures)
from tests.realkube.testapi import write_kubeconfig
from tests.test_operator_policy import IB0, MIN, xid_line

NODE = "gpu-policy-0"
PROBES = [probe_verdict(str(i), probe_result()) for i in range(8)]


def agent_pass(api, root: Path, fixture: Path, folder: Path, profile: str) -> Agent:
    """A new agent (a restart: its own health monitor, reading health.json and the kernel log
    afresh), settled: its first pass, the probe, the pass that publishes."""
    opts = ServeOptions(root=str(root), gpu_backend="fixture", gpu_fixture=str(fixture),
                        kubeconfig=str(write_kubeconfig(root.parent / "kubeconfig", api.url)), node=NODE,
                        mode="enforce", policy_dir=str(folder), profile=profile)
    st = default_stages(opts)
    st.probe = lambda topology, previous: PROBES
    agent = Agent(st, mode="enforce", interval=60, enforce_min_interval=0, jitter=0)
    agent._started_at = agent.monotonic()
    try:
        agent.run_pass()
        agent.run_probe_once()
        agent.run_pass()
    finally:
        st.close()
    return agent


def node_state(api) -> tuple[dict, bool, dict]:
    n = api.node(NODE)
    cond = next(c for c in n["status"]["conditions"] if c["type"] == CONDITION_TYPE)
    tainted = any(t["key"] == TAINT_KEY for t in n["spec"].get("taints") or [])
    return cond, tainted, n["metadata"]["annotations"]


def host_copy(dgx_tree, tmp_path: Path) -> Path:
    root = tmp_path / "h" / "root"
    shutil.copytree(dgx_tree, root, symlinks=True)
    return root


def test_the_agent_gates_and_ungates_by_readiness_checks(api, dgx_tree, tmp_path):
    root = host_copy(dgx_tree, tmp_path)
    (root / IB0 / "state").write_text("1: DOWN\n")
    fixture = gpu_json(tmp_path, lambda d: d["gpus"][2].update(inforom_valid=False))
    folder = policies(tmp_path, plain="", noib="  checks:\n    network.infiniband: off\n",
                      strict="  checks:\n    gpu.inforom: fatal\n    network.infiniband: off\n")
    api.add_node(NODE)

    agent_pass(api, root, fixture, folder, "plain")  # the catalog: the port down gates
    cond, tainted, ann = node_state(api)
    assert (cond["status"], cond["reason"], tainted) == ("False", "InfinibandPortDown", True), cond

    agent_pass(api, root, fixture, folder, "noib")  # a failing node made to pass
    cond, tainted, ann = node_state(api)
    assert (cond["status"], tainted) == ("True", False), cond
    assert cond["message"].endswith("checks passed; off by profile noib: network.infiniband"), cond["message"]
    summary = json.loads(ann[ANNOTATION_SUMMARY])
    assert summary["weights"] == {"network.infiniband": "off readiness.checks.network.infiniband"}
    noib_digest = ann[ANNOTATION_DIGEST]

    agent_pass(api, root, fixture, folder, "strict")  # a passing node made to fail
    cond, tainted, ann = node_state(api)
    assert (cond["status"], cond["reason"], tainted) == ("False", "InforomInvalid", True), cond
    assert cond["message"].startswith("gpu.inforom: [readiness.checks.gpu.inforom] GPU 2"), cond["message"]
    assert ann[ANNOTATION_DIGEST].startswith("sha256:") and ann[ANNOTATION_DIGEST] != noib_digest
    assert json.loads(ann[ANNOTATION_SUMMARY])["weights"] == {
        "gpu.inforom": "fatal readiness.checks.gpu.inforom", "network.infiniband": "off readiness.checks.network.infiniband"}
    events = [e for e in api.events_for(NODE) if e["reason"] == "GPUHostNotReady"]
    assert events and "[readiness.checks.gpu.inforom]" in events[-1]["message"], [e["message"] for e in events]


def test_the_agent_weighs_xids_by_readiness_xid_and_holds_a_count_across_its_restart(api, dgx_tree, tmp_path):
    root = host_copy(dgx_tree, tmp_path)
    base = (root / "dev/kmsg").read_text()
    fixture = gpu_json(tmp_path)
    folder = policies(tmp_path, plain="", gate45="  xid:\n    45: reset_gpu\n", quiet="  xid:\n    79: ignore\n",
                      rule="  xid:\n    31: {action: reset_gpu, count: 3, within: 1h}\n")
    api.add_node(NODE)
    (root / "dev/kmsg").write_text(base + xid_line(100, 30 * MIN, 3, 45))
    agent_pass(api, root, fixture, folder, "plain")
    cond, tainted, _ = node_state(api)
    assert (cond["status"], tainted) == ("True", False), cond  # the catalog ignores 45

    agent_pass(api, root, fixture, folder, "gate45")  # a passing node made to fail
    cond, tainted, _ = node_state(api)
    assert (cond["status"], cond["reason"], tainted) == ("False", "FatalXid", True), cond
    assert "GPU 3: XID 45 [readiness.xid.45]" in cond["message"], cond["message"]

    (root / "dev/kmsg").write_text(base + XID79.format(seq=101, usec=31 * MIN))
    agent_pass(api, root, fixture, folder, "plain")
    assert node_state(api)[0]["reason"] == "FatalXid"  # 79, by the catalog
    agent_pass(api, root, fixture, folder, "quiet")  # a failing node made to pass
    cond, tainted, _ = node_state(api)
    assert (cond["status"], tainted) == ("True", False), cond

    # a repeat rule, in a new boot: 2 bursts, then the agent restarts and the kernel log holds only a third
    (root / "proc/sys/kernel/random/boot_id").write_text("9d0e7c1a-0000-4000-8000-000000000003\n")
    (root / "dev/kmsg").write_text(base + xid_line(102, 40 * MIN, 3, 31) + xid_line(103, 50 * MIN, 3, 31))
    agent_pass(api, root, fixture, folder, "rule")
    assert node_state(api)[0]["status"] == "True"
    (root / "dev/kmsg").write_text(base + xid_line(104, 60 * MIN, 3, 31))
    agent_pass(api, root, fixture, folder, "rule")
    cond, tainted, _ = node_state(api)
    assert (cond["status"], cond["reason"], tainted) == ("False", "FatalXid", True), cond
    assert "GPU 3: XID 31 [readiness.xid.31]" in cond["message"], cond["message"]
