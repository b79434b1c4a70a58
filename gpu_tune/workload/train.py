"""TensorFlow side of the probe: device setup, the CNN, the training and inference loops.

The only module of the project that imports TensorFlow. The network is the probe's small CNN
(Conv32-pool-Conv64-pool-Dense128-Dense10, 225,034 parameters) written with TensorFlow ops, not
Keras: the probe needs no layer library, and keeping Keras (and the scikit-learn it pulls in) out
of the process saves about 1.4 s of the TensorFlow import (``tensorflow/__init__.py`` imports
``keras`` eagerly when it is installed, inside a ``try``/``except ImportError``).

Everything that decides the numbers is fixed and portable: the initial weights come from NumPy's
generator with the probe's seed (not TensorFlow's), the data order is a NumPy permutation, Adam is
written out, and the loss is an explicit log-softmax (no op without a deterministic kernel).

The data lives on the device: images (scaled to 0..1 once, in NumPy) and labels are copied there
once, and every step picks its batch there with a gather, so no host input pipeline sits between
the loop and the device.
The step runs many times per call of one ``tf.function`` (a ``tf.range`` loop), so the host pays
one Python call per chunk of steps, not per step; on a GPU the step is compiled with XLA.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from gpu_tune.workload import NOT_INSTALLED  # noqa: E402
from gpu_tune.workload.hostinfo import cpu_has_bf16, cpu_name  # noqa: E402


class TensorFlowMissing(ImportError):
    """TensorFlow cannot be imported here (not installed, or installed but broken)."""


class _SkipKeras(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """While TensorFlow imports, make ``keras`` (and what only Keras code uses) look present but
    fail to load.

    ``find_spec`` still answers with the real location (TensorFlow reads it to set up the lazy
    ``tf.keras`` alias), but loading raises ImportError, which TensorFlow's eager
    ``import keras.src.optimizers`` catches. The probe never uses Keras. TensorFlow's own legacy
    Keras (``tensorflow.python.keras``, imported by its feature columns) then tries ``h5py``,
    ``scipy.sparse`` and ``pandas``, each inside ``try``/``except ImportError``: they are kept out
    too (about 0.1 s of CPU time of the import here, more where their libraries are cold).
    """

    NAMES = frozenset({"keras", "tf_keras", "h5py", "scipy", "pandas"})

    def find_spec(self, name, path=None, target=None):
        if name not in self.NAMES:
            return None
        real = importlib.machinery.PathFinder.find_spec(name, path)
        if real is None:
            return None
        return importlib.util.spec_from_loader(name, self, origin=real.origin)

    def create_module(self, spec):
        raise ImportError(f"{spec.name} is not loaded in the probe process")

    def exec_module(self, module):  # pragma: no cover - create_module always raises
        pass


def _import_tensorflow():
    skip = _SkipKeras()
    sys.meta_path.insert(0, skip)
    try:
        import tensorflow  # noqa: PLC0415
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "tensorflow":
            raise TensorFlowMissing(NOT_INSTALLED) from None
        raise TensorFlowMissing(f"TensorFlow failed to import: {exc}") from None
    except ImportError as exc:  # installed but broken (a missing CUDA library, an ABI mismatch)
        raise TensorFlowMissing(f"TensorFlow failed to import: {exc}") from None
    finally:
        sys.meta_path.remove(skip)
    return tensorflow


tf = _import_tensorflow()

# -- the network ---------------------------------------------------------------------------------
# (name, shape, fan_in, fan_out) in a fixed order: the order of the fingerprint's bytes too.
PARAMS: tuple[tuple[str, tuple[int, ...], int, int], ...] = (
    ("conv1/kernel", (3, 3, 1, 32), 9, 288),
    ("conv1/bias", (32,), 0, 0),
    ("conv2/kernel", (3, 3, 32, 64), 288, 576),
    ("conv2/bias", (64,), 0, 0),
    ("dense1/kernel", (1600, 128), 1600, 128),
    ("dense1/bias", (128,), 0, 0),
    ("dense2/kernel", (128, 10), 128, 10),
    ("dense2/bias", (10,), 0, 0),
)
PARAM_COUNT = sum(int(np.prod(s)) for _, s, _, _ in PARAMS)
DTYPES = {"float32": tf.float32, "bfloat16": tf.bfloat16, "float16": tf.float16}
FLOAT16_LOSS_SCALE = 1024.0  # static: the probe's gradients are far from float16's limits


def init_params(seed: int) -> list[np.ndarray]:
    """Glorot-uniform kernels and zero biases from NumPy's generator: the same on every machine."""
    rng = np.random.default_rng(seed)
    out = []
    for _name, shape, fan_in, fan_out in PARAMS:
        if fan_in:
            lim = math.sqrt(6.0 / (fan_in + fan_out))
            out.append(rng.uniform(-lim, lim, size=shape).astype(np.float32))
        else:
            out.append(np.zeros(shape, np.float32))
    return out


