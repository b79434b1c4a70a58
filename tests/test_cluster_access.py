"""What the shipped RBAC and admission policy let the agent do, on a real kube-apiserver.

The objects are the ones `kubectl apply -k daemonset/` installs (the audit overlay as
`kubectl kustomize` renders it: the ServiceAccount, the ClusterRole and its binding, the Events
Role in `default`, the ValidatingAdmissionPolicy and its binding). The agent's identity is the
one a pod gets: a ServiceAccount token bound to a Pod on the agent's Node, which names that node
(``authentication.kubernetes.io/node-name``). Every answer below is the real server's: its
authorizer, its admission chain, its validation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gpu_tune.cluster.labels import CONDITION_TYPE, TAINT_KEY
from tests.realkube.controlplane import ApiError, run_kubectl

REPO = Path(__file__).resolve().parents[1]
NS, SA = "gpu-tune", "gpu-tune"
AGENT = f"system:serviceaccount:{NS}:{SA}"
OURS = {"key": TAINT_KEY, "effect": "NoSchedule"}
FOREIGN_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def rendered(kdir: str) -> list[dict]:
    exe = Path(sys.executable).parent / "kubectl"
    out = subprocess.run([str(exe), "kustomize", str(REPO / "daemonset" / kdir)], check=True, capture_output=True,
                         text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


ACCESS_KINDS = ("Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
                "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


@pytest.fixture(scope="module")
def shipped(control_plane, tmp_path_factory):
    """The shipped access objects applied (and removed at the end of the module), the admission
    policy enforced before any test runs."""
    docs = [d for d in rendered("overlays/audit") if d["kind"] in ACCESS_KINDS]
    docs += rendered("fleet-viewer")
    f = tmp_path_factory.mktemp("shipped") / "access.yaml"
    f.write_text(yaml.safe_dump_all(docs))
    run_kubectl(control_plane.kubeconfig, "apply", "-f", str(f))
    # removed afterwards but the Namespace (deleting one takes the controller-manager, which this
    # control plane does not run: it would stay Terminating and refuse new objects)
    gone = f.with_name("remove.yaml")
    gone.write_text(yaml.safe_dump_all([d for d in docs if d["kind"] != "Namespace"]))
    try:
        yield docs
    finally:
        run_kubectl(control_plane.kubeconfig, "delete", "--ignore-not-found", "--wait=false", "-f", str(gone),
                    check=False)


@pytest.fixture()
def agent(api, shipped, tmp_path):
    """``agent(node)`` -> (token, kubeconfig): the agent's pod-bound identity on ``node``."""
    made = []

    def make(node: str) -> tuple[str, str]:
        pod = api.pod_on(NS, f"agent-{node}", node, SA)
        made.append(pod["metadata"]["name"])
        token = api.cp.token(NS, SA, pod=pod)
        return token, str(api.kubeconfig(tmp_path / f"kc-{node}", token))

    yield make
    for name in made:
        try:
            api.cp.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{name}?gracePeriodSeconds=0")
        except ApiError:
            pass


def wait_policy_enforced(api, token: str, node: str) -> None:
    """A new ValidatingAdmissionPolicy takes a moment to be loaded: wait until it denies. Each try
    is a change (a label already set to the same value would be admitted by the loaded policy too)."""
    t0 = time.monotonic()
    while True:
        try:
            api.cp.request("PATCH", f"/api/v1/nodes/{node}", {"metadata": {"labels": {"team": f"x{time.monotonic_ns()}"}}},
                           "application/merge-patch+json", token=token)
        except ApiError as exc:
            if exc.status == 403 and "gpu-tune" in exc.body:
                return
        # a condition waited for (the API server loads policies about once a second), with room for a busy machine
        assert time.monotonic() - t0 < 60, "the admission policy was not enforced within 60 s"
        time.sleep(0.2)


def _want(ready: bool):
    from tests.test_kube import _want as want

    return want(ready)


def _pub(kubeconfig: str, node: str, **kw):
    from gpu_tune.cluster.publisher import KubePublisher, make_publisher
    from tests.test_kube import FAST

    pub = make_publisher(node, kubeconfig, False, **{**FAST, **kw})
    assert isinstance(pub, KubePublisher)
    return pub


