"""The blast-radius limit told to Slurm: :class:`SlurmFleet`, the store that
:mod:`gpu_tune.judge.fleet_limit` counts, ranks and writes through (docs/slurm.md, "How many nodes
gpu-tune takes out at once").

- **N**, the nodes out of service by gpu-tune: every node whose drain reason starts ``gpu-tune:``,
  whatever else Slurm says of it (``IDLE+DRAIN``, ``MIXED+DRAIN``, ``DOWN+DRAIN+NOT_RESPONDING``).
  An administrator's drain (``maint``, `` gpu-tune: x`` with its leading space) and Slurm's own
  (``Prolog error``, ``Not responding``) never count.
- **M**, the nodes gpu-tune judges: where this node offers ``gres/gpu``, every node that offers
  ``gres/gpu`` (the GPU nodes); where it offers none (a cluster that gives whole nodes to jobs and
  configures no GPU GRES), every node that shares a partition with it. A node drained by gpu-tune
  is always among them, and so is this node.
- **The count** is one ``scontrol show node`` of every node, read line by line, and only where a
  node is about to be drained or is settling after its drain: never on a ready pass.
- **No compare-and-set**: ``scontrol update`` is unconditional, so the store writes, then, a
  second later, the limit counts again and ranks the drains by the time Slurm stamped on their
  reason (UTC, to the second: :mod:`gpu_tune.slurm.scontrol`), then the node's name. A node ranked
  past the limit resumes itself with a reason that says so (:meth:`SlurmFleet.put_back`).
"""

from __future__ import annotations

from gpu_tune.judge.fleet_limit import Census, Out
from gpu_tune.slurm.decide import PREFIX, clean, ours
from gpu_tune.slurm.node import SlurmNode, gres_count
from gpu_tune.slurm.scontrol import Scontrol, SlurmRefused, SlurmUnreachable


def offers_gpus(node: SlurmNode) -> bool:
    try:
        return bool(gres_count(node.gres, "gpu"))
    except ValueError:
        return False


class SlurmFleet:
    """:class:`gpu_tune.judge.fleet_limit.Store` over ``scontrol``, for the pass of ``this`` node
    (as Slurm listed it) whose drain would carry ``reason``. ``calls``: the scontrol calls made;
    ``tried``: an update was started (a failure after it is no longer "nothing changed")."""

    compare_and_set = False
    failures = (SlurmUnreachable, SlurmRefused)
    tick_s = 1.0  # Slurm stamps a reason to the second

    def __init__(self, scontrol: Scontrol, this: SlurmNode, reason: str) -> None:
        self.scontrol = scontrol
        self.this = this
        self.reason = reason
        self.calls = 0
        self.tried = False

    def census(self) -> Census:
        gpus = offers_gpus(self.this)
        parts = set(self.this.partitions)
        judged = 0
        out: list[Out] = []

        def each(n: SlurmNode) -> None:
            nonlocal judged
            mine = ours(n)
            if mine or n.name == self.this.name or (offers_gpus(n) if gpus else bool(parts & set(n.partitions))):
                judged += 1
            if mine:
                out.append(Out(n.name, n.reason_at))

        self.calls += 1
        self.scontrol.each_node(each)
        return Census(judged, tuple(out))

    def take_out(self, node: str, census: Census) -> bool:
        self._update(node, "DRAIN", self.reason)
        return True

    def put_back(self, node: str, says: str) -> None:
        why = self.reason[len(PREFIX):].strip() if self.reason.startswith(PREFIX) else self.reason
        self._update(node, "RESUME", clean(f"{PREFIX} {says}; not ready: {why}"))

    def _update(self, node: str, state: str, reason: str) -> None:
        self.calls += 1
        self.tried = True
        self.scontrol.update(node, state, reason)
