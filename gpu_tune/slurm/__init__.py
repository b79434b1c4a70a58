"""What Slurm is told: the readiness verdict as the state of a Slurm node (docs/slurm.md).

The second scheduler the verdict is told to, beside :mod:`gpu_tune.cluster` (Kubernetes), for
``gpu-tune check --slurm`` run as Slurm's ``HealthCheckProgram``, ``Prolog`` or ``Epilog``:

- :mod:`~gpu_tune.slurm.node`: a node as ``scontrol -o show node`` prints it (pure parsers);
- :mod:`~gpu_tune.slurm.scontrol`: the one place that runs a Slurm command;
- :mod:`~gpu_tune.slurm.gres`: ``slurm.gres``, Slurm's ``gres/gpu`` count beside NVML's and the
  PCI bus's;
- :mod:`~gpu_tune.slurm.decide`: drain, resume or leave alone (pure);
- :mod:`~gpu_tune.slurm.passes`: gpu-tune's record of the node (ready passes in a row, its drain,
  the ``Gres=`` Slurm listed), kept under the root's state folder;
- :mod:`~gpu_tune.slurm.fleet`: the blast-radius limit's store on Slurm (the count of every node,
  the drain, the resume of a node ranked past the limit);
- :mod:`~gpu_tune.slurm.health`: one pass, from the node's name to the line that says what was done.
"""
