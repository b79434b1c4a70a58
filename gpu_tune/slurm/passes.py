"""gpu-tune's own record of this node in Slurm, ``<root>/var/lib/gpu-tune/slurm.json``: how many
passes in a row found it ready, whether gpu-tune's drain is on it, the ``Gres=`` Slurm listed, and
whether a drain of its own is still settling under the blast-radius limit. Written by every pass
that read Slurm (never by a dry run, never by a pass that could not read Slurm).

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

The record also lets a prolog or an epilog decide without Slurm (:mod:`gpu_tune.slurm.health`):
only where it positively says that gpu-tune has not drained this node (``drained`` false, for this
node's name) and keeps the ``Gres=`` that ``slurm.gres`` is judged against. A file from before
these keys has neither: Slurm is read, as ever.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Record:
    """What the last pass that read Slurm kept. ``drained``: gpu-tune's drain on the node after it
    (None: not said); ``gres``: the node's ``Gres=`` as Slurm listed it (None: not kept);
    ``settling``: when (this host's clock, seconds) gpu-tune wrote a drain of its own that the
    limit has not yet found settled (None: none)."""

    node: str
    ready_in_a_row: int
    drain: str = ""
    drained: bool | None = None
    gres: str | None = None
    settling: float | None = None
    at: str = ""


def read(fs: HostFS) -> Record | None:
    """The record, or None (none, unreadable, or not a file gpu-tune wrote: said in the log)."""
    try:
        text = fs.read_optional(PASSES, limit=CAP)
    except HostError as exc:
        log.warning("%s under %s: %s; counting no ready pass before this one", PASSES, fs.root, exc)
        return None
    if not text:
        return None
    try:
        doc = json.loads(text)
        n, node = doc["ready_in_a_row"], doc["node"]
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 0 and isinstance(node, str)):
            raise ValueError(n)
        drained, gres, settling = doc.get("drained"), doc.get("gres"), doc.get("settling")
        return Record(node, n, str(doc.get("drain", "")), drained if isinstance(drained, bool) else None,
                      gres if isinstance(gres, str) else None,
                      float(settling) if isinstance(settling, (int, float)) and not isinstance(settling, bool)
                      else None, str(doc.get("at", "")))
    except (ValueError, KeyError, TypeError, AttributeError):
        log.warning("%s under %s: not a file gpu-tune wrote; counting no ready pass before this one", PASSES, fs.root)
        return None


def ready_before(fs: HostFS, node: str, drain: str = "", rec: Record | None = None) -> int:
    """Ready passes in a row before this one, for ``node`` under ``drain`` (:func:`drain_of`);
    ``rec``: the record read already."""
    rec = rec if rec is not None else read(fs)
    return rec.ready_in_a_row if rec is not None and rec.node == node and rec.drain == drain else 0


def record(fs: HostFS, node: str, in_a_row: int, drain: str = "", *, drained: bool | None = None,
           gres: str | None = None, settling: float | None = None) -> str | None:
    """Save this pass's record (ready passes in a row, this one included); the error, or None."""
    doc = {"node": node, "ready_in_a_row": in_a_row, "drain": drain, "drained": drained, "gres": gres,
           "settling": settling, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        fs.write_file_atomic(PASSES, json.dumps(doc).encode() + b"\n", mode=0o644)
    except HostError as exc:
        return str(exc)
    return None