def forward(params: list[Any], x: Any, dtype: Any) -> Any:
    """Images scaled to 0..1 (B, 28, 28, float32) -> float32 logits (B, 10), computed in ``dtype``."""
    w = [tf.cast(p, dtype) if p.dtype != dtype else p for p in params]
    h = tf.reshape(tf.cast(x, dtype) if x.dtype != dtype else x, [-1, 28, 28, 1])
    # Each block is conv -> 2x2 max-pool -> bias -> ReLU: the same function as the usual
    # conv -> bias -> ReLU -> pool (a per-channel bias commutes with max, ReLU is monotonic), with
    # the elementwise work and its gradients on a tensor 4x smaller (measured ~12% faster per step
    # on a CPU, where that memory traffic rivals the convolutions' arithmetic).
    h = tf.nn.relu(tf.nn.max_pool2d(tf.nn.conv2d(h, w[0], 1, "VALID"), 2, 2, "VALID") + w[1])
    h = tf.nn.relu(tf.nn.max_pool2d(tf.nn.conv2d(h, w[2], 1, "VALID"), 2, 2, "VALID") + w[3])
    h = tf.nn.relu(tf.matmul(tf.reshape(h, [-1, 1600]), w[4]) + w[5])
    return tf.cast(tf.matmul(h, w[6]) + w[7], tf.float32)


def cross_entropy(logits: Any, labels: Any) -> Any:
    # An explicit log-softmax: sparse_softmax_cross_entropy_with_logits has no deterministic GPU
    # kernel in every TensorFlow version, and the fingerprint run needs one.
    return -tf.reduce_mean(tf.reduce_sum(tf.one_hot(labels, 10) * tf.nn.log_softmax(logits), axis=-1))


# -- the device ----------------------------------------------------------------------------------
class DeviceUnavailable(Exception):
    pass


@dataclass(frozen=True)
class Plan:
    kind: str  # "gpu" | "cpu"
    device: str  # "/GPU:0" | "/CPU:0"
    name: str
    compute_capability: str | None
    xla: bool
    precision: str  # the throughput windows' compute dtype: float32 | bfloat16 | float16
    threads: int  # CPUs this process may run on (TensorFlow sizes its thread pools by it)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "compute_capability": self.compute_capability}


def setup_device(requested: str, *, xla: bool | None = None, precision: str | None = None) -> Plan:
    """Pick the device (``cpu`` | ``gpu`` | ``auto``), enable GPU memory growth, choose XLA and
    the throughput precision. A GPU asked for but absent raises DeviceUnavailable.

    XLA: on for GPUs (fewer, fused kernels per step); off for CPUs, where TensorFlow 2.21's XLA
    CPU backend ran this loop about 40x slower than the default oneDNN kernels
    (``benchmarks/bench_probe.py`` measures both). Precision: bfloat16 on GPUs of compute
    capability 8.0 and later, float16 (with loss scaling) before that; on a CPU bfloat16 only where
    the CPU has native bfloat16 instructions, else float32. The correctness and fingerprint run
    is always float32.
    """
    gpus = tf.config.list_physical_devices("GPU")
    if requested == "cpu":
        if gpus:
            tf.config.set_visible_devices([], "GPU")
        gpus = []
    elif requested == "gpu" and not gpus:
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise DeviceUnavailable(
            "a GPU was asked for but TensorFlow sees none "
            f"(CUDA_VISIBLE_DEVICES={cvd!r}, TensorFlow built with CUDA: {tf.test.is_built_with_cuda()})")
    threads = len(os.sched_getaffinity(0))
    if gpus:
        gpus = gpus[:1]
        tf.config.set_visible_devices(gpus, "GPU")
        # TensorFlow takes all GPU memory by default; other work may share this GPU.
        tf.config.experimental.set_memory_growth(gpus[0], True)
        details = tf.config.experimental.get_device_details(gpus[0])
        cc = details.get("compute_capability")
        cc_text = f"{cc[0]}.{cc[1]}" if cc else None
        auto_precision = "bfloat16" if cc and tuple(cc) >= (8, 0) else "float16"
        return Plan("gpu", "/GPU:0", details.get("device_name") or gpus[0].name, cc_text,
                    True if xla is None else xla, precision or auto_precision, threads)
    return Plan("cpu", "/CPU:0", cpu_name(), None, False if xla is None else xla,
                precision or ("bfloat16" if cpu_has_bf16() else "float32"), threads)


