"""How one NVML reading fails: alone, for one GPU (docs/health.md "When a reading is missing").

``nv`` is the ``pynvml`` module the NVML backend imported (this module imports nothing of NVML's
itself). nvidia-ml-py names its exception classes after ``nvml.h``'s return codes through
``string.capwords`` (``NVML_ERROR_GPU_IS_LOST`` -> ``NVMLError_GpuIsLost``): :func:`error_kind`
matches on the return code the exception carries, so a class name can never be misspelt.

A reading (:meth:`Readings.read`) ends one of four ways:

- a value;
- ``None`` without a word: the GPU, the driver or the binding does not have it (``NOT_SUPPORTED``,
  ``FUNCTION_NOT_FOUND``, ``ARGUMENT_VERSION_MISMATCH``, a binding without the function);
- ``None``, with "not read: <why>" kept in :attr:`Readings.unread` under the reading's name: any
  other answer (``NO_PERMISSION``, ``UNKNOWN``, ``TIMEOUT``, ...), or a value NVML cannot hold (a
  link state outside its enum, a temperature of 2^32-1 C: :meth:`Readings.within`). That is the
  reading's fault, for that GPU: it is reported by a warning check and never fails the GPU;
- :class:`GpuGone`: the GPU's own answer that it is lost (``GPU_IS_LOST``) or needs a reset
  (``RESET_REQUIRED``). Only these end the GPU's reading; the backend records them for that GPU.
"""

from __future__ import annotations

from typing import Any, Callable

# nvml.h return codes (nvmlReturn_t)
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_GPU_NOT_FOUND = 28

KINDS = {
    NVML_ERROR_GPU_IS_LOST: "lost",
    NVML_ERROR_RESET_REQUIRED: "reset_required",
    NVML_ERROR_NOT_SUPPORTED: "not_supported",
    NVML_ERROR_FUNCTION_NOT_FOUND: "not_supported",  # the driver's library predates the call
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH: "not_supported",  # the driver predates the struct's version
    NVML_ERROR_NO_PERMISSION: "no_permission",
    NVML_ERROR_NOT_FOUND: "not_found",
    NVML_ERROR_GPU_NOT_FOUND: "not_found",
    NVML_ERROR_INVALID_ARGUMENT: "invalid_argument",
    NVML_ERROR_CORRUPTED_INFOROM: "corrupted_inforom",
}

# the answers that are the GPU's own state, not one reading's
GPU_STATES = frozenset({"lost", "reset_required"})


def error_code(exc: BaseException) -> int | None:
    v = getattr(exc, "value", None)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def error_kind(exc: BaseException) -> str:
    """lost | reset_required | not_supported | no_permission | not_found | invalid_argument |
    corrupted_inforom | error."""
    return KINDS.get(error_code(exc), "error")  # type: ignore[arg-type]


def error_text(exc: BaseException) -> str:
    """NVML's words and the return code's name: ``Insufficient Permissions (NVML_ERROR_NO_PERMISSION)``."""
    code = error_code(exc)
    try:
        words = str(exc)
    except Exception:  # noqa: BLE001 - a binding whose __str__ fails still has a code
        words = ""
    name = _CODE_NAMES.get(code) if code is not None else None
    if name is None and code is not None:
        name = f"NVML error {code}"
    if words and name and name not in words:
        return f"{words} ({name})"
    return words or name or type(exc).__name__


_CODE_NAMES = {
    1: "NVML_ERROR_UNINITIALIZED", 2: "NVML_ERROR_INVALID_ARGUMENT", 3: "NVML_ERROR_NOT_SUPPORTED",
    4: "NVML_ERROR_NO_PERMISSION", 6: "NVML_ERROR_NOT_FOUND", 7: "NVML_ERROR_INSUFFICIENT_SIZE",
    9: "NVML_ERROR_DRIVER_NOT_LOADED", 10: "NVML_ERROR_TIMEOUT", 12: "NVML_ERROR_LIBRARY_NOT_FOUND",
    13: "NVML_ERROR_FUNCTION_NOT_FOUND", 14: "NVML_ERROR_CORRUPTED_INFOROM", 15: "NVML_ERROR_GPU_IS_LOST",
    16: "NVML_ERROR_RESET_REQUIRED", 17: "NVML_ERROR_OPERATING_SYSTEM", 18: "NVML_ERROR_LIB_RM_VERSION_MISMATCH",
    20: "NVML_ERROR_MEMORY", 21: "NVML_ERROR_NO_DATA", 25: "NVML_ERROR_ARGUMENT_VERSION_MISMATCH",
    27: "NVML_ERROR_NOT_READY", 28: "NVML_ERROR_GPU_NOT_FOUND", 29: "NVML_ERROR_INVALID_STATE",
    999: "NVML_ERROR_UNKNOWN",
}


class GpuGone(Exception):
    """The GPU itself answered that it is lost or needs a reset: its reading ends here."""

    def __init__(self, kind: str, reading: str, exc: BaseException) -> None:
        super().__init__(f"{reading}: {error_text(exc)}")
        self.kind = kind
        self.reading = reading
        self.text = error_text(exc)


class Readings:
    """The readings of one GPU in one pass; each fails alone (see the module's text)."""

    def __init__(self, nv: Any) -> None:
        self.nv = nv
        self.unread: dict[str, str] = {}

    def call(self, reading: str, name: str, *args: Any) -> Any:
        """``pynvml.<name>(*args)`` as the reading ``reading``."""
        fn = getattr(self.nv, name, None)
        if fn is None:
            return None  # this nvidia-ml-py has no such call
        return self.read(reading, lambda: fn(*args))

    def read(self, reading: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except self.nv.NVMLError as exc:
            return self.failed(reading, exc)

    def failed(self, reading: str, exc: BaseException) -> None:
        """What a failed reading leaves: raises :class:`GpuGone` for the GPU's own state."""
        kind = error_kind(exc)
        if kind in GPU_STATES:
            raise GpuGone(kind, reading, exc) from None
        if kind != "not_supported":
            self.unread.setdefault(reading, f"not read: {error_text(exc)}")
        return None

    def note(self, reading: str, why: str) -> None:
        self.unread.setdefault(reading, f"not read: {why}")

    def within(self, reading: str, value: Any, low: int, high: int, what: str) -> Any:
        """``value`` when NVML's answer is a number from ``low`` to ``high``; else None, and the
        reading is "not read" (a value NVML cannot hold: its own all-ones "not available", a
        temperature of 4.29e9 C) rather than a fault of the GPU."""
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
            return value
        na = " (NVML's \"not available\")" if value in NOT_AVAILABLE else ""
        self.note(reading, f"{value}{na} is not {what} ({low} to {high})")
        return None


# nvml.h NVML_VALUE_NOT_AVAILABLE_uint / _ulonglong: all ones
NOT_AVAILABLE = frozenset({2**32 - 1, 2**64 - 1})
