"""What one publish pass would change on the Node: pure, no Kubernetes client here.

:func:`plan_node` diffs a Node as the API server returned it (plain JSON) against the
:class:`~gpu_tune.cluster.labels.NodeWant`: the owned labels and annotations (stale owned labels
removed; labels not recorded in ``gpu-tune.io/owned-labels`` are never touched), the startup taint
(the taint list read, with only ours added or removed) and the ``GPUHostReady`` condition (written
when its status, reason or message differ, or its heartbeat is due). The facts a verdict reads
from the Node (device-plugin capacity, labels saying it has GPUs, the mode label) are read here
too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gpu_tune.cluster.labels import (
    ANNOTATION_OWNED,
    ANNOTATION_OWNED_TAINT,
    CONDITION_TYPE,
    FORBIDDEN_PREFIXES,
    PREFIX,
    NodeWant,
    is_valid_label_value,
)
from gpu_tune.timestamps import parse_rfc3339
from gpu_tune.tune.taint import DEFAULT_TAINT

GPU_RESOURCE = "nvidia.com/gpu"  # the NVIDIA device plugin's extended resource
# Labels others put on a Node that has NVIDIA GPUs: node-feature-discovery (PCI vendor 10de) and
# the GPU Operator's feature discovery. Read, never written.
GPU_PRESENT_LABELS = ("feature.node.kubernetes.io/pci-10de.present", "nvidia.com/gpu.present")
# The label that overrides the agent's --mode on one Node (see gpu_tune/serve/agent.py, docs/deploy.md).
MODE_LABEL = PREFIX + "mode"
# A new value of this label clears the node's fatal XIDs of this boot after a GPU reset (a person
# sets it: docs/health.md); the agent never writes it.
SET_HEALTHY_LABEL = PREFIX + "set-healthy"


def resource_count(node: dict[str, Any], where: str, resource: str = GPU_RESOURCE) -> int | None:
    """An extended resource's count in the Node's ``status.capacity`` or ``status.allocatable``
    (a quantity string such as ``"8"``); None when absent or not a whole number."""
    value = ((node.get("status") or {}).get(where) or {}).get(resource)
    if value is None:
        return None
    text = str(value).strip()
    return int(text) if text.isdigit() else None


def gpu_expected(node: dict[str, Any]) -> tuple[str, ...]:
    """Why the Node says it has NVIDIA GPUs: NFD's or the GPU Operator's label set to ``true``,
    or device-plugin capacity ``nvidia.com/gpu`` above 0 (empty: it says nothing of the kind)."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    why = [f"label {k}=true" for k in GPU_PRESENT_LABELS if str(labels.get(k, "")).lower() == "true"]
    cap = resource_count(node, "capacity")
    if cap:
        why.append(f"capacity {GPU_RESOURCE}={cap}")
    return tuple(why)


@dataclass(frozen=True)
class NodePlan:
    """What one pass would write. ``metadata_patch`` is a merge patch (without the
    resourceVersion) or None; ``condition`` the condition to write or None."""

    metadata_patch: dict[str, Any] | None
    condition: dict[str, str] | None
    transition: bool
    changed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    # the other conditions the agent keeps (the hardware condition, docs/health.md) that differ
    more_conditions: list[dict[str, str]] = field(default_factory=list)

    @property
    def conditions(self) -> list[dict[str, str]]:
        """Every condition to write in this pass's one status patch."""
        return ([self.condition] if self.condition is not None else []) + self.more_conditions


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _ident(t: Any) -> str | None:
    return f"{t.get('key')}:{t.get('effect')}" if isinstance(t, dict) else None


def _plan_taints(taints: list[Any], annotations: dict[str, Any], want: NodeWant, former: bool,
                 changed: list[str]) -> tuple[list[Any] | None, dict[str, Any]]:
    """The taint list to write (None: as it is) and the owned-taint record's patch.

    Only the agent's own taints are touched, each known by key and effect: the one it owns now
    (``want.taint``: added or removed as ``want.taint_wanted`` says), the default
    ``gpu-tune.io/not-ready:NoSchedule`` when another is owned now (gpu-tune's own prefix: nobody
    else's), and the one recorded in ``gpu-tune.io/owned-taint`` by an earlier configuration
    (``former`` False: left, the admission policy refused its removal). Both former ones go
    whatever the verdict: after a change of key the node carries the new one or none."""
    spec = want.taint
    if spec is None:  # taint handling off: the condition only
        return None, {}
    recorded = str(annotations.get(ANNOTATION_OWNED_TAINT) or "") or None
    gone = {DEFAULT_TAINT.ident, *([recorded] if recorded and former else [])} - {spec.ident}
    keep = [t for t in taints if _ident(t) not in gone]
    for t in taints:
        if _ident(t) in gone:
            changed.append(f"taint {_ident(t)} removed (a former key of gpu-tune's)")
    have = any(spec.matches(t) for t in keep)
    if want.taint_wanted is True and not have:
        keep.append(spec.as_taint())
        changed.append(f"taint {spec.ident} added")
    elif want.taint_wanted is False and have:
        keep = [t for t in keep if not spec.matches(t)]
        changed.append(f"taint {spec.ident} removed")
    record = None if spec.ident == DEFAULT_TAINT.ident else spec.ident
    patch: dict[str, Any] = {}
    if recorded != record:
        patch[ANNOTATION_OWNED_TAINT] = record
        changed.append(f"annotation {ANNOTATION_OWNED_TAINT} " + ("removed" if record is None else
                                                                   "updated" if recorded else "added"))
    return (keep if keep != taints else None), patch


