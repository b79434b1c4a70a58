"""TensorFlow side of the probe: device setup, the CNN, the input pipeline, timed loops.

The training loop runs many steps inside one ``tf.function`` call (no per-batch Python, no
callbacks); the first call (tracing, XLA compilation) is warm-up and is excluded from timing.
"""

from __future__ import annotations

import os
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

keras = tf.keras


class DeviceUnavailable(Exception):
    pass


def setup_device(requested: str, *, xla: bool | None = None, mixed: bool | None = None) -> dict[str, Any]:
    """Pick the device, enable memory growth, set mixed precision. Returns the plan.

    ``requested``: "cpu" | "gpu" | "auto". A GPU asked for but absent raises DeviceUnavailable.
    """
    gpus = tf.config.list_physical_devices("GPU")
    if requested == "cpu":
        if gpus:
            tf.config.set_visible_devices([], "GPU")
        gpus = []
    elif requested == "gpu" and not gpus:
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
        built = tf.test.is_built_with_cuda()
        raise DeviceUnavailable(
            "a GPU was asked for but TensorFlow sees none "
            f"(CUDA_VISIBLE_DEVICES={cvd!r}, TensorFlow built with CUDA: {built})")
    for g in gpus:
        # TensorFlow takes all GPU memory by default; other work may share this GPU.
        tf.config.experimental.set_memory_growth(g, True)
    on_gpu = bool(gpus)
    if on_gpu:
        gpus = gpus[:1]
        tf.config.set_visible_devices(gpus, "GPU")
    use_xla = on_gpu if xla is None else xla
    # Mixed precision: float16 (with loss scaling) on a GPU; bfloat16 on a CPU with native bf16
    # instructions (AVX512_BF16 / AMX), where oneDNN runs the convolutions faster.
    use_mixed = (on_gpu or cpu_has_bf16()) if mixed is None else mixed
    precision = ("mixed_float16" if on_gpu else "mixed_bfloat16") if use_mixed else "float32"
    keras.mixed_precision.set_global_policy(precision)
    plan: dict[str, Any] = {"kind": "gpu" if on_gpu else "cpu", "xla": use_xla, "mixed_precision": use_mixed,
                            "precision": precision, "name": None, "compute_capability": None}
    if on_gpu:
        details = tf.config.experimental.get_device_details(gpus[0])
        plan["name"] = details.get("device_name") or gpus[0].name
        cc = details.get("compute_capability")
        plan["compute_capability"] = f"{cc[0]}.{cc[1]}" if cc else None
    else:
        plan["name"] = _cpu_name()
    return plan


def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


