"""The HTTP API: contract bodies and codes, liveness, malformed requests never 500."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gpu_tune.serve.app import PROM_CONTENT_TYPE, create_app
from gpu_tune.serve.snapshot import AgentState

from .test_metrics import snapshot

ENDPOINTS = ["/readiness", "/healthz", "/audit", "/topology", "/probe", "/metrics"]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture()
def served():
    clock = Clock()
    state = AgentState("gpu-node-1", "training", interval=10, grace=5, clock=clock)
    client = TestClient(create_app(state), raise_server_exceptions=False)
    return state, client, clock


def test_before_first_pass(served):
    state, client, _ = served
    r = client.get("/readiness")
    assert r.status_code == 503
    body = r.json()
    assert set(body) == {"ready", "node", "profile", "reason", "message", "checks", "since"}
    assert body["ready"] is False and body["checks"][0]["name"] == "agent.started"
    assert client.get("/healthz").status_code == 200
    for path in ("/audit", "/topology", "/probe"):
        r = client.get(path)
        assert r.status_code == 503 and "not completed" in r.json()["detail"]
    m = client.get("/metrics")
    assert m.status_code == 200 and b"gpu_tune_build_info" in m.content and b"gpu_tune_ready" not in m.content


def test_snapshot_served_as_is(served):
    state, client, _ = served
    snap = snapshot()
    state.publish(snap)
    r = client.get("/readiness")
    assert r.status_code == 503  # drift and a failed probe
    body = r.json()
    assert list(body) == ["ready", "node", "profile", "reason", "message", "checks", "since", "profile_digest", "off"]
    assert body["node"] == "gpu-node-1" and body["profile"] == "training"
    assert body["since"] == "2025-01-01T00:00:00Z"
    # each check with the severity it ran with and where that came from (docs/health.md "Your policy")
    assert all(set(c) == {"name", "ok", "severity", "severity_from", "detail"} for c in body["checks"])
    assert body["reason"] == snap.verdict.reason() and body["message"] == snap.verdict.message()
    assert r.content == snap.readiness_body
    assert client.get("/audit").json()["settings"][0]["id"] == "sysctl.vm.swappiness"
    assert client.get("/topology").json()["gpus"][1]["pcie"]["gen_current"] == 4
    probes = client.get("/probe").json()
    assert [p["gpu"] for p in probes] == ["0", "1"]
    m = client.get("/metrics")
    assert m.headers["content-type"] == PROM_CONTENT_TYPE and m.content == snap.metrics_body


def test_ready_is_200():
    from gpu_tune.serve.snapshot import Snapshot
    from gpu_tune.judge.readiness import Check, Verdict

    state = AgentState("n", "inference", interval=10)
    state.publish(Snapshot.build(node="n", profile="inference", verdict=Verdict(True, (Check("x", True, "fine"),)),
                                 since=0.0, created=0.0))
    r = TestClient(create_app(state)).get("/readiness")
    assert r.status_code == 200 and r.json() == {"ready": True, "node": "n", "profile": "inference",
                                                 "reason": "AllChecksPassed", "message": "all 1 checks passed",
                                                 "checks": [{"name": "x", "ok": True, "severity": "fatal",
                                                             "severity_from": "catalog", "detail": "fine"}],
                                                 "since": "1970-01-01T00:00:00Z", "profile_digest": "", "off": []}


def test_healthz_tracks_loop_liveness(served):
    state, client, clock = served
    clock.t += 34  # 3 x 10 s + 5 s grace not yet passed
    assert client.get("/healthz").status_code == 200
    clock.t += 2
    r = client.get("/healthz")
    assert r.status_code == 500 and "no pass completed" in r.json()["detail"]
    state.publish(snapshot())
    assert client.get("/healthz").status_code == 200
    clock.t += 36
    r = client.get("/healthz")
    assert r.status_code == 500 and "last pass completed 36.0s ago" in r.json()["detail"]


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
def test_wrong_methods_are_405(served, path, method):
    state, client, _ = served
    state.publish(snapshot())
    r = client.request(method, path, content=b'{"ready": true', headers={"content-type": "application/json"})
    assert r.status_code == 405, (method, path, r.status_code)
    assert "GET" in r.headers.get("allow", "")


@pytest.mark.parametrize("path", ["/", "/ready", "/readiness/", "/metrics/x", "/audit/../etc/passwd", "/%00",
                                  "/probe?gpu=%ff", "/" + "a" * 5000, "/docs/../../readiness/x"])
def test_unknown_paths_are_404(served, path):
    state, client, _ = served
    state.publish(snapshot())
    r = client.get(path)
    assert r.status_code in (404, 200), (path, r.status_code)
    if path.split("?")[0] not in ENDPOINTS:
        assert r.status_code == 404, path


@pytest.mark.parametrize("path", ENDPOINTS)
def test_malformed_requests_never_500(served, path):
    state, client, _ = served
    state.publish(snapshot())
    odd = [
        client.get(path + "?x=%zz&&=&a[]=1"),
        client.request("GET", path, headers={"content-type": "application/json"}, content=b"{not json"),
        client.get(path, headers={"accept": "application/x-nonsense", "content-length": "0"}),
        client.get(path, headers={"accept-encoding": "gzip;q=0", "x-long": "a" * 8000}),
    ]
    assert [r.status_code for r in odd] == [odd[0].status_code] * 4
    assert all(r.status_code < 500 or (path in ("/readiness",) and r.status_code == 503) for r in odd)


def test_openapi_schema_served(served):
    _, client, _ = served
    schema = client.get("/openapi.json").json()
    assert set(ENDPOINTS) <= set(schema["paths"])
    assert list(schema["paths"]["/readiness"]) == ["get"]
    ready = schema["components"]["schemas"]["ReadinessModel"]
    assert set(ready["properties"]) == {"ready", "node", "profile", "reason", "message", "checks", "since"}


def test_openapi_schema_is_the_golden_one(served):
    """The documentation models are made only when the schema is first asked for
    (gpu_tune/serve/openapi_docs.py): the schema served is still, byte for byte, the one FastAPI
    made when the routes named the models themselves (tests/golden/openapi.json)."""
    _, client, _ = served
    golden = json.loads((Path(__file__).parent / "golden" / "openapi.json").read_text())
    assert client.get("/openapi.json").json() == golden
    assert client.get("/openapi.json").json() == golden  # made once, served again the same


def test_bodies_are_json(served):
    state, client, _ = served
    state.publish(snapshot())
    for path in ("/readiness", "/audit", "/topology", "/probe", "/healthz"):
        r = client.get(path)
        assert r.headers["content-type"] == "application/json"
        json.loads(r.content)


@pytest.mark.parametrize("path", ["/readiness", "/healthz", "/audit", "/topology", "/probe", "/metrics"])
def test_head_answers_like_get_without_a_body(served, path):
    state, client, _ = served
    state.publish(snapshot())
    g, h = client.get(path), client.head(path)
    assert h.status_code == g.status_code and h.content == b""
    assert h.headers["content-type"] == g.headers["content-type"]


@pytest.mark.parametrize("path", ["/docs", "/redoc"])
def test_no_interactive_pages(served, path):
    _, client, _ = served
    assert client.get(path).status_code == 404
