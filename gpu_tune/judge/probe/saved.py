"""Small state the commands share across processes, under ``<root>/var/lib/gpu-tune/``.

``probe.json`` keeps the latest probe verdicts (written by ``gpu-tune probe`` and the agent), so
``gpu-tune label`` can judge readiness without running a probe itself. A missing or unreadable
file simply means "no probe result yet".
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from gpu_tune.errors import HostError
from gpu_tune.host.fs import HostFS

PROBE_STATE = "/var/lib/gpu-tune/probe.json"


def save_probe_results(fs: HostFS, profile: str, results: list[dict[str, Any]]) -> str | None:
    """Write the verdicts crash-safely; returns an error string instead of raising."""
    doc = {"profile": profile, "saved_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "results": results}
    try:
        fs.write_file_atomic(PROBE_STATE, json.dumps(doc, indent=1).encode() + b"\n", mode=0o644)
    except HostError as exc:
        return str(exc)
    return None


def load_probe_results(fs: HostFS, profile: str | None = None) -> list[dict[str, Any]] | None:
    text = fs.read_optional(PROBE_STATE)
    if not text:
        return None
    try:
        doc = json.loads(text)
        results = doc["results"]
    except (ValueError, KeyError, TypeError):
        return None
    if profile is not None and doc.get("profile") != profile:
        return None
    return results if isinstance(results, list) else None
