"""The startup taint, configurable (gpu_tune/tune/taint.py, gpu_tune/cluster/node_diff.py): a key,
value and effect from the profile or the agent's --taint (the chart's startupTaint), the Cluster
Autoscaler's startup-taint prefix, taint handling off for the Node Readiness Controller; the agent
removes only a taint of its own, under the key it owns now or one it owned before.

On the real kube-apiserver: first with the admin's token (what the publisher writes), then with
the agent's pod-bound ServiceAccount token through the admission policy as the chart renders it
for a custom key (what the policy lets it write: that key and nothing more).
"""

from __future__ import annotations

import json
import time

import pytest
import yaml

from gpu_tune.cluster.labels import CONDITION_TYPE, desired_node_state
from gpu_tune.cluster.node_diff import plan_node
from gpu_tune.errors import InputError
from gpu_tune.tune.taint import DEFAULT_TAINT, TaintSpec, parse_option, resolve
from tests.realkube.controlplane import ApiError
from tests.realkube.testapi import write_kubeconfig
from tests.test_kube import FAST, _topology

ANNOTATION_OWNED_TAINT = "gpu-tune.io/owned-taint"  # KEY:EFFECT of the taint owned, other than the default
CA = TaintSpec("startup-taint.cluster-autoscaler.kubernetes.io/gpu-tune", "NoSchedule", "pending")
NRC = TaintSpec("readiness.k8s.io/gpu-tune", "NoSchedule")
DEFAULT = {"key": "gpu-tune.io/not-ready", "effect": "NoSchedule"}
FOREIGN = {"key": "example.com/maintenance", "effect": "NoSchedule"}  # another's, the same effect
CA_TAINT = {"key": CA.key, "value": "pending", "effect": "NoSchedule"}
NRC_TAINT = {"key": NRC.key, "effect": "NoSchedule"}


def want(ready: bool, taint: TaintSpec | None = DEFAULT_TAINT, *, mode: str = "enforce"):
    return desired_node_state(profile="training", ready=ready, reason="" if ready else "ProbeFailed",
                              message="all checks passed" if ready else "accuracy 0.31 < 0.90",
                              topology=_topology(2), gpus=[], driver_version="570.124.06", mode=mode, taint=taint)


def node_with(taints: list[dict], record: str | None = None) -> dict:
    ann = {ANNOTATION_OWNED_TAINT: record} if record else {}
    return {"metadata": {"resourceVersion": "7", "annotations": ann}, "spec": {"taints": list(taints)}, "status": {}}


def planned_taints(node: dict, w, **kw) -> list[dict] | None:
    patch = plan_node(node, w, now="2026-01-01T00:00:00Z", **kw).metadata_patch or {}
    return (patch.get("spec") or {}).get("taints")


# -- the setting --------------------------------------------------------------------------------------
def test_the_option_and_the_profile_resolve_to_one_taint():
    assert parse_option("off") is None
    assert parse_option(CA.as_option()) == CA and CA.as_option() == f"{CA.key}=pending:NoSchedule"
    assert resolve(True, None).spec == DEFAULT_TAINT and resolve(False, None).put_back is False
    assert resolve(NRC, None).spec == NRC and resolve(NRC, None).note is None
    plan = resolve(NRC, CA.as_option())  # the deployment's option wins, and says so
    assert plan.spec == CA and plan.put_back and "readiness.taint readiness.k8s.io/gpu-tune:NoSchedule" in plan.note
    assert resolve(False, "off").spec is None
    for bad, words in (("nvidia.com/gpu:NoSchedule", "another component"), ("x:NoExecute", "evict"),
                       ("x", r"KEY\[=VALUE\]:EFFECT"), ("Bad_Prefix/x:NoSchedule", "not a taint key"),
                       ("x=a b:NoSchedule", "value")):
        with pytest.raises(ValueError, match=words):
            parse_option(bad)


