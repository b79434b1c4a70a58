"""gpu.allocatable under Dynamic Resource Allocation: a Node without nvidia.com/gpu capacity whose
GPUs NVIDIA's DRA driver (gpu.nvidia.com) publishes in ResourceSlices (gpu_tune/cluster/dra.py).

The slices are made as github.com/NVIDIA/k8s-dra-driver-gpu's GPU kubelet plugin publishes them
(cmd/gpu-kubelet-plugin: driver.go, deviceinfo.go, mig.go): one pool named after the node, its
devices named gpu-<minor> with the attribute type=gpu, MIG devices gpu-<minor>-mig-<profile>-<id>-<start>
with type=mig, written through the real kube-apiserver's resource.k8s.io/v1 API (its validation,
its field selectors, its paging), read by the publisher through the API server and, last, by the
agent's own pass with the ServiceAccount and RBAC the chart and kustomize ship.
"""

from __future__ import annotations

from typing import Any

import pytest

from gpu_tune.judge.readiness import verdict
from gpu_tune.tune.profile import Profile
from tests.realkube.testapi import write_kubeconfig
from tests.test_kube import FAST, _want

DRIVER = "gpu.nvidia.com"  # NVIDIA's DRA driver for GPUs
SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"
GPUS8 = [{"index": i, "mig_mode": False} for i in range(8)]
AUDIT_OK = {"profile": "t", "settings": []}


def gpu_device(minor: int, *, taints: list[dict] | None = None) -> dict[str, Any]:
    """A whole GPU as GpuInfo.GetDevice() announces it."""
    dev = {"name": f"gpu-{minor}",
           "attributes": {"type": {"string": "gpu"}, "uuid": {"string": f"GPU-5f2a0000-1c2d-4e5f-8a9b-0c1d2e3f000{minor}"},
                          "productName": {"string": "NVIDIA H100 80GB HBM3"}, "brand": {"string": "Nvidia"},
                          "architecture": {"string": "Hopper"}, "cudaComputeCapability": {"version": "9.0.0"},
                          "driverVersion": {"version": "570.124.6"}, "cudaDriverVersion": {"version": "12.8.0"},
                          "resource.kubernetes.io/pciBusID": {"string": f"0000:{0x18 + minor:02x}:00.0"}},
           "capacity": {"memory": {"value": "81559Mi"}}}
    if taints:
        dev["taints"] = taints
    return dev


def mig_device(parent: int, profile: str, profile_id: int, start: int) -> dict[str, Any]:
    """A MIG device as MigDeviceInfo.GetDevice() announces it (CommonAttributesMig)."""
    name = f"gpu-{parent}-mig-{profile.replace('.', '')}-{profile_id}-{start}"
    return {"name": name, "attributes": {"type": {"string": "mig"}, "profile": {"string": profile},
                                         "parentUUID": {"string": f"GPU-5f2a0000-1c2d-4e5f-8a9b-0c1d2e3f000{parent}"},
                                         "productName": {"string": "NVIDIA H100 80GB HBM3"}},
            "capacity": {"multiprocessors": {"value": "16"}}}


