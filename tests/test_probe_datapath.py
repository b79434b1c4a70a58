"""The GPU's data path in the probe's verdict: host<->GPU floors (both figures named when slow),
GPU memory bandwidth at 0.75 x its baseline, the remote NUMA node the runner asks for, the
compilation cache handed to the workload (and dropped when it cannot be used), its bound, and
what the table, /readiness and the node summary show."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpu_tune.judge import probe
from gpu_tune.judge.probe.cache import cache_folder, upkeep
from gpu_tune.judge.probe.judge import judge
from gpu_tune.tune.profile import ProbePolicy

from .fixtures.probes import datapath, probe_result, probe_verdict
from .test_probe import ROOT, _run, _target, fake  # noqa: F401  (the stand-in workload and its fixture)

SHIPPED = probe.load_baselines(ROOT / "policies")
H100 = dict(gpu_name="NVIDIA H100 80GB HBM3", pci="0x2330")
HEALTHY = {"FAKE_DEVICE_IPS": "1400000"}  # the stand-in's device-bound figure passes the H100's gate


def _judge(path: dict, *, device: str = "gpu", **target) -> object:
    t = _target("0", gpu_index=0, **(target or H100))
    res = {**probe_result(path=path, device=1_400_000.0), "device": {"kind": device}}
    return judge(res, t, device, ProbePolicy(), SHIPPED)


def test_a_healthy_data_path_passes():
    j = _judge(datapath(h2d=55.2e9, d2h=53.1e9, memory=2.61e12))
    assert j.status == "passed" and j.datapath == "ok", j.reasons


@pytest.mark.parametrize("h2d, d2h", [(20.1e9, 53.0e9), (55.0e9, 11.9e9)])
def test_a_slow_link_fails_naming_both_figures_and_the_floor(h2d, d2h):
    j = _judge(datapath(h2d=h2d, d2h=d2h))
    assert j.status == "failed" and j.datapath == "below floor"
    (reason,) = j.reasons
    assert "below the 48 GB/s floor for 'NVIDIA H100 80GB HBM3'" in reason
    assert f"host-to-GPU {h2d / 1e9:.1f} GB/s" in reason and f"GPU-to-host {d2h / 1e9:.1f} GB/s" in reason
    assert "from NUMA node 0" in reason and "PCIe link trained down" in reason
    assert j.throughput_only  # a performance shortfall: retried, as a throughput one is


def test_the_remote_node_is_reported_never_judged():
    j = _judge(datapath(remote=(3e9, 2e9)))
    assert j.status == "passed" and j.datapath == "ok"


def test_memory_bandwidth_below_three_quarters_of_the_baseline_fails():
    # DCGM's H100 figure: ~2,540,000 MB/s; 0.75 x = 1,905 GB/s
    assert _judge(datapath(memory=1.91e12)).status == "passed"
    j = _judge(datapath(memory=1.80e12))
    assert j.status == "failed" and j.datapath == "below floor"
    assert j.reasons == ["GPU memory bandwidth 1,800.0 GB/s (device-to-device copies, read + write) is below "
                         "1,905 GB/s (0.75 x the 2,540 GB/s baseline for 'NVIDIA H100 80GB HBM3')"]


def test_a_model_without_floors_is_reported_not_judged():
    j = _judge(datapath(h2d=5e9, d2h=5e9, memory=1e11), gpu_name="Tesla V100-PCIE-16GB", pci="0x1db4")
    assert j.status == "passed" and j.datapath == "not judged"
    assert any("host<->GPU bandwidth host-to-GPU 5.0 GB/s, GPU-to-host 5.0 GB/s from NUMA node 0: no floor for "
               "'Tesla V100-PCIE-16GB', reported, not judged" == n for n in j.notes), j.notes


def test_the_cpu_run_says_no_gpu_without_failing():
    path = {"bandwidth": {"status": "not_measured", "reason": "no GPU: bandwidth not measured"},
            "memory_bandwidth": {"status": "not_measured", "reason": "no GPU: bandwidth not measured"}}
    t = _target("cpu", device="cpu")
    j = judge({**probe_result(path=path), "device": {"kind": "cpu"}}, t, "cpu", ProbePolicy(), SHIPPED)
    assert j.status == "passed" and j.datapath is None
    assert "no GPU: bandwidth not measured" in j.notes


def test_a_gpu_whose_bandwidth_could_not_be_measured_is_noted_not_failed():
    path = {"bandwidth": {"status": "error", "reason": "cudaHostAlloc: out of memory (cudaError 2)"},
            "memory_bandwidth": {"status": "error", "reason": "cudaHostAlloc: out of memory (cudaError 2)"}}
    j = _judge(path)
    assert j.status == "passed" and j.datapath == "not measured"
    assert "host<->GPU bandwidth not measured: cudaHostAlloc: out of memory (cudaError 2)" in j.notes


def test_an_older_result_without_a_data_path_is_judged_as_before():
    j = _judge({})
    assert j.status == "passed" and j.datapath is None


def test_every_shipped_floor_cites_its_source_and_follows_dcgms_rule():
    for b in SHIPPED.gpus:
        if b.memory_bandwidth is not None:
            assert "DCGM" in b.memory_bandwidth.source and b.memory_bandwidth.fraction == 0.75
        if b.host_bandwidth is not None:
            assert "azurehpc-health-checks" in b.host_bandwidth.source
    h100 = SHIPPED.for_gpu("NVIDIA H100 80GB HBM3", "0x2330")
    assert h100.host_bandwidth.floor_gb_per_second == 48 and h100.memory_bandwidth.floor_gb_per_second == 1905
    assert SHIPPED.for_gpu(None, "0x20b2").host_bandwidth.floor_gb_per_second == 21


# -- through the runner, with the stand-in workload -----------------------------------------
def test_a_slow_link_fails_the_probe_after_its_retries(fake):  # noqa: F811
    t = _target("0", gpu_index=0, node=0, remote_node=1, env={"FAKE_BW": "20.1,53,2600", **HEALTHY},
                **H100)
    (v,) = _run([t], module=fake, baselines=SHIPPED, policy=ProbePolicy(retries=1))
    assert v.status == "failed" and v.attempts == 2 and v.as_dict()["datapath"] == "below floor"
    assert "host-to-GPU 20.1 GB/s, GPU-to-host 53.0 GB/s" in v.reasons[-1]
    argv = v.result["argv"]
    assert argv[argv.index("--numa-node") + 1] == "0" and argv[argv.index("--remote-numa-node") + 1] == "1"


def test_bandwidth_off_in_the_profile_reaches_the_workload(fake):  # noqa: F811
    (v,) = _run([_target("0", gpu_index=0, **H100)], module=fake, baselines=SHIPPED,
                policy=ProbePolicy(bandwidth=False, bandwidth_size_mib=512))
    argv = v.result["argv"]
    assert argv[argv.index("--bandwidth") + 1] == "off" and "--remote-numa-node" not in argv
    (v,) = _run([_target("0", gpu_index=0, **H100)], module=fake, baselines=SHIPPED,
                policy=ProbePolicy(bandwidth_size_mib=512))
    assert v.result["argv"][v.result["argv"].index("--bandwidth-size-mib") + 1] == "512"


def test_an_unusable_compilation_cache_is_dropped_and_the_probe_run_again(fake, tmp_path):  # noqa: F811
    folder = tmp_path / "xla-cache"
    folder.mkdir()
    t = _target("0", gpu_index=0, env={"FAKE_MODE": "cache", "FAKE_BW": "55,53,2600", **HEALTHY}, **H100)
    (v,) = probe.run_probes([t], ProbePolicy(), SHIPPED, data=None, timeout=30, device="auto", previous=None,
                            workload_module=fake, compile_cache=str(folder))
    assert v.status == "passed" and "--compile-cache" not in v.result["argv"]
    assert any("ran again without the compilation cache" in n and "Read less bytes" in n for n in v.notes), v.notes
    # with the profile's cache off the folder is not even handed over
    (v,) = probe.run_probes([_target("0", gpu_index=0, **H100)], ProbePolicy(compile_cache=False), SHIPPED, data=None,
                            timeout=30, device="auto", previous=None, workload_module=fake, compile_cache=str(folder))
    assert "--compile-cache" not in v.result["argv"]
    (v,) = probe.run_probes([_target("0", gpu_index=0, **H100)], ProbePolicy(), SHIPPED, data=None,
                            timeout=30, device="auto", previous=None, workload_module=fake, compile_cache=str(folder))
    assert v.result["argv"][v.result["argv"].index("--compile-cache") + 1] == str(folder)


# -- the cache folder and its bound -----------------------------------------------------------
def test_the_cache_folder_is_made_beneath_the_root(tmp_path):
    from gpu_tune.host.fs import HostFS

    for root in (tmp_path / "a", tmp_path / "b"):
        (root / "proc").mkdir(parents=True)
        (root / "sys").mkdir()
    folder, why = cache_folder(HostFS(tmp_path / "a"))
    assert why is None and Path(folder) == tmp_path / "a/var/lib/gpu-tune/xla-cache"
    assert upkeep(folder).folder == folder and Path(folder).is_dir()
    (tmp_path / "b/var").write_text("not a folder")
    folder, why = cache_folder(HostFS(tmp_path / "b"))
    assert folder is None and why.startswith("compilation cache not used:")


def _key(base: Path, name: str, size: int, age_s: float, now: float) -> Path:
    d = base / name
    d.mkdir()
    (d / "xla_compile_cache__1__2__XLA_GPU_JIT.pb").write_bytes(b"x" * size)
    os.utime(d, (now - age_s, now - age_s))
    return d


def _prune(base: Path, **kw) -> list[str]:
    u = upkeep(str(base), **kw)
    assert u.folder == str(base) and u.notes == []
    return u.removed


def test_prune_keeps_the_most_recently_used_folders_within_the_bound(tmp_path):
    now = time.time()
    base = tmp_path / "xla-cache"
    base.mkdir()
    for i in range(5):
        _key(base, f"k{i}", 100, age_s=i * 60, now=now)  # k0 newest
    assert sorted(_prune(base, max_bytes=10_000, max_folders=3, now=now)) == ["k3", "k4"]
    assert sorted(p.name for p in base.iterdir()) == ["k0", "k1", "k2"]
    # by size: the newest that fit, the rest go
    assert _prune(base, max_bytes=250, max_folders=8, now=now) == ["k2"]
    assert _prune(base, max_bytes=250, max_folders=8, now=now) == []


def test_prune_removes_what_a_killed_compilation_left_once_it_is_old(tmp_path):
    now = time.time()
    base = tmp_path / "xla-cache"
    base.mkdir()
    d = _key(base, "k0", 10, 0, now)
    old, fresh = d / "xla_compile_cache__1__2__XLA_GPU_JIT.pb.tmp123", d / "xla_compile_cache__3__4__XLA_GPU_JIT.pb.tmp9"
    old.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    os.utime(old, (now - 7200, now - 7200))
    assert _prune(base, now=now) == [f"k0/{old.name}"]
    assert fresh.exists() and not old.exists()


# -- planning the remote node -----------------------------------------------------------------
def _nodes(*spec):
    from gpu_tune.discover.model import NumaNode

    return SimpleNamespace(numa_nodes=tuple(NumaNode(i, frozenset({i}), mem, dist) for i, mem, dist in spec))


def test_the_remote_node_is_the_farthest_with_memory(monkeypatch):
    from gpu_tune.judge.probe import plan

    monkeypatch.setattr(plan, "_allowed_mems", lambda: None)
    four = _nodes((0, 1 << 20, (10, 12, 32, 32)), (1, 1 << 20, (12, 10, 32, 32)), (2, 1 << 20, (32, 32, 10, 12)),
                  (3, 1 << 20, (32, 32, 12, 10)))
    assert plan.remote_node(four, 0) == 2 and plan.remote_node(four, 3) == 0
    assert plan.remote_node(_nodes((0, 1, (10,))), 0) is None  # one node
    assert plan.remote_node(four, None) is None  # the GPU's node unknown
    memless = _nodes((0, 1 << 20, (10, 20, 30)), (1, 1 << 20, (20, 10, 30)), (2, 0, (30, 30, 10)))
    assert plan.remote_node(memless, 0) == 1  # node 2 has no memory
    monkeypatch.setattr(plan, "_allowed_mems", lambda: frozenset({0, 1}))
    assert plan.remote_node(four, 0) == 1  # the cpuset allows nodes 0-1 only


# -- what shows ---------------------------------------------------------------------------------
def test_readiness_detail_and_node_summary_show_the_data_path():
    from gpu_tune.cluster.labels import node_summary
    from gpu_tune.judge.checks.probe import Probe

    probe_checks = Probe().checks_of
    v = probe_verdict("0", probe_result())
    (c,) = probe_checks([v])
    assert c.ok and "host<->GPU 55.2/53.1 GB/s" in c.detail
    doc = node_summary(audit=None, checks=[], probes=[{**v, "datapath": "ok"}])
    assert doc["probe"]["0"]["datapath"] == "ok"
    assert "55.2" not in str(doc)  # the figures move from run to run: not in the annotation


def test_the_probe_table_shows_both_nodes_and_the_memory_bandwidth():
    from rich.console import Console

    from gpu_tune.judge.probe.run import ProbeVerdict
    from gpu_tune.views.probe import render_probe_table

    v = ProbeVerdict("0", "passed", True, [], 1, "t0", "t1", 20.0, probe_result(), "")
    con = Console(record=True, width=200)
    con.print(render_probe_table([v]))
    text = con.export_text()
    assert "local (node 0): to the GPU 55.2 GB/s, from it 53.1 GB/s; remote (node 1): to the GPU 41.5 GB/s" in text
    assert "2,610 GB/s (device-to-device copies, read + write)" in text


def test_gpu_tune_probe_hands_the_cache_folder_over_unless_told_not_to(make_host, tmp_path):
    """``gpu-tune probe`` gives the workload ``<root>/var/lib/gpu-tune/xla-cache``;
    ``--no-compile-cache`` (or the profile's ``probe.compile_cache: false``) leaves it out."""
    from .conftest import run_cli
    from .test_probe import FAKE

    pkg = tmp_path / "fakeprobe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "ok.py").write_text(FAKE)
    root = make_host("small-2cpu")
    env = {"GPU_TUNE_PROBE_MODULE": "fakeprobe.ok", "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    argvs = []
    for extra in ((), ("--no-compile-cache",)):
        p = run_cli("probe", "--device", "cpu", "--root", str(root), "--gpu-backend", "none", "-o", "json", *extra,
                    env=env)
        assert p.returncode == 0, p.stderr
        argvs.append(json.loads(p.stdout)["results"][0]["result"]["argv"])
    with_cache, without = argvs
    assert with_cache[with_cache.index("--compile-cache") + 1] == str(root / "var/lib/gpu-tune/xla-cache")
    assert (root / "var/lib/gpu-tune/xla-cache").is_dir() and "--compile-cache" not in without