def software() -> dict[str, Any]:
    """TensorFlow's version and the CUDA/cuDNN it was built for (None for a CPU build)."""
    info: dict[str, Any] = {}
    try:
        info = dict(tf.sysconfig.get_build_info())
    except Exception:  # an unusual build without build info
        pass
    cuda = info.get("cuda_version") if info.get("is_cuda_build") else None
    return {"tensorflow": tf.__version__, "cuda_build": cuda,
            "cudnn_build": info.get("cudnn_version") if cuda else None,
            "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1") not in ("0", "false", "False"),
            "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA") or None}


@dataclass
class DeviceData:
    """Training and test images (float32, scaled to 0..1) and labels (int64) on the device.

    Both are types every device has gather kernels for: a uint8 gather has no GPU kernel, and
    outside XLA TensorFlow would run it on the host, copying the images off the GPU every step.
    """

    x_train: Any
    y_train: Any
    x_test: Any
    y_test: np.ndarray  # host copy for scoring
    device: str  # where TensorFlow placed the training images

    @classmethod
    def put(cls, plan: Plan, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray,
            y_test: np.ndarray) -> "DeviceData":
        with tf.device(plan.device):
            # tf.identity under the device scope makes the copy land there (an eager constant is
            # created on the host). Scaling in NumPy (an exact division) is the same everywhere.
            xt = tf.identity(tf.constant(scale_images(x_train)))
            yt = tf.identity(tf.constant(np.asarray(y_train, np.int64)))
            xe = tf.identity(tf.constant(scale_images(x_test)))
        return cls(xt, yt, xe, np.asarray(y_test), xt.device)


def scale_images(x: np.ndarray) -> np.ndarray:
    """uint8 pixels -> float32 in 0..1 (IEEE division: bit-identical on every machine)."""
    return np.asarray(x, np.float32) / np.float32(255.0)


# -- training ------------------------------------------------------------------------------------
class Adam:
    """Adam (Kingma & Ba) with bias correction, written out so every machine runs the same ops."""

    def __init__(self, params: list[Any], lr: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-7):
        self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
        self.m = [tf.Variable(tf.zeros_like(p)) for p in params]
        self.v = [tf.Variable(tf.zeros_like(p)) for p in params]
        self.t = tf.Variable(0.0)

    def apply(self, params: list[Any], grads: list[Any]) -> None:
        t = self.t.assign_add(1.0)
        lr_t = self.lr * tf.sqrt(1.0 - tf.pow(self.b2, t)) / (1.0 - tf.pow(self.b1, t))
        for p, m, v, g in zip(params, self.m, self.v, grads):
            m.assign(self.b1 * m + (1.0 - self.b1) * g)
            v.assign(self.b2 * v + (1.0 - self.b2) * tf.square(g))
            p.assign_sub(lr_t * m / (tf.sqrt(v) + self.eps))


class Trainer:
    """Trains a fresh copy of the CNN on device-resident data in a fixed order.

    ``order`` is the sequence of training-set indices the steps consume, ``batch_size`` at a time,
    wrapping around at its end. :meth:`run` performs ``n`` steps in one call and waits for them.
    """

    def __init__(self, plan: Plan, data: DeviceData, batch_size: int, order: np.ndarray, *, seed: int,
                 lr: float, precision: str = "float32", xla: bool = False) -> None:
        self.batch_size = int(batch_size)
        self.precision = precision
        dtype = DTYPES[precision]
        scale = FLOAT16_LOSS_SCALE if precision == "float16" else 1.0
        with tf.device(plan.device):
            self.params = [tf.Variable(a, name=n.replace("/", "_")) for a, (n, *_r) in zip(init_params(seed), PARAMS)]
            self.opt = Adam(self.params, lr)
            self.order = tf.identity(tf.constant(np.asarray(order, np.int64)))
            self.pos = tf.Variable(tf.constant(0, tf.int64))
            offsets = tf.range(self.batch_size, dtype=tf.int64)  # on the device: no copy per step
        n_order = int(len(order))
        x_all, y_all = data.x_train, data.y_train
        params, opt = self.params, self.opt

        @tf.function(jit_compile=xla)
        def step():
            idx = tf.gather(self.order, tf.math.floormod(self.pos + offsets, n_order))
            self.pos.assign_add(self.batch_size)
            x = tf.gather(x_all, idx)
            y = tf.cast(tf.gather(y_all, idx), tf.int32)
            with tf.GradientTape() as tape:
                loss = cross_entropy(forward(params, x, dtype), y)
                scaled = loss * scale if scale != 1.0 else loss
            grads = tape.gradient(scaled, params)
            if scale != 1.0:
                grads = [g / scale for g in grads]
                finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
                grads = [tf.where(finite, g, tf.zeros_like(g)) for g in grads]
            opt.apply(params, grads)
            return loss

        @tf.function
        def chunk(n):
            loss = tf.constant(0.0)
            for _ in tf.range(n):
                loss = step()
            return loss

        self._chunk = chunk

    def trace(self) -> None:
        """Trace the training function now (no step runs).

        TensorFlow names a traced function by a process-wide counter that every later call of a
        ``tf.function`` advances; the persistent compilation cache finds an executable by that name
        (it is in the program's signature and text). Tracing both windows' trainers before either
        window runs gives their programs the same names in every run, whatever number of calls the
        first window's timing made; otherwise the device-bound program got a new name, and a new
        compilation, whenever that number changed."""
        self._chunk.get_concrete_function(tf.TensorSpec([], tf.int32))

    def run(self, n: int) -> float:
        return float(self._chunk(tf.constant(int(n), tf.int32)).numpy())  # .numpy() waits for the device

    def weights(self) -> list[np.ndarray]:
        return [p.numpy() for p in self.params]