# -- the identity ---------------------------------------------------------------------------------
def test_the_pod_bound_token_names_the_agents_node(api, agent):
    api.add_node("gpu-1")
    token, _ = agent("gpu-1")
    who = api.cp.whoami(token)
    assert who["username"] == AGENT
    assert who["extra"]["authentication.kubernetes.io/node-name"] == ["gpu-1"]


# -- RBAC: exactly the calls it makes -----------------------------------------------------------------
@pytest.mark.parametrize("verb, resource, sub, namespace, allowed", [
    ("get", "nodes", "", "", True),
    ("patch", "nodes", "", "", True),
    ("patch", "nodes", "status", "", True),
    ("create", "events", "", "default", True),
    ("list", "nodes", "", "", True),  # M for the limit: a Table of names, only when about to take its node out
    ("watch", "nodes", "", "", False),
    ("update", "nodes", "", "", False),
    ("delete", "nodes", "", "", False),
    ("create", "nodes", "", "", False),
    ("create", "events", "", "gpu-tune", False),
    ("create", "events", "", "kube-system", False),
    ("patch", "events", "", "default", False),
    ("get", "events", "", "default", False),
    ("list", "events", "", "default", False),
    ("get", "secrets", "", "gpu-tune", False),
    ("list", "pods", "", "gpu-tune", False),
    ("get", "configmaps", "", "gpu-tune", False),
])
def test_rbac_grants_the_agent_exactly_its_calls(api, agent, verb, resource, sub, namespace, allowed):
    api.add_node("gpu-1")
    token, _ = agent("gpu-1")
    assert api.cp.can(token, verb, resource, namespace=namespace, subresource=sub) is allowed


def test_events_k8s_io_is_not_granted(api, agent):
    api.add_node("gpu-1")
    token, _ = agent("gpu-1")
    assert not api.cp.can(token, "create", "events", namespace="default", group="events.k8s.io")


# -- the agent's own publish: every write admitted ---------------------------------------------------
def test_the_agent_publishes_its_own_node_through_rbac_and_the_policy(api, agent):
    api.add_node("gpu-1", labels={"nvidia.com/gpu.present": "true", "gpu-tune.io/profile-request": "training"},
                 taints=[FOREIGN_TAINT, OURS])
    token, kc = agent("gpu-1")
    wait_policy_enforced(api, token, "gpu-1")
    start = api.cp.audit_mark()
    pub = _pub(kc, "gpu-1")
    for ready in (False, True, False, True):  # labels, annotations, taint off and on, condition flips
        r = pub.publish(_want(ready))
        assert r.ok, r.detail
    node = api.node("gpu-1")
    labels = node["metadata"]["labels"]
    assert labels["gpu-tune.io/ready"] == "true" and labels["nvidia.com/gpu.present"] == "true"
    assert labels["gpu-tune.io/profile-request"] == "training"
    assert node["spec"]["taints"] == [FOREIGN_TAINT]
    cond = next(c for c in node["status"]["conditions"] if c["type"] == CONDITION_TYPE)
    assert cond["status"] == "True"
    events = api.events_for("gpu-1")
    assert [e["reason"] for e in events] == ["GPUHostNotReady", "GPUHostReady", "GPUHostNotReady", "GPUHostReady"]
    assert {e["metadata"]["namespace"] for e in events} == {"default"}
    api.cp.wait_audit_flushed()
    writes = api.cp.writes_by(AGENT, start)
    assert writes and all(ev["responseStatus"]["code"] < 300 for ev in writes), \
        [(ev["verb"], ev["requestURI"], ev["responseStatus"]) for ev in writes if ev["responseStatus"]["code"] >= 300]
    # a steady pass: one read, no write
    mark = api.cp.audit_mark()
    assert pub.publish(_want(True)).writes == 0
    api.cp.wait_audit_flushed()
    assert api.cp.writes_by(AGENT, mark) == []


# -- the policy: its own Node, its own keys ------------------------------------------------------------
def test_an_agent_writing_another_node_is_refused_with_the_policy_message(api, agent):
    api.add_node("gpu-1")
    api.add_node("gpu-2")
    before = api.node("gpu-2")
    token, kc = agent("gpu-1")  # gpu-1's pod token, used against gpu-2
    wait_policy_enforced(api, token, "gpu-1")
    r = _pub(kc, "gpu-2").publish(_want(True))
    assert not r.ok
    assert "refused by admission" in r.detail and "may not change Node gpu-2" in r.detail, r.detail
    assert "ClusterRole" not in r.detail  # not mistaken for a missing RBAC rule
    after = api.node("gpu-2")
    assert after["metadata"]["labels"] == before["metadata"]["labels"]
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]


