"""The GPU's data path: host<->GPU and GPU memory bandwidth (gpu_tune/gpu/bandwidth.py), measured
through a fake CUDA runtime with injected copy speeds, and the real runtime on a machine without a
GPU (it must say so, not fail)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpu_tune.gpu import bandwidth, cudart
from gpu_tune.gpu.cudart import CudaError, Runtime
from gpu_tune.workload import datapath

from .fixtures.fake_cudart import D2D, D2H, H2D, FakeCudart

MIB = 1 << 20


def test_medians_of_timed_copies_after_the_warmup():
    fake = FakeCudart(h2d=50e9, d2h=52e9, d2d=1.25e12)
    doc = bandwidth.measure(Runtime(fake), size=256 * MIB, samples=5, warmup=1)
    assert doc["status"] == "measured"
    assert doc["h2d"]["bytes_per_second"] == pytest.approx(50e9, rel=1e-6)
    assert doc["d2h"]["bytes_per_second"] == pytest.approx(52e9, rel=1e-6)
    # device-to-device: bytes read + bytes written, as DCGM counts its memory bandwidth
    assert doc["device_memory"]["bytes_per_second"] == pytest.approx(2 * 1.25e12, rel=1e-6)
    assert len(doc["h2d"]["samples_bytes_per_second"]) == 5
    assert fake.copies == {H2D: 6, D2H: 6, D2D: 6}  # 1 warm-up + 5 timed each
    assert (doc["cuda_runtime"], doc["cuda_driver"]) == (12050, 13000)
    assert fake.leaks() == {} and fake.reset  # everything freed, the device reset


def test_the_warmup_copy_is_not_counted_and_one_slow_sample_does_not_move_the_median():
    # copy 1 (the warm-up) at 1 GB/s, copy 4 at 5 GB/s, the rest at 50 GB/s
    fake = FakeCudart(h2d=[1e9, 50e9, 50e9, 5e9, 50e9, 50e9])
    doc = bandwidth.measure(Runtime(fake), size=64 * MIB, samples=5, warmup=1)
    rates = doc["h2d"]["samples_bytes_per_second"]
    assert min(rates) == pytest.approx(5e9, rel=1e-6) and 1e9 not in [round(r, -6) for r in rates]
    assert doc["h2d"]["bytes_per_second"] == pytest.approx(50e9, rel=1e-6)


def test_a_slow_link_is_measured_as_slow():
    doc = bandwidth.measure(Runtime(FakeCudart(h2d=12e9, d2h=13e9)), size=256 * MIB, samples=3)
    assert doc["h2d"]["bytes_per_second"] == pytest.approx(12e9, rel=1e-6)
    assert doc["d2h"]["bytes_per_second"] == pytest.approx(13e9, rel=1e-6)


@pytest.mark.parametrize("fake, words", [
    (FakeCudart(devices=0), "the CUDA runtime sees no device"),
    (FakeCudart(fail={"cudaGetDeviceCount": 35}), "CUDA driver version is insufficient"),
    (FakeCudart(fail={"cudaGetDeviceCount": 100}), "no CUDA-capable device"),
])
def test_no_gpu_is_not_measured_not_an_error(fake, words):
    doc = bandwidth.measure(Runtime(fake), size=16 * MIB)
    assert doc["status"] == "not_measured"
    assert doc["reason"].startswith("no GPU: bandwidth not measured") and words in doc["reason"]
    assert fake.copies == {H2D: 0, D2H: 0, D2D: 0}


@pytest.mark.parametrize("fail, fail_at, call", [
    ({"cudaHostAlloc": 2}, {}, "cudaHostAlloc: out of memory (cudaError 2)"),
    ({"cudaMemcpyAsync": 700}, {"cudaMemcpyAsync": 8}, "cudaMemcpyAsync(cudaMemcpyDeviceToHost): an illegal memory"),
    ({"cudaMalloc": 2}, {"cudaMalloc": 2}, "cudaMalloc: out of memory"),  # the second device buffer
])
def test_a_failing_call_is_an_error_naming_it_and_nothing_is_left_allocated(fail, fail_at, call):
    fake = FakeCudart(fail=fail, fail_at=fail_at)
    doc = bandwidth.measure(Runtime(fake), size=16 * MIB, samples=3)
    assert doc["status"] == "error" and doc["reason"].startswith(call), doc
    assert fake.leaks() == {} and fake.reset


def test_a_failing_clean_up_is_recorded_without_hiding_the_figures():
    fake = FakeCudart(fail={"cudaFreeHost": 1})
    doc = bandwidth.measure(Runtime(fake), size=16 * MIB, samples=3)
    assert doc["status"] == "measured" and doc["cleanup_errors"] == ["cudaFreeHost: unrecognized error code (cudaError 1)"]


def test_a_zero_time_from_the_events_is_an_error_not_an_infinite_bandwidth():
    fake = FakeCudart(h2d=float("inf"))
    doc = bandwidth.measure(Runtime(fake), size=16 * MIB, samples=3)
    assert doc["status"] == "error" and "cudaEventElapsedTime" in doc["reason"]


def test_fewer_than_three_samples_is_refused():
    with pytest.raises(ValueError, match="at least 3"):
        bandwidth.measure(Runtime(FakeCudart()), size=16 * MIB, samples=2)


def test_the_copies_name_the_buffers_they_fit():
    """The fake refuses a copy whose buffers are not of its kind: the measurement copies host ->
    device for H2D, device -> host for D2H, device -> device for the memory bandwidth."""
    fake = FakeCudart()
    bandwidth.measure(Runtime(fake), size=16 * MIB, samples=3, warmup=0)
    assert [k for _, k, _ in fake.log] == [H2D] * 3 + [D2H] * 3 + [D2D] * 3


def test_the_real_runtime_without_a_gpu_says_so(monkeypatch):
    """libcudart.so.12 (nvidia-cuda-runtime-cu12, a test dependency) loads with the signatures set,
    and on a machine without a GPU or driver its answer is "no GPU", never a crash."""
    monkeypatch.delenv(cudart.ENV_LIBRARY, raising=False)
    lib = cudart.load()
    assert lib.cudaMemcpyAsync.argtypes and lib.cudaEventElapsedTime.restype is not None
    doc = bandwidth.run(16, 3, 0, True)
    assert doc["status"] == "not_measured" and doc["reason"].startswith("no GPU: bandwidth not measured"), doc
    assert doc["mempolicy"] and doc["cpus"]


def test_no_runtime_library_is_not_measured(monkeypatch, tmp_path):
    monkeypatch.setenv(cudart.ENV_LIBRARY, str(tmp_path / "libcudart.so.12"))
    assert cudart.candidates() == [str(tmp_path / "libcudart.so.12")]
    with pytest.raises(cudart.CudartUnavailable, match="nvidia-cuda-runtime-cu12"):
        cudart.load()
    doc = bandwidth.run(16, 3, 0, True)
    assert doc["status"] == "not_measured" and "not loadable" in doc["reason"]


def test_cuda_error_words():
    e = CudaError("cudaMalloc", 2, "out of memory")
    assert str(e) == "cudaMalloc: out of memory (cudaError 2)" and not e.no_gpu
    assert CudaError("cudaGetDeviceCount", 100, "x").no_gpu


def test_the_command_prints_one_json_document_and_checks_its_arguments():
    p = subprocess.run([sys.executable, "-m", "gpu_tune.gpu.bandwidth", "--size-mib", "16", "--samples", "3"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["status"] == "not_measured"
    bad = subprocess.run([sys.executable, "-m", "gpu_tune.gpu.bandwidth", "--samples", "2"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--samples 2: expected 3..100" in bad.stderr


# -- the workload's side: local, then remote, while TensorFlow imports ---------------------------
def measured(h2d: float, d2h: float, d2d: float | None = None) -> dict:
    doc = {"status": "measured", "size_bytes": 256 * MIB, "samples": 5, "cuda_runtime": 12050, "cuda_driver": 13000,
           "h2d": {"bytes_per_second": h2d}, "d2h": {"bytes_per_second": d2h}, "mempolicy": "bind:0", "cpus": "0-3"}
    if d2d is not None:
        doc["device_memory"] = {"bytes_per_second": d2d, "counted": "bytes read + bytes written"}
    return doc


def test_local_then_remote_with_the_host_buffer_bound_to_the_remote_node(monkeypatch):
    calls = []

    def child(cmd, timeout):
        calls.append(cmd)
        return measured(55e9, 53e9, 2.6e12) if "--no-device-memory" not in cmd else measured(40e9, 38e9)

    monkeypatch.setattr(datapath, "run_child", child)
    out = datapath.DataPath(size_mib=256, samples=5, local_node=0, remote_node=1).start().result()
    assert len(calls) == 2
    local, remote = calls
    assert local[:3] == [sys.executable, "-m", "gpu_tune.gpu.bandwidth"] and "--no-device-memory" not in local
    # the remote run: host memory bound to node 1, on this process's own CPUs
    prefix = remote[:remote.index("--") + 1]
    assert "--membind=1" in prefix or prefix[-3:-1] == ["--node", "1"]
    bw = out["bandwidth"]
    assert bw["status"] == "measured"
    assert (bw["local"]["numa_node"], bw["local"]["h2d"]["bytes_per_second"]) == (0, 55e9)
    assert (bw["remote"]["numa_node"], bw["remote"]["d2h"]["bytes_per_second"]) == (1, 38e9)
    assert out["memory_bandwidth"] == {"status": "measured", "bytes_per_second": 2.6e12,
                                       "counted": "bytes read + bytes written"}


def test_no_remote_run_on_one_numa_node_or_when_the_local_run_found_no_gpu(monkeypatch):
    calls = []
    monkeypatch.setattr(datapath, "run_child", lambda cmd, timeout: calls.append(cmd) or measured(55e9, 53e9, 2e12))
    out = datapath.DataPath(size_mib=256, samples=5, local_node=0, remote_node=None).start().result()
    assert len(calls) == 1 and out["bandwidth"]["remote"]["status"] == "not_measured"
    calls.clear()
    monkeypatch.setattr(datapath, "run_child", lambda cmd, timeout: calls.append(cmd) or bandwidth.not_measured("no GPU: bandwidth not measured (x)"))
    out = datapath.DataPath(size_mib=256, samples=5, local_node=0, remote_node=1).start().result()
    assert len(calls) == 1
    assert out["bandwidth"]["status"] == "not_measured" and out["memory_bandwidth"]["status"] == "not_measured"
    assert out["bandwidth"]["reason"].startswith("no GPU: bandwidth not measured")


def test_the_membind_prefix_binds_memory_to_the_node_given(monkeypatch):
    monkeypatch.setattr(datapath.shutil, "which", lambda name: "/usr/bin/numactl")
    assert datapath.membind_prefix(1, {0, 1, 2, 3}) == ["/usr/bin/numactl", "--physcpubind=0-3", "--membind=1", "--"]
    monkeypatch.setattr(datapath.shutil, "which", lambda name: None)
    assert datapath.membind_prefix(1, {2, 3}) == [sys.executable, "-m", "gpu_tune.launch.bind", "--cpus", "2-3",
                                                  "--node", "1", "--"]


def test_a_child_that_breaks_or_hangs_is_an_error_not_a_crash(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time; time.sleep(30)\n")
    doc = datapath.run_child([sys.executable, str(script)], timeout=0.5)
    assert doc["status"] == "error" and "ran past 0.5 s" in doc["reason"]
    doc = datapath.run_child([sys.executable, "-c", "import sys; sys.exit('boom')"], timeout=30)
    assert doc["status"] == "error" and doc["reason"].endswith("exited 1: boom")
    doc = datapath.run_child([str(tmp_path / "missing")], timeout=5)
    assert doc["status"] == "error" and "could not start" in doc["reason"]


def test_the_real_child_on_this_machine(monkeypatch):
    """The workload's own path end to end: the real measurement process, no GPU here."""
    out = datapath.DataPath(size_mib=16, samples=3, local_node=None, remote_node=None).start().result()
    assert out["bandwidth"]["status"] == "not_measured", out
    assert out["bandwidth"]["reason"].startswith("no GPU: bandwidth not measured")
