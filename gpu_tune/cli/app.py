"""The ``gpu-tune`` command (docs/cli.md). Thin: each command calls one function elsewhere.

Exit codes: 0 fine, 1 drift / not applied / failed, 2 bad input (one line on stderr), 3 an
unexpected runtime error (traceback only with -v). Heavy modules are imported inside the
commands that need them, so ``gpu-tune audit`` starts fast.
"""


import functools
import inspect
import json
import logging
import math
import os
import sys
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, Callable, Optional

import typer

try:  # typer >= 0.24 vendors click as typer._click; older releases use click itself
    from typer._click import exceptions as _cx
except ImportError:  # pragma: no cover
    from click import exceptions as _cx

from gpu_tune import __version__
from gpu_tune.errors import GpuTuneError, InputError
from gpu_tune.views.lines import report_error, setup_logging

log = logging.getLogger("gpu_tune")


class Output(str, Enum):
    table = "table"
    json = "json"


class Backend(str, Enum):
    auto = "auto"
    nvml = "nvml"
    fixture = "fixture"
    none = "none"


class Mode(str, Enum):
    audit = "audit"
    enforce = "enforce"
    revert = "revert"


class Device(str, Enum):
    auto = "auto"
    gpu = "gpu"
    cpu = "cpu"


@dataclass
class Globals:
    root: str = "/"
    gpu_backend: str = "auto"
    gpu_fixture: Optional[str] = None
    policy_dir: Optional[str] = None
    output: str = "table"
    verbose: bool = False


# -- global options, accepted before the command and on every command --------------------------
RootOpt = Annotated[Optional[str], typer.Option("--root", envvar="GPU_TUNE_ROOT", metavar="DIR",
                                                help="Host root: every /proc, /sys, /etc path is read under it [default: /]")]
BackendOpt = Annotated[Optional[Backend], typer.Option("--gpu-backend", envvar="GPU_TUNE_GPU_BACKEND",
                                                       help="GPU access [default: auto]", case_sensitive=False)]
FixtureOpt = Annotated[Optional[str], typer.Option("--gpu-fixture", envvar="GPU_TUNE_GPU_FIXTURE", metavar="FILE",
                                                   help="JSON file for the fixture GPU backend")]
PolicyDirOpt = Annotated[Optional[str], typer.Option("--policy-dir", envvar="GPU_TUNE_POLICY_DIR", metavar="DIR",
                                                     help="Profiles folder [default: the shipped policies/]")]
OutputOpt = Annotated[Optional[Output], typer.Option("--output", "-o", help="table or json [default: table]",
                                                     case_sensitive=False)]
VerboseOpt = Annotated[Optional[bool], typer.Option("--verbose", "-v", help="Log more; show tracebacks")]
ProfileOpt = Annotated[str, typer.Option("--profile", envvar="GPU_TUNE_PROFILE", metavar="P",
                                         help="Profile to act for")]
TaintOpt = Annotated[Optional[str], typer.Option(
    "--taint", envvar="GPU_TUNE_TAINT", metavar="KEY[=VALUE]:EFFECT|off",
    help="The startup taint this agent owns, as kubectl taint writes it, or off: the GPUHostReady condition "
         "only, the taint left to another controller (docs/deploy.md) [default: the profile's readiness.taint]")]

_GLOBAL_PARAMS = [
    inspect.Parameter("g_root", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=RootOpt),
    inspect.Parameter("g_gpu_backend", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=BackendOpt),
    inspect.Parameter("g_gpu_fixture", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=FixtureOpt),
    inspect.Parameter("g_policy_dir", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=PolicyDirOpt),
    inspect.Parameter("g_output", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=OutputOpt),
    inspect.Parameter("g_verbose", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=VerboseOpt),
]

app = typer.Typer(
    name="gpu-tune",
    help="Tune GPU nodes for training or inference, label their topology, and prove they are ready.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _merge_globals(ctx: typer.Context, kw: dict[str, Any]) -> Globals:
    base: Globals = (ctx.obj if isinstance(ctx.obj, Globals) else None) or Globals()
    g = Globals(**vars(base))
    for name in ("root", "gpu_backend", "gpu_fixture", "policy_dir", "output", "verbose"):
        val = kw.pop(f"g_{name}", None)
        if isinstance(val, Enum):
            val = val.value
        if val is not None:
            setattr(g, name, val)
    return g


def command(name: str, help: str, **settings):
    """Register a command that also takes the global options; the body gets ``g: Globals``."""

    def deco(fn: Callable[..., int | None]):
        sig = inspect.signature(fn)
        params = [p for p in sig.parameters.values() if p.name not in ("g", "ctx")]
        ctx_param = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
        new_sig = sig.replace(parameters=[ctx_param, *params, *_GLOBAL_PARAMS])

        @functools.wraps(fn)
        def wrapper(ctx: typer.Context, **kw):
            g = _merge_globals(ctx, kw)
            setup_logging(g.verbose)
            try:
                _check_inputs(g, kw, _root_on_command_line(ctx))
                code = fn(g=g, **kw)
            except GpuTuneError as exc:
                _fail(exc, exc.exit_code, g.verbose)
            except KeyboardInterrupt:
                raise typer.Exit(130)
            except (typer.Exit, _cx.ClickException):
                raise
            except Exception as exc:  # noqa: BLE001 - the last line of defence
                _fail(exc, 3, g.verbose, unexpected=True)
            raise typer.Exit(code or 0)

        wrapper.__signature__ = new_sig  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in new_sig.parameters.values()}
        app.command(name, help=help, **settings)(wrapper)
        return fn

    return deco


