"""Judging one probe result: pure, from the workload's JSON, the target and the baselines.

A result passes when the workload ran on the device asked for, its accuracy after the fixed
amount of work reaches ``probe.accuracy_min``, each throughput regime reaches
``probe.throughput_fraction`` of its measured baseline (unmeasured targets and unknown models are
reported, not judged), the GPU's data path reaches its model's floors (host<->GPU bandwidth from
its own NUMA node in both directions; memory bandwidth at 0.75 x the model's baseline), its
fingerprint matches the one pinned for its peer group (if any), and the process ran with the NUMA
binding and allocator it was given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from gpu_tune.host.parse import ParseError, format_cpulist, parse_cpulist
from gpu_tune.tune.profile import ProbePolicy
from gpu_tune.judge.figures import host_bandwidth, memory_bandwidth, numa_node_of, regimes
from gpu_tune.judge.figures import number as _num
from gpu_tune.judge.probe.baselines import REGIME_WORDS, REGIMES, Baseline, Baselines
from gpu_tune.judge.probe.plan import ProbeTarget
from gpu_tune.launch.runner import LOCAL_JEMALLOC_MISSING

SLOW_LINK_MEANING = ("a PCIe link trained down to fewer lanes or a lower generation, a misconfigured PCIe switch, "
                     "or host memory on the wrong socket")
GB = 1e9

SDC_MEANING = ("this device computes a different result than healthy peers: possible silent data "
               "corruption or a broken software stack; drain the node and run the GPU vendor's "
               "diagnostics (e.g. `dcgmi diag -r 3`), and compare the driver and TensorFlow builds")


@dataclass(frozen=True)
class Judgement:
    status: str  # passed | failed | error
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Every reason is a throughput or bandwidth shortfall: worth a bounded retry (a noisy
    # neighbour passes).
    throughput_only: bool = False
    # The data path's verdict for the summary: "ok", "below floor", "not judged" (no floor for the
    # model), "not measured"; None for a result without one (a CPU run, an older probe).
    datapath: str | None = None


def regime_figures(result: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{regime: {"images_per_second", "batch_size", "gpu_busy_fraction", ...}}``; a 0.1.0 result
    (one ``train_images_per_second``) reads as its launch-bound regime."""
    return {k: dict(v) for k, v in regimes(result).items()}


def _baseline(result: Mapping[str, Any], target: ProbeTarget, device: str,
              baselines: Baselines) -> tuple[Baseline | None, str]:
    dev = result.get("device") or {}
    if device == "gpu":
        model = target.gpu_name or dev.get("name") or target.pci_device_id or "?"
        return baselines.for_gpu(target.gpu_name or dev.get("name"), target.pci_device_id), model
    return baselines.cpu, "cpu"


def _throughput(result: Mapping[str, Any], base: Baseline | None, model: str,
                policy: ProbePolicy) -> tuple[list[str], list[str]]:
    reasons: list[str] = []
    notes: list[str] = []
    figures = regime_figures(result)
    if base is None or all(base.regime(r) is None for r in REGIMES):
        notes.append(f"no throughput baseline for {model!r}: measured and reported, not judged")
        return reasons, notes
    for regime in REGIMES:
        want = base.regime(regime)
        if want is None:
            continue
        word = REGIME_WORDS[regime]
        got = _num((figures.get(regime) or {}).get("images_per_second"))
        if not (base.measured if want.measured is None else want.measured):
            if got is not None:
                notes.append(f"{word} training {got:.0f} images/s is {got / want.train_images_per_second:.1%} of the "
                             f"{want.train_images_per_second:g} images/s target for {model!r} (a target, not a "
                             "measured baseline: reported, not judged)")
            continue
        if got is None:
            reasons.append(f"no {word} training throughput in the result")
            continue
        need = policy.throughput_fraction * want.train_images_per_second
        if got < need:
            bs = (figures.get(regime) or {}).get("batch_size") or want.batch_size
            at = f" at batch {bs}" if bs else ""
            reasons.append(f"{word} training throughput {got:.0f} images/s{at} is below {need:.0f} "
                           f"({policy.throughput_fraction:g} x baseline {want.train_images_per_second:g} for {model!r})")
    return reasons, notes


