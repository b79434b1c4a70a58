"""Thermal and power slowdowns, judged over a window rather than one instant.

- ``gpu.thermal`` (fatal): a hardware slowdown (``hw_slowdown``, ``hw_thermal_slowdown``, or the
  power brake ``hw_power_brake_slowdown``, clock event reason 0x80) present in at least
  :data:`FATAL_MINUTES` of the last :data:`~gpu_tune.judge.checks.state.WINDOW_MINUTES` minutes
  the agent read the GPU, or the temperature above ``readiness.max_temperature_c``.
- ``gpu.clocks`` (warning): a hardware slowdown present for fewer minutes (or seen by a one-shot
  ``gpu-tune check``, which has one reading), a software thermal slowdown, or the SM clock under
  :data:`LOW_CLOCK_FRACTION` of its maximum while the GPU is busy without a power cap to explain it.
"""

from __future__ import annotations

from gpu_tune.judge.checks.base import WARNING, Check, Facts, Family, answering, gpu_label, listed, per_gpu
from gpu_tune.judge.checks.pcie import is_busy
from gpu_tune.judge.checks.state import SLOWDOWNS, WINDOW_MINUTES

FATAL_MINUTES = 6
LOW_CLOCK_FRACTION = 0.7


class Thermal(Family):
    name = "thermal"
    category = "thermal"
    source = "NVML"
    reads = ("nvmlDeviceGetCurrentClocksEventReasons once per pass, kept per minute; nvmlDeviceGetTemperature; "
             "nvmlDeviceGetClockInfo / nvmlDeviceGetMaxClockInfo (SM)")
    thresholds = (f"HW slowdown, HW thermal slowdown or power brake in >= {FATAL_MINUTES} of the last "
                  f"{WINDOW_MINUTES} minutes; temperature <= readiness.max_temperature_c; warning: any slowdown, "
                  f"SM clock < {LOW_CLOCK_FRACTION:.0%} of max when busy")
    remedy = "check cooling, airflow, fans and the power supply (a power brake is the chassis asking the GPU to stop)"
    checks = ("gpu.thermal", "gpu.clocks")

    def evaluate(self, facts: Facts) -> list[Check]:
        gpus = answering(facts.gpus)
        if not gpus:
            return []
        max_temp = getattr(facts.readiness, "max_temperature_c", None)
        minutes = getattr(facts.history, "slowdown_minutes", {}) or {}
        bad: dict[int, list[str]] = {}
        warn: dict[int, list[str]] = {}
        for g in gpus:
            seen = minutes.get(g.index, {})
            now = [r for r in g.clock_throttle_reasons if r in SLOWDOWNS]
            long = [r for r in SLOWDOWNS if seen.get(r, 0) >= FATAL_MINUTES]
            if long:
                bad.setdefault(g.index, []).append(
                    "clocks slowed by the hardware (" + ", ".join(f"{r} in {seen[r]} of the last {WINDOW_MINUTES} min"
                                                           for r in long) + "): check cooling, airflow and power")
            elif now or any(seen.get(r) for r in SLOWDOWNS):
                names = sorted(set(now) | {r for r in SLOWDOWNS if seen.get(r)})
                warn.setdefault(g.index, []).append(
                    f"hardware slowdown ({', '.join(names)}), in fewer than {FATAL_MINUTES} of {WINDOW_MINUTES} minutes")
            if "sw_thermal_slowdown" in g.clock_throttle_reasons:
                warn.setdefault(g.index, []).append("software thermal slowdown")
            t = g.temperature_c
            if max_temp is not None and isinstance(t, (int, float)) and t > max_temp:
                bad.setdefault(g.index, []).append(f"temperature {t:g} C above {max_temp:g} C: check cooling and airflow")
            sm, top = g.sm_clock_mhz, g.sm_clock_max_mhz
            if (isinstance(sm, int) and isinstance(top, int) and top > 0 and is_busy(g) and sm < LOW_CLOCK_FRACTION * top
                    and "sw_power_cap" not in g.clock_throttle_reasons):
                warn.setdefault(g.index, []).append(f"SM clock {sm} of {top} MHz while busy")
        by_index = {g.index: g for g in gpus}
        out = []
        if bad:
            texts = [f"{gpu_label(by_index[i])}: {'; '.join(p)}" for i, p in sorted(bad.items())]
            short = [f"GPU {i}: " + "; ".join(x.split(": check")[0] for x in p) for i, p in sorted(bad.items())]
            out.append(self.check("gpu.thermal", False, listed(texts), listed(short, 3), gpus=per_gpu(gpus, bad)))
        else:
            out.append(self.check("gpu.thermal", True, "no lasting hardware slowdown; temperatures within "
                                  f"{max_temp:g} C" if max_temp is not None else "no lasting hardware slowdown",
                                  gpus=per_gpu(gpus, bad)))
        if warn:
            texts = [f"{gpu_label(by_index[i])}: {'; '.join(p)}" for i, p in sorted(warn.items())]
            out.append(self.check("gpu.clocks", False, listed(texts) + ": watch cooling and power", listed(texts, 3),
                                  severity=WARNING, gpus=per_gpu(gpus, warn)))
        return out
