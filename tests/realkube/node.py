"""A whole single-node cluster in a network namespace of its own: the control plane, the
controller-manager, the scheduler, containerd (runc) and the kubelet, with bridge CNI.

Layout (``ID`` is the pytest process's pid, so two checkouts never share names):

- network namespace ``gtk-ID`` holding every component and every pod (``hostNetwork`` pods
  included: for them "the host" is this namespace). A veth pair gives the node the address
  :data:`NODE_IP` (the host end is :data:`HOST_IP`), so the test reaches the API server at
  ``https://NODE_IP:6443`` and the agents at ``http://NODE_IP:9410``. There is no kube-proxy:
  an iptables DNAT inside the namespace sends ``10.96.0.1:443`` (the ``kubernetes`` Service)
  to the API server, which is all in-cluster clients need. Everything in the namespace,
  iptables rules and the CNI bridge included, vanishes with it.
- containerd with its own root, state, socket and CNI configuration folder (nothing in
  ``/etc/cni/net.d``), network namespaces of pods under its state folder, the sandbox image
  imported from the ``pause-*.tar`` beside the binaries, ``restrict_oom_score_adj`` (a root
  without CAP_SYS_RESOURCE), and a second runtime ``nvidia`` that is plain runc, so pods with
  ``runtimeClassName: nvidia`` run (the RuntimeClass is created).
- the kubelet under the cgroup ``/gtk-ID`` (cgroupfs driver; made in every hierarchy: cgroup v1,
  hybrid or v2, :func:`~tests.realkube.cleanup.cgroup_roots`) with its own root, pod log and
  FlexVolume folders (the controller-manager's FlexVolume folder too); the paths compiled into it
  (``/var/lib/kubelet/device-plugins``, ``/var/log/containers``, ``/run/containerd``,
  ``/var/lib/cni``, and ``/usr/libexec/kubernetes`` should anything still make it) are recorded and
  removed when the run made them.

A second node joins the first (:class:`~tests.realkube.joined.JoinedNode`): its own network
namespace, containerd, cgroup and mount namespace, registered with the first node's control plane.

Kernel settings of this machine that the kubelet sets at start (``kernel.panic``,
``vm.overcommit_memory`` ...) and that enforce-mode agents change (``vm.*``, THP, IRQ
affinity, ``/etc/gpu-tune``, ``/var/lib/gpu-tune``) are saved in the ledger first and put back
by :meth:`Node.stop` (and by the janitor after a killed run).
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.realkube.binaries import Missing, binaries, pause_image_tar, tool
from tests.realkube.cleanup import Ledger, files_under, make_cgroup, mounts_under
from tests.realkube.controlplane import SERVICE_IP, ApiError, ControlPlane, kubeconfig_text, run_kubectl
from tests.realkube.procs import Proc, env_without_proxy

NODE_IP = "10.213.213.2"
HOST_IP = "10.213.213.1"
POD_CIDR = "10.244.0.0/24"
CLUSTER_CIDR = "10.244.0.0/16"
RUNTIME_CLASS = "nvidia"

# Kernel files this machine's kubelet and enforce-mode agents may change, saved before and put
# back after (globs; write-only and unreadable files are skipped).
HOST_KERNEL_FILES = [
    "/proc/sys/vm/*", "/proc/sys/kernel/numa_balancing", "/proc/sys/kernel/panic", "/proc/sys/kernel/panic_on_oops",
    "/proc/sys/kernel/keys/root_maxkeys", "/proc/sys/kernel/keys/root_maxbytes",
    "/sys/kernel/mm/transparent_hugepage/enabled", "/sys/kernel/mm/transparent_hugepage/defrag",
    "/sys/devices/system/cpu/cpu*/cpufreq/scaling_governor", "/sys/devices/system/cpu/cpu*/cpuidle/state*/disable",
    "/proc/irq/*/smp_affinity_list",
]
# Host folders the agent's hostPath volumes write (DirectoryOrCreate).
AGENT_HOST_DIRS = ["/var/lib/gpu-tune", "/etc/gpu-tune"]
# Paths compiled into the kubelet, containerd and libcni: removed after when this run made them.
# (/usr/libexec/kubernetes: the default FlexVolume folder, which the kubelet and the controller-manager
# create at start unless told another, as they are here)
FIXED_PATHS = ["/var/lib/kubelet", "/var/log/containers", "/var/log/pods", "/run/containerd", "/var/lib/cni",
               "/opt/cni", "/usr/libexec/kubernetes"]


def kernel_files() -> list[str]:
    out = []
    for pattern in HOST_KERNEL_FILES:
        for p in sorted(glob.glob(pattern)):
            if os.path.isfile(p) and os.access(p, os.R_OK):
                out.append(p)
    return out


def why_no_node() -> str | None:
    """Why a whole node cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "a whole node needs root (network namespace, containerd, kubelet)"
    for name, pkg in (("containerd", "containerd"), ("ctr", "containerd"), ("runc", "runc"),
                      ("iptables", "iptables"), ("ip", "iproute2"), ("nsenter", "util-linux"),
                      ("etcd", "etcd-server"), ("conntrack", "conntrack")):
        try:
            tool(name, pkg)
        except Missing as exc:
            return str(exc)
    if not os.path.exists("/usr/lib/cni/bridge"):
        return "the CNI plugins are not installed (Debian package containernetworking-plugins)"
    return None


