"""``irq.affinity`` per IRQ (target = IRQ number) of every GPU and NIC: ``/proc/irq/N/smp_affinity_list``.

With ``irq.affinity: numa-local`` each MSI/MSI-X IRQ of the devices in ``irq.devices`` should
land on its device's NUMA node: desired = the node's online CPUs minus ``irq.exclude_cpus``.
Only the IRQs of those devices are read (a node may have thousands). The current value is read
from ``smp_affinity_list`` or, where absent, the ``smp_affinity`` mask; both compare as sets and
show as CPU lists. ``effective_affinity_list`` (where the IRQ really lands) is shown in the detail
when it differs.

Each IRQ's files are read once per run: one sweep over every IRQ of the devices
(:func:`read_irq_files`, kept on the context), which the audit rows and the journal's record of
the original both use; only the verify step after writes reads them again (a new context).

- device NUMA node unknown -> ``unsupported`` rows (nothing to aim at);
- ``irqbalance`` running (``/proc/[pid]/comm``) -> ``conflict`` rows: it rewrites affinities every
  10 s, unless ``irq.irqbalance: ignore``;
- kernel-managed IRQs refuse a new affinity with ``EIO``: :meth:`IrqAffinityKnob.apply` raises
  :class:`gpu_tune.errors.UnsupportedWrite`, which the engine reports as ``unsupported`` for that IRQ.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Any, Iterable

from gpu_tune.errors import HostError, NotAFile, UnsupportedWrite
from gpu_tune.tune.model import Setting
from gpu_tune.host.parse import ParseError, format_cpulist, format_cpumask, parse_cpulist, parse_cpumask
from gpu_tune.tune.knobs.base import Context, Knob, encode_raw, process_table

IRQ_DIR = "/proc/irq"
IRQBALANCE_HINT = ("irqbalance is running and will move these IRQs back: stop it "
                   "(systemctl disable --now irqbalance), run it with --banirq=N for these IRQs or "
                   "IRQBALANCE_BANNED_CPULIST, or set irq.irqbalance: ignore")


def running_comms(ctx: Context) -> frozenset[str]:
    """The ``comm`` of every process under ``/proc`` (read once per context)."""
    return frozenset(process_table(ctx))


@dataclass(frozen=True)
class IrqFiles:
    """What one sweep read of an IRQ: the affinity file (``path``, its bytes ``raw``, the CPUs in
    it, or an error text) and ``effective_affinity_list`` (None when absent or unreadable)."""

    path: str | None
    raw: bytes | None
    current: frozenset[int] | None
    error: str
    effective: frozenset[int] | None


def _read_one(ctx: Context, irq: int, parse_list, parse_mask) -> IrqFiles:
    base = f"{IRQ_DIR}/{irq}"
    for name, parse in (("smp_affinity_list", parse_list), ("smp_affinity", parse_mask)):
        path = f"{base}/{name}"
        try:
            raw = ctx.fs.read_bytes(path)
        except NotAFile as exc:  # a FIFO or a device in its place: said, not passed over
            return IrqFiles(None, None, None, str(exc), None)
        except HostError:
            continue
        text = raw.decode("utf-8", "replace").strip()
        try:
            current, err = parse(text), ""
        except (ParseError, ValueError):
            current, err = None, f"{path}: unparsable {text!r}"
        break
    else:
        path = raw = current = None
        err = (f"{base}: neither smp_affinity_list nor smp_affinity is readable" if ctx.fs.is_dir(base) else
               f"{base}: no such IRQ (listed in the device's msi_irqs but not in /proc/irq)")
    effective = None
    eff = ctx.fs.read_optional(f"{base}/effective_affinity_list")
    if eff:
        try:
            effective = parse_list(eff)
        except (ParseError, ValueError):
            effective = None
    return IrqFiles(path, raw, current, err, effective)


def read_irq_files(ctx: Context, irqs: Iterable[int]) -> dict[int, IrqFiles]:
    """Every IRQ's files, each read once per context (later calls reuse the sweep). The same
    affinity text is parsed once (most IRQs of a node share a handful of CPU lists)."""
    swept: dict[int, IrqFiles] = ctx.cached("irq.files", dict)
    lists: dict[str, frozenset[int]] = {}
    masks: dict[str, frozenset[int]] = {}

    def parse_list(text: str) -> frozenset[int]:
        if text not in lists:
            lists[text] = parse_cpulist(text)
        return lists[text]

    def parse_mask(text: str) -> frozenset[int]:
        if text not in masks:
            masks[text] = parse_cpumask(text)
        return masks[text]

    for irq in irqs:
        if irq not in swept:
            swept[irq] = _read_one(ctx, irq, parse_list, parse_mask)
    return swept


class IrqAffinityKnob(Knob):
    family = "irq"
    error_id = "irq.affinity"
    ids = ("irq.affinity",)
    files = (f"{IRQ_DIR}/N/smp_affinity_list", f"{IRQ_DIR}/N/smp_affinity",
             f"{IRQ_DIR}/N/effective_affinity_list", "/sys/bus/pci/devices/*/msi_irqs/", "/proc/[pid]/comm")
    writes = (f"{IRQ_DIR}/[0-9]*/smp_affinity_list", f"{IRQ_DIR}/[0-9]*/smp_affinity")

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
        wanted: dict[int, Any] = {}
        for dev in devices:
            for irq in dev.irqs:
                wanted.setdefault(irq, dev)
        files = read_irq_files(ctx, wanted)
        texts: dict[frozenset[int], str] = {}

        def fmt(cpus: frozenset[int]) -> str:
            if cpus not in texts:
                texts[cpus] = format_cpulist(cpus)
            return texts[cpus]

        return [self._row(dev, irq, files[irq], topo, exclude, balancing, ncpus, fmt)
                for irq, dev in wanted.items()]

    def _row(self, dev, irq: int, got: IrqFiles, topo, exclude: frozenset[int], balancing: bool,
             ncpus: int, fmt) -> Setting:
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
        desired = fmt(want)
        if not want:
            return Setting("irq.affinity", target, None, "-", "unsupported",
                           f"{who}: irq.exclude_cpus removes every CPU of node {dev.numa_node}")
        path, current = got.path, got.current
        if current is None or path is None:
            return Setting("irq.affinity", target, None, desired, "error", got.error, path)
        cur_text = fmt(current)
        notes = [f"{who} node {dev.numa_node}"]
        if got.effective is not None and got.effective != current:
            notes.append(f"effective {fmt(got.effective)}")
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
        """The original as the sweep read it (the row's own reading); read again only when this
        context has no sweep of the IRQ."""
        got = ctx.cached("irq.files", dict).get(int(row.target)) if row.target.isdigit() else None
        if got is not None and got.path == row.path and got.raw is not None:
            entry = {"path": row.path, "value": row.current, "raw": encode_raw(got.raw)}
        else:
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
