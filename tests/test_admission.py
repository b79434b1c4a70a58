"""The ValidatingAdmissionPolicy that pins each agent to its own Node
(daemonset/admission/admission-policy.yaml), evaluated with a real CEL implementation
(cel-python) the way kube-apiserver evaluates it: matchConditions, then the variables in order,
then every validation; a validation that is false or fails to evaluate denies (failurePolicy
Fail). Requests are (oldObject, object) pairs as admission sees them: after the patch is applied.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import skips

celpy = skips.module("celpy", "pip install cel-python (test extra)")
from celpy import celtypes  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
POLICY_FILE = REPO / "daemonset" / "admission" / "admission-policy.yaml"
AGENT = "system:serviceaccount:gpu-tune:gpu-tune"
NODE_NAME_KEY = "authentication.kubernetes.io/node-name"
OURS = {"key": "gpu-tune.io/not-ready", "effect": "NoSchedule"}


class Policy:
    """One ValidatingAdmissionPolicy, compiled with cel-python."""

    def __init__(self, doc: dict[str, Any]) -> None:
        assert doc["kind"] == "ValidatingAdmissionPolicy"
        self.name = doc["metadata"]["name"]
        self.spec = doc["spec"]
        self.env = celpy.Environment()
        compile_ = lambda text: self.env.program(self.env.compile(text))  # noqa: E731
        self.conditions = [(c["name"], compile_(c["expression"])) for c in self.spec.get("matchConditions", [])]
        self.variables = [(v["name"], compile_(v["expression"])) for v in self.spec.get("variables", [])]
        self.validations = [(v, compile_(v["expression"]),
                             compile_(v["messageExpression"]) if v.get("messageExpression") else None)
                            for v in self.spec["validations"]]

    def matches(self, operation: str, resource: str) -> bool:
        for rule in self.spec["matchConstraints"]["resourceRules"]:
            if operation in rule["operations"] and "" in rule["apiGroups"] and resource in rule["resources"]:
                return True
        return False

    @staticmethod
    def _run(program, activation) -> Any:
        try:
            result = program.evaluate(activation)
        except celpy.CELEvalError as exc:
            return exc
        return result

    def review(self, old: dict, new: dict, *, username: str = AGENT, extra: dict | None = None,
               subresource: str = "", operation: str = "UPDATE") -> list[str]:
        """The messages of the validations that deny the request ([] = admitted)."""
        if not self.matches(operation, "nodes" + (f"/{subresource}" if subresource else "")):
            return []
        user: dict[str, Any] = {"username": username}
        if extra is not None:
            user["extra"] = extra
        request = {"operation": operation, "subResource": subresource, "name": new["metadata"]["name"],
                   "userInfo": user}
        act: dict[str, Any] = {"object": celpy.json_to_cel(new), "oldObject": celpy.json_to_cel(old),
                               "request": celpy.json_to_cel(request)}
        for _, cond in self.conditions:
            verdict = self._run(cond, act)
            assert not isinstance(verdict, Exception), f"matchCondition failed to evaluate: {verdict}"
            if not verdict:
                return []
        variables = {}
        for name, prog in self.variables:
            value = self._run(prog, {**act, "variables": celtypes.MapType(variables)})
            variables[celtypes.StringType(name)] = value
        act["variables"] = celtypes.MapType(variables)
        denied = []
        for spec, prog, message in self.validations:
            verdict = self._run(prog, act)
            if isinstance(verdict, Exception) or not isinstance(verdict, celtypes.BoolType) or not verdict:
                text = spec.get("message") or ""
                if message is not None:
                    text = str(self._run(message, act))
                denied.append(f"{text} [{'error: ' + str(verdict) if isinstance(verdict, Exception) else 'false'}]")
        return denied


@pytest.fixture(scope="module")
def policy() -> Policy:
    docs = [d for d in yaml.safe_load_all(POLICY_FILE.read_text()) if d]
    (doc,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    return Policy(doc)


def token(node: str | None) -> dict[str, list[str]]:
    """user extra of a pod-bound ServiceAccount token (Kubernetes 1.30+)."""
    extra = {"authentication.kubernetes.io/pod-name": ["gpu-tune-audit-x7k2p"],
             "authentication.kubernetes.io/pod-uid": ["7d0c3e9a-0000-4000-8000-000000000001"],
             "authentication.kubernetes.io/credential-id": ["JTI=4c2f"]}
    if node is not None:
        extra[NODE_NAME_KEY] = [node]
        extra["authentication.kubernetes.io/node-uid"] = ["uid-" + node]
    return extra


def node(name: str = "gpu-1") -> dict[str, Any]:
    """A GPU Node as the kubelet, NFD and the device plugin leave it, already published once."""
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": name, "uid": f"uid-{name}", "resourceVersion": "1200",
            "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                       "nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                       "feature.node.kubernetes.io/pci-10de.present": "true",
                       "gpu-tune.io/profile-request": "training",
                       "gpu-tune.io/ready": "false", "gpu-tune.io/gpu-count": "8"},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0",
                            "volumes.kubernetes.io/controller-managed-attach-detach": "true",
                            "gpu-tune.io/owned-labels": "gpu-tune.io/gpu-count,gpu-tune.io/ready"},
        },
        "spec": {"podCIDR": "10.244.3.0/24", "podCIDRs": ["10.244.3.0/24"], "providerID": f"aws:///{name}",
                 "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}, dict(OURS)]},
        "status": {
            "capacity": {"cpu": "112", "memory": "2113459544Ki", "nvidia.com/gpu": "8", "pods": "110"},
            "allocatable": {"cpu": "111", "memory": "2113357144Ki", "nvidia.com/gpu": "8", "pods": "110"},
            "conditions": [
                {"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory"},
                {"type": "Ready", "status": "True", "reason": "KubeletReady"},
                {"type": "GPUHostReady", "status": "False", "reason": "ProbePending", "message": "probe has not run yet"},
            ],
            "addresses": [{"type": "InternalIP", "address": "10.0.0.17"}, {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {"kubeletVersion": "v1.33.2", "containerRuntimeVersion": "containerd://2.1.3"},
            "images": [{"names": ["registry.example/gpu-tune:0.1.0"], "sizeBytes": 3700000000}],
            "runtimeHandlers": [{"name": "nvidia", "features": {"recursiveReadOnlyMounts": True}}],
        },
    }


def changed(base: dict, fn) -> dict:
    new = copy.deepcopy(base)
    fn(new)
    return new


def cond(n: dict, ctype: str) -> dict:
    return next(c for c in n["status"]["conditions"] if c["type"] == ctype)


# -- what the agent does: admitted -----------------------------------------------------------------
ALLOWED = {
    "own label changed": lambda n: n["metadata"]["labels"].update({"gpu-tune.io/ready": "true"}),
    "own label added": lambda n: n["metadata"]["labels"].update({"gpu-tune.io/numa-nodes": "2"}),
    "own label removed (stale)": lambda n: n["metadata"]["labels"].pop("gpu-tune.io/gpu-count"),
    "own annotation changed": lambda n: n["metadata"]["annotations"].update({"gpu-tune.io/topology": "{}"}),
    "own taint removed": lambda n: n["spec"].update(taints=[t for t in n["spec"]["taints"] if t != OURS]),
    "GPUHostReady flipped": lambda n: cond(n, "GPUHostReady").update(status="True", reason="AllChecksPassed"),
    "nothing changed": lambda n: None,
}


@pytest.mark.parametrize("what", ALLOWED)
def test_own_node_owned_fields_are_admitted(policy, what):
    old = node("gpu-1")
    assert policy.review(old, changed(old, ALLOWED[what]), extra=token("gpu-1")) == []


def test_own_taint_added_back_and_condition_created_are_admitted(policy):
    old = node("gpu-1")
    old["spec"]["taints"] = [t for t in old["spec"]["taints"] if t != OURS]
    old["status"]["conditions"] = [c for c in old["status"]["conditions"] if c["type"] != "GPUHostReady"]
    new = copy.deepcopy(old)
    new["spec"]["taints"].append(dict(OURS))
    new["status"]["conditions"].append({"type": "GPUHostReady", "status": "False", "reason": "ProbePending"})
    assert policy.review(old, new, extra=token("gpu-1")) == []
    assert policy.review(old, new, extra=token("gpu-1"), subresource="status") == []


def test_a_node_without_labels_or_taints_can_get_its_first_ones(policy):
    old = node("gpu-1")
    for k in ("labels", "annotations"):
        del old["metadata"][k]
    del old["spec"]["taints"]
    new = copy.deepcopy(old)
    new["metadata"]["labels"] = {"gpu-tune.io/ready": "false"}
    new["metadata"]["annotations"] = {"gpu-tune.io/owned-labels": "gpu-tune.io/ready"}
    new["spec"]["taints"] = [dict(OURS)]
    assert policy.review(old, new, extra=token("gpu-1")) == []


# -- what it may not do: denied, each by the rule that says why ------------------------------------
DENIED = {
    "nvidia.com/ label changed": (lambda n: n["metadata"]["labels"].update({"nvidia.com/gpu.present": "false"}),
                                  "gpu-tune.io/ labels"),
    "foreign label added": (lambda n: n["metadata"]["labels"].update({"node-role.kubernetes.io/gpu": ""}),
                            "gpu-tune.io/ labels"),
    "foreign label removed": (lambda n: n["metadata"]["labels"].pop("feature.node.kubernetes.io/pci-10de.present"),
                              "gpu-tune.io/ labels"),
    "profile-request changed": (lambda n: n["metadata"]["labels"].update({"gpu-tune.io/profile-request": "inference"}),
                                "profile-request"),
    "profile-request removed": (lambda n: n["metadata"]["labels"].pop("gpu-tune.io/profile-request"),
                                "profile-request"),
    "foreign annotation changed": (lambda n: n["metadata"]["annotations"].update({"node.alpha.kubernetes.io/ttl": "30"}),
                                   "gpu-tune.io/ annotations"),
    "foreign taint removed": (lambda n: n["spec"].update(taints=[OURS]), "its own taint"),
    "foreign taint added": (lambda n: n["spec"]["taints"].append({"key": "evil", "effect": "NoExecute"}),
                            "its own taint"),
    "own key with NoExecute": (lambda n: n["spec"]["taints"].append({"key": "gpu-tune.io/not-ready",
                                                                     "effect": "NoExecute"}), "its own taint"),
    "Ready condition changed": (lambda n: cond(n, "Ready").update(status="False"), "its own conditions"),
    "condition removed": (lambda n: n["status"].update(conditions=[cond(n, "GPUHostReady")]), "its own conditions"),
    "condition added": (lambda n: n["status"]["conditions"].append({"type": "NetworkUnavailable", "status": "True"}),
                        "its own conditions"),
    "GPU capacity faked": (lambda n: n["status"]["capacity"].update({"nvidia.com/gpu": "16"}), "status"),
    "GPU allocatable faked": (lambda n: n["status"]["allocatable"].update({"nvidia.com/gpu": "16"}), "status"),
    "addresses changed": (lambda n: n["status"]["addresses"][0].update(address="10.9.9.9"), "status"),
    "cordoned": (lambda n: n["spec"].update(unschedulable=True), "spec"),
    "provider ID changed": (lambda n: n["spec"].update(providerID="aws:///other"), "spec"),
    "owner reference added": (lambda n: n["metadata"].update(ownerReferences=[
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "gone", "uid": "0"}]), "owner references"),
    "finalizer added": (lambda n: n["metadata"].update(finalizers=["example.com/keep"]), "finalizers"),
}


@pytest.mark.parametrize("what", DENIED)
@pytest.mark.parametrize("subresource", ["", "status"])
def test_everything_else_is_denied(policy, what, subresource):
    fn, words = DENIED[what]
    old = node("gpu-1")
    new = changed(old, fn)
    denied = policy.review(old, new, extra=token("gpu-1"), subresource=subresource)
    assert len(denied) == 1, denied
    assert words in denied[0] and denied[0].endswith("[false]"), denied  # false, not an evaluation error


def test_another_node_is_denied(policy):
    old = node("gpu-2")
    new = changed(old, ALLOWED["own label changed"])
    denied = policy.review(old, new, extra=token("gpu-1"))
    assert denied == ["gpu-tune: the agent on node gpu-1 may not change Node gpu-2 [false]"]
    assert policy.review(old, new, extra=token("gpu-1"), subresource="status") == denied


@pytest.mark.parametrize("extra", [None, {}, token(None), {NODE_NAME_KEY: []}, {NODE_NAME_KEY: ["gpu-1", "gpu-2"]}],
                         ids=["no extra", "empty extra", "token without node", "empty node list", "two nodes"])
def test_a_token_that_names_no_node_is_denied(policy, extra):
    old = node("gpu-1")
    denied = policy.review(old, changed(old, ALLOWED["own label changed"]), extra=extra)
    assert len(denied) == 1 and "the token names no node" in denied[0] and denied[0].endswith("[false]"), denied


def test_other_users_are_not_matched(policy):
    """The kubelet, controllers and people are left to their own RBAC: the policy matches only
    the agent's ServiceAccount (and only updates of nodes and nodes/status)."""
    old = node("gpu-1")
    new = changed(old, DENIED["cordoned"][0])
    for user in ("system:node:gpu-1", "kubernetes-admin", "system:serviceaccount:gpu-tune:default",
                 "system:serviceaccount:other:gpu-tune"):
        assert policy.review(old, new, username=user, extra=token("gpu-2")) == []
    assert policy.review(old, new, extra=token("gpu-1"), operation="DELETE") == []  # RBAC has no delete
    assert policy.review(old, new, extra=token("gpu-1")) != []