def find_condition(node: dict[str, Any], ctype: str = CONDITION_TYPE) -> dict[str, Any] | None:
    for c in ((node.get("status") or {}).get("conditions") or []):
        if isinstance(c, dict) and c.get("type") == ctype:
            return c
    return None


def _age_s(stamp: Any, now_ts: float) -> float | None:
    """Seconds since an RFC 3339 time; None when it cannot be read."""
    then = parse_rfc3339(stamp)
    return None if then is None else now_ts - then


def plan_node(node: dict[str, Any], want: NodeWant, now: str | None = None, *,
              heartbeat_s: float | None = None, now_ts: float | None = None, former: bool = True) -> NodePlan:
    """Diff the Node as read against what is wanted. Writes only what differs, and the condition
    again when its ``lastHeartbeatTime`` is ``heartbeat_s`` old (None: never). ``former`` False
    leaves the taint of an earlier configuration (:func:`_plan_taints`)."""
    now = now or now_rfc3339()
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    changed: list[str] = []
    skipped: list[str] = []

    wanted_labels: dict[str, str] = {}
    for k, v in sorted(want.labels.items()):
        if not k.startswith(PREFIX) or k.startswith(FORBIDDEN_PREFIXES):
            skipped.append(f"label {k}: not under {PREFIX}")
        elif not isinstance(v, str) or not is_valid_label_value(v):
            skipped.append(f"label {k}: invalid value {v!r}")
        else:
            wanted_labels[k] = v
    owned_record = ",".join(sorted(wanted_labels))
    wanted_ann = {k: v for k, v in want.annotations.items() if k.startswith(PREFIX)}
    wanted_ann[ANNOTATION_OWNED] = owned_record

    label_patch: dict[str, Any] = {}
    for k, v in wanted_labels.items():
        if labels.get(k) != v:
            label_patch[k] = v
            changed.append(f"label {k}={v}" + (f" (was {labels[k]})" if k in labels else ""))
    previously_owned = [k.strip() for k in str(annotations.get(ANNOTATION_OWNED, "")).split(",") if k.strip()]
    for k in previously_owned:
        if k.startswith(PREFIX) and k not in wanted_labels and k in labels:
            label_patch[k] = None
            changed.append(f"label {k} removed (stale)")

    ann_patch: dict[str, Any] = {}
    for k, v in sorted(wanted_ann.items()):
        if annotations.get(k) != v:
            ann_patch[k] = v
            changed.append(f"annotation {k} {'updated' if k in annotations else 'added'}")

    taints = list((node.get("spec") or {}).get("taints") or [])
    new_taints, record = _plan_taints(taints, annotations, want, former, changed)
    ann_patch.update(record)

    patch: dict[str, Any] | None = None
    if label_patch or ann_patch or new_taints is not None:
        patch = {"metadata": {}}
        if label_patch:
            patch["metadata"]["labels"] = label_patch
        if ann_patch:
            patch["metadata"]["annotations"] = ann_patch
        if new_taints is not None:
            patch["spec"] = {"taints": new_taints}

    ts = time.time() if now_ts is None else now_ts
    cond, transition = _plan_condition(node, want.condition, CONDITION_TYPE, now, heartbeat_s, ts, changed)
    more = []
    for extra in want.more_conditions:
        c, _ = _plan_condition(node, extra, str(extra["type"]), now, heartbeat_s, ts, changed)
        if c is not None:
            more.append(c)
    return NodePlan(metadata_patch=patch, condition=cond, transition=transition, changed=changed, skipped=skipped,
                    more_conditions=more)


def _plan_condition(node: dict[str, Any], wc: dict[str, str], ctype: str, now: str, heartbeat_s: float | None,
                    now_ts: float, changed: list[str]) -> tuple[dict[str, str] | None, bool]:
    """The condition ``ctype`` to write (None: as it is), and whether its status changes."""
    cur = find_condition(node, ctype)
    cond: dict[str, str] | None = None
    transition = False
    if cur is None or any(cur.get(k) != wc.get(k) for k in ("status", "reason", "message")):
        transition = cur is None or cur.get("status") != wc.get("status")
        cond = {
            "type": ctype,
            "status": wc.get("status", "Unknown"),
            "reason": wc.get("reason", ""),
            "message": wc.get("message", ""),
            "lastHeartbeatTime": now,
            "lastTransitionTime": now if transition else (cur or {}).get("lastTransitionTime") or now,
        }
        if cur is None:
            changed.append(f"condition {ctype}={cond['status']} ({cond['reason']}) added")
        elif transition:
            changed.append(f"condition {ctype}: {cur.get('status')} -> {cond['status']} ({cond['reason']})")
        else:
            changed.append(f"condition {ctype} reason/message updated ({cond['reason']})")
    elif heartbeat_s is not None and heartbeat_s > 0:
        age = _age_s(cur.get("lastHeartbeatTime"), now_ts)
        if age is None or age >= heartbeat_s:
            cond = {"type": ctype, **{k: cur.get(k, "") for k in ("status", "reason", "message")},
                    "lastHeartbeatTime": now, "lastTransitionTime": cur.get("lastTransitionTime") or now}
            changed.append(f"condition {ctype} heartbeat" + (f" ({age:.0f}s since the last)" if age is not None else ""))
    return cond, transition