@pytest.mark.parametrize("value, words", [
    ({"key": "nvidia.com/gpu", "effect": "NoSchedule"}, "readiness.taint: key 'nvidia.com/gpu': nvidia.com/ taints"),
    ({"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}, "node.kubernetes.io/ taints belong to another"),
    ({"key": "readiness.k8s.io/gpu"}, "readiness.taint: effect: missing"),
    ({"key": "readiness.k8s.io/gpu", "effect": "NoExecute"}, "readiness.taint: effect NoExecute"),
    ({"key": "readiness.k8s.io/gpu", "effect": "NoSchedule", "valeu": "x"}, "readiness.taint: unknown key 'valeu'"),
    ("yes", "readiness.taint: expected true, false or {key, value, effect}"),
])
def test_a_bad_taint_in_a_profile_is_refused_at_load_in_one_line(tmp_path, value, words):
    from gpu_tune.tune.policy import load_profile

    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"include": "training.yaml", "readiness": {"taint": value}}))
    with pytest.raises(InputError) as exc:
        load_profile("p", tmp_path)
    assert words in str(exc.value) and "p.yaml" in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_the_cli_exits_2_on_a_bad_taint(tmp_path):
    from tests.conftest import run_cli

    (tmp_path / "p.yaml").write_text("include: training.yaml\nreadiness: {taint: {key: x, effect: NoExecute}}\n")
    proc = run_cli("--policy-dir", str(tmp_path), "profiles")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "readiness.taint: effect NoExecute" in line, line


def test_a_taint_in_a_profile_loads():
    from gpu_tune.tune.policy import load_profile

    from gpu_tune.tune.profile import Profile

    assert Profile(name="x", readiness={"taint": {"key": NRC.key, "effect": "NoSchedule"}}).readiness.taint == NRC
    assert load_profile("training").readiness.taint is True


def test_a_bad_taint_option_is_an_input_error():
    from gpu_tune.cluster.node_state import taint_plan
    from gpu_tune.serve.options import ServeOptions

    with pytest.raises(InputError, match=r"^--taint 'x:NoExecute': effect NoExecute"):
        ServeOptions(taint="x:NoExecute").validate()
    with pytest.raises(InputError, match=r"^--taint 'nvidia.com/gpu:NoSchedule'"):
        taint_plan(None, "nvidia.com/gpu:NoSchedule")


# -- the plan, pure -----------------------------------------------------------------------------------
def test_only_its_own_taint_is_put_on_and_taken_off_under_a_custom_key():
    node = node_with([FOREIGN])
    assert planned_taints(node, want(False, CA)) == [FOREIGN, CA_TAINT]
    plan = plan_node(node, want(False, CA))
    assert plan.metadata_patch["metadata"]["annotations"][ANNOTATION_OWNED_TAINT] == CA.ident
    tainted = node_with([FOREIGN, CA_TAINT, {"key": CA.key, "effect": "PreferNoSchedule"}], CA.ident)
    assert planned_taints(tainted, want(True, CA)) == [FOREIGN, {"key": CA.key, "effect": "PreferNoSchedule"}]
    assert planned_taints(tainted, want(False, CA)) is None  # there already: nothing to write
    assert plan_node(tainted, want(False, CA)).metadata_patch["metadata"].get("annotations", {}).get(
        ANNOTATION_OWNED_TAINT) is None


def test_a_change_of_key_removes_the_former_one():
    # the default, before a change of key: always the agent's (its own prefix), ready or not
    assert planned_taints(node_with([DEFAULT, FOREIGN]), want(False, CA)) == [FOREIGN, CA_TAINT]
    assert planned_taints(node_with([DEFAULT, FOREIGN]), want(True, CA)) == [FOREIGN]
    # a custom key, recorded: the next one replaces it
    was_ca = node_with([FOREIGN, CA_TAINT], CA.ident)
    assert planned_taints(was_ca, want(False, NRC)) == [FOREIGN, NRC_TAINT]
    assert plan_node(was_ca, want(False, NRC)).metadata_patch["metadata"]["annotations"][ANNOTATION_OWNED_TAINT] \
        == NRC.ident
    back = plan_node(was_ca, want(True, DEFAULT_TAINT))
    assert back.metadata_patch["spec"]["taints"] == [FOREIGN]
    assert back.metadata_patch["metadata"]["annotations"][ANNOTATION_OWNED_TAINT] is None  # the default: no record
    # not recorded: not the agent's, whatever its key
    assert planned_taints(node_with([FOREIGN, CA_TAINT]), want(True, NRC)) is None
    # the admission policy refused it: left
    assert planned_taints(was_ca, want(True, NRC), former=False) is None


