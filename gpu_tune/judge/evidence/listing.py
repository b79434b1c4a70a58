"""The bundles as ``gpu-tune evidence`` shows them (docs/cli.md): read only, through the same
no-link folder reads as the writer (:mod:`gpu_tune.host.fs_tree`); a file a bundle should hold and
does not, or holds in another form, is said, never a crash."""

from __future__ import annotations

import time
from typing import Any

from gpu_tune.errors import HostError, InputError
from gpu_tune.host import fs_tree
from gpu_tune.judge.evidence import FOLDER, Settings
from gpu_tune.judge.evidence.bugreport import words
from gpu_tune.judge.evidence.bundle import (BUG_STATUS, CAPS, KERNEL, MANIFEST, NVML, PCI, STATUS_CAP, VERDICT,
                                            bundle_entries, is_bundle_name, path_of, read_json)


def _row(fs, name: str, size: int, now: float) -> dict[str, Any]:
    man, why = read_json(fs, name, MANIFEST)
    status, swhy = read_json(fs, name, BUG_STATUS, STATUS_CAP)
    man = man if isinstance(man, dict) else {}
    listed = man.get("findings") if isinstance(man.get("findings"), list) else []
    finds = [str(f.get("key")) for f in listed if isinstance(f, dict)]
    state = status.get("state") if isinstance(status, dict) else None
    created = man.get("created") if isinstance(man.get("created"), str) else None
    return {"name": name, "path": path_of(name), "created": created, "findings": finds, "bytes": size,
            "cut": bool(man.get("cut")) or str(state or "").startswith("cut"), "bug_report": words(status, now) if status is not None else (swhy or ""),
            "bug_report_state": state,
            "notes": [w for w in (why,) if w]}


def list_bundles(fs, settings: Settings) -> tuple[dict[str, Any], bool]:
    """(the listing document, whether the folder could be read)."""
    now = time.time()
    try:
        rows = [_row(fs, e.name, e.bytes, now) for e in bundle_entries(fs)]
    except HostError as exc:
        return {"folder": FOLDER, "bundles": [], "bytes": 0, "bounds": settings.as_dict(), "notes": [str(exc)]}, False
    rows.sort(key=lambda r: r["name"], reverse=True)
    return {"folder": FOLDER, "bundles": rows, "bytes": sum(r["bytes"] for r in rows), "bounds": settings.as_dict(),
            "notes": []}, True


def show_bundle(fs, name: str) -> dict[str, Any]:
    """One bundle whole (its kernel log as text). InputError (exit 2) for a name that is no
    bundle's or is not there."""
    if not is_bundle_name(name) or "/" in name:
        raise InputError(f"{ascii(name[:120])}: not an evidence bundle's name (gpu-tune evidence lists them)")
    try:
        names = {e.name: e.bytes for e in bundle_entries(fs)}
    except HostError as exc:
        raise HostError(f"{FOLDER}: cannot be read: {exc}", exc.errno) from None
    if name not in names:
        raise InputError(f"no bundle {name} in {FOLDER} (gpu-tune evidence lists them)")
    doc: dict[str, Any] = {"name": name, "path": path_of(name), "bytes": names[name], "notes": []}
    for key, fname, cap in (("manifest", MANIFEST, 1 << 20), ("verdict", VERDICT, CAPS[VERDICT]),
                            ("nvml", NVML, CAPS[NVML]), ("pci", PCI, CAPS[PCI]),
                            ("bug_report", BUG_STATUS, STATUS_CAP)):
        got, why = read_json(fs, name, fname, cap)
        doc[key] = got
        if why:
            doc["notes"].append(why)
    try:
        text = fs_tree.read_in(fs, FOLDER, name, KERNEL, CAPS[KERNEL] + 4096)
        doc["kernel_log"] = None if text is None else text.decode("utf-8", "replace")
        files = list(fs_tree.files_in(fs, FOLDER, name))
    except HostError as exc:
        doc["kernel_log"], files = None, []
        doc["notes"].append(str(exc))
    doc["files"] = [{"file": f, "bytes": n} for f, n in files]
    doc["bug_report_words"] = words(doc["bug_report"], time.time()) if doc["bug_report"] is not None else ""
    return doc
