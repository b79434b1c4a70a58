"""``slurm.gres``: the GPUs Slurm offers on this node (its configured ``gres/gpu``) against the
GPUs the host has (NVML's list and the PCI bus), as ``gpu.allocatable`` judges the device
plugin's count on Kubernetes.

- fewer offered than the host has: GPUs that sit idle while jobs wait (a ``Gres=`` line left at
  an older count, a GPU left out of ``gres.conf``): not ready;
- more offered than the host has: Slurm hands out a GPU that is not there (a GPU fell off the
  bus after ``gres.conf`` was written): not ready;
- the node offers no ``gres/gpu`` at all, or a count of 0 (``Gres=gpu:0``, which Slurm accepts:
  it hands out no GPU of this node as a resource, the same as listing none): not compared (a
  cluster that gives whole nodes to jobs configures no GPU GRES); a GPU in MIG mode: not compared
  (Slurm then counts MIG devices);
- a ``Gres=`` value this module cannot read (``gpu:-8``, a count in digits other than ASCII's,
  ``gpu:h100:٨``): a warning, never a drain.

Both numbers are named in the detail (and so in the drain reason): ``Slurm gres/gpu 8, NVML 7,
PCI bus 8``. A prolog that decides without Slurm (:func:`gpu_tune.slurm.health.from_record`)
judges the ``Gres=`` gpu-tune's record kept from the last pass that read Slurm, and the detail
says so (``kept``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from gpu_tune.gpu.base import GpuInfo
from gpu_tune.judge.checks.base import FATAL, WARNING, Check
from gpu_tune.judge.checks.presence import pci_gpus
from gpu_tune.slurm.node import SlurmNode, gres_count

NAME = "slurm.gres"
REASON = "SlurmGresMismatch"
CATEGORY = "device_plugin"  # what the scheduler offers, as the device plugin's count on Kubernetes
REMEDY = "set the node's Gres=gpu:N in slurm.conf (and gres.conf) to the GPUs it has, then `scontrol reconfigure`"


def _check(ok: bool, detail: str, summary: str = "", severity: str = FATAL) -> Check:
    return Check(NAME, ok, detail, summary, severity, CATEGORY, (), REASON)


def gres_check(node: SlurmNode, gpus: Sequence[GpuInfo], topology: Mapping[str, Any] | None,
               kept: str | None = None) -> Check:
    """``kept``: when the ``Gres=`` judged was read from Slurm, where it comes from gpu-tune's record
    (said in the detail); None: read from Slurm in this pass."""
    c = _judged(node, gpus, topology)
    if kept is None:
        return c
    return _check(c.ok, f"{c.detail} (Gres={node.gres or '(null)'} as Slurm listed it at {kept or 'an undated pass'}, "
                        "kept by gpu-tune: Slurm not asked)", c.summary, c.severity)


def _judged(node: SlurmNode, gpus: Sequence[GpuInfo], topology: Mapping[str, Any] | None) -> Check:
    try:
        offered = gres_count(node.gres, "gpu")
    except ValueError as exc:
        return _check(False, f"Slurm's Gres={node.gres!r} for {node.name} could not be read ({exc}): not compared",
                      severity=WARNING)
    nvml = len(gpus)
    pci = len(pci_gpus(topology)) if topology is not None else None
    figures = f"Slurm gres/gpu {offered if offered is not None else 0}, NVML {nvml}" + (
        f", PCI bus {pci}" if pci is not None else "")
    if not offered:  # none listed, or a count of 0 (which Slurm allows): Slurm hands out no GPU here
        return _check(True, f"not compared: Slurm offers no gres/gpu on {node.name} (Gres={node.gres or '(null)'}); "
                            f"{figures}")
    mig = sorted(g.index for g in gpus if g.mig_mode is True)
    if mig:
        return _check(True, f"not compared: GPU {', '.join(map(str, mig))} in MIG mode (Slurm counts MIG devices as "
                            f"gres/gpu); {figures}")
    have = [n for n in (nvml, pci) if n is not None]
    if all(offered == n for n in have):
        return _check(True, figures)
    most = max(have)
    if offered < most:
        why = f"Slurm offers {offered} of the {most} GPUs this node has"
    else:
        why = f"Slurm offers {offered} GPUs, this node has {min(have)}"
    return _check(False, f"{figures}: {why}: {REMEDY}", figures)
