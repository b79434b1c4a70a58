"""One evidence bundle: what it holds, gathered from this pass's readings and the host's files,
written whole (a temporary folder renamed into place, :mod:`gpu_tune.host.fs_tree`), and the
bounds kept over all of them (docs/health.md "Evidence").

A bundle (``/var/lib/gpu-tune/evidence/20261207T101502.318Z-xid-0000-5d-00-79/``: when, in UTC to
the millisecond, and the most urgent finding it is for):

- ``manifest.json``: its name, when, the node, the boot, the findings it is for (each with the
  health state's key), every file with its bytes and whether it was cut, the bounds;
- ``verdict.json``: the verdict as ``/readiness`` has it;
- ``nvml.json``: the NVML readings of the GPUs named, as the GPU backend read them this pass;
- ``pci.json``: their sysfs link files and AER counters (``{current,max}_link_{speed,width}``,
  ``aer_dev_{correctable,nonfatal,fatal}``), as the kernel wrote them, or why not;
- ``kernel-log.txt``: the kernel's records around each fault (from a minute before an XID's first
  record to half a minute after its last), those naming a GPU of the findings, and the newest;
- ``nvidia-bug-report.json``, ``nvidia-bug-report.log.gz``, ``nvidia-bug-report.out``: the
  bug report, written later by its worker (:mod:`gpu_tune.judge.evidence.bugreport`).

Each file has its cap; a bundle has one in all (``GPU_TUNE_EVIDENCE_BUNDLE_BYTES``): what is over
is cut, and the manifest (and a JSON file's own ``cut``) says how much there was.
"""

from __future__ import annotations

import json
import re
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from gpu_tune.errors import HostError
from gpu_tune.host import fs_tree
from gpu_tune.judge.checks.state_file import BUNDLE_RE, bus_key
from gpu_tune.judge.evidence import FOLDER, Settings
from gpu_tune.judge.evidence.findings import Finding, gpu_index
from gpu_tune.timestamps import format_rfc3339

MANIFEST, VERDICT, NVML, PCI, KERNEL = "manifest.json", "verdict.json", "nvml.json", "pci.json", "kernel-log.txt"
BUG_STATUS, BUG_LOG, BUG_OUT = "nvidia-bug-report.json", "nvidia-bug-report.log", "nvidia-bug-report.out"
CAPS = {VERDICT: 256 << 10, NVML: 256 << 10, PCI: 64 << 10, KERNEL: 1 << 20}
MANIFEST_CAP = 64 << 10
STATUS_CAP = 4 << 10
OUT_CAP = 1 << 20  # the bug report's own words (its stdout and stderr)
MIN_LOG_CAP = 64 << 10  # less room than this left in a bundle: the bug report is not run
PCI_FILES = ("current_link_speed", "current_link_width", "max_link_speed", "max_link_width",
             "aer_dev_correctable", "aer_dev_nonfatal", "aer_dev_fatal")
BEFORE_USEC, AFTER_USEC = 60_000_000, 30_000_000
TAIL_RECORDS = 300  # the newest records, whatever they are
MAX_PICKED = 4000  # records around the faults or naming their GPUs (the newest kept)
_NAME_RE = re.compile(BUNDLE_RE)
_SLUG_RE = re.compile(r"[^A-Za-z0-9._-]+")


def size_words(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} bytes"


def is_bundle_name(name: str) -> bool:
    return bool(_NAME_RE.match(name))


def path_of(name: str) -> str:
    return f"{FOLDER}/{name}"


def bundle_name(first: Finding, now: float, taken: Sequence[str] = ()) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z"  # sorts as time does
    slug = _SLUG_RE.sub("-", first.key.replace(":", "-").replace("/", "-")).strip("-._")[:60] or "finding"
    name = f"{stamp}-{slug}"
    n = 2
    while name in taken and n < 100:
        name, n = f"{stamp}-{slug}-{n}", n + 1
    return name


def _json(doc: Any) -> bytes:
    return (json.dumps(doc, indent=1, sort_keys=False, default=str) + "\n").encode()


