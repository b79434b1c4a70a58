"""``gpu-tune fleet``: every GPU node's readiness as the agents published it. Pure: it judges and
renders Node objects as the API server returns them (``gpu_tune/cluster/publisher.py`` lists them).

What a node shows, and where it comes from (all written by the agent: docs/cli.md, ``gpu-tune label``):

==============  ===================================================================================
status          ``Ready`` / ``NotReady`` from the ``GPUHostReady`` condition; ``NotReporting`` (below)
since           the condition's ``lastTransitionTime`` (when readiness last changed)
profile         label ``gpu-tune.io/profile``, and ``@`` the first 8 hex digits of the annotation
                ``gpu-tune.io/profile-digest`` (the profile as loaded: nodes running different
                policies under one name show different digests)
GPUs            labels ``gpu-tune.io/gpu-count`` and ``gpu-tune.io/gpu-product`` (else the GPU
                Operator's ``nvidia.com/gpu.count`` / ``nvidia.com/gpu.product``, else the Node's
                ``nvidia.com/gpu`` capacity). On a GPU node where the agent sees no GPU
                (``gpu-count`` 0) the other sources give the count and model, and the column
                says so: ``8x NVIDIA-H100-80GB-HBM3, agent sees 0``, or ``GPU node, agent sees 0``
                when nothing else gives a count
drift           ``drift`` of the annotation ``gpu-tune.io/summary``: audit rows in drift, conflict
                or error
probe           ``probe`` of the summary: how many targets passed (the images/s are not on the
                Node: they vary from run to run; see the agents' metrics)
gain            ``gain`` of the summary: the tuning gain the agent measured at its start (``gpu-tune
                gain``), as ``+5%`` (a gain), ``LOSS -8%``, ``~0%`` (no significant difference),
                ``?`` (inconclusive); ``-`` when not measured. Per GPU model, the median images/s
                ratio over its nodes with a measured ratio
reasons         ``failing`` of the summary: each failing check and its detail (an agent without the
                summary annotation: the check names of the condition's message), with the severity it
                ran with and the profile's key where the profile set it (``weights`` of the summary:
                ``[warning readiness.checks.network.infiniband]``)
==============  ===================================================================================

A node is listed when it runs the agent (a ``GPUHostReady`` condition, or ``gpu-tune.io/`` labels)
or is a GPU node (``nvidia.com/gpu.present=true`` from the GPU Operator, or Node Feature
Discovery's ``feature.node.kubernetes.io/pci-10de.present=true``). ``NotReporting`` is a GPU node
with no ``GPUHostReady`` condition, a condition whose ``lastHeartbeatTime`` is older than
``stale_after_s`` (the agent re-writes it at least every 10 minutes, so 30 minutes by default
means three missed heartbeats: the agent is not running there), or a node whose kubelet stopped
reporting (its ``Ready`` condition ``Unknown``). A kubelet that reports ``Ready=False`` makes the
node ``NotReady`` with the reason ``node.Ready``.

The exit status: 0 when every listed node is ready (none listed included), 1 otherwise.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from gpu_tune.cluster.labels import (
    ANNOTATION_DIGEST,
    ANNOTATION_SUMMARY,
    CONDITION_TYPE,
    LABEL_GPU_COUNT,
    LABEL_GPU_PRODUCT,
    LABEL_PROFILE,
    PREFIX,
)
from gpu_tune.timestamps import format_rfc3339 as _rfc3339
from gpu_tune.timestamps import parse_rfc3339 as _epoch

GPU_NODE_LABELS = ("nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present")
STALE_AFTER_S = 30 * 60.0
READY, NOT_READY, NOT_REPORTING = "Ready", "NotReady", "NotReporting"
STATUS_ORDER = (READY, NOT_REPORTING, NOT_READY)  # table order: problems last, next to the summary
MAX_TABLE_DETAIL = 70  # characters of a failing check's detail in the table (-o json has it whole)


@dataclass(frozen=True)
class FleetNode:
    name: str
    status: str
    since: str | None = None
    heartbeat: str | None = None
    profile: str | None = None
    gpu_model: str = "unknown"
    gpu_count: int | None = None
    drift: int | None = None
    probe: Mapping[str, Any] = field(default_factory=dict)
    failing: tuple[Mapping[str, str], ...] = ()
    reason: str = ""  # why NotReporting
    warnings: tuple[str, ...] = ()  # the failing warning checks' names (never gating)
    gain: Mapping[str, Any] = field(default_factory=dict)  # the summary's gain: verdict, ratio, ci95
    agent_gpu_count: int | None = None  # the agent's own count (label gpu-tune.io/gpu-count)
    agent_sees_none: bool = False  # a GPU node (labels, device-plugin capacity) where the agent sees no GPU
    profile_digest: str | None = None  # annotation gpu-tune.io/profile-digest
    weights: Mapping[str, str] = field(default_factory=dict)  # check -> "severity key", where the profile set it

    def profile_text(self) -> str:
        """The PROFILE column: ``training@73e73197``."""
        digest = (self.profile_digest or "").split(":", 1)[-1][:8]
        return f"{self.profile or '-'}@{digest}" if digest else (self.profile or "-")

    def gpus_text(self) -> str:
        """The GPUS column."""
        if self.agent_sees_none:
            model = "GPU" if self.gpu_model == "unknown" else self.gpu_model
            known = f"{self.gpu_count}x {model}" if self.gpu_count else "GPU node"
            return f"{known}, agent sees 0"
        return f"{self.gpu_count if self.gpu_count is not None else '?'}x {self.gpu_model}"

    def gain_text(self) -> str:
        v = self.gain.get("verdict")
        r = self.gain.get("ratio")
        pct = f"{(r - 1) * 100:+.0f}%" if isinstance(r, (int, float)) and not isinstance(r, bool) else ""
        if not v:
            return "-"
        if v == "loss":
            return f"LOSS {pct}".strip()
        if v == "gain":
            return pct or "gain"
        if v == "no significant difference":
            return "~0%"
        return "?" if v == "inconclusive" else str(v)

    @property
    def ready(self) -> bool:
        return self.status == READY

    def probe_counts(self) -> tuple[int, int]:
        """(passed, targets)."""
        entries = [e for e in self.probe.values() if isinstance(e, Mapping)]
        return sum(1 for e in entries if e.get("status") == "passed"), len(entries)

    def as_dict(self) -> dict[str, Any]:
        passed, total = self.probe_counts()
        return {"node": self.name, "status": self.status, "ready": self.ready, "since": self.since,
                "heartbeat": self.heartbeat, "profile": self.profile, "gpu_model": self.gpu_model,
                "gpu_count": self.gpu_count, "agent_gpu_count": self.agent_gpu_count,
                "agent_sees_none": self.agent_sees_none, "drift": self.drift,
                "probe": {"passed": passed, "targets": total, "by_target": dict(self.probe)},
                "failing": [dict(f) for f in self.failing], "reason": self.reason, "warnings": list(self.warnings),
                "gain": dict(self.gain) or None, "profile_digest": self.profile_digest, "weights": dict(self.weights)}


@dataclass(frozen=True)
class ModelSummary:
    gpu_model: str
    nodes: int
    ready: int
    not_ready: int
    not_reporting: int
    gain_median_ratio: float | None = None  # median images/s ratio over nodes with a measured one
    gain_nodes: int = 0
    gain_losses: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"gpu_model": self.gpu_model, "nodes": self.nodes, "ready": self.ready,
                "not_ready": self.not_ready, "not_reporting": self.not_reporting,
                "gain": {"median_ratio": self.gain_median_ratio, "nodes_measured": self.gain_nodes,
                         "losses": self.gain_losses}}


@dataclass(frozen=True)
class FleetReport:
    nodes: tuple[FleetNode, ...]
    models: tuple[ModelSummary, ...]
    listed: int  # Nodes the API server returned (GPU or not)
    stale_after_s: float
    generated_at: float

    @property
    def all_ready(self) -> bool:
        return all(n.ready for n in self.nodes)

    @property
    def exit_code(self) -> int:
        return 0 if self.all_ready else 1

    def as_dict(self) -> dict[str, Any]:
        return {"ready": self.all_ready, "generated_at": _rfc3339(self.generated_at),
                "stale_after_seconds": self.stale_after_s, "nodes_listed": self.listed,
                "summary": [m.as_dict() for m in self.models], "nodes": [n.as_dict() for n in self.nodes]}


# -- judging ----------------------------------------------------------------------------------
def _condition(node: Mapping[str, Any], ctype: str) -> Mapping[str, Any] | None:
    for c in ((node.get("status") or {}).get("conditions") or []):
        if isinstance(c, Mapping) and c.get("type") == ctype:
            return c
    return None


def _int(v: Any) -> int | None:
    try:
        return int(str(v).strip())
    except (TypeError, ValueError):
        return None


def _summary(annotations: Mapping[str, Any]) -> Mapping[str, Any]:
    try:
        doc = json.loads(annotations.get(ANNOTATION_SUMMARY) or "{}")
    except (TypeError, ValueError):
        return {}
    return doc if isinstance(doc, Mapping) else {}


def is_gpu_node(labels: Mapping[str, str]) -> bool:
    return any(str(labels.get(k, "")).lower() == "true" for k in GPU_NODE_LABELS)


def age(seconds: float | None) -> str:
    """kubectl's short age: 45s, 12m, 5h3m, 3d4h."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 120:
        return f"{s}s"
    m = s // 60
    if m < 60:
        return f"{m}m"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h{m}m" if m and h < 10 else f"{h}h"
    d, h = divmod(h, 24)
    return f"{d}d{h}h" if h and d < 10 else f"{d}d"


