"""GPU backends (``--gpu-backend``, docs/cli.md): chosen once at start, with the reason logged once.

``auto`` picks NVML when ``libnvidia-ml.so.1`` loads (``nvmlInit`` succeeds), else the null
backend; when a ``--gpu-fixture`` file is given with ``auto``, the fixture backend is used. The
NVML and fixture backends are read once per pass (:class:`~gpu_tune.gpu.per_pass.PassReadings`).
"""

from __future__ import annotations

import logging

from gpu_tune.errors import InputError
from gpu_tune.gpu.base import GpuBackend, GpuError, GpuInfo

log = logging.getLogger("gpu_tune")

BACKENDS = ("auto", "nvml", "fixture", "none")


def select_backend(name: str = "auto", fixture: str | None = None) -> GpuBackend:
    """The GPU backend for ``--gpu-backend name`` (and ``--gpu-fixture fixture``)."""
    name = (name or "auto").strip().lower()
    if name not in BACKENDS:
        raise InputError(f"--gpu-backend {name!r}: expected one of {', '.join(BACKENDS)}")
    backend: GpuBackend
    if name == "fixture" or (name == "auto" and fixture):
        if not fixture:
            raise InputError("--gpu-backend fixture needs --gpu-fixture FILE (env GPU_TUNE_GPU_FIXTURE)")
        from gpu_tune.gpu.fixture import FixtureBackend

        backend = FixtureBackend(fixture)
        if name == "auto":
            backend.reason = f"auto: --gpu-fixture {fixture} given"
    elif name == "none":
        from gpu_tune.gpu.null import NullBackend

        backend = NullBackend("--gpu-backend none")
    else:
        from gpu_tune.gpu.nvml import NvmlBackend, NvmlUnavailable

        try:
            backend = NvmlBackend()
        except NvmlUnavailable as exc:
            if name == "nvml":
                raise InputError(f"--gpu-backend nvml: NVML is not usable on this host: {exc}") from None
            from gpu_tune.gpu.null import NullBackend

            backend = NullBackend(f"auto: NVML unavailable ({exc}); no NVIDIA GPU/driver")
        else:
            if name == "auto":
                backend.reason = f"auto: {backend.reason}"
    log.info("GPU backend: %s (%s)", backend.name, backend.reason)
    if backend.name == "none":
        return backend  # nothing to read
    from gpu_tune.gpu.per_pass import PassReadings

    return PassReadings(backend)


__all__ = ["BACKENDS", "GpuBackend", "GpuError", "GpuInfo", "select_backend"]