def _fit_json(doc: Any, cap: int) -> tuple[bytes, dict[str, Any]]:
    """The document, or (over ``cap``) a document saying it was cut with its head as text."""
    data = _json(doc)
    if len(data) <= cap:
        return data, {"bytes": len(data), "cut": False}
    head = data[:max(0, cap - 512)].decode("utf-8", "replace")
    cut = _json({"cut": True, "bytes": len(data), "kept": len(head.encode()), "head": head})
    while len(cut) > cap and head:
        head = head[:len(head) // 2]
        cut = _json({"cut": True, "bytes": len(data), "kept": len(head.encode()), "head": head})
    return cut, {"bytes": len(cut), "cut": True, "of": len(data)}


# -- what is gathered ----------------------------------------------------------------------------
def _doc_of(g: Any) -> dict[str, Any]:
    return dict(g) if isinstance(g, Mapping) else g.as_dict()


def nvml_doc(found: Sequence[Finding], gpus: Sequence[Any]) -> dict[str, Any]:
    """The NVML readings of the GPUs the findings name (of every GPU when one is about the node)."""
    named = {f.gpu for f in found if f.gpu is not None}
    whole = any(f.gpu is None and f.bus is None for f in found)
    docs = [_doc_of(g) for g in gpus or ()]
    picked = docs if whole or not named else [d for d in docs if d.get("index") in named]
    return {"read": "this pass's reading of the GPU backend", "gpus": picked}


def pci_buses(found: Sequence[Finding], gpus: Sequence[Any], topology: Mapping[str, Any] | None) -> list[str]:
    """The PCI functions whose files a bundle holds: the findings' GPUs (every GPU the bus or NVML
    has, for a finding about the node)."""
    by_bus = gpu_index(gpus)
    every = sorted({full for _, full in by_bus.values()} | {
        str(t.get("pci_bus_id")).lower() for t in (topology or {}).get("gpus") or ()
        if isinstance(t, Mapping) and t.get("pci_bus_id")})
    out = []
    for f in found:
        if f.bus is None and f.gpu is None:
            out += every
        elif f.bus:
            got = by_bus.get(bus_key(f.bus))
            out.append(got[1] if got else (f.bus if f.bus.count(".") else f"{f.bus}.0"))
    return sorted(dict.fromkeys(b for b in out if b))[:64]


def pci_doc(fs, buses: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for bus in buses:
        files: dict[str, Any] = {}
        for name in PCI_FILES:
            path = f"/sys/bus/pci/devices/{bus}/{name}"
            try:
                text = fs.read_optional(path, limit=4096)
            except HostError as exc:
                files[name] = {"error": str(exc)[:300]}
                continue
            files[name] = text if text is None else text.rstrip("\n")
        out[bus] = files
    return {"folder": "/sys/bus/pci/devices", "devices": out}


def _line(rec: Any) -> str:
    t = f"[{rec.usec // 1_000_000:6d}.{rec.usec % 1_000_000:06d}]" if rec.usec is not None else "[      ?      ]"
    p = f"<{rec.priority}>" if rec.priority is not None else ""
    return f"{t} {p}{rec.message}".rstrip("\n")


def kernel_text(fs, found: Sequence[Finding]) -> tuple[bytes, dict[str, Any]]:
    """The kernel's records around the faults (read again from the boot's start: a reader that
    read them before handed each out once), as ``dmesg`` prints them, at most the cap."""
    from gpu_tune.host.kmsg import KernelLog, ReadStats

    windows = [(max(0, (f.first_usec or 0) - BEFORE_USEC), (f.last_usec or f.first_usec or 0) + AFTER_USEC)
               for f in found if f.first_usec is not None]
    names = set()
    for f in found:
        if f.bus:
            k = bus_key(f.bus)
            names |= {k, k.split(":", 1)[1] if k.count(":") == 2 else k}
    tail: deque[tuple[int, str]] = deque(maxlen=TAIL_RECORDS)
    picked: deque[tuple[int, str]] = deque(maxlen=MAX_PICKED)
    stats = ReadStats()
    n = 0
    log = KernelLog(fs, max_seconds=5.0)
    try:
        for rec in log.read(None, stats):
            n += 1
            u = rec.usec
            near = u is not None and any(a <= u <= b for a, b in windows)
            if near or any(x in rec.message for x in names):
                picked.append((n, _line(rec)))
            else:
                tail.append((n, _line(rec)))
    finally:
        log.close()
    lines = [t for _, t in sorted({**dict(picked), **dict(tail)}.items())]
    head = [f"# kernel log: {stats.source or 'not read'}; {stats.scanned:,} records read"]
    if stats.error:
        head.append(f"# not read: {stats.error}")
    head += [f"# {note}" for note in stats.notes]
    head.append(f"# kept: the records from 60 s before to 30 s after each fault's, those naming "
                f"{', '.join(sorted(names)) or 'its GPUs'}, and the newest {TAIL_RECORDS}")
    return "\n".join(head + lines).encode("utf-8", "replace") + b"\n", {"records": len(lines)}


def _fit_text(data: bytes, cap: int) -> tuple[bytes, dict[str, Any]]:
    """The newest lines of ``data`` that fit ``cap`` behind a line saying what was cut."""
    if len(data) <= cap:
        return data, {"bytes": len(data), "cut": False}
    keep = data[len(data) - max(0, cap - 200):]
    keep = keep[keep.find(b"\n") + 1:] if b"\n" in keep else keep
    note = f"# cut: the newest {len(keep):,} of {len(data):,} bytes kept (the bundle's cap)\n".encode()
    out = note + keep
    return out, {"bytes": len(out), "cut": True, "of": len(data)}


@dataclass
class Gathered:
    files: dict[str, bytes]
    meta: dict[str, dict[str, Any]]
    log_cap: int  # room left for the bug report's log (0: none)
    out_cap: int


def gather(fs, found: Sequence[Finding], verdict_doc: Mapping[str, Any], gpus: Sequence[Any],
           topology: Mapping[str, Any] | None, settings: Settings) -> Gathered:
    """Every file of a bundle but its manifest, each within its cap and all within the bundle's."""
    room = settings.bundle_bytes - manifest_cap(settings) - STATUS_CAP
    files: dict[str, bytes] = {}
    meta: dict[str, dict[str, Any]] = {}
    parts = ((VERDICT, 4, lambda: {**verdict_doc, "findings": [f.as_dict() for f in found]}),
             (NVML, 4, lambda: nvml_doc(found, gpus)), (PCI, 8, lambda: pci_doc(fs, pci_buses(found, gpus, topology))),
             (KERNEL, 1, None))
    whole = room
    for name, share, make in parts:  # each within its own cap and its share of the bundle's
        cap = max(0, min(CAPS[name], whole // share, room))
        if make is None:
            data, extra = kernel_text(fs, found)
            data, m = _fit_text(data, cap)
            m.update(extra)
        else:
            data, m = _fit_json(make(), cap)
        files[name], meta[name] = data, m
        room -= len(data)
    out_cap = max(0, min(OUT_CAP, room // 4))
    log_cap = room - out_cap
    return Gathered(files, meta, log_cap if log_cap >= MIN_LOG_CAP else 0, out_cap)


def manifest(name: str, found: Sequence[Finding], got: Gathered, *, now: float, node: str, boot: str | None,
             settings: Settings, bug_report: Mapping[str, Any]) -> bytes:
    doc = {"name": name, "path": path_of(name), "created": format_rfc3339(now), "node": node, "boot_id": boot,
           "findings": [f.as_dict() for f in found], "files": got.meta,
           "bytes": sum(m["bytes"] for m in got.meta.values()), "cut": any(m.get("cut") for m in got.meta.values()),
           "bounds": settings.as_dict(), "bug_report": dict(bug_report)}
    data, _ = _fit_json(doc, manifest_cap(settings))
    return data


def manifest_cap(settings: Settings) -> int:
    return min(MANIFEST_CAP, settings.bundle_bytes // 8)


def write(fs, name: str, files: Mapping[str, bytes]) -> None:
    """The bundle, whole or not at all. Raises HostError (a full disk, a read-only folder, a
    symlink in the folder's place)."""
    fs_tree.make_folder(fs, FOLDER, name, files)


def bundle_entries(fs) -> list[fs_tree.Entry]:
    return [e for e in fs_tree.entries(fs, FOLDER) if e.is_dir and is_bundle_name(e.name)]


def read_json(fs, name: str, fname: str, cap: int = MANIFEST_CAP) -> tuple[Any, str | None]:
    """(the document, None), or (None, why not): a file of a bundle, read within ``cap``."""
    try:
        data = fs_tree.read_in(fs, FOLDER, name, fname, cap + 1)
    except HostError as exc:
        return None, str(exc)
    if data is None:
        return None, f"{path_of(name)}/{fname}: not there"
    if len(data) > cap:
        return None, f"{path_of(name)}/{fname}: larger than {cap} bytes"
    try:
        return json.loads(data), None
    except (ValueError, RecursionError) as exc:
        return None, f"{path_of(name)}/{fname}: not JSON ({str(exc)[:80] or 'nested too deep'})"


def running(status: Any, now: float) -> bool:
    """Whether a bundle's bug report may still write (started or running, within its deadline)."""
    if not isinstance(status, dict) or status.get("state") not in ("starting", "running"):
        return False
    until = status.get("until")
    return isinstance(until, (int, float)) and now <= until + 30


def prune(fs, settings: Settings, now: float, keep: str | None = None) -> tuple[list[str], list[str]]:
    """Remove the oldest bundles until the newest ``settings.keep`` are left and all of them hold at
    most ``settings.max_bytes`` (one whose bug report still runs counts as its whole cap, the room
    it may fill); ``keep`` is never removed. Leftovers of an interrupted write go too. Returns
    (names removed, notes). The caller holds the health state's lock."""
    removed, notes = [], []
    try:
        every = fs_tree.entries(fs, FOLDER)
    except HostError as exc:
        return [], [f"evidence bounds not kept: {exc}"]
    for e in every:
        if e.is_dir and e.name.startswith(fs_tree.TEMP_PREFIX):
            try:
                fs_tree.remove(fs, FOLDER, e.name)
            except HostError as exc:
                notes.append(str(exc))
    bundles = [e for e in every if e.is_dir and is_bundle_name(e.name)]
    sizes = {}
    for e in bundles:
        status, _ = read_json(fs, e.name, BUG_STATUS, STATUS_CAP)
        sizes[e.name] = max(e.bytes, settings.bundle_bytes) if running(status, now) else e.bytes
    left = [e.name for e in bundles]
    total = sum(sizes.values())
    for name in list(left):
        if len(left) <= settings.keep and total <= settings.max_bytes:
            break
        if name == keep:
            continue
        try:
            fs_tree.remove(fs, FOLDER, name)
        except HostError as exc:
            notes.append(str(exc))
            continue
        left.remove(name)
        total -= sizes[name]
        removed.append(name)
    return removed, notes
