"""A second node in the first node's cluster: its own kubelet, containerd, network namespace,
cgroup and mount namespace, registered with the first node's control plane.

``JoinedNode(first, workdir, ledger, name=...).start()`` after ``first.start()``. What it has of
its own, and how it reaches the first:

- network namespace ``gtk-ID-1`` with a veth pair to this machine (the node's address
  ``10.213.214.2``, the host end ``.1``: the test reaches its agent at ``http://10.213.214.2:9410``)
  and a second veth pair straight to the first node's namespace (``10.213.250.0/30``), with a
  route each way to the other node's address and pod range. Its kubelet talks to the API server
  at the first node's address through that link; the ``kubernetes`` Service
  (``10.96.0.1:443``) is DNATed there as on the first node. No forwarding on this machine is
  needed, and nothing of it outlives the namespaces.
- a mount namespace of its own, shared by its containerd and its kubelet (both started with
  ``nsenter --mount=FILE --net=...``; the namespace is kept by ``unshare --mount=FILE`` on a
  private bind of the node's state folder), in which the paths compiled into the kubelet and
  containerd (``/var/lib/kubelet/device-plugins``, ``/var/log/containers``, ``/run/containerd``,
  ``/var/lib/cni``) are private bind mounts of the node's own folders: the two kubelets would
  otherwise remove each other's device-plugin socket and container log links. Mounts made there
  (pod volumes, container root filesystems) are seen only there, and go with the namespace.
- its containerd (own root, state, socket, CNI configuration with the pod range
  ``10.244.1.0/24``), the kubelet under the cgroup ``/gtk-ID-1`` (every hierarchy), no
  controller-manager or scheduler (the first node's serve both).

Both nodes share this machine's kernel: a setting one node's pod changes is changed for the other
too. Tests enforce on one node at a time (the ``gpu-tune.io/profile-request`` label selects it).
:meth:`~tests.realkube.node.Node.stop` undoes it all (the ledger: its processes, cgroup, mounts,
namespaces and files); the first node's control plane stays.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from tests.realkube.binaries import Missing, binaries
from tests.realkube.cleanup import Ledger
from tests.realkube.node import Node, why_no_node

LINK_NET = "10.213.250"  # the first node is .1, the joining node .2 (a /30)
# Paths compiled into the kubelet and containerd that two nodes on one machine must not share.
PRIVATE_PATHS = ("/var/lib/kubelet/device-plugins", "/var/log/containers", "/run/containerd", "/var/lib/cni")


class JoinedNode(Node):
    index = 1

    def __init__(self, first: Node, workdir: Path, ledger: Ledger, *, name: str,
                 labels: dict[str, str] | None = None) -> None:
        super().__init__(workdir, ledger, name=name, run_id=first.run_id, labels=labels)
        if first.cp is None:
            raise RuntimeError("the first node is not started")
        self.first = first
        self.cp = first.cp
        self.api_ip = first.node_ip

    def start(self, timeout: float = 120.0) -> "JoinedNode":
        why = why_no_node()
        if why:
            raise Missing(why)
        bins = binaries(("kubelet",))
        t0 = time.monotonic()
        self._record_host()  # (no machine lock: the first node holds it)
        self._network()
        self._link()
        self._mount_namespace()
        self._containerd()
        self._kubelet(bins)
        self._wait_ready(t0, timeout)
        self.timings["node_ready_s"] = time.monotonic() - t0
        return self

    def _link(self) -> None:
        """A veth pair straight between the two nodes' namespaces, and the routes over it."""
        mine, theirs = f"gtkx{self.run_id}b"[:15], f"gtkx{self.run_id}a"[:15]
        first = self.first
        self._sh("ip", "link", "add", mine, "type", "veth", "peer", "name", theirs)
        self._sh("ip", "link", "set", theirs, "netns", first.netns)
        self._sh("ip", "link", "set", mine, "netns", self.netns)
        for cmd in (["ip", "addr", "add", f"{LINK_NET}.2/30", "dev", mine], ["ip", "link", "set", mine, "up"],
                    ["ip", "route", "add", f"{first.node_ip}/32", "via", f"{LINK_NET}.1"],
                    ["ip", "route", "add", first.pod_cidr, "via", f"{LINK_NET}.1"]):
            self._sh(*cmd, netns=True)
        for cmd in (["ip", "addr", "add", f"{LINK_NET}.1/30", "dev", theirs], ["ip", "link", "set", theirs, "up"],
                    ["ip", "route", "add", f"{self.node_ip}/32", "via", f"{LINK_NET}.2"],
                    ["ip", "route", "add", self.pod_cidr, "via", f"{LINK_NET}.2"]):
            first._sh(*cmd, netns=True)

    def _mount_namespace(self) -> None:
        """A persistent mount namespace (``unshare --mount=FILE``, FILE on a private mount, as
        unshare(1) requires) with this node's own folders bound over the compiled-in paths."""
        st = self.state  # recorded as a mount root: its binds are undone by the ledger
        self._sh("mount", "--bind", str(st), str(st))
        self._sh("mount", "--make-private", str(st))
        ns = st / "mnt"
        ns.touch()
        self._sh("unshare", f"--mount={ns}", "--propagation", "private", "true")
        self.mntns = str(ns)
        own = self.dir / "private"
        for path in PRIVATE_PATHS:
            src = own / path.strip("/").replace("/", "_")
            src.mkdir(parents=True, exist_ok=True)
            # the folder is made on this machine's file system (recorded by _record_host when
            # it was not there); the bind over it exists only in this node's namespace
            os.makedirs(path, exist_ok=True)
            self._sh("nsenter", f"--mount={ns}", "--", "mount", "--bind", str(src), path)

    def in_mntns(self, *argv: str) -> str:
        """A command's output, run in this node's mount namespace: pod volumes (a projected token)
        are mounted there, and the test's own namespace does not see them."""
        return self._sh("nsenter", f"--mount={self.mntns}", "--", *argv).stdout
