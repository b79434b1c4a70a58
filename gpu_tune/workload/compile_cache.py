"""The probe's persistent XLA compilation cache: one folder per TensorFlow, device and driver.

TensorFlow saves every executable it compiles with XLA to ``--tf_xla_persistent_cache_directory``
(``TF_XLA_FLAGS``, read once, before the first compilation) and loads it from there the next
time instead of compiling: on a GPU that skips the autotuning and the PTX compilation that were
most of the probe's time to verdict (docs/probe.md). The folder is chosen here, before
TensorFlow is imported, under the directory the agent gives (``--compile-cache``, in its state
folder):

``<dir>/<key>/`` with ``key`` = TensorFlow's version, the device's model, the driver version and
a digest of what else changes a compilation (the probe version, ``XLA_FLAGS``, the other
``TF_XLA_FLAGS``; on a CPU its instruction-set flags). TensorFlow's own entry names carry a
fingerprint of the program compiled, and it compares the whole program before using an entry,
so an entry is only ever used for the very program it was compiled from; the key keeps the
executables of one GPU model, driver or TensorFlow from being offered to another.

Never able to change the result: the fingerprint comes from the correctness run, which is not
compiled with XLA; the throughput windows run the same program either way. An entry TensorFlow
cannot use (a file cut short, a disk that filled up) makes its compilation fail instead of
falling back: the workload then removes the folder and reports ``error_kind: compile_cache``,
and the agent runs the probe again at once without the cache.

The folder holds code the probe loads and runs: it is used only when it and all in it are this
process' own (:func:`own_folder`, ``gpu_tune.workload.cache_guard``: no symbolic link, no FIFO,
socket or device, nothing of another user's or writable by anyone else, bounded in depth and
entries); otherwise the cache is off, with the reason. The agent checks the whole cache the same
way before each run and sets aside what fails (``gpu_tune.judge.probe.cache``); it also keeps the
bound on its size, pruning the least recently used folders; this module touches the folder it uses.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_tune.workload import PROBE_VERSION, cache_guard
from gpu_tune.workload.hostinfo import cpu_name, cpuinfo_field, nvml_identity

TF_FLAG = "--tf_xla_persistent_cache_directory"
ENTRY_GLOB = "*.pb"
TF_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel", "tensorflow-aarch64",
                    "tf-nightly", "tf-nightly-cpu")


def tensorflow_version() -> str | None:
    """The installed TensorFlow's version, from its package metadata (no import)."""
    for name in TF_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def slug(text: str, limit: int = 48) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")[:limit] or "unknown"


def cache_key(tf_version: str, device: str, driver: str | None, extra: dict[str, Any]) -> str:
    """``tf2.21.0-NVIDIA-H100-80GB-HBM3-driver580.159.04-1a2b3c4d``: readable, and different
    whenever any part differs."""
    digest = hashlib.sha256(repr(sorted(extra.items())).encode()).hexdigest()[:8]
    return f"tf{slug(tf_version)}-{slug(device)}-driver{slug(driver or 'none')}-{digest}"


def other_xla_flags() -> str:
    return " ".join(f for f in os.environ.get("TF_XLA_FLAGS", "").split() if not f.startswith(TF_FLAG))


@dataclass
class CompileCache:
    """The folder in use (``path``) or why none is (``reason``)."""

    path: Path | None
    key: str | None = None
    reason: str | None = None
    entries_before: int = 0
    notes: list[str] = field(default_factory=list)

    def entries(self) -> int:
        if self.path is None:
            return 0
        try:
            return sum(1 for _ in self.path.glob(ENTRY_GLOB))
        except OSError:
            return 0

    def forget(self) -> str | None:
        """Remove the folder (an entry TensorFlow could not use), never following a link: the next
        run compiles afresh. None, or why it was not (all) removed."""
        if self.path is None:
            return None
        try:
            bfd = cache_guard.open_dir(self.path.parent)
        except OSError as exc:
            return f"{self.path.parent}: {exc.strerror or exc}"
        try:
            r = cache_guard.remove(bfd, self.path.name, budget=cache_guard.MAX_ENTRIES * 4)
        finally:
            os.close(bfd)
        return r.error or (None if r.done else "more entries than expected; the agent removes the rest")

    def summary(self) -> dict[str, Any]:
        if self.path is None:
            return {"status": "off", "reason": self.reason}
        after = self.entries()
        state = "cold" if self.entries_before == 0 else ("warm" if after == self.entries_before else "partly warm")
        return {"status": state, "key": self.key, "dir": str(self.path), "entries_before": self.entries_before,
                "entries_after": after}


