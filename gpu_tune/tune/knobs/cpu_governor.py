"""``cpu.governor`` per online CPU: /sys/devices/system/cpu/cpuN/cpufreq/scaling_governor.

The profile gives a fallback order (``performance|schedutil``); the wanted governor is the first
that ``scaling_available_governors`` offers (intel_pstate offers only performance and powersave,
acpi-cpufreq offers schedutil, ondemand, ...). No cpufreq (most VMs): ``unsupported``.
"""

from __future__ import annotations

from gpu_tune.errors import HostError
from gpu_tune.tune.model import Setting
from gpu_tune.host.numbers import uint_or_none
from gpu_tune.host.parse import ParseError, parse_cpulist
from gpu_tune.tune.knobs.base import Context, Knob

CPU_DIR = "/sys/devices/system/cpu"


def online_cpus(ctx: Context) -> list[int]:
    def load():
        text = ctx.fs.read_optional(f"{CPU_DIR}/online")
        if text:
            try:
                return sorted(parse_cpulist(text))
            except (ParseError, ValueError):
                pass
        ids = (uint_or_none(n[3:], max_digits=5) for n in ctx.fs.listdir(CPU_DIR) if n.startswith("cpu"))
        return sorted(i for i in ids if i is not None)

    return ctx.cached("online_cpus", load)


class CpuGovernorKnob(Knob):
    family = "cpu"
    error_id = "cpu.governor"
    ids = ("cpu.governor",)
    files = (f"{CPU_DIR}/online", f"{CPU_DIR}/cpuN/cpufreq/scaling_governor",
             f"{CPU_DIR}/cpuN/cpufreq/scaling_available_governors")
    writes = (f"{CPU_DIR}/cpu[0-9]*/cpufreq/scaling_governor",)

    def wanted(self, profile) -> bool:
        return bool(profile.cpu.governor)

    def read(self, ctx: Context) -> list[Setting]:
        wanted = ctx.profile.cpu.governor or []
        prefer = "|".join(wanted)
        rows = []
        avail_cache: dict[str, tuple[str, ...]] = {}
        for cpu in online_cpus(ctx):
            target = f"cpu{cpu}"
            base = f"{CPU_DIR}/cpu{cpu}/cpufreq"
            path = f"{base}/scaling_governor"
            try:
                current = ctx.fs.read_value(path)
            except HostError as exc:
                if not ctx.fs.exists(base):
                    rows.append(Setting("cpu.governor", target, None, prefer, "unsupported",
                                        "no cpufreq for this CPU (a VM, or frequency fixed by firmware)"))
                else:
                    rows.append(Setting("cpu.governor", target, None, prefer, "error", str(exc), path))
                continue
            avail_text = ctx.fs.read_optional(f"{base}/scaling_available_governors")
            if avail_text is None:
                available: tuple[str, ...] = ()
            else:
                available = avail_cache.setdefault(avail_text, tuple(avail_text.split()))
            if available:
                desired = next((g for g in wanted if g in available), None)
                if desired is None:
                    rows.append(Setting("cpu.governor", target, current, prefer, "unsupported",
                                        f"driver offers only: {' '.join(available)}", path))
                    continue
            else:
                desired = wanted[0]
            status = "ok" if current == desired else "drift"
            rows.append(Setting("cpu.governor", target, current, desired, status, "", path))
        return rows
