"""Probe targets: which GPUs (or the CPU) to probe, and how each is bound and run.

GPU targets (``--gpu N|all``; all by default) are bound to their GPU's NUMA node (CPUs and
memory) with the profile's allocator preload; a GPU whose node lies outside this process' cpuset
is blocked with a plain reason, and a MIG-enabled GPU is skipped with a stated reason (MIG
instances are separate devices the whole-GPU probe does not address; the node is not failed for
it). On a machine with more than one NUMA node each GPU target also names a remote node, the
farthest one with memory that this process may use, from which the probe measures host<->GPU
bandwidth a second time (what the binding buys). ``--device cpu`` (or no GPU with ``auto``)
gives one CPU target.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from gpu_tune.errors import InputError
from gpu_tune.host.numbers import shown, uint_or_none
from gpu_tune.host.parse import format_cpulist, parse_cpulist
from gpu_tune.judge.probe.baselines import normalize_pci_device

MIG_SKIP = ("MIG mode is enabled on GPU {index}: the probe runs on whole GPUs, so its MIG instances "
            "are not probed (not a failure); disable MIG to probe it")


@dataclass(frozen=True)
class ProbeTarget:
    label: str  # "0", "1", ... or "cpu": the verdict's "gpu" field
    gpu_index: int | None
    gpu_name: str | None
    pci_device_id: str | None
    prefix: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    expected_cpus: frozenset[int] | None = None
    expected_node: int | None = None
    gpu_uuid: str | None = None
    device: str | None = None  # "gpu" | "cpu"; None: "gpu" when gpu_index is set
    notes: tuple[str, ...] = ()  # facts met while planning (e.g. NUMA node unknown)
    # Set when the target cannot be run as planned (its NUMA node's CPUs or memory are outside
    # this container's cpuset): the verdict is an error with this reason, no process is started.
    blocked: str | None = None
    # Set when the target is not probed on purpose (a MIG-enabled GPU): the verdict is "skipped"
    # with this reason and counts as passed; no process is started.
    skip: str | None = None
    # The NUMA node the host<->GPU bandwidth is also measured from (None: one node, or unknown).
    remote_node: int | None = None



def _topology_gpus(topology: Any) -> list[Any]:
    # A GPU that sysfs shows but the GPU backend did not match has no index to probe by.
    gpus = [g for g in (getattr(topology, "gpus", None) or []) if getattr(g, "gpu_index", None) is not None]
    return sorted(gpus, key=lambda g: g.gpu_index)


def _allowed_mems() -> frozenset[int] | None:
    """Memory nodes this process may use (its cpuset), from its own /proc/self/status."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Mems_allowed_list:"):
                    return parse_cpulist(line.split(":", 1)[1])
    except (OSError, ValueError):
        return None
    return None


def _within_allowed(runner: Any, binding: Any) -> tuple[Any, list[str], str | None]:
    """Bind only to CPUs this process may use (a container's cpuset may hold part of a node).

    Returns (binding, notes, blocked): ``blocked`` says why the binding cannot be used at all.
    """
    if binding.numa_node is not None:
        mems = _allowed_mems()
        if mems is not None and binding.numa_node not in mems:
            return binding, [], (f"NUMA node {binding.numa_node} is outside this container's cpuset "
                                 f"(memory nodes allowed: {format_cpulist(mems) or 'none'}): give the agent "
                                 "the whole node (no CPU/memory pinning by the kubelet's CPU manager)")
    try:
        allowed = frozenset(os.sched_getaffinity(0))
    except OSError:
        return binding, [], None
    if not binding.cpus or not allowed or binding.cpus <= allowed:
        return binding, [], None
    usable = binding.cpus & allowed
    if not usable:
        return binding, [], (f"none of NUMA node {binding.numa_node}'s CPUs {format_cpulist(binding.cpus)} may be "
                             f"used here (this process may use {format_cpulist(allowed)})")
    note = (f"CPUs {format_cpulist(binding.cpus - allowed)} of NUMA node {binding.numa_node} are outside "
            f"this process' cpuset; bound to {format_cpulist(usable)}")
    return runner.Binding(binding.numa_node, usable, binding.gpu_index, binding.gpu_uuid), [note], None


def remote_node(topology: Any, local: int | None) -> int | None:
    """The NUMA node farthest from ``local`` (by the firmware's distances; the lowest id among
    equals) that has memory and lies in this process' cpuset; None with one node."""
    nodes = list(getattr(topology, "numa_nodes", None) or [])
    if local is None or len(nodes) < 2:
        return None
    mems = _allowed_mems()
    ids = sorted(n.id for n in nodes)
    here = next((n for n in nodes if n.id == local), None)
    dist = list(getattr(here, "distances", ()) or ())
    cands = [n for n in nodes if n.id != local and (n.memory_total_kib is None or n.memory_total_kib > 0)
             and (mems is None or n.id in mems)]
    if not cands:
        return None

    def distance(n: Any) -> int:
        return dist[ids.index(n.id)] if len(dist) == len(ids) else 0

    return max(cands, key=lambda n: (distance(n), -n.id)).id


