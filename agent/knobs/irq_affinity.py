"""``irq.affinity`` per IRQ (target = IRQ number) of every GPU and NIC: ``/proc/irq/N/smp_affinity_list``.

With ``irq.affinity: numa-local`` each MSI/MSI-X IRQ of the devices in ``irq.devices`` should
land on its device's NUMA node: desired = the node's online CPUs minus ``irq.exclude_cpus``.
Only the IRQs of those devices are read (a node may have thousands). The current value is read
from ``smp_affinity_list`` or, where absent, the ``smp_affinity`` mask; both compare as sets and
show as CPU lists. ``effective_affinity_list`` (where the IRQ really lands) is shown in the detail
when it differs.

- device NUMA node unknown -> ``unsupported`` rows (nothing to aim at);
- ``irqbalance`` running (``/proc/[pid]/comm``) -> ``conflict`` rows: it rewrites affinities every
  10 s, unless ``irq.irqbalance: ignore``;
- kernel-managed IRQs refuse a new affinity with ``EIO``: :meth:`IrqAffinityKnob.apply` raises
  :class:`agent.errors.UnsupportedWrite`, which the engine reports as ``unsupported`` for that IRQ.
"""

from __future__ import annotations

import errno

from typing import Any

from ..errors import HostError, UnsupportedWrite
from ..model import Setting
from ..parse import ParseError, format_cpulist, format_cpumask, parse_cpulist, parse_cpumask
from .base import Context, Knob, process_table

IRQ_DIR = "/proc/irq"
IRQBALANCE_HINT = ("irqbalance is running and will move these IRQs back: stop it "
                   "(systemctl disable --now irqbalance), run it with --banirq=N for these IRQs or "
                   "IRQBALANCE_BANNED_CPULIST, or set irq.irqbalance: ignore")


def running_comms(ctx: Context) -> frozenset[str]:
    """The ``comm`` of every process under ``/proc`` (read once per context)."""
    return frozenset(process_table(ctx))


def _read_affinity(ctx: Context, irq: int) -> tuple[str | None, frozenset[int] | None, str]:
    """(path written, current CPUs or None, error text) for one IRQ."""
    base = f"{IRQ_DIR}/{irq}"
    lst = ctx.fs.read_optional(f"{base}/smp_affinity_list")
    if lst is not None:
        try:
            return f"{base}/smp_affinity_list", parse_cpulist(lst), ""
        except (ParseError, ValueError):
            return f"{base}/smp_affinity_list", None, f"{base}/smp_affinity_list: unparsable {lst!r}"
    mask = ctx.fs.read_optional(f"{base}/smp_affinity")
    if mask is not None:
        try:
            return f"{base}/smp_affinity", parse_cpumask(mask), ""
        except ParseError:
            return f"{base}/smp_affinity", None, f"{base}/smp_affinity: unparsable {mask!r}"
    if not ctx.fs.is_dir(base):
        return None, None, f"{base}: no such IRQ (listed in the device's msi_irqs but not in /proc/irq)"
    return None, None, f"{base}: neither smp_affinity_list nor smp_affinity is readable"


class IrqAffinityKnob(Knob):
    family = "irq"
    error_id = "irq.affinity"
    ids = ("irq.affinity",)
    files = (f"{IRQ_DIR}/N/smp_affinity_list", f"{IRQ_DIR}/N/smp_affinity",
             f"{IRQ_DIR}/N/effective_affinity_list", "/sys/bus/pci/devices/*/msi_irqs/", "/proc/[pid]/comm")

    def wanted(self, profile) -> bool:
        return profile.irq.affinity == "numa-local"

    def read(self, ctx: Context) -> list[Setting]:
        pol = ctx.profile.irq
        topo = ctx.topology()
        devices = []
        if "gpu" in pol.devices:
            devices.extend(topo.gpus)
        if "nic" in pol.devices:
            devices.extend(topo.nics)
        try:
            exclude = parse_cpulist(pol.exclude_cpus)
        except (ParseError, ValueError):
            exclude = frozenset()
        balancing = pol.irqbalance != "ignore" and "irqbalance" in running_comms(ctx)
        ncpus = max(topo.cpus_online, default=0) + 1
        rows: list[Setting] = []
        seen: set[int] = set()
        for dev in devices:
            for irq in dev.irqs:
                if irq in seen:
                    continue
                seen.add(irq)
                rows.append(self._row(ctx, dev, irq, topo, exclude, balancing, ncpus))
        return rows

    def _row(self, ctx: Context, dev, irq: int, topo, exclude: frozenset[int], balancing: bool,
             ncpus: int) -> Setting:
        target = str(irq)
        who = dev.label
        if dev.numa_node is None:
            return Setting("irq.affinity", target, None, "-", "unsupported",
                           f"{who}: NUMA node unknown (numa_node -1, local_cpulist not within one node)")
        node_cpus = topo.node_cpus(dev.numa_node)
        if not node_cpus:
            return Setting("irq.affinity", target, None, "-", "error",
                           f"{who}: the CPUs of NUMA node {dev.numa_node} are unknown (unreadable "
                           f"/sys/devices/system/node/node{dev.numa_node}/cpulist)")
        want = node_cpus - exclude
        desired = format_cpulist(want)
        if not want:
            return Setting("irq.affinity", target, None, "-", "unsupported",
                           f"{who}: irq.exclude_cpus removes every CPU of node {dev.numa_node}")
        path, current, err = _read_affinity(ctx, irq)
        if current is None:
            return Setting("irq.affinity", target, None, desired, "error", err, path)
        cur_text = format_cpulist(current)
        notes = [f"{who} node {dev.numa_node}"]
        eff = ctx.fs.read_optional(f"{IRQ_DIR}/{irq}/effective_affinity_list")
        if eff:
            try:
                eff_set = parse_cpulist(eff)
            except (ParseError, ValueError):
                eff_set = None
            if eff_set is not None and eff_set != current:
                notes.append(f"effective {format_cpulist(eff_set)}")
        handle = {"form": "list" if path.endswith("_list") else "mask", "ncpus": ncpus}
        if current == want:
            status = "ok"
        else:
            status = "drift"
        if balancing:
            status = "conflict"
            notes.append(IRQBALANCE_HINT)
        return Setting("irq.affinity", target, cur_text, desired, status, "; ".join(notes), path, handle)

    # -- writing ------------------------------------------------------------------------------
    def value_to_write(self, row: Setting) -> str:
        handle = row.handle or {}
        if handle.get("form") == "mask":
            return format_cpumask(parse_cpulist(row.desired), handle.get("ncpus"))
        return row.desired

    def snapshot(self, ctx: Context, row: Setting) -> dict[str, Any]:
        entry = super().snapshot(ctx, row)
        entry["ncpus"] = (row.handle or {}).get("ncpus")
        return entry

    def apply(self, ctx: Context, row: Setting) -> None:
        try:
            super().apply(ctx, row)
        except UnsupportedWrite:
            raise
        except HostError as exc:
            if exc.errno == errno.EIO:
                raise UnsupportedWrite(f"IRQ {row.target}: kernel-managed IRQ, its affinity cannot be "
                                       f"changed ({exc})") from None
            raise

    def restore_value(self, entry: dict[str, Any]) -> str:
        value = str(entry["value"])
        if str(entry.get("path", "")).endswith("/smp_affinity"):
            return format_cpumask(parse_cpulist(value), entry.get("ncpus"))
        return value