def judge_node(node: Mapping[str, Any], *, now: float, stale_after_s: float = STALE_AFTER_S) -> FleetNode | None:
    """The fleet row of one Node object, or None when it neither runs the agent nor is a GPU node."""
    meta = node.get("metadata") or {}
    name = str(meta.get("name") or "?")
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    cond = _condition(node, CONDITION_TYPE)
    runs_agent = cond is not None or any(str(k).startswith(PREFIX) for k in labels)
    if not runs_agent and not is_gpu_node(labels):
        return None
    summary = _summary(annotations)
    capacity = (node.get("status") or {}).get("capacity") or {}
    agent_count = _int(labels.get(LABEL_GPU_COUNT))
    others = _int(labels.get("nvidia.com/gpu.count"))
    if others is None:
        others = _int(capacity.get("nvidia.com/gpu"))
    count = agent_count if agent_count is not None else others
    sees_none = agent_count == 0 and (is_gpu_node(labels) or (others or 0) > 0)
    if sees_none:
        count = others  # a GPU node where the agent sees none: what the rest of the cluster says
    model = labels.get(LABEL_GPU_PRODUCT) or labels.get("nvidia.com/gpu.product") or "unknown"
    drift = summary.get("drift")
    probe = summary.get("probe")
    gain = summary.get("gain")
    weights = summary.get("weights")
    digest = annotations.get(ANNOTATION_DIGEST)
    base = dict(name=name, profile=labels.get(LABEL_PROFILE), gpu_model=str(model), gpu_count=count,
                profile_digest=str(digest)[:80] if isinstance(digest, str) and digest else None,
                weights={str(k): str(v) for k, v in weights.items()} if isinstance(weights, Mapping) else {},
                agent_gpu_count=agent_count, agent_sees_none=sees_none,
                drift=drift if isinstance(drift, int) and not isinstance(drift, bool) else None,
                probe=probe if isinstance(probe, Mapping) else {},
                gain=gain if isinstance(gain, Mapping) else {},
                since=(cond or {}).get("lastTransitionTime"), heartbeat=(cond or {}).get("lastHeartbeatTime"))

    kubelet = _condition(node, "Ready")
    if cond is None:
        return FleetNode(status=NOT_REPORTING, reason="no GPUHostReady condition: the agent has not "
                         "published from this node (is its DaemonSet pod running there?)", **base)
    if kubelet is not None and kubelet.get("status") == "Unknown":
        return FleetNode(status=NOT_REPORTING, reason=f"the node itself is not reporting (kubelet Ready "
                         f"Unknown: {kubelet.get('reason') or 'no reason'})", **base)
    beat = _epoch(cond.get("lastHeartbeatTime"))
    if beat is None or now - beat > stale_after_s:
        last = "never" if beat is None else f"{age(now - beat)} ago"
        return FleetNode(status=NOT_REPORTING, reason=f"stale: GPUHostReady last written {last} (older than "
                         f"{age(stale_after_s)}): the agent is not running there", **base)

    failing: list[Mapping[str, str]] = []
    if cond.get("status") != "True":
        raw = summary.get("failing")
        if isinstance(raw, list) and raw:
            failing = [{"check": str(f.get("check", "?")), "detail": str(f.get("detail", ""))}
                       for f in raw if isinstance(f, Mapping)]
            if isinstance(summary.get("failing_more"), int):
                failing.append({"check": "…", "detail": f"and {summary['failing_more']} more failing checks"})
        else:  # an agent without the summary annotation: the check names of the message
            msg = str(cond.get("message") or "")
            names = msg.split(":", 1)[1] if msg.startswith("failed:") else ""
            failing = [{"check": n.strip(), "detail": ""} for n in names.split(",") if n.strip()] or \
                [{"check": str(cond.get("reason") or "GPUHostReady"), "detail": msg}]
    if kubelet is not None and kubelet.get("status") == "False":
        failing.append({"check": "node.Ready", "detail": f"kubelet: {kubelet.get('reason') or ''} "
                                                          f"{kubelet.get('message') or ''}".strip()})
    status = READY if cond.get("status") == "True" and not failing else NOT_READY
    warn = summary.get("warnings")
    warnings = tuple(str(w) for w in warn if isinstance(w, str))[:24] if isinstance(warn, list) else ()
    return FleetNode(status=status, failing=tuple(failing), warnings=warnings, **base)


