"""The fixture GPU backend: GPUs described by a JSON file (``--gpu-fixture FILE``, docs/cli.md).

Unknown extra keys are ignored. A missing required key (``index``, ``uuid``, ``name``,
``pci_bus_id``) or malformed JSON is an :class:`InputError` naming the file (and line). Optional
per-GPU keys (docs/cli.md lists them too): ``"lost": true`` (the GPU answers "GPU is lost"),
``"processes": [pids]``, ``"cpu_affinity": "0-55"`` (what NVML would say is local) and
``"mig_mode"`` / ``"mig_mode_pending"`` (booleans, NVML's current and pending MIG mode; absent:
the GPU has no MIG).

Persistence mode set through this backend is written back into the same file crash-safely
(temp file, fsync, rename, fsync of the folder), so a later run sees it as on real hardware; a
temp file that a killed write left is removed by the next load or write of the file.
"""

from __future__ import annotations

import json
import math
import re
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from gpu_tune.errors import InputError
from gpu_tune.host.parse import ParseError, nesting, parse_cpulist
from gpu_tune.gpu.base import Fabric, GpuError, GpuInfo, NvLink, RemappedRows, SramEcc

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
    "pcie_link_gen_current": _INT, "pcie_link_gen_max": _INT, "pcie_link_gen_gpu_max": _INT,
    "pcie_link_width_current": _INT, "pcie_link_width_max": _INT, "ecc_uncorrected_volatile": _INT, "temperature_c": _NUM,
    "power_w": _NUM, "utilization_percent": _NUM,
    "reset_required": (bool,), "inforom_valid": (bool,), "pcie_replay_count": _INT,
    "sm_clock_mhz": _INT, "sm_clock_max_mhz": _INT,
}
RECOVERY_ACTIONS = ("none", "reset", "reboot", "drain_p2p", "drain_and_reset", "recover_imex_domain", "bus_reset",
                    "system_reboot")
FABRIC_SUMMARIES = ("healthy", "unhealthy", "limited_capacity")
FABRIC_STATES = ("not_supported", "not_started", "in_progress", "completed")
# The health readings that are objects or lists: key -> {member: types}
_MEMBERS: dict[str, dict[str, tuple[type, ...]]] = {
    "remapped_rows": {"correctable": _INT, "uncorrectable": _INT, "pending": (bool,), "failure": (bool,)},
    "sram_ecc": {"uncorrected": _INT, "threshold_exceeded": (bool,)},
    "fabric": {"state": (str,), "status": (str,), "summary": (str,)},
}
_REQUIRED_MEMBERS = {"fabric": ("state",)}
_NVLINK_MEMBERS = {"link": _INT, "active": (bool,), "crc_errors": _INT, "replay_errors": _INT,
                   "recovery_errors": _INT}
_BUS_ID = re.compile(r"([0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")
_CC = re.compile(r"[0-9]{1,2}\.[0-9]{1,2}")

# What a real GPU can report (inclusive ranges, or the allowed values): a fixture describes
# hardware, so a value no GPU could have is bad input, not a GPU to judge.
MAX_GPU_INDEX = 1023
MAX_MEMORY_MIB = 16 * 1024 * 1024  # 16 TiB
PID_MAX = 4194304  # the kernel's PID_MAX_LIMIT
_RANGES: dict[str, tuple[float, float]] = {
    "memory_total_mib": (1, MAX_MEMORY_MIB), "memory_used_mib": (0, MAX_MEMORY_MIB),
    "pcie_link_gen_current": (1, 7), "pcie_link_gen_max": (1, 7), "pcie_link_gen_gpu_max": (1, 7),
    "ecc_uncorrected_volatile": (0, 2**63 - 1), "temperature_c": (0, 150), "power_w": (0, 10_000),
    "utilization_percent": (0, 100), "pcie_replay_count": (0, 2**63 - 1), "sm_clock_mhz": (0, 100_000),
    "sm_clock_max_mhz": (0, 100_000),
}
PCIE_WIDTHS = (1, 2, 4, 8, 12, 16, 32)
MAX_DEPTH = 32
MAX_VALUES = 1_000_000
MAX_FILE_BYTES = 16 << 20


def _no_constant(name: str):
    raise ValueError(f"{name} is not a finite number")


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"{text[:40]} is not a finite number")
    return v


