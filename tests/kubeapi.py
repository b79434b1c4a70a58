"""A small imitation of the Kubernetes API server: Nodes and Events over real HTTP on 127.0.0.1.

The test suite runs against a real kube-apiserver (tests/realkube; faults on cue through its
proxy); this imitation is kept for the benchmarks (benchmarks/bench_kube.py, bench_fleet.py,
bench_agent.py), which time the client's own work without a server's. It accepts what the real
server refuses (an Event about a Node in any namespace, for one): never test behaviour against it.

It keeps Node objects the way kube-apiserver does for the calls gpu-tune makes:

- ``GET /api/v1/nodes/{name}``
- ``PATCH /api/v1/nodes/{name}``: ``application/merge-patch+json`` (RFC 7386: maps merge,
  ``null`` deletes, lists replace) and ``application/strategic-merge-patch+json`` (maps merge;
  ``spec.taints`` replaced whole; ``status.conditions`` merged by ``type``). Status changes sent
  here are dropped, as the API server does for the main resource.
- ``PATCH /api/v1/nodes/{name}/status``: only status and metadata persist (labels sent to
  ``nodes/status`` are persisted for Nodes); spec changes are dropped.
- a ``metadata.resourceVersion`` in a patch that is not the current one gives 409 Conflict;
  every write that changes the object increments the resourceVersion (a no-op does not).
- ``POST /api/v1/namespaces/{ns}/events`` (``metadata.name`` or ``generateName``); with
  ``event_namespaces`` set, only in those namespaces (a namespaced Role's grant), else 403.
- ``GET /api/v1/nodes``: a ``NodeList`` sorted by name, filtered by ``labelSelector`` (``k``,
  ``!k``, ``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``, ``k notin (a,b)``, comma-separated; a
  malformed selector is 400 as kube-apiserver answers it) and paged by ``limit`` + ``continue``
  (``metadata.continue`` and ``remainingItemCount`` on every page but the last; a token from an
  older list generation, see :meth:`KubeAPIServer.expire_continue_tokens`, is 410 Gone).
  ``list_calls`` counts them.

Admission: ``admit`` (old, new, subresource) is called for every Node write after the patch
and the subresource's reset, as kube-apiserver runs validating admission; a denial is 403.

Fault injection: :meth:`KubeAPIServer.stop` / :meth:`start` (connections refused, then back on
the same port), :meth:`fail` (a status for N calls, or forever, on a method and path pattern),
``conflict_first_try`` (every write is first answered 409 as if another writer had just bumped
the resourceVersion; its retry passes). Write calls (PATCH/POST/PUT/DELETE) are counted per node,
including refused ones.
"""

from __future__ import annotations

import base64
import copy
import json
import random
import re
import socket
import string
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs

NODE_RE = re.compile(r"^/api/v1/nodes/([^/?]+)(/status)?$")
NODES_RE = re.compile(r"^/api/v1/nodes/?$")
EVENTS_RE = re.compile(r"^/api/v1/namespaces/([^/?]+)/events$")
WRITE_METHODS = {"PATCH", "POST", "PUT", "DELETE"}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


# list fields merged by a key under strategic merge (everything else: lists replace)
_SMP_MERGE_KEYS = {("status", "conditions"): "type", ("status", "addresses"): "type"}


def strategic_merge_patch(target: Any, patch: Any, path: tuple[str, ...] = ()) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if k.startswith("$"):
            continue
        sub = path + (k,)
        if v is None:
            out.pop(k, None)
        elif isinstance(v, list) and sub in _SMP_MERGE_KEYS:
            key = _SMP_MERGE_KEYS[sub]
            items = [dict(x) for x in (out.get(k) or [])]
            for item in v:
                pos = next((i for i, x in enumerate(items) if x.get(key) == item.get(key)), None)
                if item.get("$patch") == "delete":
                    if pos is not None:
                        items.pop(pos)
                elif pos is None:
                    items.append(copy.deepcopy(item))
                else:
                    items[pos] = merge_patch(items[pos], item)
            out[k] = items
        else:
            out[k] = strategic_merge_patch(out.get(k), v, sub)
    return out


@dataclass
class FailRule:
    method: str | None  # None: any
    pattern: re.Pattern[str]
    status: int
    remaining: int | None  # None: forever
    hits: int = 0