def plan_targets(topology: Any, profile: Any, gpu_backend: Any, *, gpu: str | None, device: str,
                 numa_node: int | None = None) -> list[ProbeTarget]:
    """The probe targets for ``gpu-tune probe``.

    GPU targets (``--gpu N|all``; all by default) are bound to their GPU's NUMA node with the
    profile's allocator. ``--device cpu`` (or no GPU with ``auto``) gives one CPU target, run
    unbound on this process' CPUs unless ``numa_node`` asks for a node. ``--device gpu`` on a
    host without GPUs gives one GPU target that fails clearly (the workload finds no GPU).
    """
    from gpu_tune.launch import runner

    if device not in ("auto", "gpu", "cpu"):
        raise InputError(f"--device {device!r}: expected auto, gpu or cpu")
    gpus = _topology_gpus(topology)
    names: dict[int, tuple[str | None, str | None]] = {}
    mig: dict[int, bool] = {}
    if gpu_backend is not None:
        try:
            infos = list(gpu_backend.gpus())
        except Exception:
            infos = []
        names = {g.index: (g.name, g.uuid) for g in infos}
        mig = {g.index: bool(getattr(g, "mig_mode", None)) for g in infos}

    if gpu is not None and gpu != "all":
        if device == "cpu":
            raise InputError(f"--gpu {gpu} with --device cpu: a CPU probe uses no GPU")
        idx = uint_or_none(str(gpu), max_digits=4)
        if idx is None:
            raise InputError(f"--gpu {shown(str(gpu))}: expected a GPU index or 'all'")
        have = [g.gpu_index for g in gpus]
        if idx not in have:
            known = ", ".join(map(str, have)) or "none"
            raise InputError(f"--gpu {idx}: no such GPU on this host (GPUs: {known})")
        gpus = [g for g in gpus if g.gpu_index == idx]

    if device == "cpu" or (device == "auto" and not gpus):
        if numa_node is not None:
            binding, _, blocked = _within_allowed(runner, runner.binding_for_profile(topology, profile, numa_node=numa_node))
            if blocked:
                raise InputError(f"--numa-node {numa_node}: {blocked}")
            prefix = runner.bind_prefix(binding)
            exp_cpus, exp_node = binding.cpus, binding.numa_node
        else:
            cpus = frozenset(os.sched_getaffinity(0))
            binding = runner.Binding(numa_node=None, cpus=cpus, gpu_index=None, gpu_uuid=None)
            prefix, exp_cpus, exp_node = [], cpus, None
        wenv = runner.workload_env(binding, profile, {})
        env = dict(wenv)
        env["CUDA_VISIBLE_DEVICES"] = ""
        return [ProbeTarget("cpu", None, None, None, prefix=prefix, env=env, expected_cpus=exp_cpus,
                            expected_node=exp_node, device="cpu",
                            notes=tuple(getattr(wenv, "warnings", ())))]

    if not gpus:  # --device gpu on a host without GPUs: one target that reports it
        return [ProbeTarget("gpu", None, None, None, prefix=[], env={}, expected_cpus=None,
                            expected_node=None, device="gpu")]

    targets = []
    for g in gpus:
        binding, notes, blocked = _within_allowed(runner, runner.binding_for_profile(topology, profile, gpu=g.gpu_index))
        name, uuid = names.get(g.gpu_index, (None, None))
        wenv = runner.workload_env(binding, profile, {})
        env = dict(wenv)
        notes += list(getattr(wenv, "warnings", ()))
        bound = binding.numa_node is not None
        targets.append(ProbeTarget(
            label=str(g.gpu_index), gpu_index=g.gpu_index,
            gpu_name=name or getattr(g, "gpu_name", None), pci_device_id=normalize_pci_device(getattr(g, "device", None)),
            prefix=list(runner.bind_prefix(binding)), env=env,
            expected_cpus=binding.cpus if bound and binding.cpus else None,
            expected_node=binding.numa_node, gpu_uuid=binding.gpu_uuid or uuid or getattr(g, "gpu_uuid", None),
            device="gpu", notes=tuple(dict.fromkeys(notes)), blocked=blocked,
            skip=MIG_SKIP.format(index=g.gpu_index) if mig.get(g.gpu_index) else None,
            remote_node=remote_node(topology, binding.numa_node)))
    return targets
