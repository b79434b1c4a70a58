"""The ``gpu-tune`` command (and the ``kubectl-gpu_tune`` plugin): thin commands over the stages."""

from gpu_tune.cli.app import main

__all__ = ["main"]