def _check_types(p: Path, i: int, g: dict[str, Any]) -> None:
    for key, types in _TYPES.items():
        v = g.get(key)
        if v is None:
            continue
        ok = isinstance(v, types) and (bool in types or not isinstance(v, bool))
        if not ok:
            want = "/".join("integer" if t is int else "number" if t is float else t.__name__ for t in types)
            raise InputError(f"{p}: gpus[{i}].{key}: expected {want}, got {v!r}")
    _check_health(p, i, g)
    for key, item in (("clock_throttle_reasons", str), ("clock_event_reasons", str), ("xid_events", int),
                      ("processes", int)):
        v = g.get(key)
        if v is None:
            continue
        if not isinstance(v, list) or not all(isinstance(x, item) and not isinstance(x, bool) for x in v):
            kind = "strings" if item is str else "integers"
            raise InputError(f"{p}: gpus[{i}].{key}: expected a list of {kind}, got {v!r}")
    for key, (lo, hi) in _RANGES.items():
        v = g.get(key)
        if v is not None and not lo <= v <= hi:
            raise InputError(f"{p}: gpus[{i}].{key}: {v!r} is out of range {lo}..{hi}")
    for key in ("pcie_link_width_current", "pcie_link_width_max"):
        v = g.get(key)
        if v is not None and v not in PCIE_WIDTHS:
            raise InputError(f"{p}: gpus[{i}].{key}: {v!r} is not a PCIe link width "
                             f"({', '.join(map(str, PCIE_WIDTHS))})")
    total, used = g.get("memory_total_mib"), g.get("memory_used_mib")
    if total is not None and used is not None and used > total:
        raise InputError(f"{p}: gpus[{i}].memory_used_mib: {used} is more than memory_total_mib {total}")
    for key, lo, hi in (("processes", 1, PID_MAX), ("xid_events", 0, 2**32 - 1)):
        bad = [x for x in g.get(key) or () if not lo <= x <= hi]
        if bad:
            raise InputError(f"{p}: gpus[{i}].{key}: {bad[0]!r} is out of range {lo}..{hi}")
    cc = g.get("compute_capability")
    if cc is not None and not _CC.fullmatch(cc):
        raise InputError(f"{p}: gpus[{i}].compute_capability: {cc!r} is not a compute capability (e.g. 9.0)")
    if not _BUS_ID.fullmatch(g["pci_bus_id"]):
        raise InputError(f"{p}: gpus[{i}].pci_bus_id: {g['pci_bus_id']!r} is not a PCI bus id "
                         "(expected e.g. 0000:18:00.0)")


def _typed(v: Any, types: tuple[type, ...]) -> bool:
    return isinstance(v, types) and (bool in types or not isinstance(v, bool))


def _want(types: tuple[type, ...]) -> str:
    return "/".join("integer" if t is int else "number" if t is float else "boolean" if t is bool
                    else "string" if t is str else t.__name__ for t in types)