def fleet_report(nodes: Iterable[Mapping[str, Any]], *, now: float | None = None,
                 stale_after_s: float = STALE_AFTER_S) -> FleetReport:
    now = time.time() if now is None else now
    return report_of((judge_node(n, now=now, stale_after_s=stale_after_s) for n in nodes), now=now,
                     stale_after_s=stale_after_s)


def report_of(judged: Iterable[FleetNode | None], *, now: float, stale_after_s: float = STALE_AFTER_S) -> FleetReport:
    """The report of Nodes already judged (:func:`judge_node`: None for a Node not listed), so that
    a caller can judge each Node as its page arrives and let its JSON go."""
    listed = 0
    rows: list[FleetNode] = []
    for row in judged:
        listed += 1
        if row is not None:
            rows.append(row)
    rows.sort(key=lambda r: (STATUS_ORDER.index(r.status), r.name))
    by_model: dict[str, list[FleetNode]] = {}
    for r in rows:
        by_model.setdefault(r.gpu_model, []).append(r)
    models = tuple(ModelSummary(m, len(rs), sum(r.status == READY for r in rs),
                                sum(r.status == NOT_READY for r in rs), sum(r.status == NOT_REPORTING for r in rs),
                                *_gain_of(rs))
                   for m, rs in sorted(by_model.items()))
    return FleetReport(tuple(rows), models, listed, stale_after_s, now)


