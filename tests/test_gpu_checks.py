"""The GPU-side checks: gpu.mig_mode (fixture and NVML), gpu.gpudirect_rdma and gpu.gds (kernel
modules under /sys/module), gpu.driver_cuda (the driver's CUDA against the probe's TensorFlow
build, read as text) and gpu.allocatable (the device plugin's capacity on the Node)."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from gpu_tune.tune.engine import audit, make_context, plan
from gpu_tune.gpu import select_backend
from gpu_tune.gpu.cuda import FrameworkBuild, cuda_major_minor, framework_build_from, parse_build_info
from gpu_tune.host.fs import HostFS
from gpu_tune.tune.knobs import fixable
from gpu_tune.cluster.publisher import PublishResult
from gpu_tune.tune.profile import Profile
from gpu_tune.tune.policy import load_profile
from gpu_tune.gpu.base import GpuInfo
from gpu_tune.judge.checks.cluster import DevicePlugin
from gpu_tune.judge.checks.driver import Driver
from gpu_tune.judge.readiness import verdict
from tests.fixtures import pcigen


def allocatable_check(gpus, publish, *, required=False):
    return DevicePlugin().allocatable([GpuInfo.from_dict(g) for g in gpus], publish, required=required)


def driver_cuda_check(topology, gpus=()):
    return Driver().driver_cuda(topology, [GpuInfo.from_dict(g) for g in gpus])

GPU_DIR = pcigen.GPU_JSON_DIR

TF_CUDA_BUILD = ('"""Auto-generated module providing information about the build."""\nimport collections\n\n'
                 "build_info = collections.OrderedDict([('cpu_compiler', '/usr/lib/llvm-18/bin/clang'), "
                 "('cuda_compute_capabilities', ['sm_60', 'sm_70', 'sm_80', 'sm_89', 'compute_90']), "
                 "('cuda_version', '12.5.1'), ('cudnn_version', '9'), ('is_cuda_build', True), "
                 "('is_rocm_build', False), ('is_tensorrt_build', False)])\n")
TF_CPU_BUILD = ("import collections\n\nbuild_info = collections.OrderedDict([('is_cuda_build', False), "
                "('is_rocm_build', False), ('is_tensorrt_build', False)])\n")


def fixture_copy(tmp_path, name: str, edit=None):
    data = json.loads((GPU_DIR / f"{name}.json").read_text())
    if edit:
        edit(data)
    f = tmp_path / f"{name}-edited.json"
    f.write_text(json.dumps(data))
    return select_backend("fixture", str(f))


def rows(root, profile, backend, sid):
    return [r for r in audit(make_context(HostFS(root), profile, backend)).settings if r.id == sid]


# -- gpu.mig_mode -----------------------------------------------------------------------------------
def test_mig_mode_rows_from_the_fixture(make_host, tmp_path):
    root = make_host("link-degraded")

    def edit(d):
        d["gpus"][1].update(mig_mode=True, mig_mode_pending=True)

    b = fixture_copy(tmp_path, "link-degraded", edit)
    got = rows(root, load_profile("training"), b, "gpu.mig_mode")  # training: mig_mode false
    assert [(r.target, r.current, r.desired, r.status) for r in got] == [
        ("0", "off", "off", "ok"), ("1", "on", "off", "drift")]
    assert "nvidia-smi -i 1 -mig 0" in got[1].detail and "nvidia.com/mig.config=all-disabled" in got[1].detail
    assert not fixable("gpu.mig_mode")
    assert all(r.id != "gpu.mig_mode" for r in plan(audit(make_context(HostFS(root), load_profile("training"), b)).settings))
    want_on = Profile(name="t", gpu={"mig_mode": True})
    got = rows(root, want_on, b, "gpu.mig_mode")
    assert [(r.target, r.status) for r in got] == [("0", "drift"), ("1", "ok")] and "-mig 1" in got[0].detail


def test_mig_pending_and_unsupported(make_host, tmp_path):
    root = make_host("link-degraded")

    def edit(d):
        d["gpus"][0].update(mig_mode=True, mig_mode_pending=False)  # disabled, takes effect at reset
        for k in ("mig_mode", "mig_mode_pending"):
            d["gpus"][1].pop(k)  # a GPU without MIG
        d["gpus"][1]["name"] = "NVIDIA L40S"

    b = fixture_copy(tmp_path, "link-degraded", edit)
    got = rows(root, load_profile("training"), b, "gpu.mig_mode")
    assert got[0].status == "drift" and "set to off, pending: reset the GPU (nvidia-smi -r -i 0)" in got[0].detail
    assert (got[1].status, got[1].detail) == ("unsupported", "NVIDIA L40S has no MIG")
    got = rows(root, Profile(name="t", gpu={"mig_mode": True}), b, "gpu.mig_mode")
    assert got[0].status == "ok" and got[0].detail == "pending off after the next GPU reset"
    # no backend / a lost GPU
    assert [(r.target, r.status) for r in rows(root, load_profile("training"), select_backend("none"),
                                                "gpu.mig_mode")] == [("-", "unsupported")]
    lost = fixture_copy(tmp_path, "link-degraded", lambda d: d["gpus"][0].update(lost=True))
    assert rows(root, load_profile("training"), lost, "gpu.mig_mode")[0].status == "error"


def test_mig_in_topology_document_and_view(make_host, tmp_path):
    from rich.console import Console

    from gpu_tune.discover.topology import discover
    from gpu_tune.views.topology import render_topology

    root = make_host("link-degraded")
    b = fixture_copy(tmp_path, "link-degraded", lambda d: d["gpus"][1].update(mig_mode=True, mig_mode_pending=False))
    topo = discover(HostFS(root), b)
    g = topo.as_dict()["gpus"]
    assert (g[0]["mig_mode"], g[1]["mig_mode"], g[1]["mig_mode_pending"]) == (False, True, False)
    c = Console(width=220, record=True, color_system=None)
    c.print(render_topology(topo))
    text = c.export_text()
    assert "MIG on (pending off after a GPU reset)" in text and text.count("MIG") == 1


def test_mig_fixture_types_are_checked(tmp_path):
    from gpu_tune.errors import InputError

    doc = {"gpus": [{"index": 0, "uuid": "GPU-0", "name": "H100", "pci_bus_id": "0000:18:00.0", "mig_mode": "yes"}]}
    f = tmp_path / "g.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=r"gpus\[0\]\.mig_mode: expected bool"):
        select_backend("fixture", str(f))


def test_mig_mode_from_nvml(monkeypatch):
    from tests import nvmlfake

    gpus = nvmlfake.hgx_h100(3, g0=dict(mig=(1, 1)), g1=dict(lost=True), g2=dict(mig=(0, 1)))  # g2: at the next reset
    b, lib = nvmlfake.backend(monkeypatch, gpus)
    g0, g1, g2 = b.gpus()
    assert (g0.mig_mode, g0.mig_mode_pending) == (True, True)
    assert g1.error_kind == "lost" and g1.mig_mode is None
    assert (g2.mig_mode, g2.mig_mode_pending) == (False, True)
    lib.gpus[0].mig = None  # NVML_ERROR_NOT_SUPPORTED: no MIG on this GPU
    assert b.gpus()[0].mig_mode is None
    lib.missing.add("nvmlDeviceGetMigMode")  # a driver without the call (the binding caches the pointer)
    import pynvml

    pynvml._nvmlGetFunctionPointer_cache.pop("nvmlDeviceGetMigMode", None)
    assert b.gpus()[2].mig_mode is None and not b.gpus()[2].unread
    b.close()


def test_gpu_info_has_the_field_the_probe_reads():
    from gpu_tune.gpu.base import GpuInfo

    g = GpuInfo(0, "GPU-0", "H100", "0000:18:00.0", mig_mode=True)
    assert getattr(g, "mig_mode", None) is True and g.as_dict()["mig_mode"] is True


# -- gpu.gpudirect_rdma / gpu.gds -----------------------------------------------------------------
def test_gpudirect_rdma_loaded_on_the_dgx(tmp_path_factory):
    root = pcigen.build_shared("dgx-8gpu", tmp_path_factory)
    b = select_backend("fixture", str(GPU_DIR / "dgx-8gpu.json"))
    (row,) = rows(root, load_profile("training"), b, "gpu.gpudirect_rdma")
    assert (row.target, row.current, row.desired, row.status) == ("host", "loaded", "loaded", "ok")
    assert row.detail.startswith("nvidia_peermem live; GPU 0,1,2,3,4,5,6,7 and RDMA NIC mlx5_0, mlx5_1")
    assert row.detail.endswith("share NUMA nodes 0,1")


def test_gpudirect_rdma_missing_module_is_drift_with_the_remedy(make_host):
    root = make_host("irqbalance")  # GPU 0 and mlx5_0 on node 0, no nvidia_peermem
    b = select_backend("fixture", str(GPU_DIR / "irqbalance.json"))
    (row,) = rows(root, load_profile("training"), b, "gpu.gpudirect_rdma")
    assert (row.current, row.status) == ("not loaded", "drift")
    assert row.detail.startswith("GPU 0 and RDMA NIC mlx5_0 share NUMA node 0: modprobe nvidia_peermem")
    assert "driver.rdma.enabled=true" in row.detail and not fixable("gpu.gpudirect_rdma")
    # loading (initstate "coming") is not loaded yet; the pre-465 module name counts
    (root / "sys/module/nvidia_peermem").mkdir()
    (root / "sys/module/nvidia_peermem/initstate").write_text("coming\n")
    (row,) = rows(root, load_profile("training"), b, "gpu.gpudirect_rdma")
    assert (row.current, row.status) == ("nvidia_peermem coming", "drift")
    shutil.rmtree(root / "sys/module/nvidia_peermem")
    (root / "sys/module/nv_peer_mem").mkdir()
    (root / "sys/module/nv_peer_mem/initstate").write_text("live\n")
    (row,) = rows(root, load_profile("training"), b, "gpu.gpudirect_rdma")
    assert row.status == "ok" and row.detail.startswith("nv_peer_mem live")


def test_gpudirect_rdma_unsupported_without_a_shared_node(make_host):
    prof = load_profile("training")
    root = make_host("link-degraded")  # GPUs, no NIC
    b = select_backend("fixture", str(GPU_DIR / "link-degraded.json"))
    assert rows(root, prof, b, "gpu.gpudirect_rdma")[0].detail == "no RDMA NIC (/sys/class/infiniband lists none)"
    root = make_host("vm-virtio-2node")  # a virtio NIC is not RDMA
    b = select_backend("fixture", str(GPU_DIR / "vm-virtio-2node.json"))
    assert rows(root, prof, b, "gpu.gpudirect_rdma")[0].status == "unsupported"
    root = make_host("irqbalance")  # move the RDMA NIC off any one node (numa_node -1, all CPUs local)
    b = select_backend("fixture", str(GPU_DIR / "irqbalance.json"))
    nic = root / "sys/devices/pci0000:10/0000:10:01.0/0000:19:00.0"
    (nic / "numa_node").write_text("-1\n")
    (nic / "local_cpulist").write_text("0-15\n")
    (row,) = rows(root, prof, b, "gpu.gpudirect_rdma")
    assert (row.status, row.detail) == ("unsupported", "no RDMA NIC shares a NUMA node with a GPU "
                                                       "(GPUs on nodes [0, 1], RDMA NICs on nodes unknown)")
    root2 = make_host("vm-no-cpufreq")  # no GPU at all
    assert rows(root2, prof, select_backend("none"), "gpu.gpudirect_rdma")[0].detail == "no NVIDIA GPU"


def test_gds_when_the_profile_asks(tmp_path_factory, make_host):
    root = pcigen.build_shared("dgx-8gpu", tmp_path_factory)
    b = select_backend("fixture", str(GPU_DIR / "dgx-8gpu.json"))
    assert rows(root, load_profile("training"), b, "gpu.gds") == []  # off in the shipped profiles
    prof = Profile(name="t", gpu={"gds": True})
    (row,) = rows(root, prof, b, "gpu.gds")
    assert (row.current, row.status) == ("not loaded", "drift") and "nvidia-gds" in row.detail
    root = make_host("link-degraded")
    (root / "sys/module/nvidia_fs").mkdir(parents=True)
    (root / "sys/module/nvidia_fs/initstate").write_text("live\n")
    (row,) = rows(root, prof, select_backend("fixture", str(GPU_DIR / "link-degraded.json")), "gpu.gds")
    assert row.status == "ok"
    assert rows(make_host("vm-no-cpufreq"), prof, select_backend("none"), "gpu.gds")[0].status == "unsupported"


# -- gpu.driver_cuda ----------------------------------------------------------------------------------
def test_build_info_is_parsed_as_text(tmp_path):
    assert parse_build_info(TF_CUDA_BUILD)["cuda_version"] == "12.5.1"
    assert parse_build_info("build_info = {'is_cuda_build': True, 'cuda_version': '64_112'}")["cuda_version"] == "64_112"
    with pytest.raises(ValueError):
        parse_build_info("x = 1\n")
    assert cuda_major_minor("12.5.1") == (12, 5) and cuda_major_minor("13.0") == (13, 0)
    assert cuda_major_minor("64_112") == (11, 2) and cuda_major_minor("") is None
    pkg = tmp_path / "tensorflow"
    (pkg / "python/platform").mkdir(parents=True)
    (pkg / "python/platform/build_info.py").write_text(TF_CUDA_BUILD)
    fb = framework_build_from(pkg)
    assert (fb.found, fb.is_cuda_build, fb.cuda_version, fb.cudnn_version) == (True, True, "12.5.1", "9")
    (pkg / "python/platform/build_info.py").write_text(TF_CPU_BUILD)
    assert framework_build_from(pkg).is_cuda_build is False
    (pkg / "python/platform/build_info.py").write_text("build_info = (\n")
    assert framework_build_from(pkg).error and framework_build_from(None).found is False


def test_the_probe_tensorflow_is_found_without_importing_it():
    import subprocess

    code = ("import sys; from gpu_tune.gpu.cuda import probe_framework_build as p; b = p(); "
            "print(b.found, 'tensorflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[1] == "False"  # located and read, never imported


def _topo(driver, build: FrameworkBuild):
    return {"gpus": [{"index": 0}], "cuda_driver_version": driver, "probe_runtime": build.as_dict()}


CUDA_TF = FrameworkBuild("tensorflow", True, True, "12.5.1", "9", "/site-packages/tensorflow")


@pytest.mark.parametrize("driver,ok,needle", [
    ("12.8", True, "the driver supports CUDA 12.8, the probe's tensorflow was built for CUDA 12.5.1"),
    ("13.0", True, "supports CUDA 13.0"),
    ("12.5", True, "supports CUDA 12.5"),
    ("12.2", False, "the NVIDIA driver supports CUDA 12.2, older than CUDA 12.5.1 the probe's tensorflow was built "
                    "for: upgrade the driver to one that supports CUDA 12.5 or newer"),
    ("11.8", False, "older than CUDA 12.5.1"),
])
def test_driver_cuda_check(driver, ok, needle):
    c = driver_cuda_check(_topo(driver, CUDA_TF))
    assert c.name == "gpu.driver_cuda" and c.ok is ok and needle in c.detail


def test_driver_cuda_check_without_a_cuda_build_or_gpus():
    cpu = FrameworkBuild("tensorflow", True, False, location="/x")
    assert "CPU-only build" in driver_cuda_check(_topo("12.8", cpu)).detail
    assert driver_cuda_check(_topo("12.8", cpu)).ok
    none = FrameworkBuild("tensorflow", False)
    assert driver_cuda_check(_topo("12.8", none)).detail == "not compared: the probe's tensorflow is not installed (driver supports CUDA 12.8)"
    assert driver_cuda_check({"gpus": [], "cuda_driver_version": None, "probe_runtime": CUDA_TF.as_dict()}) is None
    assert driver_cuda_check(None, [{"index": 0}]) is None  # no topology yet: no facts
    unknown = driver_cuda_check(_topo(None, CUDA_TF))
    assert unknown.ok and "the driver's CUDA version is unknown" in unknown.detail


def test_topology_carries_driver_and_probe_runtime(make_host, monkeypatch):
    from gpu_tune.gpu import cuda
    from gpu_tune.discover.topology import discover

    root = make_host("link-degraded")
    monkeypatch.setattr(cuda, "probe_framework_build", lambda framework="tensorflow": CUDA_TF)
    doc = discover(HostFS(root), select_backend("fixture", str(GPU_DIR / "link-degraded.json"))).as_dict()
    assert (doc["driver_version"], doc["cuda_driver_version"]) == ("570.124.06", "12.8")
    assert doc["probe_runtime"]["cuda_version"] == "12.5.1"
    v = verdict(profile=load_profile("training"), audit=None, gpus=[], topology=doc, probes=[])
    assert [c.ok for c in v.checks if c.name == "gpu.driver_cuda"] == [True]
    old = dict(doc, cuda_driver_version="12.2")
    v = verdict(profile=load_profile("training"), audit=None, gpus=[], topology=old, probes=[])
    (c,) = [c for c in v.checks if c.name == "gpu.driver_cuda"]
    assert not c.ok and not v.ready


def test_driver_too_old_is_the_condition_reason_when_first():
    from gpu_tune.judge.readiness import Check, Verdict

    v = Verdict(False, (Check("tuning.compliant", True), Check("gpu.driver_cuda", False, "x")))
    assert v.reason() == "DriverTooOldForCuda"
    v = Verdict(False, (Check("gpu.allocatable", False, "x"),))
    assert v.reason() == "DevicePluginMissingGpus"


# -- gpu.allocatable ---------------------------------------------------------------------------------
def _pub(cap, alloc=None, read=True, detail="node gpu-1 up to date"):
    return PublishResult(writes=0, changed=[], ok=True, detail=detail, node_read=read, gpu_capacity=cap,
                         gpu_allocatable=cap if alloc is None else alloc)


GPUS8 = [{"index": i, "mig_mode": False} for i in range(8)]


def test_allocatable_equal_fewer_more():
    c = allocatable_check(GPUS8, _pub(8))
    assert c.ok and c.detail == "nvidia.com/gpu 8 for 8 GPU(s) (8 GPU(s) on the host)"
    c = allocatable_check(GPUS8, _pub(7))
    assert not c.ok and c.detail.startswith("7 of 8 GPUs offered by the device plugin (nvidia.com/gpu 7; 8 GPU(s) on the host)")
    assert "restart the device plugin pod" in c.detail
    c = allocatable_check(GPUS8, _pub(16))
    assert c.ok and "time-slicing replicas or MIG devices" in c.detail
    c = allocatable_check(GPUS8, _pub(8, alloc=6))
    assert c.ok and "allocatable 6: the device plugin marks 2 unhealthy" in c.detail


def test_allocatable_leaves_mig_gpus_out():
    gpus = [dict(g, mig_mode=g["index"] in (2, 5)) for g in GPUS8]
    c = allocatable_check(gpus, _pub(6))
    assert c.ok and "2 of them in MIG mode (GPU 2, 5)" in c.detail
    assert not allocatable_check(gpus, _pub(5)).ok


def test_allocatable_without_device_plugin_or_kubernetes():
    c = allocatable_check(GPUS8, _pub(None))
    assert c.ok and "no NVIDIA device plugin" in c.detail and "not required" in c.detail
    c = allocatable_check(GPUS8, _pub(None), required=True)
    assert not c.ok and "readiness.require_device_plugin is true" in c.detail
    off = PublishResult(writes=0, changed=[], ok=True, detail="kubernetes publishing off: --no-kube given")
    c = allocatable_check(GPUS8, off)
    assert c.ok and c.detail == "not checked: kubernetes publishing off: --no-kube given"
    failed = PublishResult(writes=0, changed=[], ok=False, detail="get nodes: API server unavailable")
    assert allocatable_check(GPUS8, failed).detail == "not checked: the Node could not be read (see topology.published)"
    assert allocatable_check([], _pub(8)) is None and allocatable_check(GPUS8, None) is None


def test_verdict_uses_the_previous_read_before_publishing():
    prof = Profile(name="t", readiness={"require_probe": False})
    pre = verdict(profile=prof, audit={"profile": "t", "settings": []}, gpus=GPUS8, probes=[], last_publish=_pub(7))
    assert not pre.ready and pre.reason() == "DevicePluginMissingGpus"
    final = verdict(profile=prof, audit={"profile": "t", "settings": []}, gpus=GPUS8, probes=[],
                    last_publish=_pub(7), publish=_pub(8))
    assert final.ready


def test_publisher_reads_capacity_from_the_node(tmp_path, api):
    from gpu_tune.cluster.publisher import make_publisher
    from tests.realkube.testapi import write_kubeconfig
    from tests.test_kube import _want

    api.add_node("gpu-1", capacity={"nvidia.com/gpu": "8"}, allocatable={"nvidia.com/gpu": "7"})
    api.add_node("cpu-1")
    kc = str(write_kubeconfig(tmp_path / "kc", api.url))
    pub = make_publisher("gpu-1", kc, False, attempts=2, backoff_base_s=0.01, retry_budget_s=2.0)
    r = pub.publish(_want(True))
    assert (r.node_read, r.gpu_capacity, r.gpu_allocatable) == (True, 8, 7)
    api.edit_node("gpu-1", {"status": {"capacity": {"nvidia.com/gpu": "6"}}})  # the plugin lost 2
    r = pub.publish(_want(True))
    assert r.gpu_capacity == 6 and r.as_dict()["gpu_capacity"] == 6
    pub.close()
    pub = make_publisher("cpu-1", kc, False, attempts=2, backoff_base_s=0.01, retry_budget_s=2.0)
    r = pub.publish(_want(True), dry_run=True)
    assert (r.node_read, r.gpu_capacity) == (True, None)
    pub.close()
    pub = make_publisher("gone", kc, False, attempts=2, backoff_base_s=0.01, retry_budget_s=2.0)
    r = pub.publish(_want(True))
    assert not r.ok and not r.node_read
    pub.close()


def test_agent_not_ready_when_the_device_plugin_lost_gpus(tmp_path, monkeypatch, api):
    """The real stages: fixture GPUs, the test API server's Node with 7 of 8 GPUs advertised."""
    from gpu_tune.cluster.labels import CONDITION_TYPE
    from gpu_tune.serve.agent import Agent
    from gpu_tune.serve.options import ServeOptions
    from gpu_tune.serve.stages import default_stages
    from tests.fixtures import hostgen
    from tests.realkube.testapi import write_kubeconfig

    root = hostgen.build("link-degraded", tmp_path / "host")  # 2 GPUs
    api.add_node("gpu-7", capacity={"nvidia.com/gpu": "1"})
    kc = str(write_kubeconfig(tmp_path / "kc", api.url))
    st = default_stages(ServeOptions(root=str(root), gpu_backend="fixture",
                                     gpu_fixture=str(GPU_DIR / "link-degraded.json"), kubeconfig=kc,
                                     node="gpu-7"))
    agent = Agent(st, probe_enabled=False)
    snap = agent.run_pass()
    checks = {c.name: c for c in snap.verdict.checks}
    assert not checks["gpu.allocatable"].ok
    assert "1 of 2 GPUs offered by the device plugin" in checks["gpu.allocatable"].detail
    agent.run_pass()  # the next pass decides the condition with what the last one read
    cond = next(c for c in api.node("gpu-7")["status"]["conditions"] if c["type"] == CONDITION_TYPE)
    assert cond["status"] == "False" and "gpu.allocatable" in cond["message"]
    api.edit_node("gpu-7", {"status": {"capacity": {"nvidia.com/gpu": "2"}}})
    snap = agent.run_pass()
    assert {c.name: c for c in snap.verdict.checks}["gpu.allocatable"].ok
    st.close()


def test_no_kube_lists_allocatable_as_not_checked(make_host):
    from gpu_tune.serve.agent import Agent
    from gpu_tune.serve.options import ServeOptions
    from gpu_tune.serve.stages import default_stages

    root = make_host("link-degraded")
    st = default_stages(ServeOptions(root=str(root), gpu_backend="fixture",
                                     gpu_fixture=str(GPU_DIR / "link-degraded.json"), no_kube=True))
    snap = Agent(st, probe_enabled=False).run_pass()
    c = {c.name: c for c in snap.verdict.checks}["gpu.allocatable"]
    assert c.ok and c.detail == "not checked: kubernetes publishing off: --no-kube given"
    st.close()