def _gbps(v: float) -> str:
    return f"{v / GB:,.1f} GB/s"


def _datapath(result: Mapping[str, Any], base: Baseline | None, model: str,
              device: str) -> tuple[list[str], list[str], str | None]:
    """(reasons, notes, state): the host<->GPU floor in both directions from the local NUMA node,
    and the GPU memory bandwidth at ``fraction`` x its baseline."""
    bw = result.get("bandwidth")
    if not isinstance(bw, Mapping):
        return [], [], None  # an older probe's result
    if bw.get("status") != "measured":
        reason = str(bw.get("reason") or bw.get("status") or "not measured")
        if device != "gpu":
            return [], [reason], None
        return [], [f"host<->GPU bandwidth not measured: {reason}"], "not measured"
    reasons: list[str] = []
    notes: list[str] = []
    figs = host_bandwidth(result)
    node = numa_node_of(result, "local")
    where = f" from NUMA node {node}" if node is not None else ""
    h2d, d2h = figs.get(("local", "h2d")), figs.get(("local", "d2h"))
    pair = f"host-to-GPU {_gbps(h2d) if h2d else '?'}, GPU-to-host {_gbps(d2h) if d2h else '?'}"
    floor = base.host_bandwidth if base is not None else None
    state = "ok"
    if h2d is None or d2h is None:
        notes.append(f"host<->GPU bandwidth incomplete ({pair}{where})")
        state = "not measured"
    elif floor is None:
        notes.append(f"host<->GPU bandwidth {pair}{where}: no floor for {model!r}, reported, not judged")
        state = "not judged"
    elif min(h2d, d2h) < floor.floor_gb_per_second * GB:
        size = bw.get("size_bytes")
        how = f"pinned {size / 2**20:g} MiB copies, median of {bw.get('samples')}; " if size else ""
        reasons.append(f"host<->GPU bandwidth{where} is below the {floor.floor_gb_per_second:g} GB/s floor for "
                       f"{model!r}: {pair} ({how}{SLOW_LINK_MEANING})")
        state = "below floor"
    mem = memory_bandwidth(result)
    mbase = base.memory_bandwidth if base is not None else None
    if mem is not None and mbase is not None and mem < mbase.floor_gb_per_second * GB:
        reasons.append(f"GPU memory bandwidth {_gbps(mem)} (device-to-device copies, read + write) is below "
                       f"{mbase.floor_gb_per_second:,.0f} GB/s ({mbase.fraction:g} x the {mbase.baseline_gb_per_second:,.0f} "
                       f"GB/s baseline for {model!r})")
        state = "below floor"
    elif mem is not None and mbase is None:
        notes.append(f"GPU memory bandwidth {_gbps(mem)}: no baseline for {model!r}, reported, not judged")
        if state == "ok":
            state = "not judged"
    return reasons, notes, state


def _fingerprint(result: Mapping[str, Any], base: Baseline | None) -> tuple[list[str], list[str]]:
    group = result.get("peer_group")
    got = result.get("fingerprint")
    pin = base.pinned(group) if base is not None else None
    if pin is None:
        return [], []
    if not isinstance(got, str) or not got:
        return [f"no result fingerprint, but healthy peers ({group}) pin {pin.fingerprint}"], []
    if got.lower() != pin.fingerprint:
        return [f"result fingerprint {got} differs from {pin.fingerprint} pinned for peer group "
                f"'{group}': {SDC_MEANING}"], []
    return [], [f"fingerprint {got} matches the one pinned for its peer group"]