def test_taint_handling_off_never_touches_a_taint():
    for taints in ([DEFAULT, FOREIGN], [NRC_TAINT], []):
        for ready in (True, False):
            plan = plan_node(node_with(taints, CA.ident), want(ready, None))
            assert (plan.metadata_patch or {}).get("spec") is None
            assert ANNOTATION_OWNED_TAINT not in ((plan.metadata_patch or {}).get("metadata") or {}).get("annotations", {})
            assert plan.condition["status"] == ("True" if ready else "False")
    assert want(False, None).as_dict()["taint"] == {"managed": False, "wanted": "unchanged"}


# -- the publisher on the real API server (the admin's token) ----------------------------------------------
@pytest.fixture()
def pub(api, tmp_path):
    from gpu_tune.cluster.publisher import make_publisher

    made = []

    def make(node: str = "gpu-1", kubeconfig: str | None = None):
        p = make_publisher(node, kubeconfig or str(write_kubeconfig(tmp_path / "kc", api.url)), False, **FAST)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def taints_of(api, node: str = "gpu-1") -> list[dict]:
    return api.node(node)["spec"].get("taints", [])


def test_a_custom_key_is_put_on_and_removed_a_foreign_one_untouched(api, pub):
    api.add_node("gpu-1", taints=[FOREIGN])
    p = pub()
    assert p.publish(want(False, CA)).ok
    assert taints_of(api) == [FOREIGN, CA_TAINT]
    assert api.node("gpu-1")["metadata"]["annotations"][ANNOTATION_OWNED_TAINT] == CA.ident
    api.reset_counts()
    assert p.publish(want(False, CA)).writes == 0  # a second identical pass writes nothing
    assert p.publish(want(True, CA)).ok
    assert taints_of(api) == [FOREIGN]


def test_a_change_of_key_removes_the_old_one(api, pub):
    api.add_node("gpu-1", taints=[DEFAULT, FOREIGN])  # registered with the default startup taint
    assert pub().publish(want(False, CA)).ok  # a new release, a new key: the default goes
    assert taints_of(api) == [FOREIGN, CA_TAINT]
    r = pub().publish(want(False, NRC))  # a restarted agent with another key: the recorded one goes
    assert r.ok and f"taint {CA.ident} removed (a former key of gpu-tune's)" in r.changed
    assert taints_of(api) == [FOREIGN, NRC_TAINT]
    assert api.node("gpu-1")["metadata"]["annotations"][ANNOTATION_OWNED_TAINT] == NRC.ident
    assert pub().publish(want(True, DEFAULT_TAINT)).ok
    assert taints_of(api) == [FOREIGN]
    assert ANNOTATION_OWNED_TAINT not in api.node("gpu-1")["metadata"]["annotations"]


def test_taint_handling_off_writes_the_condition_only(api, pub):
    api.add_node("gpu-1", taints=[NRC_TAINT, DEFAULT])  # the Node Readiness Controller's, and a stale default
    p = pub()
    for ready in (False, True, False):
        r = p.publish(want(ready, None))
        assert r.ok and not any(c.startswith("taint ") for c in r.changed), r.changed
        node = api.node("gpu-1")
        assert node["spec"]["taints"] == [NRC_TAINT, DEFAULT]
        cond = next(c for c in node["status"]["conditions"] if c["type"] == CONDITION_TYPE)
        assert cond["status"] == ("True" if ready else "False")


# -- the agent's token through the admission policy the chart renders for a custom key ---------------------
def chart_policy(sets: list[str]) -> list[dict]:
    from tests.helmbin import helm_binary
    from tests.test_helm import template

    docs = template(str(helm_binary()), "gpu-tune", sets=sets, skip_tests=True)
    return [d for d in docs if d["kind"].startswith("ValidatingAdmissionPolicy")]