def _check_health(p: Path, i: int, g: dict[str, Any]) -> None:
    """The health readings' shapes (docs/health.md): a wrong one is bad input naming the key."""
    at = f"{p}: gpus[{i}]"
    ra = g.get("recovery_action")
    if ra is not None and ra not in RECOVERY_ACTIONS:
        raise InputError(f"{at}.recovery_action: {ra!r} is not one of {', '.join(RECOVERY_ACTIONS)}")
    for key, members in _MEMBERS.items():
        v = g.get(key)
        if v is None:
            continue
        if not isinstance(v, dict):
            raise InputError(f"{at}.{key}: expected an object with {', '.join(members)}, got {v!r}")
        for m in _REQUIRED_MEMBERS.get(key, ()):
            if v.get(m) is None:
                raise InputError(f"{at}.{key}: missing required key {m!r}")
        for m, val in v.items():
            if m in members and val is not None and not _typed(val, members[m]):
                raise InputError(f"{at}.{key}.{m}: expected {_want(members[m])}, got {val!r}")
            if isinstance(val, int) and not isinstance(val, bool) and val < 0:
                raise InputError(f"{at}.{key}.{m}: {val!r} is negative")
    fab = g.get("fabric")
    if isinstance(fab, dict) and fab.get("state") is not None and fab["state"] not in FABRIC_STATES:
        raise InputError(f"{at}.fabric.state: {fab['state']!r} is not one of {', '.join(FABRIC_STATES)}")
    if isinstance(fab, dict) and fab.get("summary") is not None and fab["summary"] not in FABRIC_SUMMARIES:
        raise InputError(f"{at}.fabric.summary: {fab['summary']!r} is not one of {', '.join(FABRIC_SUMMARIES)}")
    health = fab.get("health") if isinstance(fab, dict) else None
    if health is not None and (not isinstance(health, list) or not all(isinstance(x, str) and x for x in health)):
        raise InputError(f"{at}.fabric.health: expected a list of fault names (e.g. [\"degraded_bandwidth\"]), "
                         f"got {health!r}")
    unread = g.get("unread")
    if unread is not None and (not isinstance(unread, dict)
                               or not all(isinstance(k, str) and isinstance(x, str) for k, x in unread.items())):
        raise InputError(f"{at}.unread: expected an object of reading -> why it was not read, got {unread!r}")
    links = g.get("nvlink")
    if links is not None:
        if not isinstance(links, list):
            raise InputError(f"{at}.nvlink: expected a list of links, got {links!r}")
        for j, link in enumerate(links):
            if not isinstance(link, dict) or "link" not in link or "active" not in link:
                raise InputError(f"{at}.nvlink[{j}]: expected an object with link and active")
            for m, val in link.items():
                if m in _NVLINK_MEMBERS and val is not None and not _typed(val, _NVLINK_MEMBERS[m]):
                    raise InputError(f"{at}.nvlink[{j}].{m}: expected {_want(_NVLINK_MEMBERS[m])}, got {val!r}")
    p2p = g.get("nvlink_p2p")
    if p2p is not None:
        if not isinstance(p2p, dict) or not all(isinstance(v, bool) for v in p2p.values()):
            raise InputError(f"{at}.nvlink_p2p: expected an object of peer bus id -> true/false, got {p2p!r}")
        for peer in p2p:
            if not _BUS_ID.fullmatch(peer):
                raise InputError(f"{at}.nvlink_p2p: {peer!r} is not a PCI bus id (expected e.g. 0000:29:00.0)")


def _normalize_bus_id(bus_id: str) -> str:
    from gpu_tune.host.parse import normalize_bus_id

    return normalize_bus_id(bus_id)


def _health(g: dict[str, Any]) -> dict[str, Any]:
    """The health readings of a fixture entry as :class:`GpuInfo` values."""
    out: dict[str, Any] = {}
    for key, cls in (("remapped_rows", RemappedRows), ("sram_ecc", SramEcc), ("fabric", Fabric)):
        v = g.get(key)
        if isinstance(v, dict):
            names = {f.name for f in fields(cls)}
            kw = {k: x for k, x in v.items() if k in names}
            if key == "fabric":
                kw["health"] = tuple(kw.get("health") or ())
            out[key] = cls(**kw)
    if isinstance(g.get("unread"), dict):
        out["unread"] = tuple(sorted((str(k), f"not read: {x}") for k, x in g["unread"].items()))
    if isinstance(g.get("nvlink"), list):
        names = {f.name for f in fields(NvLink)}
        out["nvlink"] = tuple(NvLink(**{k: x for k, x in link.items() if k in names}) for link in g["nvlink"])
    if isinstance(g.get("nvlink_p2p"), dict):
        out["nvlink_p2p"] = tuple((_normalize_bus_id(k), bool(v)) for k, v in g["nvlink_p2p"].items())
    return out


