"""What to tell Slurm about this node, from the verdict and the node as Slurm has it: pure.

The rules (docs/slurm.md, "What gpu-tune drains and resumes"):

- **not ready**: drain the node with a reason that starts :data:`PREFIX` (``scontrol update
  State=DRAIN``: running jobs finish, no new job starts; nothing is killed). Already drained by
  gpu-tune with the same reason: nothing to do; with another reason (another fault): the reason
  is replaced, the node stays drained.
- **ready**: resume the node only when gpu-tune drained it (its reason starts :data:`PREFIX`,
  LBNL NHC's rule), and only on the second ready pass in a row (:data:`READY_PASSES_TO_RESUME`),
  so a fault that comes and goes on alternate passes keeps the node drained instead of flapping.
- **not ready, past the blast-radius limit** (:mod:`gpu_tune.judge.fleet_limit`, asked only where
  this would drain the node): not drained (``limit_reached``), or drained and then put back in
  service by the count after the drain (``put_back``); the line says "limit reached: ...".
- a node drained or set down by anyone else (an administrator's ``maint``, Slurm's own
  ``Prolog error`` or ``Not responding``), or down, failed, rebooting, powered down: left as it
  is, whatever the verdict; the line says so.

A reason is one line of printable ASCII, at most :data:`MAX_REASON` characters (Slurm sets no
limit; ``sinfo -R`` cuts its reason column at 20 unless given a width, and those 20 are the prefix
and as much of the verdict's CamelCase reason as fits): the verdict's reason, the headline of the
most urgent failing check, and Slurm's GPU count where ``slurm.gres`` fails as well.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpu_tune.judge.readiness import Verdict, headline
from gpu_tune.slurm.gres import NAME as GRES
from gpu_tune.slurm.node import SlurmNode

PREFIX = "gpu-tune:"
MAX_REASON = 160
READY_PASSES_TO_RESUME = 2
_NOT_PLAIN = re.compile(r"[^\x20-\x7e]+")

NONE, DRAIN, REDRAIN, RESUME, HOLD, LEFT = "none", "drain", "update_reason", "resume", "hold", "left_alone"
LIMITED, PUT_BACK = "limit_reached", "put_back"  # the blast-radius limit's (held_back)


@dataclass(frozen=True)
class Decision:
    action: str  # none | drain | update_reason | resume | hold | left_alone | limit_reached | put_back
    reason: str  # what Reason= to write (drain, update_reason, resume), else ""
    says: str  # one line: what was (or will be) done and why

    @property
    def writes(self) -> bool:
        return self.action in (DRAIN, REDRAIN, RESUME)

    def as_dict(self) -> dict[str, str]:
        return {"action": self.action, "reason": self.reason, "says": self.says}


def clean(text: str, limit: int = MAX_REASON) -> str:
    """One line of printable ASCII, no double quote (scontrol strips a reason's closing ``"``),
    at most ``limit`` characters."""
    t = " ".join(_NOT_PLAIN.sub(" ", text.replace("…", "...")).split()).replace('"', "'")
    return t if len(t) <= limit else t[:limit - 3].rstrip() + "..."


def ours(node: SlurmNode) -> bool:
    """Drained by gpu-tune: a drain whose reason starts with its prefix."""
    return node.drain and node.reason.startswith(PREFIX)


def drain_reason(v: Verdict) -> str:
    """``gpu-tune: FatalXid GPU 3: XID 79 (GPU has fallen off the bus)``: the verdict's reason and
    its most urgent check's headline (``slurm.gres``'s figures added when it fails too)."""
    top = v.most_urgent()
    text = f"{v.reason()} {headline(top) if top else v.message()}"
    gres = next((c for c in v.failed if c.name == GRES and c is not top), None)
    if gres is not None:
        text += f"; {headline(gres)}"
    return clean(f"{PREFIX} {text}")


def _held(node: SlurmNode) -> str:
    what = "+".join(sorted(node.out_of_service)) if node.out_of_service else "drained"
    who = f" by {node.reason_by}" if node.reason_by else ""
    when = f" at {node.reason_at}" if node.reason_at else ""
    because = f" ({node.reason!r}{who}{when})" if node.reason else " (no reason given)"
    return f"{node.state}{because}: {what} by someone other than gpu-tune"


def decide(v: Verdict, node: SlurmNode, ready_in_a_row: int) -> Decision:
    """``ready_in_a_row``: ready passes in a row, this one included (0 when not ready)."""
    mine = ours(node)
    held = bool(node.out_of_service) or (node.drain and not mine)
    if not v.ready:
        want = drain_reason(v)
        if held:
            return Decision(LEFT, "", f"not ready; left as it is: {_held(node)}")
        if mine and node.reason == want:
            return Decision(NONE, "", f"not ready; stays drained ({want!r})")
        if mine:
            return Decision(REDRAIN, want, f"not ready; still drained, reason now {want!r} (was {node.reason!r})")
        jobs = " (its running jobs go on; no new job starts)" if {"ALLOCATED", "MIXED"} & node.flags else ""
        return Decision(DRAIN, want, f"not ready; drained{jobs}: {want!r}")
    if held:
        return Decision(LEFT, "", f"ready; left as it is: {_held(node)}")
    if not mine:
        return Decision(NONE, "", "ready")
    if ready_in_a_row < READY_PASSES_TO_RESUME:
        return Decision(HOLD, "", f"ready; stays drained until the next ready pass ({ready_in_a_row} of "
                                  f"{READY_PASSES_TO_RESUME} in a row): {node.reason!r}")
    note = clean(f"{PREFIX} ready again, resumed: {v.message()} (drained for: {node.reason[len(PREFIX):].strip()})")
    return Decision(RESUME, note, f"ready; resumed (drained by gpu-tune for {node.reason[len(PREFIX):].strip()!r})")


def held_back(says: str, put_back: bool, ready: bool = False) -> Decision:
    """Left in service by the blast-radius limit: never drained (``says``: the limit's "limit
    reached: ..."), or drained and then put back in service by a count after the drain."""
    if put_back:
        return Decision(PUT_BACK, "", f"ready; drained, then {says}" if ready else f"not ready; drained, then {says}")
    return Decision(LIMITED, "", f"not ready; not drained: {says}")


def unsaved(node: SlurmNode, error: str) -> Decision:
    """A ready pass that would resume the node but could not save its count: it stays drained (a
    count that was not saved never resumes a node: the next pass would read the old one)."""
    return Decision(HOLD, "", f"ready; stays drained: the ready-pass count was not saved ({error}): no resume "
                              f"until it can be: {node.reason!r}")
