"""The read-only HTTP API (CONTRACT §4), answered from the latest immutable snapshot.

A request never runs an audit or a probe and never changes the host: every body is rendered
once when the loop publishes a snapshot, so a request returns prepared bytes.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import __version__
from .metrics import render_metrics
from .readiness import Verdict

PROM_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
JSON_CONTENT_TYPE = "application/json"


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _dumps(obj: Any) -> bytes:
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
    """Everything the API serves, fixed at the end of a loop pass. Build with :meth:`build`."""

    node: str
    profile: str
    verdict: Verdict
    since: float  # when ``ready`` last changed (epoch seconds)
    created: float
    mode: str = "audit"
    audit: Mapping[str, Any] | None = None
    topology: Mapping[str, Any] | None = None
    gpus: tuple[Mapping[str, Any], ...] = ()
    probes: tuple[Mapping[str, Any], ...] = ()
    probe_last_success: Mapping[str, float] = field(default_factory=dict)
    collectors: tuple[CollectorStatus, ...] = ()
    # pre-rendered bodies
    readiness_body: bytes = b""
    metrics_body: bytes = b""
    audit_body: bytes = b""
    topology_body: bytes = b""
    probe_body: bytes = b""

    @property
    def readiness_status(self) -> int:
        return 200 if self.verdict.ready else 503

    def readiness_doc(self) -> dict[str, Any]:
        return {"ready": self.verdict.ready, "node": self.node, "profile": self.profile,
                "checks": [c.as_dict() for c in self.verdict.checks], "since": rfc3339(self.since)}

    @classmethod
    def build(cls, **kw: Any) -> "Snapshot":
        kw["gpus"] = tuple(kw.get("gpus") or ())
        kw["probes"] = tuple(kw.get("probes") or ())
        kw["collectors"] = tuple(kw.get("collectors") or ())
        kw["probe_last_success"] = dict(kw.get("probe_last_success") or {})
        snap = cls(**kw)
        bodies = {
            "readiness_body": _dumps(snap.readiness_doc()),
            "audit_body": _dumps(snap.audit) if snap.audit is not None else b"",
            "topology_body": _dumps(snap.topology) if snap.topology is not None else b"",
            "probe_body": _dumps([dict(p) for p in snap.probes]),
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
        self._not_ready_body = _dumps({
            "ready": False, "node": node, "profile": profile,
            "checks": [{"name": "agent.started", "ok": False,
                        "detail": "the agent has not completed its first pass yet"}],
            "since": rfc3339(time.time()),
        })
        self._empty_metrics = render_metrics(None)

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


# -- OpenAPI documentation models (responses are pre-rendered bytes of these shapes) ----------
class CheckModel(BaseModel):
    name: str
    ok: bool
    detail: str


class ReadinessModel(BaseModel):
    ready: bool
    node: str
    profile: str
    checks: list[CheckModel]
    since: str


class SettingModel(BaseModel):
    id: str
    target: str
    current: str | None
    desired: str
    status: str
    detail: str
    changed: bool | None = None


class AuditModel(BaseModel):
    profile: str
    compliant: bool
    settings: list[SettingModel]


class HealthModel(BaseModel):
    alive: bool
    detail: str


class ErrorModel(BaseModel):
    detail: str


def create_app(state: AgentState) -> FastAPI:
    app = FastAPI(
        title="gpu-tune agent",
        version=__version__,
        description="Read-only view of the node's tuning, topology, probe results and readiness.",
        redirect_slashes=False,
        # The schema is served at /openapi.json; no interactive pages (they load scripts from a
        # CDN, and this is a privileged node agent).
        docs_url=None,
        redoc_url=None,
    )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        headers = getattr(exc, "headers", None)
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        return JSONResponse({"detail": "malformed request"}, status_code=422)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:  # pragma: no cover
        return JSONResponse({"detail": f"unavailable: {type(exc).__name__}"}, status_code=503)

    def _missing(what: str) -> Response:
        return Response(_dumps({"detail": f"no {what} yet: the agent has not completed one"}),
                        status_code=503, media_type=JSON_CONTENT_TYPE)

    @app.get("/readiness", response_model=None, summary="Readiness verdict (200 ready, 503 not)",
             responses={200: {"model": ReadinessModel}, 503: {"model": ReadinessModel}})
    async def readiness() -> Response:
        snap = state.snapshot
        if snap is None:
            return Response(state._not_ready_body, status_code=503, media_type=JSON_CONTENT_TYPE)
        return Response(snap.readiness_body, status_code=snap.readiness_status, media_type=JSON_CONTENT_TYPE)

    @app.get("/healthz", response_model=None, summary="Liveness of the agent's loop (200 alive, 500 not)",
             responses={200: {"model": HealthModel}, 500: {"model": HealthModel}})
    async def healthz() -> Response:
        alive, detail = state.alive()
        return Response(_dumps({"alive": alive, "detail": detail}), status_code=200 if alive else 500,
                        media_type=JSON_CONTENT_TYPE)

    def _document(attr: str, what: str) -> Response:
        """A pre-rendered document of the latest snapshot, or 503 before the first pass."""
        snap = state.snapshot
        body = getattr(snap, attr, None) if snap is not None else None
        if not body:
            return _missing(what)
        return Response(body, media_type=JSON_CONTENT_TYPE)

    @app.get("/audit", response_model=None, summary="The latest audit document",
             responses={200: {"model": AuditModel}, 503: {"model": ErrorModel}})
    async def audit() -> Response:
        return _document("audit_body", "audit")

    @app.get("/topology", response_model=None, summary="The latest topology document",
             responses={200: {"description": "topology document"}, 503: {"model": ErrorModel}})
    async def topology() -> Response:
        return _document("topology_body", "topology")

    @app.get("/probe", response_model=None, summary="The latest probe results, one entry per GPU or the CPU run",
             responses={200: {"description": "list of probe verdicts"}, 503: {"model": ErrorModel}})
    async def probe() -> Response:
        snap = state.snapshot
        if snap is None:
            return _missing("probe result")
        return Response(snap.probe_body, media_type=JSON_CONTENT_TYPE)

    @app.get("/metrics", response_model=None, summary="Prometheus text exposition",
             responses={200: {"content": {PROM_CONTENT_TYPE: {}}}})
    async def metrics() -> Response:
        snap = state.snapshot
        body = snap.metrics_body if snap is not None else state._empty_metrics
        return Response(body, media_type=PROM_CONTENT_TYPE)

    # HEAD on every GET endpoint (uptime checkers, load balancers), kept out of the schema.
    from fastapi.routing import APIRoute

    for route in [r for r in app.routes if isinstance(r, APIRoute) and "GET" in r.methods]:
        app.add_api_route(route.path, route.endpoint, methods=["HEAD"], include_in_schema=False,
                          response_model=None)
    return app

