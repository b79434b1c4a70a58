"""Lost or missing GPUs: the most urgent faults a GPU node has.

- ``gpu.backend``: the GPU backend (NVML) failed as a whole;
- ``gpu.visible``: the Node says it has NVIDIA GPUs (NFD or GPU Operator labels, device-plugin
  capacity) and the agent sees none;
- ``gpu.present``: every GPU NVML lists answers (not "GPU is lost", no other error);
- ``gpu.count``: the NVIDIA display controllers on the PCI bus (sysfs), the GPUs NVML lists and the
  node's expected count agree, and NVML lists each GPU once (no UUID or bus id twice); each
  disagreement names both numbers and the missing bus ids, also when the counts agree only because
  NVML lists one GPU twice while another is gone.
"""

from __future__ import annotations

from gpu_tune.judge.checks.base import Check, Facts, Family, gpu_label, listed

GPU_VISIBILITY_CAUSES = (
    "the pod does not run with the NVIDIA container runtime (runtimeClassName: nvidia, or the "
    "runtime's default), NVIDIA_VISIBLE_DEVICES is not 'all' in the pod, the NVIDIA driver is "
    "not installed or not loaded on the host (nvidia-smi on the node), the GPU backend is off "
    "(--gpu-backend none), or the device plugin's capacity is stale")


def pci_gpus(topology) -> list[str]:
    """Bus ids of the NVIDIA VGA/3D controllers the topology found on the PCI bus (sysfs)."""
    out = []
    for g in (topology or {}).get("gpus") or []:
        if isinstance(g, dict) and g.get("pci_bus_id") and g.get("on_pci_bus", True):
            out.append(str(g["pci_bus_id"]).lower())
    return sorted(set(out))


def few(items: list[str], limit: int = 8) -> str:
    """The first ``limit`` of ``items`` and how many more (a detail stays short at 1,024 GPUs)."""
    return ", ".join(items[:limit]) + (f" and {len(items) - limit:,} more" if len(items) > limit else "")


