"""One reading of the GPUs per pass (docs/health.md, "One reading per pass").

A pass of ``gpu-tune check`` or of the agent reads the GPUs from several places: the topology
matches them to the PCI bus, the tuning audit reads their persistence and MIG modes, the knobs
that need the topology discover it again, the verdict judges them, the probe plans by them. Each
used to ask the backend, so every NVML reading of every GPU was taken five times a pass (and a
thousand GPUs' P2P pairs five times over). :class:`PassReadings` sits in front of the backend
:func:`gpu_tune.gpu.select_backend` chose and answers every ask of one pass from its one reading:

- :meth:`gpus` (a failure too: the same error, not a second try), :meth:`cpu_affinity` per GPU,
  the driver's and CUDA's versions: read at the first ask of a pass, kept for the rest of it;
- :meth:`next_pass` starts a new pass (the agent calls it at the start of each; a command is one
  pass). It never waits, not even for a reading stuck in the driver;
- a write (:meth:`set_persistence_mode`) ends what was read: the verify after it reads again;
- :meth:`processes` is not kept: the probe asks it just before it runs, to see who uses a GPU now.

Concurrent asks (a probe thread beside the pass) wait for the one reading rather than take another.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from gpu_tune.gpu.base import GpuBackend, GpuInfo


class PassReadings:
    """A :class:`~gpu_tune.gpu.base.GpuBackend` that reads its backend once per pass."""

    def __init__(self, backend: GpuBackend) -> None:
        self.backend = backend
        self._lock = threading.Lock()
        self._pass = 0
        self._kept: dict[Any, tuple[int, bool, Any]] = {}  # key -> (pass, ok, value or the error)

    # what the backend says of itself
    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def reason(self) -> str:
        return self.backend.reason

    @reason.setter
    def reason(self, value: str) -> None:
        self.backend.reason = value

    def __getattr__(self, name: str) -> Any:  # the backend's own extras (a fixture's path, ...)
        if name == "backend":
            raise AttributeError(name)
        return getattr(self.backend, name)

    def next_pass(self) -> None:
        """Start a new pass: the next ask reads again. Never waits (a stuck reading keeps its lock)."""
        self._pass += 1

    def _once(self, key: Any, read: Callable[[], Any]) -> Any:
        with self._lock:
            now = self._pass
            kept = self._kept.get(key)
            if kept is None or kept[0] != now:
                try:
                    kept = (now, True, read())
                except Exception as exc:  # the pass's answer: asked again, it fails the same way
                    kept = (now, False, exc)
                self._kept[key] = kept
        if not kept[1]:
            raise kept[2]
        return kept[2]

    def gpus(self) -> list[GpuInfo]:
        return list(self._once("gpus", self.backend.gpus))

    def cpu_affinity(self, index: int) -> frozenset[int] | None:
        return self._once(("cpu_affinity", index), lambda: self.backend.cpu_affinity(index))

    def driver_version(self) -> str | None:
        return self._once("driver_version", self.backend.driver_version)

    def cuda_driver_version(self) -> str | None:
        return self._once("cuda_driver_version", self.backend.cuda_driver_version)

    def processes(self, index: int) -> list[int]:
        return self.backend.processes(index)

    def set_persistence_mode(self, index: int, enabled: bool) -> None:
        try:
            self.backend.set_persistence_mode(index, enabled)
        finally:
            self.next_pass()  # what was read before the write is not what the GPU is now

    def close(self) -> None:
        self.backend.close()
