"""What the Node and Kubernetes say: the device plugin's GPU count and the agent's publishing.

- ``gpu.allocatable`` (category device_plugin): the Node's ``status.capacity["nvidia.com/gpu"]``
  (read by the publisher) is at least the GPUs the host has, MIG-enabled ones left out as the
  device plugin's ``mixed`` strategy does. A Node without that capacity whose GPUs NVIDIA's DRA
  driver publishes (``gpu.nvidia.com`` ResourceSlices naming the node,
  :mod:`gpu_tune.cluster.dra`) is judged the same way on the whole GPUs there. Listed when the
  node has GPUs and the Node was read; without Kubernetes, or with neither publisher, ok with
  the reason, unless ``readiness.require_device_plugin`` (which either publisher satisfies).
- ``topology.published``: topology discovered and the node labels/condition written (or
  Kubernetes publishing switched off).
- ``fleet.limit`` (warning): the blast-radius limit (``readiness.max_out_of_service``) kept this
  not-ready node in service: "limit reached: N of M nodes out of service by gpu-tune (limit L)".
"""

from __future__ import annotations

from typing import Any

from gpu_tune.judge.checks.base import WARNING, Check, Facts, Family

DRA_DRIVER = "gpu.nvidia.com"  # NVIDIA's DRA driver for GPUs (gpu_tune/cluster/dra.py counts its devices)


class DevicePlugin(Family):
    name = "device_plugin"
    category = "device_plugin"
    source = "the Node (status.capacity / allocatable nvidia.com/gpu), else NVIDIA's DRA driver's ResourceSlices"
    reads = ("the device plugin's nvidia.com/gpu capacity and allocatable (or the whole GPUs in the gpu.nvidia.com "
             "ResourceSlices naming the node) against the GPUs NVML lists")
    thresholds = "capacity >= GPUs not in MIG mode"
    remedy = "restart the device plugin (or DRA driver kubelet plugin) pod on the node, then check its log and nvidia-smi"
    checks = ("gpu.allocatable",)

    def evaluate(self, facts: Facts) -> list[Check]:
        if facts.errors.get("gpus"):
            return []
        required = bool(getattr(facts.readiness, "require_device_plugin", False))
        c = self.allocatable(list(facts.gpus), facts.node_facts, required=required)
        return [c] if c is not None else []

    def allocatable(self, gpus: list[Any], publish: Any, *, required: bool = False) -> Check | None:
        name = "gpu.allocatable"
        if not gpus or publish is None or getattr(publish, "node_read", None) is None:
            return None  # no GPUs, or nothing published (read) yet
        mig = sorted(g.index for g in gpus if g.mig_mode is True)
        expected = len(gpus) - len(mig)
        host = f"{len(gpus)} GPU(s) on the host" + (
            f", {len(mig)} of them in MIG mode (GPU {', '.join(map(str, mig))})" if mig else "")
        if not getattr(publish, "node_read", False):
            why = str(getattr(publish, "detail", "") or "")
            if why.startswith("kubernetes publishing off"):
                return self.check(name, True, f"not checked: {why}")
            return self.check(name, True, "not checked: the Node could not be read (see topology.published)")
        cap = getattr(publish, "gpu_capacity", None)
        alloc = getattr(publish, "gpu_allocatable", None)
        dra = getattr(publish, "dra", None)
        if cap is None and dra is not None and dra.slices:
            return self.dra(dra, expected, host)
        if cap is None:
            dra_error = getattr(publish, "dra_error", None)
            detail = f"the Node has no nvidia.com/gpu capacity: no NVIDIA device plugin runs on it ({host})"
            if dra_error:
                detail += f" and its ResourceSlices of {DRA_DRIVER} could not be listed: {dra_error}"
            elif dra is not None:
                detail += f", nor NVIDIA's DRA driver (no ResourceSlice of {DRA_DRIVER} names the node)"
            if required:
                return self.check(name, False, detail + ": deploy the device plugin (the GPU Operator) or NVIDIA's "
                                                        "DRA driver, readiness.require_device_plugin is true")
            return self.check(name, True, detail + "; not required (readiness.require_device_plugin is false)")
        notes = []
        if isinstance(alloc, int) and alloc < cap:
            notes.append(f"allocatable {alloc}: the device plugin marks {cap - alloc} unhealthy")
        if cap < expected:
            figures = f"{cap} of {expected} GPUs offered by the device plugin (nvidia.com/gpu {cap}; {host})"
            return self.check(name, False, f"{figures}: restart the device plugin pod on this node, then check its "
                              "log and nvidia-smi" + "".join(f"; {n}" for n in notes),
                              figures + "".join(f"; {n}" for n in notes))
        if cap > expected:
            notes.append("more than the GPUs: time-slicing replicas or MIG devices counted as nvidia.com/gpu")
        return self.check(name, True, f"nvidia.com/gpu {cap} for {expected} GPU(s) ({host})"
                          + "".join(f"; {n}" for n in notes))

    def dra(self, dra: Any, expected: int, host: str) -> Check:
        """The device plugin's rule on the whole GPUs NVIDIA's DRA driver publishes for the node."""
        name = "gpu.allocatable"
        notes = "".join(f"; {n}" for n in dra.notes())
        if dra.gpus < expected:
            figures = f"{dra.gpus} of {expected} GPUs offered by the DRA driver {DRA_DRIVER} ({dra.source()}; {host})"
            return self.check(name, False, f"{figures}: restart the DRA driver's kubelet plugin pod on this node, "
                              "then check its log and nvidia-smi" + notes, figures + notes)
        more = "; more than the GPUs: a GPU in MIG mode offered whole as well" if dra.gpus > expected else ""
        return self.check(name, True, f"{dra.gpus} GPU device(s) of {DRA_DRIVER} for {expected} GPU(s) "
                          f"({dra.source()}; {host}){more}{notes}")