def test_a_token_that_names_no_node_is_refused(api, shipped, tmp_path):
    api.add_node("gpu-1")
    token = api.cp.token(NS, SA)  # a TokenRequest not bound to a pod
    assert "extra" not in api.cp.whoami(token) or \
        "authentication.kubernetes.io/node-name" not in api.cp.whoami(token)["extra"]
    wait_policy_enforced(api, token, "gpu-1")
    r = _pub(str(api.kubeconfig(tmp_path / "kc", token)), "gpu-1").publish(_want(True))
    assert not r.ok and "the token names no node" in r.detail, r.detail


@pytest.mark.parametrize("what, path, body", [
    ("a label outside gpu-tune.io/", "", {"metadata": {"labels": {"nvidia.com/gpu.product": "fake"}}}),
    ("the profile request", "", {"metadata": {"labels": {"gpu-tune.io/profile-request": "training"}}}),
    ("an annotation outside gpu-tune.io/", "", {"metadata": {"annotations": {"team": "x"}}}),
    ("another taint", "", {"spec": {"taints": [OURS, {"key": "maint", "effect": "NoExecute"}]}}),
    ("cordon", "", {"spec": {"unschedulable": True}}),
    ("another condition", "/status", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}),
    ("GPU capacity", "/status", {"status": {"capacity": {"nvidia.com/gpu": "16"}}}),
])
def test_everything_but_its_own_keys_is_refused(api, agent, what, path, body):
    api.add_node("gpu-1", taints=[OURS])
    token, _ = agent("gpu-1")
    wait_policy_enforced(api, token, "gpu-1")
    before = api.node("gpu-1")
    ctype = "application/strategic-merge-patch+json" if path else "application/merge-patch+json"
    with pytest.raises(ApiError) as exc:
        api.cp.request("PATCH", f"/api/v1/nodes/gpu-1{path}", body, ctype, token=token)
    assert exc.value.status == 403 and "gpu-tune: may" in exc.value.body, (what, exc.value.body[:400])
    assert api.node("gpu-1")["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"], what


def test_its_own_keys_are_admitted(api, agent):
    api.add_node("gpu-1")
    token, _ = agent("gpu-1")
    wait_policy_enforced(api, token, "gpu-1")
    api.cp.request("PATCH", "/api/v1/nodes/gpu-1", {"metadata": {"labels": {"gpu-tune.io/x": "1"},
                                                                 "annotations": {"gpu-tune.io/y": "2"}},
                                                    "spec": {"taints": [OURS]}},
                   "application/merge-patch+json", token=token)
    node = api.node("gpu-1")
    assert node["metadata"]["labels"]["gpu-tune.io/x"] == "1" and node["spec"]["taints"] == [OURS]


# -- the blast-radius limit's ledger: that one ConfigMap, its own entry -----------------------------------
LEDGER_PATH = f"/api/v1/namespaces/{NS}/configmaps/gpu-tune-out-of-service"


def test_rbac_grants_the_ledger_by_name_only(api, agent):
    api.add_node("gpu-1")
    token, _ = agent("gpu-1")
    can = lambda verb, name="gpu-tune-out-of-service": api.cp.can(token, verb, "configmaps", namespace=NS,  # noqa: E731
                                                                  name=name)
    assert can("get") and can("update")
    assert not can("patch") and not can("delete") and not can("create", "") and not can("list", "")
    assert not can("get", "gpu-tune-policies") and not can("update", "gpu-tune-policies")


@pytest.fixture()
def ledger(api, shipped):
    """The ledger as the manifests ship it (empty), with one entry of gpu-2's and one of a Node gone."""
    api.create(f"/api/v1/namespaces/{NS}/configmaps", {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "gpu-tune-out-of-service"},
        "data": {"gpu-2": "2026-12-07T18:00:00.000000Z", "gpu-gone": "2026-12-07T17:00:00.000000Z"}})

    def write(token: str, change) -> None:
        doc = api.cp.request("GET", LEDGER_PATH)
        change(doc)
        api.cp.request("PUT", LEDGER_PATH, doc, token=token)

    return write


