"""The read-only HTTP API (docs/cli.md, ``gpu-tune serve``), answered from the latest immutable snapshot.

A request never runs an audit or a probe and never changes the host: every body is rendered
once when the loop publishes a snapshot (``gpu_tune/serve/snapshot.py``), so a request returns prepared
bytes.

The app is Starlette's (FastAPI's base), with routes of its own (:class:`Documented`): no endpoint
takes a parameter or a body and every answer is prepared bytes, so nothing of FastAPI's is needed
to answer. FastAPI makes /openapi.json, when it is first asked for (:mod:`gpu_tune.serve.openapi_docs`):
importing it with the app would keep it, its OpenTelemetry instrumentation and
``importlib.metadata``'s entry points resident for the agent's life, about 6 MiB
(benchmarks/bench_rss.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gpu_tune import __version__
from gpu_tune.serve.snapshot import AgentState
from gpu_tune.serve.snapshot import dumps as _dumps

PROM_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
JSON_CONTENT_TYPE = "application/json"
TITLE = "gpu-tune agent"
DESCRIPTION = "Read-only view of the node's tuning, topology, probe results and readiness."
OPENAPI_URL = "/openapi.json"


@dataclass(frozen=True)
class Documented:
    """A GET endpoint as /openapi.json documents it (its HEAD twin is not documented)."""

    path: str
    name: str
    summary: str
    responses: dict[int, dict[str, Any]] = field(default_factory=dict)


class AgentApp(Starlette):
    """The agent's app: Starlette's, with the documented routes (:attr:`documented`) and the
    schema made once, when first asked for (:meth:`openapi`)."""

    documented: list[Documented]
    openapi_schema: dict[str, Any] | None = None
    title, version, description, openapi_url = TITLE, __version__, DESCRIPTION, OPENAPI_URL

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            from gpu_tune.serve.openapi_docs import schema

            self.openapi_schema = schema(self)
        return self.openapi_schema


def _doc(model: str) -> dict[str, Any]:
    """A response documented by one of :mod:`gpu_tune.serve.openapi_docs`' models, named by
    reference: the models are made only when /openapi.json is first asked for (:func:`create_app`)."""
    return {"content": {JSON_CONTENT_TYPE: {"schema": {"$ref": f"#/components/schemas/{model}"}}}}


def create_app(state: AgentState) -> AgentApp:
    documented: list[Documented] = []
    routes: list[Route] = []
    Endpoint = Callable[[], Awaitable[Response]]

    def get(path: str, *, summary: str, responses: dict[int, dict[str, Any]]) -> Callable[[Endpoint], Endpoint]:
        """A GET endpoint and its HEAD twin (uptime checkers, load balancers; not documented)."""

        def register(fn: Endpoint) -> Endpoint:
            async def endpoint(request: Request) -> Response:
                return await fn()

            documented.append(Documented(path, fn.__name__, summary, responses))
            for method in ("GET", "HEAD"):
                route = Route(path, endpoint, methods=[method], name=fn.__name__)
                route.methods = {method}  # Starlette adds HEAD to a GET route: its own route, as before
                routes.append(route)
            return fn

        return register

    async def _http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        headers = getattr(exc, "headers", None)
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=headers)

    async def _unexpected(request: Request, exc: Exception) -> Response:  # pragma: no cover
        return JSONResponse({"detail": f"unavailable: {type(exc).__name__}"}, status_code=503)

    def _missing(what: str) -> Response:
        return Response(_dumps({"detail": f"no {what} yet: the agent has not completed one"}),
                        status_code=503, media_type=JSON_CONTENT_TYPE)

    @get("/readiness", summary="Readiness verdict (200 ready, 503 not)",
         responses={200: _doc("ReadinessModel"), 503: _doc("ReadinessModel")})
    async def readiness() -> Response:
        snap = state.snapshot
        if snap is None:
            return Response(state.not_ready_body, status_code=503, media_type=JSON_CONTENT_TYPE)
        return Response(snap.readiness_body, status_code=snap.readiness_status, media_type=JSON_CONTENT_TYPE)

    @get("/agent-ready",
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

    @get("/healthz", summary="Liveness of the agent's loop (200 alive, 500 not)",
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

    @get("/audit", summary="The latest audit document", responses={200: _doc("AuditModel"), 503: _doc("ErrorModel")})
    async def audit() -> Response:
        return _document("audit_body", "audit")

    @get("/topology", summary="The latest topology document",
         responses={200: {"description": "topology document"}, 503: _doc("ErrorModel")})
    async def topology() -> Response:
        return _document("topology_body", "topology")

    @get("/probe", summary="The latest probe results, one entry per GPU or the CPU run",
         responses={200: {"description": "list of probe verdicts"}, 503: _doc("ErrorModel")})
    async def probe() -> Response:
        snap = state.snapshot
        if snap is None:
            return _missing("probe result")
        return Response(snap.probe_body, media_type=JSON_CONTENT_TYPE)

    @get("/gain", summary="The tuning gain measured at the agent's start (untuned vs tuned)",
         responses={200: {"description": "gpu-tune gain document"}, 503: _doc("ErrorModel")})
    async def gain() -> Response:
        snap = state.snapshot
        if snap is None or not snap.gain_body:
            return Response(_dumps({"detail": "no gain measurement: it runs once at the agent's start in enforce "
                                              "mode when the profile sets gain.measure_on_start"}),
                            status_code=503, media_type=JSON_CONTENT_TYPE)
        return Response(snap.gain_body, media_type=JSON_CONTENT_TYPE)

    @get("/metrics", summary="Prometheus text exposition", responses={200: {"content": {PROM_CONTENT_TYPE: {}}}})
    async def metrics() -> Response:
        snap = state.snapshot
        body = snap.metrics_body if snap is not None else state.empty_metrics
        return Response(body, media_type=PROM_CONTENT_TYPE)

    async def openapi(request: Request) -> Response:
        return JSONResponse(app.openapi())

    # The schema at /openapi.json (any method, as FastAPI serves it); no interactive pages (they
    # load scripts from a CDN, and this is a privileged node agent).
    routes.append(Route(OPENAPI_URL, openapi, include_in_schema=False))
    app = AgentApp(routes=routes, exception_handlers={StarletteHTTPException: _http_error, Exception: _unexpected})
    app.router.redirect_slashes = False
    app.documented = documented
    return app