def slice_doc(node: str, devices: list[dict], *, generation: int = 1, count: int = 1, driver: str = DRIVER,
              pool: str | None = None) -> dict[str, Any]:
    """One ResourceSlice as the kubelet plugin helper writes it: named <node>-<driver>-<random>,
    in the pool named after the node."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"generateName": f"{node}-{driver}-"},
            "spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": pool or node, "generation": generation, "resourceSliceCount": count},
                     "devices": devices}}


def as_listed(doc: dict) -> dict:
    return {"metadata": {"name": "x"}, "spec": doc["spec"]}


# -- the count, pure ----------------------------------------------------------------------------------
def test_only_whole_gpus_of_the_newest_generation_of_this_nodes_pools_count():
    from gpu_tune.cluster.dra import count_gpus

    eight = [gpu_device(i) for i in range(8)]
    slices = [as_listed(slice_doc("gpu-1", [gpu_device(i) for i in range(7)], generation=1)),  # being replaced
              as_listed(slice_doc("gpu-1", eight[:4] + [mig_device(7, "1g.10gb", 19, 0)], generation=2, count=2)),
              as_listed(slice_doc("gpu-1", eight[4:] + [eight[0]], generation=2, count=2)),  # gpu-0 twice: once
              as_listed(slice_doc("gpu-2", eight)),  # another node
              as_listed(slice_doc("gpu-1", eight, driver="compute-domain.nvidia.com"))]  # another driver
    c = count_gpus(slices, "gpu-1")
    assert (c.gpus, c.slices, c.stale, c.devices) == (8, 2, 1, {"gpu": 8, "mig": 1})
    assert c.pools == ("gpu-1 generation 2",) and not c.incomplete and not c.truncated
    assert c.notes() == ["also 1 mig device(s)", "1 slice(s) of an older pool generation left out"]
    half = count_gpus(slices[1:2], "gpu-1")
    assert half.gpus == 4 and half.incomplete == ("gpu-1: 1 of 2 slices",)
    assert count_gpus([], "gpu-1").slices == 0 and count_gpus([{"spec": None}, "x"], "gpu-1").gpus == 0


def test_a_gpu_the_driver_tainted_is_named():
    from gpu_tune.cluster.dra import count_gpus

    xid = {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}
    quiet = {"key": "gpu.nvidia.com/unmonitored", "effect": "None"}
    c = count_gpus([as_listed(slice_doc("gpu-1", [gpu_device(0, taints=[xid]), gpu_device(1, taints=[quiet])]))],
                   "gpu-1")
    assert c.gpus == 2 and c.tainted == ("gpu-0 (gpu.nvidia.com/xid)",)


def test_the_type_attribute_may_be_qualified_with_the_drivers_domain():
    from gpu_tune.cluster.dra import device_type

    assert device_type({"attributes": {"gpu.nvidia.com/type": {"string": "gpu"}}}) == "gpu"
    assert device_type({"attributes": {"type": {"string": "vfio"}}}) == "vfio"
    assert device_type({"attributes": {"type": {"int": 1}}}) is None and device_type({}) is None


# -- through the real API server --------------------------------------------------------------------
def publish_facts(api, tmp_path, node: str, **kw):
    from gpu_tune.cluster.publisher import make_publisher

    return make_publisher(node, str(write_kubeconfig(tmp_path / "kc", api.url)), False, **{**FAST, **kw})


def judged(facts, *, required: bool = True, gpus=GPUS8):
    prof = Profile(name="t", readiness={"require_probe": False, "require_device_plugin": required})
    v = verdict(profile=prof, audit=AUDIT_OK, gpus=gpus, probes=[], publish=facts)
    return v, {c.name: c for c in v.checks}["gpu.allocatable"]


def slice_lists(api) -> list[dict[str, str]]:
    return [q for m, p, q in api.queries if m == "GET" and p == SLICES_PATH]


def test_seven_of_eight_gpus_in_the_drivers_slices_is_not_ready_both_figures_named(api, tmp_path):
    api.add_node("gpu-1", labels={"nvidia.com/gpu.present": "true"})
    api.create(SLICES_PATH, slice_doc("gpu-1", [gpu_device(i) for i in range(7)]))
    pub = publish_facts(api, tmp_path, "gpu-1")
    facts = pub.read()
    v, c = judged(facts)
    assert not v.ready and v.reason() == "DevicePluginMissingGpus"
    assert c.detail.startswith("7 of 8 GPUs offered by the DRA driver gpu.nvidia.com (1 ResourceSlice(s) of "
                               "gpu.nvidia.com (pool gpu-1 generation 1); 8 GPU(s) on the host)"), c.detail
    assert v.message().startswith("gpu.allocatable: 7 of 8 GPUs offered by the DRA driver"), v.message()
    assert not judged(facts, required=False)[0].ready  # a shortfall fails whether required or not
    assert facts.ok and facts.gpu_capacity is None and facts.dra.gpus == 7, facts.as_dict()
    (q,) = slice_lists(api)  # filtered by the server's field selector, paged, from its watch cache
    assert q == {"fieldSelector": "spec.nodeName=gpu-1,spec.driver=gpu.nvidia.com", "limit": "64",
                 "resourceVersion": "0"}
    pub.close()


def test_eight_of_eight_is_ready_and_a_steady_pass_reads_twice_writes_nothing(api, tmp_path):
    """The pool republished (generation 2 replaces the 7 GPUs of generation 1), beside another
    node's slices and another driver's on this node: 8 of 8, ready with require_device_plugin
    true. A steady pass: one GET of the Node, one LIST of its slices, no write."""
    api.add_node("gpu-1")
    api.add_node("gpu-2")
    api.create(SLICES_PATH, slice_doc("gpu-1", [gpu_device(i) for i in range(7)], generation=1))
    api.create(SLICES_PATH, slice_doc("gpu-1", [gpu_device(i) for i in range(8)], generation=2))
    api.create(SLICES_PATH, slice_doc("gpu-2", [gpu_device(i) for i in range(8)]))
    api.create(SLICES_PATH, slice_doc("gpu-1", [{"name": "channel-0", "attributes": {"type": {"string": "channel"}}}],
                                      driver="compute-domain.nvidia.com"))
    pub = publish_facts(api, tmp_path, "gpu-1")
    facts = pub.read()
    v, c = judged(facts)
    assert v.ready and c.ok, c.detail
    assert c.detail == ("8 GPU device(s) of gpu.nvidia.com for 8 GPU(s) (1 ResourceSlice(s) of gpu.nvidia.com "
                        "(pool gpu-1 generation 2); 8 GPU(s) on the host); 1 slice(s) of an older pool generation "
                        "left out"), c.detail
    assert "ResourceSlices of gpu.nvidia.com: 8 GPU(s)" in facts.gpu_expected
    assert pub.publish(_want(True)).ok
    api.reset_counts()
    facts = pub.read()
    r = pub.publish(_want(True))
    assert (facts.reads, r.reads, r.writes, api.total_writes()) == (2, 0, 0, 0)
    assert r.dra.gpus == 8 and api.reads["gpu-1"] == 1 and len(slice_lists(api)) == 1
    pub.close()


def test_no_slices_and_no_device_plugin_is_as_today(api, tmp_path):
    api.add_node("gpu-1")
    api.create(SLICES_PATH, slice_doc("gpu-2", [gpu_device(i) for i in range(8)]))  # not this node's
    facts = publish_facts(api, tmp_path, "gpu-1").read()
    v, c = judged(facts, required=False)
    assert v.ready and c.ok and "no NVIDIA device plugin runs on it" in c.detail and "not required" in c.detail
    v, c = judged(facts)
    assert not v.ready and "readiness.require_device_plugin is true" in c.detail
    assert "nor NVIDIA's DRA driver (no ResourceSlice of gpu.nvidia.com names the node)" in c.detail
    assert facts.dra is not None and facts.dra.slices == 0 and facts.dra_error is None


def test_a_node_with_the_device_plugins_capacity_lists_no_slice(api, tmp_path):
    api.add_node("gpu-1", capacity={"nvidia.com/gpu": "8"})
    facts = publish_facts(api, tmp_path, "gpu-1").read()
    assert facts.reads == 1 and facts.dra is None and slice_lists(api) == []
    assert judged(facts)[1].detail.startswith("nvidia.com/gpu 8 for 8 GPU(s)")


def test_a_gpu_in_mig_mode_offered_as_mig_devices(api, tmp_path):
    api.add_node("gpu-1")
    migs = [mig_device(7, "3g.40gb", 9, 0), mig_device(7, "3g.40gb", 9, 4)]
    api.create(SLICES_PATH, slice_doc("gpu-1", [gpu_device(i) for i in range(7)] + migs))
    gpus = [dict(g, mig_mode=g["index"] == 7) for g in GPUS8]
    v, c = judged(publish_facts(api, tmp_path, "gpu-1").read(), gpus=gpus)
    assert v.ready and c.ok and "also 2 mig device(s)" in c.detail and "1 of them in MIG mode (GPU 7)" in c.detail


@pytest.mark.parametrize("status", [403, 500])
def test_a_refused_list_is_named_and_fails_only_where_required(api, tmp_path, status):
    api.add_node("gpu-1")
    api.fail(r"/resourceslices", status)
    facts = publish_facts(api, tmp_path, "gpu-1", attempts=2).read()
    assert facts.ok and facts.dra is None and facts.dra_error, facts.as_dict()
    if status == 403:
        assert 'apiGroups: ["resource.k8s.io"], resources: ["resourceslices"], verbs: ["list"]' in facts.dra_error
    v, c = judged(facts, required=False)
    assert v.ready and "could not be listed" in c.detail
    v, c = judged(facts)
    assert not v.ready and facts.dra_error in c.detail


def test_a_server_without_the_dra_api_is_as_today(api, tmp_path):
    api.add_node("gpu-1")
    api.fail(r"/resourceslices", 404)
    facts = publish_facts(api, tmp_path, "gpu-1").read()
    assert facts.ok and facts.dra is None and facts.dra_error is None
    assert judged(facts, required=False)[1].detail.endswith(
        "no NVIDIA device plugin runs on it (8 GPU(s) on the host); not required (readiness.require_device_plugin is false)")


def test_the_list_is_one_request_from_the_watch_cache_and_bounded(api, tmp_path):
    """resourceVersion=0: the API server answers from its watch cache, whole, whatever the limit
    (kube-apiserver 1.36: one request for three slices at limit 1); what is kept is bounded
    (``page_size`` x ``max_pages``) and the count says what was left out."""
    import json as _json

    from gpu_tune.cluster.api import CoreV1, reader_configuration
    from gpu_tune.cluster.dra import count_gpus, list_node_slices

    api.add_node("gpu-1")
    for i in range(3):
        api.create(SLICES_PATH, slice_doc("gpu-1", [gpu_device(i)], count=3))
    cfg, _ = reader_configuration(str(write_kubeconfig(tmp_path / "kc", api.url)))
    client = CoreV1(cfg)
    try:
        def fetch(query):
            return _json.loads(client.request("GET", SLICES_PATH, query=query))

        items, truncated = list_node_slices(fetch, "gpu-1", page_size=1, max_pages=4)
        assert len(items) == 3 and not truncated and len(slice_lists(api)) == 1
        items, truncated = list_node_slices(fetch, "gpu-1", page_size=1, max_pages=2)
        assert len(items) == 2 and truncated
        c = count_gpus(items, "gpu-1", truncated=truncated)
        assert c.gpus == 2 and c.notes()[-1] == "more than 256 slices: the rest not read"
    finally:
        client.close()


# -- the agent's own pass, with the ServiceAccount and RBAC it ships with ------------------------------
def test_the_agents_pass_counts_the_drivers_gpus_with_its_own_rbac(api, tmp_path, make_host, gpu_fixture,
                                                                    agent):
    """The real stages and the agent loop, with a pod-bound token of the shipped ServiceAccount
    (RBAC and admission policy as `kubectl apply -k daemonset/` installs them; the chart's are
    the same, tests/test_helm.py): 7 of 8 not ready on the Node's condition, both figures named;
    the driver republishes 8: ready on that count."""
    from gpu_tune.cluster.labels import CONDITION_TYPE
    from gpu_tune.serve.agent import Agent
    from gpu_tune.serve.options import ServeOptions
    from gpu_tune.serve.stages import default_stages
    from tests.test_cluster_access import wait_policy_enforced

    api.add_node("gpu-1", labels={"nvidia.com/gpu.present": "true"})
    token, kc = agent("gpu-1")
    assert api.cp.can(token, "list", "resourceslices", group="resource.k8s.io")
    for verb in ("get", "watch", "create", "patch", "delete"):
        assert not api.cp.can(token, verb, "resourceslices", group="resource.k8s.io"), verb
    wait_policy_enforced(api, token, "gpu-1")
    made = api.create(SLICES_PATH, slice_doc("gpu-1", [gpu_device(i) for i in range(7)]))
    st = default_stages(ServeOptions(root=str(make_host("dgx-8gpu")), gpu_backend="fixture",
                                     gpu_fixture=str(gpu_fixture("dgx-8gpu")), kubeconfig=kc, node="gpu-1"))
    agent_loop = Agent(st, probe_enabled=False)
    try:
        snap = agent_loop.run_pass()
        checks = {c.name: c for c in snap.verdict.checks}
        assert checks["gpu.allocatable"].detail.startswith("7 of 8 GPUs offered by the DRA driver gpu.nvidia.com")
        assert checks["topology.published"].ok, checks["topology.published"].detail
        cond = next(c for c in api.node("gpu-1")["status"]["conditions"] if c["type"] == CONDITION_TYPE)
        assert cond["status"] == "False" and "gpu.allocatable: 7 of 8 GPUs offered by the DRA driver" in cond["message"]
        # the driver republishes its pool with the eighth GPU
        api.cp.request("PUT", f"{SLICES_PATH}/{made['metadata']['name']}",
                       {**made, "spec": {**made["spec"], "pool": {**made["spec"]["pool"], "generation": 2},
                                         "devices": [gpu_device(i) for i in range(8)]}})
        api.reset_counts()
        snap = agent_loop.run_pass()
        c = {c.name: c for c in snap.verdict.checks}["gpu.allocatable"]
        assert c.ok and c.detail.startswith("8 GPU device(s) of gpu.nvidia.com for 8 GPU(s)"), c.detail
        assert len(slice_lists(api)) == 1 and api.reads["gpu-1"] == 1  # one list, one GET a pass
    finally:
        st.close()


from tests.test_cluster_access import agent, shipped  # noqa: E402,F401 - the agent's identity, as shipped