def fixed_order(n_train: int, images: int, seed: int) -> np.ndarray:
    """The first ``images`` indices of successive seeded permutations of the training set."""
    rng = np.random.default_rng(seed)
    parts, have = [], 0
    while have < images:
        parts.append(rng.permutation(n_train))
        have += n_train
    return np.concatenate(parts)[:images]


def predict(params: list[Any], x: Any, dtype: Any = None, batch: int = 1000) -> np.ndarray:
    """Class predictions for device-resident images, in fixed-size chunks."""
    dtype = dtype or tf.float32

    @tf.function(reduce_retracing=True)
    def classes(xb):
        return tf.argmax(forward(params, xb, dtype), axis=-1, output_type=tf.int32)

    n = int(x.shape[0])
    return np.concatenate([classes(x[i:i + batch]).numpy() for i in range(0, n, batch)])


def correctness_run(plan: Plan, data: DeviceData, *, steps: int, batch_size: int, seed: int,
                    lr: float) -> dict[str, Any]:
    """The fixed amount of work the verdict judges: ``steps`` float32 steps in a seeded order,
    with op determinism, then the test accuracy and the result fingerprint.

    The fingerprint is the first 16 hex digits of SHA-256 over the final weights (float32,
    little-endian, in :data:`PARAMS` order) followed by the test-set predictions (int32): it is
    bit-identical on healthy machines with the same device model and software (and, on CPUs, the
    same thread count, which sets how the kernels split their sums), idle or busy.
    """
    # Deterministic kernels (and no autotuning among kernels that differ in their last bits),
    # and true float32 on GPUs that would otherwise use TensorFloat-32 for matmuls/convolutions.
    tf.config.experimental.enable_op_determinism()
    tf.config.experimental.enable_tensor_float_32_execution(False)
    n_train = int(data.x_train.shape[0])
    t0 = time.perf_counter()
    trainer = Trainer(plan, data, batch_size, fixed_order(n_train, steps * batch_size, seed), seed=seed,
                      lr=lr, precision="float32", xla=False)
    loss = trainer.run(steps)
    train_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    preds = predict(trainer.params, data.x_test)
    acc = float(np.mean(preds == data.y_test))
    eval_s = time.perf_counter() - t1
    wbytes = b"".join(w.astype("<f4").tobytes() for w in trainer.weights())
    pbytes = preds.astype("<i4").tobytes()
    weights_sha = hashlib.sha256(wbytes).hexdigest()
    preds_sha = hashlib.sha256(pbytes).hexdigest()
    fingerprint = hashlib.sha256(wbytes + pbytes).hexdigest()[:16]
    return {
        "accuracy": acc, "fingerprint": fingerprint, "final_loss": loss, "steps": steps,
        "batch_size": batch_size, "images": steps * batch_size, "seed": seed, "learning_rate": lr,
        "epochs": round(steps * batch_size / n_train, 3), "precision": "float32", "deterministic": True,
        "weights_sha256": weights_sha, "predictions_sha256": preds_sha,
        "train_seconds": train_s, "evaluate_seconds": eval_s,
    }


