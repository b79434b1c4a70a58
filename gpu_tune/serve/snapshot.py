"""What one pass of the agent leaves behind: an immutable :class:`Snapshot`, and the
:class:`AgentState` the loop and the HTTP API share.

Every body the API serves (readiness, audit, topology, probe, the Prometheus exposition) is
rendered once here, when the loop builds a snapshot, so a request only returns prepared bytes.
The HTTP layer (``gpu_tune/serve/app.py``) and the exposition (``gpu_tune/serve/metrics.py``) both depend on this
module; it depends on neither's web framework.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from gpu_tune.serve.metrics import render_metrics
from gpu_tune.judge.readiness import Verdict
from gpu_tune.timestamps import format_rfc3339 as rfc3339


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=False).encode()


@dataclass(frozen=True)
class CollectorStatus:
    """How one stage of the loop went in its latest run."""

    name: str
    success: bool
    duration: float
    error: str = ""


@dataclass(frozen=True)
class Snapshot:
    """Everything the API serves, fixed at the end of a loop pass. Build with :meth:`build`.

    ``metrics_detail`` adds the per-target series (one per CPU, IRQ, GPU of a setting), the
    per-stage collector series and the launch-bound busy ratio to the exposition; off by default
    (see ``gpu-tune serve --metrics-detail``).
    """

    node: str
    profile: str
    verdict: Verdict
    since: float  # when ``ready`` last changed (epoch seconds)
    created: float
    mode: str = "audit"
    agent_ready: bool = False  # the pod's readiness (GET /agent-ready), not the node's
    agent_ready_detail: str = ""
    audit: Mapping[str, Any] | None = None
    topology: Mapping[str, Any] | None = None
    gpus: tuple[Mapping[str, Any], ...] = ()
    probes: tuple[Mapping[str, Any], ...] = ()
    probe_last_success: Mapping[str, float] = field(default_factory=dict)
    collectors: tuple[CollectorStatus, ...] = ()
    metrics_detail: bool = False
    # the latest `gpu-tune gain` document (measured once per start in enforce mode), or None
    gain: Mapping[str, Any] | None = None
    # the health readings of the pass (docs/health.md): host files, and what is remembered
    host: Any = None
    history: Any = None
    # the evidence of this pass's hardware findings (docs/health.md "Evidence"): /readiness's
    # ``evidence``, there only when a finding keeps some or it could not be kept
    evidence: Mapping[str, Any] | None = None
    # the blast-radius limit's outcome (gpu_tune.judge.fleet_limit.Outcome) where this pass would take
    # the node out: /readiness's ``limit`` and the gpu_tune_out_of_service_* metrics; None otherwise
    limit: Any = None
    # pre-rendered bodies
    readiness_body: bytes = b""
    metrics_body: bytes = b""
    audit_body: bytes = b""
    topology_body: bytes = b""
    probe_body: bytes = b""
    agent_ready_body: bytes = b""
    gain_body: bytes = b""

    @property
    def readiness_status(self) -> int:
        return 200 if self.verdict.ready else 503

    def readiness_doc(self) -> dict[str, Any]:
        return {"ready": self.verdict.ready, "node": self.node, "profile": self.profile,
                "reason": self.verdict.reason(), "message": self.verdict.message(),
                "checks": [c.as_dict() for c in self.verdict.checks], "since": rfc3339(self.since),
                **self.verdict.policy_doc(), **({"evidence": dict(self.evidence)} if self.evidence else {}),
                **({"limit": self.limit.as_dict()} if self.limit is not None else {})}

    @classmethod
    def build(cls, **kw: Any) -> "Snapshot":
        kw["gpus"] = tuple(kw.get("gpus") or ())
        kw["probes"] = tuple(kw.get("probes") or ())
        kw["collectors"] = tuple(kw.get("collectors") or ())
        kw["probe_last_success"] = dict(kw.get("probe_last_success") or {})
        snap = cls(**kw)
        bodies = {
            "readiness_body": dumps(snap.readiness_doc()),
            "audit_body": dumps(snap.audit) if snap.audit is not None else b"",
            "topology_body": dumps(snap.topology) if snap.topology is not None else b"",
            "probe_body": dumps([dict(p) for p in snap.probes]),
            "agent_ready_body": dumps({"ready": snap.agent_ready, "node": snap.node, "mode": snap.mode,
                                       "detail": snap.agent_ready_detail}),
            "gain_body": dumps(snap.gain) if snap.gain is not None else b"",
        }
        for k, v in bodies.items():
            object.__setattr__(snap, k, v)
        object.__setattr__(snap, "metrics_body", render_metrics(snap))
        return snap


class AgentState:
    """The latest snapshot and the loop's liveness, shared by the loop and the API.

    The snapshot is swapped whole (one attribute assignment), so a reader sees either the old or
    the new one. ``alive()`` is false once no pass has completed within ``3 x interval`` (plus a
    grace period for one slow pass).
    """

    def __init__(self, node: str, profile: str, interval: float, *, grace: float = 10.0,
                 clock=time.monotonic) -> None:
        self.node = node
        self.profile = profile
        self.interval = float(interval)
        self.grace = grace
        self.clock = clock
        self.started = clock()
        self.last_pass: float | None = None
        self.passes = 0
        self.snapshot: Snapshot | None = None
        self._lock = threading.Lock()
        self.not_ready_body = dumps({
            "ready": False, "node": node, "profile": profile, "reason": "AgentStarting",
            "message": "agent.started: the agent has not completed its first pass yet",
            "checks": [{"name": "agent.started", "ok": False, "severity": "fatal",
                        "detail": "the agent has not completed its first pass yet"}],
            "since": rfc3339(time.time()),
        })
        self.empty_metrics = render_metrics(None)

    def publish(self, snap: Snapshot) -> None:
        with self._lock:
            self.snapshot = snap
            self.last_pass = self.clock()
            self.passes += 1

    def alive(self) -> tuple[bool, str]:
        now = self.clock()
        limit = 3 * self.interval + self.grace
        ref = self.last_pass if self.last_pass is not None else self.started
        age = now - ref
        if age <= limit:
            what = "last pass" if self.last_pass is not None else "started"
            return True, f"{what} {age:.1f}s ago"
        if self.last_pass is None:
            return False, f"no pass completed in {age:.1f}s (limit {limit:.0f}s)"
        return False, f"last pass completed {age:.1f}s ago (limit {limit:.0f}s)"
