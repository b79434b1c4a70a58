"""``cpu.cstates`` per online CPU: /sys/devices/system/cpu/cpuN/cpuidle/stateK/{name,latency,disable}.

Deep idle states save power but take long to leave: a CPU waking from C6 (290 µs on Sapphire
Rapids) to launch the next kernel or hand over the next batch shows up as a GPU bubble. The
profile gives an exit-latency budget, ``cpu.cstates.max_latency_us``; every state whose
``latency`` is above it should be disabled. ``apply`` writes ``1`` into those states' per-CPU
``disable`` files (journalled first, like every write; revert puts ``0`` back).

Rows: ``current`` names the enabled states above the budget (``C6 (290 µs)``; ``drift``), or
``C6 disabled`` once they are off, or the deepest state the driver offers when none is above the
budget (``ok``). ``desired`` is the budget (``≤ 10 µs``).

Few files are read: the states' names and latencies once, from the first CPU (the cpuidle
driver is system-wide unless the kernel runs one per CPU, which shows as ``cpuN/cpuidle/driver/``;
then per CPU), and per CPU only the ``disable`` files of the states above the budget.

The kernel command line (``intel_idle.max_cstate``, ``processor.max_cstate``, ``idle=``,
``cpuidle.off``) limits states at boot: it is reported in the detail, never changed. No cpuidle
for a CPU (``cpuidle.off=1``, ``idle=poll``, a VM without a guest idle driver): ``unsupported``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpu_tune.errors import HostError
from gpu_tune.tune.model import Setting
from gpu_tune.host.numbers import uint_or_none
from gpu_tune.host.parse import parse_cmdline
from gpu_tune.tune.knobs.base import Context, Knob, encode_raw, restore_file
from gpu_tune.tune.knobs.cpu_governor import CPU_DIR, online_cpus

CMDLINE_PARAMS = ("intel_idle.max_cstate", "processor.max_cstate", "idle", "cpuidle.off",
                  "intel_idle.states_off")


@dataclass(frozen=True)
class IdleState:
    index: int
    name: str
    latency_us: int

    def __str__(self) -> str:
        return f"{self.name} ({self.latency_us} µs)"


def kernel_cmdline(ctx: Context) -> dict[str, str]:
    return ctx.cached("cmdline", lambda: parse_cmdline(ctx.fs.read_optional("/proc/cmdline") or ""))


def _read_states(ctx: Context, cpu: int) -> list[IdleState] | None:
    """The idle states of ``cpu`` (name, exit latency), or None without cpuidle."""
    base = f"{CPU_DIR}/cpu{cpu}/cpuidle"
    names = [n for n in ctx.fs.listdir(base) if n.startswith("state") and uint_or_none(n[5:], max_digits=3) is not None]
    if not names:
        return None
    out = []
    for n in sorted(names, key=lambda n: int(n[5:])):
        name = ctx.fs.read_optional(f"{base}/{n}/name")
        lat = ctx.fs.read_optional(f"{base}/{n}/latency")
        if name is None or lat is None or uint_or_none(lat) is None:
            raise HostError(f"{base}/{n}: unreadable name or latency")
        out.append(IdleState(int(n[5:]), name, int(lat)))
    return out


class CpuCstatesKnob(Knob):
    family = "cstates"
    error_id = "cpu.cstates"
    ids = ("cpu.cstates",)
    files = (f"{CPU_DIR}/cpuN/cpuidle/stateK/name", f"{CPU_DIR}/cpuN/cpuidle/stateK/latency",
             f"{CPU_DIR}/cpuN/cpuidle/stateK/disable", f"{CPU_DIR}/cpuidle/current_driver", "/proc/cmdline")
    writes = (f"{CPU_DIR}/cpu[0-9]*/cpuidle/state[0-9]*/disable",)

    def entry_problem(self, entry: dict[str, Any]) -> str:
        """A C-state entry records the ``disable`` files of one CPU (``files``), no ``path``."""
        if entry.get("path") is not None or entry.get("created_dirs"):
            return "path: family 'cstates' records its files in files, not in path or created_dirs"
        files = entry.get("files")
        if not files:
            return "files: family 'cstates' records the disable files it wrote; none are given"
        for i, f in enumerate(files):
            problem = self.path_problem(f"files[{i}].path", f["path"])
            if problem:
                return problem
        return ""

    def wanted(self, profile) -> bool:
        return profile.cpu.cstates is not None

    def read(self, ctx: Context) -> list[Setting]:
        budget = ctx.profile.cpu.cstates.max_latency_us
        desired = f"≤ {budget} µs"
        cpus = online_cpus(ctx)
        cmdline = kernel_cmdline(ctx)
        boot = [f"{k}={cmdline[k]}" if cmdline[k] else k for k in CMDLINE_PARAMS if k in cmdline]
        note = f"kernel command line: {' '.join(boot)} (reported, not changed)" if boot else ""
        if not cpus:
            return [Setting("cpu.cstates", "-", None, desired, "error", f"{CPU_DIR}/online: no online CPUs")]
        per_cpu_driver = ctx.fs.is_dir(f"{CPU_DIR}/cpu{cpus[0]}/cpuidle/driver")
        shared = None if per_cpu_driver else _read_states(ctx, cpus[0])
        driver = ctx.fs.read_optional(f"{CPU_DIR}/cpuidle/current_driver")
        rows = []
        for cpu in cpus:
            target = f"cpu{cpu}"
            states = _read_states(ctx, cpu) if per_cpu_driver else shared
            if not states or driver == "none":
                why = ("no cpuidle driver (idle=poll, cpuidle.off=1, or a VM without a guest idle driver)"
                       if driver in (None, "none") else "no cpuidle states for this CPU")
                rows.append(Setting("cpu.cstates", target, None, desired, "unsupported",
                                    "; ".join(x for x in (why, note) if x)))
                continue
            rows.append(self._row(ctx, cpu, states, budget, desired, note))
        return rows

    def _row(self, ctx: Context, cpu: int, states: list[IdleState], budget: int, desired: str,
             note: str) -> Setting:
        target = f"cpu{cpu}"
        deep = [s for s in states if s.latency_us > budget]
        if not deep:
            deepest = max(states, key=lambda s: s.latency_us)
            return Setting("cpu.cstates", target, str(deepest), desired, "ok",
                           "; ".join(x for x in ("no state above the budget", note) if x))
        base = f"{CPU_DIR}/cpu{cpu}/cpuidle"
        enabled: list[tuple[IdleState, str]] = []
        for s in deep:
            path = f"{base}/state{s.index}/disable"
            flag = ctx.fs.read_optional(path)
            if flag is None:
                if not ctx.fs.is_dir(base):
                    return Setting("cpu.cstates", target, None, desired, "unsupported",
                                   "; ".join(x for x in ("no cpuidle for this CPU", note) if x))
                if not ctx.fs.exists(path):
                    return Setting("cpu.cstates", target, None, desired, "unsupported",
                                   f"{path}: no such file (this CPU lacks {s.name})")
                return Setting("cpu.cstates", target, None, desired, "error", f"{path}: unreadable")
            if flag.strip() == "0":
                enabled.append((s, path))
        if not enabled:
            current = ", ".join(s.name for s in deep) + " disabled"
            return Setting("cpu.cstates", target, current, desired, "ok", note)
        current = ", ".join(str(s) for s, _ in enabled)
        detail = "; ".join(x for x in ("enabled above the budget: apply disables them", note) if x)
        handle = {"cpu": cpu, "disable": [(s.name, p) for s, p in enabled]}
        return Setting("cpu.cstates", target, current, desired, "drift", detail, None, handle)

    # -- writing: one row covers several ``disable`` files --------------------------------------
    def planned(self, row: Setting) -> str:
        return "disable " + ", ".join(name for name, _ in (row.handle or {}).get("disable", []))

    def snapshot(self, ctx: Context, row: Setting) -> dict[str, Any]:
        files = []
        for name, path in (row.handle or {}).get("disable", []):
            raw = ctx.fs.read_bytes(path)
            files.append({"state": name, "path": path, "value": raw.decode().strip() or "0", "raw": encode_raw(raw)})
        if not files:
            raise HostError(f"cpu.cstates[{row.target}]: nothing to record")
        return {"value": row.current, "files": files}

    def apply(self, ctx: Context, row: Setting) -> None:
        for _, path in (row.handle or {}).get("disable", []):
            ctx.fs.write_text(path, "1")

    def current_value(self, ctx: Context, entry: dict[str, Any]) -> str | None:
        parts = []
        for f in entry.get("files") or []:
            flag = ctx.fs.read_optional(f["path"])
            parts.append(f"{f.get('state')} {'disabled' if flag == '1' else 'enabled' if flag == '0' else '?'}")
        return ", ".join(parts) or None

    def restore(self, ctx: Context, entry: dict[str, Any]) -> None:
        files = entry.get("files")
        if not files:
            raise HostError("cpu.cstates: journal entry lists no files")
        for f in reversed(files):
            restore_file(ctx, f["path"], f.get("raw"), str(f.get("value", "0")))
