"""Small state the commands share across processes, under ``<root>/var/lib/gpu-tune/``.

``probe.json`` keeps the latest probe verdicts (written by ``gpu-tune probe`` and the agent), so
``gpu-tune label`` can judge readiness without running a probe itself. A missing or unreadable
file simply means "no probe result yet"; one that this tool cannot have written (not a regular
file, larger than :data:`PROBE_STATE_CAP`, a key given twice) is bad input naming it.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from gpu_tune.errors import HostError, InputError
from gpu_tune.host.fs import HostFS, NotAFile

PROBE_STATE = "/var/lib/gpu-tune/probe.json"
# One verdict per GPU, a few KB each.
PROBE_STATE_CAP = 16 << 20


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
    """The saved verdicts, or None when there are none (for ``profile``, when given). Raises
    :class:`InputError` for a file this tool cannot have written."""
    from gpu_tune.strict import BadText, DuplicateKey, check_text, json_loads

    where = f"{PROBE_STATE} under {fs.root}"
    try:
        text = fs.read_optional(PROBE_STATE, limit=PROBE_STATE_CAP)
    except NotAFile as exc:
        raise InputError(f"{where}: {str(exc).split(': ', 1)[-1]}; move it away (the next probe writes it "
                         "again)") from None
    if not text:
        return None
    try:
        doc = json_loads(text)
        check_text(doc)
        results = doc["results"]
    except (DuplicateKey, BadText) as exc:
        line = f":{exc.second}" if isinstance(exc, DuplicateKey) and exc.second else ""
        raise InputError(f"{PROBE_STATE}{line} under {fs.root}: {exc}; move it away (the next probe writes it "
                         "again)") from None
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    if profile is not None and doc.get("profile") != profile:
        return None
    return results if isinstance(results, list) else None