class KubeAPIServer:
    """Start with :meth:`start` (or as a context manager); ``url`` is ``http://127.0.0.1:PORT``."""

    def __init__(self, token: str | None = "test-token") -> None:
        self.token = token
        self.nodes: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.writes: Counter[str] = Counter()  # node name -> write calls
        self.reads: Counter[str] = Counter()  # node name -> GETs
        self.calls: list[tuple[str, str, int]] = []  # (method, path, status answered)
        self.bodies: list[tuple[str, str, str, Any]] = []  # writes: (method, path, content type, body)
        self.conflict_first_try = False
        # RBAC of a namespaced Role for Events: when set, creating an Event in any other
        # namespace is 403, as kube-apiserver answers a service account without the grant there.
        self.event_namespaces: set[str] | None = None
        # Validating admission for Node writes: admit(old, new, subresource) -> None to let the
        # write through, or (policy name, message) to refuse it with 403 as kube-apiserver
        # answers a ValidatingAdmissionPolicy denial with reason Forbidden.
        self.admit: Callable[[dict[str, Any], dict[str, Any], str], tuple[str, str] | None] | None = None
        self.latency_s = 0.0
        self.list_calls: list[dict[str, str]] = []  # the query of every GET /api/v1/nodes
        self.user_agents: Counter[str] = Counter()  # User-Agent header of every request
        self._list_generation = 0
        self._rules: list[FailRule] = []
        self._first_try_seen: set[tuple[str, str]] = set()
        self._rv = 100
        self._lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self.port = 0

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "KubeAPIServer":
        owner = self

        class Handler(_Handler):
            api = owner

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True
            request_queue_size = 1024

        self._server = Server(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"kubeapi-{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the port and every open connection: clients see refused/reset connections."""
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

    @property
    def running(self) -> bool:
        return self._server is not None

    def __enter__(self) -> "KubeAPIServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- state ---------------------------------------------------------------------------------
    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def add_node(self, name: str, *, labels: dict[str, str] | None = None,
                 annotations: dict[str, str] | None = None, taints: list[dict[str, Any]] | None = None,
                 conditions: list[dict[str, Any]] | None = None, capacity: dict[str, str] | None = None,
                 allocatable: dict[str, str] | None = None) -> dict[str, Any]:
        """A Node as the kubelet registers it. ``capacity``/``allocatable`` are added to the
        kubelet's cpu/memory/pods (the NVIDIA device plugin adds ``nvidia.com/gpu`` this way);
        allocatable defaults to the capacity."""
        with self._lock:
            node = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "uid": f"uid-{name}",
                    "resourceVersion": self._next_rv(),
                    "creationTimestamp": _now(),
                    "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                               **(labels or {})},
                    "annotations": dict(annotations or {}),
                },
                "spec": {"taints": list(taints or [])},
                "status": {"conditions": list(conditions or [
                    {"type": "Ready", "status": "True", "reason": "KubeletReady",
                     "message": "kubelet is posting ready status", "lastHeartbeatTime": _now(),
                     "lastTransitionTime": _now()}]),
                    "capacity": {"cpu": "224", "memory": "2113445612Ki", "pods": "110", **(capacity or {})},
                    "allocatable": {"cpu": "223", "memory": "2111245612Ki", "pods": "110",
                                    **((capacity or {}) if allocatable is None else allocatable)}},
            }
            self.nodes[name] = node
            return copy.deepcopy(node)

    def node(self, name: str) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(self.nodes[name])

    def edit_node(self, name: str, patch: dict[str, Any]) -> None:
        """Another controller's write (merge patch), bumping the resourceVersion."""
        with self._lock:
            node = merge_patch(self.nodes[name], patch)
            node["metadata"]["resourceVersion"] = self._next_rv()
            self.nodes[name] = node

    def expire_continue_tokens(self) -> None:
        """Tokens handed out so far become invalid (410 Gone), as after an etcd compaction."""
        with self._lock:
            self._list_generation += 1

    def fail(self, path_regex: str, status: int, times: int | None = None, method: str | None = None) -> FailRule:
        rule = FailRule(method, re.compile(path_regex), status, times)
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear_faults(self) -> None:
        with self._lock:
            self._rules.clear()
            self.conflict_first_try = False
            self._first_try_seen.clear()

    def total_writes(self) -> int:
        with self._lock:
            return sum(self.writes.values())

    def reset_counts(self) -> None:
        with self._lock:
            self.writes.clear()
            self.reads.clear()
            self.calls.clear()
            self.bodies.clear()

    def events_for(self, node: str) -> list[dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(e) for e in self.events if e.get("involvedObject", {}).get("name") == node]

    # -- request handling (called from handler threads) ----------------------------------------
    def _injected(self, method: str, path: str) -> FailRule | None:
        for rule in self._rules:
            if rule.method not in (None, method) or not rule.pattern.search(path):
                continue
            if rule.remaining is not None:
                if rule.remaining <= 0:
                    continue
                rule.remaining -= 1
            rule.hits += 1
            return rule
        return None

    def handle(self, method: str, path: str, ctype: str, body: bytes, auth: str | None) -> tuple[int, dict[str, Any], dict[str, str]]:
        path, _, query = path.partition("?")
        if self.latency_s:
            time.sleep(self.latency_s)
        with self._lock:
            m_node, m_ev = NODE_RE.match(path), EVENTS_RE.match(path)
            subject = m_node.group(1) if m_node else None
            if method in WRITE_METHODS:
                if subject is None and m_ev:
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
            if method == "GET" and NODES_RE.match(path):
                self.list_calls.append({k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()})
                code, doc, headers = self._list_nodes(auth, query)
            else:
                code, doc, headers = self._dispatch(method, path, ctype, body, auth, m_node, m_ev)
            self.calls.append((method, path, code))
            return code, doc, headers

    def _dispatch(self, method, path, ctype, body, auth, m_node, m_ev):  # noqa: ANN001
        if self.token is not None and auth != f"Bearer {self.token}":
            return _status(401, "Unauthorized", "Unauthorized")
        rule = self._injected(method, path)
        if rule is not None:
            headers = {"Retry-After": "0"} if rule.status == 429 else {}
            reason = {403: "Forbidden", 404: "NotFound", 409: "Conflict", 429: "TooManyRequests"}.get(
                rule.status, "InternalError")
            msg = (f'nodes "{m_node.group(1)}" is forbidden: User "system:serviceaccount:gpu-tune:gpu-tune" '
                   f'cannot {method.lower()} resource "nodes{"/status" if m_node.group(2) else ""}" in API group ""'
                   if rule.status == 403 and m_node else f"injected {rule.status}")
            code, doc, _ = _status(rule.status, reason, msg)
            return code, doc, headers
        if m_node:
            name, sub = m_node.group(1), m_node.group(2)
            if name not in self.nodes:
                return _status(404, "NotFound", f'nodes "{name}" not found')
            if method == "GET" and not sub:
                return 200, copy.deepcopy(self.nodes[name]), {}
            if method == "PATCH":
                return self._patch(name, bool(sub), ctype, body)
            return _status(405, "MethodNotAllowed", f"{method} not supported here")
        if m_ev:
            if method != "POST":
                return _status(405, "MethodNotAllowed", f"{method} not supported here")
            if self.event_namespaces is not None and m_ev.group(1) not in self.event_namespaces:
                return _status(403, "Forbidden", 'events is forbidden: User "system:serviceaccount:gpu-tune:gpu-tune" '
                               f'cannot create resource "events" in API group "" in the namespace "{m_ev.group(1)}"')
            return self._post_event(m_ev.group(1), body)
        return _status(404, "NotFound", f"the server could not find the requested resource ({path})")

    def _list_nodes(self, auth: str | None, query: str):  # noqa: ANN202
        if self.token is not None and auth != f"Bearer {self.token}":
            return _status(401, "Unauthorized", "Unauthorized")
        rule = self._injected("GET", "/api/v1/nodes")
        if rule is not None:
            msg = ('nodes is forbidden: User "jane@example.com" cannot list resource "nodes" in API group "" '
                   "at the cluster scope" if rule.status == 403 else f"injected {rule.status}")
            code, doc, _ = _status(rule.status, {403: "Forbidden", 429: "TooManyRequests"}.get(
                rule.status, "InternalError"), msg)
            return code, doc, ({"Retry-After": "0"} if rule.status == 429 else {})
        q = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
        try:
            match = parse_label_selector(q.get("labelSelector", ""))
        except ValueError as exc:
            return _status(400, "BadRequest", f"unable to parse requirement: {exc}")
        try:
            limit = int(q.get("limit") or 0)
        except ValueError:
            return _status(400, "BadRequest", f"limit: invalid value {q.get('limit')!r}")
        start = ""
        if q.get("continue"):
            try:
                tok = json.loads(base64.urlsafe_b64decode(q["continue"].encode()))
                gen, start = int(tok["gen"]), str(tok["start"])
            except (ValueError, KeyError, TypeError):
                return _status(400, "BadRequest", "continue key is not valid")
            if gen != self._list_generation:
                return _status(410, "Expired", "The provided continue parameter is too old to display a "
                               "consistent list result. You can start a new list without the continue parameter.")
        names = [n for n in sorted(self.nodes) if n > start and match(self.nodes[n]["metadata"].get("labels") or {})]
        page = names[:limit] if limit > 0 else names
        meta: dict[str, Any] = {"resourceVersion": str(self._rv)}
        if len(page) < len(names):
            meta["continue"] = base64.urlsafe_b64encode(json.dumps(
                {"gen": self._list_generation, "start": page[-1]}).encode()).decode()
            meta["remainingItemCount"] = len(names) - len(page)
        return 200, {"kind": "NodeList", "apiVersion": "v1", "metadata": meta,
                     "items": [copy.deepcopy(self.nodes[n]) for n in page]}, {}

    def _patch(self, name: str, status_sub: bool, ctype: str, body: bytes):  # noqa: ANN202
        ctype = ctype.split(";", 1)[0].strip()
        try:
            patch = json.loads(body or b"null")
        except ValueError as exc:
            return _status(400, "BadRequest", f"invalid JSON: {exc}")
        if ctype not in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            return _status(415, "UnsupportedMediaType", f"unsupported patch type {ctype!r}")
        if not isinstance(patch, dict):
            return _status(400, "BadRequest", "patch must be a JSON object")
        cur = self.nodes[name]
        key = (name, "status" if status_sub else "")
        if self.conflict_first_try and key not in self._first_try_seen:
            # each write sequence: the first try conflicts, the retry after it passes
            self._first_try_seen.add(key)
            cur["metadata"]["resourceVersion"] = self._next_rv()  # another writer got there first
            return _status(409, "Conflict", f'Operation cannot be fulfilled on nodes "{name}": '
                           "the object has been modified; please apply your changes to the latest version and try again")
        want_rv = (patch.get("metadata") or {}).get("resourceVersion")
        if want_rv is not None and str(want_rv) != cur["metadata"]["resourceVersion"]:
            return _status(409, "Conflict", f'Operation cannot be fulfilled on nodes "{name}": '
                           "the object has been modified; please apply your changes to the latest version and try again")
        self._first_try_seen.discard(key)
        fn = merge_patch if ctype == "application/merge-patch+json" else strategic_merge_patch
        new = fn(cur, patch)
        if not isinstance(new.get("metadata"), dict):
            return _status(422, "Invalid", "metadata: Required value")
        for f in ("name", "uid", "creationTimestamp"):
            new["metadata"][f] = cur["metadata"][f]
        err = _validate_labels(new["metadata"].get("labels") or {})
        if err:
            return _status(422, "Invalid", f'Node "{name}" is invalid: {err}')
        if status_sub:
            new["spec"] = copy.deepcopy(cur.get("spec"))
        else:
            new["status"] = copy.deepcopy(cur.get("status"))
        new["metadata"]["resourceVersion"] = cur["metadata"]["resourceVersion"]
        if self.admit is not None:
            denied = self.admit(copy.deepcopy(cur), copy.deepcopy(new), "status" if status_sub else "")
            if denied is not None:
                policy, message = denied
                return _status(403, "Forbidden", f'nodes "{name}" is forbidden: ValidatingAdmissionPolicy '
                               f"'{policy}' with binding '{policy}' denied request: {message}")
        if new != cur:
            new["metadata"]["resourceVersion"] = self._next_rv()
            self.nodes[name] = new
        return 200, copy.deepcopy(self.nodes[name]), {}

    def _post_event(self, ns: str, body: bytes):  # noqa: ANN202
        try:
            ev = json.loads(body or b"null")
        except ValueError as exc:
            return _status(400, "BadRequest", f"invalid JSON: {exc}")
        if not isinstance(ev, dict) or not isinstance(ev.get("involvedObject"), dict):
            return _status(422, "Invalid", "involvedObject: Required value")
        meta = ev.setdefault("metadata", {})
        if not meta.get("name"):
            gen = meta.get("generateName")
            if not gen:
                return _status(422, "Invalid", "metadata.name: Required value: name or generateName is required")
            meta["name"] = gen + "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        if meta.get("namespace", ns) != ns:
            return _status(400, "BadRequest", "the namespace of the provided object does not match the namespace sent on the request")
        if any(e["metadata"]["name"] == meta["name"] and e["metadata"]["namespace"] == ns for e in self.events):
            return _status(409, "AlreadyExists", f'events "{meta["name"]}" already exists')
        meta["namespace"] = ns
        meta["uid"] = f"uid-ev-{len(self.events)}"
        meta["resourceVersion"] = self._next_rv()
        self.events.append(ev)
        return 201, copy.deepcopy(ev), {}


