"""The ``gpu-tune`` command (and the ``kubectl-gpu_tune`` plugin): thin commands over the stages.

The command modules do not use ``from __future__ import annotations``: typer reads their
annotations as objects.

:mod:`~gpu_tune.cli.app` holds the typer app, the global options and the error handling;
:mod:`~gpu_tune.cli.host`, :mod:`~gpu_tune.cli.judge`, :mod:`~gpu_tune.cli.cluster` and
:mod:`~gpu_tune.cli.serve` the commands of each stage; :mod:`~gpu_tune.cli.main` the entry point.
A ``gpu-tune serve`` that re-executed itself (:mod:`gpu_tune.serve.lean`) enters here too and runs
the agent without importing the command line.
"""

from gpu_tune.serve.lean import pending

if pending():
    from gpu_tune.serve.lean import defer_package_metadata, main

    defer_package_metadata()  # first: before anything imports pydantic
else:
    from gpu_tune.cli.main import main

__all__ = ["main"]