class FixtureBackend:
    name = "fixture"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.reason = f"--gpu-fixture {self.path}"
        self._data = self._load()

    # -- loading --------------------------------------------------------------------------------
    def _load(self) -> dict[str, Any]:
        from gpu_tune.host.files import read_local_file, remove_stale_temporaries
        from gpu_tune.strict import BadText, DuplicateKey, check_text, json_loads

        p = self.path
        try:  # what a write killed before its rename left beside the file
            remove_stale_temporaries(p)
        except OSError:
            pass  # a folder that cannot be listed: the read below says what is wrong, if anything
        try:
            text = read_local_file(p, MAX_FILE_BYTES, "GPU fixture").decode("utf-8")
        except FileNotFoundError:
            raise InputError(f"--gpu-fixture {p}: no such file") from None
        except IsADirectoryError:
            raise InputError(f"--gpu-fixture {p}: is a directory, expected a JSON file") from None
        except UnicodeDecodeError as exc:
            raise InputError(f"--gpu-fixture {p}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} "
                             f"at offset {exc.start})") from None
        except OSError as exc:
            raise InputError(f"--gpu-fixture {p}: cannot read: {exc.strerror or exc}") from None
        except ValueError as exc:  # a NUL byte in the path
            raise InputError(f"--gpu-fixture {str(p)[:200]!r}: not a file name: {exc}") from None
        too_deep = InputError(f"{p}: JSON nested too deep for a GPU fixture (at most {MAX_DEPTH} levels)")
        try:
            data = json_loads(text, parse_constant=_no_constant, parse_float=_finite)
        except DuplicateKey as exc:
            raise InputError(f"{p}:{exc.second}: {exc}: a key is given once") from None
        except json.JSONDecodeError as exc:
            raise InputError(f"{p}:{exc.lineno}:{exc.colno}: malformed JSON: {exc.msg}") from None
        except ValueError as exc:  # NaN / Infinity, or an integer of more than 4,300 digits
            raise InputError(f"{p}: malformed JSON: {str(exc).splitlines()[0][:120]}") from None
        except RecursionError:
            raise too_deep from None
        depth, nodes = nesting(data, MAX_DEPTH, MAX_VALUES)
        if depth > MAX_DEPTH:
            raise too_deep
        if nodes > MAX_VALUES:
            raise InputError(f"{p}: more than {MAX_VALUES:,} values: too large for a GPU fixture")
        try:
            check_text(data)
        except BadText as exc:
            raise InputError(f"{p}: {exc}") from None
        if not isinstance(data, dict):
            raise InputError(f"{p}: expected a JSON object with a \"gpus\" list")
        gpus = data.get("gpus", [])
        if not isinstance(gpus, list):
            raise InputError(f"{p}: gpus: expected a list")
        seen: set[int] = set()
        owners: dict[tuple[str, str], int] = {}  # (key, value) -> the entry that has it
        for i, g in enumerate(gpus):
            if not isinstance(g, dict):
                raise InputError(f"{p}: gpus[{i}]: expected an object")
            for key in REQUIRED:
                if key not in g:
                    raise InputError(f"{p}: gpus[{i}]: missing required key {key!r}")
            if not isinstance(g["index"], int) or isinstance(g["index"], bool) or not 0 <= g["index"] <= MAX_GPU_INDEX:
                raise InputError(f"{p}: gpus[{i}].index: expected an integer 0..{MAX_GPU_INDEX}, got {g['index']!r}")
            if g["index"] in seen:
                raise InputError(f"{p}: gpus[{i}].index: GPU index {g['index']} appears twice")
            seen.add(g["index"])
            for key in ("uuid", "name", "pci_bus_id"):
                if not isinstance(g[key], str) or not g[key]:
                    raise InputError(f"{p}: gpus[{i}].{key}: expected a non-empty string")
                if not g[key].isprintable():  # what NVML says is plain text
                    raise InputError(f"{p}: gpus[{i}].{key}: {g[key][:60]!r} holds a control character")
            _check_types(p, i, g)
            for key, value in (("uuid", g["uuid"].strip().lower()), ("pci_bus_id", _normalize_bus_id(g["pci_bus_id"]))):
                j = owners.setdefault((key, value), i)
                if j != i:
                    raise InputError(f"{p}: gpus[{i}].{key}: {g[key]!r} is also gpus[{j}]'s: "
                                     f"two GPUs cannot share a {'uuid' if key == 'uuid' else 'PCI bus id'}")
            aff = g.get("cpu_affinity")
            if aff is not None:
                try:
                    parse_cpulist(str(aff))
                except (ParseError, ValueError) as exc:
                    raise InputError(f"{p}: gpus[{i}].cpu_affinity: not a CPU list: {str(aff)[:60]!r}: {exc}") from None
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
            kw["clock_throttle_reasons"] = tuple(g.get("clock_event_reasons", g.get("clock_throttle_reasons")) or ())
            kw["xid_events"] = tuple(int(x) for x in (g.get("xid_events") or ()))
            kw.update(_health(g))
            extra = {k: v for k, v in g.items() if k not in _FIELDS and k != "clock_event_reasons"}
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
        from gpu_tune.host.files import atomic_write

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