class Node:
    """``Node(workdir, ledger).start()``; :attr:`cp` is its control plane."""

    index = 0  # the first node; a node that joins it (tests/realkube/joined.py) is 1

    def __init__(self, workdir: Path, ledger: Ledger, *, name: str = "gpu-tune-node", run_id: str | None = None,
                 labels: dict[str, str] | None = None) -> None:
        self.run_id = run_id or str(os.getpid())
        self.name = name
        self.dir = Path(workdir)
        self.ledger = ledger
        tag = f"{self.run_id}-{self.index}" if self.index else self.run_id
        self.netns = f"gtk-{tag}"
        self.cgroup = f"gtk-{tag}"
        self.state = Path("/run/gpu-tune-realkube") / f"n{tag}"  # sockets: a short path
        # this node's addresses: 10.213.213.2 (host end .1), 10.213.214.2 for the next node ...
        self.node_ip = f"10.213.{213 + self.index}.2"
        self.host_ip = f"10.213.{213 + self.index}.1"
        self.pod_cidr = f"10.244.{self.index}.0/24"
        self.api_ip = NODE_IP  # where this node's kubelet finds the API server
        self.mntns: str | None = None  # a mount namespace of its own (a node joining another)
        self.labels = dict(labels or {})
        self.procs: list[Proc] = []
        self.cp: ControlPlane | None = None
        self.sock = self.state / "containerd.sock"
        self.timings: dict[str, float] = {}
        self._lock_fd: int | None = None

    # -- start ---------------------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> "Node":
        why = why_no_node()
        if why:
            raise Missing(why)
        bins = binaries()
        t0 = time.monotonic()
        self._machine_lock()
        self._record_host()
        self._network()
        self.cp = ControlPlane(self.dir / "cp", self.ledger, netns=self.netns, host=self.node_ip,
                               extra_hosts=(self.node_ip,)).start(timeout=60)
        self.timings["control_plane_ready_s"] = self.cp.ready_s or 0.0
        self._cluster_objects()
        self._containerd()
        self._controllers(bins)
        self._kubelet(bins)
        self._wait_ready(t0, timeout)
        self.timings["node_ready_s"] = time.monotonic() - t0
        return self

    def _machine_lock(self) -> None:
        """One whole node per machine at a time: the kubelet's compiled-in paths are shared."""
        self.state.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(str(self.state.parent / "node.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        t0 = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - t0 > 1800:
                    os.close(fd)
                    raise RuntimeError("another test node held the machine lock for 30 minutes")
                time.sleep(1)
        self._lock_fd = fd

    def _record_host(self) -> None:
        led = self.ledger
        led.save_host_files(kernel_files())
        for d in AGENT_HOST_DIRS:
            if os.path.isdir(d):
                led.save_host_files(str(p) for p in files_under(Path(d)) if p.is_file())
                led.note("keep_dirs", d)  # files added there later are removed
            else:
                led.note("paths", d)
        for p in FIXED_PATHS:
            if not os.path.exists(p):
                led.note("paths", p)
        for d in (self.dir, self.state):
            led.note("paths", str(d))
            led.note("mount_roots", str(d))
        led.note("result_prefixes", f"/var/lib/cni/results/{self.netns}-")
        led.note("cgroups", self.cgroup)
        led.note("cmdline_marks", str(self.sock))  # containerd's shims: -address <sock>
        led.note("netns", self.netns)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.state.mkdir(parents=True, exist_ok=True)

    def _sh(self, *argv: str, netns: bool = False, check: bool = True) -> subprocess.CompletedProcess:
        cmd = list(argv)
        if netns:
            cmd = ["nsenter", f"--net=/run/netns/{self.netns}", *self._mnt(), "--", *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.strip()[-800:]}")
        return proc

    def _mnt(self) -> list[str]:
        return [f"--mount={self.mntns}"] if self.mntns else []

    def _proc(self, name: str, argv: list[Any], grace: float) -> Proc:
        """A component of this node: in its network namespace (and mount namespace, if any)."""
        return Proc(name, [str(a) for a in argv], self.dir / f"{name}.log", self.ledger, netns=self.netns,
                    mntns=self.mntns, env=env_without_proxy(), grace=grace).start()

    def _network(self) -> None:
        suffix = "b" * self.index
        host_if, node_if = f"gtkh{self.run_id}{suffix}"[:15], f"gtkn{self.run_id}{suffix}"[:15]
        self._sh("ip", "netns", "add", self.netns)
        self.ledger.note("netns_inodes", os.stat(f"/run/netns/{self.netns}").st_ino)
        self._sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", node_if)
        self._sh("ip", "link", "set", node_if, "netns", self.netns)
        self._sh("ip", "addr", "add", f"{self.host_ip}/24", "dev", host_if)
        self._sh("ip", "link", "set", host_if, "up")
        for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", f"{self.node_ip}/24", "dev", node_if],
                    ["ip", "link", "set", node_if, "up"], ["ip", "route", "add", "default", "via", self.host_ip],
                    ["sysctl", "-qw", "net.ipv4.ip_forward=1"],
                    ["sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1"]):
            self._sh(*cmd, netns=True)
        # the `kubernetes` Service without kube-proxy: host-network pods (OUTPUT) and pods on
        # the bridge (PREROUTING)
        for chain in ("OUTPUT", "PREROUTING"):
            self._sh("iptables", "-t", "nat", "-A", chain, "-d", SERVICE_IP, "-p", "tcp", "--dport", "443",
                     "-j", "DNAT", "--to-destination", f"{self.api_ip}:6443", netns=True)

    def _certs(self, *kinds: str) -> dict[str, Any]:
        assert self.cp is not None
        pki = self.cp.pki
        make = {
            "kubelet": lambda: pki.issue(f"kubelet-{self.name}", f"system:node:{self.name}", org="system:nodes"),
            "kubelet-serving": lambda: pki.issue(f"kubelet-serving-{self.name}", self.name,
                                                 hosts=(self.node_ip, self.name), server=True),
            "controller-manager": lambda: pki.issue("controller-manager", "system:kube-controller-manager"),
            "scheduler": lambda: pki.issue("scheduler", "system:kube-scheduler"),
        }
        return {k: make[k]() for k in kinds}

    def _kubeconfig(self, name: str, pair: Any) -> Path:
        assert self.cp is not None
        path = self.dir / f"{name}.kubeconfig"
        path.write_text(kubeconfig_text(f"https://{self.api_ip}:6443", self.cp.pki.ca.cert, cert=pair.cert,
                                        key=pair.key))
        return path

    def _cluster_objects(self) -> None:
        cp = self.cp
        assert cp is not None
        # the API server's own kubelet client may read logs and exec (kubectl logs)
        cp.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                  "metadata": {"name": "test-apiserver-kubelet-client"},
                  "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                              "name": "system:kubelet-api-admin"},
                  "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                                "name": "kube-apiserver-kubelet-client"}]})
        cp.apply({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": RUNTIME_CLASS},
                  "handler": RUNTIME_CLASS})

    def _containerd(self) -> None:
        d, st = self.dir / "containerd", self.state / "containerd"
        cni_conf = self.state / "cni"
        for p in (d, st, cni_conf):
            p.mkdir(parents=True, exist_ok=True)
        net = self.netns
        (cni_conf / "10-gtk.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": net,
            "plugins": [
                {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": True, "hairpinMode": True,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": self.pod_cidr}]], "routes": [{"dst": "0.0.0.0/0"}],
                          "dataDir": str(self.state / "ipam")}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ]}, indent=1))
        runc = tool("runc", "runc")
        runtime = f"""
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.%s]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.%s.options]
        BinaryName = "{runc}"
        SystemdCgroup = false
"""
        config = f"""version = 2
root = "{d / 'root'}"
state = "{st}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{self.sock}"
[ttrpc]
  address = "{self.sock}.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d / 'opt'}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.10.2"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni_conf}"
    max_conf_num = 1
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
""" + runtime % ("runc", "runc") + runtime % (RUNTIME_CLASS, RUNTIME_CLASS)
        (self.dir / "containerd.toml").write_text(config)
        # (its locked-memory limit stays this machine's: raising it takes CAP_SYS_RESOURCE)
        self.procs.append(self._proc("containerd", [tool("containerd", "containerd"), "--config",
                                                    self.dir / "containerd.toml", "--log-level", "warn"], grace=5))
        t0 = time.monotonic()
        while self.ctr("version", check=False).returncode != 0:
            self.procs[-1].check()
            if time.monotonic() - t0 > 30:
                raise RuntimeError(f"containerd did not answer within 30 s:\n{self.procs[-1].tail()}")
            time.sleep(0.1)
        pause = pause_image_tar()
        if pause is not None:
            self.ctr("images", "import", "--no-unpack", str(pause))
            self.ctr("images", "import", str(pause))

    def ctr(self, *args: str, check: bool = True, input_file: str | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
        cmd = [tool("ctr", "containerd"), "--address", str(self.sock), "--namespace", "k8s.io", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()[-800:]}")
        return proc

    def _controllers(self, bins: dict[str, Path]) -> None:
        cp = self.cp
        assert cp is not None
        certs = self._certs("controller-manager", "scheduler")
        pki = cp.pki
        cm_kc = self._kubeconfig("controller-manager", certs["controller-manager"])
        self.procs.append(self._proc("kube-controller-manager", [
            bins["kube-controller-manager"], f"--kubeconfig={cm_kc}",
            f"--authentication-kubeconfig={cm_kc}", f"--authorization-kubeconfig={cm_kc}",
            "--use-service-account-credentials", f"--service-account-private-key-file={pki.sa_key}",
            f"--root-ca-file={pki.ca.cert}", f"--cluster-signing-cert-file={pki.ca.cert}",
            f"--cluster-signing-key-file={pki.ca.key}", "--allocate-node-cidrs", f"--cluster-cidr={CLUSTER_CIDR}",
            "--node-cidr-mask-size=24", "--leader-elect=false", "--bind-address=127.0.0.1", "--secure-port=10257",
            f"--flex-volume-plugin-dir={self.dir / 'volume-plugins'}", "--v=1"], grace=3))
        sch_kc = self._kubeconfig("scheduler", certs["scheduler"])
        self.procs.append(self._proc("kube-scheduler", [
            bins["kube-scheduler"], f"--kubeconfig={sch_kc}", f"--authentication-kubeconfig={sch_kc}",
            f"--authorization-kubeconfig={sch_kc}", "--leader-elect=false", "--bind-address=127.0.0.1",
            "--secure-port=10259", "--v=1"], grace=3))

    def _kubelet(self, bins: dict[str, Path]) -> None:
        cp = self.cp
        assert cp is not None
        certs = self._certs("kubelet", "kubelet-serving")
        kc = self._kubeconfig("kubelet", certs["kubelet"])
        root = self.dir / "kubelet"
        logs = self.dir / "pod-logs"
        root.mkdir(parents=True, exist_ok=True)
        logs.mkdir(parents=True, exist_ok=True)
        # the kubelet's pod cgroups live under /gtk-ID in every hierarchy (v1, hybrid or v2)
        make_cgroup(self.cgroup)
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "failCgroupV1": False, "cgroupDriver": "cgroupfs", "cgroupRoot": f"/{self.cgroup}",
            "failSwapOn": False, "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(cp.pki.ca.cert)}},
            "authorization": {"mode": "Webhook"},
            "tlsCertFile": str(certs["kubelet-serving"].cert), "tlsPrivateKeyFile": str(certs["kubelet-serving"].key),
            "address": self.node_ip, "healthzBindAddress": "127.0.0.1",
            "volumePluginDir": str(self.dir / "volume-plugins"),
            "containerRuntimeEndpoint": f"unix://{self.sock}", "podLogsDir": str(logs),
            "resolvConf": "/etc/resolv.conf", "maxPods": 30, "serializeImagePulls": False,
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "nodefs.inodesFree": "1%",
                             "imagefs.available": "1%"},
            "evictionPressureTransitionPeriod": "5s",
            "nodeStatusUpdateFrequency": "5s", "syncFrequency": "10s", "fileCheckFrequency": "5s",
            "shutdownGracePeriod": "0s", "localStorageCapacityIsolation": True,
            "registerNode": True,
        }
        (self.dir / "kubelet.yaml").write_text(json.dumps(config, indent=1))
        labels = ",".join(f"{k}={v}" for k, v in self.labels.items())
        argv = [str(bins["kubelet"]), f"--config={self.dir / 'kubelet.yaml'}", f"--kubeconfig={kc}",
                f"--root-dir={root}", f"--hostname-override={self.name}", f"--node-ip={self.node_ip}", "--v=1"]
        if labels:
            argv.append(f"--node-labels={labels}")
        self.procs.append(self._proc("kubelet", argv, grace=5))

    def _wait_ready(self, t0: float, timeout: float) -> None:
        assert self.cp is not None
        last = "not registered"
        while time.monotonic() - t0 < timeout:
            for p in self.procs:
                p.check()
            try:
                node = self.cp.request("GET", f"/api/v1/nodes/{self.name}")
                ready = [c for c in node["status"].get("conditions", []) if c["type"] == "Ready"]
                last = f"Ready={ready[0]['status']} ({ready[0].get('message', '')})" if ready else "no Ready condition"
                if ready and ready[0]["status"] == "True" and node["spec"].get("podCIDR"):
                    taints = [t for t in node["spec"].get("taints", []) if t["key"].startswith("node.kubernetes.io/")]
                    if not taints:
                        return
                    last = f"Ready, tainted {taints}"
            except ApiError as exc:
                last = f"HTTP {exc.status}"
            time.sleep(0.25)
        raise RuntimeError(f"node {self.name} not Ready within {timeout:.0f} s ({last}); kubelet log ends:\n"
                           + self.procs[-1].tail(40))

    # -- images, kubectl -------------------------------------------------------------------------
    def import_image(self, tar: Path, *names: str) -> float:
        """Import a docker-archive into containerd's ``k8s.io`` namespace and tag it ``names``."""
        t0 = time.monotonic()
        out = self.ctr("images", "import", "--digests", "--all-platforms", str(tar), timeout=900).stdout
        ref = None
        for line in out.splitlines():
            if line.startswith("unpacking "):
                ref = line.split()[1]
        imported = [ln.split()[0] for ln in self.ctr("images", "ls", "-q").stdout.split() if ln]
        if ref is None:
            ref = next((r for r in imported if "gpu-tune" in r), None)
        assert ref, f"nothing imported from {tar}: {out}"
        for name in names:
            self.ctr("images", "rm", name, check=False)
            self.ctr("images", "tag", ref, name)
        return time.monotonic() - t0

    def kubectl(self, *args: str, **kw: Any) -> subprocess.CompletedProcess:
        assert self.cp is not None
        return run_kubectl(self.cp.kubeconfig, *args, **kw)

    def logs(self) -> str:
        """The last lines of every component's log, for a failing test's report."""
        return "\n".join(f"--- {p.name} ---\n{p.tail(15)}" for p in self.procs)

    # -- stop --------------------------------------------------------------------------------------
    def stop(self) -> list[str]:
        """Stop everything and undo every trace; returns what could not be undone."""
        t0 = time.monotonic()
        problems: list[str] = []
        try:
            for name in ("kubelet", "kube-scheduler", "kube-controller-manager"):
                for p in self.procs:
                    if p.name == name:
                        p.stop()
            self.timings["stop_components_s"] = time.monotonic() - t0
            from tests.realkube.cleanup import kill_cgroup

            kill_cgroup(self.cgroup)  # every pod's processes
            self.timings["stop_pods_s"] = time.monotonic() - t0
            for p in self.procs:
                if p.name == "containerd":
                    p.stop()
            from tests.realkube.cleanup import kill_matching

            kill_matching([], [str(self.sock)])  # the shims containerd left behind
            if self.cp is not None and self.index == 0:  # a joining node's is the first node's
                self.cp.stop()
            self.timings["stop_processes_s"] = time.monotonic() - t0
        finally:
            problems = self.ledger.clean()
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
        left = mounts_under([str(self.dir), str(self.state)])
        if left:
            problems.append(f"mounts left: {left}")
        self.timings["stop_s"] = time.monotonic() - t0
        return problems


def save_image(tag: str, dest: Path) -> Path:
    """``podman save`` the image ``tag`` into a docker-archive at ``dest``."""
    podman = shutil.which("podman")
    if podman is None:
        raise Missing("podman is not installed (make test installs it when root)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([podman, "--cgroup-manager", "cgroupfs", "save", "--format", "docker-archive", "-o", str(dest),
                    tag], check=True, capture_output=True, text=True)
    return dest
