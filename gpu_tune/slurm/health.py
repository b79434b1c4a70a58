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
named like the host's short name. A name given is one Slurm node name, never an option of
``scontrol`` (``-V``): checked before anything runs (exit 2).

A pass is two steps: :func:`judge_node` reads (Slurm's node, the saved count) and decides,
writing nothing; :func:`act` writes what was decided (``scontrol update``, then the count; for a
resume the count first, since a count that was not saved never resumes a node). A drain goes
through the blast-radius limit (:mod:`gpu_tune.slurm.fleet`, :mod:`gpu_tune.judge.fleet_limit`):
past it the node is not drained, and a prolog or an epilog then exits 0 (:attr:`SlurmPass.exit_code`),
since slurmd drains a node whose prolog or epilog fails (``Prolog error``).

A prolog or an epilog on a ready host whose record (:mod:`gpu_tune.slurm.passes`) says gpu-tune
has not drained this node decides without Slurm (:func:`from_record`): no ``scontrol`` at all, the
node's name from ``--slurm-node`` or ``SLURMD_NODENAME``, ``slurm.gres`` judged against the
``Gres=`` the record keeps. Any doubt reads Slurm.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from gpu_tune.errors import InputError
from gpu_tune.gpu.base import GpuInfo
from gpu_tune.host.fs import HostFS
from gpu_tune.judge import fleet_limit
from gpu_tune.judge.fleet_limit import KEPT, LIMIT, PUT_BACK, TAKE, Outcome
from gpu_tune.judge.readiness import Verdict
from gpu_tune.slurm import passes
from gpu_tune.slurm.decide import (DRAIN, HOLD, LIMITED, NONE, REDRAIN, RESUME, Decision, clean, decide,
                                   drain_reason, held_back, ours, unsaved)
from gpu_tune.slurm.fleet import SlurmFleet
from gpu_tune.slurm.gres import gres_check
from gpu_tune.slurm.node import SlurmNode
from gpu_tune.slurm.scontrol import NoAnswer, NoSuchNode, Scontrol, SlurmRefused, SlurmUnreachable

log = logging.getLogger("gpu_tune")

__all__ = ["Scontrol", "SlurmPass", "SlurmRefused", "SlurmUnreachable", "act", "check_names", "check_node_name",
           "context_of", "judge_node", "node_name", "slurm_pass"]

SHOWN = 40  # characters of a node's name or a job id in the line on stderr
HELD_CONTEXTS = ("prolog", "epilog")  # where a non-zero exit makes slurmd drain the node itself


@dataclass
class SlurmPass:
    node: str
    named_by: str  # --slurm-node | SLURMD_NODENAME | NodeHostName | host name
    context: str  # health_check | prolog | epilog | command
    job: str | None
    before: SlurmNode | None  # None: Slurm not asked (from_record)
    verdict: Verdict
    decision: Decision
    in_a_row: int = 0  # ready passes in a row, this one included
    drain: str = ""  # the drain the count is kept under (passes.drain_of)
    done: bool = False
    notes: list[str] = field(default_factory=list)
    limit: Outcome | None = None  # what the blast-radius limit said, where it was asked
    record: passes.Record | None = None  # gpu-tune's record of the node, as this pass found it

    @property
    def exit_code(self) -> int:
        """0 ready, 1 not ready; 0 for a prolog or an epilog the limit kept in service, whose
        failure would make slurmd drain the node itself (``Prolog error``, ``Epilog error``)."""
        if self.verdict.ready or (self.decision.action in (LIMITED, PUT_BACK) and self.context in HELD_CONTEXTS):
            return 0
        return 1

    @property
    def line(self) -> str:
        """What gpu-tune did in Slurm, in one line (stderr): what was done comes first, whatever
        the length of the node's name or the job id."""
        where = self.context + (f" of job {_short(self.job)}" if self.job else "")
        text = f"slurm node {_short(self.node)} ({where}): {self.decision.says}"
        if self.notes:
            text += "; " + "; ".join(self.notes)
        return clean(text, 1000)

    def as_dict(self) -> dict[str, Any]:
        return {"node": self.node, "named_by": self.named_by, "context": self.context, "job": self.job,
                "slurm_read": self.before is not None, "before": self.before.as_dict() if self.before else None,
                **self.decision.as_dict(), "ready_in_a_row": self.in_a_row, "done": self.done, "notes": self.notes,
                "limit": self.limit.as_dict() if self.limit else None, "exit_code": self.exit_code}


def _short(text: str) -> str:
    return text if len(text) <= SHOWN else f"{text[:SHOWN - 10]}...({len(text)} characters)"


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


def check_node_name(name: str | None, where: str = "--slurm-node") -> None:
    """One Slurm node name (no list, no space, no control character), and never what scontrol
    would take for an option (``-V``, ``--help``): checked before anything runs."""
    if name is None:
        return
    if not name.strip() or any(c.isspace() or c in ",[]" or not c.isprintable() for c in name):
        raise InputError(f"{where} {shown_name(name)}: expected one Slurm node name")
    if name.startswith("-"):
        raise InputError(f"{where} {shown_name(name)}: a node name does not start with '-' (scontrol would take it "
                         "for an option)")


def shown_name(name: str) -> str:
    return ascii(name if len(name) <= 80 else name[:80] + "...")


def check_names(flag: str | None, env: Mapping[str, str]) -> None:
    """The names this pass would use, ``--slurm-node`` and ``SLURMD_NODENAME``: checked before
    the checks run (exit 2, nothing written)."""
    check_node_name(flag)
    if flag is None and env.get("SLURMD_NODENAME", "").strip():
        check_node_name(env["SLURMD_NODENAME"].strip(), "SLURMD_NODENAME")


def node_name(flag: str | None, env: Mapping[str, str], scontrol: Scontrol | None,
              hostname: str | None = None) -> tuple[str, str]:
    """(the node's name in Slurm, where it came from)."""
    if flag is not None:
        check_node_name(flag)
        return flag, "--slurm-node"
    if env.get("SLURMD_NODENAME", "").strip():
        name = env["SLURMD_NODENAME"].strip()
        check_node_name(name, "SLURMD_NODENAME")
        return name, "SLURMD_NODENAME"
    if scontrol is None:
        raise InputError("no node name: give --slurm-node NAME")
    host = hostname or socket.gethostname()
    short = host.split(".")[0]
    nodes, count = scontrol.find_nodes(lambda n: n.hostname in (host, short) or n.name == short)
    for names, how in (({host, short}, "NodeHostName"), ({short}, "host name")):
        found = sorted({n.name for n in nodes if (n.hostname if how == "NodeHostName" else n.name) in names})
        if len(found) == 1:
            return found[0], f"{how} {host}"
        if len(found) > 1:
            raise InputError(f"Slurm has {len(found)} nodes with NodeHostName {host} ({', '.join(found[:10])}): "
                             "give --slurm-node NAME (slurmd's HealthCheckProgram passes SLURMD_NODENAME)")
    raise InputError(f"no Slurm node has NodeHostName {host} or the name {short} (`scontrol show node` lists "
                     f"{count}): give --slurm-node NAME")


def slurm_pass(fs: HostFS, verdict: Verdict, gpus: Sequence[GpuInfo], topology: Mapping[str, Any] | None, *,
               node_flag: str | None = None, env: Mapping[str, str] | None = None,
               scontrol: Scontrol | None = None, dry_run: bool = False) -> SlurmPass:
    """Judge the node for Slurm (:func:`judge_node`) and act (:func:`act`); a prolog or an epilog
    on the happy path decides from gpu-tune's record alone (:func:`from_record`). ``dry_run``:
    decide only, writing nothing to Slurm and nothing under the root (not the record either)."""
    env = dict(os.environ if env is None else env)
    rec = passes.read(fs)
    quiet = from_record(verdict, gpus, topology, node_flag=node_flag, env=env, rec=rec)
    if quiet is not None:
        return quiet
    sc = scontrol or Scontrol(env=env)
    out = judge_node(fs, verdict, gpus, topology, node_flag=node_flag, env=env, scontrol=sc, rec=rec)
    if dry_run:
        preview(sc, out)
    else:
        act(fs, sc, out)
    return out


def from_record(verdict: Verdict, gpus: Sequence[GpuInfo], topology: Mapping[str, Any] | None, *,
                node_flag: str | None, env: Mapping[str, str], rec: passes.Record | None) -> SlurmPass | None:
    """A prolog's or an epilog's pass without Slurm, or None where there is any doubt: not a
    prolog or an epilog, no name without asking Slurm, no record for this name, a record that
    does not positively say gpu-tune has not drained the node or keeps no ``Gres=``, or a host
    that is not ready (``slurm.gres`` judged against the kept ``Gres=`` included)."""
    context, job = context_of(env)
    if context not in HELD_CONTEXTS or not verdict.ready or rec is None:
        return None
    if node_flag is not None:
        name, named_by = node_flag, "--slurm-node"
    elif env.get("SLURMD_NODENAME", "").strip():
        name, named_by = env["SLURMD_NODENAME"].strip(), "SLURMD_NODENAME"
    else:
        return None
    if rec.node != name or rec.drained is not False or rec.gres is None:
        return None
    v = verdict.plus(gres_check(SlurmNode(name, "", gres=rec.gres), gpus, topology, kept=rec.at))
    if not v.ready:
        return None
    p = SlurmPass(name, named_by, context, job, None, v, Decision(NONE, "", "ready"), record=rec)
    p.notes.append(f"Slurm not asked: gpu-tune's record ({passes.PASSES}, {rec.at or 'undated'}) says it has not "
                   "drained this node")
    return p


def judge_node(fs: HostFS, verdict: Verdict, gpus: Sequence[GpuInfo], topology: Mapping[str, Any] | None, *,
               node_flag: str | None, env: Mapping[str, str], scontrol: Scontrol,
               rec: passes.Record | None = None) -> SlurmPass:
    """The node as Slurm has it, the verdict with ``slurm.gres``, the count, and what to do:
    reads only, writes nothing. :class:`SlurmUnreachable` or :class:`SlurmRefused` (the line
    ending "nothing changed") when Slurm cannot be read."""
    context, job = context_of(env)
    try:
        name, named_by = node_name(node_flag, env, scontrol)
        node = scontrol.show_node(name)
    except NoSuchNode as exc:
        raise InputError(f"{exc} (the name came from {named_by})") from None
    except (SlurmUnreachable, SlurmRefused) as exc:
        raise type(exc)(f"{exc}; nothing changed") from None
    v = verdict.plus(gres_check(node, gpus, topology))  # weighed by the profile's policy, as every check
    drain = passes.drain_of(node)
    n = passes.ready_before(fs, name, drain, rec) + 1 if v.ready else 0
    return SlurmPass(name, named_by, context, job, node, v, decide(v, node, n), in_a_row=n, drain=drain, record=rec)


def limit_of(v: Verdict) -> Any:
    """The profile's ``readiness.max_out_of_service`` (its default where the verdict has no policy)."""
    from gpu_tune.judge.policy import Policy

    return (v.policy or Policy()).limit


def preview(scontrol: Scontrol, p: SlurmPass) -> None:
    """A dry run's word from the limit: a drain it would refuse is said, counted as a real pass
    would count (one ``scontrol show node`` of every node), nothing written."""
    if p.decision.action != DRAIN or p.before is None:
        return
    limit = limit_of(p.verdict)
    store = SlurmFleet(scontrol, p.before, p.decision.reason)
    o = fleet_limit.report_only(limit) or _counted(lambda: fleet_limit.admit(limit, store.census(), p.node), store)
    p.limit = o
    if o.action == LIMIT:
        _hold(p, held_back(o.says, False))


def act(fs: HostFS, scontrol: Scontrol, p: SlurmPass) -> None:
    """Write what :func:`judge_node` decided: the update, then the record (which Slurm's answer
    does not change: a not-ready pass is 0 whether the drain lands or not), so that a pass
    whose update fails has written nothing. A resume is the other way round: its count is
    saved first, and a count that cannot be saved keeps the node drained. A drain goes through
    the limit; a drain of gpu-tune's still settling is counted again (:func:`_settle`)."""
    assert p.before is not None
    node, rec, limit = p.before, p.record, limit_of(p.verdict)
    drained, settling = ours(node), None
    if p.decision.action == RESUME:
        err = passes.record(fs, p.node, p.in_a_row, p.drain, drained=True, gres=node.gres)
        if err:
            p.decision = unsaved(node, err)
            return
        _update(scontrol, p, "RESUME", f"the ready-pass count was saved ({p.in_a_row} in a row)")
        passes.record(fs, p.node, p.in_a_row, p.drain, drained=False, gres=node.gres)
        return
    store = SlurmFleet(scontrol, node, p.decision.reason or drain_reason(p.verdict))
    since = None  # when the drain still settling was written
    if p.decision.action == DRAIN:
        o = fleet_limit.report_only(limit) or _counted(lambda: fleet_limit.take_out(store, p.node, limit), store)
    elif p.decision.action == REDRAIN:
        _update(scontrol, p, "DRAIN", "the ready-pass count was not written")
        o = fleet_limit.rewritten(store, p.node, limit)
    elif (p.decision.action in (NONE, HOLD) and drained and rec is not None and rec.node == p.node
          and (rec.settling is not None or rec.drained is False)):
        # a drain of gpu-tune's still settling, or one its record does not know (a write that got no
        # answer); never a node also set down (left alone: a resume would bring it back)
        since = settling = rec.settling if rec.settling is not None else time.time()
        o = _settle(store, p, limit, since)
    else:
        o = None
    if o is not None:
        p.limit = o
        drained = _apply(p, o)
        settling = (time.time() if since is None else since) if drained and not o.settled else None
    err = passes.record(fs, p.node, p.in_a_row, p.drain, drained=drained, gres=node.gres, settling=settling)
    if err:
        p.notes.append(f"the ready-pass count was not saved ({err}): no resume until it can be")


def _counted(step: Any, store: SlurmFleet) -> Outcome:
    """Run the limit's ``step``; a Slurm that fails it says what was changed."""
    try:
        return step()
    except (SlurmUnreachable, SlurmRefused) as exc:
        if not store.tried:
            raise type(exc)(f"{exc}; nothing changed") from None
        if isinstance(exc, NoAnswer):
            raise NoAnswer(f"{exc}: slurmctld may still apply it, the next pass reads the node again; the ready-pass "
                           "count was not written") from None
        raise type(exc)(f"{exc}; the node is as it was; the ready-pass count was not written") from None


def _settle(store: SlurmFleet, p: SlurmPass, limit: Any, since: float) -> Outcome | None:
    try:
        return fleet_limit.settle(store, p.node, limit, since, store.scontrol.timeout)
    except (SlurmUnreachable, SlurmRefused) as exc:
        p.notes.append(f"the limit's count could not be read ({exc}): the next pass counts again")
        return None


def _apply(p: SlurmPass, o: Outcome) -> bool:
    """The pass after the limit's outcome: its decision, its line, and whether gpu-tune's drain is
    on the node now."""
    if o.action == LIMIT:
        _hold(p, held_back(o.says, False))
        return False
    if o.action == PUT_BACK:
        _hold(p, held_back(o.says, True, ready=p.verdict.ready))
        p.done = True
        return False
    if p.decision.action in (DRAIN, REDRAIN):
        p.done = True
    if o.problem or o.action not in (TAKE, KEPT):
        p.notes.append(o.says)
    return o.action in (TAKE, KEPT)


def _hold(p: SlurmPass, d: Decision) -> None:
    """The limit keeps the node in service; a prolog or an epilog says why it exits 0."""
    p.decision = d
    if p.context in HELD_CONTEXTS and not p.verdict.ready:
        p.notes.append(f"exit 0: slurmd drains a node whose {p.context} fails ({p.context.capitalize()} error)")


def _update(scontrol: Scontrol, p: SlurmPass, state: str, count: str) -> None:
    """``scontrol update``; when it fails, the error says what is known of the node and the count."""
    try:
        scontrol.update(p.node, state, p.decision.reason)
    except NoAnswer as exc:
        raise NoAnswer(f"{exc}: slurmctld may still apply it, the next pass reads the node again; {count}") from None
    except (SlurmUnreachable, SlurmRefused) as exc:
        raise type(exc)(f"{exc}; the node is as it was; {count}") from None
    p.done = True
