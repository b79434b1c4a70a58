"""This node's GPUs as NVIDIA's DRA driver for GPUs publishes them: ``ResourceSlice`` objects of
``resource.k8s.io/v1``.

Under Dynamic Resource Allocation (GA in Kubernetes 1.34) a node has no ``nvidia.com/gpu``
capacity: NVIDIA's driver (``gpu.nvidia.com``, github.com/NVIDIA/k8s-dra-driver-gpu) publishes
its devices in ResourceSlices with ``spec.nodeName`` set to the node, in one pool named after
the node: one slice for all of them, or (partitionable devices) one slice per GPU, plus, from
Kubernetes 1.35, a slice holding only the shared counters. A device's ``type`` attribute
says what it is: ``gpu`` (a whole GPU, named ``gpu-<minor>``), ``mig`` (a MIG device) or ``vfio``
(a GPU handed to a VM). A GPU in MIG mode is offered as MIG devices only, as the device plugin's
``mixed`` strategy leaves it out of ``nvidia.com/gpu``.

:func:`count_gpus` (pure) counts the whole GPUs of the newest generation of each pool (a driver
that republishes bumps the pool's generation; slices of older ones are being replaced and do
not count), each device once. :func:`list_node_slices` lists this node's slices of the driver
with a field selector (``spec.nodeName`` and ``spec.driver``: the server filters them), paged and
bounded, through a ``fetch`` callable (the publisher's client, with its retries): one request
per pass for any node NVIDIA's driver serves. It asks with ``resourceVersion=0``: the API
server answers from its watch cache (as fresh as its watch of etcd, milliseconds behind), never
with a range read of every slice in etcd filtered afterwards, which is what a consistent list
costs where the server cannot serve one from its cache (etcd older than 3.5.13), and what 5,000
agents each minute would make of a 45,000-slice fleet. The watch cache answers such a list whole,
whatever its ``limit`` (kube-apiserver 1.36 does; ``tests/test_dra.py``), so the answer is
bounded by what the driver publishes for this one node (a slice holds at most 128 devices; the
driver writes one to nine slices for eight GPUs); a server that pages it anyway is followed by
its continue tokens. Past :data:`PAGE_SIZE` × :data:`MAX_PAGES` slices the rest is left out and
the count says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable


DRIVER = "gpu.nvidia.com"
GROUP = "resource.k8s.io"
SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"
PAGE_SIZE = 64  # slices per page: the driver writes one per GPU (+1 for shared counters)
MAX_PAGES = 4  # at most 256 slices for one node are read; past that the count says it stopped
GPU_TYPE = "gpu"
UNSCHEDULABLE = ("NoSchedule", "NoExecute")  # device taints that keep new claims off a device


@dataclass(frozen=True)
class DraCount:
    """What the driver's ResourceSlices say of this node. ``gpus``: whole GPUs (devices of type
    ``gpu``) in the newest generation of each pool; ``devices``: every device by type;
    ``tainted``: GPUs carrying a NoSchedule/NoExecute device taint (the driver's health events);
    ``incomplete``: pools with fewer slices than their ``resourceSliceCount`` (being republished);
    ``stale``: slices of an older generation, left out; ``truncated``: more slices than were read."""

    slices: int = 0
    gpus: int = 0
    devices: dict[str, int] = field(default_factory=dict)
    pools: tuple[str, ...] = ()
    tainted: tuple[str, ...] = ()
    incomplete: tuple[str, ...] = ()
    stale: int = 0
    truncated: bool = False

    def source(self) -> str:
        """``ResourceSlices of gpu.nvidia.com: pool gpu-1 generation 3, 8 slices``."""
        pools = ", ".join(self.pools) or "none"
        return f"{self.slices} ResourceSlice(s) of {DRIVER} (pool {pools})"

    def notes(self) -> list[str]:
        out = []
        others = {k: v for k, v in sorted(self.devices.items()) if k != GPU_TYPE}
        if others:
            out.append("also " + ", ".join(f"{n} {k} device(s)" for k, n in others.items()))
        if self.tainted:
            shown = ", ".join(self.tainted[:8]) + (f" and {len(self.tainted) - 8} more" if len(self.tainted) > 8 else "")
            out.append(f"{len(self.tainted)} GPU(s) tainted by the driver: {shown}")
        if self.incomplete:
            out.append("pool being republished: " + ", ".join(self.incomplete))
        if self.stale:
            out.append(f"{self.stale} slice(s) of an older pool generation left out")
        if self.truncated:
            out.append(f"more than {PAGE_SIZE * MAX_PAGES} slices: the rest not read")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"driver": DRIVER, "slices": self.slices, "gpus": self.gpus, "devices": dict(sorted(self.devices.items())),
                "pools": list(self.pools), "tainted": list(self.tainted), "incomplete": list(self.incomplete),
                "stale": self.stale, "truncated": self.truncated}


def _int(v: Any, default: int = 0) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def device_type(device: dict[str, Any], driver: str = DRIVER) -> str | None:
    """The device's ``type`` attribute (``gpu``, ``mig``, ``vfio``): written bare or qualified
    with the driver's domain (``gpu.nvidia.com/type``)."""
    attrs = device.get("attributes")
    if not isinstance(attrs, dict):
        return None
    a = attrs.get("type", attrs.get(f"{driver}/type"))
    value = a.get("string") if isinstance(a, dict) else None
    return value if isinstance(value, str) else None


def count_gpus(slices: Iterable[Any], node: str, *, driver: str = DRIVER, truncated: bool = False) -> DraCount:
    """The whole GPUs ``driver`` publishes for ``node`` (see the module docstring)."""
    pools: dict[str, list[dict[str, Any]]] = {}
    for s in slices:
        spec = s.get("spec") if isinstance(s, dict) else None
        if not isinstance(spec, dict) or spec.get("nodeName") != node or spec.get("driver") != driver:
            continue
        pool = spec.get("pool") if isinstance(spec.get("pool"), dict) else {}
        pools.setdefault(str(pool.get("name") or ""), []).append(spec)
    devices: dict[str, int] = {}
    tainted: list[str] = []
    names, incomplete = [], []
    counted = stale = 0
    for name, specs in sorted(pools.items()):
        newest = max(_int((sp.get("pool") or {}).get("generation")) for sp in specs)
        current = [sp for sp in specs if _int((sp.get("pool") or {}).get("generation")) == newest]
        stale += len(specs) - len(current)
        counted += len(current)
        want = max(_int((sp.get("pool") or {}).get("resourceSliceCount"), 1) for sp in current)
        names.append(f"{name} generation {newest}")
        if len(current) < want:
            incomplete.append(f"{name}: {len(current)} of {want} slices")
        seen: set[str] = set()
        for sp in current:
            for dev in sp.get("devices") or []:
                if not isinstance(dev, dict) or not isinstance(dev.get("name"), str) or dev["name"] in seen:
                    continue
                seen.add(dev["name"])
                kind = device_type(dev, driver) or "untyped"
                devices[kind] = devices.get(kind, 0) + 1
                taints = [t for t in dev.get("taints") or [] if isinstance(t, dict) and t.get("effect") in UNSCHEDULABLE]
                if kind == GPU_TYPE and taints:
                    tainted.append(f"{dev['name']} ({taints[0].get('key')})")
    return DraCount(slices=counted, gpus=devices.get(GPU_TYPE, 0), devices=devices, pools=tuple(names),
                    tainted=tuple(tainted), incomplete=tuple(incomplete), stale=stale, truncated=truncated)


def slice_query(node: str, *, token: str | None = None, page_size: int = PAGE_SIZE,
                driver: str = DRIVER) -> list[tuple[str, Any]]:
    """The query of one page: the first from the watch cache (``resourceVersion=0``), the next
    ones by their continue token."""
    query: list[tuple[str, Any]] = [("fieldSelector", f"spec.nodeName={node},spec.driver={driver}"),
                                    ("limit", page_size)]
    query.append(("continue", token) if token else ("resourceVersion", "0"))
    return query


def list_node_slices(fetch: Callable[[list[tuple[str, Any]]], dict[str, Any]], node: str, *,
                     page_size: int = PAGE_SIZE, max_pages: int = MAX_PAGES) -> tuple[list[dict[str, Any]], bool]:
    """(``node``'s slices of the driver, at most ``page_size`` × ``max_pages``; whether more were
    left out). ``fetch(query)`` answers one page (JSON); what it raises is the caller's."""
    most = max(1, page_size) * max(1, max_pages)
    items: list[dict[str, Any]] = []
    token: str | None = None
    for _ in range(max(1, max_pages)):
        doc = fetch(slice_query(node, token=token, page_size=page_size))
        items.extend(i for i in doc.get("items") or [] if isinstance(i, dict))
        token = (doc.get("metadata") or {}).get("continue") or None
        if not token or len(items) >= most:
            break
    return items[:most], bool(token) or len(items) > most
