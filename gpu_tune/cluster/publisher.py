"""Publish a :class:`~gpu_tune.cluster.labels.NodeWant` to the Node: labels, annotations, taint, condition, Events.

Over :mod:`gpu_tune.cluster.api` (the only module that imports the ``kubernetes`` client); the
diff itself is pure (:mod:`gpu_tune.cluster.node_diff`).

Choice of cluster, made once by :func:`make_publisher` and logged in one line: ``--no-kube`` ->
off; in-cluster service account (``KUBERNETES_SERVICE_HOST`` and the token file) -> on; else
``--kubeconfig`` / ``KUBECONFIG`` -> on; else off.

One pass (:meth:`KubePublisher.publish`):

1. ``GET`` the Node (the only read of a steady pass on a node with the device plugin's
   ``nvidia.com/gpu`` capacity). A Node without it: one ``LIST`` of its ResourceSlices of NVIDIA's
   DRA driver as well (:mod:`gpu_tune.cluster.dra`), once a pass, whatever else the pass reads.
2. Diff (pure, :func:`~gpu_tune.cluster.node_diff.plan_node`): owned labels and annotations, stale owned labels (recorded in
   ``gpu-tune.io/owned-labels``; labels not recorded there are never touched), the
   taint it owns (``gpu-tune.io/not-ready:NoSchedule`` unless configured otherwise,
   :mod:`gpu_tune.tune.taint`), and a former one of its own after a change of key.
   Where the pass would take the node out (its taint, the hardware condition False) and the
   publisher has a ``limit`` (``readiness.max_out_of_service``): the blast-radius limit's ledger
   first (:mod:`gpu_tune.cluster.limit`); past the limit the node is published not ready without
   them, and one Event says so.
3. When something differs: one JSON merge patch of ``metadata`` + ``spec.taints`` carrying the
   ``metadata.resourceVersion`` just read. A merge patch replaces the taint list whole, so the
   list sent is the one read with only our taint added or removed; should another writer have
   changed the Node since, the server answers 409 and the pass reads again and re-plans. Should
   the admission policy refuse the removal of a former key (one the release's policy was not told
   of), the patch is planned again without it, once per process, and the taint is left.
4. When the ``GPUHostReady`` condition's status, reason or message differ: one strategic merge
   patch of ``nodes/status`` (conditions merge by ``type``, so the kubelet's are untouched).
   ``lastTransitionTime`` moves only when the status flips; ``lastHeartbeatTime`` is the time
   of the write. When nothing else changed, the condition is written again only once its
   ``lastHeartbeatTime`` is older than ``heartbeat_s`` (default :data:`HEARTBEAT_S`, 10 minutes):
   that is how ``gpu-tune fleet`` tells a live agent from a stopped one (``fleet --stale-after``).
   Passes in between write nothing.
5. On a status flip (or the first condition): one core v1 Event on the Node, in the namespace
   ``default`` (:data:`NODE_EVENT_NAMESPACE`): the only namespace where the API server keeps an
   Event about a cluster-scoped object (anywhere else it answers 422 "involvedObject.namespace:
   Invalid value: "": does not match event.namespace"); the kubelet posts its Node events there
   too. A Role in ``default`` granting ``create`` on ``events`` is all it needs. If posting it
   fails, it is kept and posted on the next pass.

409 -> read again and retry; 429, 5xx and connection errors -> retry with jittered exponential
backoff (bounded in attempts and seconds); 403 -> the pass fails with the RBAC rule that is
missing; failures are returned as a :class:`PublishResult`, never raised.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import socket
import threading
import time
from typing import Any, Callable, Protocol

from gpu_tune.cluster.api import (
    MERGE_PATCH,
    STRATEGIC_MERGE_PATCH,
    ApiError,
    CoreV1,
    Unreachable,
    agent_configuration,
    events_path,
    first_line,
    in_cluster,
    node_path,
)
from gpu_tune.cluster.dra import GROUP, SLICES_PATH, DraCount, count_gpus, list_node_slices
from gpu_tune.cluster.labels import NodeWant
from gpu_tune.cluster.node_diff import now_rfc3339, plan_node, resource_count
from gpu_tune.cluster.publish_result import PassRecord, PublishResult
from gpu_tune.errors import InputError

log = logging.getLogger("gpu_tune.kube")

EVIDENCE_REASON = "GPUHostEvidence"  # an Event naming an evidence bundle written while the condition stays
# Where an Event about a Node can live: kube-apiserver validates a core/v1 Event about a
# cluster-scoped object (involvedObject.namespace "") only in "default" (or, with an eventTime,
# "kube-system"), whatever namespace the agent itself runs in. The kubelet's Node events are there.
NODE_EVENT_NAMESPACE = "default"
COMPONENT = "gpu-tune"
HEARTBEAT_S = 600.0  # the GPUHostReady condition is re-written at least this often (seconds)


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



# -- the real publisher -----------------------------------------------------------------------
class _Conflict(Exception):
    pass


class _Failed(Exception):
    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class KubePublisher:
    """Publishes to one Node through the kubernetes client over HTTP(S) (:class:`CoreV1`)."""

    enabled = True

    def __init__(
        self,
        node_name: str,
        configuration: Any,
        *,
        source: str = "",
        event_namespace: str = NODE_EVENT_NAMESPACE,
        request_timeout: tuple[float, float] = (3.0, 10.0),
        attempts: int = 5,
        conflict_attempts: int = 5,
        backoff_base_s: float = 0.2,
        backoff_cap_s: float = 5.0,
        retry_budget_s: float = 20.0,
        heartbeat_s: float | None = HEARTBEAT_S,
        sleep: Callable[[float], None] = time.sleep,
        api: CoreV1 | None = None,
        limit: Any = None,
        ledger_namespace: str | None = None,
    ) -> None:
        self._heartbeat = heartbeat_s
        # readiness.max_out_of_service (None: no limit, as before it existed): gpu_tune.cluster.limit
        self.gate = None
        if limit is not None:
            from gpu_tune.cluster.limit import OutOfServiceGate

            self.gate = OutOfServiceGate(limit, ledger_namespace)

        self.node = node_name
        self.source = source
        self._host = configuration.host
        # ``api``: a client shared with other publishers (many Nodes published from one process,
        # benchmarks/bench_fleet_scale.py); closed by its owner, not here
        self._owns_api = api is None
        self._api = CoreV1(configuration) if api is None else api
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
        self._prefetched: dict[str, Any] | None = None  # read() just before a publish(): reused once
        self._prefetched_dra: tuple[bool, DraCount | None, str | None] = (False, None, None)
        self._former_refused = False  # the admission policy refused removing a former taint key
        self._read_failed: str | None = None  # ... or why that read failed (retries spent already)

    def describe(self) -> str:
        return (f"kubernetes: node {self.node} via {self.source or 'configuration'} ({self._host}), "
                f"events in namespace {self._event_ns}")

    def close(self) -> None:
        if not self._owns_api:
            return
        try:
            self._api.close()
        except Exception:  # noqa: BLE001 - closing a pool must not fail a shutdown
            pass

    # -- HTTP with retries -------------------------------------------------------------------
    def _call(self, ctx: PassRecord, verb: str, resource: str, fn: Callable[[], Any], *, write: bool,
              raw: frozenset[int] = frozenset()) -> dict[str, Any]:
        """``fn()``'s JSON, with retries; an answer whose status is in ``raw`` is raised as is."""
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
            except ApiError as exc:
                status = exc.status
                if status in raw:
                    raise
                if status == 409 and resource.startswith("nodes"):
                    raise _Conflict() from None
                if status == 409 and resource == "events":
                    return {}  # the same Event from an earlier attempt is already there
                if status == 403 and "denied request" in exc.message:
                    raise _Failed(f"{verb} {resource}: refused by admission: {exc.message}") from None
                if status == 403:
                    where = (f"a Role rule in namespace {self._event_ns}" if resource == "events"
                             else "a ClusterRole rule")
                    group = GROUP if resource == "resourceslices" else ""
                    raise _Failed(
                        f"forbidden: may not {verb} {resource} ({exc.message}); grant the agent's "
                        f'service account {where} apiGroups: ["{group}"], resources: ["{resource}"], '
                        f'verbs: ["{verb}"]') from None
                if status == 401:
                    raise _Failed(f"unauthorized: the API server rejected the credentials ({exc.message})") from None
                if status == 404 and resource.startswith("nodes"):
                    raise _Failed(f"node {self.node!r} not found: check --node / NODE_NAME") from None
                if status != 429 and not 500 <= status <= 599:
                    raise _Failed(f"{verb} {resource}: HTTP {status}: {exc.message}") from None
                last = f"HTTP {status}: {exc.message}"
                retry_after = exc.retry_after
            except Unreachable as exc:
                last = exc.detail
            delay = max(random.uniform(0, min(self._cap, self._base * 2 ** (attempt - 1))), min(retry_after, self._cap))
            if attempt == self._attempts or time.monotonic() + delay > deadline:
                break
            self._sleep(delay)
        raise _Failed(f"{verb} {resource}: API server {self._host} unavailable after {attempt} attempts ({last})")

    def _read_node(self, ctx: PassRecord) -> dict[str, Any]:
        node = self._call(ctx, "get", "nodes", lambda: self._api.request(
            "GET", node_path(self.node), timeout=self._timeout), write=False)
        ctx.node = node
        if ctx.first is None:
            ctx.first = node
        if not ctx.dra[0] and resource_count(node, "capacity") is None:
            ctx.dra = self._count_dra(ctx)
        return node

    def _count_dra(self, ctx: PassRecord) -> tuple[bool, DraCount | None, str | None]:
        """This Node's GPUs in NVIDIA's DRA driver's ResourceSlices (a Node without the device
        plugin's capacity): one list a pass. A server without ``resource.k8s.io/v1`` (404):
        none; a refused or failed list: the reason, for ``gpu.allocatable`` to report."""

        def fetch(query: list[tuple[str, Any]]) -> dict[str, Any]:
            return self._call(ctx, "list", "resourceslices", lambda: self._api.request(
                "GET", SLICES_PATH, query=query, timeout=self._timeout), write=False, raw=frozenset({404}))

        try:
            slices, truncated = list_node_slices(fetch, self.node)
        except _Failed as f:
            return True, None, f.detail
        except ApiError as exc:
            if exc.status == 404:
                return True, None, None
            return True, None, f"list resourceslices: HTTP {exc.status}: {exc.message}"
        return True, count_gpus(slices, self.node, truncated=truncated), None

    def read(self) -> PublishResult:
        """One read of the Node, no write: the facts a verdict needs before it is published
        (device-plugin capacity, the labels saying the node has GPUs, the mode label, the
        condition as the previous agent left it). The next :meth:`publish` starts from this read
        instead of reading again (the agent reads at the start of a pass and publishes at its end:
        one GET per pass)."""
        with self._lock:
            ctx = PassRecord()
            self._prefetched = self._read_failed = None
            try:
                self._prefetched = self._read_node(ctx)
                self._prefetched_dra = ctx.dra
                return ctx.result(True, f"node {self.node} read")
            except _Failed as f:
                self._read_failed = f.detail
                return ctx.result(False, f.detail)
            except Exception as exc:  # noqa: BLE001 - a failed read is a value
                return ctx.result(False, f"unexpected {type(exc).__name__}: {first_line(exc)}")

    # -- one pass ----------------------------------------------------------------------------
    def publish(self, want: NodeWant, *, dry_run: bool = False) -> PublishResult:
        """Bring the Node to ``want``; a second identical pass makes zero write calls. Right after a
        :meth:`read` that failed (its retries spent), the publish fails with the same reason
        without calling again: one pass waits out one retry budget, not two."""
        with self._lock:
            ctx = PassRecord()
            failed, self._read_failed = self._read_failed, None
            if failed is not None and self._prefetched is None:
                log.warning("publish to node %s failed: %s", self.node, failed)
                return ctx.result(False, failed)
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

    def _publish(self, want: NodeWant, ctx: PassRecord, dry_run: bool) -> str:
        node, self._prefetched = self._prefetched, None
        if node is None:
            node = self._read_node(ctx)
        else:  # read by read() at the start of this pass; a stale one is caught by the 409 below
            ctx.node = ctx.first = node
            ctx.dra = self._prefetched_dra
        if dry_run:
            plan = plan_node(node, want, heartbeat_s=self._heartbeat)
            ctx.changed.extend(plan.changed)
            if plan.transition or want.evidence_new:
                ctx.changed.append(f"event {self._event_reason(want) if plan.transition else EVIDENCE_REASON}")
            return f"dry run: {len(plan.changed)} change(s) for node {self.node}"
        limit_due, wanted = False, want
        if self.gate is not None:  # before anything that takes the node out is written
            want, ctx.limit, limit_due = self.gate.decide(self.node, want, self._ledger_call(ctx), node)

        skipped: list[str] = []
        for attempt in range(1, self._conflict_attempts + 1):
            plan = plan_node(node, want, heartbeat_s=self._heartbeat, former=not self._former_refused)
            skipped = plan.skipped
            if plan.metadata_patch is None:
                break
            body = copy.deepcopy(plan.metadata_patch)
            body["metadata"]["resourceVersion"] = (node.get("metadata") or {}).get("resourceVersion")
            try:
                node = self._call(ctx, "patch", "nodes", lambda: self._api.request(
                    "PATCH", node_path(self.node), query=[("fieldManager", COMPONENT)], body=body,
                    content_type=MERGE_PATCH, timeout=self._timeout), write=True)
            except _Conflict:
                node = self._read_node(ctx)
                continue
            except _Failed as f:
                if self._former_refused or "refused by admission" not in f.detail or \
                        plan_node(node, want, former=False).metadata_patch == plan.metadata_patch:
                    raise
                # the release's policy does not let it remove the former key: left, once said
                log.warning("node %s: a former taint key of gpu-tune's is left on the Node: %s", self.node, f.detail)
                self._former_refused = True
                continue
            ctx.changed.extend(c for c in plan.changed if not c.startswith("condition "))
            break
        else:
            raise _Failed(f"patch nodes: still conflicting after {self._conflict_attempts} attempts")

        for attempt in range(1, self._conflict_attempts + 1):
            plan = plan_node(node, want, heartbeat_s=self._heartbeat)
            if not plan.conditions:
                break
            body = {"status": {"conditions": plan.conditions}}
            try:
                node = self._call(ctx, "patch", "nodes/status", lambda: self._api.request(
                    "PATCH", node_path(self.node, "/status"), query=[("fieldManager", COMPONENT)], body=body,
                    content_type=STRATEGIC_MERGE_PATCH, timeout=self._timeout), write=True)
            except _Conflict:
                node = self._read_node(ctx)
                continue
            ctx.changed.extend(c for c in plan.changed if c.startswith("condition "))
            if plan.transition:
                self._pending_event = self._event_body(want, node)
            break
        else:
            raise _Failed(f"patch nodes/status: still conflicting after {self._conflict_attempts} attempts")

        if self._pending_event is None and want.evidence_new:  # evidence without a transition: its own Event
            self._pending_event = self._event_body(want, node, EVIDENCE_REASON)
        if self._pending_event is not None:
            ev = self._pending_event
            self._call(ctx, "create", "events", lambda: self._api.request(
                "POST", events_path(self._event_ns), body=ev,
                timeout=self._timeout), write=True)
            self._pending_event = None
            ctx.changed.append(f"event {ev['reason']}")
        if limit_due:  # once a spell: "limit reached: N of M nodes out of service by gpu-tune (limit L)"
            from gpu_tune.cluster.limit import LEDGER_REASON

            ev = {**self._event_body(want, node, LEDGER_REASON), "message": ctx.limit.says[:1024]}
            self._call(ctx, "create", "events", lambda: self._api.request(
                "POST", events_path(self._event_ns), body=ev, timeout=self._timeout), write=True)
            ctx.changed.append(f"event {LEDGER_REASON}")
        if self.gate is not None:  # a node back in service frees its slot, its taint gone first
            skipped = skipped + [why] if (why := self.gate.after(self.node, wanted, self._ledger_call(ctx))) else skipped

        note = f"; skipped {', '.join(skipped)}" if skipped else ""
        if not ctx.changed:
            return f"node {self.node} up to date{note}"
        return f"node {self.node}: {len(ctx.changed)} change(s) in {ctx.writes} write call(s){note}"

    def _ledger_call(self, ctx: PassRecord) -> Callable[..., dict[str, Any]]:
        """The limit's calls (gpu_tune.cluster.limit) through :meth:`_call`: retried alike, counted in
        the pass; 403/404/409/422 raised as ApiError, what retries could not mend as LedgerError."""
        from gpu_tune.cluster.limit import LedgerError

        def call(verb: str, resource: str, method: str, path: str, *, query: Any = None, body: Any = None,
                 accept: str = "application/json", write: bool = False) -> dict[str, Any]:
            try:
                return self._call(ctx, verb, resource, lambda: self._api.request(
                    method, path, query=query, body=body, timeout=self._timeout, accept=accept), write=write,
                    raw=frozenset({403, 404, 409, 422}))
            except _Failed as f:
                raise LedgerError(f.detail) from None
        return call

    @staticmethod
    def _event_reason(want: NodeWant) -> str:
        return "GPUHostReady" if want.condition.get("status") == "True" else "GPUHostNotReady"

    def _event_body(self, want: NodeWant, node: dict[str, Any], reason: str = "") -> dict[str, Any]:
        now = now_rfc3339()
        ready = want.condition.get("status") == "True" and not reason
        reason = reason or self._event_reason(want)
        message = f"{want.condition.get('reason', '')}: {want.condition.get('message', '')}".strip(": ")
        if want.evidence:  # the bundles kept on the node, before the message's own words are cut
            more = len(want.evidence) - 3
            shown = ", ".join(want.evidence[:3]) + (f" and {more} more" if more > 0 else "")
            message = f"evidence: {shown}; {message[:1024 - len(shown) - 12]}"
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
def node_name(option: str | None) -> str:
    """The agent's Node: ``--node``, else ``NODE_NAME`` (the downward API's ``spec.nodeName``),
    else this host's name."""
    return option or os.environ.get("NODE_NAME") or socket.gethostname()


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
    if not in_cluster() and not kubeconfig:
        pub = NullPublisher("no in-cluster service account and no --kubeconfig/KUBECONFIG", node)
        log.info("%s", pub.describe())
        return pub
    if node is None:
        raise InputError("node name: pass --node NAME or set NODE_NAME (the downward API's spec.nodeName)")

    cfg, source = agent_configuration(kubeconfig, where)
    pub = KubePublisher(node, cfg, source=source, **options)
    log.info("%s", pub.describe())
    return pub

