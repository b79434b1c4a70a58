"""The CUDA runtime through ``ctypes``: the few calls the probe's data-path measurement makes.

The library is ``libcudart.so.12``, from the ``nvidia-cuda-runtime-cu12`` wheel that
``gpu-tune[gpu]`` (TensorFlow's ``and-cuda`` extra) installs, so nothing is compiled at run time
and no binding package is needed. It is looked up by its soname first (the loader's path,
``LD_LIBRARY_PATH``), then in the wheel's folder (``site-packages/nvidia/cuda_runtime/lib``),
then under the unversioned name; ``GPU_TUNE_CUDART`` names a file to use instead.

:class:`Runtime` wraps the library object (a ``ctypes.CDLL``, or any object with the same
functions: the tests give it a fake) and turns every non-zero ``cudaError_t`` into
:class:`CudaError` with the call, the code and the runtime's own words for it.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path
from typing import Any

SONAME = "libcudart.so.12"
ENV_LIBRARY = "GPU_TUNE_CUDART"

# cudaMemcpyKind
HOST_TO_DEVICE = 1
DEVICE_TO_HOST = 2
DEVICE_TO_DEVICE = 3
KIND_NAMES = {HOST_TO_DEVICE: "cudaMemcpyHostToDevice", DEVICE_TO_HOST: "cudaMemcpyDeviceToHost",
              DEVICE_TO_DEVICE: "cudaMemcpyDeviceToDevice"}
STREAM_NON_BLOCKING = 1  # cudaStreamNonBlocking
HOST_ALLOC_DEFAULT = 0  # cudaHostAllocDefault: page-locked, as nvbandwidth's host buffers

# cudaError_t values that mean "no usable GPU here" rather than a fault of one
NO_GPU_ERRORS = {
    35: "cudaErrorInsufficientDriver",  # no driver loaded, or one older than the runtime
    100: "cudaErrorNoDevice",
    34: "cudaErrorStubLibrary",
    999: "cudaErrorUnknown",  # what cuInit answers in some containers without the device nodes
}

_VP = ctypes.c_void_p
# name -> (argtypes, restype); every call returns cudaError_t (int) except cudaGetErrorString
SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "cudaGetErrorString": ([ctypes.c_int], ctypes.c_char_p),
    "cudaRuntimeGetVersion": ([ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
    "cudaDriverGetVersion": ([ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
    "cudaGetDeviceCount": ([ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
    "cudaSetDevice": ([ctypes.c_int], ctypes.c_int),
    "cudaDeviceReset": ([], ctypes.c_int),
    "cudaHostAlloc": ([ctypes.POINTER(_VP), ctypes.c_size_t, ctypes.c_uint], ctypes.c_int),
    "cudaFreeHost": ([_VP], ctypes.c_int),
    "cudaMalloc": ([ctypes.POINTER(_VP), ctypes.c_size_t], ctypes.c_int),
    "cudaFree": ([_VP], ctypes.c_int),
    "cudaStreamCreateWithFlags": ([ctypes.POINTER(_VP), ctypes.c_uint], ctypes.c_int),
    "cudaStreamDestroy": ([_VP], ctypes.c_int),
    "cudaEventCreate": ([ctypes.POINTER(_VP)], ctypes.c_int),
    "cudaEventDestroy": ([_VP], ctypes.c_int),
    "cudaEventRecord": ([_VP, _VP], ctypes.c_int),
    "cudaEventSynchronize": ([_VP], ctypes.c_int),
    "cudaEventElapsedTime": ([ctypes.POINTER(ctypes.c_float), _VP, _VP], ctypes.c_int),
    "cudaMemcpyAsync": ([_VP, _VP, ctypes.c_size_t, ctypes.c_int, _VP], ctypes.c_int),
}


class CudartUnavailable(Exception):
    """The CUDA runtime library cannot be loaded here."""


class CudaError(Exception):
    """A CUDA runtime call returned an error: ``call``, ``code`` and the runtime's words."""

    def __init__(self, call: str, code: int, text: str) -> None:
        super().__init__(f"{call}: {text} (cudaError {code})")
        self.call, self.code, self.text = call, code, text

    @property
    def no_gpu(self) -> bool:
        return self.code in NO_GPU_ERRORS


