"""realkube: a real Kubernetes for a test suite, started from the official server binaries.

No kind, no minikube, no container registry: etcd and the Kubernetes v1.36 server binaries run as
plain processes, and the harness removes every trace of them afterwards. Two sizes:

**A control plane alone** (:class:`~tests.realkube.controlplane.ControlPlane`): etcd +
kube-apiserver on free ports of 127.0.0.1, certificates made with ``openssl``, authorization
``Node,RBAC``, the NodeRestriction admission plugin, ValidatingAdmissionPolicy, and an audit log
(one JSON line per call) to count a user's writes. Ready in about 3 s; no root needed. One per
test session (fixture ``control_plane``); each test gets a
:class:`~tests.realkube.testapi.RealAPI` (fixture ``api``) whose Nodes and Events are deleted when
the test ends, and whose :class:`~tests.realkube.proxy.FaultProxy` records every client call and
injects, on cue, the faults a real server will not produce when asked (a 503 for the next call, a
409 on every first write, a refused connection, an expired list continue token).

**A whole node** (:class:`~tests.realkube.node.Node`): the control plane plus
kube-controller-manager, kube-scheduler, containerd (runc), the kubelet and bridge CNI, all inside
a network namespace of its own, with a node address reachable from the test; Ready in about 10 s.
Images are imported from ``podman save`` archives (nothing is pulled). Root only. It changes
this machine's kernel settings the way any kubelet does (``kernel.panic``,
``vm.overcommit_memory``), and pods in it may change more (an enforcing gpu-tune agent tunes
``vm.*``, THP, IRQ affinity): all of it is saved first and put back at the end. One per run
(fixture ``kube_node``), shared by the modules that use it.

**A second node** (:class:`~tests.realkube.joined.JoinedNode`) joins the first: its own kubelet,
containerd, network namespace, cgroup and a mount namespace of its own (the paths compiled into
the kubelet and containerd are private bind mounts there), registered with the first node's
control plane (fixture ``second_kube_node``). The two share this machine's kernel.

cgroups: v1, hybrid (v1 controllers with a v2 tree beside them, as on the machine this was
written on) and v2 alike: the hierarchies are read from ``/proc/self/mountinfo``
(:func:`~tests.realkube.cleanup.cgroup_roots`), and a node's cgroup is made, read and removed in
each of them. Only v1 and hybrid have run a whole node so far; v2 is tested at the level of the
path logic (tests/test_realkube_cleanup.py).

Binaries: ``KUBE_BIN_DIR`` (default ``../shared/kube`` beside the repository when it exists),
plain or zstd-compressed with a ``SHA256SUMS``; compressed ones are unpacked once into
``~/.cache/gpu-tune/kube/v1.36.2`` (:mod:`~tests.realkube.binaries`). Debian packages:
``etcd-server``, ``containerd``, ``runc``, ``containernetworking-plugins``, ``iptables``,
``conntrack``, ``zstd``. Without them a test that needs them is skipped with the reason (which
version, where to download it: the official ``kubernetes-server-linux-amd64.tar.gz``); with
``CI=true`` it fails instead.

Cleanup, whatever happens (:mod:`~tests.realkube.cleanup`): each run keeps a ledger (one JSON file
under ``/run/gpu-tune-realkube/``) of what it makes, written *before* making it: processes (pid and
start time), the cgroup of its pods, mount points, the network namespace, files and folders it
created, the kernel settings it may change. Fixture teardown undoes the ledger; so does an
``atexit`` hook, SIGTERM (turned into KeyboardInterrupt so teardown runs) and Ctrl-C; a run killed
outright is cleaned by the janitor at the start of the next run (ledgers whose owner is gone).

Using it from another project: copy this folder, keep ``plugin.py``'s fixtures (or import them
into a ``conftest.py``), and point ``KUBE_BIN_DIR`` at the binaries::

    def test_my_controller(api):
        api.add_node("n1", labels={"a": "b"})
        ...                                  # your client against api.url, token api.token
        assert api.writes["n1"] == 1         # what the proxy saw
        assert api.cp.writes_by("system:serviceaccount:ns:sa", api.audit_start) == []
"""