class Published(Family):
    name = "published"
    category = "publish"
    source = "the agent's own writes to the API server"
    reads = "whether topology discovery ran and the last publish of labels, annotations and the condition worked"
    thresholds = "the publish succeeded (or Kubernetes publishing is off)"
    remedy = "see the agent's log: RBAC (a 403 names the rule to add), API server reachability"
    checks = ("topology.published", "fleet.limit")

    def evaluate(self, facts: Facts) -> list[Check]:
        return self._published(facts) + self._limit(getattr(facts.publish, "limit", None))

    def _limit(self, o: Any) -> list[Check]:
        """``fleet.limit`` (warning): the blast-radius limit kept this not-ready node in service
        (gpu_tune.cluster.limit); listed only where the limit was asked."""
        if o is None:
            return []
        if o.taken:  # a problem here: the limit could not be enforced (no ledger)
            return [self.check("fleet.limit", not o.problem, f"taken out: {o.says}", severity=WARNING)]
        return [self.check("fleet.limit", False, f"{o.says}: reported not ready and left in service (no taint added, "
                           "the hardware condition not set to False)", o.reached, severity=WARNING)]

    def _published(self, facts: Facts) -> list[Check]:
        name = "topology.published"
        if facts.errors.get("discover"):
            return [self.check(name, False, f"topology discovery failed: {facts.errors['discover']}")]
        if facts.errors.get("publish"):
            return [self.check(name, False, f"publishing to Kubernetes failed: {facts.errors['publish']}")]
        pub = facts.publish
        if pub is None:
            return [self.check(name, True, "publishing")] if facts.pending_publish else []
        detail = str(getattr(pub, "detail", "") or "")
        if bool(getattr(pub, "ok", False)):
            return [self.check(name, True, detail or "topology published")]
        return [self.check(name, False, detail or "publishing to Kubernetes failed")]