def build_model(seed: int) -> keras.Model:
    """A small CNN (~225k parameters); uint8 images in, logits (float32) out."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input(shape=(28, 28), dtype="uint8"),
        keras.layers.Rescaling(1.0 / 255.0),
        keras.layers.Reshape((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10, dtype="float32"),
    ])


def make_dataset(x: np.ndarray, y: np.ndarray, batch_size: int, seed: int) -> tf.data.Dataset:
    """uint8 in host memory, cached, shuffled, large batches, prefetched; cast on the device."""
    ds = tf.data.Dataset.from_tensor_slices((x, y.astype(np.int32))).cache()
    ds = ds.shuffle(min(len(x), 10_000), seed=seed, reshuffle_each_iteration=True).repeat()
    ds = ds.batch(batch_size, drop_remainder=True, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.prefetch(tf.data.AUTOTUNE)


def learning_rate(batch_size: int) -> float:
    # Adam at 1e-3 for batch 128, scaled with the square root of the batch, capped.
    return float(min(4e-3, 1e-3 * (batch_size / 128.0) ** 0.5))


class FastTrainer:
    def __init__(self, model: keras.Model, batch_size: int, *, xla: bool, mixed: bool) -> None:
        self.model = model
        self.batch_size = batch_size
        opt = keras.optimizers.Adam(learning_rate(batch_size))
        # Loss scaling guards float16 gradients; bfloat16 has float32's range and needs none.
        mixed = mixed and keras.mixed_precision.global_policy().compute_dtype == "float16"
        self.mixed = mixed
        self.opt = keras.mixed_precision.LossScaleOptimizer(opt) if mixed else opt
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        @tf.function(jit_compile=xla)
        def step(x, y):
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = self.loss_fn(y, logits)
                scaled = self.opt.scale_loss(loss) if mixed else loss
            grads = tape.gradient(scaled, model.trainable_variables)
            self.opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        @tf.function
        def chunk(iterator, n):
            loss = tf.constant(0.0)
            for _ in tf.range(n):
                x, y = next(iterator)
                loss = step(x, y)
            return loss

        self._chunk = chunk

    def train(self, dataset: tf.data.Dataset, seconds: float, warmup_steps: int = 3) -> dict[str, Any]:
        it = iter(dataset)
        t0 = time.perf_counter()
        self._chunk(it, tf.constant(warmup_steps)).numpy()  # trace + compile + fill the pipeline
        warmup_s = time.perf_counter() - t0
        # Size chunks from one short timed chunk so each call lasts ~0.2 s.
        t1 = time.perf_counter()
        self._chunk(it, tf.constant(2)).numpy()
        per_step = max((time.perf_counter() - t1) / 2, 1e-5)
        n = int(max(1, min(1000, 0.2 / per_step)))
        steps = 2
        start = t1
        loss = float("nan")
        while time.perf_counter() - start < seconds:
            loss = float(self._chunk(it, tf.constant(n)).numpy())  # .numpy() waits for the device
            steps += n
        elapsed = time.perf_counter() - start
        images = steps * self.batch_size
        return {"steps": steps, "images": images, "seconds": elapsed, "warmup_seconds": warmup_s,
                "warmup_steps": warmup_steps, "steps_per_call": n, "final_loss": loss,
                "images_per_second": images / elapsed, "steps_per_second": steps / elapsed,
                "window": (start, start + elapsed)}


def accuracy(model: keras.Model, x: np.ndarray, y: np.ndarray, *, xla: bool, batch: int = 1024) -> float:
    @tf.function(jit_compile=xla, reduce_retracing=True)
    def predict(xb):
        return tf.argmax(model(xb, training=False), axis=-1, output_type=tf.int32)

    correct = 0
    for i in range(0, len(x), batch):
        correct += int(np.sum(predict(tf.constant(x[i:i + batch])).numpy() == y[i:i + batch]))
    return correct / len(x)


def inference_throughput(model: keras.Model, x: np.ndarray, batch_sizes, seconds: float, *,
                         xla: bool) -> dict[str, float]:
    """Images/s of a forward pass at each batch size (one warm-up call excluded)."""

    @tf.function(jit_compile=xla)
    def forward(xb):
        return model(xb, training=False)

    out: dict[str, float] = {}
    for bs in batch_sizes:
        reps = int(np.ceil(bs / len(x)))
        batch = tf.constant(np.concatenate([x] * reps)[:bs] if reps > 1 else x[:bs])
        forward(batch).numpy()  # warm-up: trace/compile for this shape
        calls = 0
        t0 = time.perf_counter()
        last = None
        while True:
            for _ in range(8):
                last = forward(batch)
            calls += 8
            last.numpy()
            if time.perf_counter() - t0 >= seconds:
                break
        out[str(bs)] = round(calls * bs / (time.perf_counter() - t0), 1)
    return out


def variable_device(model: keras.Model) -> str:
    v = model.trainable_variables[0]
    return getattr(getattr(v, "value", v), "device", "") or ""


# -- the approach of the first app, for side-by-side comparison --------------------------------
def fit_with_callback(x: np.ndarray, y: np.ndarray, batch_size: int, seconds: float, seed: int,
                      warmup_steps: int = 3) -> dict[str, Any]:
    """``model.fit`` on NumPy arrays with a per-batch timing callback (the first app's shape)."""
    model = build_model(seed)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate(batch_size)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    stamps: list[float] = []

    class BatchTimer(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            stamps.append(time.perf_counter())
            if len(stamps) > warmup_steps and stamps[-1] - stamps[warmup_steps] >= seconds:
                self.model.stop_training = True

    model.fit(x, y.astype(np.int32), batch_size=batch_size, epochs=10_000, verbose=0,
              callbacks=[BatchTimer()], shuffle=True)
    steps = len(stamps) - 1 - warmup_steps
    elapsed = stamps[-1] - stamps[warmup_steps]
    return {"steps": steps, "seconds": elapsed, "images_per_second": steps * batch_size / elapsed}


def fast_train(x: np.ndarray, y: np.ndarray, batch_size: int, seconds: float, seed: int, *,
               xla: bool = False, mixed: bool = False) -> dict[str, Any]:
    model = build_model(seed)
    trainer = FastTrainer(model, batch_size, xla=xla, mixed=mixed)
    res = trainer.train(make_dataset(x, y, batch_size, seed), seconds)
    res.pop("window", None)
    return res