NODE_SCHEMA_VERSION = "v1.30.0-local-strict"  # the first release with admissionregistration.k8s.io/v1 policies


def node_fields(kind: str) -> list[str]:
    import kubernetes_validate

    defs = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / NODE_SCHEMA_VERSION / "_definitions.json"
    return sorted(json.loads(defs.read_text())["$defs"][f"io.k8s.api.core.v1.{kind}"]["properties"])


SAMPLE = {"boolean": True, "string": "x", "array": [{"name": "x"}], "object": {"x": "y"}}


@pytest.mark.parametrize("where, kind", [("spec", "NodeSpec"), ("status", "NodeStatus")])
def test_every_field_of_the_node_schema_is_guarded(policy, where, kind):
    """Adding, changing or removing any field of a 1.30 NodeSpec / NodeStatus other than the
    taints and conditions (guarded above) is denied: no field was forgotten."""
    skips.module("kubernetes_validate", "pip install kubernetes-validate (test extra)")
    fields = [f for f in node_fields(kind) if f not in ("taints", "conditions")]
    assert len(fields) >= 6
    base = node("gpu-1")
    for field in fields:
        for old in (changed(base, lambda n: n[where].pop(field, None)), base):
            new = changed(old, lambda n: n[where].update({field: {"changed": field} if field != "unschedulable" else True}))
            assert policy.review(old, new, extra=token("gpu-1")), f"{where}.{field} changed, yet admitted"
            if field in old[where]:
                gone = changed(old, lambda n: n[where].pop(field))
                assert policy.review(old, gone, extra=token("gpu-1")), f"{where}.{field} removed, yet admitted"


