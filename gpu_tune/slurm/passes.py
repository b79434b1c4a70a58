"""How many Slurm passes in a row found this node ready: ``<root>/var/lib/gpu-tune/slurm.json``.

A resume waits for the second ready pass in a row (:mod:`gpu_tune.slurm.decide`); the count has
to outlive the process, since Slurm starts a new one for every health check, prolog and epilog.
The file is small and written whole (temporary file, rename). A missing file, or one that cannot
be read back, counts as no ready pass yet: a resume then waits one more pass, never the other
way round.
"""

from __future__ import annotations

import json
import logging
import time

from gpu_tune.errors import HostError
from gpu_tune.host.fs import HostFS

log = logging.getLogger("gpu_tune")

PASSES = "/var/lib/gpu-tune/slurm.json"
CAP = 64 << 10


def ready_before(fs: HostFS, node: str) -> int:
    """Ready passes in a row before this one, for ``node``."""
    try:
        text = fs.read_optional(PASSES, limit=CAP)
    except HostError as exc:
        log.warning("%s under %s: %s; counting no ready pass before this one", PASSES, fs.root, exc)
        return 0
    if not text:
        return 0
    try:
        doc = json.loads(text)
        n = doc["ready_in_a_row"] if doc.get("node") == node else 0
    except (ValueError, KeyError, TypeError, AttributeError):
        log.warning("%s under %s: not a file gpu-tune wrote; counting no ready pass before this one", PASSES, fs.root)
        return 0
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else 0


def record(fs: HostFS, node: str, ready: bool, before: int) -> tuple[int, str | None]:
    """Write this pass; returns (ready passes in a row, this one included; an error or None)."""
    n = before + 1 if ready else 0
    doc = {"node": node, "ready_in_a_row": n, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        fs.write_file_atomic(PASSES, json.dumps(doc).encode() + b"\n", mode=0o644)
    except HostError as exc:
        return n, str(exc)
    return n, None
