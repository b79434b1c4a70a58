"""The figures of a probe result that the metrics and the node summary show: pure, no imports
beyond the standard library (``gpu-tune label`` and the agent read them without Prometheus).

A probe verdict's ``result`` is the workload's JSON: ``accuracy``; ``fingerprint`` (a short hex
string, equal on healthy peers) and ``peer_group`` (GPU model and software versions); per regime
(``launch_bound``: small batches, the host's share; ``device_bound``: large batches with the data
on the GPU) ``images_per_second`` and ``gpu_busy_fraction`` (0..1). A result saved by an older probe
has only ``train_images_per_second``: it stands for the launch-bound regime. The probe's judge
reads the regimes through :func:`regimes` too. The data path: ``bandwidth`` (host<->GPU, from the
GPU's own NUMA node and from a remote one) and ``memory_bandwidth`` (the GPU's), read through
:func:`host_bandwidth` and :func:`memory_bandwidth`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

REGIMES = ("launch_bound", "device_bound")
MAX_PEER_GROUP = 200  # characters kept of the free-text peer group


def number(v: Any) -> float | None:
    """A finite int or float as float; None for anything else (bools, strings, NaN)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def ratio(v: Any) -> float | None:
    x = number(v)
    return x if x is not None and 0.0 <= x <= 1.0 else None


def result_of(verdict: Mapping[str, Any]) -> Mapping[str, Any]:
    """The verdict's result, or an empty mapping when it has none (a crashed or skipped probe)."""
    res = verdict.get("result")
    return res if isinstance(res, Mapping) else {}


def regimes(result: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """Each regime's section of the result as the workload wrote it (``batch_size``, ``steps``...);
    without ``regimes`` (or with none in it) the old ``train_images_per_second`` is the
    launch-bound one. The probe's judge, the metrics and the node summary all read it here."""
    found = result.get("regimes")
    if isinstance(found, Mapping) and found:
        return {k: found[k] for k in REGIMES if isinstance(found.get(k), Mapping)}
    ips = number(result.get("train_images_per_second"))
    return {"launch_bound": {"images_per_second": ips}} if ips is not None else {}


def throughput(result: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """``{regime: {"images_per_second": x, "gpu_busy_fraction": y}}``, clean numbers only."""
    out: dict[str, dict[str, float]] = {}
    for regime, r in regimes(result).items():
        vals = {}
        ips, busy = number(r.get("images_per_second")), ratio(r.get("gpu_busy_fraction"))
        if ips is not None:
            vals["images_per_second"] = ips
        if busy is not None:
            vals["gpu_busy_fraction"] = busy
        if vals:
            out[regime] = vals
    return out


def identity(result: Mapping[str, Any]) -> tuple[str, str] | None:
    """(fingerprint, peer_group) when the result has a non-empty fingerprint string."""
    fp = result.get("fingerprint")
    if not isinstance(fp, str) or not fp.strip():
        return None
    pg = result.get("peer_group")
    return fp.strip(), (pg.strip()[:MAX_PEER_GROUP] if isinstance(pg, str) else "")


BANDWIDTH_SIDES = ("local", "remote")
BANDWIDTH_DIRECTIONS = ("h2d", "d2h")


def host_bandwidth(result: Mapping[str, Any]) -> dict[tuple[str, str], float]:
    """``{(side, direction): bytes/s}`` of the result's host<->GPU bandwidth: ``side`` ``local``
    (host memory on the GPU's NUMA node) or ``remote``, ``direction`` ``h2d`` or ``d2h``; measured,
    positive figures only."""
    bw = result.get("bandwidth")
    if not isinstance(bw, Mapping) or bw.get("status") != "measured":
        return {}
    out = {}
    for side in BANDWIDTH_SIDES:
        s = bw.get(side)
        if not isinstance(s, Mapping) or s.get("status") != "measured":
            continue
        for d in BANDWIDTH_DIRECTIONS:
            fig = s.get(d)
            v = number(fig.get("bytes_per_second")) if isinstance(fig, Mapping) else None
            if v is not None and v > 0:
                out[(side, d)] = v
    return out


def memory_bandwidth(result: Mapping[str, Any]) -> float | None:
    """The GPU's memory bandwidth in bytes/s (device-to-device copies, read + write), if measured."""
    mem = result.get("memory_bandwidth")
    if not isinstance(mem, Mapping) or mem.get("status") != "measured":
        return None
    v = number(mem.get("bytes_per_second"))
    return v if v is not None and v > 0 else None


def numa_node_of(result: Mapping[str, Any], side: str) -> int | None:
    bw = result.get("bandwidth")
    s = bw.get(side) if isinstance(bw, Mapping) else None
    n = s.get("numa_node") if isinstance(s, Mapping) else None
    return n if isinstance(n, int) and not isinstance(n, bool) else None
