"""The Kubernetes API over HTTP: the only module that imports the ``kubernetes`` client.

Imported inside the functions that talk to a cluster, so commands that never publish do not pay
for it, and then only the parts called here (:mod:`gpu_tune.cluster.kube_client`). Everything above this module sees plain JSON and two exceptions of its own:
:class:`ApiError` (the server answered, not 2xx: its status and message) and
:class:`Unreachable` (no answer: TLS, connection, timeout), never the client's types.

Where a cluster is found: :func:`agent_configuration` for the agent (the in-cluster service
account, else a kubeconfig), :func:`reader_configuration` for a person's command (as kubectl
finds one: ``--kubeconfig``, ``KUBECONFIG``, ``~/.kube/config``, else in-cluster).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable

from gpu_tune.cluster.kube_client import modules
from gpu_tune.errors import GpuTuneError, InputError

SERVICE_HOST_ENV = "KUBERNETES_SERVICE_HOST"
SERVICE_TOKEN_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/token"
LIST_PAGE_SIZE = 500  # Nodes per page of a list call (kubectl's default chunk size)
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


class ApiError(Exception):
    """The API server answered with a status outside 2xx."""

    def __init__(self, status: int, message: str, retry_after: float = 0.0) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.retry_after = retry_after


class Unreachable(Exception):
    """No answer from the API server: ``reason`` in the operating system's words (``connection
    refused``), ``detail`` with the exception's type (for retry logs)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class ClusterError(GpuTuneError):
    """The API server could not be reached or refused the request (exit 3, one line)."""

    exit_code = 3


def first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def connection_reason(exc: Any) -> str:
    """The operating system's words from a connection failure (``connection refused``), else the
    most specific line of the message."""
    text = str(exc)
    m = re.search(r"\[Errno -?\d+\] ([^'\")\]\n]+)", text)
    if m:
        return m.group(1).strip().lower()
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]


def _api_message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    try:
        msg = json.loads(body).get("message") if body else None
    except (ValueError, AttributeError):
        msg = None
    return str(msg or getattr(exc, "reason", "") or exc).strip().splitlines()[0][:300]


def node_path(name: str, sub: str = "") -> str:
    from urllib.parse import quote

    return f"/api/v1/nodes/{quote(name, safe='')}{sub}"


def events_path(namespace: str) -> str:
    from urllib.parse import quote

    return f"/api/v1/namespaces/{quote(namespace, safe='')}/events"


