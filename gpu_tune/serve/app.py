"""The read-only HTTP API (docs/cli.md, ``gpu-tune serve``), answered from the latest immutable snapshot.

A request never runs an audit or a probe and never changes the host: every body is rendered
once when the loop publishes a snapshot (``gpu_tune/serve/snapshot.py``), so a request returns prepared
bytes.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpu_tune import __version__
from gpu_tune.serve.snapshot import AgentState
from gpu_tune.serve.snapshot import dumps as _dumps

PROM_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
JSON_CONTENT_TYPE = "application/json"


def _doc(model: str) -> dict[str, Any]:
    """A response documented by one of :mod:`gpu_tune.serve.openapi_docs`' models, named by
    reference: the models are made only when /openapi.json is first asked for (:func:`create_app`)."""
    return {"content": {JSON_CONTENT_TYPE: {"schema": {"$ref": f"#/components/schemas/{model}"}}}}


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
             responses={200: _doc("ReadinessModel"), 503: _doc("ReadinessModel")})
    async def readiness() -> Response:
        snap = state.snapshot
        if snap is None:
            return Response(state.not_ready_body, status_code=503, media_type=JSON_CONTENT_TYPE)
        return Response(snap.readiness_body, status_code=snap.readiness_status, media_type=JSON_CONTENT_TYPE)

    @app.get("/agent-ready", response_model=None,
             summary="The agent pod's readiness, for its readinessProbe (200 ready, 503 not): it completed a "
                     "pass and published it, and did not turn a node that was ready into a not-ready one",
             responses={200: _doc("AgentReadyModel"), 503: _doc("AgentReadyModel")})
    async def agent_ready() -> Response:
        snap = state.snapshot
        if snap is None:
            return Response(_dumps({"ready": False, "node": state.node, "mode": "",
                                    "detail": "the agent has not completed its first pass yet"}),
                            status_code=503, media_type=JSON_CONTENT_TYPE)
        return Response(snap.agent_ready_body, status_code=200 if snap.agent_ready else 503,
                        media_type=JSON_CONTENT_TYPE)

    @app.get("/healthz", response_model=None, summary="Liveness of the agent's loop (200 alive, 500 not)",
             responses={200: _doc("HealthModel"), 500: _doc("HealthModel")})
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
             responses={200: _doc("AuditModel"), 503: _doc("ErrorModel")})
    async def audit() -> Response:
        return _document("audit_body", "audit")

    @app.get("/topology", response_model=None, summary="The latest topology document",
             responses={200: {"description": "topology document"}, 503: _doc("ErrorModel")})
    async def topology() -> Response:
        return _document("topology_body", "topology")

    @app.get("/probe", response_model=None, summary="The latest probe results, one entry per GPU or the CPU run",
             responses={200: {"description": "list of probe verdicts"}, 503: _doc("ErrorModel")})
    async def probe() -> Response:
        snap = state.snapshot
        if snap is None:
            return _missing("probe result")
        return Response(snap.probe_body, media_type=JSON_CONTENT_TYPE)

    @app.get("/gain", response_model=None, summary="The tuning gain measured at the agent's start (untuned vs tuned)",
             responses={200: {"description": "gpu-tune gain document"}, 503: _doc("ErrorModel")})
    async def gain() -> Response:
        snap = state.snapshot
        if snap is None or not snap.gain_body:
            return Response(_dumps({"detail": "no gain measurement: it runs once at the agent's start in enforce "
                                              "mode when the profile sets gain.measure_on_start"}),
                            status_code=503, media_type=JSON_CONTENT_TYPE)
        return Response(snap.gain_body, media_type=JSON_CONTENT_TYPE)

    @app.get("/metrics", response_model=None, summary="Prometheus text exposition",
             responses={200: {"content": {PROM_CONTENT_TYPE: {}}}})
    async def metrics() -> Response:
        snap = state.snapshot
        body = snap.metrics_body if snap is not None else state.empty_metrics
        return Response(body, media_type=PROM_CONTENT_TYPE)

    def openapi() -> dict[str, Any]:
        """The schema with the documentation models, made once (``app.openapi`` replaced: FastAPI's
        documented way to extend it)."""
        if app.openapi_schema is None:
            from gpu_tune.serve.openapi_docs import schema

            app.openapi_schema = schema(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    # HEAD on every GET endpoint (uptime checkers, load balancers), kept out of the schema.
    from fastapi.routing import APIRoute

    for route in [r for r in app.routes if isinstance(r, APIRoute) and "GET" in r.methods]:
        app.add_api_route(route.path, route.endpoint, methods=["HEAD"], include_in_schema=False,
                          response_model=None)
    return app

