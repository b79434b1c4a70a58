"""``gpu-tune run [--gpu N | --numa-node K] [--profile P] -- CMD ...``: exec a workload bound to
its GPU's NUMA node (CPU affinity to the node's CPUs, memory bound to the node) with the
profile's allocator preload.

Binding uses ``numactl --physcpubind=<cpus> --membind=<node> --`` when numactl is installed, else
``python -m gpu_tune.launch.bind`` (sched_setaffinity + set_mempolicy(MPOL_BIND), then exec).

Two path worlds: the jemalloc preloaded here must exist in *this process's* filesystem (the
container, in the DaemonSet), so it is looked up in this process's library folders, never under
``--root``; see :data:`LocalPath` versus :data:`gpu_tune.tune.knobs.allocator.HostPath`.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, NewType, NoReturn

from gpu_tune.errors import CommandNotRunnable, InputError
from gpu_tune.host.parse import format_cpulist
from gpu_tune.tune.knobs.allocator import jemalloc_missing

if TYPE_CHECKING:  # pragma: no cover
    from gpu_tune.tune.profile import Profile
    from gpu_tune.discover.model import Topology

log = logging.getLogger("gpu_tune")

# A path in this process's own filesystem (what exec and the dynamic loader here will see).
LocalPath = NewType("LocalPath", str)

LOCAL_LIB_DIRS: tuple[str, ...] = (
    "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu", "/usr/lib64", "/lib64", "/usr/lib", "/lib", "/usr/local/lib",
    "/usr/local/lib64",
)
JEMALLOC_SONAME = "libjemalloc.so.2"


@dataclass(frozen=True)
class Binding:
    numa_node: int | None
    cpus: frozenset[int]
    gpu_index: int | None
    gpu_uuid: str | None
    warnings: tuple[str, ...] = ()

    def describe(self) -> str:
        where = f"node {self.numa_node}" if self.numa_node is not None else "no NUMA node"
        gpu = f"GPU {self.gpu_index}, " if self.gpu_index is not None else ""
        return f"{gpu}{where}, CPUs {format_cpulist(self.cpus) or 'all'}"


class EnvResult(dict):
    """The workload's environment (a plain dict) plus the warnings met while building it."""

    warnings: tuple[str, ...] = ()


def binding_for(topology: "Topology", *, gpu: int | None = None, numa_node: int | None = None) -> Binding:
    """Where a workload for GPU ``gpu`` (or NUMA node ``numa_node``) should run."""
    if gpu is not None and numa_node is not None:
        raise InputError("--gpu and --numa-node are exclusive: give one")
    if gpu is not None:
        dev = topology.gpu(gpu)
        if dev is None:
            known = ", ".join(str(g.gpu_index) for g in topology.gpus if g.gpu_index is not None) or "none"
            raise InputError(f"--gpu {gpu}: no such GPU (known: {known})")
        if dev.numa_node is None:
            msg = (f"GPU {gpu} ({dev.address}): NUMA node unknown; running on all CPUs without a "
                   "memory binding")
            log.warning("%s", msg)
            return Binding(None, topology.cpus_online, gpu, dev.gpu_uuid, (msg,))
        return Binding(dev.numa_node, topology.node_cpus(dev.numa_node), gpu, dev.gpu_uuid)
    if numa_node is not None:
        node = topology.node(numa_node)
        if node is None:
            known = ", ".join(str(n.id) for n in topology.numa_nodes) or "none"
            raise InputError(f"--numa-node {numa_node}: no such NUMA node (known: {known})")
        return Binding(numa_node, node.cpus, None, None)
    return Binding(None, frozenset(), None, None)


def binding_for_profile(topology: "Topology", profile: "Profile", *, gpu: int | None = None,
                        numa_node: int | None = None) -> Binding:
    """:func:`binding_for`, unless the profile says jobs run unbound (``launch.numa_binding: false``):
    then no CPU or memory binding, the GPU still chosen."""
    binding = binding_for(topology, gpu=gpu, numa_node=numa_node)
    launch = getattr(profile, "launch", None)
    if launch is None or launch.numa_binding:
        return binding
    return Binding(None, frozenset(), binding.gpu_index, binding.gpu_uuid,
                   (f"profile {profile.name}: launch.numa_binding is false: running unbound",))


def bind_prefix(binding: Binding) -> list[str]:
    """The command words that bind what follows them (empty when nothing is to be bound)."""
    cpus = format_cpulist(binding.cpus)
    if not cpus and binding.numa_node is None:
        return []
    numactl = shutil.which("numactl")
    if numactl:
        out = [numactl]
        if cpus:
            out.append(f"--physcpubind={cpus}")
        if binding.numa_node is not None:
            out.append(f"--membind={binding.numa_node}")
        return out + ["--"]
    out = [sys.executable, "-m", "gpu_tune.launch.bind"]
    if cpus:
        out += ["--cpus", cpus]
    if binding.numa_node is not None:
        out += ["--node", str(binding.numa_node)]
    return out + ["--"]


