"""One Slurm pass of ``gpu-tune check --slurm``: which node this is, how Slurm has it, the GPU
count Slurm offers beside the host's, what to do (:mod:`gpu_tune.slurm.decide`), doing it, and
one line saying so.

Where it runs (``context``), from the variables slurmd sets:

- ``HealthCheckProgram``: ``SLURMD_NODENAME`` only (slurmd's ``run_script_health_check``);
- ``Prolog`` / ``Epilog``: ``SLURM_SCRIPT_CONTEXT`` = ``prolog_slurmd`` / ``epilog_slurmd`` and
  ``SLURM_JOB_ID``. A prolog that exits non-zero makes Slurm requeue the job (held: ``launch
  failed requeued held``) and drain the node with its own reason ``Prolog error``, unless the node
  is drained already: gpu-tune drains it first with its own reason, so that its next ready pass
  may resume it; an epilog's non-zero exit drains the node the same way, the job having ended;
- anywhere else: ``command`` (a person, cron, a systemd timer).

The node's name: ``--slurm-node``, else ``SLURMD_NODENAME``, else the node whose
``NodeHostName`` is this host's name (``slurmd`` finds its own name that way), else the node
named like the host's short name.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from gpu_tune.errors import InputError
from gpu_tune.gpu.base import GpuInfo
from gpu_tune.host.fs import HostFS
from gpu_tune.judge.readiness import Verdict
from gpu_tune.slurm import passes
from gpu_tune.slurm.decide import Decision, clean, decide
from gpu_tune.slurm.gres import gres_check
from gpu_tune.slurm.node import SlurmNode
from gpu_tune.slurm.scontrol import NoSuchNode, Scontrol, SlurmUnreachable

log = logging.getLogger("gpu_tune")

__all__ = ["Scontrol", "SlurmPass", "SlurmUnreachable", "check_node_flag", "context_of", "node_name", "slurm_pass"]


@dataclass
class SlurmPass:
    node: str
    named_by: str  # --slurm-node | SLURMD_NODENAME | NodeHostName | host name
    context: str  # health_check | prolog | epilog | command
    job: str | None
    before: SlurmNode
    verdict: Verdict
    decision: Decision
    done: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def line(self) -> str:
        """What gpu-tune did in Slurm, in one line (stderr)."""
        where = self.context + (f" of job {self.job}" if self.job else "")
        text = f"slurm node {self.node} ({where}): {self.decision.says}"
        if self.notes:
            text += "; " + "; ".join(self.notes)
        return clean(text, 1000)

    def as_dict(self) -> dict[str, Any]:
        return {"node": self.node, "named_by": self.named_by, "context": self.context, "job": self.job,
                "before": self.before.as_dict(), **self.decision.as_dict(), "done": self.done, "notes": self.notes}


def context_of(env: Mapping[str, str]) -> tuple[str, str | None]:
    ctx = env.get("SLURM_SCRIPT_CONTEXT", "")
    job = env.get("SLURM_JOB_ID") or None
    if ctx.startswith("prolog"):
        return "prolog", job
    if ctx.startswith("epilog"):
        return "epilog", job
    if env.get("SLURMD_NODENAME") and not job:
        return "health_check", None
    return "command", job


def check_node_flag(flag: str | None) -> None:
    """``--slurm-node``: one node name (no list, no space), checked before anything runs."""
    if flag is not None and (not flag.strip() or any(c.isspace() or c in ",[]" for c in flag)):
        raise InputError(f"--slurm-node {flag!r}: expected one Slurm node name")


def node_name(flag: str | None, env: Mapping[str, str], scontrol: Scontrol | None,
              hostname: str | None = None) -> tuple[str, str]:
    """(the node's name in Slurm, where it came from)."""
    if flag is not None:
        check_node_flag(flag)
        return flag, "--slurm-node"
    if env.get("SLURMD_NODENAME", "").strip():
        return env["SLURMD_NODENAME"].strip(), "SLURMD_NODENAME"
    if scontrol is None:
        raise InputError("no node name: give --slurm-node NAME")
    host = hostname or socket.gethostname()
    short = host.split(".")[0]
    nodes = scontrol.nodes()
    for names, how in (({host, short}, "NodeHostName"), ({short}, "host name")):
        found = sorted({n.name for n in nodes if (n.hostname if how == "NodeHostName" else n.name) in names})
        if len(found) == 1:
            return found[0], f"{how} {host}"
        if len(found) > 1:
            raise InputError(f"Slurm has {len(found)} nodes with NodeHostName {host} ({', '.join(found[:10])}): "
                             "give --slurm-node NAME (slurmd's HealthCheckProgram passes SLURMD_NODENAME)")
    raise InputError(f"no Slurm node has NodeHostName {host} or the name {short} (`scontrol show node` lists "
                     f"{len(nodes)}): give --slurm-node NAME")


def slurm_pass(fs: HostFS, verdict: Verdict, gpus: Sequence[GpuInfo], topology: Mapping[str, Any] | None, *,
               node_flag: str | None = None, env: Mapping[str, str] | None = None,
               scontrol: Scontrol | None = None, dry_run: bool = False) -> SlurmPass:
    """Judge the node for Slurm and act. Raises :class:`SlurmUnreachable` (nothing changed) when
    slurmctld does not answer the read; an answer refused on the write is raised the same way,
    after the read (the node is then as it was). ``dry_run``: decide only, writing nothing to
    Slurm and nothing under the root (not the ready-pass count either)."""
    env = dict(os.environ if env is None else env)
    sc = scontrol or Scontrol(env=env)
    context, job = context_of(env)
    name, named_by = node_name(node_flag, env, sc)
    try:
        node = sc.show_node(name)
    except NoSuchNode as exc:
        raise InputError(f"{exc} (the name came from {named_by})") from None
    v = verdict.plus(gres_check(node, gpus, topology))  # weighed by the profile's policy, as every check
    before = passes.ready_before(fs, name)
    in_a_row, err = (before + 1 if v.ready else 0, None) if dry_run else passes.record(fs, name, v.ready, before)
    out = SlurmPass(name, named_by, context, job, node, v, decide(v, node, in_a_row))
    if err:
        out.notes.append(f"the ready-pass count was not saved ({err}): a resume waits until it can be")
    d = out.decision
    if d.writes and not dry_run:
        state = "RESUME" if d.action == "resume" else "DRAIN"
        sc.update(name, state, d.reason)
        out.done = True
    return out
