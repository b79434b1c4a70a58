"""Two real nodes in one cluster: what only shows across nodes.

The run's node (fixture ``kube_node``, shared with tests/test_cluster_e2e.py) and a second one
joining it (``second_kube_node``, tests/realkube/joined.py: its own kubelet, containerd, network
namespace, cgroup and mount namespace), both labelled as GPU nodes, the CPU image imported into
both. The agents take their GPUs from the fixture backend, a file per node
(``$(NODE_NAME)`` in the path): two H100s on the first node, none on the second. In order:

1. ``helm install`` of the read-only default rolls out one pod per node; ``helm upgrade`` rolls
   both, and a watch on the pods proves that at no moment more nodes lacked a ready agent than
   the chart's ``maxUnavailable`` (10 %, one of two nodes).
2. ``gpu-tune fleet`` lists both nodes, each with its own verdict, the one its own agent serves.
3. The admission policy refuses each node's agent (its pod's own token) any write to the other
   node, and lets it write its own.
4. Enforce on one node only (the ``gpu-tune.io/profile-request`` label; the nodes share this
   machine's kernel, so never both), then its revert label: that node's agent restores the host
   and says it reverted (``tuning.reverted``; the condition names the more urgent GPU it cannot see); the other node's agent stays in audit, not reverted, its Node untouched
   by the first node's agent.

The module leaves no release installed and no label it set.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import yaml

from gpu_tune.cluster.labels import CONDITION_TYPE, PREFIX
from tests.clusterkit import agent_http, helm, wait_for, with_image
from tests.realkube.controlplane import ApiError
from tests.realkube.plugin import record_timing

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "gpu-tune"
NS = "gpu-tune"
REL = "gpu-tune-fleet"  # the read-only release (its objects' names: none is kustomize's or the e2e's)
TRAIN = "gpu-tune-training"  # the enforcing one
INTERVAL = 10
HOST_DIR = "/var/lib/gpu-tune/two-nodes"  # the pods see it at /host/var/lib/gpu-tune/two-nodes
SYSCTLS = ("vm.swappiness", "vm.dirty_background_ratio", "vm.dirty_ratio")  # what training changes
H100 = {"index": 0, "uuid": "GPU-2n000000-0000-0000-0000-000000000000", "name": "NVIDIA H100 80GB HBM3",
        "pci_bus_id": "0000:18:00.0", "memory_total_mib": 81559, "compute_capability": "9.0",
        "persistence_mode": True, "pcie_link_gen_current": 5, "pcie_link_gen_max": 5,
        "pcie_link_width_current": 16, "pcie_link_width_max": 16, "ecc_mode": True, "ecc_uncorrected_volatile": 0,
        "retired_pages_pending": False, "temperature_c": 34, "power_w": 71.5, "utilization_percent": 0,
        "memory_used_mib": 0, "clock_throttle_reasons": [], "xid_events": []}


@pytest.fixture(scope="module")
def nodes(kube_node, second_kube_node, tmp_path_factory):
    t0 = time.monotonic()
    a = with_image(kube_node, tmp_path_factory)
    b = with_image(second_kube_node, tmp_path_factory, "image import into the second node's containerd (s)")
    b.tmp = a.tmp
    # what an earlier module left running (kustomize's audit agent) holds port 9410 on every GPU node
    a.kubectl("-n", NS, "delete", "daemonset", "--all", "--ignore-not-found", "--wait=true", "--timeout=120s",
              timeout=150)
    # and kustomize's ledger of the blast-radius limit: one per namespace, shared by every release
    # in it and made by the first (docs/deploy.md, `ledger.create`): here, this module's first release
    a.kubectl("-n", NS, "delete", "configmap", "gpu-tune-out-of-service", "--ignore-not-found", timeout=60)
    for n in (a, b):
        a.kubectl("label", "node", n.name, f"{PREFIX}profile-request-", f"{PREFIX}mode-")
    os.makedirs(HOST_DIR, exist_ok=True)
    gpus = {"driver_version": "570.124.06", "cuda_driver_version": "12.8"}
    Path(HOST_DIR, f"gpus-{a.name}.json").write_text(json.dumps({**gpus, "gpus": [
        H100, {**H100, "index": 1, "uuid": H100["uuid"].replace("2n0", "2n1"), "pci_bus_id": "0000:3b:00.0"}]}))
    Path(HOST_DIR, f"gpus-{b.name}.json").write_text(json.dumps({**gpus, "gpus": []}))
    values = a.tmp / "values-two-nodes.yaml"
    values.write_text(yaml.safe_dump({
        "extraEnv": [{"name": "GPU_TUNE_GPU_BACKEND", "value": "fixture"},
                     # each pod its own node's file: $(NODE_NAME) is the chart's downward-API variable
                     {"name": "GPU_TUNE_GPU_FIXTURE", "value": f"/host{HOST_DIR}/gpus-$(NODE_NAME).json"}],
        "interval": INTERVAL, "probe": {"device": "cpu"}}))
    a.values = values
    try:
        yield a, b
    finally:
        for release in (TRAIN, REL):
            helm(a, "uninstall", release, "-n", NS, "--wait", "--timeout", "120s", "--ignore-not-found", check=False)
        for n in (a, b):
            a.kubectl("label", "node", n.name, f"{PREFIX}profile-request-", f"{PREFIX}mode-", check=False)
        shutil.rmtree(HOST_DIR, ignore_errors=True)
        record_timing("two-node module, the second node's start and stop aside (s)", time.monotonic() - t0)


def node_obj(node, name: str) -> dict:
    return node.cp.request("GET", f"/api/v1/nodes/{quote(name)}")


def condition(node, name: str) -> dict | None:
    return next((c for c in node_obj(node, name)["status"].get("conditions", []) if c["type"] == CONDITION_TYPE),
                None)


def agent_pods(node, release: str) -> list[dict]:
    """The release's agent pods, those being deleted aside."""
    items = node.cp.request("GET", f"/api/v1/namespaces/{NS}/pods?labelSelector=app.kubernetes.io/instance%3D"
                                   f"{release},app.kubernetes.io/component%3Dagent")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def rollout(node, ds: str, what: str) -> float:
    t0 = time.monotonic()
    proc = node.kubectl("-n", NS, "rollout", "status", f"ds/{ds}", "--timeout=300s", check=False, timeout=330)
    took = time.monotonic() - t0
    if proc.returncode != 0:
        pods = node.kubectl("-n", NS, "get", "pods", "-o", "wide", check=False).stdout
        raise AssertionError(f"rollout of ds/{ds} did not complete: {proc.stdout}{proc.stderr}\n{pods}")
    record_timing(what, took)
    return took


