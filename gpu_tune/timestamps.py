"""RFC 3339 times as Kubernetes and the HTTP API write them (``2025-01-01T00:00:00Z``): pure."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any


def format_rfc3339(ts: float) -> str:
    """Epoch seconds -> ``2025-01-01T00:00:00Z`` (UTC, whole seconds)."""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: Any) -> float | None:
    """``2025-01-01T00:00:00Z`` (or with an offset, or fractions) -> epoch seconds; None when it is
    not such a time."""
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