def window_trainer(plan: Plan, data: DeviceData, *, batch_size: int, seed: int, lr: float) -> Trainer:
    """The trainer of a throughput window at ``batch_size``, traced but not run (see
    :meth:`Trainer.trace`)."""
    n_train = int(data.x_train.shape[0])
    order = np.random.default_rng(seed + 1).permutation(n_train)
    trainer = Trainer(plan, data, batch_size, order, seed=seed, lr=lr, precision=plan.precision, xla=plan.xla)
    trainer.trace()
    return trainer


def throughput_window(plan: Plan, data: DeviceData, *, batch_size: int, seconds: float, seed: int,
                      lr: float, min_steps: int = 3, call_seconds: float | None = None,
                      step_times: bool = False, trainer: Trainer | None = None) -> dict[str, Any]:
    """Training images/s at ``batch_size`` in a timed window of about ``seconds``.

    The first call (tracing, XLA compilation) and one short sizing call are excluded; the window
    then runs whole chunks of steps sized to ``call_seconds`` each (0.1 s on a CPU, 0.25 s on a
    GPU) and reports the monotonic time span it covered, for matching GPU utilization samples.

    ``step_times``: one step per call, each timed to its result (launch, compute and the wait for
    it), reported as ``step_seconds`` (p50, p99, p99/p50, samples) and ``step_seconds_all``.
    ``trainer``: one :func:`window_trainer` made earlier (its time is the caller's to count).
    """
    t0 = time.perf_counter()
    if trainer is None:
        trainer = window_trainer(plan, data, batch_size=batch_size, seed=seed, lr=lr)
    trainer.run(2)  # (trace +) compile + first steps
    compile_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    trainer.run(2)
    per_step = max((time.perf_counter() - t1) / 2, 1e-6)
    target = call_seconds if call_seconds is not None else (0.25 if plan.kind == "gpu" else 0.1)
    n = 1 if step_times else int(max(1, min(2000, target / per_step)))
    steps = 0
    times: list[float] = []
    start_m, start = time.monotonic(), time.perf_counter()
    loss = float("nan")
    while steps < min_steps or time.perf_counter() - start < seconds:
        if step_times:
            t = time.perf_counter()
            loss = trainer.run(1)
            times.append(time.perf_counter() - t)
        else:
            loss = trainer.run(n)
        steps += n
    elapsed = time.perf_counter() - start
    images = steps * batch_size
    out = {"batch_size": batch_size, "steps": steps, "images": images, "seconds": elapsed,
           "images_per_second": images / elapsed, "steps_per_second": steps / elapsed,
           "steps_per_call": n, "compile_seconds": compile_s, "final_loss": loss,
           "precision": plan.precision, "xla": plan.xla, "window": (start_m, start_m + elapsed)}
    if step_times:
        out["step_seconds"] = step_time_summary(times)
        out["step_seconds_all"] = [round(x, 7) for x in times]
    return out


def step_time_summary(times: list[float]) -> dict[str, Any]:
    """p50 and p99 of step times (linear interpolation between order statistics) and their ratio,
    the jitter figure: 1.0 for perfectly even steps."""
    arr = np.asarray(times, np.float64)
    p50, p99 = (float(np.percentile(arr, q)) for q in (50, 99))
    return {"samples": int(arr.size), "p50": round(p50, 7), "p99": round(p99, 7),
            "p99_over_p50": round(p99 / p50, 4) if p50 > 0 else None}


def inference_throughput(plan: Plan, data: DeviceData, batch_sizes: Iterable[int], seconds: float,
                         seed: int) -> dict[str, float]:
    """Forward-pass images/s at each batch size (one warm-up call per shape excluded).

    Graph mode without XLA on every device: an XLA compilation per batch size cost seconds of
    the GPU's time-to-verdict for figures that are reported, not judged.
    """
    dtype = DTYPES[plan.precision]
    with tf.device(plan.device):
        params = [tf.Variable(a) for a in init_params(seed)]

    @tf.function
    def forward_only(xb):
        return forward(params, xb, dtype)

    n_test = int(data.x_test.shape[0])
    out: dict[str, float] = {}
    for bs in batch_sizes:
        with tf.device(plan.device):
            idx = tf.constant(np.arange(bs) % n_test, tf.int64)
            batch = tf.gather(data.x_test, idx)
        forward_only(batch).numpy()
        calls = 0
        t0 = time.perf_counter()
        while True:
            last = None
            for _ in range(8):
                last = forward_only(batch)
            calls += 8
            last.numpy()
            if time.perf_counter() - t0 >= seconds:
                break
        out[str(bs)] = round(calls * bs / (time.perf_counter() - t0), 1)
    return out
