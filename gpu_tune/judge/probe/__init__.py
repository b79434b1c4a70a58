"""The readiness probe, agent side: plan targets, spawn the workload, judge its result.

- :mod:`.plan`: which targets (GPUs or the CPU), bound how, and which are blocked or skipped;
- :mod:`.run`: one process per target with a hard timeout, bounded retries, parallel NUMA nodes;
- :mod:`.judge`: accuracy after fixed work, both throughput regimes, the result fingerprint,
  the binding seen from inside;
- :mod:`.baselines`: ``policies/baselines.yaml``;
- :mod:`.render`: the ``gpu-tune probe`` table.

TensorFlow is never imported here: the workload (``gpu_tune.workload.mnist_probe``) runs in its own process.
"""

from gpu_tune.judge.probe.baselines import (REGIMES, Baseline, Baselines, FingerprintPin, RegimeBaseline, load_baselines,
                        normalize_pci_device)
from gpu_tune.judge.probe.judge import Judgement, judge, regime_figures
from gpu_tune.judge.probe.plan import MIG_SKIP, ProbeTarget, _allowed_mems, plan_targets
from gpu_tune.judge.probe.run import STATUSES, WORKLOAD_MODULE, ProbeVerdict, run_once, run_probes, workload_args

__all__ = [
    "MIG_SKIP", "REGIMES", "STATUSES", "WORKLOAD_MODULE", "Baseline", "Baselines", "FingerprintPin", "Judgement",
    "ProbeTarget", "ProbeVerdict", "RegimeBaseline", "_allowed_mems", "judge", "load_baselines",
    "normalize_pci_device", "plan_targets", "regime_figures", "run_once", "run_probes",
    "workload_args",
]