_LABEL_KEY_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def _validate_labels(labels: dict[str, Any]) -> str:
    for k, v in labels.items():
        name = k.rsplit("/", 1)[-1]
        if not _LABEL_KEY_NAME.match(name) or len(name) > 63:
            return f"metadata.labels: Invalid value: {k!r}: name part must be 63 characters or less of [A-Za-z0-9_.-]"
        if not isinstance(v, str) or len(v) > 63 or not _LABEL_VALUE.match(v):
            return f"metadata.labels: Invalid value: {v!r}: a valid label must be 63 characters or less of [A-Za-z0-9_.-]"
    return ""


_SELECTOR_TERM = re.compile(
    r"^\s*(?P<neg>!)?\s*(?P<key>[^\s!=,()]+)\s*(?:(?P<op>==|!=|=|\s+in\s+|\s+notin\s+)\s*(?P<val>.*?))?\s*$")


def _split_terms(text: str) -> list[str]:
    terms, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ')' in {text!r}")
        if ch == "," and depth == 0:
            terms.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"unbalanced '(' in {text!r}")
    return terms + [cur]


def _check_key(key: str) -> None:
    prefix, _, name = key.rpartition("/")
    if not _LABEL_KEY_NAME.match(name) or len(name) > 63 or (prefix and not re.match(r"^[a-z0-9.-]+$", prefix)):
        raise ValueError(f"invalid label key {key!r}: name part must consist of alphanumeric characters, "
                         "'-', '_' or '.', and must start and end with an alphanumeric character")


