"""The fixture GPU backend: GPUs described by a JSON file (CONTRACT §2 ``--gpu-fixture FILE``).

Unknown extra keys are ignored. A missing required key (``index``, ``uuid``, ``name``,
``pci_bus_id``) or malformed JSON is an :class:`InputError` naming the file (and line). Optional
per-GPU keys beyond the contract's: ``"lost": true`` (the GPU answers "GPU is lost"),
``"processes": [pids]``, ``"cpu_affinity": "0-55"`` (what NVML would say is local) and
``"mig_mode"`` / ``"mig_mode_pending"`` (booleans, NVML's current and pending MIG mode; absent:
the GPU has no MIG).

Persistence mode set through this backend is written back into the same file crash-safely
(temp file, fsync, rename, fsync of the folder), so a later run sees it as on real hardware.
"""

from __future__ import annotations

import json
import re
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..parse import ParseError, parse_cpulist
from .base import GpuError, GpuInfo

REQUIRED = ("index", "uuid", "name", "pci_bus_id")
_FIELDS = {f.name for f in fields(GpuInfo)} - {"extra", "error", "error_kind"}

# Optional per-GPU keys and the JSON types they must have (checked when the file loads, so a
# wrong type is bad input naming the key, not a failure later in every pass).
_INT = (int,)
_NUM = (int, float)
_TYPES: dict[str, tuple[type, ...]] = {
    "memory_total_mib": _INT, "memory_used_mib": _INT, "compute_capability": (str,),
    "persistence_mode": (bool,), "ecc_mode": (bool,), "retired_pages_pending": (bool,), "lost": (bool,),
    "mig_mode": (bool,), "mig_mode_pending": (bool,),
    "pcie_link_gen_current": _INT, "pcie_link_gen_max": _INT, "pcie_link_width_current": _INT,
    "pcie_link_width_max": _INT, "ecc_uncorrected_volatile": _INT, "temperature_c": _NUM,
    "power_w": _NUM, "utilization_percent": _NUM,
}
_BUS_ID = re.compile(r"^([0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


def _check_types(p: Path, i: int, g: dict[str, Any]) -> None:
    for key, types in _TYPES.items():
        v = g.get(key)
        if v is None:
            continue
        ok = isinstance(v, types) and (bool in types or not isinstance(v, bool))
        if not ok:
            want = "/".join("integer" if t is int else "number" if t is float else t.__name__ for t in types)
            raise InputError(f"{p}: gpus[{i}].{key}: expected {want}, got {v!r}")
    for key, item in (("clock_throttle_reasons", str), ("xid_events", int), ("processes", int)):
        v = g.get(key)
        if v is None:
            continue
        if not isinstance(v, list) or not all(isinstance(x, item) and not isinstance(x, bool) for x in v):
            kind = "strings" if item is str else "integers"
            raise InputError(f"{p}: gpus[{i}].{key}: expected a list of {kind}, got {v!r}")
    if not _BUS_ID.match(g["pci_bus_id"]):
        raise InputError(f"{p}: gpus[{i}].pci_bus_id: {g['pci_bus_id']!r} is not a PCI bus id "
                         "(expected e.g. 0000:18:00.0)")


def _normalize_bus_id(bus_id: str) -> str:
    from ..topology import normalize_bus_id

    return normalize_bus_id(bus_id)


class FixtureBackend:
    name = "fixture"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.reason = f"--gpu-fixture {self.path}"
        self._data = self._load()

    # -- loading --------------------------------------------------------------------------------
    def _load(self) -> dict[str, Any]:
        p = self.path
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise InputError(f"--gpu-fixture {p}: no such file") from None
        except IsADirectoryError:
            raise InputError(f"--gpu-fixture {p}: is a directory, expected a JSON file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"--gpu-fixture {p}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"{p}:{exc.lineno}:{exc.colno}: malformed JSON: {exc.msg}") from None
        if not isinstance(data, dict):
            raise InputError(f"{p}: expected a JSON object with a \"gpus\" list")
        gpus = data.get("gpus", [])
        if not isinstance(gpus, list):
            raise InputError(f"{p}: gpus: expected a list")
        seen: set[int] = set()
        for i, g in enumerate(gpus):
            if not isinstance(g, dict):
                raise InputError(f"{p}: gpus[{i}]: expected an object")
            for key in REQUIRED:
                if key not in g:
                    raise InputError(f"{p}: gpus[{i}]: missing required key {key!r}")
            if not isinstance(g["index"], int) or isinstance(g["index"], bool) or g["index"] < 0:
                raise InputError(f"{p}: gpus[{i}].index: expected a non-negative integer, got {g['index']!r}")
            if g["index"] in seen:
                raise InputError(f"{p}: gpus[{i}].index: GPU index {g['index']} appears twice")
            seen.add(g["index"])
            for key in ("uuid", "name", "pci_bus_id"):
                if not isinstance(g[key], str) or not g[key]:
                    raise InputError(f"{p}: gpus[{i}].{key}: expected a non-empty string")
            _check_types(p, i, g)
            aff = g.get("cpu_affinity")
            if aff is not None:
                try:
                    parse_cpulist(str(aff))
                except (ParseError, ValueError):
                    raise InputError(f"{p}: gpus[{i}].cpu_affinity: not a CPU list: {aff!r}") from None
        return data

    def _gpu(self, index: int) -> dict[str, Any]:
        for g in self._data.get("gpus", []):
            if g["index"] == index:
                return g
        raise GpuError(f"GPU {index}: no such GPU in {self.path}", "not_found")

    # -- GpuBackend -----------------------------------------------------------------------------
    def driver_version(self) -> str | None:
        v = self._data.get("driver_version")
        return str(v) if v is not None else None

    def cuda_driver_version(self) -> str | None:
        v = self._data.get("cuda_driver_version")
        return str(v) if v is not None else None

    def gpus(self) -> list[GpuInfo]:
        out = []
        for g in sorted(self._data.get("gpus", []), key=lambda g: g["index"]):
            kw: dict[str, Any] = {k: v for k, v in g.items() if k in _FIELDS}
            kw["pci_bus_id"] = _normalize_bus_id(g["pci_bus_id"])
            kw["clock_throttle_reasons"] = tuple(g.get("clock_throttle_reasons") or ())
            kw["xid_events"] = tuple(int(x) for x in (g.get("xid_events") or ()))
            extra = {k: v for k, v in g.items() if k not in _FIELDS}
            if g.get("lost"):
                keep = {k: kw[k] for k in REQUIRED}
                out.append(GpuInfo(**keep, error="GPU is lost", error_kind="lost", extra=extra))
                continue
            try:
                out.append(GpuInfo(**kw, extra=extra))
            except TypeError as exc:
                raise InputError(f"{self.path}: gpus[index={g['index']}]: {exc}") from None
        return out

    def set_persistence_mode(self, index: int, enabled: bool) -> None:
        g = self._gpu(index)
        if g.get("lost"):
            raise GpuError(f"GPU {index}: GPU is lost", "lost")
        g["persistence_mode"] = bool(enabled)
        self._write()

    def processes(self, index: int) -> list[int]:
        return [int(p) for p in self._gpu(index).get("processes") or []]

    def cpu_affinity(self, index: int) -> frozenset[int] | None:
        aff = self._gpu(index).get("cpu_affinity")
        return parse_cpulist(str(aff)) if aff is not None else None

    def close(self) -> None:
        pass

    # -- writing back ---------------------------------------------------------------------------
    def _write(self) -> None:
        from ..hostfs import atomic_write

        data = (json.dumps(self._data, indent=2) + "\n").encode()
        p = self.path
        try:
            mode = p.stat().st_mode & 0o7777
        except OSError:
            mode = 0o644
        try:
            atomic_write(p, data, mode)
        except OSError as exc:
            raise GpuError(f"cannot write {p}: {exc.strerror or exc}", "error") from None