def _gain_of(rows: list[FleetNode]) -> tuple[float | None, int, int]:
    """(median images/s ratio over the nodes that have one, how many, how many show a loss)."""
    ratios = sorted(float(r.gain["ratio"]) for r in rows
                    if isinstance(r.gain.get("ratio"), (int, float)) and not isinstance(r.gain.get("ratio"), bool))
    losses = sum(1 for r in rows if r.gain.get("verdict") == "loss")
    if not ratios:
        return None, 0, losses
    k = len(ratios) // 2
    med = ratios[k] if len(ratios) % 2 else (ratios[k - 1] + ratios[k]) / 2
    return round(med, 3), len(ratios), losses


# -- rendering --------------------------------------------------------------------------------
def _reasons(row: FleetNode) -> str:
    if row.status == NOT_REPORTING:
        return row.reason
    parts = []
    for f in row.failing:
        d = " ".join(str(f.get("detail", "")).split())
        d = d if len(d) <= MAX_TABLE_DETAIL else d[:MAX_TABLE_DETAIL - 1] + "…"
        name = _weighed(row, str(f.get("check")))
        parts.append(f"{name}: {d}" if d else name)
    if row.warnings:
        parts.append(f"warnings: {', '.join(_weighed(row, w) for w in row.warnings)}")
    off = sorted(n for n, w in row.weights.items() if w.startswith("off "))
    if off:
        parts.append(f"off: {', '.join(off)}")
    return "; ".join(parts)


