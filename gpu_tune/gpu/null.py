"""The null GPU backend: a host without NVIDIA GPUs or driver (``--gpu-backend none``, docs/cli.md)."""

from __future__ import annotations

from gpu_tune.gpu.base import GpuError, GpuInfo


class NullBackend:
    name = "none"

    def __init__(self, reason: str = "--gpu-backend none") -> None:
        self.reason = reason

    def driver_version(self) -> str | None:
        return None

    def cuda_driver_version(self) -> str | None:
        return None

    def gpus(self) -> list[GpuInfo]:
        return []

    def set_persistence_mode(self, index: int, enabled: bool) -> None:
        raise GpuError(f"GPU {index}: no NVIDIA GPU/driver on this host", "not_supported")

    def processes(self, index: int) -> list[int]:
        return []

    def cpu_affinity(self, index: int) -> frozenset[int] | None:
        return None

    def close(self) -> None:
        pass