# The agent's own writes through the policy, on a real kube-apiserver with a pod-bound token:
# tests/test_cluster_access.py.


def test_the_hardware_condition_is_owned_only_where_the_chart_keeps_one(policy, tmp_path):
    """The agent's hardware condition (docs/health.md) may be written only when the release keeps
    one: the chart adds its type to the owned conditions; the shipped policy owns GPUHostReady alone."""
    old = node("gpu-1")
    new = changed(old, lambda n: n["status"]["conditions"].append(
        {"type": "AcceleratedHardwareReady", "status": "False", "reason": "FatalXid"}))
    assert policy.review(old, new, extra=token("gpu-1"), subresource="status") != []  # not owned by default
    from tests.test_helm import template
    from tests.helmbin import helm_binary

    docs = template(str(helm_binary()), sets=["hardwareCondition=AcceleratedHardwareReady"])
    (doc,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"
                and d["metadata"]["name"].endswith("-own-node")]
    owned = next(v for v in doc["spec"]["variables"] if v["name"] == "ownedConditions")
    assert owned["expression"] == "['GPUHostReady', 'AcceleratedHardwareReady']"
    doc["spec"]["matchConditions"][0]["expression"] = policy.spec["matchConditions"][0]["expression"]
    with_hw = Policy(doc)
    assert with_hw.review(old, new, extra=token("gpu-1"), subresource="status") == []
    kubelets = changed(old, lambda n: cond(n, "Ready").update(status="False"))
    assert with_hw.review(old, kubelets, extra=token("gpu-1"), subresource="status") != []


