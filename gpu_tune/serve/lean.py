"""The agent in a process image of its own: ``gpu-tune serve`` without the command line.

The command line (typer and its click, every command's module) is needed to parse ``gpu-tune
serve``'s options and never again, yet it would stay resident for the agent's life: about 1.7 MiB
(benchmarks/bench_rss.py). So once typer has parsed and checked the options, :func:`handoff` puts
them in the environment and re-executes the same command in the same process
(``os.execv(sys.executable, sys.orig_argv)``): the same interpreter, flags, entry point and
arguments, so ``ps`` shows what was started; the same PID, so systemd's notify socket, the
container runtime and the kubelet see one process; the same standard streams. The new image
starts at the same entry, :mod:`gpu_tune.cli`, which finds the options (:func:`pending`: only in
the process they were left for, by its PID, never in a child that inherits the variable) and runs
:func:`main` instead of the command line. Errors are reported as the command line reports them:
one line on stderr, exit 2 for bad input, 3 for an unexpected error, 130 on Ctrl-C.

Only a process's own command line is re-executed (``gpu_tune.cli.main()`` without arguments):
a caller of ``main(argv)`` in its own process (a test, a tool) keeps its process, and the agent
runs there as before. Where ``exec`` fails the agent runs in the first process too.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

ENV = "GPU_TUNE_SERVE_HANDOFF"

log = logging.getLogger("gpu_tune")


def handoff(options: dict[str, Any]) -> None:
    """Re-execute this process as the agent with ``options`` (:class:`ServeOptions`' fields);
    returns only when that is not possible (the caller then serves in this process)."""
    argv = list(getattr(sys, "orig_argv", None) or [])
    if os.name != "posix" or not sys.executable or not argv:
        return
    os.environ[ENV] = json.dumps({"pid": os.getpid(), "options": options})
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    try:
        os.execv(sys.executable, argv)
    except OSError as exc:
        os.environ.pop(ENV, None)
        log.debug("the agent runs beside the command line: re-executing %s failed: %s", sys.executable, exc)


def pending() -> bool:
    """Whether this process is a ``gpu-tune serve`` re-executed by :func:`handoff`. The variable
    left for another process (this one inherited it) is removed."""
    raw = os.environ.get(ENV)
    if raw is None:
        return False
    try:
        mine = json.loads(raw).get("pid") == os.getpid()
    except (ValueError, AttributeError):
        mine = False
    if not mine:
        os.environ.pop(ENV, None)
    return mine


def defer_package_metadata() -> None:
    """pydantic's plugin loader imports ``importlib.metadata`` (and with it zipfile, shutil, bz2,
    lzma, csv, tempfile, ``importlib.resources``: about 0.8 MiB for the agent's life) to look up
    plugins among the installed packages' entry points when its first model is built; urllib3
    (under the kubernetes client) imports its ``version`` to check ``h2`` if HTTP/2 is asked for,
    which the agent never does. The agent builds its models with no pydantic plugin
    (``PYDANTIC_DISABLE_PLUGINS=__all__``, unless the variable is set already) and
    ``importlib.metadata`` is loaded part by part (:mod:`gpu_tune.partial_import`): whole at the
    first use of any of its names, by anyone."""
    from gpu_tune import partial_import

    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    if "importlib.metadata" in sys.modules:
        return
    try:
        partial_import.install(("importlib.metadata",), {})
        for name in ("entry_points", "version", "distribution", "distributions", "metadata", "requires", "files"):
            partial_import.on_first_call(f"importlib.metadata.{name}")  # imported early, called late or never
    except ImportError as exc:  # no source to load from (a frozen or zipped standard library): imported whole
        log.debug("importlib.metadata imported whole: %s", exc)


def main(argv: list[str] | None = None) -> None:
    """The agent with the options :func:`handoff` left (``argv``: the command line's, already
    parsed: not read again). Exits with the code ``gpu-tune serve`` exits with."""
    defer_package_metadata()  # before anything imports pydantic
    from gpu_tune.errors import GpuTuneError
    from gpu_tune.serve.options import ServeOptions
    from gpu_tune.views.lines import report_error, setup_logging

    options = ServeOptions(**json.loads(os.environ.pop(ENV))["options"])
    setup_logging(options.verbose)
    try:
        from gpu_tune.serve.server import serve

        code = serve(options)
    except GpuTuneError as exc:
        report_error(exc, options.verbose)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - the last line of defence, as the command line's
        report_error(exc, options.verbose, unexpected=True)
        sys.exit(3)
    sys.exit(code or 0)
