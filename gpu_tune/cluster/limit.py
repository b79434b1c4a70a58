"""The blast-radius limit told to Kubernetes: :class:`KubeLedger`, the compare-and-set store that
:mod:`gpu_tune.judge.fleet_limit` counts and writes through, and :class:`OutOfServiceGate`, what one
agent's publisher asks before it takes its Node out (docs/deploy.md, "How many nodes gpu-tune takes
out at once").

- **The ledger**: one ConfigMap, ``gpu-tune-out-of-service`` in the agent's namespace (shipped
  empty by the chart and kustomize), whose ``data`` maps each node out of service by gpu-tune to
  when it was taken out (``2026-12-07T18:20:39.123456Z``). Written only with ``update`` carrying the
  ``resourceVersion`` it was read at: two agents that counted the same ledger cannot both write it
  (the second gets 409 and counts again, at most :data:`~gpu_tune.judge.fleet_limit.TRIES` times).
  The admission policy lets an agent add, change or remove only its own node's key, and remove
  the key of a node that no longer exists.
- **N**: the ledger's entries whose Node still carries ``gpu-tune.io/ready`` (a Node that vanished
  is not counted; its entry is pruned by the next write). **M**: the Nodes carrying
  ``gpu-tune.io/ready`` (every agent sets it on its own Node at its first publish), this node
  included: listed as a Table without objects (``includeObject=None``: a name and four short
  cells per Node, ~0.2 KiB, not the Node's 10-20 KiB) from the API server's watch cache
  (``resourceVersion=0``), once per decision, never on a ready pass.
- **Taken out** means the taint added and the hardware condition set to False, both after the
  ledger names the node; **put back** (the node ready again) removes the taint first, then its
  entry, so the ledger never counts fewer nodes than carry the taint.
- A node past the limit counts again on a later pass only when the ledger changed since the count
  that refused it, or :data:`RECOUNT_S` after it (a Node that vanished frees its slot then): one
  small ``get`` per pass otherwise. A Node that already carries the taint (the startup taint since
  it registered, or taken out earlier) and the hardware condition False is not taken out again:
  it neither counts nor takes a slot. The limit never removes a taint.
- No ledger (404) or no right to read it (403): a deployment that predates the limit. The node is
  taken out as before, and ``fleet.limit`` says the limit is not enforced and why.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Callable
from urllib.parse import quote

from gpu_tune.judge import fleet_limit
from gpu_tune.judge.fleet_limit import Census, Out, Outcome

LEDGER = "gpu-tune-out-of-service"
LEDGER_REASON = "GPUHostOutOfServiceLimit"  # the Event of a node the limit keeps in service
NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
NAMESPACE_ENV = "GPU_TUNE_NAMESPACE"
DEFAULT_NAMESPACE = "gpu-tune"
JUDGED_LABEL = "gpu-tune.io/ready"  # set by every agent on its Node: the nodes gpu-tune judges
RECOUNT_S = 300.0
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"


class LedgerError(Exception):
    """The ledger could not be read or written (the reason in one line)."""


class LedgerMissing(LedgerError):
    """No ledger ConfigMap: nothing can be taken out, and there is no entry to remove."""


def ledger_namespace() -> str:
    """Where the ledger lives: ``GPU_TUNE_NAMESPACE``, else the pod's own namespace (its
    service account's), else ``gpu-tune``."""
    ns = os.environ.get(NAMESPACE_ENV, "").strip()
    if ns:
        return ns
    try:
        return Path(NAMESPACE_FILE).read_text().strip() or DEFAULT_NAMESPACE
    except OSError:
        return DEFAULT_NAMESPACE


def stamp(t: float | None = None) -> str:
    t = time.time() if t is None else t
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


# ``call(verb, resource, method, path, query, body, accept, write)`` -> JSON: the publisher's HTTP
# with its retries; raises ApiError for 403/404/409/422 and LedgerError for what its retries could not mend
Call = Callable[..., dict[str, Any]]