def candidates() -> list[str]:
    """Where the runtime is looked for, in order."""
    out = []
    env = os.environ.get(ENV_LIBRARY)
    if env:
        return [env]
    out.append(SONAME)
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        lib = Path(folder) / "cuda_runtime" / "lib" / SONAME
        if lib.is_file():
            out.append(str(lib))
    out.append("libcudart.so")
    return out


def load(path: str | None = None) -> ctypes.CDLL:
    """The runtime library with its functions' signatures set; :class:`CudartUnavailable` when
    none of :func:`candidates` loads."""
    errors = []
    for name in [path] if path else candidates():
        try:
            lib = ctypes.CDLL(name)
        except OSError as exc:
            errors.append(f"{name}: {exc}")
            continue
        try:
            for fn, (argtypes, restype) in SIGNATURES.items():
                f = getattr(lib, fn)
                f.argtypes, f.restype = argtypes, restype
        except AttributeError as exc:
            errors.append(f"{name}: not a CUDA runtime ({exc})")
            continue
        return lib
    raise CudartUnavailable(f"the CUDA runtime ({SONAME}, from nvidia-cuda-runtime-cu12) is not loadable here: "
                            + "; ".join(errors))


class Runtime:
    """The calls the measurement makes, each checked. ``lib``: the loaded library (or a fake)."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib

    def _check(self, call: str, rc: int) -> None:
        if rc:
            try:
                raw = self.lib.cudaGetErrorString(rc)
                text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
            except Exception:  # a runtime too broken to name its own error
                text = NO_GPU_ERRORS.get(rc, "unknown error")
            raise CudaError(call, int(rc), text)

    def _out(self, call: str, ctype: Any, *args: Any) -> Any:
        box = ctype()
        self._check(call, getattr(self.lib, call)(ctypes.pointer(box), *args))
        return box.value

    def runtime_version(self) -> int:
        return int(self._out("cudaRuntimeGetVersion", ctypes.c_int))

    def driver_version(self) -> int:
        """The CUDA version the driver supports (12080 for 12.8); 0 without a driver."""
        return int(self._out("cudaDriverGetVersion", ctypes.c_int))

    def device_count(self) -> int:
        return int(self._out("cudaGetDeviceCount", ctypes.c_int))

    def set_device(self, index: int) -> None:
        self._check("cudaSetDevice", self.lib.cudaSetDevice(index))

    def device_reset(self) -> None:
        self._check("cudaDeviceReset", self.lib.cudaDeviceReset())

    def host_alloc(self, size: int) -> int:
        return int(self._out("cudaHostAlloc", _VP, size, HOST_ALLOC_DEFAULT) or 0)

    def free_host(self, ptr: int) -> None:
        self._check("cudaFreeHost", self.lib.cudaFreeHost(_VP(ptr)))

    def malloc(self, size: int) -> int:
        return int(self._out("cudaMalloc", _VP, size) or 0)

    def free(self, ptr: int) -> None:
        self._check("cudaFree", self.lib.cudaFree(_VP(ptr)))

    def stream_create(self) -> int:
        return int(self._out("cudaStreamCreateWithFlags", _VP, STREAM_NON_BLOCKING) or 0)

    def stream_destroy(self, stream: int) -> None:
        self._check("cudaStreamDestroy", self.lib.cudaStreamDestroy(_VP(stream)))

    def event_create(self) -> int:
        return int(self._out("cudaEventCreate", _VP) or 0)

    def event_destroy(self, event: int) -> None:
        self._check("cudaEventDestroy", self.lib.cudaEventDestroy(_VP(event)))

    def event_record(self, event: int, stream: int) -> None:
        self._check("cudaEventRecord", self.lib.cudaEventRecord(_VP(event), _VP(stream)))

    def event_synchronize(self, event: int) -> None:
        self._check("cudaEventSynchronize", self.lib.cudaEventSynchronize(_VP(event)))

    def elapsed_ms(self, start: int, stop: int) -> float:
        return float(self._out("cudaEventElapsedTime", ctypes.c_float, _VP(start), _VP(stop)))

    def memcpy_async(self, dst: int, src: int, size: int, kind: int, stream: int) -> None:
        self._check(f"cudaMemcpyAsync({KIND_NAMES.get(kind, kind)})",
                    self.lib.cudaMemcpyAsync(_VP(dst), _VP(src), size, kind, _VP(stream)))
