"""``gpu-tune topology`` as a rich Tree: node -> CPUs, memory -> GPUs (link state) and NICs.

The only module of the topology code that imports rich.
"""

from __future__ import annotations

from rich.text import Text
from rich.tree import Tree

from gpu_tune.host.parse import format_cpulist
from gpu_tune.discover.model import PciDevice, Topology
from gpu_tune.views.text import printable


def _gib(kib: int | None) -> str:
    return "unknown" if kib is None else f"{kib / (1024 * 1024):.1f} GiB"


def _link(dev: PciDevice) -> Text:
    def gen(v):
        return "?" if v is None else str(v)

    text = Text(f"PCIe gen{gen(dev.link_gen_current)} x{gen(dev.link_width_current)}")
    if dev.link_degraded:
        text.append(f" DEGRADED (capable of gen{gen(dev.link_gen_max)} x{gen(dev.link_width_max)})",
                    style="bold red")
    elif dev.link_gen_below_max:
        text.append(f" (gen{gen(dev.link_gen_max)} capable; lower while idle)", style="yellow")
    return text


def _gpu_line(g: PciDevice, topo: Topology) -> Text:
    idx = "?" if g.gpu_index is None else str(g.gpu_index)
    t = Text()
    t.append(f"GPU {idx}", style="bold green")
    t.append(printable(f"  {g.gpu_name or g.device or 'NVIDIA GPU'}  {g.address}  "))
    t.append_text(_link(g))
    t.append(f"  {len(g.irqs)} IRQs")
    if g.numa_source == "local_cpulist":
        t.append("  (node from local_cpulist)", style="yellow")
    if g.mig_mode is not None and (g.mig_mode or g.mig_mode_pending):
        t.append(f"  MIG {'on' if g.mig_mode else 'off'}", style="bold magenta")
        if g.mig_mode_pending is not None and g.mig_mode_pending != g.mig_mode:
            t.append(f" (pending {'on' if g.mig_mode_pending else 'off'} after a GPU reset)", style="yellow")
    nics = topo.gpu_local_nics.get(g.address, ())
    if nics:
        t.append(printable(f"  local NICs: {', '.join(nics)}"), style="cyan")
    return t


def _software_line(topo: Topology) -> Text | None:
    """The driver and the CUDA version the probe's TensorFlow was built for."""
    bits = []
    if topo.driver_version or topo.cuda_driver_version:
        bits.append(f"NVIDIA driver {topo.driver_version or '?'} (CUDA {topo.cuda_driver_version or '?'})")
    rt = topo.probe_runtime or {}
    if rt.get("found"):
        if rt.get("error"):
            bits.append(f"probe's {rt.get('framework')}: build unknown ({rt['error']})")
        elif rt.get("is_cuda_build"):
            bits.append(f"probe's {rt.get('framework')} built for CUDA {rt.get('cuda_version')}")
        else:
            bits.append(f"probe's {rt.get('framework')}: CPU-only build")
    elif rt:
        bits.append(f"probe's {rt.get('framework')}: not installed")
    return Text(printable("; ".join(bits)), style="dim") if bits else None


def _irqs(dev: PciDevice) -> str:
    return f"{len(dev.irqs)} IRQs" + (f" ({format_cpulist(dev.irqs)})" if dev.irqs else "")


def _nic_line(n: PciDevice) -> Text:
    t = Text()
    t.append(printable(", ".join(n.names) or n.address), style="bold cyan")
    t.append(f"  {'rdma' if n.rdma else 'net'}  ")
    if n.virtio:
        t.append(printable(f"{n.virtio} on "))
    t.append(printable(f"{n.address}  "))
    if n.link_gen_current is not None or n.link_width_current is not None:
        t.append_text(_link(n))  # virtio functions have no PCIe link files
        t.append("  ")
    t.append(_irqs(n))
    if n.numa_source == "local_cpulist":
        t.append("  (node from local_cpulist)", style="yellow")
    return t


def render_topology(topo: Topology) -> Tree:
    """A rich renderable of the host's topology."""
    root = Tree(Text.assemble(("host", "bold"), printable(f"  {topo.cpu_model}, {topo.sockets} socket(s), "
                              f"{len(topo.cpus_online)} CPUs online ({format_cpulist(topo.cpus_online)})")))
    for node in topo.numa_nodes:
        dist = " ".join(str(d) for d in node.distances)
        branch = root.add(Text.assemble((f"NUMA node {node.id}", "bold magenta"), f"  distances [{dist}]"))
        branch.add(f"CPUs {format_cpulist(node.cpus) or 'none'} ({len(node.cpus)})")
        branch.add(f"memory {_gib(node.memory_total_kib)}")
        gpus = [g for g in topo.gpus if g.numa_node == node.id]
        if gpus:
            gb = branch.add(Text("GPUs", style="bold"))
            for g in gpus:
                gb.add(_gpu_line(g, topo))
        nics = [n for n in topo.nics if n.numa_node == node.id]
        if nics:
            nb = branch.add(Text("NICs", style="bold"))
            for n in nics:
                nb.add(_nic_line(n))
    soft = _software_line(topo)
    if soft is not None:
        root.add(soft)
    lost = [d for d in (*topo.gpus, *topo.nics) if d.numa_node is None]
    if lost:
        ub = root.add(Text("NUMA node unknown", style="bold yellow"))
        for d in lost:
            ub.add(_gpu_line(d, topo) if d.kind == "gpu" else _nic_line(d))
    if topo.warnings:
        wb = root.add(Text("warnings", style="bold yellow"))
        for w in topo.warnings:
            wb.add(Text(printable(w), style="yellow"))
    return root