class CoreV1:
    """The core/v1 calls gpu-tune makes (get, patch and list Nodes, create an Event), through the
    kubernetes client's ``ApiClient``: its configuration, authentication, TLS and connection pool.

    The generated ``CoreV1Api`` is not used: importing it builds a validator for each of its
    ~1,000 endpoints, about 21 MB of resident memory and half a second of start time for the
    four calls made here (``benchmarks/bench_agent.py``). Answers are the raw JSON bytes; a non-2xx
    answer raises :class:`ApiError`, no answer :class:`Unreachable`.
    """

    def __init__(self, configuration: Any) -> None:
        from gpu_tune import __version__

        client, _ = modules()

        configuration.retries = False  # retries are the callers': bounded, with jitter, 409-aware
        self.host = configuration.host
        self.client = client.ApiClient(configuration)
        # what the API server's audit log and metrics name the caller by (not the generator's)
        self.client.user_agent = f"gpu-tune/{__version__}"

    def request(self, method: str, path: str, *, query: list[tuple[str, Any]] | None = None, body: Any = None,
                content_type: str | None = None, timeout: Any = None, accept: str = "application/json") -> bytes:
        import urllib3
        from kubernetes.client.exceptions import ApiException

        headers = {"Accept": accept}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        try:
            req = self.client.param_serialize(method=method, resource_path=path, query_params=query or [],
                                              header_params=headers, body=body, auth_settings=["BearerToken"])
            resp = self.client.call_api(*req, _request_timeout=timeout)
            resp.read()
            if not 200 <= resp.status <= 299:
                raise ApiException.from_response(http_resp=resp, body=None, data=None)
            return resp.data
        except ApiException as exc:
            status = int(exc.status or 0)
            if status == 0:  # the client's wrapping of a TLS failure
                raise Unreachable(connection_reason(exc.reason), f"ApiException: {first_line(exc)[:200]}") from None
            try:
                retry_after = float((exc.headers or {}).get("Retry-After") or 0)
            except (TypeError, ValueError):
                retry_after = 0.0
            raise ApiError(status, _api_message(exc), retry_after) from None
        except (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as exc:
            line = str(exc).splitlines()[0][:200] if str(exc) else ""
            raise Unreachable(connection_reason(getattr(exc, "reason", None) or exc),
                              f"{type(exc).__name__}: {line}".rstrip(": ")) from None

    def close(self) -> None:
        self.client.close()


# -- finding a cluster ------------------------------------------------------------------------
def in_cluster() -> bool:
    return bool(os.environ.get(SERVICE_HOST_ENV)) and Path(SERVICE_TOKEN_FILE).is_file()


def load_kubeconfig(cfg: Any, kubeconfig: str, where: str, context: str | None = None) -> None:
    """Fill ``cfg`` from a kubeconfig file; InputError naming the file (or the context)."""
    _, config = modules()

    paths = [p for p in kubeconfig.split(os.pathsep) if p]
    if not any(Path(p).is_file() for p in paths):
        raise InputError(f"{where} {kubeconfig}: no such file")
    try:
        config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg,
                                persist_config=False)
    except (config.ConfigException, ValueError, TypeError, OSError) as exc:
        if context and context in str(exc):
            raise InputError(f"--context {context}: no such context in {kubeconfig}") from None
        raise InputError(f"{where} {kubeconfig}: {first_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - YAML errors and the like from the loader
        raise InputError(f"{where} {kubeconfig}: malformed kubeconfig: {first_line(exc)}") from None


def _incluster_configuration() -> Any:
    client, config = modules()

    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException as exc:
        raise InputError(f"in-cluster configuration: {exc}") from None
    return cfg


def agent_configuration(kubeconfig: str | None, where: str) -> tuple[Any, str]:
    """(client configuration, where it came from) for the agent: the in-cluster service account
    when there is one (a kubeconfig given as well is ignored, and said so), else ``kubeconfig``."""
    if in_cluster():
        cfg = _incluster_configuration()
        return cfg, "in-cluster service account" + (f" ({where} {kubeconfig} ignored)" if kubeconfig else "")
    if not kubeconfig:
        raise InputError("no cluster configured: no in-cluster service account and no --kubeconfig/KUBECONFIG")
    client, _ = modules()

    cfg = client.Configuration()
    load_kubeconfig(cfg, kubeconfig, where)
    return cfg, f"kubeconfig {kubeconfig}"


def reader_configuration(kubeconfig: str | None = None, context: str | None = None) -> tuple[Any, str]:
    """(client configuration, where it came from) for a person's command, found as kubectl finds
    it: ``kubeconfig`` (``--kubeconfig``), else ``KUBECONFIG``, else ``~/.kube/config``, else the
    in-cluster service account. InputError when none is there or it is malformed."""
    client, _ = modules()

    cfg = client.Configuration()
    if kubeconfig:
        where, path = "--kubeconfig", kubeconfig
    elif os.environ.get("KUBECONFIG"):
        where, path = "KUBECONFIG", os.environ["KUBECONFIG"]
    else:
        where, path = "kubeconfig", os.path.expanduser("~/.kube/config")
        if not Path(path).is_file():
            if in_cluster() and not context:
                return _incluster_configuration(), "in-cluster service account"
            raise InputError("no cluster configured: pass --kubeconfig FILE, set KUBECONFIG, or create "
                             "~/.kube/config")
    load_kubeconfig(cfg, path, where, context)
    return cfg, f"{where} {path}" + (f" context {context}" if context else "")


# -- reading every Node (for people: gpu-tune fleet) -------------------------------------------
@dataclass(frozen=True)
class NodeListing:
    """Every Node one list call returned (or what ``keep`` made of each): ``pages`` requests, from
    ``server`` (via ``source``)."""

    items: list[Any]
    pages: int
    server: str
    source: str


def list_nodes(configuration: Any, *, selector: str | None = None, page_size: int = LIST_PAGE_SIZE,
               timeout: tuple[float, float] = (5.0, 60.0), attempts: int = 3, source: str = "",
               sleep: Callable[[float], None] = time.sleep,
               keep: Callable[[dict[str, Any]], Any] | None = None) -> NodeListing:
    """Every Node (matching the label ``selector``) in one list call, paged by ``limit`` +
    ``continue``; read-only. Plain JSON (no client model objects: 1,000 Nodes in well under a
    second). With ``keep``, each Node is passed to it as its page arrives and what it returns is
    kept instead of the Node: memory grows with what the caller keeps, not with the fleet's JSON
    (a 5,000-node fleet is 10 pages of about 9 MiB). A continue token that expired mid-list (410)
    restarts the list once (what was kept is dropped: every Node is kept once); 429 and 5xx are
    retried (``attempts`` per page). Raises InputError for a selector the server rejects,
    ClusterError for everything else that stops the list."""
    server = configuration.host
    api = CoreV1(configuration)
    items: list[dict[str, Any]] = []
    token: str | None = None
    pages = 0
    restarted = False
    try:
        while True:
            for attempt in range(1, max(1, attempts) + 1):
                try:
                    query: list[tuple[str, Any]] = [("limit", page_size)]
                    if selector:
                        query.append(("labelSelector", selector))
                    if token:
                        query.append(("continue", token))
                    doc = json.loads(api.request("GET", "/api/v1/nodes", query=query, timeout=timeout) or b"{}")
                    break
                except ApiError as exc:
                    status, msg = exc.status, exc.message
                    if status == 410 and token and not restarted:
                        restarted, token, items, doc = True, None, [], None
                        break
                    if (status == 429 or 500 <= status <= 599) and attempt < attempts:
                        sleep(min(2.0, 0.2 * 2 ** (attempt - 1)))
                        continue
                    if status == 400 and selector:
                        raise InputError(f"--selector {selector!r}: {msg}") from None
                    if status == 401:
                        raise ClusterError(f"unauthorized: the API server {server} rejected the credentials of "
                                           f"{source or 'the kubeconfig'} ({msg})") from None
                    if status == 403:
                        raise ClusterError(
                            f"forbidden: may not list nodes ({msg}); bind the read-only ClusterRole "
                            "gpu-tune-fleet-viewer (daemonset/fleet-viewer, docs/fleet.md): kubectl create "
                            "clusterrolebinding gpu-tune-fleet-viewer-$USER --clusterrole=gpu-tune-fleet-viewer "
                            "--user=$USER") from None
                    raise ClusterError(f"list nodes: API server {server}: HTTP {status}: {msg}") from None
                except Unreachable as exc:
                    raise ClusterError(f"cannot reach the API server {server}: {exc.reason}") from None
                except ValueError as exc:
                    raise ClusterError(f"list nodes: API server {server} sent a malformed answer: "
                                       f"{first_line(exc)}") from None
            if doc is None:  # restarted after an expired continue token
                continue
            pages += 1
            page = [i for i in doc.get("items") or [] if isinstance(i, dict)]
            token = (doc.get("metadata") or {}).get("continue") or None
            doc = None  # this page's JSON goes before the next is read
            items.extend(page if keep is None else (keep(i) for i in page))
            page = []
            if not token:
                return NodeListing(items=items, pages=pages, server=server, source=source)
    finally:
        api.close()
