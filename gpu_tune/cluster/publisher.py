"""Publish a :class:`~gpu_tune.cluster.labels.NodeWant` to the Node: labels, annotations, taint, condition, Events.

The only module that imports the ``kubernetes`` package, and only inside the functions that talk
to a cluster, so commands that never publish do not pay for the import.

Choice of cluster, made once by :func:`make_publisher` and logged in one line: ``--no-kube`` ->
off; in-cluster service account (``KUBERNETES_SERVICE_HOST`` and the token file) -> on; else
``--kubeconfig`` / ``KUBECONFIG`` -> on; else off.

One pass (:meth:`KubePublisher.publish`):

1. ``GET`` the Node (the only read of a steady pass).
2. Diff (pure, :func:`plan_node`): owned labels and annotations, stale owned labels (recorded in
   ``gpu-tune.io/owned-labels``; labels not recorded there are never touched), the
   ``gpu-tune.io/not-ready:NoSchedule`` taint.
3. When something differs: one JSON merge patch of ``metadata`` + ``spec.taints`` carrying the
   ``metadata.resourceVersion`` just read. A merge patch replaces the taint list whole, so the
   list sent is the one read with only our taint added or removed; should another writer have
   changed the Node since, the server answers 409 and the pass reads again and re-plans.
4. When the ``GPUHostReady`` condition's status, reason or message differ: one strategic merge
   patch of ``nodes/status`` (conditions merge by ``type``, so the kubelet's are untouched).
   ``lastTransitionTime`` moves only when the status flips; ``lastHeartbeatTime`` is the time
   of the write. When nothing else changed, the condition is written again only once its
   ``lastHeartbeatTime`` is older than ``heartbeat_s`` (default :data:`HEARTBEAT_S`, 10 minutes):
   that is how ``gpu-tune fleet`` tells a live agent from a stopped one (``fleet --stale-after``).
   Passes in between write nothing.
5. On a status flip (or the first condition): one core v1 Event on the Node, in the agent's own
   namespace (:func:`event_namespace`: ``POD_NAMESPACE``, else the service account's namespace
   file, else ``default``), so that a namespaced Role is all it needs. If posting it fails, it is
   kept and posted on the next pass.

409 -> read again and retry; 429, 5xx and connection errors -> retry with jittered exponential
backoff (bounded in attempts and seconds); 403 -> the pass fails with the RBAC rule that is
missing; failures are returned as a :class:`PublishResult`, never raised.

For people (``gpu-tune fleet``): :func:`reader_configuration` finds a cluster the way kubectl
does, and :func:`list_nodes` reads every Node in one paged list call (``limit`` + ``continue``),
read-only; its failures are :class:`ClusterError` (exit 3) or :class:`InputError` (exit 2).
"""

from __future__ import annotations

import copy
import http.client
import json
import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from gpu_tune.errors import GpuTuneError, InputError
from gpu_tune.cluster.labels import (
    ANNOTATION_OWNED,
    CONDITION_TYPE,
    FORBIDDEN_PREFIXES,
    PREFIX,
    TAINT_EFFECT,
    TAINT_KEY,
    NodeWant,
    is_valid_label_value,
)

log = logging.getLogger("gpu_tune.kube")

SERVICE_HOST_ENV = "KUBERNETES_SERVICE_HOST"
SERVICE_TOKEN_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/token"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
SERVICE_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
POD_NAMESPACE_ENV = "POD_NAMESPACE"  # the downward API's metadata.namespace
# Outside a pod (a person's `gpu-tune label --kubeconfig`): where the kubelet puts Node events.
EVENT_NAMESPACE = "default"
COMPONENT = "gpu-tune"
HEARTBEAT_S = 600.0  # the GPUHostReady condition is re-written at least this often (seconds)
LIST_PAGE_SIZE = 500  # Nodes per page of a list call (kubectl's default chunk size)


