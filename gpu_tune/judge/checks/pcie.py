"""The GPU's PCIe link and its errors.

- ``gpu.pcie`` (fatal): the link runs at its full width (a narrower link is a fault at any load:
  a bad seat, riser or slot), and at its top generation while the GPU is busy (at least
  :data:`BUSY_UTILIZATION_PERCENT` utilization; idle GPUs lower the generation to save power, which
  the passing detail notes); the kernel counted no fatal uncorrectable AER error on it
  (``aer_dev_fatal``, since boot).
- ``gpu.pcie_errors`` (warning): the PCIe replay counter grows faster than DCGM's limit over the
  agent's window (lanes x the link's rate x a bit error rate of 1e-12 per minute: about 0.96 per
  lane per minute at Gen4, 1.92 at Gen5), or the kernel counted non-fatal uncorrectable AER
  errors. ``gpu-tune check`` (one reading) reports the counters and leaves the rate to the agent.

A file that is there but holds what the kernel never writes (``TOTAL_ERR_FATAL ²``, a link width
of 5,000 digits) is ``unreadable: <path>``: in ``gpu.pcie`` for the fatal AER counter and the link
files (the link cannot be judged: never a pass), in ``gpu.pcie_errors`` for the others.
"""

from __future__ import annotations

from typing import Any, Mapping

from gpu_tune.judge.checks.base import WARNING, Check, Facts, Family, answering, gpu_label, listed, per_gpu

BUSY_UTILIZATION_PERCENT = 50  # the same threshold as the PCIe alert rule
GT_PER_S = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0, 7: 128.0}
BIT_ERROR_RATE = 1e-12  # PCIe's specified worst bit error rate


def replay_limit_per_minute(gen: int | None, width: int | None) -> float | None:
    """Replays per minute a healthy link may show: lanes x bits/s x BER x 60 (DCGM's rule)."""
    if not isinstance(gen, int) or not isinstance(width, int) or gen not in GT_PER_S:
        return None
    return width * GT_PER_S[gen] * 1e9 * BIT_ERROR_RATE * 60


def _below(cur: Any, top: Any) -> bool:
    return isinstance(cur, int) and isinstance(top, int) and cur < top


def pcie_link(g: Any, pcie: Mapping[str, Any] | None = None) -> tuple[Any, Any, Any, Any]:
    """(gen current, gen max, width current, width max): the topology's sysfs reading where it
    has one, else the GPU backend's; except the top generation, which is NVML's
    ``nvmlDeviceGetMaxPcieLinkGeneration`` ("possible with this device and system") where the
    backend has it, before sysfs's (the lower of the GPU's and its port's ``max_link_speed``): a
    Gen5 GPU in a Gen4 host tops out at Gen4, and is judged against Gen4."""
    def pick(topo_key: str, attr: str) -> Any:
        v = pcie.get(topo_key) if pcie else None
        return v if v is not None else getattr(g, attr, None)

    nvml_max = getattr(g, "pcie_link_gen_max", None)
    gen_max = nvml_max if isinstance(nvml_max, int) else pick("gen_max", "pcie_link_gen_max")
    return (pick("gen_current", "pcie_link_gen_current"), gen_max,
            pick("width_current", "pcie_link_width_current"), pick("width_max", "pcie_link_width_max"))


def gpu_capable_above(g: Any, pcie: Mapping[str, Any] | None, gen_max: Any) -> int | None:
    """The GPU's own top generation where it is above what its link can reach (a Gen5 GPU in a
    Gen4 slot: 5), for the detail; else None."""
    own = getattr(g, "pcie_link_gen_gpu_max", None)
    if not isinstance(own, int):
        own = (pcie or {}).get("gen_device_max")
    return own if isinstance(own, int) and isinstance(gen_max, int) and own > gen_max else None


def is_busy(g: Any) -> bool:
    util = g.utilization_percent
    return isinstance(util, (int, float)) and not isinstance(util, bool) and util >= BUSY_UTILIZATION_PERCENT


def link_problem(g: Any, pcie: Mapping[str, Any] | None) -> str | None:
    gen_cur, gen_max, w_cur, w_max = pcie_link(g, pcie)
    link = []
    narrow = _below(w_cur, w_max)
    if _below(gen_cur, gen_max) and (narrow or is_busy(g)):
        link.append(f"Gen{gen_cur} of Gen{gen_max}" + ("" if narrow else f" at {g.utilization_percent:g}% utilization"))
    if narrow:
        link.append(f"x{w_cur} of x{w_max}")
    if link:
        return f"PCIe link trained down ({', '.join(link)}): reseat the card or check the riser/slot"
    return None


def link_note(g: Any, pcie: Mapping[str, Any] | None) -> str | None:
    gen_cur, gen_max, w_cur, w_max = pcie_link(g, pcie)
    if _below(gen_cur, gen_max) and not _below(w_cur, w_max) and not is_busy(g):
        util = g.utilization_percent
        load = f"idle ({util:g}% utilization)" if isinstance(util, (int, float)) else "utilization unknown"
        return (f"GPU {g.index} PCIe link at Gen{gen_cur} of Gen{gen_max} while {load}: GPUs lower the link "
                "generation to save power; judged only under load")
    return None


