"""What one publish pass did (:class:`PublishResult`) and the record it is made from (:class:`PassRecord`),
apart from :mod:`gpu_tune.cluster.publisher` that makes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpu_tune.cluster.dra import DRIVER, DraCount
from gpu_tune.cluster.node_diff import MODE_LABEL, SET_HEALTHY_LABEL, find_condition, gpu_expected, resource_count

@dataclass(frozen=True)
class PublishResult:
    """One publish pass: ``writes`` write calls made (attempts included), ``changed`` what
    changed (or would, on a dry run), ``ok`` and ``detail`` for the ``publish`` check.

    ``node_read`` says whether the Node was read this pass; ``gpu_capacity`` and
    ``gpu_allocatable`` are its ``status.capacity`` / ``status.allocatable`` of
    ``nvidia.com/gpu`` as read (None: the Node has no such resource, i.e. no device plugin) —
    the facts the ``gpu.allocatable`` readiness check judges."""

    writes: int
    changed: list[str]
    ok: bool
    detail: str
    reads: int = 0
    node_read: bool = False
    gpu_capacity: int | None = None
    gpu_allocatable: int | None = None
    gpu_expected: tuple[str, ...] = ()
    mode_request: str | None = None
    condition_status: str | None = None
    # the Node's gpu-tune.io/set-healthy label: a new value clears this boot's fatal XIDs
    # (docs/health.md), as `gpu-tune set-healthy` does on the node
    set_healthy: str | None = None
    # a Node without nvidia.com/gpu capacity: its GPUs in NVIDIA's DRA driver's ResourceSlices
    # (None: not looked at, or the resource.k8s.io/v1 API is not served), or why they could not be listed
    dra: DraCount | None = None
    dra_error: str | None = None
    # the blast-radius limit's outcome where this pass would take the node out (gpu_tune.cluster.limit)
    limit: Any = None

    def as_check(self) -> dict[str, Any]:
        return {"name": "publish", "ok": self.ok, "detail": self.detail}

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "detail": self.detail, "writes": self.writes, "reads": self.reads,
                "changed": list(self.changed), "node_read": self.node_read,
                "gpu_capacity": self.gpu_capacity, "gpu_allocatable": self.gpu_allocatable,
                "gpu_expected": list(self.gpu_expected), "mode_request": self.mode_request,
                "condition_status": self.condition_status, "set_healthy": self.set_healthy,
                "dra": self.dra.as_dict() if self.dra is not None else None, "dra_error": self.dra_error,
                "limit": self.limit.as_dict() if self.limit is not None else None}


@dataclass
class PassRecord:
    reads: int = 0
    writes: int = 0
    changed: list[str] = field(default_factory=list)
    node: dict[str, Any] | None = None  # the Node as last read this pass
    first: dict[str, Any] | None = None  # the Node as first read this pass (before our writes)
    dra: tuple[bool, DraCount | None, str | None] = (False, None, None)  # (looked, count, error)
    limit: Any = None  # the blast-radius limit's outcome, where it was asked

    def result(self, ok: bool, detail: str) -> PublishResult:
        node = self.node
        if node is None:
            return PublishResult(writes=self.writes, changed=self.changed, ok=ok, detail=detail, reads=self.reads,
                                 limit=self.limit)
        cond = find_condition(self.first or node)
        node_labels = (node.get("metadata") or {}).get("labels") or {}
        mode = node_labels.get(MODE_LABEL)
        clear = node_labels.get(SET_HEALTHY_LABEL)
        _, dra, dra_error = self.dra
        why = gpu_expected(node) + ((f"ResourceSlices of {DRIVER}: {dra.gpus} GPU(s)",) if dra and dra.gpus else ())
        return PublishResult(writes=self.writes, changed=self.changed, ok=ok, detail=detail, reads=self.reads,
                             node_read=True, gpu_capacity=resource_count(node, "capacity"),
                             gpu_allocatable=resource_count(node, "allocatable"), gpu_expected=why,
                             mode_request=str(mode) if mode is not None else None,
                             condition_status=None if cond is None else str(cond.get("status")),
                             set_healthy=str(clear) if clear else None, dra=dra, dra_error=dra_error, limit=self.limit)
