"""``thp.enabled`` and ``thp.defrag``: /sys/kernel/mm/transparent_hugepage/{enabled,defrag}.

The files read ``always [madvise] never`` and take the bare word. When the kernel command line
fixes ``transparent_hugepage=``, the boot owner decides: the row is ``unsupported`` with the
parameter named, and nothing is written.
"""

from __future__ import annotations

from gpu_tune.errors import HostError
from gpu_tune.tune.model import Setting
from gpu_tune.host.parse import parse_bracketed, parse_cmdline
from gpu_tune.tune.knobs.base import Context, Knob

THP_DIR = "/sys/kernel/mm/transparent_hugepage"


class ThpKnob(Knob):
    family = "thp"
    error_id = "thp.enabled"
    ids = ("thp.enabled", "thp.defrag")
    files = (f"{THP_DIR}/enabled", f"{THP_DIR}/defrag", "/proc/cmdline")
    writes = (f"{THP_DIR}/enabled", f"{THP_DIR}/defrag")

    def wanted(self, profile) -> bool:
        return profile.thp.enabled is not None or profile.thp.defrag is not None

    def read(self, ctx: Context) -> list[Setting]:
        rows = []
        cmdline = parse_cmdline(ctx.fs.read_optional("/proc/cmdline") or "")
        fixed = cmdline.get("transparent_hugepage")
        for name in ("enabled", "defrag"):
            desired = getattr(ctx.profile.thp, name)
            if desired is None:
                continue
            sid = f"thp.{name}"
            path = f"{THP_DIR}/{name}"
            if not ctx.fs.exists(path):
                rows.append(Setting(sid, "host", None, desired, "unsupported",
                                    "this kernel has no transparent hugepages", path))
                continue
            try:
                choice = parse_bracketed(ctx.fs.read_text(path))
            except HostError as exc:
                rows.append(Setting(sid, "host", None, desired, "error", str(exc), path))
                continue
            current = choice.active
            if current == desired:
                rows.append(Setting(sid, "host", current, desired, "ok", "", path))
            elif name == "enabled" and fixed is not None:
                rows.append(Setting(sid, "host", current, desired, "unsupported",
                                    f"fixed on the kernel command line (transparent_hugepage={fixed}); "
                                    "change the boot parameters to change it", path))
            elif choice.options and len(choice.options) > 1 and desired not in choice.options:
                rows.append(Setting(sid, "host", current, desired, "unsupported",
                                    f"kernel offers only: {' '.join(choice.options)}", path))
            else:
                rows.append(Setting(sid, "host", current, desired, "drift", "", path))
        return rows
