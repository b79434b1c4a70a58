"""``limits.memlock`` (target: the container runtime): RLIMIT_MEMLOCK of containerd, CRI-O or dockerd.

Pinned (page-locked) host buffers, used by data loaders' ``pin_memory``, NCCL and RDMA, count
against the locked-memory limit. Containers inherit it from the runtime that starts them, so the
runtime process's own limit is what a pod gets: it is read from ``/proc/<pid>/limits`` ("Max
locked memory", the soft limit) of the runtime found by ``/proc/<pid>/comm``. The profile gives
a floor (``limits.memlock: {min: unlimited}``); a higher value is fine.

Read-only: the limit comes from the runtime's systemd unit (or its own configuration) and takes
effect when the runtime restarts, so the row carries the remedy and ``apply`` never writes. No
runtime process found: ``unsupported``.
"""

from __future__ import annotations

from gpu_tune.errors import HostError
from gpu_tune.tune.model import Setting
from gpu_tune.host.parse import parse_limits
from gpu_tune.tune.profile import UNLIMITED, format_limit
from gpu_tune.tune.knobs.base import Context, Knob, process_table

# comm -> (systemd unit, the runtime's own setting, if any)
RUNTIMES: dict[str, tuple[str, str]] = {
    "containerd": ("containerd.service", ""),
    "crio": ("crio.service", "or default_ulimits = [\"memlock=-1:-1\"] in /etc/crio/crio.conf"),
    "dockerd": ("docker.service", "or --default-ulimit memlock=-1:-1 (\"default-ulimits\" in /etc/docker/daemon.json)"),
}
LIMIT = "Max locked memory"


def remedy(comm: str, floor: int) -> str:
    unit, other = RUNTIMES[comm]
    value = "infinity" if floor >= UNLIMITED else str(floor)
    text = (f"set LimitMEMLOCK={value} for {unit} (systemctl edit {unit.removesuffix('.service')}: "
            f"[Service] LimitMEMLOCK={value}; then restart it and the pods that need it)")
    return f"{text} {other}".strip()


class MemlockKnob(Knob):
    family = "limits"
    error_id = "limits.memlock"
    ids = ("limits.memlock",)
    writable = False
    files = ("/proc/[pid]/comm", "/proc/[pid]/limits")

    def wanted(self, profile) -> bool:
        return profile.limits.memlock is not None

    def read(self, ctx: Context) -> list[Setting]:
        bound = ctx.profile.limits.memlock
        desired = bound.describe()
        procs = process_table(ctx)
        found = [(comm, procs[comm][0]) for comm in RUNTIMES if comm in procs]
        if not found:
            return [Setting("limits.memlock", "-", None, desired, "unsupported",
                            f"no container runtime process ({', '.join(RUNTIMES)}) under /proc")]
        rows = []
        for comm, pid in found:
            path = f"/proc/{pid}/limits"
            try:
                limits = parse_limits(ctx.fs.read_text(path))
            except HostError as exc:
                if not ctx.fs.exists(path):  # the process went away between the two reads
                    rows.append(Setting("limits.memlock", comm, None, desired, "unsupported",
                                        f"{path}: no such file ({comm} pid {pid} exited?)", path))
                else:
                    rows.append(Setting("limits.memlock", comm, None, desired, "error", str(exc), path))
                continue
            lim = limits.get(LIMIT)
            if lim is None:
                rows.append(Setting("limits.memlock", comm, None, desired, "error",
                                    f"{path}: no {LIMIT!r} line", path))
                continue
            soft = UNLIMITED if lim.soft is None else lim.soft
            hard = UNLIMITED if lim.hard is None else lim.hard
            ok, relation, _ = bound.judge(soft)
            who = f"{comm} (pid {pid})"
            hard_note = f"; hard limit {format_limit(hard)}" if hard != soft else ""
            if ok:
                rows.append(Setting("limits.memlock", comm, format_limit(soft), desired, "ok",
                                    f"{relation}: containers started by {who} inherit it{hard_note}", path))
                continue
            detail = (f"{relation}: containers started by {who} inherit it and cannot pin more"
                      f"{hard_note}; {remedy(comm, bound.min or 0)}")
            rows.append(Setting("limits.memlock", comm, format_limit(soft), desired, "drift", detail, path))
        return rows
