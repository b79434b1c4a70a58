"""The ``gpu-tune`` command (CONTRACT §3). Thin: each command calls one function elsewhere.

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
            _setup_logging(g.verbose)
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


def _setup_logging(verbose: bool) -> None:
    if logging.getLogger().handlers:
        return
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, stream=sys.stderr,
                        format="gpu-tune: %(levelname)s: %(message)s")


def _fail(exc: BaseException, code: int, verbose: bool, unexpected: bool = False) -> None:
    if verbose:
        import traceback

        traceback.print_exception(exc, file=sys.stderr)
    msg = str(exc) or type(exc).__name__
    # One line, whatever the input echoed back held: newlines shown as \n, and not a whole file.
    msg = msg.replace("\r", "\\r").replace("\n", "\\n")
    if len(msg) > 1000:
        msg = msg[:1000] + "..."
    if unexpected:
        msg = f"unexpected error: {type(exc).__name__}: {msg} (run with -v for the traceback)"
    print(f"gpu-tune: error: {msg}", file=sys.stderr)
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
def _fs(g: Globals):
    from gpu_tune.host.fs import HostFS

    return HostFS(g.root)


def _profile(g: Globals, name: str):
    from gpu_tune.tune.policy import load_profile

    return load_profile(name, g.policy_dir)


def _check_journal(fs) -> None:
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


def _gpu(g: Globals):
    from gpu_tune.gpu import select_backend

    return select_backend(g.gpu_backend, g.gpu_fixture)


def _print_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False) + "\n")


def _console():
    from rich.console import Console

    return Console(highlight=False, emoji=False)


# -- commands -----------------------------------------------------------------------------------
def _check_gpu_and_data(gpu: Optional[str], data: Optional[str]) -> None:
    """The probe's and the gain's --gpu and --data, checked before anything runs."""
    if gpu is not None and gpu != "all" and not gpu.isdigit():
        raise InputError(f"--gpu {gpu!r}: expected a GPU index or 'all'")
    if data is not None and not os.path.exists(data):
        raise InputError(f"--data {data}: no such file or folder")


@command("profiles", help="List the profiles with their summaries.")
def profiles_cmd(g: Globals) -> int:
    from gpu_tune.tune.policy import load_all

    profiles = load_all(g.policy_dir)
    if g.output == "json":
        _print_json({"profiles": [{"name": p.name, "summary": p.summary} for p in profiles]})
        return 0
    from rich.table import Table

    t = Table(header_style="bold")
    t.add_column("profile")
    t.add_column("summary")
    for p in profiles:
        t.add_row(p.name, p.summary)
    _console().print(t)
    return 0


def _emit_report(g: Globals, report, title: str, *, show_changed: bool = False) -> None:
    if g.output == "json":
        _print_json(report.as_dict())
        return
    from gpu_tune.views.settings import settings_table, summary_line

    c = _console()
    c.print(settings_table(title, report.settings, show_changed=show_changed))
    verdict = "[green]compliant[/]" if report.compliant else "[yellow]not compliant[/]"
    c.print(f"{summary_line(report.settings)} → {verdict}")


@command("audit", help="Read-only: each setting's current vs desired value. Exit 0 compliant, 1 drift.")
def audit_cmd(g: Globals, profile: ProfileOpt = "training") -> int:
    from gpu_tune.tune.engine import audit, make_context

    prof = _profile(g, profile)
    fs = _fs(g)
    report = audit(make_context(fs, prof, _gpu(g)))
    _emit_report(g, report, f"audit: profile {prof.name} on {fs.root}")
    return 0 if report.compliant else 1


@command("apply", help="Record originals, change what differs, verify. Exit 0 applied and verified, 1 not.")
def apply_cmd(
    g: Globals,
    profile: ProfileOpt = "training",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would change; change nothing")] = False,
) -> int:
    from gpu_tune.tune.engine import apply, make_context

    prof = _profile(g, profile)
    fs = _fs(g)
    if not dry_run:
        _check_journal(fs)
    report = apply(make_context(fs, prof, _gpu(g)), dry=dry_run)
    title = f"apply{' --dry-run' if dry_run else ''}: profile {prof.name} on {fs.root}"
    _emit_report(g, report, title, show_changed=True)
    if dry_run:
        return 0
    return 0 if report.compliant else 1


@command("revert", help="Restore every original recorded by earlier applies. Exit 0 restored, 1 not.")
def revert_cmd(g: Globals) -> int:
    from gpu_tune.tune.engine import Context, revert

    fs = _fs(g)
    _check_journal(fs)
    gpu = None
    try:
        gpu = _gpu(g)
    except InputError:
        raise
    ok, rows = revert(Context(fs=fs, profile=None, gpu=gpu))
    if g.output == "json":
        _print_json({"restored": ok, "settings": [r.as_dict() for r in rows]})
    else:
        c = _console()
        if not rows:
            c.print("nothing to revert: no originals recorded")
        else:
            from gpu_tune.views.settings import settings_table

            c.print(settings_table(f"revert on {fs.root}", rows, show_changed=True))
            journal = next((r for r in rows if r.id == "journal" and r.status == "error"), None)
            if journal is not None:
                c.print("[red]the journal could not be updated: it keeps every original; run gpu-tune "
                        "revert again once the cause is fixed[/]")
            else:
                c.print("[green]all originals restored[/]" if ok else "[red]some originals could not be restored (kept in the journal)[/]")
    return 0 if ok else 1


@command("topology", help="NUMA nodes, CPUs, memory, GPUs, NICs and who is local to whom.")
def topology_cmd(g: Globals) -> int:
    from gpu_tune.discover.topology import discover

    topo = discover(_fs(g), _gpu(g))
    if g.output == "json":
        _print_json(topo.as_dict())
    else:
        from gpu_tune.views.topology import render_topology

        _console().print(render_topology(topo))
    return 0


@command("probe", help="Run the MNIST probe per GPU (or on the CPU), NUMA-pinned. Exit 0 passed, 1 failed.")
def probe_cmd(
    g: Globals,
    profile: ProfileOpt = "training",
    gpu: Annotated[Optional[str], typer.Option("--gpu", metavar="N|all", help="GPU index or 'all'")] = None,
    device: Annotated[Device, typer.Option("--device", case_sensitive=False, help="auto, gpu or cpu")] = Device.auto,
    data: Annotated[Optional[str], typer.Option("--data", metavar="PATH", help="MNIST .npz or IDX folder")] = None,
    timeout: Annotated[Optional[float], typer.Option("--timeout", metavar="S", min=1.0, help="Hard timeout per probe, seconds")] = None,
) -> int:
    from gpu_tune.judge import probe as probe_mod
    from gpu_tune.discover.topology import discover

    _check_gpu_and_data(gpu, data)
    prof = _profile(g, profile)
    fs = _fs(g)
    backend = _gpu(g)
    topo = discover(fs, backend)
    targets = probe_mod.plan_targets(topo, prof, backend, gpu=gpu, device=device.value)
    baselines = probe_mod.load_baselines(g.policy_dir)
    verdicts = probe_mod.run_probes(targets, prof.probe, baselines, data=data, timeout=timeout,
                                    device=device.value, previous=None, gpu_backend=backend)
    passed = bool(verdicts) and all(v.passed for v in verdicts)
    from gpu_tune.judge.probe.saved import save_probe_results

    err = save_probe_results(fs, prof.name, [v.as_dict() for v in verdicts])
    if err:
        log.warning("probe results not saved for `gpu-tune label`: %s", err)
    if g.output == "json":
        _print_json({"profile": prof.name, "passed": passed, "results": [v.as_dict() for v in verdicts]})
    else:
        _console().print(probe_mod.render_probe_table(verdicts))
    return 0 if passed else 1


@command("gain", help="Measure what the profile gains (or loses) here: the probe's launch-bound regime untuned vs "
                       "tuned, interleaved pairs, 95% interval. Exit 0 gain or no difference, 1 loss or inconclusive.")
def gain_cmd(
    g: Globals,
    profile: ProfileOpt = "training",
    gpu: Annotated[Optional[str], typer.Option("--gpu", metavar="N|all", help="GPU index or 'all' [default: all]")] = None,
    pairs: Annotated[int, typer.Option("--pairs", metavar="K", help="Untuned/tuned pairs, run A/B/B/A… (1..50)")] = 3,
    keep: Annotated[bool, typer.Option("--keep", help="Leave the host tuned afterwards (default: as found)")] = False,
    force: Annotated[bool, typer.Option("--force", help="Compare even when a GPU is busy with other work")] = False,
    window: Annotated[Optional[float], typer.Option("--window", metavar="S",
                                                    help="Timed seconds of each run's launch-bound window "
                                                         "[default: the profile's probe window]")] = None,
    data: Annotated[Optional[str], typer.Option("--data", metavar="PATH", help="MNIST .npz or IDX folder")] = None,
    timeout: Annotated[Optional[float], typer.Option("--timeout", metavar="S", min=1.0,
                                                     help="Hard timeout per run, seconds [default: the profile's]")] = None,
) -> int:
    import signal

    from gpu_tune.judge.gain import measure as gain_mod
    from gpu_tune.discover.topology import discover

    _check_gpu_and_data(gpu, data)
    if not 1 <= pairs <= gain_mod.MAX_PAIRS:
        raise InputError(f"--pairs {pairs}: expected 1..{gain_mod.MAX_PAIRS}")
    if window is not None and not 0 < window <= 600:
        raise InputError(f"--window {window}: expected 0 < S <= 600")
    prof = _profile(g, profile)
    fs = _fs(g)
    backend = _gpu(g)
    topo = discover(fs, backend)

    def on_term(signum, frame):  # leave the host as found on SIGTERM too (SIGKILL: `gpu-tune revert`)
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        doc = gain_mod.measure_gain(fs=fs, profile=prof, backend=backend, topology=topo, gpu=gpu, pairs=pairs,
                                    keep=keep, force=force, data=data, window=window, timeout=timeout,
                                    progress=lambda m: log.info("gain: %s", m))
    finally:
        signal.signal(signal.SIGTERM, old)
    if g.output == "json":
        _print_json(doc)
    else:
        _console().print(gain_mod.render_gain(doc))
    return gain_mod.exit_code(doc)


@command("label", help="Publish labels, taint and condition for this node once.")
def label_cmd(
    g: Globals,
    profile: ProfileOpt = "training",
    node: Annotated[Optional[str], typer.Option("--node", envvar="NODE_NAME", help="Node name [default: env NODE_NAME]")] = None,
    kubeconfig: Annotated[Optional[str], typer.Option("--kubeconfig", envvar="KUBECONFIG", metavar="FILE")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be published; write nothing")] = False,
) -> int:
    from gpu_tune.cluster.oneshot import label_once

    return label_once(g, profile=profile, node=node, kubeconfig=kubeconfig, dry_run=dry_run)


@command("run", help="Exec CMD bound to a GPU's (or NUMA node's) CPUs and memory, with the profile's allocator.",
         context_settings={"allow_interspersed_args": False})
def run_cmd(
    g: Globals,
    argv: Annotated[list[str], typer.Argument(metavar="-- CMD ...", help="The command to run")],
    profile: ProfileOpt = "training",
    gpu: Annotated[Optional[int], typer.Option("--gpu", min=0, help="GPU index")] = None,
    numa_node: Annotated[Optional[int], typer.Option("--numa-node", min=0, help="NUMA node (no GPU needed)")] = None,
) -> int:
    from gpu_tune.launch import runner
    from gpu_tune.discover.topology import discover

    if gpu is not None and numa_node is not None:
        raise InputError("--gpu and --numa-node: give one, not both")
    prof = _profile(g, profile)
    backend = _gpu(g) if gpu is not None else None
    topo = discover(_fs(g), backend)
    binding = runner.binding_for(topo, gpu=gpu, numa_node=numa_node)
    runner.exec_run(binding, prof, argv)
    return 3  # exec_run does not return


@command("serve", help="The agent: reconcile loop, read-only HTTP on :9410, Prometheus, Kubernetes publishing.")
def serve_cmd(
    g: Globals,
    profile: ProfileOpt = "training",
    host: Annotated[str, typer.Option("--host", help="Listen address (the DaemonSet passes the node's address)")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Listen port")] = 9410,
    mode: Annotated[Mode, typer.Option("--mode", case_sensitive=False, help="audit: read only; enforce: re-apply drift; revert: restore the recorded originals, "
                                       "then stop enforcing (a Node label gpu-tune.io/mode=audit|revert overrides)")] = Mode.audit,
    interval: Annotated[float, typer.Option("--interval", min=1.0, metavar="S", help="Seconds between passes")] = 60.0,
    probe_interval: Annotated[Optional[float], typer.Option("--probe-interval", min=0.0, metavar="S",
                                                            help="Seconds between probes [default: the profile's]")] = None,
    no_kube: Annotated[bool, typer.Option("--no-kube", help="Do not talk to Kubernetes")] = False,
    kubeconfig: Annotated[Optional[str], typer.Option("--kubeconfig", envvar="KUBECONFIG", metavar="FILE")] = None,
    node: Annotated[Optional[str], typer.Option("--node", envvar="NODE_NAME", help="Node name [default: env NODE_NAME, else hostname]")] = None,
    revert_on_exit: Annotated[bool, typer.Option("--revert-on-exit", help="Restore originals on SIGTERM")] = False,
    metrics_detail: Annotated[bool, typer.Option(
        "--metrics-detail", help="Also export one series per setting target (per CPU, IRQ, GPU), the loop's "
                                  "per-stage success and duration, and the launch-bound GPU busy ratio: about "
                                  "1,500 more series on a 224-CPU, 8-GPU node; off by default")] = False,
    probe_device: Annotated[Device, typer.Option("--probe-device", case_sensitive=False, help="auto, gpu or cpu")] = Device.auto,
    probe_data: Annotated[Optional[str], typer.Option("--probe-data", metavar="PATH", help="MNIST data for the probe")] = None,
) -> int:
    from gpu_tune.serve.options import ServeOptions
    from gpu_tune.serve.server import serve

    opts = ServeOptions(
        root=g.root, gpu_backend=g.gpu_backend, gpu_fixture=g.gpu_fixture, policy_dir=g.policy_dir,
        profile=profile, host=host, port=port, mode=mode.value, interval=interval,
        probe_interval=probe_interval, no_kube=no_kube, kubeconfig=kubeconfig, node=node,
        revert_on_exit=revert_on_exit, probe_device=probe_device.value, probe_data=probe_data,
        verbose=g.verbose, metrics_detail=metrics_detail,
    )
    return serve(opts)


@command("fleet", help="Every GPU node's readiness as the agents published it, from the API server (read-only). "
                        "Exit 0 all ready, 1 some not ready or not reporting, or --selector matches no GPU node.")
def fleet_cmd(
    g: Globals,
    selector: Annotated[Optional[str], typer.Option("--selector", "-l", metavar="S",
                                                    help="Only nodes matching this label selector, as kubectl -l")] = None,
    kubeconfig: Annotated[Optional[str], typer.Option("--kubeconfig", metavar="FILE",
                                                      help="[default: KUBECONFIG, else ~/.kube/config, else in-cluster]")] = None,
    context: Annotated[Optional[str], typer.Option("--context", metavar="NAME", help="kubeconfig context")] = None,
    stale_after: Annotated[float, typer.Option("--stale-after", min=1.0, metavar="MINUTES",
                                               help="A GPUHostReady condition not re-written for this long means "
                                                    "the agent is not running (it re-writes it every 10 minutes)")] = 30.0,
    chunk_size: Annotated[int, typer.Option("--chunk-size", min=1, metavar="N",
                                            help="Nodes per page of the list call, as kubectl --chunk-size")] = 500,
) -> int:
    from gpu_tune.cluster.fleet import fleet_report, render_table
    from gpu_tune.cluster.api import list_nodes, reader_configuration

    cfg, source = reader_configuration(kubeconfig, context)
    listing = list_nodes(cfg, selector=selector, page_size=chunk_size, source=source)
    log.info("listed %d nodes from %s in %d page(s) (%s)", len(listing.items), listing.server, listing.pages, source)
    report = fleet_report(listing.items, stale_after_s=stale_after * 60.0)
    if g.output == "json":
        _print_json(report.as_dict())
    else:
        sys.stdout.write(render_table(report))
    if selector is not None and not report.nodes:
        # a typo in a selector must not read as "every node ready" to a script
        matched = (f"{len(listing.items)} node(s) match it, none a GPU node or running the agent"
                   if listing.items else "no node matches it")
        print(f"gpu-tune: error: --selector {selector!r}: {matched}", file=sys.stderr)
        return 1
    return report.exit_code


def _prog_name() -> str:
    """``kubectl gpu-tune`` when run as the kubectl plugin ``kubectl-gpu_tune``."""
    name = os.path.basename(sys.argv[0] or "")
    return "kubectl gpu-tune" if name.startswith("kubectl-") else "gpu-tune"


def main(argv: list[str] | None = None) -> None:
    cmd = typer.main.get_command(app)
    try:
        rv = cmd.main(args=argv, prog_name=_prog_name(), standalone_mode=False)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except _cx.UsageError as exc:
        hint = f" (see {_prog_name()} {exc.ctx.info_name + ' ' if exc.ctx and exc.ctx.parent else ''}--help)"
        print(f"gpu-tune: error: {exc.format_message()}{hint}", file=sys.stderr)
        sys.exit(2)
    except _cx.ClickException as exc:
        print(f"gpu-tune: error: {exc.format_message()}", file=sys.stderr)
        sys.exit(2)
    except typer.Abort:
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