def own_folder(base: Path, key: str) -> str | None:
    """Make ``base/key`` (0700) and check that it and all in it are this process' own
    (``cache_guard``: no link, no FIFO, nobody else's, nobody else may write); None, or why the
    cache cannot be used. Files this process makes are writable by it alone (umask 022 at least):
    TensorFlow's entries pass the next run's check."""
    os.umask(os.umask(0o022) | 0o022)
    what = str(base / key)
    try:
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        bfd = cache_guard.open_dir(base)
    except OSError as exc:
        return f"{base}: {exc.strerror or exc}"
    try:
        why = cache_guard.fault(os.fstat(bfd), str(base), uid=os.geteuid(), folder=True)
        if why:
            return why
        try:
            os.mkdir(key, 0o700, dir_fd=bfd)
        except FileExistsError:
            why = cache_guard.fault(os.stat(key, dir_fd=bfd, follow_symlinks=False), what, uid=os.geteuid(),
                                    folder=True)
            if why:
                return why
        kfd = cache_guard.open_dir(key, bfd)  # never through a link, never opening a FIFO
        try:
            why = (cache_guard.fault(os.fstat(kfd), what, uid=os.geteuid(), folder=True)
                   or cache_guard.walk(kfd, what).fault)
            if why:
                return why
            probe = f".write-test-{os.getpid()}"
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=kfd))
            os.unlink(probe, dir_fd=kfd)
            os.utime(kfd)  # the agent's pruning keeps the folders used most recently
        finally:
            os.close(kfd)
    except OSError as exc:
        return f"{what}: {exc.strerror or exc}"
    finally:
        os.close(bfd)
    return None


def prepare(base: str | None, *, device: str, xla: str) -> CompileCache:
    """Choose and create the folder, check it is writable and set ``TF_XLA_FLAGS``; call it before
    TensorFlow is imported. Anything in the way leaves the cache off with the reason."""
    if not base:
        return CompileCache(None, reason="no cache folder given")
    xla_off = CompileCache(None, reason="XLA is off for this run: nothing to cache")
    if xla == "off" or (xla == "auto" and device == "cpu"):
        return xla_off
    # What the probe will compile for: the GPU NVML names for CUDA_VISIBLE_DEVICES, else the CPU.
    ident = nvml_identity() if device in ("gpu", "auto") else None
    if ident is None:
        if device == "gpu":
            return CompileCache(None, reason="not keyed: the GPU's model and driver are unknown (NVML)")
        if xla == "auto":  # no GPU: a CPU run, XLA off
            return xla_off
    model, driver = ident if ident is not None else (cpu_name(), None)
    tf_version = tensorflow_version()
    if tf_version is None:
        return CompileCache(None, reason="not keyed: TensorFlow's version is unknown before the import")
    extra = {"probe": PROBE_VERSION, "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""), "TF_XLA_FLAGS": other_xla_flags()}
    if driver is None:  # a CPU: what it can execute
        extra["cpu_flags"] = hashlib.sha256((cpuinfo_field("flags") or "").encode()).hexdigest()[:12]
    key = cache_key(tf_version, model, driver, extra)
    path = Path(base) / key
    why = own_folder(Path(base), key)
    if why:
        return CompileCache(None, reason=why)
    cache = CompileCache(path, key)
    cache.entries_before = cache.entries()
    os.environ["TF_XLA_FLAGS"] = f"{other_xla_flags()} {TF_FLAG}={path}".strip()
    return cache
