"""The node's topology as data: NUMA nodes, PCI devices (GPUs, NICs) and who is local to whom.

Frozen dataclasses, built by :func:`gpu_tune.discover.topology.discover`; ``Topology.as_dict()`` is
the document of ``gpu-tune topology -o json`` and ``GET /topology``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from gpu_tune.host.parse import format_cpulist

NumaSource = Literal["firmware", "local_cpulist", "unknown"]


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: frozenset[int]
    memory_total_kib: int | None
    distances: tuple[int, ...]


@dataclass(frozen=True)
class PciDevice:
    address: str
    kind: Literal["gpu", "nic"]
    vendor: str
    device: str
    pci_class: str
    numa_node: int | None
    numa_source: NumaSource
    local_cpus: frozenset[int]
    link_gen_current: int | None
    link_gen_max: int | None
    link_width_current: int | None
    link_width_max: int | None
    irqs: tuple[int, ...]
    names: tuple[str, ...] = ()
    gpu_index: int | None = None
    gpu_name: str | None = None
    gpu_uuid: str | None = None
    rdma: bool = False  # a NIC with an RDMA (infiniband) device
    mig_mode: bool | None = None  # a GPU's MIG mode (None: no MIG, or not known)
    mig_mode_pending: bool | None = None
    virtio: str | None = None  # a virtio-net NIC: its virtio device under the PCI function
    on_pci_bus: bool = True  # False: a GPU the backend reports that sysfs does not list
    # the device's own top generation (its max_link_speed); ``link_gen_max`` is the link's: the
    # lower of the device's and its upstream port's (a Gen5 GPU in a Gen4 slot: 4)
    link_gen_device_max: int | None = None

    @property
    def link_degraded(self) -> bool:
        """The link trained narrower than both ends can do (x8 of x16): a fault at any load.

        A lower *generation* alone is not a fault here: GPUs and NICs drop the link speed when
        idle to save power (see :attr:`link_gen_below_max`); readiness judges it under load.
        """
        return (self.link_width_current is not None and self.link_width_max is not None
                and self.link_width_current < self.link_width_max)

    @property
    def link_gen_below_max(self) -> bool:
        return (self.link_gen_current is not None and self.link_gen_max is not None
                and self.link_gen_current < self.link_gen_max)

    @property
    def label(self) -> str:
        if self.kind == "gpu":
            return f"GPU {self.gpu_index} ({self.address})" if self.gpu_index is not None else f"GPU {self.address}"
        return f"NIC {self.names[0] if self.names else ''} ({self.address})".replace(" ()", "")

    def pcie_dict(self) -> dict[str, Any]:
        return {"gen_current": self.link_gen_current, "gen_max": self.link_gen_max,
                "gen_device_max": self.link_gen_device_max, "width_current": self.link_width_current, "width_max": self.link_width_max,
                "degraded": self.link_degraded, "gen_below_max": self.link_gen_below_max}


@dataclass(frozen=True)
class Topology:
    numa_nodes: tuple[NumaNode, ...]
    cpus_online: frozenset[int]
    sockets: int
    cpu_model: str
    gpus: tuple[PciDevice, ...]
    nics: tuple[PciDevice, ...]
    gpu_local_nics: dict[str, tuple[str, ...]] = field(default_factory=dict)  # GPU address -> NIC names
    warnings: tuple[str, ...] = ()
    driver_version: str | None = None
    cuda_driver_version: str | None = None  # the newest CUDA the driver supports ("12.8")
    probe_runtime: dict[str, Any] | None = None  # gpu_tune.gpu.cuda.FrameworkBuild.as_dict()

    def gpu(self, index: int) -> PciDevice | None:
        for g in self.gpus:
            if g.gpu_index == index:
                return g
        return None

    def node(self, id: int) -> NumaNode | None:  # noqa: A002 - the kernel's word
        for n in self.numa_nodes:
            if n.id == id:
                return n
        return None

    def node_cpus(self, id: int) -> frozenset[int]:
        n = self.node(id)
        return n.cpus if n is not None else frozenset()

    def as_dict(self) -> dict[str, Any]:
        """The JSON document of ``gpu-tune topology -o json`` and ``GET /topology``."""
        nodes = []
        for n in self.numa_nodes:
            nodes.append({
                "id": n.id, "cpus": format_cpulist(n.cpus), "cpu_count": len(n.cpus),
                "memory_total_kib": n.memory_total_kib, "distances": list(n.distances),
                "gpus": [g.gpu_index if g.gpu_index is not None else g.address
                         for g in self.gpus if g.numa_node == n.id],
                "nics": [nic_name(d) for d in self.nics if d.numa_node == n.id],
            })
        gpus = []
        for g in self.gpus:
            gpus.append({
                "index": g.gpu_index, "uuid": g.gpu_uuid, "name": g.gpu_name, "pci_bus_id": g.address,
                "vendor": g.vendor, "device": g.device,
                "numa_node": g.numa_node, "numa_source": g.numa_source,
                "local_cpus": format_cpulist(g.local_cpus), "pcie": g.pcie_dict(),
                "irq_count": len(g.irqs), "irqs": format_cpulist(g.irqs),
                "local_nics": list(self.gpu_local_nics.get(g.address, ())),
                "mig_mode": g.mig_mode, "mig_mode_pending": g.mig_mode_pending,
                "on_pci_bus": g.on_pci_bus,
            })
        nics = []
        for d in self.nics:
            nics.append({
                "name": nic_name(d), "names": list(d.names), "pci_bus_id": d.address,
                "kind": "rdma" if d.rdma else "net", "vendor": d.vendor, "device": d.device,
                "virtio": d.virtio, "numa_node": d.numa_node, "numa_source": d.numa_source,
                "local_cpus": format_cpulist(d.local_cpus), "pcie": d.pcie_dict(), "irq_count": len(d.irqs),
                "irqs": format_cpulist(d.irqs),
            })
        return {
            "numa_nodes": nodes, "cpus_online": format_cpulist(self.cpus_online),
            "cpu_count": len(self.cpus_online), "sockets": self.sockets, "cpu_model": self.cpu_model,
            "gpus": gpus, "nics": nics, "warnings": list(self.warnings),
            "driver_version": self.driver_version, "cuda_driver_version": self.cuda_driver_version,
            "probe_runtime": self.probe_runtime,
        }


def nic_name(d: PciDevice) -> str:
    return d.names[0] if d.names else d.address


# -- reading pieces -------------------------------------------------------------------------------