class KubeLedger:
    """:class:`gpu_tune.judge.fleet_limit.Store` over the ledger ConfigMap, for one decision of
    ``node``'s agent. ``writes``/``conflicts``: the updates sent and those refused with 409."""

    compare_and_set = True
    failures = (LedgerError,)
    tick_s = 0.0

    def __init__(self, node: str, call: Call, namespace: str, name: str = LEDGER) -> None:
        self.node, self.call, self.name = node, call, name
        self.path = f"/api/v1/namespaces/{quote(namespace)}/configmaps/{quote(name)}"
        self.where = f"ConfigMap {namespace}/{name}"
        self.read: dict[str, Any] = {}  # the ledger as last read
        self.judged: set[str] | None = None  # listed once per decision, kept across its conflicts
        self.writes = self.conflicts = 0

    def get(self) -> dict[str, Any]:
        from gpu_tune.cluster.api import ApiError

        try:
            self.read = self.call("get", "configmaps", "GET", self.path)
        except ApiError as exc:
            if exc.status == 404:
                raise LedgerMissing(f"the ledger {self.where} does not exist: install it with the chart or "
                                    "kustomize (the agent never creates it)") from None
            if exc.status == 403:
                raise LedgerMissing(f"may not get the ledger {self.where} (HTTP 403: {exc.message}): install "
                                    "the chart's or kustomize's RBAC") from None
            raise LedgerError(f"get {self.where}: HTTP {exc.status}: {exc.message}") from None
        return self.read

    def entries(self) -> dict[str, str]:
        return dict(self.read.get("data") or {})

    def version(self) -> str:
        return str((self.read.get("metadata") or {}).get("resourceVersion") or "")

    def _list_judged(self) -> set[str]:
        from gpu_tune.cluster.api import ApiError

        try:
            table = self.call("list", "nodes", "GET", "/api/v1/nodes", query=[
                ("labelSelector", JUDGED_LABEL), ("resourceVersion", "0"), ("includeObject", "None")], accept=TABLE)
        except ApiError as exc:
            raise LedgerError(f"list nodes (the nodes gpu-tune judges): HTTP {exc.status}: {exc.message}") from None
        cols = [str(c.get("name", "")).lower() for c in table.get("columnDefinitions") or []]
        at = cols.index("name") if "name" in cols else 0
        names = {str(r["cells"][at]) for r in table.get("rows") or [] if len(r.get("cells") or ()) > at}
        if not names and table.get("kind") != "Table":  # a server that ignored the Table ask: a NodeList
            names = {str(i["metadata"]["name"]) for i in table.get("items") or []}
        return names

    def census(self) -> Census:
        self.get()
        if self.judged is None:
            self.judged = self._list_judged()
        live = self.judged | {self.node}
        out = tuple(Out(n, s) for n, s in sorted(self.entries().items()) if n in live)
        return Census(len(live), out, self.version())

    def _update(self, data: dict[str, str], version: str) -> bool:
        from gpu_tune.cluster.api import ApiError

        body = {**self.read, "data": data}
        body["metadata"] = {**(self.read.get("metadata") or {}), "resourceVersion": version}
        self.writes += 1
        try:
            self.read = self.call("update", "configmaps", "PUT", self.path, body=body, write=True)
        except ApiError as exc:
            if exc.status == 409:
                self.conflicts += 1
                return False
            raise LedgerError(f"update {self.where}: HTTP {exc.status}: {exc.message}") from None
        return True

    def take_out(self, node: str, census: Census) -> bool:
        live = (self.judged or set()) | {self.node}
        data = {n: s for n, s in self.entries().items() if n in live}  # a vanished Node's entry pruned
        data[node] = stamp()
        return self._update(data, census.version)

    def put_back(self, node: str, says: str) -> None:  # never called: a compare-and-set store never overshoots
        raise NotImplementedError

    def remove(self, node: str) -> bool:
        """Take ``node``'s entry out (its node is back in service); True once it is not there."""
        for _ in range(fleet_limit.TRIES):
            data = self.entries() if self.read else self.get().get("data") or {}
            if node not in data:
                return True
            if self._update({n: s for n, s in data.items() if n != node}, self.version()):
                return True
            self.get()
        return False


def wants_out(want: Any) -> bool:
    """The NodeWant keeps the node out: gpu-tune's taint wanted, or its hardware condition False."""
    return want.taint_wanted is True or any(c.get("status") == "False" for c in want.more_conditions)


