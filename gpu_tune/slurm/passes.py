"""How many Slurm passes in a row found this node ready: ``<root>/var/lib/gpu-tune/slurm.json``.

A resume waits for the second ready pass in a row (:mod:`gpu_tune.slurm.decide`); the count has
to outlive the process, since Slurm starts a new one for every health check, prolog and epilog.
The file is small and written whole (temporary file, rename); HostFS never writes it through a
symlink or when it has another name (a hard link).

The count is trusted only so far as it can do no harm:

- it counts the ready passes of one drain: it is kept with the drain it was counted under
  (:func:`drain_of`: the node's reason, who set it and when, as Slurm prints them), and a count
  kept under another drain, or while the node was in service, counts as none. A count left
  from before a fault whose own pass could not save its 0 (a folder gone read-only) never
  lets the first ready pass after the drain resume the node;
- a pass that cannot save its count never resumes the node (:mod:`gpu_tune.slurm.health`): a
  count read through a link that is never written, or from a folder that is read-only, stays
  where it is and so cannot grow into a resume;
- a missing file, or one that cannot be read back, counts as no ready pass yet: a resume then
  waits one more pass, never the other way round.
"""

from __future__ import annotations

import json
import logging
import time

from gpu_tune.errors import HostError
from gpu_tune.host.fs import HostFS
from gpu_tune.slurm.decide import ours
from gpu_tune.slurm.node import SlurmNode

log = logging.getLogger("gpu_tune")

PASSES = "/var/lib/gpu-tune/slurm.json"
CAP = 64 << 10


def drain_of(node: SlurmNode) -> str:
    """gpu-tune's drain of ``node`` as Slurm has it (``gpu-tune: X [root@2026-11-28T04:28:01]``),
    or "" when the node is not drained by gpu-tune. Slurm stamps a reason with the second it was
    set, so a new drain with the same words is another drain."""
    return f"{node.reason} [{node.reason_by}@{node.reason_at}]" if ours(node) else ""


def ready_before(fs: HostFS, node: str, drain: str = "") -> int:
    """Ready passes in a row before this one, for ``node`` under ``drain`` (:func:`drain_of`)."""
    try:
        text = fs.read_optional(PASSES, limit=CAP)
    except HostError as exc:
        log.warning("%s under %s: %s; counting no ready pass before this one", PASSES, fs.root, exc)
        return 0
    if not text:
        return 0
    try:
        doc = json.loads(text)
        n = doc["ready_in_a_row"] if doc.get("node") == node and doc.get("drain", "") == drain else 0
    except (ValueError, KeyError, TypeError, AttributeError):
        log.warning("%s under %s: not a file gpu-tune wrote; counting no ready pass before this one", PASSES, fs.root)
        return 0
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else 0


def record(fs: HostFS, node: str, in_a_row: int, drain: str = "") -> str | None:
    """Save this pass's count (ready passes in a row, this one included); the error, or None."""
    doc = {"node": node, "ready_in_a_row": in_a_row, "drain": drain,
           "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        fs.write_file_atomic(PASSES, json.dumps(doc).encode() + b"\n", mode=0o644)
    except HostError as exc:
        return str(exc)
    return None