def wait_ledger_policy(api, write, token: str) -> None:
    """Until the ledger policy is loaded: another node's entry changed is refused."""
    t0 = time.monotonic()
    while True:
        try:
            write(token, lambda d: d["data"].update({"gpu-2": f"2026-12-07T18:00:{time.monotonic_ns() % 60:02d}Z"}))
        except ApiError as exc:
            if exc.status == 403 and "gpu-tune" in exc.body:
                return
        assert time.monotonic() - t0 < 60, "the ledger policy was not enforced within 60 s"
        time.sleep(0.2)


def test_an_agent_takes_its_own_node_out_through_rbac_and_the_ledger_policy(api, agent, ledger):
    for name in ("gpu-1", "gpu-2"):
        api.add_node(name, labels={"gpu-tune.io/ready": "true"})
    token, kc = agent("gpu-1")
    wait_policy_enforced(api, token, "gpu-1")
    wait_ledger_policy(api, ledger, token)
    pub = _pub(kc, "gpu-1", limit=5, ledger_namespace=NS)
    r = pub.publish(_want(False))
    assert r.ok and r.limit.action == "take_out", (r.detail, r.limit.says)
    assert r.limit.says == "2 of 2 nodes out of service by gpu-tune, this one included (limit 5)"
    data = api.cp.request("GET", LEDGER_PATH)["data"]
    assert set(data) == {"gpu-1", "gpu-2"}  # its own entry added, the vanished node's pruned, gpu-2's kept
    assert api.node("gpu-1")["spec"]["taints"] == [OURS]
    r = pub.publish(_want(True))
    assert r.ok and set(api.cp.request("GET", LEDGER_PATH)["data"]) == {"gpu-2"}, r.detail


@pytest.mark.parametrize("what, change", [
    ("another node's entry added", lambda d: d["data"].update({"gpu-3": "2026-12-07T18:00:00.000000Z"})),
    ("another node's entry changed", lambda d: d["data"].update({"gpu-2": "2026-12-07T19:00:00.000000Z"})),
    ("its labels", lambda d: d["metadata"].setdefault("labels", {}).update({"team": "x"})),
    ("binaryData", lambda d: d.update({"binaryData": {"x": "eA=="}})),
])
def test_the_ledger_policy_refuses_all_but_its_own_entry(api, agent, ledger, what, change):
    api.add_node("gpu-1")
    token, _ = agent("gpu-1")
    wait_ledger_policy(api, ledger, token)
    before = api.cp.request("GET", LEDGER_PATH)
    with pytest.raises(ApiError) as exc:
        ledger(token, change)
    assert exc.value.status == 403 and "ValidatingAdmissionPolicy 'gpu-tune-ledger'" in exc.value.body, \
        (what, exc.value.body[:400])
    assert api.cp.request("GET", LEDGER_PATH)["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    # its own entry, and the removal of another's (a vanished node's, pruned), are admitted
    ledger(token, lambda d: d["data"].update({"gpu-1": "2026-12-07T18:30:00.000000Z"}))
    ledger(token, lambda d: d["data"].pop("gpu-gone"))
    assert set(api.cp.request("GET", LEDGER_PATH)["data"]) == {"gpu-1", "gpu-2"}


# -- people: the fleet viewer ------------------------------------------------------------------------------
def test_the_fleet_viewer_lists_nodes_and_writes_nothing(api, shipped, tmp_path):
    api.add_node("gpu-1", labels={"nvidia.com/gpu.present": "true"})
    api.service_account("oncall", "viewer")
    api.cp.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                  "metadata": {"name": "test-fleet-viewer"},
                  "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                              "name": "gpu-tune-fleet-viewer"},
                  "subjects": [{"kind": "ServiceAccount", "name": "viewer", "namespace": "oncall"}]})
    try:
        token = api.cp.token("oncall", "viewer")
        assert api.cp.can(token, "list", "nodes") and api.cp.can(token, "get", "nodes")
        for verb in ("watch", "patch", "update", "delete"):
            assert not api.cp.can(token, verb, "nodes"), verb
        assert not api.cp.can(token, "patch", "nodes", subresource="status")
        assert not api.cp.can(token, "get", "secrets", namespace="gpu-tune")
        kc = str(api.kubeconfig(tmp_path / "kc", token))
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_TUNE_")}
        proc = subprocess.run([sys.executable, "-m", "gpu_tune", "fleet", "--kubeconfig", kc, "-o", "json"],
                              capture_output=True, text=True, timeout=60, env={**env, "PYTHONPATH": str(REPO)})
        assert proc.returncode in (0, 1), proc.stderr
        assert "gpu-1" in [n["node"] for n in json.loads(proc.stdout)["nodes"]]
    finally:
        api.cp.delete({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                       "metadata": {"name": "test-fleet-viewer"}})