def topology_pcie(facts: Facts) -> dict[str, Any]:
    out = {}
    for t in (facts.topology or {}).get("gpus", []) or []:
        if isinstance(t, Mapping) and t.get("pci_bus_id"):
            out[str(t["pci_bus_id"]).lower()] = t.get("pcie")
    return out


class Pcie(Family):
    name = "pcie"
    category = "pcie"
    source = "sysfs and NVML"
    reads = ("/sys/bus/pci/devices/BDF/{current,max}_link_{speed,width} and the upstream port's max_link_speed "
             "(NVML's link figures where sysfs has none; the top generation from nvmlDeviceGetMaxPcieLinkGeneration "
             "first), aer_dev_{fatal,nonfatal}; nvmlDeviceGetPcieReplayCounter over the agent's window; utilization")
    thresholds = (f"width = max; generation = max at >= {BUSY_UTILIZATION_PERCENT}% utilization; AER fatal 0; "
                  "replays/min <= lanes x GT/s x 1e-12 x 60 (warning); AER non-fatal 0 (warning)")
    remedy = "reseat the GPU or check its riser/slot; replays and AER errors that persist: replace the riser or GPU"
    checks = ("gpu.pcie", "gpu.pcie_errors")

    def evaluate(self, facts: Facts) -> list[Check]:
        gpus = answering(facts.gpus)
        if not gpus:
            return []
        topo = topology_pcie(facts)
        host = facts.host
        bad: dict[int, list[str]] = {}
        notes = []
        warn: dict[int, list[str]] = {}
        for g in gpus:
            pcie = topo.get((g.pci_bus_id or "").lower())
            p = link_problem(g, pcie)
            if p:
                bad.setdefault(g.index, []).append(p)
            else:
                n = link_note(g, pcie)
                if n:
                    notes.append(n)
            _, top, _, _ = pcie_link(g, pcie)
            above = gpu_capable_above(g, pcie, top)
            if above is not None:
                notes.append(f"GPU {g.index} is Gen{above}-capable in a Gen{top} link (its slot or host): judged "
                             f"against Gen{top}")
            bus = (g.pci_bus_id or "").lower()
            aer = host.aer_of(bus) if host is not None else None
            unreadable = list(host.pcie_problems(bus)) if host is not None and hasattr(host, "pcie_problems") else []
            if aer is not None and aer.problem("fatal"):
                unreadable.append(aer.problem("fatal"))
            if unreadable:
                bad.setdefault(g.index, []).append("; ".join(unreadable) + ": not judged")
            for kind in ("nonfatal", "correctable"):
                if aer is not None and aer.problem(kind):
                    warn.setdefault(g.index, []).append(aer.problem(kind))
            if aer is not None and aer.fatal:
                bad.setdefault(g.index, []).append(
                    f"{aer.fatal} fatal uncorrectable PCIe error(s) since boot (AER): drain the node, reboot, and "
                    "reseat or replace the GPU if they recur")
            if aer is not None and aer.nonfatal:
                warn.setdefault(g.index, []).append(f"{aer.nonfatal} non-fatal uncorrectable PCIe error(s) since boot (AER)")
            rate = (getattr(facts.history, "replay_rates", {}) or {}).get(g.index)
            # the link's top figures: an idle GPU lowers its generation, and its replays are counted at
            # whatever speed it ran (DCGM takes the current figures and can warn on an idle link)
            _, gen_max, _, w_max = pcie_link(g, pcie)
            limit = replay_limit_per_minute(gen_max, w_max)
            if rate is not None and limit is not None and rate.per_minute > limit:
                warn.setdefault(g.index, []).append(
                    f"PCIe replays at {rate.per_minute:.1f}/min over {rate.minutes:.0f} min, above {limit:.2f}/min "
                    f"(Gen{gen_max} x{w_max})")
        by_index = {g.index: g for g in gpus}
        out = []
        if bad:
            texts = [f"{gpu_label(by_index[i])}: {'; '.join(p)}" for i, p in sorted(bad.items())]
            short = [f"GPU {i}: " + "; ".join(x.split(": ")[0] for x in p) for i, p in sorted(bad.items())]
            out.append(self.check("gpu.pcie", False, listed(texts), listed(short, 3), gpus=per_gpu(gpus, bad)))
        else:
            out.append(self.check("gpu.pcie", True, "PCIe links at full width" + "".join(f"; {n}" for n in notes),
                                  gpus=per_gpu(gpus, bad)))
        if warn:
            texts = [f"{gpu_label(by_index[i])}: {'; '.join(p)}" for i, p in sorted(warn.items())]
            out.append(self.check("gpu.pcie_errors", False, listed(texts) + ": watch the trend; reseat or replace "
                                  "the riser or GPU if they keep growing", listed(texts, 3), severity=WARNING,
                                  gpus=per_gpu(gpus, warn)))
        return out
