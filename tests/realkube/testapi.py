"""The real API server as a test sees it: Nodes made and read back by the admin, every client
call recorded (and faults injected on cue) by a :class:`~tests.realkube.proxy.FaultProxy`.

``RealAPI(control_plane)`` is made per test (the control plane is shared by the session): the
Nodes a test adds, and the Events about them, are deleted when it ends, so tests do not see each
other's objects. Clients point at :attr:`RealAPI.url`, the proxy, with a bearer token: the
static admin token ``test-token`` or a ServiceAccount token (:meth:`ControlPlane.token`).
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from tests.realkube.controlplane import ADMIN_TOKEN, ApiError, ControlPlane
from tests.realkube.proxy import FaultProxy

KUBELET_READY = {"type": "Ready", "status": "True", "reason": "KubeletReady",
                 "message": "kubelet is posting ready status"}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class RealAPI:
    token = ADMIN_TOKEN

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        host, port = cp.host, cp.port
        self.proxy = FaultProxy(host, port, str(cp.pki.ca.cert)).start()
        self.made_nodes: list[str] = []
        self.made_paths: list[str] = []  # other objects made by create(), deleted at the end
        self.audit_start = cp.audit_mark()

    # -- the proxy's records and faults, as attributes ---------------------------------------------
    @property
    def url(self) -> str:
        return self.proxy.url

    def __getattr__(self, name: str) -> Any:
        if name in ("writes", "reads", "calls", "bodies", "list_calls", "queries", "user_agents", "fail", "clear_faults",
                    "expire_continue_tokens", "total_writes", "reset_counts"):
            return getattr(self.proxy, name)
        raise AttributeError(name)

    @property
    def conflict_first_try(self) -> bool:
        return self.proxy.conflict_first_try

    @conflict_first_try.setter
    def conflict_first_try(self, value: bool) -> None:
        self.proxy.conflict_first_try = value

    @property
    def latency_s(self) -> float:
        return self.proxy.latency_s

    @latency_s.setter
    def latency_s(self, value: float) -> None:
        self.proxy.latency_s = value

    def stop(self) -> None:
        """Refuse connections (the proxy's port closes); :meth:`start` serves again."""
        self.proxy.stop()

    def start(self) -> "RealAPI":
        self.proxy.start()
        return self

    # -- Nodes, as the kubelet registers them ------------------------------------------------------
    def add_node(self, name: str, *, labels: dict[str, str] | None = None,
                 annotations: dict[str, str] | None = None, taints: list[dict[str, Any]] | None = None,
                 conditions: list[dict[str, Any]] | None = None, capacity: dict[str, str] | None = None,
                 allocatable: dict[str, str] | None = None) -> dict[str, Any]:
        """A Node as a kubelet registers it: created, then its status (the kubelet's Ready
        condition, cpu/memory/pods, plus ``capacity``/``allocatable`` as the NVIDIA device plugin
        adds ``nvidia.com/gpu``; allocatable defaults to the capacity)."""
        self.made_nodes.append(name)
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                                      **(labels or {})},
                             "annotations": dict(annotations or {})},
                "spec": {"taints": list(taints or [])}}
        try:
            self.cp.request("POST", "/api/v1/nodes", body)
        except ApiError as exc:  # left by a test that did not end (a Node name is the cluster's)
            if exc.status != 409:
                raise
            self.delete_node(name)
            self.cp.request("POST", "/api/v1/nodes", body)
        now = _now()
        conds = conditions if conditions is not None else [
            {**KUBELET_READY, "lastHeartbeatTime": now, "lastTransitionTime": now}]
        status = {"conditions": conds,
                  "capacity": {"cpu": "224", "memory": "2113445612Ki", "pods": "110", **(capacity or {})},
                  "allocatable": {"cpu": "223", "memory": "2111245612Ki", "pods": "110",
                                  **((capacity or {}) if allocatable is None else allocatable)},
                  "addresses": [{"type": "InternalIP", "address": "10.0.0.1"},
                                {"type": "Hostname", "address": name}]}
        self.cp.request("PATCH", f"/api/v1/nodes/{quote(name)}/status", {"status": status},
                        "application/strategic-merge-patch+json")
        # the API server taints a new Node node.kubernetes.io/not-ready (TaintNodesByCondition);
        # the node lifecycle controller lifts it once the kubelet reports Ready: as it would
        return self.cp.request("PATCH", f"/api/v1/nodes/{quote(name)}", {"spec": {"taints": list(taints or [])}},
                               "application/merge-patch+json")

    def create(self, collection: str, doc: dict[str, Any]) -> dict[str, Any]:
        """POST ``doc`` to ``collection`` as the admin (a ResourceSlice as a DRA driver publishes
        it, ...); deleted when the test ends."""
        made = self.cp.request("POST", collection, doc)
        self.made_paths.append(f"{collection}/{quote(made['metadata']['name'])}")
        return made

    def node(self, name: str) -> dict[str, Any]:
        return self.cp.request("GET", f"/api/v1/nodes/{quote(name)}")

    def edit_node(self, name: str, patch: dict[str, Any]) -> None:
        """Another controller's write (a merge patch; ``status`` through ``nodes/status``)."""
        patch = copy.deepcopy(patch)
        status = patch.pop("status", None)
        if patch:
            self.cp.request("PATCH", f"/api/v1/nodes/{quote(name)}", patch, "application/merge-patch+json")
        if status is not None:
            self.cp.request("PATCH", f"/api/v1/nodes/{quote(name)}/status", {"status": status},
                            "application/merge-patch+json")

    def patch_status(self, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """A strategic merge patch of ``nodes/status`` as the admin (conditions merge by type)."""
        return self.cp.request("PATCH", f"/api/v1/nodes/{quote(name)}/status", {"status": status},
                               "application/strategic-merge-patch+json")

    def delete_node(self, name: str) -> None:
        self.cp.delete(f"/api/v1/nodes/{quote(name)}", wait=True)
        self.delete_events(name)

    def events_for(self, node: str) -> list[dict[str, Any]]:
        """Events about Node ``node`` in every namespace, oldest first."""
        sel = quote(f"involvedObject.kind=Node,involvedObject.name={node}")
        items = self.cp.request("GET", f"/api/v1/events?fieldSelector={sel}")["items"]
        return sorted(items, key=lambda e: int(e["metadata"]["resourceVersion"]))

    def delete_events(self, node: str) -> None:
        for ev in self.events_for(node):
            try:
                self.cp.request("DELETE", f"/api/v1/namespaces/{ev['metadata']['namespace']}/events/"
                                          f"{quote(ev['metadata']['name'])}")
            except ApiError as exc:
                if exc.status != 404:
                    raise

    # -- identities -----------------------------------------------------------------------------------
    def namespace(self, name: str) -> None:
        """Make namespace ``name`` unless it exists (namespaces are never deleted here: that takes
        the controller-manager's namespace controller)."""
        try:
            self.cp.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                           "metadata": {"name": name}})
        except ApiError as exc:
            if exc.status != 409:
                raise

    def service_account(self, namespace: str, name: str) -> None:
        self.namespace(namespace)
        try:
            self.cp.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts",
                            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}})
        except ApiError as exc:
            if exc.status != 409:
                raise

    def pod_on(self, namespace: str, name: str, node: str, service_account: str) -> dict[str, Any]:
        """A Pod object bound to ``node`` (nothing runs it: the control plane has no kubelet), for
        a token bound to it: the token then names the node."""
        self.service_account(namespace, service_account)
        path = f"/api/v1/namespaces/{namespace}/pods"
        try:
            self.cp.request("DELETE", f"{path}/{name}?gracePeriodSeconds=0")
        except ApiError as exc:
            if exc.status != 404:
                raise
        return self.cp.request("POST", path, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeName": node, "serviceAccountName": service_account, "automountServiceAccountToken": False,
                     "containers": [{"name": "agent", "image": "gpu-tune:0.1.0"}]}})

    def kubeconfig(self, path: Any, token: str) -> Any:
        """A kubeconfig for the proxy with ``token``."""
        return write_kubeconfig(path, self.url, token=token)

    # -- the end of a test ---------------------------------------------------------------------------
    def close(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.proxy.stop()
        names = set(self.made_nodes)
        events = self.cp.request("GET", "/api/v1/events?fieldSelector=involvedObject.kind%3DNode")["items"]
        paths = [f"/api/v1/nodes/{quote(n)}" for n in names] + list(self.made_paths)
        paths += [f"/api/v1/namespaces/{e['metadata']['namespace']}/events/{quote(e['metadata']['name'])}"
                  for e in events if e["involvedObject"].get("name") in names]

        def delete(path: str) -> None:
            try:
                self.cp.delete(path)
            except (ApiError, OSError):
                pass

        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(delete, paths))


def write_kubeconfig(path: str | Path, server_url: str, token: str | None = ADMIN_TOKEN,
                     context: str = "test") -> Path:
    """A kubeconfig pointing at ``server_url`` (the proxy: plain HTTP) with a bearer token."""
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
