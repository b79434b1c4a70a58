"""The MNIST readiness probe: ``python -m gpu_tune.workload.mnist_probe --device cpu|gpu|auto``.

Prints ONE JSON document on stdout (all logging goes to stderr). Exit 0 when a result was
produced, even a failing one (``"ok": false`` with ``"error"`` and ``"error_kind"``: ``input``
for unusable data, ``dependency`` when TensorFlow cannot be imported, ``device`` when the
asked-for device is absent or unused); non-zero on a crash.

What it runs, in order (each phase timed in ``timings``):

0. on a GPU, the data path (``gpu_tune.workload.datapath``): host<->GPU bandwidth from the GPU's
   NUMA node (and from a remote one) and the GPU's memory bandwidth, in processes of their own
   while TensorFlow imports;
1. load MNIST with NumPy, import TensorFlow (with the persistent XLA compilation cache of
   ``--compile-cache``), put the data on the device;
2. the **launch-bound** window: training at ``--batch-size`` (256), whose short steps measure the
   host path that launches them (CPU frequency, NUMA binding, interrupts, allocator);
3. the **device-bound** window: training at ``--device-batch-size`` (4,096 on a GPU, 1,024 on a
   CPU), which keeps the device itself busy (clocks, thermals, memory bandwidth);
4. inference images/s at batch 1, 32, 64 and 256;
5. the **correctness run**: a fixed amount of work (``--train-steps`` steps of
   ``--train-batch-size`` in a seeded order, float32, deterministic ops), then the test accuracy
   and the result fingerprint. Only the throughput windows are timed; the verdict's accuracy
   never depends on how fast or how busy the machine is.

GPU utilization is sampled every 100 ms through NVML and reported per window.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any

T_START = time.monotonic()

from gpu_tune.workload import NOT_INSTALLED, PROBE_VERSION  # noqa: E402
from gpu_tune.workload import compile_cache  # noqa: E402

try:
    from gpu_tune.workload import data as mnist_data  # noqa: E402  (NumPy only)
    NO_NUMPY = None
except ModuleNotFoundError as _exc:  # gpu-tune without the probe's extras: NumPy comes with TensorFlow
    if (_exc.name or "").split(".")[0] != "numpy":
        raise
    mnist_data, NO_NUMPY = None, f"{NOT_INSTALLED} (no module named 'numpy')"
from gpu_tune.workload import datapath  # noqa: E402
from gpu_tune.workload.hostinfo import NvmlSampler, process_facts  # noqa: E402

TARGET_IMAGES_PER_SECOND = 100_000  # the launch-bound goal for one H100
BYTES_PER_IMAGE = 28 * 28 + 1  # uint8 pixels + uint8 label: what the host feeds per image
INFER_BATCHES = (1, 32, 64, 256)
DEVICE_BATCH = {"gpu": 4096, "cpu": 1024}
WINDOW_SECONDS = {"gpu": 2.0, "cpu": 1.0}
REGIMES = ("launch_bound", "device_bound")


def _process_age_s() -> float:
    """Seconds since this process started (kernel start time), for time-to-verdict."""
    try:
        with open("/proc/self/stat", encoding="ascii") as fh:
            stat = fh.read()
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as fh:
            uptime = float(fh.read().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
        if age >= 0:
            return age
    except (OSError, ValueError, IndexError):
        pass
    return time.monotonic() - T_START


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gpu_tune.workload.mnist_probe", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "gpu", "auto"), default="auto")
    p.add_argument("--data", default=None, help="mnist.npz, an IDX directory, or mnist_5k.csv.gz")
    p.add_argument("--train-steps", type=int, default=80, help="steps of the correctness run (fixed work)")
    p.add_argument("--train-batch-size", type=int, default=64, help="batch of the correctness run")
    p.add_argument("--learning-rate", type=float, default=3e-3, help="Adam's learning rate, correctness run")
    p.add_argument("--batch-size", type=int, default=256, help="launch-bound window's batch")
    p.add_argument("--device-batch-size", type=int, default=None,
                   help="device-bound window's batch [default: 4096 on a GPU, 1024 on a CPU]")
    p.add_argument("--window-seconds", type=float, default=None,
                   help="timed seconds per throughput window [default: 2 on a GPU, 1 on a CPU]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-times", action="store_true",
                   help="launch-bound window: one step per call, each step timed (step_seconds p50/p99)")
    p.add_argument("--launch-bound-only", action="store_true",
                   help="only the launch-bound window (no device-bound window, inference or correctness "
                        "run): what `gpu-tune gain` compares")
    p.add_argument("--infer-seconds", type=float, default=0.15, help="timed seconds per inference batch size")
    p.add_argument("--xla", choices=("auto", "on", "off"), default="auto", help="auto: on for GPUs, off for CPUs")
    p.add_argument("--precision", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="throughput windows' compute type (the correctness run is float32)")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="persistent XLA compilation cache: a folder per TensorFlow, device and driver under DIR")
    p.add_argument("--bandwidth", choices=("auto", "on", "off"), default="auto",
                   help="measure host<->GPU and GPU memory bandwidth (auto: unless the device is the CPU)")
    p.add_argument("--bandwidth-size-mib", type=int, default=256, help="bytes per timed copy, MiB")
    p.add_argument("--bandwidth-samples", type=int, default=5, help="timed copies per direction (median)")
    p.add_argument("--numa-node", type=int, default=None, help="the NUMA node this process is bound to (reported)")
    p.add_argument("--remote-numa-node", type=int, default=None,
                   help="also measure host<->GPU bandwidth with host memory on this NUMA node")
    a = p.parse_args(argv)
    checks = (
        ("--train-steps", a.train_steps, 1 <= a.train_steps <= 100_000, "1..100000"),
        ("--train-batch-size", a.train_batch_size, 1 <= a.train_batch_size <= 65536, "1..65536"),
        ("--learning-rate", a.learning_rate, 0 < a.learning_rate <= 1, "0 < LR <= 1"),
        ("--batch-size", a.batch_size, 1 <= a.batch_size <= 65536, "1..65536"),
        ("--device-batch-size", a.device_batch_size,
         a.device_batch_size is None or 1 <= a.device_batch_size <= 262144, "1..262144"),
        ("--window-seconds", a.window_seconds, a.window_seconds is None or 0 < a.window_seconds <= 600,
         "0 < S <= 600"),
        ("--infer-seconds", a.infer_seconds, 0 < a.infer_seconds <= 60, "0 < S <= 60"),
        ("--bandwidth-size-mib", a.bandwidth_size_mib, 16 <= a.bandwidth_size_mib <= 4096, "16..4096"),
        ("--bandwidth-samples", a.bandwidth_samples, 3 <= a.bandwidth_samples <= 100, "3..100"),
        ("--numa-node", a.numa_node, a.numa_node is None or a.numa_node >= 0, ">= 0"),
        ("--remote-numa-node", a.remote_numa_node, a.remote_numa_node is None or a.remote_numa_node >= 0, ">= 0"),
    )
    for flag, value, ok, want in checks:
        if not ok:
            p.error(f"{flag} {value}: expected {want}")
    return a


def _tri(v: str) -> bool | None:
    return None if v == "auto" else v == "on"


def _target(launch: dict[str, Any] | None, batch_size: int) -> dict[str, Any]:
    """What reaching the launch-bound goal would take, against what was measured."""
    need_sps = TARGET_IMAGES_PER_SECOND / batch_size
    out: dict[str, Any] = {
        "train_images_per_second": TARGET_IMAGES_PER_SECOND,
        "device": "one H100",
        "batch_size": batch_size,
        "bytes_per_image": BYTES_PER_IMAGE,
        "steps_per_second_needed": round(need_sps, 1),
        "host_input_mb_per_second_needed": round(TARGET_IMAGES_PER_SECOND * BYTES_PER_IMAGE / 1e6, 1),
    }
    if launch:
        ips = launch["images_per_second"]
        out.update({
            "train_images_per_second_measured": round(ips, 1),
            "fraction_of_target": round(ips / TARGET_IMAGES_PER_SECOND, 4),
            "steps_per_second_measured": round(launch["steps_per_second"], 2),
            "host_input_mb_per_second_measured": round(ips * BYTES_PER_IMAGE / 1e6, 2),
            # The batch that would reach the goal at the step rate measured here.
            "batch_size_for_target_at_measured_step_rate": int(-(-TARGET_IMAGES_PER_SECOND // max(launch["steps_per_second"], 1e-9))),
        })
    return out


def peer_group(device: dict[str, Any], software: dict[str, Any], driver: str | None, data_digest: str,
               threads: int) -> str:
    """Who must compute the same fingerprint: same device model, driver major version, TensorFlow
    and probe version, same data; on a CPU also the thread count (it sets how kernels split their
    sums) and whether oneDNN is on."""
    parts = [str(device.get("name") or "?")]
    if device.get("kind") == "gpu":
        parts.append(f"driver {str(driver).split('.')[0] if driver else '?'}")
    parts += [f"tensorflow {software.get('tensorflow')}", f"probe {PROBE_VERSION}", f"data {data_digest}"]
    if device.get("kind") == "cpu":
        cpu = f"{threads} threads"
        if not software.get("onednn", True):
            cpu += ", onednn off"
        elif software.get("onednn_max_isa"):
            cpu += f", onednn isa {software['onednn_max_isa']}"
        parts.append(cpu)
    return " | ".join(parts)


def op_error_line(exc: BaseException) -> str:
    """The line of a TensorFlow error that says what went wrong (not "Graph execution error:",
    the traceback of where the op was defined, or the node's name)."""
    text = str(getattr(exc, "message", None) or exc)
    skip = ("Graph execution error", "Detected at node", "File ", "[[", "Traceback")
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(skip):
            return line
    return type(exc).__name__


def _round(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


def run(a: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {
        "ok": False, "error": None, "error_kind": None, "probe_version": PROBE_VERSION,
        "requested_device": a.device, "device": None, "accuracy": None, "fingerprint": None,
        "peer_group": None, "train_images_per_second": None, "regimes": {},
        "inference_images_per_second": None, "time_to_verdict_seconds": None, "timings": {},
        "data": None, "gpu_samples": {"status": "unavailable", "reason": "not started"},
        "software": None, "host": None, "target": _target(None, a.batch_size),
        "config": {"train_steps": a.train_steps, "train_batch_size": a.train_batch_size,
                   "learning_rate": a.learning_rate, "batch_size": a.batch_size, "seed": a.seed},
    }
    timings = res["timings"]

    def finish() -> dict[str, Any]:
        if path is not None and "bandwidth" not in res:
            res.update(path.result())
        res["compile_cache"] = cache.summary() if cache is not None else {"status": "off", "reason": "not reached"}
        res["host"] = process_facts()
        res["time_to_verdict_seconds"] = round(_process_age_s(), 3)
        timings["total_seconds"] = res["time_to_verdict_seconds"]
        return res

    path: datapath.DataPath | None = None
    cache: compile_cache.CompileCache | None = None
    timings["process_start_seconds"] = round(_process_age_s(), 3)  # interpreter + NumPy
    # The data path first, in processes of its own, while the data loads and TensorFlow imports.
    if a.bandwidth == "on" or (a.bandwidth == "auto" and a.device != "cpu" and not a.launch_bound_only):
        path = datapath.DataPath(size_mib=a.bandwidth_size_mib, samples=a.bandwidth_samples, local_node=a.numa_node,
                                 remote_node=a.remote_numa_node).start()
    else:
        res["bandwidth"] = datapath.not_measured()
        res["memory_bandwidth"] = datapath.not_measured()
    cache = compile_cache.prepare(a.compile_cache, device=a.device, xla=a.xla)
    if mnist_data is None:  # the same verdict as TensorFlow missing, before anything needs NumPy
        res.update(error=NO_NUMPY, error_kind="dependency")
        return finish()
    t = time.perf_counter()
    try:
        ds = mnist_data.load(a.data, seed=a.seed)
    except mnist_data.DataError as exc:
        res.update(error=str(exc), error_kind="input")
        return finish()
    res["data"] = ds.summary()
    timings["data_load_seconds"] = round(time.perf_counter() - t, 3)

    t = time.perf_counter()
    try:
        from gpu_tune.workload import train as tr  # the TensorFlow import: seconds
    except ImportError as exc:  # train.TensorFlowMissing, or TensorFlow's own import failing
        res.update(error=str(exc), error_kind="dependency")
        return finish()
    timings["tensorflow_import_seconds"] = round(time.perf_counter() - t, 3)
    if path is not None:
        t = time.perf_counter()
        res.update(path.result())
        timings["bandwidth_seconds"] = round(path.seconds, 3)  # its own seconds, spent while TensorFlow imported
        timings["bandwidth_wait_seconds"] = round(time.perf_counter() - t, 3)  # what the import did not hide
    res["software"] = tr.software()
    t = time.perf_counter()
    try:
        plan = tr.setup_device(a.device, xla=_tri(a.xla), precision=None if a.precision == "auto" else a.precision)
    except tr.DeviceUnavailable as exc:
        res.update(error=str(exc), error_kind="device", device={"kind": None, "name": None, "compute_capability": None})
        return finish()
    res["device"] = plan.as_dict()
    device_batch = a.device_batch_size or DEVICE_BATCH[plan.kind]
    window_s = a.window_seconds or WINDOW_SECONDS[plan.kind]
    res["config"].update(xla=plan.xla, precision=plan.precision, device_batch_size=device_batch,
                         window_seconds=window_s, threads=plan.threads)
    data = tr.DeviceData.put(plan, ds.x_train, ds.y_train, ds.x_test, ds.y_test)
    res["device"]["data_placement"] = data.device
    timings["device_setup_seconds"] = round(time.perf_counter() - t, 3)

    sampler = NvmlSampler(interval_s=0.1)
    driver = None
    if plan.kind == "gpu":
        sampler.start()
        driver = sampler.driver_version()
    else:
        sampler.reason = "CPU run"
    res["software"]["driver"] = driver
    try:
        windows = [("launch_bound", a.batch_size)] + ([] if a.launch_bound_only else [("device_bound", device_batch)])
        # Both windows' trainers traced before either runs: their programs keep the same names from
        # run to run, so the compilation cache finds them (train.Trainer.trace).
        trainers, traced_s = {}, {}
        for regime, bs in windows:
            t = time.perf_counter()
            trainers[regime] = tr.window_trainer(plan, data, batch_size=bs, seed=a.seed, lr=a.learning_rate)
            traced_s[regime] = time.perf_counter() - t
        for regime, bs in windows:
            steps_timed = a.step_times and regime == "launch_bound"
            try:
                trainer = trainers.pop(regime)
                if trainer.precision != plan.precision:  # made before a fallback to float32 (below)
                    trainer, traced_s[regime] = None, 0.0
                w = tr.throughput_window(plan, data, batch_size=bs, seconds=window_s, seed=a.seed, lr=a.learning_rate,
                                         step_times=steps_timed, trainer=trainer)
                w["compile_seconds"] += traced_s[regime]
            except tr.tf.errors.OpError as exc:
                if plan.xla and cache.path is not None:
                    # TensorFlow fails a compilation whose cached entry it cannot read or write
                    # (a file cut short, a full disk) instead of compiling afresh: remove the
                    # folder and let the agent run the probe again without the cache.
                    left = cache.forget()
                    first = op_error_line(exc)
                    gone = "was removed" if left is None else f"could not be removed ({left})"
                    res.update(error=f"the XLA compilation with the persistent cache failed ({type(exc).__name__}: "
                                     f"{first}); the cache folder {cache.path} {gone}", error_kind="compile_cache")
                    return finish()
                if plan.kind != "cpu" or plan.precision == "float32":
                    raise
                # A CPU whose flags promise bfloat16 that its kernels cannot use (a capped oneDNN
                # ISA, an odd hypervisor): measure in float32 and say so.
                res.setdefault("notes", []).append(
                    f"{plan.precision} kernels failed on this CPU ({type(exc).__name__}); "
                    "throughput measured in float32")
                plan = tr.dataclasses.replace(plan, precision="float32")
                res["config"]["precision"] = "float32"
                w = tr.throughput_window(plan, data, batch_size=bs, seconds=window_s, seed=a.seed, lr=a.learning_rate,
                                         step_times=steps_timed)
            window = w.pop("window")
            all_steps = w.pop("step_seconds_all", None)
            timings[f"{regime}_compile_seconds"] = round(w["compile_seconds"], 3)
            timings[f"{regime}_window_seconds"] = round(w["seconds"], 3)
            w.update(sampler.window(window) if plan.kind == "gpu" else {"gpu_busy_fraction": None, "gpu_samples": 0})
            res["regimes"][regime] = _round(w)
            if all_steps is not None:
                res["regimes"][regime]["step_seconds_all"] = all_steps
        launch = res["regimes"]["launch_bound"]
        res["train_images_per_second"] = round(launch["images_per_second"], 1)
        res["target"] = _target(launch, a.batch_size)
        if a.launch_bound_only:
            res["ok"] = True
            res["gpu_samples"] = sampler.summary()
            return finish()

        t = time.perf_counter()
        res["inference_images_per_second"] = tr.inference_throughput(plan, data, INFER_BATCHES, a.infer_seconds, a.seed)
        timings["inference_seconds"] = round(time.perf_counter() - t, 3)

        try:
            c = tr.correctness_run(plan, data, steps=a.train_steps, batch_size=a.train_batch_size, seed=a.seed,
                                   lr=a.learning_rate)
        except tr.tf.errors.UnimplementedError as exc:
            # An op without a deterministic kernel on this device/TensorFlow: a software limit,
            # the same on every node of this kind, not a fault of this node.
            res.update(error="TensorFlow cannot run the deterministic correctness run on this device: "
                             + str(exc.message).splitlines()[0], error_kind="dependency")
            return finish()
        timings["correctness_train_seconds"] = round(c.pop("train_seconds"), 3)
        timings["evaluate_seconds"] = round(c.pop("evaluate_seconds"), 3)
        res["accuracy"] = round(c["accuracy"], 4)
        res["fingerprint"] = c["fingerprint"]
        res["correctness"] = _round(c)
    finally:
        sampler.stop()
    res["gpu_samples"] = sampler.summary()
    res["peer_group"] = peer_group(res["device"], res["software"], driver, ds.digest(), plan.threads)
    if plan.kind == "gpu" and "GPU" not in data.device.upper():
        res.update(error=f"a GPU was asked for but the data was placed on {data.device or 'an unknown device'}",
                   error_kind="device")
        return finish()
    res["ok"] = True
    return finish()


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    try:
        result = run(a)
    except Exception:
        traceback.print_exc(file=sys.stderr)
        return 1
    sys.stdout.write(json.dumps(result, sort_keys=False) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    # TensorFlow's C++ logging goes to stderr; keep stdout for the one JSON document.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