def _weighed(row: FleetNode, check: str) -> str:
    """A check's name, with its weight where the profile set it: ``gpu.inforom [fatal readiness.checks.gpu.inforom]``."""
    w = row.weights.get(check)
    return f"{check} [{w}]" if w else check


def render_table(report: FleetReport) -> str:
    """kubectl-style columns, one node per line (ready ones first, problems last), then one
    summary line per GPU model and a total."""
    head = ("NODE", "STATUS", "SINCE", "PROFILE", "GPUS", "DRIFT", "PROBE", "GAIN", "REASONS")
    lines = [head]
    for r in report.nodes:
        since = _epoch(r.since)
        passed, total = r.probe_counts()
        gpus = r.gpus_text()
        lines.append((r.name, r.status, age(report.generated_at - since) if since else "-", r.profile_text(), gpus,
                      "-" if r.drift is None else str(r.drift), f"{passed}/{total}" if total else "-",
                      r.gain_text(), _reasons(r)))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head) - 1)]
    out = ["  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1] for row in lines]
    out = [line.rstrip() for line in out] if report.nodes else []
    out.append("")
    for m in report.models:
        gain = ""
        if m.gain_median_ratio is not None:
            gain = (f"; median tuning gain {(m.gain_median_ratio - 1) * 100:+.1f}% over {m.gain_nodes} "
                    f"node{'s' if m.gain_nodes != 1 else ''}")
        if m.gain_losses:
            gain += f"; LOSS on {m.gain_losses} node{'s' if m.gain_losses != 1 else ''}"
        out.append(f"{m.gpu_model}: {m.nodes} node{'s' if m.nodes != 1 else ''}: {m.ready} ready, "
                   f"{m.not_ready} not ready, {m.not_reporting} not reporting{gain}")
    total = len(report.nodes)
    ready = sum(r.ready for r in report.nodes)
    if total:
        out.append(f"total: {total} GPU node{'s' if total != 1 else ''}, {ready} ready, "
                   f"{sum(r.status == NOT_READY for r in report.nodes)} not ready, "
                   f"{sum(r.status == NOT_REPORTING for r in report.nodes)} not reporting "
                   f"({report.listed} nodes listed)")
    else:
        out.append(f"no GPU nodes: none of the {report.listed} nodes listed runs the agent or carries "
                   f"{' or '.join(k + '=true' for k in GPU_NODE_LABELS)}")
    return "\n".join(out).lstrip("\n") + "\n"