def twice(gpus) -> list[str]:
    """GPUs NVML lists under one UUID or one bus id: one GPU listed twice (and so, on a node whose
    count still agrees, another one gone)."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for what, key in (("UUID", lambda g: g.uuid), ("bus id", lambda g: (g.pci_bus_id or "").lower())):
        seen: dict[str, list[int]] = {}
        for g in gpus:
            if key(g) and not g.error:
                seen.setdefault(key(g), []).append(g.index)
        for value, idx in seen.items():
            if len(idx) > 1:
                groups.setdefault(tuple(idx), []).append(f"{what} {value}")
    return [f"NVML lists GPU {few([str(i) for i in idx])} under one {' and '.join(whats)}: one GPU listed "
            f"{len(idx)} times" for idx, whats in sorted(groups.items())[:8]]


class Presence(Family):
    name = "presence"
    category = "presence"
    source = "NVML (nvmlDeviceGetCount, every GPU's handle), sysfs (/sys/bus/pci/devices/*/{vendor,class}), the Node"
    reads = ("the GPUs NVML lists and whether each answers; the NVIDIA VGA (0x0300) and 3D (0x0302) controllers "
             "on the PCI bus; readiness.expect.gpus or the GPU model's gpus; the Node's GPU labels and capacity")
    thresholds = "every GPU answers; PCI count = NVML count = expected count"
    remedy = ("a lost GPU or one missing from the bus: cordon and drain the node, check `dmesg` for XID 79, "
              "reset the GPU or reboot; one that stays missing after a reboot: reseat or replace it")
    checks = ("gpu.backend", "gpu.visible", "gpu.present", "gpu.count")

    def evaluate(self, facts: Facts) -> list[Check]:
        err = facts.errors.get("gpus")
        if err:
            return [self.check("gpu.backend", False, f"GPU backend failed: {err}; check the driver with nvidia-smi")]
        out: list[Check] = []
        gpus = list(facts.gpus)
        visible = self._visible(facts)
        if visible is not None:
            out.append(visible)
        if gpus:
            out.append(self._present(gpus))
        count = self._count(facts)
        if count is not None:
            out.append(count)
        return out

    def _visible(self, facts: Facts) -> Check | None:
        if facts.gpus or facts.node_facts is None:
            return None
        why = list(getattr(facts.node_facts, "gpu_expected", None) or ())
        if not why:
            return None
        figures = f"the Node says it has NVIDIA GPUs ({', '.join(why)}) but the agent sees none"
        return self.check("gpu.visible", False, f"{figures}; likely causes: {GPU_VISIBILITY_CAUSES}", figures)

    def _present(self, gpus) -> Check:
        bad = {}
        for g in gpus:
            if g.error and g.error_kind != "reset_required":  # a reset is the recovery family's
                if g.error_kind == "lost":
                    bad[g.index] = (f"{gpu_label(g)} is lost (NVML: {g.error}): cordon and drain the node, check "
                                    f"dmesg for Xid 79, then reset the GPU or reboot")
                elif g.error_kind == "identity":
                    bad[g.index] = (f"{gpu_label(g)} cannot say who it is (NVML: {g.error}): check the driver with "
                                    "nvidia-smi -q; reset the GPU or reboot")
                else:
                    bad[g.index] = f"{gpu_label(g)} does not answer ({g.error_kind or 'error'}: {g.error}): check the driver with nvidia-smi"
        per = tuple((str(g.index), g.index not in bad) for g in gpus)
        if bad:
            texts = [bad[i] for i in sorted(bad)]
            return self.check("gpu.present", False, listed(texts), listed([t.split(": cordon")[0].split(": check")[0]
                                                                            for t in texts], 3), gpus=per)
        return self.check("gpu.present", True, f"{len(gpus)} GPU(s) answer NVML", gpus=per)

    def _count(self, facts: Facts) -> Check | None:
        pci = pci_gpus(facts.topology)
        nvml = sorted({(g.pci_bus_id or "").lower() for g in facts.gpus if g.pci_bus_id})
        n_nvml = len(facts.gpus)
        expected = facts.expect.gpus
        if not pci and not n_nvml and not expected:
            return None
        problems = twice(facts.gpus)
        notes = []
        if facts.topology is not None and not pci and n_nvml:
            # no NVIDIA controller in sysfs at all: not the host's /sys (a GPU fixture on another
            # machine, /sys not mounted), not a GPU that fell off: nothing to compare
            notes.append("not compared with the PCI bus: sysfs lists no NVIDIA GPU under --root (is /sys the host's?)")
        elif facts.topology is not None and len(pci) != n_nvml:
            missing = [b for b in pci if b not in nvml]
            if len(pci) > n_nvml:
                problems.append(f"{len(pci)} NVIDIA GPU(s) on the PCI bus but NVML lists {n_nvml}"
                                + (f": missing from NVML {few(missing)}" if missing else ""))
            else:
                extra = [b for b in nvml if b not in pci]
                problems.append(f"NVML lists {n_nvml} GPU(s) but {len(pci)} are on the PCI bus"
                                + (f": not found on the bus {few(extra)}" if extra else ""))
        elif facts.topology is not None:
            # as many as on the bus, but not the same ones (one GPU listed twice, another gone): each
            # GPU on the bus that NVML does not name, beyond those that could not say their bus id
            missing = [b for b in pci if b not in nvml]
            unnamed = sum(1 for g in facts.gpus if not g.pci_bus_id)
            if len(missing) > unnamed:
                problems.append(f"{len(missing)} NVIDIA GPU(s) on the PCI bus that NVML does not list: {few(missing)}")
        have = max(len(pci), n_nvml)
        if expected is not None and have < expected:
            where = f" ({facts.expect.source})" if facts.expect.source else ""
            problems.append(f"{have} of {expected} expected GPU(s) present{where}: "
                            f"{expected - have} missing (fell off the bus before boot, or not seated)")
        elif expected is not None and have > expected:
            problems.append(f"{have} GPU(s) present, {expected} expected{f' ({facts.expect.source})' if facts.expect.source else ''}: "
                            "the expectation is wrong for this node")
        if problems:
            return self.check("gpu.count", False, "; ".join(problems) + ": drain the node, reseat or replace the "
                              "missing GPU (a GPU lost at runtime comes back after a reset or reboot)",
                              "; ".join(problems))
        figs = f"{n_nvml} GPU(s): " + (f"PCI bus {len(pci)}, " if facts.topology is not None and pci else "") + \
            f"NVML {n_nvml}" + (f", expected {expected}" if expected else "")
        return self.check("gpu.count", True, figs + "".join(f"; {n}" for n in notes))
