"""Side-by-side training throughput: the probe's launch-bound loop against the field notes' code.

``python -m gpu_tune.workload.compare [--device cpu|gpu|auto] [--repeats N] [--seconds S] [--batch-size N]``
prints one JSON document. Per repeat, alternating the order so drift in machine load hits each
alike, at the same batch size on the same data:

- ``probe``: the probe's launch-bound window as the probe runs it (its precision and XLA choice);
- ``probe_float32``: the same loop in float32 (what a CPU without bfloat16 instructions runs);
- ``keras_fit``: the field notes' code as they wrote it: a Keras ``Sequential`` CNN, ``compile()``
  with its defaults (``jit_compile="auto"``), ``fit`` on NumPy arrays with a per-batch callback.

Once, after the repeats: the probe's loop with XLA switched the other way (``xla_flipped``), the
measurement behind the probe's XLA choice for this device.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@dataclass
class Comparison:
    """Result of :func:`keras_fit_default` (the field notes' way, for the benchmark)."""

    images_per_second: float
    steps: int
    seconds: float
    jit_compile: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def keras_fit_default(x: np.ndarray, y: np.ndarray, batch_size: int, seconds: float, seed: int,
                      warmup_steps: int = 3) -> Comparison:
    """The field notes' code as they wrote it: a Keras ``Sequential`` CNN, ``model.compile()`` with
    its defaults (``jit_compile="auto"``), and ``model.fit`` on NumPy arrays with a per-batch
    timing callback. Only the benchmark calls this (it imports Keras)."""
    import keras  # noqa: PLC0415 - the benchmark's comparison only

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input(shape=(28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    stamps: list[float] = []

    class BatchTimer(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            stamps.append(time.perf_counter())
            if len(stamps) > warmup_steps and stamps[-1] - stamps[warmup_steps] >= seconds:
                self.model.stop_training = True

    xf = (x.astype("float32") / 255.0)[..., None]
    model.fit(xf, y.astype("int32"), batch_size=batch_size, epochs=10_000, verbose=0, callbacks=[BatchTimer()])
    steps = len(stamps) - 1 - warmup_steps
    elapsed = stamps[-1] - stamps[warmup_steps]
    return Comparison(steps * batch_size / elapsed, steps, elapsed, getattr(model, "jit_compile", None))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpu_tune.workload.compare")
    p.add_argument("--device", choices=("cpu", "gpu", "auto"), default="cpu")
    p.add_argument("--data", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-xla-flip", action="store_true", help="skip the XLA-flipped measurement")
    a = p.parse_args(argv)

    from gpu_tune.workload import data as mnist_data
    from gpu_tune.workload import train as tr

    ds = mnist_data.load(a.data, seed=a.seed)
    plan = tr.setup_device(a.device)
    data = tr.DeviceData.put(plan, ds.x_train, ds.y_train, ds.x_test, ds.y_test)
    f32 = dataclasses.replace(plan, precision="float32")
    runs: dict[str, list[float]] = {"probe": [], "probe_float32": [], "keras_fit": []}
    keras_jit = None

    def window(pl) -> float:
        return tr.throughput_window(pl, data, batch_size=a.batch_size, seconds=a.seconds, seed=a.seed,
                                    lr=1e-3)["images_per_second"]

    for r in range(a.repeats):
        order = ("probe", "probe_float32", "keras_fit") if r % 2 == 0 else ("keras_fit", "probe_float32", "probe")
        for which in order:
            if which == "probe":
                ips = window(plan)
            elif which == "probe_float32":
                ips = window(f32)
            else:
                c = keras_fit_default(ds.x_train, ds.y_train, a.batch_size, a.seconds, a.seed + r)
                ips, keras_jit = c.images_per_second, c.jit_compile
            runs[which].append(ips)
            print(f"repeat {r + 1} {which}: {ips:.0f} images/s", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in runs.items()}
    out = {"device": plan.name, "kind": plan.kind, "batch_size": a.batch_size, "seconds": a.seconds,
           "repeats": a.repeats, "data": ds.summary(), "precision": plan.precision, "xla": plan.xla,
           "keras_jit_compile": keras_jit, "images_per_second": runs, "median": med,
           "ratio": med["probe"] / med["keras_fit"], "ratio_float32": med["probe_float32"] / med["keras_fit"]}
    if not a.no_xla_flip:
        flipped = dataclasses.replace(f32, xla=not plan.xla)
        ips = tr.throughput_window(flipped, data, batch_size=a.batch_size, seconds=a.seconds, seed=a.seed,
                                   lr=1e-3, min_steps=2)["images_per_second"]
        out["xla_flipped"] = {"xla": flipped.xla, "precision": "float32", "images_per_second": ips,
                              "ratio_to_probe_float32": ips / med["probe_float32"]}
        print(f"probe loop float32 with XLA {'on' if flipped.xla else 'off'}: {ips:.0f} images/s", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
