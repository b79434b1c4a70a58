"""Topology discovery from the kernel's own files under ``--root``.

``discover(fs, gpus)`` reads:

- NUMA nodes: ``/sys/devices/system/node/{online,nodeN/cpulist,nodeN/meminfo,nodeN/distance}``;
- CPUs: ``/sys/devices/system/cpu/online``, sockets and the model from ``/proc/cpuinfo``
  (``physical id``, ``model name``), falling back to ``cpuN/topology/physical_package_id`` and, on
  the live host only, to py-cpuinfo;
- GPUs: ``/sys/bus/pci/devices/*`` with vendor ``0x10de`` and class ``0x0300xx``/``0x0302xx``;
- NICs: ``/sys/class/net/*/device`` and ``/sys/class/infiniband/*/device`` (their PCI function);
  in a VM the ``device`` link of a virtio-net interface is a virtio device *under* its PCI
  function (``.../0000:00:03.0/virtio2``): the PCI function is the parent, and the interface's
  IRQs are found by name in ``/proc/interrupts`` (``virtio2-input.0``, ``virtio2-output.0``,
  ``virtio2-config``, or ``virtio2`` on a shared INTx line) as well as in the function's
  ``msi_irqs/``;
- for every GPU and NIC: ``numa_node``, ``local_cpulist``, the PCIe link (current/max speed and
  width) and the MSI/MSI-X IRQs listed in ``msi_irqs/``.

``numa_node`` is ``-1`` where firmware gives none: the node is then derived from the device's
``local_cpulist`` (the node whose CPU list equals or contains it) or left unknown (``None``,
``numa_source="unknown"``), never guessed. GPUs are matched to the backend's GPUs by PCI bus id,
and NVML's CPU affinity is cross-checked against sysfs (a mismatch becomes a warning); each GPU
carries its MIG mode (current and pending) from the backend.

With a GPU backend the document also carries the driver version and the CUDA version the driver
supports, and ``probe_runtime``: the CUDA version the probe's TensorFlow was built for (read from
the probe's own environment, see :mod:`gpu_tune.gpu.cuda`; the container's in the DaemonSet).
Nothing here reads per-IRQ files: IRQs are only listed.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from gpu_tune.discover.model import NumaNode, NumaSource, PciDevice, Topology, nic_name
from gpu_tune.errors import HostError, NotAFile
from gpu_tune.host.numbers import uint_or_none
from gpu_tune.host.files import TABLE_READ_CAP
from gpu_tune.host.parse import (MAX_CPU, normalize_bus_id, ParseError, format_cpulist, irqs_named, parse_cpulist, parse_cpumask, parse_int,
                    parse_interrupts, parse_link_speed, parse_link_width, parse_meminfo)

if TYPE_CHECKING:  # pragma: no cover
    from gpu_tune.gpu.base import GpuBackend, GpuInfo
    from gpu_tune.host.fs import HostFS

log = logging.getLogger("gpu_tune")

NODE_DIR = "/sys/devices/system/node"
CPU_DIR = "/sys/devices/system/cpu"
PCI_DIR = "/sys/bus/pci/devices"
NET_DIR = "/sys/class/net"
IB_DIR = "/sys/class/infiniband"

PCI_ADDRESS_RE = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
VIRTIO_RE = re.compile(r"^virtio\d+$")

NVIDIA_VENDOR = "0x10de"
GPU_CLASS_PREFIXES = ("0x0300", "0x0302")  # VGA-compatible, 3D controller

def _cpulist(text: str | None) -> frozenset[int] | None:
    if text is None:
        return None
    try:
        return parse_cpulist(text)
    except (ParseError, ValueError):
        return None


def _online_cpus(fs: "HostFS", warnings: list[str]) -> frozenset[int]:
    text = fs.read_optional(f"{CPU_DIR}/online")
    cpus = _cpulist(text)
    if cpus:
        return cpus
    if text and text.strip() and cpus is None:
        warnings.append(f"{CPU_DIR}/online: unparsable {text.strip()[:40]!r} (CPU ids are 0..{MAX_CPU}): "
                        "the cpuN directories are used instead")
    ids = (uint_or_none(n[3:], max_digits=5) for n in fs.listdir(CPU_DIR) if n.startswith("cpu"))
    found = frozenset(i for i in ids if i is not None and i <= MAX_CPU)
    if not found:
        warnings.append(f"{CPU_DIR}/online: unreadable and no cpuN directories")
    return found


def _numa_nodes(fs: "HostFS", cpus_online: frozenset[int], warnings: list[str]) -> tuple[NumaNode, ...]:
    ids = _cpulist(fs.read_optional(f"{NODE_DIR}/online"))
    if ids is None:
        ids = frozenset(i for i in (uint_or_none(n[4:], max_digits=5) for n in fs.listdir(NODE_DIR)
                                    if n.startswith("node")) if i is not None)
    nodes = []
    for nid in sorted(ids):
        base = f"{NODE_DIR}/node{nid}"
        cpus = _cpulist(fs.read_optional(f"{base}/cpulist"))
        if cpus is None:
            cpus = frozenset()
            warnings.append(f"{base}/cpulist: unreadable")
        mem_text = fs.read_optional(f"{base}/meminfo")
        mem = parse_meminfo(mem_text).get("MemTotal") if mem_text else None
        dist_text = fs.read_optional(f"{base}/distance") or ""
        dist = tuple(d for d in (uint_or_none(x, max_digits=5) for x in dist_text.split()) if d is not None)
        nodes.append(NumaNode(nid, cpus & cpus_online if cpus_online else cpus, mem, dist))
    if not nodes:
        # A kernel without NUMA support shows no node directory: the whole machine is one node.
        mem_text = fs.read_optional("/proc/meminfo")
        mem = parse_meminfo(mem_text).get("MemTotal") if mem_text else None
        warnings.append(f"{NODE_DIR}: no NUMA nodes listed; treating the machine as node 0")
        nodes.append(NumaNode(0, cpus_online, mem, (10,)))
    return tuple(nodes)


def _cpu_model_and_sockets(fs: "HostFS", cpus_online: frozenset[int]) -> tuple[str, int]:
    model = None
    packages: set[str] = set()
    text = fs.read_optional("/proc/cpuinfo", limit=TABLE_READ_CAP) or ""
    for line in text.splitlines():
        if ":" not in line:
            continue
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "physical id":
            packages.add(value.strip())
        elif model is None and key in ("model name", "Model", "cpu model"):
            model = value.strip() or None
    if not packages:
        for cpu in sorted(cpus_online):
            pid = fs.read_optional(f"{CPU_DIR}/cpu{cpu}/topology/physical_package_id")
            if pid is not None:
                packages.add(pid)
    if model is None and str(fs.root) == "/":
        model = _py_cpuinfo_model()
    return model or "unknown", max(1, len(packages))


def _py_cpuinfo_model() -> str | None:
    """py-cpuinfo on the live host only (it inspects this process's CPU, and is slow to import)."""
    try:
        import cpuinfo  # noqa: PLC0415

        info = cpuinfo.get_cpu_info()
    except Exception as exc:  # py-cpuinfo raises many kinds on odd platforms
        log.debug("py-cpuinfo failed: %s", exc)
        return None
    return info.get("brand_raw") or None


def _derive_node(local: frozenset[int], nodes: tuple[NumaNode, ...]) -> int | None:
    """The node whose CPU list equals or contains ``local``; None when none or several do."""
    if not local:
        return None
    hits = [n.id for n in nodes if n.cpus and local <= n.cpus]
    return hits[0] if len(hits) == 1 else None


def _read_device(fs: "HostFS", address: str, kind: str, nodes: tuple[NumaNode, ...],
                 cpus_online: frozenset[int]) -> PciDevice:
    base = f"{PCI_DIR}/{address}"
    vendor = (fs.read_optional(f"{base}/vendor") or "").lower()
    device = (fs.read_optional(f"{base}/device") or "").lower()
    pci_class = (fs.read_optional(f"{base}/class") or "").lower()
    local = _cpulist(fs.read_optional(f"{base}/local_cpulist"))
    if local is None:
        mask = fs.read_optional(f"{base}/local_cpus")
        try:
            local = parse_cpumask(mask) if mask else frozenset()
        except ParseError:
            local = frozenset()
    if cpus_online:
        local = local & cpus_online
    node_ids = {n.id for n in nodes}
    raw_node = parse_int(fs.read_optional(f"{base}/numa_node"), -1)
    source: NumaSource
    if raw_node is not None and raw_node >= 0 and raw_node in node_ids:
        numa, source = raw_node, "firmware"
    else:
        numa = _derive_node(local, nodes)
        source = "local_cpulist" if numa is not None else "unknown"
    irqs = tuple(sorted(i for i in (uint_or_none(n, max_digits=10) for n in fs.listdir(f"{base}/msi_irqs"))
                        if i is not None))
    dev_max = parse_link_speed(fs.read_optional(f"{base}/max_link_speed"))
    return PciDevice(
        address=address, kind=kind, vendor=vendor, device=device, pci_class=pci_class,  # type: ignore[arg-type]
        numa_node=numa, numa_source=source, local_cpus=local,
        link_gen_current=parse_link_speed(fs.read_optional(f"{base}/current_link_speed")),
        link_gen_max=_link_gen_max(fs, base, dev_max),
        link_gen_device_max=dev_max,
        link_width_current=parse_link_width(fs.read_optional(f"{base}/current_link_width")),
        link_width_max=parse_link_width(fs.read_optional(f"{base}/max_link_width")),
        irqs=irqs,
    )


_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def _link_gen_max(fs: "HostFS", base: str, dev_max: int | None) -> int | None:
    """The top generation of the device's link: the lower of what the device and the port above it
    can do (sysfs ``max_link_speed`` of each). The device's own figure alone would hold a Gen5 GPU
    in a Gen4 slot to Gen5, a speed its link can never reach. Where the port is not a PCI function
    (a root bus) or says nothing, the device's figure stands."""
    if dev_max is None:
        return None
    try:
        parent = fs.realpath(base).rsplit("/", 1)[0]
    except (HostError, OSError):
        return dev_max
    if not _BDF.match(parent.rsplit("/", 1)[-1].lower()):
        return dev_max
    port = parse_link_speed(fs.read_optional(f"{parent}/max_link_speed"))
    return dev_max if port is None else min(dev_max, port)


@dataclass
class _NicFunction:
    names: list[str] = field(default_factory=list)
    rdma: bool = False
    virtio: str | None = None


def pci_function_of(fs: "HostFS", link: str) -> tuple[str | None, str | None]:
    """(PCI address, virtio device) behind a class device's ``device`` link.

    A physical NIC's link is the PCI function itself (``.../0000:17:00.0``); a virtio-net
    interface's is the virtio device one level below it (``.../0000:00:03.0/virtio2``). Anything
    else (USB, virtio-mmio, platform devices) has no PCI function: (None, virtio or None).
    """
    parts = fs.realpath(link).rstrip("/").split("/")
    last = parts[-1]
    if PCI_ADDRESS_RE.match(last) and fs.exists(f"{PCI_DIR}/{last}"):
        return last, None
    if VIRTIO_RE.match(last):
        parent = parts[-2] if len(parts) > 1 else ""
        if PCI_ADDRESS_RE.match(parent) and fs.exists(f"{PCI_DIR}/{parent}"):
            return parent, last
        return None, last
    return None, None


def _nic_addresses(fs: "HostFS", warnings: list[str]) -> dict[str, _NicFunction]:
    """PCI address -> interface names, RDMA, virtio device; from /sys/class/{net,infiniband}."""
    out: dict[str, _NicFunction] = {}
    for cls_dir, rdma in ((NET_DIR, False), (IB_DIR, True)):
        for name in fs.listdir(cls_dir):
            link = f"{cls_dir}/{name}/device"
            if not fs.exists(link):
                continue  # virtual interfaces (lo, bonds, veth) have no device
            address, virtio = pci_function_of(fs, link)
            if address is None:
                if virtio is not None:
                    warnings.append(f"NIC {name}: {virtio} is not behind a PCI function (virtio-mmio): "
                                    "its NUMA node and IRQs are unknown; not listed")
                continue  # not a PCI function (e.g. a USB or platform device)
            fn = out.setdefault(address, _NicFunction())
            fn.names.append(name)
            fn.rdma = fn.rdma or rdma
            fn.virtio = fn.virtio or virtio
    return out


def _gpu_infos(gpus: Any) -> tuple[list["GpuInfo"], Any]:
    """Accept a GpuBackend, a list of GpuInfo, or None; return (infos, backend or None)."""
    if gpus is None:
        return [], None
    if hasattr(gpus, "gpus") and callable(gpus.gpus):
        return list(gpus.gpus()), gpus
    return list(gpus), None


class _Noting:
    """The host as discovery reads it: a file refused for what it is or its size (a FIFO, a
    device, a 2 GB file where a one-line file should be) is left unknown, as a missing one is,
    and named in the warnings."""

    def __init__(self, fs: "HostFS", warnings: list[str]) -> None:
        self._fs = fs
        self._warnings = warnings

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    def read_optional(self, host_path: str, **kw: Any) -> str | None:
        try:
            return self._fs.read_optional(host_path, **kw)
        except NotAFile as exc:
            self._warnings.append(str(exc))
            return None


# -- discover -----------------------------------------------------------------------------------
def discover(fs: "HostFS", gpus: "GpuBackend | Iterable[GpuInfo] | None" = None) -> Topology:
    """Read the topology of the host under ``fs.root``. Never raises for a missing file: what
    cannot be read is left unknown and named in ``warnings``."""
    warnings: list[str] = []
    fs = _Noting(fs, warnings)  # type: ignore[assignment]
    cpus_online = _online_cpus(fs, warnings)
    nodes = _numa_nodes(fs, cpus_online, warnings)
    model, sockets = _cpu_model_and_sockets(fs, cpus_online)

    nic_map = _nic_addresses(fs, warnings)
    gpu_devs: list[PciDevice] = []
    nic_devs: list[PciDevice] = []
    try:
        addresses = fs.listdir(PCI_DIR)
    except HostError as exc:
        warnings.append(str(exc))
        addresses = []
    for address in addresses:
        base = f"{PCI_DIR}/{address}"
        if address in nic_map:
            fn = nic_map[address]
            dev = _read_device(fs, address, "nic", nodes, cpus_online)
            nic_devs.append(_with(dev, names=tuple(fn.names), rdma=fn.rdma, virtio=fn.virtio))
            continue
        vendor = (fs.read_optional(f"{base}/vendor") or "").lower()
        if vendor != NVIDIA_VENDOR:
            continue
        cls = (fs.read_optional(f"{base}/class") or "").lower()
        if not cls.startswith(GPU_CLASS_PREFIXES):
            continue  # NVSwitch bridges, audio functions, ...
        gpu_devs.append(_read_device(fs, address, "gpu", nodes, cpus_online))

    if any(n.virtio for n in nic_devs):
        nic_devs = _with_virtio_irqs(fs, nic_devs, warnings)

    # Match the backend's GPUs by PCI bus id.
    infos, backend = _gpu_infos(gpus)
    by_addr = {d.address: d for d in gpu_devs}
    matched: dict[str, PciDevice] = {}
    for info in infos:
        if not info.pci_bus_id:  # e.g. a lost GPU that could not even say where it sits
            warnings.append(f"GPU {info.index}: not placed in the topology: {info.error or 'no PCI bus id'}")
            continue
        addr = normalize_bus_id(info.pci_bus_id)
        dev = by_addr.get(addr)
        if dev is None:
            warnings.append(f"GPU {info.index} ({addr}) is reported by the GPU backend but not found "
                            f"under {PCI_DIR}; its NUMA node is unknown")
            dev = PciDevice(addr, "gpu", NVIDIA_VENDOR, "", "", None, "unknown", frozenset(),
                            info.pcie_link_gen_current, info.pcie_link_gen_max,
                            info.pcie_link_width_current, info.pcie_link_width_max, (), on_pci_bus=False)
        matched[addr] = _with(dev, gpu_index=info.index, gpu_name=info.name, gpu_uuid=info.uuid,
                              mig_mode=getattr(info, "mig_mode", None),
                              mig_mode_pending=getattr(info, "mig_mode_pending", None))
    for d in gpu_devs:
        matched.setdefault(d.address, d)
    final_gpus = sorted(matched.values(),
                        key=lambda d: (d.gpu_index is None, d.gpu_index if d.gpu_index is not None else 0, d.address))

    for g in final_gpus:
        if g.numa_source == "unknown" and g.address in by_addr:
            warnings.append(f"{g.label}: NUMA node unknown (numa_node is -1 and local_cpulist "
                            f"{format_cpulist(g.local_cpus) or 'empty'} is not within one node)")
        elif g.numa_source == "local_cpulist":
            warnings.append(f"{g.label}: numa_node is -1; node {g.numa_node} derived from local_cpulist")
        if g.link_degraded:
            warnings.append(f"{g.label}: PCIe link runs at gen{g.link_gen_current} x{g.link_width_current}, "
                            f"capable of gen{g.link_gen_max} x{g.link_width_max}")
        elif g.link_gen_below_max:
            warnings.append(f"{g.label}: PCIe link at gen{g.link_gen_current} of gen{g.link_gen_max} "
                            "(normal while idle: GPUs lower the link speed to save power; readiness "
                            "judges the generation under load)")
        if backend is not None and g.gpu_index is not None:
            warnings.extend(_cross_check(backend, g, nodes))
    for n in nic_devs:
        if n.numa_source == "unknown":
            warnings.append(f"{n.label}: NUMA node unknown (numa_node is -1 and local_cpulist is not within one node)")
        if n.link_degraded or n.link_gen_below_max:
            warnings.append(f"{n.label}: PCIe link runs at gen{n.link_gen_current} x{n.link_width_current}, "
                            f"capable of gen{n.link_gen_max} x{n.link_width_max}")

    local_nics: dict[str, tuple[str, ...]] = {}
    for g in final_gpus:
        if g.numa_node is None:
            local_nics[g.address] = ()
            continue
        local_nics[g.address] = tuple(nic_name(n) for n in nic_devs if n.numa_node == g.numa_node)

    driver, cuda = _driver_versions(backend, warnings)
    from gpu_tune.gpu.cuda import probe_framework_build

    return Topology(
        numa_nodes=nodes, cpus_online=cpus_online, sockets=sockets, cpu_model=model,
        gpus=tuple(final_gpus), nics=tuple(nic_devs), gpu_local_nics=local_nics, warnings=tuple(warnings),
        driver_version=driver, cuda_driver_version=cuda, probe_runtime=probe_framework_build().as_dict(),
    )


def _driver_versions(backend: Any, warnings: list[str]) -> tuple[str | None, str | None]:
    if backend is None:
        return None, None
    out = []
    for what in ("driver_version", "cuda_driver_version"):
        try:
            out.append(getattr(backend, what)())
        except Exception as exc:  # a backend error is a warning here, never a failed discovery
            warnings.append(f"GPU backend: {what} unavailable: {exc}")
            out.append(None)
    return out[0], out[1]


def _with_virtio_irqs(fs: "HostFS", nics: list[PciDevice], warnings: list[str]) -> list[PciDevice]:
    """Add the IRQs ``/proc/interrupts`` names after each virtio NIC's virtio device (read only
    when there is one: on a big node the file is megabytes). Read line by line, keeping only the
    lines that name one of those devices: memory for what is kept, not for what is read."""
    devices = sorted({n.virtio for n in nics if n.virtio})

    def keep(number: int, line: str) -> bool:
        return number == 0 or any(d in line for d in devices)  # the header, and the devices' lines

    try:
        kept = fs.read_lines("/proc/interrupts", keep, limit=TABLE_READ_CAP)
    except NotAFile as exc:
        warnings.append(str(exc))
        kept = None
    except HostError:
        kept = None
    if kept is None:
        warnings.append("/proc/interrupts: unreadable; virtio NICs list only their msi_irqs")
        return nics
    lines = parse_interrupts(kept)
    out = []
    for n in nics:
        if n.virtio:
            n = _with(n, irqs=tuple(sorted(set(n.irqs) | set(irqs_named(lines, n.virtio)))))
        out.append(n)
    return out


def _cross_check(backend: Any, g: PciDevice, nodes: tuple[NumaNode, ...]) -> list[str]:
    try:
        aff = backend.cpu_affinity(g.gpu_index)
    except Exception as exc:  # a backend error is a warning here, never a failed discovery
        return [f"{g.label}: CPU affinity from the GPU backend unavailable: {exc}"]
    if not aff:
        return []
    if g.numa_node is None:
        hint = _derive_node(frozenset(aff), nodes)
        where = f" (within node {hint})" if hint is not None else ""
        return [f"{g.label}: NUMA node unknown in sysfs; the GPU backend gives CPU affinity "
                f"{format_cpulist(aff)}{where}"]
    node_cpus = next((n.cpus for n in nodes if n.id == g.numa_node), frozenset())
    expected = g.local_cpus or node_cpus
    if frozenset(aff) != expected:
        return [f"{g.label}: CPU affinity from the GPU backend ({format_cpulist(aff)}) differs from sysfs "
                f"(node {g.numa_node}, local CPUs {format_cpulist(expected)})"]
    return []


def _with(dev: PciDevice, **kw: Any) -> PciDevice:
    from dataclasses import replace

    return replace(dev, **kw)
