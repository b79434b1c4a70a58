"""Side-by-side training throughput: the probe's loop vs ``model.fit`` with a per-batch callback.

``python -m workload.compare [--device cpu|gpu|auto] [--repeats N] [--seconds S] [--batch-size N]``
prints one JSON document: images/s per repeat for each approach (same model, data, machine),
run alternately so drift in machine load hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workload.compare")
    p.add_argument("--device", choices=("cpu", "gpu", "auto"), default="cpu")
    p.add_argument("--data", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    from . import data as mnist_data
    from . import train as tr

    ds = mnist_data.load(a.data, seed=a.seed)
    plan = tr.setup_device(a.device)
    fast, fast32, fit = [], [], []
    for r in range(a.repeats):
        order = ("fast", "fast32", "fit") if r % 2 == 0 else ("fit", "fast32", "fast")
        for which in order:
            if which == "fast":  # the probe's settings
                tr.keras.mixed_precision.set_global_policy(plan["precision"])
                res = tr.fast_train(ds.x_train, ds.y_train, a.batch_size, a.seconds, a.seed + r,
                                    xla=plan["xla"], mixed=plan["mixed_precision"])
                fast.append(res["images_per_second"])
            elif which == "fast32":  # the probe's loop in float32: the pipeline's share alone
                tr.keras.mixed_precision.set_global_policy("float32")
                res = tr.fast_train(ds.x_train, ds.y_train, a.batch_size, a.seconds, a.seed + r,
                                    xla=plan["xla"], mixed=False)
                fast32.append(res["images_per_second"])
            else:
                tr.keras.mixed_precision.set_global_policy("float32")
                res = tr.fit_with_callback(ds.x_train, ds.y_train, a.batch_size, a.seconds, a.seed + r)
                fit.append(res["images_per_second"])
            print(f"repeat {r + 1} {which}: {res['images_per_second']:.0f} images/s", file=sys.stderr)
    out = {"device": plan["name"], "kind": plan["kind"], "batch_size": a.batch_size, "seconds": a.seconds,
           "data": ds.summary(), "probe_loop_images_per_second": fast, "fit_callback_images_per_second": fit,
           "probe_loop_float32_images_per_second": fast32, "median_probe_loop_float32": statistics.median(fast32),
           "precision": plan["precision"],
           "median_probe_loop": statistics.median(fast), "median_fit_callback": statistics.median(fit)}
    out["ratio"] = out["median_probe_loop"] / out["median_fit_callback"]
    out["ratio_float32"] = out["median_probe_loop_float32"] / out["median_fit_callback"]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