def enforce(api, docs: list[dict], token: str, before: list[dict], after: list[dict], admitted: bool) -> None:
    """Install ``docs`` in place of the policy in force, and wait until the API server enforces
    them: until the agent's change of the scratch Node's taints from ``before`` to ``after`` (a
    change only that policy admits, or only it denies) is ``admitted``, or denied."""
    for d in docs:
        api.cp.apply(d)
    t0 = time.monotonic()
    while True:
        api.cp.request("PATCH", "/api/v1/nodes/scratch", {"spec": {"taints": before}}, "application/merge-patch+json")
        try:
            api.cp.request("PATCH", "/api/v1/nodes/scratch", {"spec": {"taints": after}},
                           "application/merge-patch+json", token=token)
            if admitted:
                return
        except ApiError as exc:
            assert exc.status == 403, exc.body
            if not admitted:
                return
        # a condition waited for (the API server reloads policies about once a second)
        assert time.monotonic() - t0 < 60, f"the policy was not enforced within 60 s: {before} -> {after}"
        time.sleep(0.2)


@pytest.fixture()
def agent_on(api, agent, shipped):
    """``agent_on(node, sets, before, after, admitted)`` -> (token, kubeconfig) of the agent on
    ``node``, with the chart's policy for ``sets`` in force (see :func:`enforce` for the rest);
    the shipped policy is put back at the end."""
    from tests.test_cluster_access import wait_policy_enforced

    api.add_node("scratch")
    scratch, _ = agent("scratch")
    wait_policy_enforced(api, scratch, "scratch")

    def make(node: str, sets: list[str], before: list[dict], after: list[dict], admitted: bool = True):
        docs = chart_policy(sets)
        enforce(api, docs, scratch, before, after, admitted)
        return agent(node)

    yield make
    enforce(api, [d for d in shipped if d["kind"].startswith("ValidatingAdmissionPolicy")], scratch, [], [DEFAULT], True)


CA_SETS = [f"startupTaint.key={CA.key}", "startupTaint.value=pending"]


def test_the_agent_may_add_and_remove_its_custom_key_and_the_former_default_nothing_more(api, agent_on, pub):
    api.add_node("gpu-1", taints=[DEFAULT, FOREIGN])
    token, kc = agent_on("gpu-1", CA_SETS, [], [CA_TAINT])
    p = pub("gpu-1", kc)
    r = p.publish(want(False, CA))  # the default removed (a former key), the custom key put on
    assert r.ok, r.detail
    assert taints_of(api) == [FOREIGN, CA_TAINT]
    assert p.publish(want(True, CA)).ok
    assert taints_of(api) == [FOREIGN]
    # what the policy refuses the agent: the default put back, a foreign taint of the same effect removed,
    # its own key with another effect
    for taints in ([FOREIGN, DEFAULT], [], [FOREIGN, {"key": CA.key, "effect": "NoExecute"}]):
        with pytest.raises(ApiError) as exc:
            api.cp.request("PATCH", "/api/v1/nodes/gpu-1", {"spec": {"taints": taints}}, "application/merge-patch+json",
                           token=token)
        assert exc.value.status == 403 and f"may add or remove only its own taint {CA.ident}" in exc.value.body
    assert taints_of(api) == [FOREIGN]


def test_a_former_custom_key_the_policy_was_not_told_of_is_left_and_said(api, agent_on, pub, caplog):
    """custom -> another custom key: the release's policy lets the agent remove the former one only
    when startupTaint.formerKeys lists it. Without: the publish still succeeds, the former taint is
    left (said once), no write on the next pass; with: removed."""
    for node in ("gpu-1", "gpu-2"):  # the Nodes of the release before: the former key on, and recorded
        api.add_node(node, taints=[FOREIGN, CA_TAINT], annotations={ANNOTATION_OWNED_TAINT: CA.ident})
    _, kc = agent_on("gpu-1", [f"startupTaint.key={NRC.key}"], [], [NRC_TAINT])
    p = pub("gpu-1", kc)
    r = p.publish(want(False, NRC))
    assert r.ok, r.detail
    assert taints_of(api) == [FOREIGN, CA_TAINT, NRC_TAINT]
    assert "a former taint key of gpu-tune's is left" in caplog.text
    assert p.publish(want(False, NRC)).writes == 0
    _, kc = agent_on("gpu-2", [f"startupTaint.key={NRC.key}", f"startupTaint.formerKeys={{{CA.ident}}}"],
                     [CA_TAINT], [])
    r = pub("gpu-2", kc).publish(want(False, NRC))
    assert r.ok and taints_of(api, "gpu-2") == [FOREIGN, NRC_TAINT], r.detail


