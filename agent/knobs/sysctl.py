"""``sysctl.<key>``: any key under /proc/sys, e.g. ``vm.swappiness`` -> /proc/sys/vm/swappiness.

Ranges for the keys the profiles use are checked when the profile loads (agent.policy).
``net.*`` keys belong to a network namespace: from a pod without hostNetwork they change only
the pod's own namespace, so their rows say so.
"""

from __future__ import annotations

from ..errors import HostError
from ..model import Setting
from .base import Context, Knob


def sysctl_path(key: str) -> str:
    return "/proc/sys/" + key.replace(".", "/")


def _norm(text: str) -> str:
    # multi-value sysctls (kernel.printk) read back tab-separated
    return " ".join(text.split())


class SysctlKnob(Knob):
    family = "sysctl"
    error_id = "sysctl"
    files = ("/proc/sys/**",)

    def wanted(self, profile) -> bool:
        return bool(profile.sysctl)

    def read(self, ctx: Context) -> list[Setting]:
        rows = []
        for key, value in ctx.profile.sysctl.items():
            sid = f"sysctl.{key}"
            path = sysctl_path(key)
            desired = _norm(str(value))
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
            status = "ok" if current == desired else "drift"
            rows.append(Setting(sid, "host", current, desired, status, note, path))
        return rows
