"""The Kubernetes publisher against a local API server over real HTTP (gpu_tune/cluster/publisher.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpu_tune.errors import InputError
from gpu_tune.cluster.node_diff import plan_node
from gpu_tune.cluster.publisher import KubePublisher, NullPublisher, make_publisher
from gpu_tune.cluster.labels import ANNOTATION_OWNED, CONDITION_TYPE, TAINT_KEY, desired_node_state
from tests.realkube.testapi import write_kubeconfig

FAST = dict(backoff_base_s=0.01, backoff_cap_s=0.05, retry_budget_s=5.0, attempts=4,
            request_timeout=(1.0, 3.0))
OURS = {"key": TAINT_KEY, "effect": "NoSchedule"}
FOREIGN_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def _topology(n: int = 8) -> dict:
    return {"numa_nodes": [{"id": 0, "cpus": "0-55"}, {"id": 1, "cpus": "56-111"}],
            "gpus": [{"index": i, "pci_bus_id": f"0000:{0x18 + i:02x}:00.0", "name": "NVIDIA H100 80GB HBM3",
                      "numa_node": i * 2 // n} for i in range(n)],
            "nics": []}


def _want(ready: bool, *, reason: str = "", message: str = "", profile: str = "training", n: int = 8,
          taint: bool = True):
    gpus = [{"index": i, "uuid": f"GPU-{i}", "name": "NVIDIA H100 80GB HBM3",
             "pci_bus_id": f"0000:{0x18 + i:02x}:00.0", "memory_total_mib": 81559,
             "compute_capability": "9.0"} for i in range(n)]
    return desired_node_state(profile=profile, ready=ready, reason=reason or ("" if ready else "ProbePending"),
                              message=message or ("all checks passed" if ready else "probe has not run yet"),
                              topology=_topology(n), gpus=gpus, driver_version="570.124.06",
                              taint_when_not_ready=taint)


@pytest.fixture()
def kubeconfig(api, tmp_path):
    return str(write_kubeconfig(tmp_path / "kubeconfig", api.url))


def _pub(kubeconfig: str, node: str = "gpu-1", **kw) -> KubePublisher:
    pub = make_publisher(node, kubeconfig, False, **{**FAST, **kw})
    assert isinstance(pub, KubePublisher)
    return pub


# -- choosing the publisher -------------------------------------------------------------------
def test_no_kube_and_no_config_are_off(monkeypatch):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    off = make_publisher("n", "/nonexistent", True)
    assert isinstance(off, NullPublisher) and "--no-kube" in off.describe()
    none = make_publisher("n", None, False)
    assert isinstance(none, NullPublisher) and "KUBECONFIG" in none.reason
    r = none.publish(_want(True))
    assert r.ok and r.writes == 0 and "off" in r.detail and r.as_check()["name"] == "publish"


def test_bad_kubeconfig_and_missing_node_are_input_errors(tmp_path, monkeypatch, kubeconfig):
    monkeypatch.delenv("NODE_NAME", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(InputError, match="--kubeconfig .*no such file"):
        make_publisher("n", str(tmp_path / "missing"), False)
    bad = tmp_path / "bad"
    bad.write_text("clusters: [unclosed\n")
    with pytest.raises(InputError, match=f"--kubeconfig {bad}"):
        make_publisher("n", str(bad), False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "nope"))
    with pytest.raises(InputError, match="^KUBECONFIG .*no such file"):
        make_publisher("n", None, False)
    with pytest.raises(InputError, match="NODE_NAME"):
        make_publisher(None, kubeconfig, False)


def test_node_name_and_kubeconfig_from_env(monkeypatch, api, kubeconfig):
    monkeypatch.setenv("NODE_NAME", "gpu-env")
    monkeypatch.setenv("KUBECONFIG", kubeconfig)
    # a service host without the service account token is not in-cluster
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    api.add_node("gpu-env")
    pub = make_publisher(None, None, False, **FAST)
    assert isinstance(pub, KubePublisher) and pub.node == "gpu-env"
    assert "kubeconfig" in pub.describe() and api.url in pub.describe()
    assert pub.publish(_want(True)).ok
    assert api.node("gpu-env")["metadata"]["labels"]["gpu-tune.io/ready"] == "true"


def test_kubernetes_not_imported_when_off():
    code = ("import sys; from gpu_tune.cluster.publisher import make_publisher; from gpu_tune.cluster.labels import desired_node_state; "
            "make_publisher('n', None, True); make_publisher('n', None, False); "
            "print('kubernetes' in sys.modules)")
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# -- the pure diff ----------------------------------------------------------------------------
def test_plan_touches_only_what_is_ours():
    node = {"metadata": {"resourceVersion": "5",
                         "labels": {"team": "ml", "gpu-tune.io/old": "x", "gpu-tune.io/manual": "keep",
                                    "gpu-tune.io/ready": "true"},
                         "annotations": {ANNOTATION_OWNED: "gpu-tune.io/old,gpu-tune.io/ready,team"}},
            "spec": {"taints": [FOREIGN_TAINT, {"key": TAINT_KEY, "effect": "NoExecute"}]},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    want = _want(False)
    plan = plan_node(node, want, now="2025-01-01T00:00:00Z")
    labels = plan.metadata_patch["metadata"]["labels"]
    assert labels["gpu-tune.io/old"] is None  # stale, owned
    assert "team" not in labels  # recorded, but not under our prefix: never touched
    assert "gpu-tune.io/manual" not in labels  # ours by prefix, not by record: never touched
    assert labels["gpu-tune.io/ready"] == "false"
    assert plan.metadata_patch["spec"]["taints"] == [FOREIGN_TAINT, {"key": TAINT_KEY, "effect": "NoExecute"}, OURS]
    assert plan.condition["lastTransitionTime"] == "2025-01-01T00:00:00Z" and plan.transition
    assert "resourceVersion" not in plan.metadata_patch["metadata"]


# -- publishing -------------------------------------------------------------------------------
def test_first_pass_at_most_4_writes_second_pass_zero(api, kubeconfig, no_pod_namespace):
    api.add_node("gpu-1", taints=[FOREIGN_TAINT, OURS])
    pub = _pub(kubeconfig)
    want = _want(False)
    r1 = pub.publish(want)
    assert r1.ok, r1.detail
    assert 1 <= api.writes["gpu-1"] <= 4 and r1.writes == api.writes["gpu-1"]
    node = api.node("gpu-1")
    assert node["metadata"]["labels"]["gpu-tune.io/gpu-numa-map"] == "0-3.n0_4-7.n1"
    assert node["metadata"]["labels"]["gpu-tune.io/ready"] == "false"
    assert json.loads(node["metadata"]["annotations"]["gpu-tune.io/topology"])["gpus"][0]["index"] == 0
    assert node["spec"]["taints"] == [FOREIGN_TAINT, OURS]  # startup taint kept while not ready
    cond = [c for c in node["status"]["conditions"] if c["type"] == CONDITION_TYPE]
    assert len(cond) == 1 and cond[0]["status"] == "False" and cond[0]["reason"] == "ProbePending"
    assert any(c["type"] == "Ready" for c in node["status"]["conditions"])  # kubelet's untouched
    evs = api.events_for("gpu-1")
    assert [e["reason"] for e in evs] == ["GPUHostNotReady"]
    assert evs[0]["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": "gpu-1",
                                        "uid": node["metadata"]["uid"]}
    assert evs[0]["type"] == "Warning" and evs[0]["metadata"]["namespace"] == "default"

    kinds = [(m, p.rsplit("/", 1)[-1], ct) for m, p, ct, _ in api.bodies]
    assert kinds == [("PATCH", "gpu-1", "application/merge-patch+json"),
                     ("PATCH", "status", "application/strategic-merge-patch+json"),
                     ("POST", "events", "application/json")]
    meta_patch = api.bodies[0][3]
    assert meta_patch["metadata"]["resourceVersion"]  # the taint list is written against what was read
    assert set(meta_patch) == {"metadata"}  # taint already there: spec not sent
    assert set(api.bodies[1][3]) == {"status"}

    api.reset_counts()
    r2 = pub.publish(want)
    assert r2.ok and r2.writes == 0 and r2.changed == [] and "up to date" in r2.detail
    assert api.writes["gpu-1"] == 0 and api.reads["gpu-1"] == 1

    # a new publisher (agent restart) with the same wish writes nothing either
    api.reset_counts()
    assert _pub(kubeconfig).publish(want).writes == 0 and api.total_writes() == 0


def test_ready_removes_taint_then_lost_puts_it_back_with_events(api, kubeconfig):
    api.add_node("gpu-1", taints=[OURS, FOREIGN_TAINT])
    pub = _pub(kubeconfig)
    assert pub.publish(_want(False)).ok
    t0 = [c for c in api.node("gpu-1")["status"]["conditions"] if c["type"] == CONDITION_TYPE][0]
    time.sleep(1.05)  # condition times have one-second resolution

    r = pub.publish(_want(True))
    assert r.ok and r.writes <= 3
    node = api.node("gpu-1")
    assert node["spec"]["taints"] == [FOREIGN_TAINT]
    assert node["metadata"]["labels"]["gpu-tune.io/ready"] == "true"
    c1 = [c for c in node["status"]["conditions"] if c["type"] == CONDITION_TYPE][0]
    assert c1["status"] == "True" and c1["lastTransitionTime"] != t0["lastTransitionTime"]

    # another controller adds its taint meanwhile; it must survive our taint going back
    api.edit_node("gpu-1", {"spec": {"taints": [FOREIGN_TAINT, {"key": "maint", "effect": "NoExecute"}]}})
    r = pub.publish(_want(False, reason="ProbeFailed", message="accuracy 0.31 < 0.90"))
    assert r.ok
    node = api.node("gpu-1")
    assert node["spec"]["taints"] == [FOREIGN_TAINT, {"key": "maint", "effect": "NoExecute"}, OURS]
    assert [e["reason"] for e in api.events_for("gpu-1")] == ["GPUHostNotReady", "GPUHostReady", "GPUHostNotReady"]
    c2 = [c for c in node["status"]["conditions"] if c["type"] == CONDITION_TYPE][0]
    time.sleep(1.05)

    # same status, new message: one status write, no event, transition time kept
    api.reset_counts()
    r = pub.publish(_want(False, reason="ProbeFailed", message="accuracy 0.40 < 0.90"))
    assert r.ok and api.writes["gpu-1"] == 1
    c3 = [c for c in api.node("gpu-1")["status"]["conditions"] if c["type"] == CONDITION_TYPE][0]
    assert c3["message"] == "accuracy 0.40 < 0.90"
    assert c3["lastTransitionTime"] == c2["lastTransitionTime"]
    assert c3["lastHeartbeatTime"] != c2["lastHeartbeatTime"]
    assert len(api.events_for("gpu-1")) == 3


def test_taint_not_put_back_when_configured_off(api, kubeconfig):
    api.add_node("gpu-1", taints=[OURS])
    pub = _pub(kubeconfig)
    assert pub.publish(_want(False, taint=False)).ok
    assert api.node("gpu-1")["spec"]["taints"] == [OURS]  # startup taint stays until ready
    assert pub.publish(_want(True, taint=False)).ok
    assert api.node("gpu-1")["spec"].get("taints", []) == []
    assert pub.publish(_want(False, taint=False)).ok
    assert api.node("gpu-1")["spec"].get("taints", []) == []


def test_stale_owned_labels_removed_foreign_untouched(api, kubeconfig):
    api.add_node("gpu-1", labels={"team": "ml", "nvidia.com/gpu.product": "H100",
                                  "gpu-tune.io/manual": "set-by-admin"},
                  taints=[FOREIGN_TAINT])
    pub = _pub(kubeconfig)
    assert pub.publish(_want(True, n=8)).ok
    assert api.node("gpu-1")["metadata"]["labels"]["gpu-tune.io/gpu-count"] == "8"
    # the next wish has no GPUs: GPU labels become stale and go; others stay
    no_gpu = desired_node_state(profile="inference", ready=True, reason="", message="", topology={},
                                gpus=[], driver_version=None)
    r = pub.publish(no_gpu)
    assert r.ok, r.detail
    labels = api.node("gpu-1")["metadata"]["labels"]
    assert "gpu-tune.io/gpu-numa-map" not in labels and "gpu-tune.io/gpu-product" not in labels
    assert labels["gpu-tune.io/gpu-count"] == "0" and labels["gpu-tune.io/profile"] == "inference"
    assert labels["team"] == "ml" and labels["nvidia.com/gpu.product"] == "H100"
    assert labels["gpu-tune.io/manual"] == "set-by-admin"
    assert labels["kubernetes.io/hostname"] == "gpu-1"
    assert api.node("gpu-1")["spec"]["taints"] == [FOREIGN_TAINT]
    assert any("removed (stale)" in c for c in r.changed)
    owned = api.node("gpu-1")["metadata"]["annotations"][ANNOTATION_OWNED].split(",")
    assert set(owned) == set(no_gpu.labels)
    assert not any(k.startswith(("nvidia.com/", "feature.node.kubernetes.io/")) for k in owned)


def test_api_down_at_start_then_back(api, kubeconfig):
    api.add_node("gpu-1")
    api.stop()
    pub = _pub(kubeconfig)
    t0 = time.monotonic()
    r = pub.publish(_want(False))
    assert not r.ok and "unavailable after 4 attempts" in r.detail and r.writes == 0
    assert time.monotonic() - t0 < 5
    api.start()
    r = pub.publish(_want(False))
    assert r.ok, r.detail
    assert api.node("gpu-1")["metadata"]["labels"]["gpu-tune.io/ready"] == "false"
    # down again between passes: pooled connections are dead; comes back again
    api.stop()
    assert not pub.publish(_want(True)).ok
    api.start()
    r = pub.publish(_want(True))
    assert r.ok and api.node("gpu-1")["metadata"]["labels"]["gpu-tune.io/ready"] == "true"


def test_403_on_status_is_a_failed_check_with_rbac_hint(api, kubeconfig):
    api.add_node("gpu-1")
    api.fail(r"/nodes/[^/]+/status$", 403)
    pub = _pub(kubeconfig)
    r = pub.publish(_want(True))
    assert not r.ok
    assert "nodes/status" in r.detail and '"patch"' in r.detail and "ClusterRole" in r.detail
    assert r.as_check() == {"name": "publish", "ok": False, "detail": r.detail}
    # labels were still published; the condition was not
    node = api.node("gpu-1")
    assert node["metadata"]["labels"]["gpu-tune.io/ready"] == "true"
    assert not any(c["type"] == CONDITION_TYPE for c in node["status"]["conditions"])
    api.clear_faults()
    api.reset_counts()
    r = pub.publish(_want(True))
    assert r.ok and api.writes["gpu-1"] == 2  # status + event, no metadata rewrite


def test_403_on_events_names_create_events(api, kubeconfig):
    api.add_node("gpu-1")
    api.fail(r"/events$", 403)
    r = _pub(kubeconfig).publish(_want(True))
    assert not r.ok and '"create"' in r.detail and '"events"' in r.detail


# -- the Event's namespace: default, the only one the API server keeps a Node's Event in ---------
@pytest.fixture()
def no_pod_namespace(monkeypatch):
    """No POD_NAMESPACE (a run outside a pod)."""
    monkeypatch.delenv("POD_NAMESPACE", raising=False)


def test_node_events_go_to_default_whatever_the_pod_namespace(api, kubeconfig, monkeypatch):
    api.add_node("gpu-1")
    api.namespace("agent-ns")
    monkeypatch.setenv("POD_NAMESPACE", "agent-ns")  # as the downward API sets it in the agent's pod
    pub = _pub(kubeconfig)
    assert "events in namespace default" in pub.describe()
    r = pub.publish(_want(False))
    assert r.ok, r.detail
    (ev,) = api.events_for("gpu-1")
    assert ev["metadata"]["namespace"] == "default" and ev["reason"] == "GPUHostNotReady"
    assert "namespace" not in ev["involvedObject"]


def test_the_api_server_refuses_a_node_event_outside_default(api, kubeconfig):
    """The rule that made every publish of an agent posting Events in its own namespace fail:
    kube-apiserver answers 422 for a core/v1 Event about a Node in any namespace but default."""
    api.add_node("gpu-1")
    api.namespace("agent-ns")
    pub = _pub(kubeconfig, event_namespace="agent-ns")
    r = pub.publish(_want(False))
    assert not r.ok
    assert "HTTP 422" in r.detail and "does not match event.namespace" in r.detail, r.detail
    assert api.events_for("gpu-1") == []


def test_409_on_every_first_try_succeeds_after_retry(api, kubeconfig):
    api.add_node("gpu-1", taints=[FOREIGN_TAINT])
    api.conflict_first_try = True
    pub = _pub(kubeconfig)
    r = pub.publish(_want(False))
    assert r.ok, r.detail
    node = api.node("gpu-1")
    assert node["spec"]["taints"] == [FOREIGN_TAINT, OURS]
    assert node["metadata"]["labels"]["gpu-tune.io/ready"] == "false"
    assert [c for c in api.calls if c[2] == 409]
    r = pub.publish(_want(True))
    assert r.ok and api.node("gpu-1")["spec"]["taints"] == [FOREIGN_TAINT]
    api.reset_counts()
    assert pub.publish(_want(True)).writes == 0


def test_stale_resource_version_is_rejected_by_server(api, kubeconfig):
    """The taint list is written with the resourceVersion read: a change in between wins."""
    api.add_node("gpu-1", taints=[FOREIGN_TAINT])
    pub = _pub(kubeconfig)
    node = api.node("gpu-1")
    api.edit_node("gpu-1", {"spec": {"taints": [FOREIGN_TAINT, {"key": "late", "effect": "NoSchedule"}]}})
    # replay what a writer holding the old read would send
    body = {"metadata": {"resourceVersion": node["metadata"]["resourceVersion"]}, "spec": {"taints": [OURS]}}
    from gpu_tune.cluster.api import ApiError
    with pytest.raises(ApiError) as exc:
        pub._api.request("PATCH", "/api/v1/nodes/gpu-1", body=body, content_type="application/merge-patch+json")
    assert exc.value.status == 409
    assert pub.publish(_want(False)).ok
    assert api.node("gpu-1")["spec"]["taints"] == [FOREIGN_TAINT, {"key": "late", "effect": "NoSchedule"}, OURS]


def test_429_and_500_back_off_with_jitter_bounded(api, kubeconfig):
    api.add_node("gpu-1")
    api.fail(r"/nodes/gpu-1$", 429, times=2, method="PATCH")
    api.fail(r"/nodes/gpu-1/status$", 500, times=2)
    sleeps: list[float] = []
    pub = _pub(kubeconfig, sleep=sleeps.append)
    r = pub.publish(_want(True))
    assert r.ok, r.detail
    assert len(sleeps) == 4 and all(0 <= s <= FAST["backoff_cap_s"] for s in sleeps)
    assert r.writes == 2 + 1 + 2 + 1 + 1  # failed + ok metadata, failed + ok status, event

    api.fail(r"/nodes/gpu-1/status$", 503)  # forever
    sleeps.clear()
    r = pub.publish(_want(False))
    assert not r.ok and "HTTP 503" in r.detail and "4 attempts" in r.detail
    assert len(sleeps) == 3


def test_failed_event_is_posted_on_next_pass(api, kubeconfig):
    api.add_node("gpu-1")
    api.fail(r"/events$", 500)
    pub = _pub(kubeconfig)
    r = pub.publish(_want(True))
    assert not r.ok and "events" in r.detail
    assert api.events_for("gpu-1") == []
    api.clear_faults()
    api.reset_counts()
    r = pub.publish(_want(True))
    assert r.ok and api.writes["gpu-1"] == 1 and [e["reason"] for e in api.events_for("gpu-1")] == ["GPUHostReady"]
    api.reset_counts()
    assert pub.publish(_want(True)).writes == 0


def test_unknown_node_and_bad_token(api, kubeconfig, tmp_path):
    r = _pub(kubeconfig, node="ghost").publish(_want(True))
    assert not r.ok and "ghost" in r.detail and "not found" in r.detail
    api.add_node("gpu-1")
    bad = write_kubeconfig(tmp_path / "bad-token", api.url, token="wrong")
    r = _pub(str(bad)).publish(_want(True))
    assert not r.ok and "unauthorized" in r.detail and api.total_writes() == 0


def test_dry_run_writes_nothing(api, kubeconfig):
    api.add_node("gpu-1", taints=[OURS])
    pub = _pub(kubeconfig)
    r = pub.publish(_want(True), dry_run=True)
    assert r.ok and r.writes == 0 and api.total_writes() == 0
    assert f"taint {TAINT_KEY}:NoSchedule removed" in r.changed
    assert "event GPUHostReady" in r.changed and "dry run" in r.detail
    assert api.node("gpu-1")["spec"]["taints"] == [OURS]


def test_server_keeps_status_and_spec_apart(api, kubeconfig):
    """What the API server does with the patches the publisher relies on: the main resource drops
    status; nodes/status drops spec and keeps labels; a no-op patch is no new version."""
    api.add_node("gpu-1")
    pub = _pub(kubeconfig)
    pub._api.request("PATCH", "/api/v1/nodes/gpu-1", body={"status": {"conditions": [{"type": "X", "status": "True"}]},
                                                          "metadata": {"labels": {"a": "1"}}},
                     content_type="application/merge-patch+json")
    node = api.node("gpu-1")
    assert node["metadata"]["labels"]["a"] == "1" and not any(c["type"] == "X" for c in node["status"]["conditions"])
    pub._api.request("PATCH", "/api/v1/nodes/gpu-1/status",
                     body={"spec": {"taints": [OURS]}, "metadata": {"labels": {"b": "2"}},
                           "status": {"conditions": [{"type": "X", "status": "True"}]}},
                     content_type="application/strategic-merge-patch+json")
    node = api.node("gpu-1")
    assert node["spec"].get("taints", []) == [] and node["metadata"]["labels"]["b"] == "2"
    assert sorted(c["type"] for c in node["status"]["conditions"]) == ["Ready", "X"]  # merged by type
    rv = node["metadata"]["resourceVersion"]
    pub._api.request("PATCH", "/api/v1/nodes/gpu-1", body={"metadata": {"labels": {"a": "1"}}},
                     content_type="application/merge-patch+json")
    assert api.node("gpu-1")["metadata"]["resourceVersion"] == rv  # a no-op is not a new version


def test_in_cluster_service_account_is_preferred(monkeypatch, tmp_path, kubeconfig):
    import kubernetes.config.incluster_config as incluster

    import gpu_tune.cluster.api as kube

    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("sa-token")
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setattr(kube, "SERVICE_TOKEN_FILE", str(token))
    monkeypatch.setattr(incluster, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster, "SERVICE_CERT_FILENAME", str(ca))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "1")  # nothing listens: fails fast
    pub = make_publisher("gpu-1", kubeconfig, False, **{**FAST, "attempts": 1})
    assert isinstance(pub, KubePublisher)
    assert "in-cluster" in pub.describe() and "https://127.0.0.1:1" in pub.describe()
    assert "ignored" in pub.describe()
    r = pub.publish(_want(True))
    assert not r.ok and r.writes == 0 and r.detail


def test_unexpected_client_error_is_a_value(api, kubeconfig, monkeypatch):
    api.add_node("gpu-1")
    pub = _pub(kubeconfig)

    def boom(*a, **k):
        raise RuntimeError("client blew up")

    monkeypatch.setattr(pub._api, "request", boom)
    r = pub.publish(_want(True))
    assert not r.ok and "RuntimeError: client blew up" in r.detail


def test_summary_annotation_published_once_and_steady_passes_write_nothing(api, kubeconfig):
    from .test_labels import _want_with_summary

    api.add_node("gpu-1")
    pub = _pub(kubeconfig)
    assert pub.publish(_want_with_summary()).ok
    summary = json.loads(api.node("gpu-1")["metadata"]["annotations"]["gpu-tune.io/summary"])
    assert summary["drift"] == 5 and summary["probe"]["0"]["fingerprint"] == "3f2a9c1d"
    assert "device_bound" not in summary["probe"]["0"]  # images/s vary run to run: metrics and /probe only
    # the next passes: the GPU warmer and busier, the probe re-run a little slower: nothing to write
    api.reset_counts()
    for temp, util, launch in ((92.0, 88.0, 9800.0), (95.5, 97.0, 15000.0)):
        r = pub.publish(_want_with_summary(temp=temp, util=util, launch=launch))
        assert r.ok and r.writes == 0, r.changed
    assert api.total_writes() == 0
    # a new fingerprint is news: one metadata patch, no condition write, no Event
    r = pub.publish(_want_with_summary(fp="deadbeef"))
    assert r.writes == 1 and r.changed == ["annotation gpu-tune.io/summary updated"]
    assert json.loads(api.node("gpu-1")["metadata"]["annotations"]["gpu-tune.io/summary"])["probe"]["0"][
        "fingerprint"] == "deadbeef"


def test_plan_heartbeat_only_when_due():
    """A steady node gets its GPUHostReady condition re-written once it is heartbeat_s old (so that
    `gpu-tune fleet` can tell a running agent from a stopped one), never in between."""
    want = _want(True)
    first = plan_node({"metadata": {}, "status": {}}, want, now="2025-01-01T00:00:00Z").condition
    node = {"metadata": {"labels": {}, "annotations": {}}, "status": {"conditions": [
        {**first, "lastTransitionTime": "2024-12-01T00:00:00Z"}]}}
    t0 = 1735689600.0  # 2025-01-01T00:00:00Z
    assert plan_node(node, want, heartbeat_s=600, now_ts=t0 + 599).condition is None
    assert plan_node(node, want, heartbeat_s=None, now_ts=t0 + 86400).condition is None
    plan = plan_node(node, want, now="2025-01-01T00:10:00Z", heartbeat_s=600, now_ts=t0 + 600)
    assert plan.condition == {**first, "lastHeartbeatTime": "2025-01-01T00:10:00Z",
                              "lastTransitionTime": "2024-12-01T00:00:00Z"}
    assert not plan.transition
    assert [c for c in plan.changed if c.startswith("condition")] == [
        f"condition {CONDITION_TYPE} heartbeat (600s since the last)"]
    # an unreadable heartbeat is written again
    node["status"]["conditions"][0]["lastHeartbeatTime"] = "yesterday"
    assert plan_node(node, want, heartbeat_s=600).condition is not None


def test_heartbeat_over_http_is_one_status_write_without_event(api, kubeconfig):
    api.add_node("gpu-1")
    pub = _pub(kubeconfig)  # the default heartbeat: 10 minutes
    assert pub.publish(_want(True)).ok
    events = len(api.events_for("gpu-1"))
    api.reset_counts()
    assert pub.publish(_want(True)).writes == 0  # within the heartbeat
    # eleven minutes pass (the condition's heartbeat on the server ages)
    cond = next(c for c in api.node("gpu-1")["status"]["conditions"] if c["type"] == CONDITION_TYPE)
    old = {**cond, "lastHeartbeatTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 660))}
    api.patch_status("gpu-1", {"conditions": [old]})
    pub2 = _pub(kubeconfig)  # a restarted agent reads the aged heartbeat
    api.reset_counts()
    r = pub2.publish(_want(True))
    assert r.ok and r.writes == 1 and len(r.changed) == 1 and "heartbeat" in r.changed[0]
    assert [(m, p.rsplit("/", 1)[-1]) for m, p, _, _ in api.bodies] == [("PATCH", "status")]
    new = next(c for c in api.node("gpu-1")["status"]["conditions"] if c["type"] == CONDITION_TYPE)
    assert new["lastHeartbeatTime"] > old["lastHeartbeatTime"]
    assert new["lastTransitionTime"] == old["lastTransitionTime"] and new["status"] == "True"
    assert len(api.events_for("gpu-1")) == events  # no Event for a heartbeat
    assert pub2.publish(_want(True)).writes == 0


@pytest.mark.slow
def test_generated_core_api_is_never_imported(api, kubeconfig, tmp_path):
    """The publisher and the fleet list go through ApiClient: the generated CoreV1Api (~21 MB
    resident, ~0.5 s to import) stays out of the process."""
    api.add_node("gpu-1")
    code = ("import sys, json\n"
            "from gpu_tune.cluster.publisher import make_publisher; from gpu_tune.cluster.api import list_nodes, reader_configuration\n"
            "from tests.test_kube import _want\n"
            f"pub = make_publisher('gpu-1', {kubeconfig!r}, False)\n"
            "assert pub.publish(_want(False)).ok\n"
            f"cfg, src = reader_configuration({kubeconfig!r})\n"
            "assert len(list_nodes(cfg).items) == 1\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('kubernetes.client.api'))))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    assert "kubernetes.client.api.core_v1_api" not in loaded, loaded
    assert api.node("gpu-1")["metadata"]["labels"]["gpu-tune.io/ready"] == "false"


def test_a_publish_right_after_a_failed_read_does_not_retry_again(api, kubeconfig):
    """The agent reads its Node at the start of a pass and publishes at its end: when the read
    spent its retries, the publish reports the same failure without calling again (one retry
    budget per pass), and the next pass calls as usual."""
    api.add_node("gpu-1")
    api.fail(r"/nodes/gpu-1$", 503, method="GET")
    pub = _pub(kubeconfig, sleep=lambda s: None)
    read = pub.read()
    calls = len(api.calls)
    assert not read.ok and "HTTP 503" in read.detail and calls == FAST["attempts"]
    r = pub.publish(_want(True))
    assert not r.ok and r.detail == read.detail and len(api.calls) == calls
    api.clear_faults()
    assert pub.read().ok and pub.publish(_want(True)).ok


# -- many Nodes from one process (benchmarks/bench_fleet_scale.py) ---------------------------------------
def test_publishers_sharing_one_client_publish_their_own_nodes_and_leave_it_open(api, kubeconfig):
    from gpu_tune.cluster.api import CoreV1, reader_configuration

    cfg, source = reader_configuration(kubeconfig)
    shared = CoreV1(cfg)
    for n in ("gpu-a", "gpu-b"):
        api.add_node(n)
    pubs = [KubePublisher(n, cfg, source=source, api=shared, **FAST) for n in ("gpu-a", "gpu-b")]
    try:
        first = pubs[0].publish(_want(True))
        pools = shared.client.rest_client.pool_manager.pools
        assert len(pools) == 1
        pubs[0].close()  # closes nothing the other publisher uses: the connection stays
        assert len(pools) == 1
        second = pubs[1].publish(_want(False))
        assert first.ok and second.ok, (first.detail, second.detail)
        assert api.node("gpu-a")["metadata"]["labels"]["gpu-tune.io/ready"] == "true"
        assert api.node("gpu-b")["metadata"]["labels"]["gpu-tune.io/ready"] == "false"
        assert pubs[1].publish(_want(False)).writes == 0
    finally:
        shared.close()