# -- results ----------------------------------------------------------------------------------
GPU_RESOURCE = "nvidia.com/gpu"  # the NVIDIA device plugin's extended resource
# Labels others put on a Node that has NVIDIA GPUs: node-feature-discovery (PCI vendor 10de) and
# the GPU Operator's feature discovery. Read, never written.
GPU_PRESENT_LABELS = ("feature.node.kubernetes.io/pci-10de.present", "nvidia.com/gpu.present")
# The label that overrides the agent's --mode on one Node (see gpu_tune/serve/agent.py, docs/deploy.md).
MODE_LABEL = PREFIX + "mode"


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

    def as_check(self) -> dict[str, Any]:
        return {"name": "publish", "ok": self.ok, "detail": self.detail}

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "detail": self.detail, "writes": self.writes, "reads": self.reads,
                "changed": list(self.changed), "node_read": self.node_read,
                "gpu_capacity": self.gpu_capacity, "gpu_allocatable": self.gpu_allocatable,
                "gpu_expected": list(self.gpu_expected), "mode_request": self.mode_request,
                "condition_status": self.condition_status}


def resource_count(node: dict[str, Any], where: str, resource: str = GPU_RESOURCE) -> int | None:
    """An extended resource's count in the Node's ``status.capacity`` or ``status.allocatable``
    (a quantity string such as ``"8"``); None when absent or not a whole number."""
    value = ((node.get("status") or {}).get(where) or {}).get(resource)
    if value is None:
        return None
    text = str(value).strip()
    return int(text) if text.isdigit() else None