def test_with_taint_handling_off_the_agent_writes_the_condition_and_no_taint(api, agent_on, make_host):
    """The Node Readiness Controller owns the taint: the chart's startupTaint.manage=false gives the
    agent GPU_TUNE_TAINT=off and a policy refusing it any taint change; `gpu-tune label` in enforce
    mode on a node that is not ready publishes the condition only."""
    from tests.test_cluster_access import label_cli

    api.add_node("gpu-1", taints=[NRC_TAINT, DEFAULT])
    token, kc = agent_on("gpu-1", ["startupTaint.manage=false"], [DEFAULT], [], admitted=False)
    proc = label_cli(make_host("small-2cpu"), kc, "gpu-1", "--mode", "enforce", env={"GPU_TUNE_TAINT": "off"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["want"]["taint"] == {"managed": False, "wanted": "unchanged"} and doc["result"]["ok"]
    node = api.node("gpu-1")
    assert node["spec"]["taints"] == [NRC_TAINT, DEFAULT]
    assert next(c for c in node["status"]["conditions"] if c["type"] == CONDITION_TYPE)["status"] == "False"
    with pytest.raises(ApiError) as exc:
        api.cp.request("PATCH", "/api/v1/nodes/gpu-1", {"spec": {"taints": [NRC_TAINT]}},
                       "application/merge-patch+json", token=token)
    assert exc.value.status == 403 and "its taint handling is off" in exc.value.body


def test_label_puts_the_charts_custom_taint_on_through_the_policy(api, agent_on, make_host):
    from tests.test_cluster_access import label_cli

    api.add_node("gpu-1", taints=[FOREIGN, DEFAULT])
    _, kc = agent_on("gpu-1", CA_SETS, [], [CA_TAINT])
    proc = label_cli(make_host("small-2cpu"), kc, "gpu-1", "--mode", "enforce", env={"GPU_TUNE_TAINT": CA.as_option()})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads(proc.stdout)["want"]["taint"] == {**CA.as_dict(), "wanted": "present"}
    assert taints_of(api) == [FOREIGN, CA_TAINT]


from tests.test_cluster_access import agent, shipped  # noqa: E402,F401 - the agent's identity, as shipped


def test_the_agents_taint_option_reaches_its_pass(api, tmp_path, make_host):
    """`gpu-tune serve --taint` (GPU_TUNE_TAINT): the real stages publish under that key. An audit
    agent never puts a taint on and takes its own off: here the custom one and the former default,
    the foreign one left."""
    from gpu_tune.serve.agent import Agent
    from gpu_tune.serve.options import ServeOptions
    from gpu_tune.serve.stages import default_stages

    api.add_node("gpu-1", taints=[DEFAULT, FOREIGN, CA_TAINT])
    opts = ServeOptions(root=str(make_host("small-2cpu")), gpu_backend="none", node="gpu-1", mode="audit",
                        kubeconfig=str(write_kubeconfig(tmp_path / "kc", api.url)), taint=CA.as_option())
    opts.validate()
    st = default_stages(opts)
    try:
        snap = Agent(st, probe_enabled=False).run_pass()
        assert not snap.verdict.ready  # an untuned host: not ready, and still no taint from an audit agent
    finally:
        st.close()
    assert taints_of(api) == [FOREIGN]
    assert api.node("gpu-1")["metadata"]["annotations"][ANNOTATION_OWNED_TAINT] == CA.ident