def sysctl(name: str) -> str:
    return Path("/proc/sys/" + name.replace(".", "/")).read_text().strip()


def _ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions") or [])


class PodWatch(threading.Thread):
    """A watch on an agent DaemonSet's pods: after every event, how many of ``nodes`` lack a ready
    agent pod that is not being deleted (what a DaemonSet's maxUnavailable bounds)."""

    def __init__(self, node, release: str, nodes: set[str]) -> None:
        super().__init__(daemon=True)
        self.cp, self.nodes = node.cp, nodes
        self.selector = quote(f"app.kubernetes.io/instance={release},app.kubernetes.io/component=agent")
        self.pods: dict[str, dict] = {}
        self.timeline: list[str] = []
        self.max_unavailable = 0
        self.events = 0
        self.error: BaseException | None = None
        listing = self.cp.request("GET", f"/api/v1/namespaces/{NS}/pods?labelSelector={self.selector}")
        for pod in listing["items"]:
            self._seen("LISTED", pod)
        self.max_unavailable = len(self.unavailable())  # counted from the whole listing, not pod by pod
        self.rv = listing["metadata"]["resourceVersion"]
        self.conn = http.client.HTTPSConnection(self.cp.host, self.cp.port, context=self.cp.ssl_context(), timeout=600)
        self.t0 = time.monotonic()

    def unavailable(self) -> set[str]:
        up = {p["spec"].get("nodeName") for p in self.pods.values()
              if _ready(p) and not p["metadata"].get("deletionTimestamp")}
        return self.nodes - up

    def _seen(self, kind: str, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        if kind == "DELETED":
            self.pods.pop(uid, None)
        else:
            self.pods[uid] = pod
        down = self.unavailable()
        self.max_unavailable = max(self.max_unavailable, len(down))
        self.timeline.append(f"{time.monotonic() - getattr(self, 't0', time.monotonic()):6.1f}s {kind:<8} "
                             f"{pod['metadata']['name']} on {pod['spec'].get('nodeName')} ready={_ready(pod)} "
                             f"deleting={bool(pod['metadata'].get('deletionTimestamp'))} -> nodes without a ready "
                             f"agent: {sorted(down)}")

    def run(self) -> None:
        try:
            self.conn.request("GET", f"/api/v1/namespaces/{NS}/pods?watch=1&resourceVersion={self.rv}"
                                     f"&labelSelector={self.selector}&allowWatchBookmarks=false",
                              headers={"Accept": "application/json"})
            resp = self.conn.getresponse()
            assert resp.status == 200, resp.status
            while True:
                line = resp.readline()
                if not line:
                    return
                ev = json.loads(line)
                if ev.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                    self.events += 1
                    self._seen(ev["type"], ev["object"])
        except (OSError, ValueError, http.client.HTTPException) as exc:
            if not getattr(self, "_stopping", False):
                self.error = exc
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def stop(self) -> None:
        self._stopping = True
        try:
            if self.conn.sock is not None:
                self.conn.sock.shutdown(2)
        except OSError:
            pass
        self.join(10)
        self.conn.close()


# -- 1. a rollout across two nodes ---------------------------------------------------------------------
def test_a_daemonset_rolls_out_on_both_nodes_and_an_upgrade_keeps_max_unavailable(nodes):
    a, b = nodes
    t0 = time.monotonic()
    helm(a, "install", REL, str(CHART), "-n", NS, "--create-namespace", "-f", str(a.values))
    rollout(a, REL, "two nodes: helm install (audit) to rollout complete (s)")
    record_timing("two nodes: helm install to both pods Ready, all in (s)", time.monotonic() - t0)
    before = {p["spec"]["nodeName"]: p["metadata"]["uid"] for p in agent_pods(a, REL)}
    assert set(before) == {a.name, b.name}, before
    ds = a.cp.request("GET", f"/apis/apps/v1/namespaces/{NS}/daemonsets/{REL}")
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == "10%"  # of 2 nodes: 1

    watch = PodWatch(a, REL, {a.name, b.name})
    watch.start()
    try:
        t0 = time.monotonic()
        helm(a, "upgrade", REL, str(CHART), "-n", NS, "--reuse-values", "--set", f"interval={INTERVAL + 1}")
        rollout(a, REL, "two nodes: helm upgrade, both pods replaced one at a time (s)")
        wait_for("the watch saw both new pods ready", lambda: not watch.unavailable() and len(watch.pods) == 2,
                 30, a)
    finally:
        watch.stop()
    timeline = "\n".join(watch.timeline)
    assert watch.error is None, f"the watch failed: {watch.error!r}\n{timeline}"
    after = {p["spec"]["nodeName"]: p["metadata"]["uid"] for p in agent_pods(a, REL)}
    assert set(after) == {a.name, b.name} and not set(after.values()) & set(before.values()), (before, after)
    # never both nodes without a ready agent; and one at a time it was (the watch saw the rollout)
    assert watch.max_unavailable == 1, f"nodes without a ready agent at once: {watch.max_unavailable}\n{timeline}"


# -- 2. the fleet view ----------------------------------------------------------------------------------
def _published(a, name: str, ip: str) -> bool:
    """The node's agent (the upgraded one) has published: its condition matches what it serves."""
    code, body = agent_http(ip, "/agent-ready")
    cond = condition(a, name)
    return code == 200 and cond is not None and body.get("node") == name


def test_the_fleet_view_lists_both_nodes_with_their_own_verdicts(nodes):
    a, b = nodes
    for n in (a, b):
        wait_for(f"{n.name}'s agent published", lambda n=n: _published(a, n.name, n.node_ip), 4 * INTERVAL, a)
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-m", "gpu_tune", "fleet", "--kubeconfig", str(a.cp.kubeconfig),
                           "-o", "json"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1, proc.stderr  # not every node ready
    doc = json.loads(proc.stdout)
    rows = {r["node"]: r for r in doc["nodes"]}
    assert set(rows) == {a.name, b.name}, rows.keys()
    assert rows[a.name]["gpu_count"] == 2 and rows[a.name]["gpu_model"] == "NVIDIA-H100-80GB-HBM3", rows[a.name]
    # its agent counts none; nothing else in the cluster (device plugin, GFD) says how many it has
    assert rows[b.name]["agent_gpu_count"] == 0 and rows[b.name]["agent_sees_none"], rows[b.name]
    assert rows[b.name]["gpu_count"] is None, rows[b.name]
    # the second node says it has GPUs (its label) and its agent sees none: its most urgent reason,
    # and not the first node's
    assert rows[b.name]["status"] == "NotReady", rows[b.name]
    assert "gpu.visible" in [f["check"] for f in rows[b.name]["failing"]], rows[b.name]
    assert "gpu.visible" not in [f["check"] for f in rows[a.name]["failing"]], rows[a.name]
    assert condition(a, b.name)["reason"] == "GpusNotVisible" != condition(a, a.name)["reason"]
    # each row is what that node's own agent judged
    for n in (a, b):
        code, body = agent_http(n.node_ip, "/readiness")
        failing = [c["name"] for c in body["checks"] if not c["ok"]]
        shown = [f["check"] for f in rows[n.name]["failing"]]
        assert sorted(shown) == sorted(failing), (n.name, rows[n.name], body)
        if not body["ready"]:  # led by the most urgent, the check the node's condition names
            assert condition(a, n.name)["message"].startswith(shown[0] + ":"), (n.name, shown, condition(a, n.name))
        assert rows[n.name]["ready"] == body["ready"] == (code == 200)


# -- 3. the admission policy, across nodes -------------------------------------------------------------
def _token(n, pod: dict) -> str:
    """The agent pod's own projected token, as the kubelet of its node wrote it."""
    folder = n.dir / "kubelet" / "pods" / pod["metadata"]["uid"] / "volumes" / "kubernetes.io~projected"
    if n.index == 0:
        (path,) = folder.glob("*/token")
        return path.read_text().strip()
    return n.in_mntns("sh", "-c", f"cat {folder}/*/token").strip()


def test_the_admission_policy_refuses_each_nodes_agent_writing_the_other_node(nodes):
    a, b = nodes
    pods = {p["spec"]["nodeName"]: p for p in agent_pods(a, REL)}
    merge = "application/merge-patch+json"
    for me, other in ((a, b), (b, a)):
        token = _token(me, pods[me.name])
        who = a.cp.whoami(token)
        assert who["extra"]["authentication.kubernetes.io/node-name"] == [me.name], who
        with pytest.raises(ApiError) as exc:
            a.cp.request("PATCH", f"/api/v1/nodes/{other.name}", {"metadata": {"labels": {PREFIX + "ready": "true"}}},
                         merge, token=token)
        assert exc.value.status == 403, exc.value.body[:300]
        # refused by the policy (RBAC allows patching Nodes), saying whose agent and which Node
        assert f"the agent on node {me.name} may not change Node {other.name}" in exc.value.body, exc.value.body[:500]
        with pytest.raises(ApiError) as exc:
            a.cp.request("PATCH", f"/api/v1/nodes/{other.name}/status",
                         {"status": {"conditions": [{"type": CONDITION_TYPE, "status": "True", "reason": "X"}]}},
                         "application/strategic-merge-patch+json", token=token)
        assert exc.value.status == 403 and "may not change Node" in exc.value.body, exc.value.body[:500]
        # its own Node: allowed
        a.cp.request("PATCH", f"/api/v1/nodes/{me.name}", {"metadata": {"labels": {PREFIX + "e2e": "1"}}}, merge,
                     token=token)
        a.cp.request("PATCH", f"/api/v1/nodes/{me.name}", {"metadata": {"labels": {PREFIX + "e2e": None}}}, merge,
                     token=token)


# -- 4. enforce on one node, revert on that node only ------------------------------------------------------
def test_enforce_on_one_node_and_its_revert_label_act_on_that_node_only(nodes):
    a, b = nodes  # the second node enforces: the first stays in audit throughout
    originals = {k: sysctl(k) for k in SYSCTLS}
    a_before = condition(a, a.name)
    a.kubectl("label", "node", b.name, f"{PREFIX}profile-request=training")
    t0 = time.monotonic()
    helm(a, "install", TRAIN, str(CHART), "-n", NS, "-f", str(CHART / "values-training.yaml"),
         "-f", str(a.values), "--set", "fleetViewer.create=false", "--set", "ledger.create=false")
    rollout(a, TRAIN, "two nodes: helm install (training) on one node to rollout complete (s)")
    rollout(a, REL, "two nodes: the audit pod leaves the enforcing node (s)")
    record_timing("two nodes: enforce on one node, all in (s)", time.monotonic() - t0)
    ds = a.cp.request("GET", f"/apis/apps/v1/namespaces/{NS}/daemonsets/{TRAIN}")
    assert ds["status"]["desiredNumberScheduled"] == 1  # one node enforces, never both
    assert [p["spec"]["nodeName"] for p in agent_pods(a, TRAIN)] == [b.name]
    assert [p["spec"]["nodeName"] for p in agent_pods(a, REL)] == [a.name]
    wait_for("the host tuned by the second node's agent", lambda: any(sysctl(k) != v for k, v in originals.items()),
             3 * INTERVAL, a)
    assert agent_http(b.node_ip, "/agent-ready")[1]["mode"] == "enforce"

    mark = a.cp.audit_mark()
    t0 = time.monotonic()
    a.kubectl("label", "node", b.name, f"{PREFIX}mode=revert")
    wait_for("the originals back", lambda: all(sysctl(k) == v for k, v in originals.items()),
             INTERVAL * 1.1 + 10, a, every=0.2)
    record_timing("two nodes: revert label to the host restored (s)", time.monotonic() - t0)
    # the second node's agent says it reverted; its condition still names the more urgent fault
    # (its agent sees no GPU: GpusNotVisible outranks Reverted) and lists the revert among the rest
    def reverted():
        code, body = agent_http(b.node_ip, "/readiness")
        checks = {c["name"]: c for c in body.get("checks", [])}
        rev = checks.get("tuning.reverted") or {}
        return code == 503 and rev.get("ok") is False and "originals are restored" in rev.get("detail", "") and body
    wait_for("the second node's agent reports tuning.reverted", reverted, 2 * INTERVAL, a)
    cond = wait_for("the second node's condition written after the revert",
                    lambda: (c := condition(a, b.name)) and "tuning.reverted" in c["message"] and c, 2 * INTERVAL, a)
    assert cond["status"] == "False" and cond["reason"] == "GpusNotVisible", cond
    # the first node: its agent still audits, its Node has no mode label and is not reverted
    status, body = agent_http(a.node_ip, "/agent-ready")
    assert status == 200 and body["mode"] == "audit", body
    assert PREFIX + "mode" not in node_obj(a, a.name)["metadata"]["labels"]
    a_cond = condition(a, a.name)
    assert a_before["reason"] != "Reverted" and a_cond["reason"] != "Reverted", (a_before, a_cond)
    # and the enforcing agent wrote its own Node only (the audit log: the training release's account)
    a.cp.wait_audit_flushed()
    wrote = {ev["objectRef"].get("name") for ev in a.cp.writes_by(f"system:serviceaccount:{NS}:{TRAIN}", mark)
             if (ev.get("objectRef") or {}).get("resource") == "nodes"}
    assert wrote <= {b.name}, wrote
    helm(a, "uninstall", TRAIN, "-n", NS, "--wait", "--timeout", "120s")
    a.kubectl("label", "node", b.name, f"{PREFIX}profile-request-", f"{PREFIX}mode-")
    assert all(sysctl(k) == v for k, v in originals.items())
