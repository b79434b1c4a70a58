"""``gpu.gpudirect_rdma`` and ``gpu.gds`` (target ``host``): the kernel modules GPUDirect needs.

- GPUDirect RDMA lets an RDMA NIC (InfiniBand, RoCE: ``/sys/class/infiniband``) read and write
  GPU memory without a copy through host memory. The NVIDIA driver's ``nvidia_peermem`` module
  (``nv_peer_mem`` before driver 465) must be loaded for it. Checked with
  ``gpu.gpudirect_rdma: true`` when an RDMA NIC shares a NUMA node with a GPU (``unsupported``
  otherwise: no RDMA NIC, no GPU, or none on the same node).
- GPUDirect Storage (``gpu.gds: true``) needs ``nvidia_fs`` (the nvidia-gds package).

A module is loaded when ``/sys/module/<name>`` exists and, for a loadable module, its
``initstate`` reads ``live``. Read-only: loading a kernel module from a node agent would fight
the GPU Operator (or the host's module configuration), which owns it; the row names the remedy.
"""

from __future__ import annotations

from gpu_tune.tune.model import Setting
from gpu_tune.tune.knobs.base import Context, Knob

PEERMEM = ("nvidia_peermem", "nv_peer_mem")
GDS = ("nvidia_fs",)

RDMA_REMEDY = ("modprobe nvidia_peermem (and list it in /etc/modules-load.d/ to keep it across reboots); "
               "with the GPU Operator: --set driver.rdma.enabled=true. With DMA-BUF (open kernel modules, "
               "kernel 5.12+) the module is not needed: set gpu.gpudirect_rdma: false")
GDS_REMEDY = ("install nvidia-gds and modprobe nvidia_fs; with the GPU Operator: --set gds.enabled=true")


def module_state(ctx: Context, name: str) -> str | None:
    """``live`` (loaded), ``coming``/``going`` (being loaded/unloaded), ``builtin`` (no
    initstate: compiled in), or None when the module is not there."""
    base = f"/sys/module/{name}"
    if not ctx.fs.is_dir(base):
        return None
    state = ctx.fs.read_optional(f"{base}/initstate")
    return "builtin" if state is None else state


def _loaded(ctx: Context, names: tuple[str, ...]) -> tuple[str | None, str | None]:
    """(name, state) of the first of ``names`` present, else (None, None)."""
    for name in names:
        state = module_state(ctx, name)
        if state is not None:
            return name, state
    return None, None


def _module_row(sid: str, ctx: Context, names: tuple[str, ...], why: str, remedy: str) -> Setting:
    name, state = _loaded(ctx, names)
    path = f"/sys/module/{names[0]}"
    if name is not None and state in ("live", "builtin"):
        return Setting(sid, "host", "loaded", "loaded", "ok", f"{name} {state}; {why}", path)
    current = "not loaded" if name is None else f"{name} {state}"
    return Setting(sid, "host", current, "loaded", "drift", f"{why}: {remedy}", path)


class GpuDirectKnob(Knob):
    family = "gpudirect"
    error_id = "gpu.gpudirect_rdma"
    ids = ("gpu.gpudirect_rdma", "gpu.gds")
    writable = False
    files = tuple(f"/sys/module/{m}/initstate" for m in (*PEERMEM, *GDS)) + (
        "/sys/class/infiniband/*/device", "/sys/bus/pci/devices/*/numa_node")

    def wanted(self, profile) -> bool:
        return bool(profile.gpu.gpudirect_rdma or profile.gpu.gds)

    def read(self, ctx: Context) -> list[Setting]:
        rows = []
        topo = ctx.topology()
        if ctx.profile.gpu.gpudirect_rdma:
            rows.append(self._rdma(ctx, topo))
        if ctx.profile.gpu.gds:
            if not topo.gpus:
                rows.append(Setting("gpu.gds", "host", None, "loaded", "unsupported", "no NVIDIA GPU"))
            else:
                rows.append(_module_row("gpu.gds", ctx, GDS, "GPUDirect Storage asked for by the profile",
                                        GDS_REMEDY))
        return rows

    def _rdma(self, ctx: Context, topo) -> Setting:
        sid = "gpu.gpudirect_rdma"
        rdma = [n for n in topo.nics if n.rdma]
        if not topo.gpus:
            return Setting(sid, "host", None, "loaded", "unsupported", "no NVIDIA GPU")
        if not rdma:
            return Setting(sid, "host", None, "loaded", "unsupported",
                           "no RDMA NIC (/sys/class/infiniband lists none)")
        pairs = []
        for g in topo.gpus:
            for n in rdma:
                if g.numa_node is not None and g.numa_node == n.numa_node:
                    pairs.append((g, n))
        if not pairs:
            gn = sorted({g.numa_node for g in topo.gpus if g.numa_node is not None})
            nn = sorted({n.numa_node for n in rdma if n.numa_node is not None})
            return Setting(sid, "host", None, "loaded", "unsupported",
                           f"no RDMA NIC shares a NUMA node with a GPU (GPUs on nodes {gn or 'unknown'}, "
                           f"RDMA NICs on nodes {nn or 'unknown'})")
        nodes = sorted({g.numa_node for g, _ in pairs})
        gpus = sorted({g.gpu_index if g.gpu_index is not None else g.address for g, _ in pairs}, key=str)
        nics = sorted({n.names[-1] if n.names else n.address for _, n in pairs})
        why = (f"GPU {','.join(map(str, gpus))} and RDMA NIC {', '.join(nics)} share NUMA node"
               f"{'s' if len(nodes) > 1 else ''} {','.join(map(str, nodes))}")
        return _module_row(sid, ctx, PEERMEM, why, RDMA_REMEDY)
