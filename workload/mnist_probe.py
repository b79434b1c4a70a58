"""The MNIST readiness probe: ``python -m workload.mnist_probe --device cpu|gpu|auto``.

Prints ONE JSON document on stdout (all logging goes to stderr). Exit 0 when a result was
produced, even a failing one (``"ok": false`` with ``"error"`` and ``"error_kind"``: ``input``
for unusable data, ``device`` when the asked-for device is absent or unused); non-zero on crash.
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

from . import data as mnist_data  # noqa: E402  (NumPy only)
from .hostinfo import NvmlSampler, process_facts  # noqa: E402

TARGET_IMAGES_PER_SECOND = 100_000  # the goal for one H100
BYTES_PER_IMAGE = 28 * 28 + 1  # uint8 pixels + uint8 label: what the host feeds per image
INFER_BATCHES = (1, 32, 64, 256)


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
    p = argparse.ArgumentParser(prog="python -m workload.mnist_probe", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "gpu", "auto"), default="auto")
    p.add_argument("--data", default=None, help="mnist.npz, an IDX directory, or mnist_5k.csv.gz")
    p.add_argument("--train-seconds", type=float, default=3.0)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--infer-seconds", type=float, default=0.2, help="timed seconds per inference batch size")
    p.add_argument("--xla", choices=("auto", "on", "off"), default="auto", help="auto: on for GPU runs")
    p.add_argument("--mixed-precision", choices=("auto", "on", "off"), default="auto", help="auto: float16 on a GPU, bfloat16 on a CPU with native bf16")
    a = p.parse_args(argv)
    if not 0 < a.train_seconds <= 3600:
        p.error(f"--train-seconds {a.train_seconds}: expected 0 < S <= 3600")
    if not 1 <= a.batch_size <= 65536:
        p.error(f"--batch-size {a.batch_size}: expected 1..65536")
    if not 0 < a.infer_seconds <= 60:
        p.error(f"--infer-seconds {a.infer_seconds}: expected 0 < S <= 60")
    return a


def _tri(v: str) -> bool | None:
    return None if v == "auto" else v == "on"


def _target(train: dict[str, Any] | None, batch_size: int) -> dict[str, Any]:
    need_sps = TARGET_IMAGES_PER_SECOND / batch_size
    out: dict[str, Any] = {
        "train_images_per_second": TARGET_IMAGES_PER_SECOND,
        "device": "one H100",
        "batch_size": batch_size,
        "bytes_per_image": BYTES_PER_IMAGE,
        "steps_per_second_needed": round(need_sps, 1),
        "host_input_mb_per_second_needed": round(TARGET_IMAGES_PER_SECOND * BYTES_PER_IMAGE / 1e6, 1),
    }
    if train:
        ips = train["images_per_second"]
        out.update({
            "train_images_per_second_measured": round(ips, 1),
            "fraction_of_target": round(ips / TARGET_IMAGES_PER_SECOND, 4),
            "steps_per_second_measured": round(train["steps_per_second"], 2),
            "host_input_mb_per_second_measured": round(ips * BYTES_PER_IMAGE / 1e6, 2),
            # The batch that would reach the target at the step rate measured here.
            "batch_size_for_target_at_measured_step_rate": int(-(-TARGET_IMAGES_PER_SECOND // max(train["steps_per_second"], 1e-9))),
        })
    return out


def run(a: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {
        "ok": False, "error": None, "error_kind": None, "requested_device": a.device,
        "device": None, "accuracy": None, "train_images_per_second": None,
        "inference_images_per_second": None, "time_to_verdict_seconds": None, "timings": {},
        "data": None, "gpu_samples": {"status": "unavailable", "reason": "not started"},
        "host": None, "target": _target(None, a.batch_size),
        "config": {"train_seconds": a.train_seconds, "batch_size": a.batch_size, "seed": a.seed},
    }
    timings = res["timings"]

    def finish() -> dict[str, Any]:
        res["host"] = process_facts()
        res["time_to_verdict_seconds"] = round(_process_age_s(), 3)
        return res

    t = time.perf_counter()
    try:
        ds = mnist_data.load(a.data, seed=a.seed)
    except mnist_data.DataError as exc:
        res.update(error=str(exc), error_kind="input")
        return finish()
    res["data"] = ds.summary()
    timings["data_load_seconds"] = round(time.perf_counter() - t, 3)

    t = time.perf_counter()
    from . import train as tr  # the TensorFlow import: seconds

    timings["tensorflow_import_seconds"] = round(time.perf_counter() - t, 3)
    try:
        plan = tr.setup_device(a.device, xla=_tri(a.xla), mixed=_tri(a.mixed_precision))
    except tr.DeviceUnavailable as exc:
        res.update(error=str(exc), error_kind="device", device={"kind": None, "name": None, "compute_capability": None})
        return finish()
    res["device"] = {k: plan[k] for k in ("kind", "name", "compute_capability")}
    res["config"].update(xla=plan["xla"], mixed_precision=plan["mixed_precision"], precision=plan["precision"])

    sampler = NvmlSampler(interval_s=0.1)
    if plan["kind"] == "gpu":
        sampler.start()
    else:
        sampler.reason = "CPU run"
    try:
        t = time.perf_counter()
        model = tr.build_model(a.seed)
        trainer = tr.FastTrainer(model, a.batch_size, xla=plan["xla"], mixed=plan["mixed_precision"])
        dataset = tr.make_dataset(ds.x_train, ds.y_train, a.batch_size, a.seed)
        timings["build_seconds"] = round(time.perf_counter() - t, 3)
        train = trainer.train(dataset, a.train_seconds)
        window = train.pop("window")
        timings["warmup_seconds"] = round(train.pop("warmup_seconds"), 3)
        timings["train_seconds"] = round(train["seconds"], 3)
        res["train_images_per_second"] = round(train["images_per_second"], 1)
        res["train"] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in train.items()}
        res["target"] = _target(train, a.batch_size)

        t = time.perf_counter()
        res["accuracy"] = round(tr.accuracy(model, ds.x_test, ds.y_test, xla=plan["xla"]), 4)
        timings["evaluate_seconds"] = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        res["inference_images_per_second"] = tr.inference_throughput(
            model, ds.x_test, INFER_BATCHES, a.infer_seconds, xla=plan["xla"])
        timings["inference_seconds"] = round(time.perf_counter() - t, 3)
        ran_on = tr.variable_device(model)
        res["device"]["placement"] = ran_on
    finally:
        sampler.stop()
    res["gpu_samples"] = sampler.summary(window)
    if plan["kind"] == "gpu" and "GPU" not in ran_on.upper():
        res.update(error=f"a GPU was asked for but the model's variables live on {ran_on or 'an unknown device'}",
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
