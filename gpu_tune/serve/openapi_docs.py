"""The agent's /openapi.json: the documentation models of its API (the shapes of the JSON documents
it serves: every body is pre-rendered, nothing is validated against these) and the schema FastAPI
makes of its documented routes. Imported when the schema is first asked for
(:meth:`gpu_tune.serve.app.AgentApp.openapi`), not at the agent's start: FastAPI and its
OpenTelemetry instrumentation (about 6 MiB resident), the models and FastAPI's response fields for
them (which import ``pydantic.v1`` to refuse v1 models) stay out of an agent nobody asks for its
schema (benchmarks/bench_rss.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from pydantic import BaseModel

if TYPE_CHECKING:
    from gpu_tune.serve.app import AgentApp


class CheckModel(BaseModel):
    name: str
    ok: bool
    severity: str  # fatal (gates the node) | warning (reported, never gating)
    detail: str


class ReadinessModel(BaseModel):
    ready: bool
    node: str
    profile: str
    reason: str  # the condition's reason: the most urgent failing check's (docs/health.md)
    message: str
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


class AgentReadyModel(BaseModel):
    ready: bool
    node: str
    mode: str
    detail: str


class HealthModel(BaseModel):
    alive: bool
    detail: str


class ErrorModel(BaseModel):
    detail: str


MODELS = {m.__name__: m for m in (AgentReadyModel, AuditModel, CheckModel, ErrorModel, HealthModel, ReadinessModel,
                                   SettingModel)}
REF = "#/components/schemas/"


def _with_model(response: dict[str, Any]) -> dict[str, Any]:
    """A response of app.py that names a model here by ``$ref``, as FastAPI's ``{"model": ...}``."""
    ref = str(((response.get("content") or {}).get("application/json") or {}).get("schema", {}).get("$ref", ""))
    name = ref[len(REF):] if ref.startswith(REF) else ""
    return {"model": MODELS[name]} if name in MODELS else response


def schema(app: AgentApp) -> dict[str, Any]:
    """``app``'s /openapi.json, made by FastAPI from its documented routes, whose responses name
    these models as response models: exactly what FastAPI makes of the same routes in an app of
    its own (tests/golden/openapi.json)."""
    doc = FastAPI(title=app.title, version=app.version, description=app.description, docs_url=None,
                  redoc_url=None, openapi_url=app.openapi_url)
    for route in app.documented:
        async def endpoint() -> None:  # never called: FastAPI documents it, Starlette answers (app.py)
            return None

        doc.add_api_route(route.path, endpoint, methods=["GET"], name=route.name, summary=route.summary,
                          response_model=None,
                          responses={code: _with_model(r) for code, r in route.responses.items()})
    return doc.openapi()