def _check_value(value: str) -> None:
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        raise ValueError(f"invalid label value: {value!r}: a valid label must be an empty string or consist "
                         "of alphanumeric characters, '-', '_' or '.'")


def parse_label_selector(text: str) -> Callable[[dict[str, str]], bool]:
    """A predicate over a label map for a Kubernetes label selector; ValueError when malformed."""
    if not text.strip():
        return lambda labels: True
    preds: list[Callable[[dict[str, str]], bool]] = []
    for term in _split_terms(text):
        m = _SELECTOR_TERM.match(term)
        if not term.strip() or not m:
            raise ValueError(f"{term!r}: found unexpected token")
        key, op, val, neg = m.group("key"), (m.group("op") or "").strip(), m.group("val"), bool(m.group("neg"))
        _check_key(key)
        if neg:
            if op:
                raise ValueError(f"{term!r}: '!' only negates an existence test")
            preds.append(lambda lab, k=key: k not in lab)
        elif not op:
            preds.append(lambda lab, k=key: k in lab)
        elif op in ("=", "==", "!="):
            _check_value(val)
            if op == "!=":
                preds.append(lambda lab, k=key, v=val: lab.get(k) != v)
            else:
                preds.append(lambda lab, k=key, v=val: lab.get(k) == v)
        else:
            if not (val.startswith("(") and val.endswith(")")):
                raise ValueError(f"{term!r}: expected '(' after {op}")
            values = {x.strip() for x in val[1:-1].split(",")}
            for v in values:
                _check_value(v)
            if op == "in":
                preds.append(lambda lab, k=key, vs=values: lab.get(k) in vs)
            else:
                preds.append(lambda lab, k=key, vs=values: lab.get(k) not in vs)
    return lambda labels: all(p(labels) for p in preds)