def gpu_expected(node: dict[str, Any]) -> tuple[str, ...]:
    """Why the Node says it has NVIDIA GPUs: NFD's or the GPU Operator's label set to ``true``,
    or device-plugin capacity ``nvidia.com/gpu`` above 0 (empty: it says nothing of the kind)."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    why = [f"label {k}=true" for k in GPU_PRESENT_LABELS if str(labels.get(k, "")).lower() == "true"]
    cap = resource_count(node, "capacity")
    if cap:
        why.append(f"capacity {GPU_RESOURCE}={cap}")
    return tuple(why)


class Publisher(Protocol):
    enabled: bool
    node: str | None

    def publish(self, want: NodeWant, *, dry_run: bool = False) -> PublishResult: ...

    def read(self) -> PublishResult: ...

    def describe(self) -> str: ...

    def close(self) -> None: ...


class NullPublisher:
    """Publishing is off; every pass succeeds with nothing written and says why."""

    enabled = False

    def __init__(self, reason: str, node: str | None = None) -> None:
        self.reason = reason
        self.node = node

    def publish(self, want: NodeWant, *, dry_run: bool = False) -> PublishResult:
        return PublishResult(writes=0, changed=[], ok=True, detail=f"kubernetes publishing off: {self.reason}")

    def read(self) -> PublishResult:
        return self.publish(None)  # type: ignore[arg-type]

    def describe(self) -> str:
        return f"kubernetes: off ({self.reason})"

    def close(self) -> None:
        pass


# -- the diff (pure) --------------------------------------------------------------------------
@dataclass(frozen=True)
class NodePlan:
    """What one pass would write. ``metadata_patch`` is a merge patch (without the
    resourceVersion) or None; ``condition`` the condition to write or None."""

    metadata_patch: dict[str, Any] | None
    condition: dict[str, str] | None
    transition: bool
    changed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def _now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _is_ours(t: Any) -> bool:
    return isinstance(t, dict) and t.get("key") == TAINT_KEY and t.get("effect") == TAINT_EFFECT


def find_condition(node: dict[str, Any], ctype: str = CONDITION_TYPE) -> dict[str, Any] | None:
    for c in ((node.get("status") or {}).get("conditions") or []):
        if isinstance(c, dict) and c.get("type") == ctype:
            return c
    return None


def _age_s(stamp: Any, now_ts: float) -> float | None:
    """Seconds since an RFC 3339 time; None when it cannot be read."""
    from gpu_tune.timestamps import parse_rfc3339

    then = parse_rfc3339(stamp)
    return None if then is None else now_ts - then


def plan_node(node: dict[str, Any], want: NodeWant, now: str | None = None, *,
              heartbeat_s: float | None = None, now_ts: float | None = None) -> NodePlan:
    """Diff the Node as read against what is wanted. Writes only what differs, and the condition
    again when its ``lastHeartbeatTime`` is ``heartbeat_s`` old (None: never)."""
    now = now or _now_rfc3339()
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    changed: list[str] = []
    skipped: list[str] = []

    wanted_labels: dict[str, str] = {}
    for k, v in sorted(want.labels.items()):
        if not k.startswith(PREFIX) or k.startswith(FORBIDDEN_PREFIXES):
            skipped.append(f"label {k}: not under {PREFIX}")
        elif not isinstance(v, str) or not is_valid_label_value(v):
            skipped.append(f"label {k}: invalid value {v!r}")
        else:
            wanted_labels[k] = v
    owned_record = ",".join(sorted(wanted_labels))
    wanted_ann = {k: v for k, v in want.annotations.items() if k.startswith(PREFIX)}
    wanted_ann[ANNOTATION_OWNED] = owned_record

    label_patch: dict[str, Any] = {}
    for k, v in wanted_labels.items():
        if labels.get(k) != v:
            label_patch[k] = v
            changed.append(f"label {k}={v}" + (f" (was {labels[k]})" if k in labels else ""))
    previously_owned = [k.strip() for k in str(annotations.get(ANNOTATION_OWNED, "")).split(",") if k.strip()]
    for k in previously_owned:
        if k.startswith(PREFIX) and k not in wanted_labels and k in labels:
            label_patch[k] = None
            changed.append(f"label {k} removed (stale)")

    ann_patch: dict[str, Any] = {}
    for k, v in sorted(wanted_ann.items()):
        if annotations.get(k) != v:
            ann_patch[k] = v
            changed.append(f"annotation {k} {'updated' if k in annotations else 'added'}")

    taints = list((node.get("spec") or {}).get("taints") or [])
    new_taints: list[Any] | None = None
    have = any(_is_ours(t) for t in taints)
    if want.taint_wanted is True and not have:
        new_taints = taints + [{"key": TAINT_KEY, "effect": TAINT_EFFECT}]
        changed.append(f"taint {TAINT_KEY}:{TAINT_EFFECT} added")
    elif want.taint_wanted is False and have:
        new_taints = [t for t in taints if not _is_ours(t)]
        changed.append(f"taint {TAINT_KEY}:{TAINT_EFFECT} removed")

    patch: dict[str, Any] | None = None
    if label_patch or ann_patch or new_taints is not None:
        patch = {"metadata": {}}
        if label_patch:
            patch["metadata"]["labels"] = label_patch
        if ann_patch:
            patch["metadata"]["annotations"] = ann_patch
        if new_taints is not None:
            patch["spec"] = {"taints": new_taints}

    cur = find_condition(node)
    wc = want.condition
    cond: dict[str, str] | None = None
    transition = False
    if cur is None or any(cur.get(k) != wc.get(k) for k in ("status", "reason", "message")):
        transition = cur is None or cur.get("status") != wc.get("status")
        cond = {
            "type": CONDITION_TYPE,
            "status": wc.get("status", "Unknown"),
            "reason": wc.get("reason", ""),
            "message": wc.get("message", ""),
            "lastHeartbeatTime": now,
            "lastTransitionTime": now if transition else (cur or {}).get("lastTransitionTime") or now,
        }
        if cur is None:
            changed.append(f"condition {CONDITION_TYPE}={cond['status']} ({cond['reason']}) added")
        elif transition:
            changed.append(f"condition {CONDITION_TYPE}: {cur.get('status')} -> {cond['status']} ({cond['reason']})")
        else:
            changed.append(f"condition {CONDITION_TYPE} reason/message updated ({cond['reason']})")
    elif heartbeat_s is not None and heartbeat_s > 0:
        age = _age_s(cur.get("lastHeartbeatTime"), time.time() if now_ts is None else now_ts)
        if age is None or age >= heartbeat_s:
            cond = {"type": CONDITION_TYPE, **{k: cur.get(k, "") for k in ("status", "reason", "message")},
                    "lastHeartbeatTime": now, "lastTransitionTime": cur.get("lastTransitionTime") or now}
            changed.append(f"condition {CONDITION_TYPE} heartbeat"
                           + (f" ({age:.0f}s since the last)" if age is not None else ""))
    return NodePlan(metadata_patch=patch, condition=cond, transition=transition, changed=changed, skipped=skipped)


# -- the HTTP calls --------------------------------------------------------------------------
class CoreV1:
    """The core/v1 calls gpu-tune makes (get, patch and list Nodes, create an Event), through the
    kubernetes client's ``ApiClient``: its configuration, authentication, TLS and connection pool.

    The generated ``CoreV1Api`` is not used: importing it builds a validator for each of its
    ~1,000 endpoints, about 21 MB of resident memory and half a second of start time for the
    four calls made here (``benchmarks/bench_agent.py``). Answers are the raw JSON bytes; a non-2xx
    answer raises the client's ``ApiException``, as the generated methods do.
    """

    def __init__(self, configuration: Any) -> None:
        from kubernetes import client

        from gpu_tune import __version__

        self.client = client.ApiClient(configuration)
        # what the API server's audit log and metrics name the caller by (not the generator's)
        self.client.user_agent = f"gpu-tune/{__version__}"

    def request(self, method: str, path: str, *, query: list[tuple[str, Any]] | None = None, body: Any = None,
                content_type: str | None = None, timeout: Any = None) -> bytes:
        from kubernetes.client.exceptions import ApiException

        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        req = self.client.param_serialize(method=method, resource_path=path, query_params=query or [],
                                          header_params=headers, body=body, auth_settings=["BearerToken"])
        resp = self.client.call_api(*req, _request_timeout=timeout)
        resp.read()
        if not 200 <= resp.status <= 299:
            raise ApiException.from_response(http_resp=resp, body=None, data=None)
        return resp.data

    def close(self) -> None:
        self.client.close()


def _node_path(name: str, sub: str = "") -> str:
    from urllib.parse import quote

    return f"/api/v1/nodes/{quote(name, safe='')}{sub}"


# -- the real publisher -----------------------------------------------------------------------
class _Conflict(Exception):
    pass


class _Failed(Exception):
    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


@dataclass
class _Pass:
    reads: int = 0
    writes: int = 0
    changed: list[str] = field(default_factory=list)
    node: dict[str, Any] | None = None  # the Node as last read this pass
    first: dict[str, Any] | None = None  # the Node as first read this pass (before our writes)

    def result(self, ok: bool, detail: str) -> PublishResult:
        node = self.node
        if node is None:
            return PublishResult(writes=self.writes, changed=self.changed, ok=ok, detail=detail, reads=self.reads)
        cond = find_condition(self.first or node)
        mode = ((node.get("metadata") or {}).get("labels") or {}).get(MODE_LABEL)
        return PublishResult(writes=self.writes, changed=self.changed, ok=ok, detail=detail, reads=self.reads,
                             node_read=True, gpu_capacity=resource_count(node, "capacity"),
                             gpu_allocatable=resource_count(node, "allocatable"), gpu_expected=gpu_expected(node),
                             mode_request=str(mode) if mode is not None else None,
                             condition_status=None if cond is None else str(cond.get("status")))


def _api_message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    try:
        msg = json.loads(body).get("message") if body else None
    except (ValueError, AttributeError):
        msg = None
    return str(msg or getattr(exc, "reason", "") or exc).strip().splitlines()[0][:300]


class KubePublisher:
    """Publishes to one Node through the kubernetes client over HTTP(S) (:class:`CoreV1`)."""

    enabled = True

    def __init__(
        self,
        node_name: str,
        configuration: Any,
        *,
        source: str = "",
        event_namespace: str = EVENT_NAMESPACE,
        request_timeout: tuple[float, float] = (3.0, 10.0),
        attempts: int = 5,
        conflict_attempts: int = 5,
        backoff_base_s: float = 0.2,
        backoff_cap_s: float = 5.0,
        retry_budget_s: float = 20.0,
        heartbeat_s: float | None = HEARTBEAT_S,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._heartbeat = heartbeat_s

        configuration.retries = False  # retries are ours: bounded, with jitter, 409-aware
        self.node = node_name
        self.source = source
        self._host = configuration.host
        self._api = CoreV1(configuration)
        self._event_ns = event_namespace
        self._timeout = request_timeout
        self._attempts = max(1, attempts)
        self._conflict_attempts = max(1, conflict_attempts)
        self._base = backoff_base_s
        self._cap = backoff_cap_s
        self._budget = retry_budget_s
        self._sleep = sleep
        self._lock = threading.Lock()
        self._pending_event: dict[str, Any] | None = None
        self._node_cache: dict[str, Any] | None = None  # the Node as last read or written

    def describe(self) -> str:
        return (f"kubernetes: node {self.node} via {self.source or 'configuration'} ({self._host}), "
                f"events in namespace {self._event_ns}")

    def close(self) -> None:
        try:
            self._api.close()
        except Exception:  # noqa: BLE001 - closing a pool must not fail a shutdown
            pass

    # -- HTTP with retries -------------------------------------------------------------------
    def _call(self, ctx: _Pass, verb: str, resource: str, fn: Callable[[], Any], *, write: bool) -> dict[str, Any]:
        import urllib3
        from kubernetes.client.exceptions import ApiException

        deadline = time.monotonic() + self._budget
        last = ""
        for attempt in range(1, self._attempts + 1):
            if write:
                ctx.writes += 1
            else:
                ctx.reads += 1
            retry_after = 0.0
            try:
                return json.loads(fn() or b"{}")
            except ApiException as exc:
                status = int(exc.status or 0)
                if status == 409 and resource.startswith("nodes"):
                    raise _Conflict() from None
                if status == 409 and resource == "events":
                    return {}  # the same Event from an earlier attempt is already there
                if status == 403 and "denied request" in _api_message(exc):
                    raise _Failed(f"{verb} {resource}: refused by admission: {_api_message(exc)}") from None
                if status == 403:
                    where = (f"a Role rule in namespace {self._event_ns}" if resource == "events"
                             else "a ClusterRole rule")
                    raise _Failed(
                        f"forbidden: may not {verb} {resource} ({_api_message(exc)}); grant the agent's "
                        f'service account {where} apiGroups: [""], resources: ["{resource}"], '
                        f'verbs: ["{verb}"]') from None
                if status == 401:
                    raise _Failed(f"unauthorized: the API server rejected the credentials ({_api_message(exc)})") from None
                if status == 404 and resource.startswith("nodes"):
                    raise _Failed(f"node {self.node!r} not found: check --node / NODE_NAME") from None
                if status != 429 and not 500 <= status <= 599:
                    raise _Failed(f"{verb} {resource}: HTTP {status}: {_api_message(exc)}") from None
                last = f"HTTP {status}: {_api_message(exc)}"
                try:
                    retry_after = float((exc.headers or {}).get("Retry-After") or 0)
                except (TypeError, ValueError):
                    retry_after = 0.0
            except (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as exc:
                last = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}".rstrip(": ")
            delay = max(random.uniform(0, min(self._cap, self._base * 2 ** (attempt - 1))), min(retry_after, self._cap))
            if attempt == self._attempts or time.monotonic() + delay > deadline:
                break
            self._sleep(delay)
        raise _Failed(f"{verb} {resource}: API server {self._host} unavailable after {attempt} attempts ({last})")

    def _read_node(self, ctx: _Pass) -> dict[str, Any]:
        node = self._call(ctx, "get", "nodes", lambda: self._api.request(
            "GET", _node_path(self.node), timeout=self._timeout), write=False)
        self._node_cache = node
        ctx.node = node
        if ctx.first is None:
            ctx.first = node
        return node

    def read(self) -> PublishResult:
        """One read of the Node, no write: the facts a verdict needs before the first publish
        (device-plugin capacity, the labels saying the node has GPUs, the mode label, the
        condition as the previous agent left it)."""
        with self._lock:
            ctx = _Pass()
            try:
                self._read_node(ctx)
                return ctx.result(True, f"node {self.node} read")
            except _Failed as f:
                return ctx.result(False, f.detail)
            except Exception as exc:  # noqa: BLE001 - a failed read is a value
                return ctx.result(False, f"unexpected {type(exc).__name__}: {_first_line(exc)}")

    # -- one pass ----------------------------------------------------------------------------
    def publish(self, want: NodeWant, *, dry_run: bool = False) -> PublishResult:
        """Bring the Node to ``want``; a second identical pass makes zero write calls."""
        with self._lock:
            ctx = _Pass()
            try:
                detail = self._publish(want, ctx, dry_run)
                return ctx.result(True, detail)
            except _Failed as f:
                detail = f.detail
            except Exception as exc:  # noqa: BLE001 - a failed publish is a check row, never a crash
                log.debug("publish to node %s", self.node, exc_info=True)
                first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
                detail = f"unexpected {type(exc).__name__}: {first}".rstrip(": ")
            log.warning("publish to node %s failed: %s", self.node, detail)
            return ctx.result(False, detail)

    def _publish(self, want: NodeWant, ctx: _Pass, dry_run: bool) -> str:
        node = self._read_node(ctx)
        if dry_run:
            plan = plan_node(node, want, heartbeat_s=self._heartbeat)
            ctx.changed.extend(plan.changed)
            if plan.transition:
                ctx.changed.append(f"event {self._event_reason(want)}")
            return f"dry run: {len(plan.changed)} change(s) for node {self.node}"

        skipped: list[str] = []
        for attempt in range(1, self._conflict_attempts + 1):
            plan = plan_node(node, want, heartbeat_s=self._heartbeat)
            skipped = plan.skipped
            if plan.metadata_patch is None:
                break
            body = copy.deepcopy(plan.metadata_patch)
            body["metadata"]["resourceVersion"] = (node.get("metadata") or {}).get("resourceVersion")
            try:
                node = self._call(ctx, "patch", "nodes", lambda: self._api.request(
                    "PATCH", _node_path(self.node), query=[("fieldManager", COMPONENT)], body=body,
                    content_type=MERGE_PATCH, timeout=self._timeout), write=True)
                self._node_cache = node
            except _Conflict:
                node = self._read_node(ctx)
                continue
            ctx.changed.extend(c for c in plan.changed if not c.startswith("condition "))
            break
        else:
            raise _Failed(f"patch nodes: still conflicting after {self._conflict_attempts} attempts")

        for attempt in range(1, self._conflict_attempts + 1):
            plan = plan_node(node, want, heartbeat_s=self._heartbeat)
            if plan.condition is None:
                break
            body = {"status": {"conditions": [plan.condition]}}
            try:
                node = self._call(ctx, "patch", "nodes/status", lambda: self._api.request(
                    "PATCH", _node_path(self.node, "/status"), query=[("fieldManager", COMPONENT)], body=body,
                    content_type=STRATEGIC_MERGE_PATCH, timeout=self._timeout), write=True)
                self._node_cache = node
            except _Conflict:
                node = self._read_node(ctx)
                continue
            ctx.changed.extend(c for c in plan.changed if c.startswith("condition "))
            if plan.transition:
                self._pending_event = self._event_body(want, node)
            break
        else:
            raise _Failed(f"patch nodes/status: still conflicting after {self._conflict_attempts} attempts")

        if self._pending_event is not None:
            ev = self._pending_event
            from urllib.parse import quote

            self._call(ctx, "create", "events", lambda: self._api.request(
                "POST", f"/api/v1/namespaces/{quote(self._event_ns, safe='')}/events", body=ev,
                timeout=self._timeout), write=True)
            self._pending_event = None
            ctx.changed.append(f"event {ev['reason']}")

        note = f"; skipped {', '.join(skipped)}" if skipped else ""
        if not ctx.changed:
            return f"node {self.node} up to date{note}"
        return f"node {self.node}: {len(ctx.changed)} change(s) in {ctx.writes} write call(s){note}"

    @staticmethod
    def _event_reason(want: NodeWant) -> str:
        return "GPUHostReady" if want.condition.get("status") == "True" else "GPUHostNotReady"

    def _event_body(self, want: NodeWant, node: dict[str, Any]) -> dict[str, Any]:
        now = _now_rfc3339()
        ready = want.condition.get("status") == "True"
        reason = self._event_reason(want)
        message = f"{want.condition.get('reason', '')}: {want.condition.get('message', '')}".strip(": ")
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{self.node}.{time.time_ns():x}", "namespace": self._event_ns},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": self.node,
                               "uid": (node.get("metadata") or {}).get("uid") or self.node},
            "reason": reason,
            "message": message[:1024] or reason,
            "type": "Normal" if ready else "Warning",
            "source": {"component": COMPONENT, "host": self.node},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.node,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }


# -- choosing ---------------------------------------------------------------------------------
def _in_cluster() -> bool:
    return bool(os.environ.get(SERVICE_HOST_ENV)) and Path(SERVICE_TOKEN_FILE).is_file()


def _is_namespace_name(name: str) -> bool:
    """A DNS-1123 label, as namespace names are."""
    import re

    return len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) is not None


def event_namespace() -> str:
    """The namespace the agent posts its Events to: its own pod's.

    ``POD_NAMESPACE`` (the downward API's ``metadata.namespace``), else the in-cluster service
    account's namespace file, else :data:`EVENT_NAMESPACE` (``default``, for a kubeconfig run
    outside a pod). InputError for a value that is not a namespace name."""
    value, where = os.environ.get(POD_NAMESPACE_ENV, "").strip(), POD_NAMESPACE_ENV
    if not value:
        where = SERVICE_NAMESPACE_FILE
        try:
            value = Path(SERVICE_NAMESPACE_FILE).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            value = ""
    if not value:
        return EVENT_NAMESPACE
    if not _is_namespace_name(value):
        raise InputError(f"{where} {value[:80]!r}: not a namespace name (lower-case DNS-1123 label)")
    return value


def make_publisher(node_name: str | None, kubeconfig: str | None, no_kube: bool, **options: Any) -> Publisher:
    """The publisher for this run, chosen once and logged in one line.

    Off (a :class:`NullPublisher` with the reason) for ``no_kube`` or when there is neither an
    in-cluster service account nor a kubeconfig (``kubeconfig`` argument, else ``KUBECONFIG``).
    Raises :class:`InputError` for an unreadable or malformed kubeconfig, or when a cluster is
    configured but no node name is given (``node_name``, else ``NODE_NAME``). ``options`` go to
    :class:`KubePublisher` (timeouts, retry bounds).
    """
    node = (node_name or os.environ.get("NODE_NAME") or "").strip() or None
    if no_kube:
        pub: Publisher = NullPublisher("--no-kube given", node)
        log.info("%s", pub.describe())
        return pub
    where = "--kubeconfig" if kubeconfig else "KUBECONFIG"
    kubeconfig = kubeconfig or os.environ.get("KUBECONFIG") or None
    in_cluster = _in_cluster()
    if not in_cluster and not kubeconfig:
        pub = NullPublisher("no in-cluster service account and no --kubeconfig/KUBECONFIG", node)
        log.info("%s", pub.describe())
        return pub
    if node is None:
        raise InputError("node name: pass --node NAME or set NODE_NAME (the downward API's spec.nodeName)")
    options.setdefault("event_namespace", event_namespace())

    from kubernetes import client, config

    cfg = client.Configuration()
    if in_cluster:
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException as exc:
            raise InputError(f"in-cluster configuration: {exc}") from None
        source = "in-cluster service account" + (f" ({where} {kubeconfig} ignored)" if kubeconfig else "")
    else:
        assert kubeconfig is not None
        _load_kubeconfig(cfg, kubeconfig, where)
        source = f"kubeconfig {kubeconfig}"
    pub = KubePublisher(node, cfg, source=source, **options)
    log.info("%s", pub.describe())
    return pub


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _load_kubeconfig(cfg: Any, kubeconfig: str, where: str, context: str | None = None) -> None:
    """Fill ``cfg`` from a kubeconfig file; InputError naming the file (or the context)."""
    from kubernetes import config

    paths = [p for p in kubeconfig.split(os.pathsep) if p]
    if not any(Path(p).is_file() for p in paths):
        raise InputError(f"{where} {kubeconfig}: no such file")
    try:
        config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg,
                                persist_config=False)
    except (config.ConfigException, ValueError, TypeError, OSError) as exc:
        if context and context in str(exc):
            raise InputError(f"--context {context}: no such context in {kubeconfig}") from None
        raise InputError(f"{where} {kubeconfig}: {_first_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - YAML errors and the like from the loader
        raise InputError(f"{where} {kubeconfig}: malformed kubeconfig: {_first_line(exc)}") from None


# -- reading the fleet (for people: gpu-tune fleet) -------------------------------------------
def _connection_reason(exc: Any) -> str:
    """The operating system's words from a connection failure (``connection refused``), else the
    most specific line of the message."""
    import re

    text = str(exc)
    m = re.search(r"\[Errno -?\d+\] ([^'\")\]\n]+)", text)
    if m:
        return m.group(1).strip().lower()
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]


class ClusterError(GpuTuneError):
    """The API server could not be reached or refused the request (exit 3, one line)."""

    exit_code = 3


@dataclass(frozen=True)
class NodeListing:
    """Every Node one list call returned: ``pages`` requests, from ``server`` (via ``source``)."""

    items: list[dict[str, Any]]
    pages: int
    server: str
    source: str


def reader_configuration(kubeconfig: str | None = None, context: str | None = None) -> tuple[Any, str]:
    """(client configuration, where it came from) for a person's command, found as kubectl finds
    it: ``kubeconfig`` (``--kubeconfig``), else ``KUBECONFIG``, else ``~/.kube/config``, else the
    in-cluster service account. InputError when none is there or it is malformed."""
    from kubernetes import client, config

    cfg = client.Configuration()
    if kubeconfig:
        where, path = "--kubeconfig", kubeconfig
    elif os.environ.get("KUBECONFIG"):
        where, path = "KUBECONFIG", os.environ["KUBECONFIG"]
    else:
        where, path = "kubeconfig", os.path.expanduser("~/.kube/config")
        if not Path(path).is_file():
            if _in_cluster() and not context:
                try:
                    config.load_incluster_config(client_configuration=cfg)
                except config.ConfigException as exc:
                    raise InputError(f"in-cluster configuration: {exc}") from None
                return cfg, "in-cluster service account"
            raise InputError("no cluster configured: pass --kubeconfig FILE, set KUBECONFIG, or create "
                             "~/.kube/config")
    _load_kubeconfig(cfg, path, where, context)
    return cfg, f"{where} {path}" + (f" context {context}" if context else "")


def list_nodes(configuration: Any, *, selector: str | None = None, page_size: int = LIST_PAGE_SIZE,
               timeout: tuple[float, float] = (5.0, 60.0), attempts: int = 3, source: str = "",
               sleep: Callable[[float], None] = time.sleep) -> NodeListing:
    """Every Node (matching the label ``selector``) in one list call, paged by ``limit`` +
    ``continue``; read-only. The raw JSON is kept (no client model objects: 1,000 Nodes in well
    under a second). A continue token that expired mid-list (410) restarts the list once; 429 and
    5xx are retried (``attempts`` per page). Raises InputError for a selector the server rejects,
    ClusterError for everything else that stops the list."""
    import urllib3
    from kubernetes.client.exceptions import ApiException

    configuration.retries = False
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
                except ApiException as exc:
                    status = int(exc.status or 0)
                    msg = _api_message(exc)
                    if status == 0:  # the client's wrapping of a TLS failure
                        raise ClusterError(f"cannot reach the API server {server}: "
                                           f"{_connection_reason(exc.reason)}") from None
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
                except (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as exc:
                    raise ClusterError(f"cannot reach the API server {server}: "
                                       f"{_connection_reason(getattr(exc, 'reason', None) or exc)}") from None
                except ValueError as exc:
                    raise ClusterError(f"list nodes: API server {server} sent a malformed answer: "
                                       f"{_first_line(exc)}") from None
            if doc is None:  # restarted after an expired continue token
                continue
            pages += 1
            items.extend(i for i in doc.get("items") or [] if isinstance(i, dict))
            token = (doc.get("metadata") or {}).get("continue") or None
            if not token:
                return NodeListing(items=items, pages=pages, server=server, source=source)
    finally:
        api.close()