# -- `gpu-tune label` as the agent runs it in its pod ---------------------------------------------------
def label_cli(root: Path, kubeconfig: str, node: str, *extra: str, gpu: tuple[str, ...] = ("--gpu-backend", "none"),
              env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPU_TUNE_") and k != "KUBECONFIG"}
    base.update(PYTHONPATH=str(REPO), COLUMNS="300", POD_NAMESPACE=NS, **(env or {}))  # as the downward API sets it
    return subprocess.run([sys.executable, "-m", "gpu_tune", "--root", str(root), *gpu, "-o", "json", "label",
                           "--kubeconfig", kubeconfig, "--node", node, *extra],
                          capture_output=True, text=True, timeout=120, env=base)


def test_label_with_the_agents_token_publishes_and_posts_its_event(api, agent, make_host):
    """`gpu-tune label` with the DaemonSet's ServiceAccount (a pod-bound token) and
    POD_NAMESPACE=gpu-tune: exit 0, the Node labelled, the condition written, the Event kept."""
    api.add_node("gpu-1")
    _, kc = agent("gpu-1")
    proc = label_cli(make_host("small-2cpu"), kc, "gpu-1")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["result"]["ok"], doc["result"]
    node = api.node("gpu-1")
    assert node["metadata"]["labels"]["gpu-tune.io/ready"] == "false"
    cond = next(c for c in node["status"]["conditions"] if c["type"] == CONDITION_TYPE)
    (ev,) = api.events_for("gpu-1")
    assert ev["metadata"]["namespace"] == "default" and ev["reason"] == "GPUHostNotReady"
    assert ev["message"].startswith(cond["reason"] + ": ")
def test_a_gpu_node_without_a_visible_gpu_says_so_in_its_condition(api, agent, make_host):
    api.add_node("gpu-1", labels={"nvidia.com/gpu.present": "true"})
    _, kc = agent("gpu-1")
    proc = label_cli(make_host("small-2cpu"), kc, "gpu-1")  # untuned host, no GPU backend
    assert proc.returncode == 0, proc.stderr[-2000:]
    cond = next(c for c in api.node("gpu-1")["status"]["conditions"] if c["type"] == CONDITION_TYPE)
    assert cond["status"] == "False" and cond["reason"] == "GpusNotVisible", cond
    assert cond["message"].startswith("gpu.visible: the Node says it has NVIDIA GPUs (label "
                                      "nvidia.com/gpu.present=true) but the agent sees none"), cond["message"]
    assert "also failing: tuning.compliant" in cond["message"]


def test_a_device_plugin_offering_7_of_8_gpus_says_7_of_8(api, agent, make_host, gpu_fixture):
    api.add_node("gpu-1", labels={"nvidia.com/gpu.present": "true"}, capacity={"nvidia.com/gpu": "7"})
    _, kc = agent("gpu-1")
    gpus = gpu_fixture("dgx-8gpu")
    doc = json.loads(gpus.read_text())
    for g in doc["gpus"]:  # eight healthy GPUs: the device plugin's shortfall is the node's worst fault
        g["persistence_mode"] = True
    gpus.write_text(json.dumps(doc))
    proc = label_cli(make_host("dgx-8gpu"), kc, "gpu-1", gpu=("--gpu-fixture", str(gpus)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    cond = next(c for c in api.node("gpu-1")["status"]["conditions"] if c["type"] == CONDITION_TYPE)
    assert cond["reason"] == "DevicePluginMissingGpus", cond
    assert cond["message"].startswith("gpu.allocatable: 7 of 8 GPUs offered by the device plugin"), cond["message"]
    # what `kubectl describe node` shows
    described = run_kubectl(api.cp.kubeconfig, "describe", "node", "gpu-1").stdout
    assert "7 of 8 GPUs offered by the device plugin" in described and "DevicePluginMissingGpus" in described