# -- the startup taint the chart configures (startupTaint: key, effect, manage, formerKeys) ---------
CA = {"key": "startup-taint.cluster-autoscaler.kubernetes.io/gpu-tune", "value": "pending", "effect": "NoSchedule"}
FORMER = {"key": "readiness.k8s.io/gpu-tune", "effect": "NoSchedule"}


def chart_policy(policy, sets: list[str]) -> Policy:
    from tests.helmbin import helm_binary
    from tests.test_helm import template

    docs = template(str(helm_binary()), sets=sets)
    (doc,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"
                and d["metadata"]["name"].endswith("-own-node")]
    doc["spec"]["matchConditions"][0]["expression"] = policy.spec["matchConditions"][0]["expression"]
    return Policy(doc)


def with_taints(base: dict, taints: list[dict]) -> dict:
    return changed(base, lambda n: n["spec"].update(taints=taints))


def test_a_custom_taint_key_is_the_agents_and_the_default_only_removable(policy):
    """startupTaint.key: that key (and effect) added and removed; the default, and the keys in
    formerKeys, removed but never added; nothing else."""
    custom = chart_policy(policy, [f"startupTaint.key={CA['key']}", "startupTaint.value=pending",
                                   f"startupTaint.formerKeys={{{FORMER['key']}:NoSchedule}}"])
    foreign = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    base = with_taints(node("gpu-1"), [foreign, dict(OURS), dict(FORMER)])
    admitted = {
        "the default removed": [foreign, dict(FORMER)],
        "the custom key added": [foreign, dict(OURS), dict(FORMER), CA],
        "both former ones removed, the custom key added": [foreign, CA],
    }
    for what, taints in admitted.items():
        assert custom.review(base, with_taints(base, taints), extra=token("gpu-1")) == [], what
    tainted = with_taints(base, [foreign, CA])
    assert custom.review(tainted, with_taints(tainted, [foreign]), extra=token("gpu-1")) == []  # custom removed
    denied = {
        "the default added back": (tainted, [foreign, CA, dict(OURS)]),
        "a former key added": (tainted, [foreign, CA, dict(FORMER)]),
        "a foreign taint of the same effect removed": (tainted, [CA]),
        "its key with another effect": (tainted, [foreign, CA, {"key": CA["key"], "effect": "PreferNoSchedule"}]),
        "a foreign taint added": (tainted, [foreign, CA, {"key": "evil", "effect": "NoSchedule"}]),
    }
    for what, (old, taints) in denied.items():
        got = custom.review(old, with_taints(old, taints), extra=token("gpu-1"))
        assert len(got) == 1 and f"may add or remove only its own taint {CA['key']}:NoSchedule" in got[0], (what, got)
    # the shipped policy: the custom key is someone else's
    assert policy.review(base, with_taints(base, [foreign, dict(OURS), dict(FORMER), CA]), extra=token("gpu-1"))


def test_with_taint_handling_off_no_taint_may_change(policy):
    off = chart_policy(policy, ["startupTaint.manage=false"])
    base = node("gpu-1")
    for taints in ([t for t in base["spec"]["taints"] if t != OURS], base["spec"]["taints"] + [CA]):
        got = off.review(base, with_taints(base, taints), extra=token("gpu-1"))
        assert len(got) == 1 and "its taint handling is off" in got[0], got
    assert off.review(base, changed(base, ALLOWED["own label changed"]), extra=token("gpu-1")) == []