def _check_root(root: str) -> None:
    """``--root`` (or GPU_TUNE_ROOT) must name a directory this process can search: an empty value
    would mean the working directory (or, from ``/``, the real host) and is refused."""
    if not root.strip():
        raise InputError("--root '' (or GPU_TUNE_ROOT=''): empty; give the host root, e.g. --root / or --root /host")
    try:
        st = os.stat(root)
    except FileNotFoundError:
        raise InputError(f"--root {root}: no such directory") from None
    except OSError as exc:
        raise InputError(f"--root {root}: {exc.strerror or exc}") from None
    import stat as _stat

    if not _stat.S_ISDIR(st.st_mode):
        raise InputError(f"--root {root}: not a directory")
    for sub in ("proc", "sys"):  # needs search (x) permission on the root, as every read does
        try:
            os.stat(os.path.join(root, sub))
        except FileNotFoundError:
            pass  # HostFS says which are missing
        except OSError as exc:
            raise InputError(f"--root {root}: cannot read under it: {sub}/: {exc.strerror or exc}") from None


def _root_on_command_line(ctx: typer.Context) -> bool:
    sources = [ctx.get_parameter_source("g_root")]
    if ctx.parent is not None:
        sources.append(ctx.parent.get_parameter_source("root"))
    return any(getattr(s, "name", "") == "COMMANDLINE" for s in sources)


def _check_inputs(g: Globals, kw: dict[str, Any], root_given: bool = False) -> None:
    """Checks every command shares: the root, and finite numbers in every float option."""
    # click reads an empty variable as unset, which would mean / (the real host): refuse it.
    if g.root == "" or (os.environ.get("GPU_TUNE_ROOT") == "" and not root_given):
        _check_root("")
    if g.root != "/":
        _check_root(g.root)
    for name, val in kw.items():
        if isinstance(val, float) and not math.isfinite(val):
            raise InputError(f"--{name.replace('_', '-')} {val}: expected a finite number")


def _fail(exc: BaseException, code: int, verbose: bool, unexpected: bool = False) -> None:
    report_error(exc, verbose, unexpected=unexpected)  # one line; the traceback only with -v
    raise typer.Exit(code)


def _version(value: bool) -> None:
    if value:
        print(f"gpu-tune {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    ctx: typer.Context,
    root: RootOpt = None,
    gpu_backend: BackendOpt = None,
    gpu_fixture: FixtureOpt = None,
    policy_dir: PolicyDirOpt = None,
    output: OutputOpt = None,
    verbose: VerboseOpt = None,
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit", is_eager=True,
                                          callback=lambda v: _version(v))] = False,
) -> None:
    ctx.obj = Globals(
        root="/" if root is None else root,
        gpu_backend=(gpu_backend.value if gpu_backend else "auto"),
        gpu_fixture=gpu_fixture,
        policy_dir=policy_dir,
        output=(output.value if output else "table"),
        verbose=bool(verbose),
    )


# -- shared plumbing ----------------------------------------------------------------------------
_own_command_line = False


def set_own_command_line(own: bool) -> None:
    """Whether :func:`gpu_tune.cli.main.main` runs this process's own command line (``sys.argv``)
    rather than a caller's ``main(argv)``: only then may ``serve`` re-execute the process."""
    global _own_command_line
    _own_command_line = own


def own_command_line() -> bool:
    return _own_command_line


def open_host(g: Globals):
    from gpu_tune.host.fs import HostFS

    return HostFS(g.root)


def profile_of(g: Globals, name: str):
    """The profile ``name``, every value checked, its operator's policy too (a misspelt check name
    refuses every command, as any other bad key does)."""
    from gpu_tune.judge.policy import policy_of
    from gpu_tune.tune.policy import load_profile

    prof = load_profile(name, g.policy_dir)
    policy_of(prof)
    return prof


def check_journal(fs) -> None:
    """A journal this tool did not write is bad input: exit 2 before the lock is taken or
    anything is written. (An unreadable file is left to apply/revert to report.)"""
    from gpu_tune.errors import HostError
    from gpu_tune.tune.journal import Journal, JournalError

    try:
        Journal(fs).load()
    except JournalError:
        raise
    except HostError:
        pass


def gpu_backend(g: Globals):
    from gpu_tune.gpu import select_backend

    return select_backend(g.gpu_backend, g.gpu_fixture)


def print_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False) + "\n")


def to_journal(stream=None) -> bool:
    """Whether ``stream`` (stdout) is systemd's journal: ``JOURNAL_STREAM`` names its device and inode
    (systemd.exec(5)), so a unit's output is plain lines and a pipe or a terminal keeps the tables."""
    stream = sys.stdout if stream is None else stream
    try:
        dev, ino = (int(x) for x in os.environ.get("JOURNAL_STREAM", "").split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def console():
    from rich.console import Console

    return Console(highlight=False, emoji=False)
