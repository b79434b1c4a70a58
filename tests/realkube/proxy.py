"""A plain-HTTP front for the real API server that records every call and injects faults.

A real API server answers truthfully: it cannot be made to answer 503 for the next three
calls, to refuse connections for a while, or to find every first write stale. This proxy sits
between a client and the server and does exactly that, on cue, and nothing else: every other
request goes to the real server unchanged (the client's own ``Authorization`` header included,
so the server authenticates and authorizes the client itself), and its answer comes back as is.

What it keeps, per request: ``calls`` (method, path, status answered), ``bodies`` of writes
(method, path, content type, JSON), ``writes`` and ``reads`` per Node (a Node's path, or an
Event's ``involvedObject.name``), the query of every Node list (``list_calls``) and the
``User-Agent`` of every request. Faults: :meth:`fail` (a status for N calls matching a method
and a path pattern), ``conflict_first_try`` (the first try of every Node write answered 409),
``latency_s``, :meth:`expire_continue_tokens` (list continue tokens handed out so far answered
410, as after an etcd compaction) and :meth:`stop`/:meth:`start` (connections refused, then
served again on the same port).
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import ssl
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

NODE_RE = re.compile(r"^/api/v1/nodes/([^/?]+)(/status)?$")
NODES_RE = re.compile(r"^/api/v1/nodes/?$")
EVENTS_RE = re.compile(r"^/api/v1/namespaces/([^/?]+)/events$")
WRITE_METHODS = {"PATCH", "POST", "PUT", "DELETE"}
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "te", "trailer",
               "upgrade", "proxy-authorization", "proxy-connection"}


@dataclass
class FailRule:
    method: str | None
    pattern: re.Pattern[str]
    status: int
    remaining: int | None
    hits: int = 0


def status_doc(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int, ca_file: str) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._ssl = ssl.create_default_context(cafile=ca_file)
        self.writes: Counter[str] = Counter()
        self.reads: Counter[str] = Counter()
        self.calls: list[tuple[str, str, int]] = []
        self.bodies: list[tuple[str, str, str, Any]] = []
        self.list_calls: list[dict[str, str]] = []
        self.queries: list[tuple[str, str, dict[str, str]]] = []  # (method, path, query) of every call
        self.user_agents: Counter[str] = Counter()
        self.conflict_first_try = False
        self.latency_s = 0.0
        # called with the number of Node lists so far, before each is answered (to make a fault
        # happen between two pages of one list)
        self.list_hook: Any = None
        self._rules: list[FailRule] = []
        self._first_try_seen: set[tuple[str, str]] = set()
        self._issued_tokens: set[str] = set()
        self._expired_tokens: set[str] = set()
        self._lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._local = threading.local()
        self.port = 0

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FaultProxy":
        owner = self

        class Handler(_Handler):
            proxy = owner

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True
            request_queue_size = 256

        self._server = Server(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"fault-proxy-{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the port and every open connection: clients see refused or reset connections."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- faults and counts ------------------------------------------------------------------------
    def fail(self, path_regex: str, status: int, times: int | None = None, method: str | None = None) -> FailRule:
        """Answer ``status`` (instead of the server) to calls whose path (or path and query)
        matches ``path_regex``, ``times`` times (None: until :meth:`clear_faults`)."""
        rule = FailRule(method, re.compile(path_regex), status, times)
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear_faults(self) -> None:
        with self._lock:
            self._rules.clear()
            self.conflict_first_try = False
            self._first_try_seen.clear()

    def expire_continue_tokens(self) -> None:
        with self._lock:
            self._expired_tokens |= self._issued_tokens

    def total_writes(self) -> int:
        with self._lock:
            return sum(self.writes.values())

    def reset_counts(self) -> None:
        with self._lock:
            self.writes.clear()
            self.reads.clear()
            self.calls.clear()
            self.bodies.clear()
            self.queries.clear()

    # -- one request -------------------------------------------------------------------------------
    def _injected(self, method: str, path: str, target: str) -> FailRule | None:
        for rule in self._rules:
            if rule.method not in (None, method) or not (rule.pattern.search(path) or rule.pattern.search(target)):
                continue
            if rule.remaining is not None:
                if rule.remaining <= 0:
                    continue
                rule.remaining -= 1
            rule.hits += 1
            return rule
        return None

    def handle(self, method: str, target: str, headers: dict[str, str], body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        path, _, query = target.partition("?")
        ctype = headers.get("content-type", "")
        if self.latency_s:
            time.sleep(self.latency_s)
        with self._lock:
            m_node = NODE_RE.match(path)
            subject = m_node.group(1) if m_node else None
            if method in WRITE_METHODS:
                if subject is None and EVENTS_RE.match(path):
                    try:
                        subject = json.loads(body or b"{}").get("involvedObject", {}).get("name")
                    except (ValueError, AttributeError):
                        subject = None
                self.writes[subject or "?"] += 1
                try:
                    self.bodies.append((method, path, ctype.split(";", 1)[0].strip(), json.loads(body or b"null")))
                except ValueError:
                    self.bodies.append((method, path, ctype, body))
            elif subject:
                self.reads[subject] += 1
            q = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
            self.queries.append((method, path, q))
            if method == "GET" and NODES_RE.match(path):
                self.list_calls.append(q)
                if self.list_hook is not None:
                    self.list_hook(len(self.list_calls))
            canned = self._canned(method, path, target, q, m_node)
        if canned is not None:
            code, doc, extra = canned
            out = json.dumps(doc).encode()
            self._record(method, path, code)
            return code, [("Content-Type", "application/json"), *extra], out
        code, resp_headers, data = self._forward(method, target, headers, body)
        if method == "GET" and NODES_RE.match(path) and code == 200:
            try:
                token = (json.loads(data).get("metadata") or {}).get("continue")
            except ValueError:
                token = None
            if token:
                with self._lock:  # (handed out again after expiry: a fresh token of a new list)
                    self._issued_tokens.add(token)
                    self._expired_tokens.discard(token)
        self._record(method, path, code)
        return code, resp_headers, data

    def _record(self, method: str, path: str, code: int) -> None:
        with self._lock:
            self.calls.append((method, path, code))

    def _canned(self, method: str, path: str, target: str, q: dict[str, str], m_node: Any):
        if q.get("continue") and q["continue"] in self._expired_tokens:
            return 410, status_doc(410, "Expired", "The provided continue parameter is too old to display a "
                                                   "consistent list result. You can start a new list without "
                                                   "the continue parameter."), []
        rule = self._injected(method, path, target)
        if rule is not None:
            reason = {403: "Forbidden", 404: "NotFound", 409: "Conflict", 429: "TooManyRequests",
                      410: "Expired"}.get(rule.status, "InternalError")
            extra = [("Retry-After", "0")] if rule.status == 429 else []
            return rule.status, status_doc(rule.status, reason, f"injected {rule.status}"), extra
        if self.conflict_first_try and method in WRITE_METHODS and m_node:
            key = (method, path)
            if key not in self._first_try_seen:
                self._first_try_seen.add(key)
                name = m_node.group(1)
                return 409, status_doc(409, "Conflict", f'Operation cannot be fulfilled on nodes "{name}": the '
                                                        "object has been modified; please apply your changes to "
                                                        "the latest version and try again"), []
        return None

    def _forward(self, method: str, target: str, headers: dict[str, str], body: bytes):
        conn = getattr(self._local, "conn", None)
        for attempt in (1, 2):
            if conn is None:
                conn = http.client.HTTPSConnection(*self.upstream, context=self._ssl, timeout=60)
                self._local.conn = conn
            try:
                send = {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}
                conn.request(method, target, body=body or None, headers=send)
                resp = conn.getresponse()
                data = resp.read()
                out = [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP_HEADERS]
                return resp.status, out, data
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = self._local.conn = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")


class _Handler(BaseHTTPRequestHandler):
    proxy: FaultProxy
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()
        with self.proxy._lock:
            self.proxy._conns.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            with self.proxy._lock:
                self.proxy._conns.discard(self.connection)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        with self.proxy._lock:
            self.proxy.user_agents[self.headers.get("User-Agent") or ""] += 1
        headers = {k.lower(): v for k, v in self.headers.items()}
        try:
            code, resp_headers, data = self.proxy.handle(self.command, self.path, headers, body)
        except (OSError, http.client.HTTPException) as exc:
            code, resp_headers = 502, [("Content-Type", "application/json")]
            data = json.dumps(status_doc(502, "BadGateway", f"upstream: {exc}")).encode()
        self.send_response(code)
        for k, v in resp_headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PATCH = do_POST = do_PUT = do_DELETE = _serve