def _policy_nodes(mempolicy: Any) -> frozenset[int] | None:
    """The nodes of a binding memory policy as numa_maps prints it (``bind:1``, ``bind=static:0-1``,
    ``prefer:1``); None for ``default``, ``local`` or anything unreadable."""
    text = str(mempolicy or "")
    head, _, nodes = text.partition(":")
    if not nodes or not head.split("=", 1)[0] in ("bind", "prefer", "preferred"):
        return None
    try:
        return parse_cpulist(nodes)
    except (ParseError, ValueError):
        return None


def _binding(host: Mapping[str, Any], target: ProbeTarget, policy: ProbePolicy) -> list[str]:
    reasons: list[str] = []
    if policy.require_numa_binding:
        if target.expected_cpus is not None:
            try:
                got = parse_cpulist(str(host.get("cpu_affinity", "")))
            except (ParseError, ValueError):
                got = None
            if got != frozenset(target.expected_cpus):
                reasons.append(f"CPU affinity inside the probe is {host.get('cpu_affinity')!r}, "
                               f"expected {format_cpulist(target.expected_cpus)!r}")
        if target.expected_node is not None:
            # numactl --membind (and the bind module) set the memory policy, not the cpuset: a
            # two-socket host's Mems_allowed_list stays 0-1 while the policy reads bind:1
            mems = _policy_nodes(host.get("mempolicy"))
            what = f"memory policy {host.get('mempolicy')!r}"
            if mems is None:  # no binding policy: bound by the cpuset alone, or not at all
                try:
                    mems = parse_cpulist(str(host.get("mems_allowed", "")))
                except (ParseError, ValueError):
                    mems = None
                what = f"memory allowed on NUMA node(s) {host.get('mems_allowed')!r}"
            if mems != frozenset({target.expected_node}):
                reasons.append(f"{what}, expected {target.expected_node}")
    if policy.require_jemalloc and not host.get("jemalloc_mapped"):
        if not str(host.get("ld_preload", "")).strip():  # nothing to preload was found here
            reasons.append(f"probe.require_jemalloc: {LOCAL_JEMALLOC_MISSING}")
        else:
            reasons.append("jemalloc is required but not mapped in the probe process "
                           f"(LD_PRELOAD={host.get('ld_preload', '')!r})")
    return reasons


def judge(result: Mapping[str, Any], target: ProbeTarget, device: str, policy: ProbePolicy,
          baselines: Baselines) -> Judgement:
    if not result.get("ok"):
        err = str(result.get("error") or "workload reported failure without a reason")
        # Unusable data, a missing TensorFlow or an unusable compilation cache say nothing about the
        # node's hardware: errors.
        status = "error" if result.get("error_kind") in ("input", "dependency", "compile_cache") else "failed"
        return Judgement(status, [err])
    reasons: list[str] = []
    notes: list[str] = list(result.get("notes") or [])
    dev = result.get("device") or {}
    if device == "gpu" and dev.get("kind") != "gpu":
        reasons.append(f"a GPU was asked for but the workload ran on {dev.get('kind') or 'an unknown device'}"
                       f" ({dev.get('name') or '?'})")
    acc = _num(result.get("accuracy"))
    if acc is None:
        reasons.append("no accuracy in the result")
    elif acc < policy.accuracy_min:
        steps = (result.get("correctness") or {}).get("steps")
        after = f" after the fixed {steps} training steps" if steps else ""
        reasons.append(f"accuracy {acc:.4f}{after} is below {policy.accuracy_min:g}")
    base, model = _baseline(result, target, device, baselines)
    fr, fn = _fingerprint(result, base)
    tr, tn = _throughput(result, base, model, policy)
    br, bn, datapath = _datapath(result, base, model, device)
    other = reasons + fr + _binding(result.get("host") or {}, target, policy)
    notes += fn + tn + bn
    shortfalls = tr + br
    all_reasons = other + shortfalls
    return Judgement("failed" if all_reasons else "passed", all_reasons, notes,
                     throughput_only=bool(shortfalls) and not other, datapath=datapath)