def _status(code: int, reason: str, message: str) -> tuple[int, dict[str, Any], dict[str, str]]:
    return code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                  "message": message, "reason": reason, "code": code}, {}


class _Handler(BaseHTTPRequestHandler):
    api: KubeAPIServer
    protocol_version = "HTTP/1.1"
    wbufsize = 64 * 1024  # headers and body leave in one segment (flushed per request)
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()
        with self.api._lock:
            self.api._conns.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            with self.api._lock:
                self.api._conns.discard(self.connection)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        with self.api._lock:
            self.api.user_agents[self.headers.get("User-Agent") or ""] += 1
        code, doc, headers = self.api.handle(self.command, self.path, self.headers.get("Content-Type", ""),
                                             body, self.headers.get("Authorization"))
        data = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PATCH = do_POST = do_PUT = do_DELETE = _serve


def write_kubeconfig(path: str | Path, server_url: str, token: str | None = "test-token",
                     context: str = "test") -> Path:
    """A kubeconfig pointing at ``server_url`` with a bearer token (JSON is valid YAML)."""
    path = Path(path)
    user: dict[str, Any] = {"token": token} if token else {}
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": context, "cluster": {"server": server_url}}],
        "users": [{"name": context, "user": user}],
        "contexts": [{"name": context, "context": {"cluster": context, "user": context}}],
        "current-context": context,
    }
    path.write_text(json.dumps(cfg, indent=1))
    return path
