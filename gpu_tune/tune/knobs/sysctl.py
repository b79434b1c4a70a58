"""``sysctl.<key>``: any key under /proc/sys, e.g. ``vm.swappiness`` -> /proc/sys/vm/swappiness.

Ranges for the keys the profiles use are checked when the profile loads (gpu_tune.tune.policy).
``net.*`` keys belong to a network namespace: from a pod without hostNetwork they change only
the pod's own namespace, so their rows say so.

A value is exact (``vm.swappiness: 0``) or a bound (``vm.max_map_count: {min: 1048576}``). A
bound is ``ok`` while the current value satisfies it (the detail says ``8249672 ≥ 1048576``) and
is never moved then; outside it, ``apply`` writes the nearest end (the floor, or the ceiling).
"""

from __future__ import annotations

from gpu_tune.errors import HostError
from gpu_tune.tune.model import Setting
from gpu_tune.tune.profile import Bound
from gpu_tune.tune.knobs.base import Context, Knob


def sysctl_path(key: str) -> str:
    return "/proc/sys/" + key.replace(".", "/")


def _norm(text: str) -> str:
    # multi-value sysctls (kernel.printk) read back tab-separated
    return " ".join(text.split())


def bound_row(sid: str, target: str, current: str, bound: Bound, path: str | None, note: str = "") -> Setting:
    """The row of a numeric setting checked against a bound (``current`` as read)."""
    desired = bound.describe()
    try:
        value = int(current)
    except ValueError:
        return Setting(sid, target, current, desired, "error", f"{current!r} is not a number", path)
    ok, relation, write = bound.judge(value)
    if ok:
        return Setting(sid, target, current, desired, "ok", "; ".join(x for x in (relation, note) if x), path)
    detail = f"{relation}: apply writes {write}"
    return Setting(sid, target, current, desired, "drift", "; ".join(x for x in (detail, note) if x), path,
                   {"write": str(write)})


class SysctlKnob(Knob):
    family = "sysctl"
    error_id = "sysctl"
    files = ("/proc/sys/**",)
    writes = ("/proc/sys/**",)

    def owns(self, setting_id: str) -> bool:
        return setting_id == "sysctl" or setting_id.startswith("sysctl.")

    def wanted(self, profile) -> bool:
        return bool(profile.sysctl)

    def read(self, ctx: Context) -> list[Setting]:
        rows = []
        for key, value in ctx.profile.sysctl.items():
            sid = f"sysctl.{key}"
            path = sysctl_path(key)
            desired = value.describe() if isinstance(value, Bound) else _norm(str(value))
            note = "per network namespace: effective host-wide only with hostNetwork" if key.startswith("net.") else ""
            if ctx.fs.is_dir(path):
                rows.append(Setting(sid, "host", None, desired, "error", f"{path} is a directory, expected a file", path))
                continue
            if not ctx.fs.exists(path):
                rows.append(Setting(sid, "host", None, desired, "unsupported", f"this kernel has no {path}", path))
                continue
            try:
                current = _norm(ctx.fs.read_text(path))
            except HostError as exc:
                rows.append(Setting(sid, "host", None, desired, "error", str(exc), path))
                continue
            if isinstance(value, Bound):
                rows.append(bound_row(sid, "host", current, value, path, note))
                continue
            status = "ok" if current == desired else "drift"
            rows.append(Setting(sid, "host", current, desired, status, note, path))
        return rows

    # A bound row writes the end it is outside of, not its description.
    def value_to_write(self, row: Setting) -> str:
        return (row.handle or {}).get("write", row.desired)

    def planned(self, row: Setting) -> str:
        return self.value_to_write(row)