def takes_out(want: Any, node: dict[str, Any]) -> bool:
    """Writing ``want`` would take the Node, as read, out: add the taint it lacks, or turn its
    hardware condition False. A Node already carrying them (the startup taint since it registered,
    or taken out before) is not taken out again: it needs no slot."""
    from gpu_tune.cluster.node_diff import find_condition

    taints = (node.get("spec") or {}).get("taints") or []
    if want.taint_wanted is True and want.taint is not None and not any(want.taint.matches(t) for t in taints):
        return True
    return any(c.get("status") == "False" and (find_condition(node, str(c.get("type"))) or {}).get("status") != "False"
               for c in want.more_conditions)


def held_in(want: Any) -> Any:
    """``want`` for a node the limit keeps in service: still reported not ready (labels, annotations,
    ``GPUHostReady`` False), no taint added and the hardware condition not set to False (the limit
    never removes a taint either: a node that has one keeps it)."""
    return dataclasses.replace(want, taint_wanted=None if want.taint_wanted is True else want.taint_wanted,
                               more_conditions=tuple(c for c in want.more_conditions if c.get("status") != "False"))


class OutOfServiceGate:
    """One agent's side of the limit, kept across its passes: whether its node is in the ledger
    (None: not known since this process started) and the latest outcome."""

    def __init__(self, limit: Any, namespace: str | None = None, *, name: str = LEDGER,
                 recount_s: float = RECOUNT_S, clock: Callable[[], float] = time.monotonic) -> None:
        from gpu_tune.tune.readiness import parse_out_of_service

        self.limit = parse_out_of_service(limit)
        self.namespace = namespace or ledger_namespace()
        self.name, self.recount_s, self.clock = name, recount_s, clock
        self.listed: bool | None = None
        self.last: Outcome | None = None
        self.refused: tuple[str, float] | None = None  # (ledger version, when) of the count that refused
        self.said = False  # the limit's Event posted for this spell of not ready
        self.writes = self.conflicts = 0  # over the process's life (benchmarks)

    def decide(self, node: str, want: Any, call: Call, read: dict[str, Any]) -> tuple[Any, Outcome | None, bool]:
        """Before the Node (``read``: as just read) is written: (the NodeWant to write, the limit's
        outcome or None where nothing is taken out, whether the limit's Event is due)."""
        if not wants_out(want):
            return want, None, False
        if not takes_out(want, read):  # out already: the outcome that took it out, if this agent did
            return want, (self.last if self.listed and self.last is not None and self.last.taken else None), False
        o = self._outcome(node, call)
        self.last = o
        if o.taken:
            self.listed, self.refused, self.said = True, None, False
            return want, o, False
        due, self.said = not self.said, True
        return held_in(want), o, due

    def _outcome(self, node: str, call: Call) -> Outcome:
        quick = fleet_limit.report_only(self.limit)
        if quick is not None:
            return quick
        store = KubeLedger(node, call, self.namespace, self.name)
        try:
            if self.refused is not None and self.last is not None and self.clock() - self.refused[1] < self.recount_s:
                store.get()
                if store.version() == self.refused[0]:
                    return self.last  # nothing changed since the count that refused it
            o = fleet_limit.take_out(store, node, self.limit)
        except LedgerMissing as exc:  # a deployment without it (older manifests): taken out as before the limit
            o = Outcome(fleet_limit.TAKE, 0, 0, 0, self.limit.words(), problem=f"{exc}: the limit is not enforced")
        except LedgerError as exc:
            o = Outcome(fleet_limit.LIMIT, 0, 0, 0, self.limit.words(), problem=f"{exc}: not taken out")
        finally:
            self.writes += store.writes
            self.conflicts += store.conflicts
        if not o.taken:
            self.refused = (store.version(), self.clock())
        return o

    def after(self, node: str, want: Any, call: Call) -> str:
        """After the Node was written: a node back in service takes its entry out of the ledger
        (read once after a restart, then only when this agent put it there). '' or why not."""
        if wants_out(want) or self.listed is False:
            return ""
        self.last = self.refused = None
        self.said = False
        store = KubeLedger(node, call, self.namespace, self.name)
        try:
            done = store.remove(node)
        except LedgerMissing:
            done = True  # no ledger, no entry of its own in it
        except LedgerError as exc:
            return f"its entry in the ledger not removed ({exc}): the next pass tries again"
        finally:
            self.writes += store.writes
            self.conflicts += store.conflicts
        if done:
            self.listed = False
            return ""
        return f"its entry in the ledger not removed: {store.where} changed under each of {fleet_limit.TRIES} tries"