LOCAL_JEMALLOC_MISSING = jemalloc_missing("where this command runs")


def find_local_jemalloc(dirs: tuple[str, ...] = LOCAL_LIB_DIRS) -> LocalPath | None:
    """``libjemalloc.so.2`` in this process's own library folders (deliberately not under --root)."""
    for d in dirs:
        p = os.path.join(d, JEMALLOC_SONAME)
        if os.path.isfile(p):
            return LocalPath(p)
    return None


def _malloc_options(conf: str) -> dict[str, str]:
    """``key:value,key:value`` -> {key: value}, in order (a piece without ``:`` is kept whole)."""
    out: dict[str, str] = {}
    for piece in conf.split(","):
        piece = piece.strip()
        if piece:
            key, sep, value = piece.partition(":")
            out[key] = f"{sep}{value}"
    return out


def merge_malloc_conf(profile_conf: str, callers: str) -> tuple[str, list[str]]:
    """The profile's ``MALLOC_CONF`` with the caller's own merged in, option by option: the
    caller's value wins where both set an option (it asked for it for this job), its other
    options are added. Returns the merged string and a warning per option of the profile's that
    the caller's replaced."""
    merged = _malloc_options(profile_conf)
    warnings = []
    for key, value in _malloc_options(callers).items():
        if key in merged and merged[key] != value:
            warnings.append(f"MALLOC_CONF: {key}{value} from the environment is kept over the profile's "
                            f"{key}{merged[key]} (the other options are merged)")
        merged[key] = value
    return ",".join(f"{k}{v}" for k, v in merged.items()), warnings


def workload_env(binding: Binding, profile: "Profile", base_env: Mapping[str, str]) -> EnvResult:
    """The environment for the bound workload: GPU visibility and the allocator preload
    (``MALLOC_CONF``: the profile's, with the caller's own options merged in:
    :func:`merge_malloc_conf`)."""
    env = EnvResult(base_env)
    warnings: list[str] = list(binding.warnings)
    if binding.gpu_index is not None:
        env["CUDA_VISIBLE_DEVICES"] = binding.gpu_uuid or str(binding.gpu_index)
    alloc = profile.allocator
    if alloc.preload == "jemalloc":
        lib = find_local_jemalloc()
        if lib is None:
            warnings.append(f"allocator.preload is jemalloc, but {LOCAL_JEMALLOC_MISSING}; running without it")
        else:
            existing = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p]
            if lib not in existing:
                existing.insert(0, lib)
            env["LD_PRELOAD"] = ":".join(existing)
            if alloc.malloc_conf:
                env["MALLOC_CONF"], said = merge_malloc_conf(alloc.malloc_conf, env.get("MALLOC_CONF", ""))
                warnings += said
    env.warnings = tuple(warnings)
    return env


def _check_runnable(cmd: str, path: str) -> None:
    """Fail before binding with the exit code env(1) uses (127 not found, 126 not executable),
    instead of numactl's or the binder's own error for the command."""
    import shutil

    if "/" in cmd:
        if not os.path.exists(cmd):
            raise CommandNotRunnable(f"gpu-tune run: {cmd}: no such file", 127)
        if os.path.isdir(cmd) or not os.access(cmd, os.X_OK):
            raise CommandNotRunnable(f"gpu-tune run: {cmd}: not executable", 126)
        return
    if shutil.which(cmd, path=path) is None:
        raise CommandNotRunnable(f"gpu-tune run: {cmd}: command not found", 127)


def exec_run(binding: Binding, profile: "Profile", argv: list[str]) -> NoReturn:
    """Replace this process with ``argv`` bound as ``binding`` says. Returns only by raising."""
    if not argv:
        raise InputError("gpu-tune run: no command given after --")
    try:
        allowed = frozenset(os.sched_getaffinity(0))
    except OSError:
        allowed = frozenset()
    if binding.cpus and allowed and not binding.cpus <= allowed:
        usable = binding.cpus & allowed
        if not usable:
            raise InputError(f"none of the CPUs {format_cpulist(binding.cpus)} ({binding.describe()}) may be "
                             f"used by this process (allowed: {format_cpulist(allowed)})")
        log.warning("CPUs %s are outside this process's cpuset; binding to %s",
                    format_cpulist(binding.cpus - allowed), format_cpulist(usable))
        binding = Binding(binding.numa_node, usable, binding.gpu_index, binding.gpu_uuid, binding.warnings)
    env = workload_env(binding, profile, os.environ)
    for w in env.warnings:
        log.warning("%s", w)
    _check_runnable(argv[0], env.get("PATH", os.defpath))
    full = bind_prefix(binding) + list(argv)
    log.info("run: %s: %s", binding.describe(), " ".join(full))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(full[0], full, dict(env))
    except FileNotFoundError:
        raise CommandNotRunnable(f"gpu-tune run: {full[0]}: command not found", 127) from None
    except OSError as exc:
        raise CommandNotRunnable(f"gpu-tune run: {full[0]}: {exc.strerror or exc}", 126) from None
