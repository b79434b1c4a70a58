"""The host commands: ``profiles``, ``audit``, ``apply``, ``revert``, ``topology``, ``run``."""


import sys
from typing import Annotated, Optional

import typer

from gpu_tune.cli.app import (
    Globals,
    Mode,
    ProfileOpt,
    check_journal,
    command,
    console,
    gpu_backend,
    open_host,
    print_json,
    profile_of,
    to_journal,
)
from gpu_tune.errors import InputError


@command("profiles", help="List the profiles with their summaries.")
def profiles_cmd(g: Globals) -> int:
    from gpu_tune.judge.policy import policy_of
    from gpu_tune.tune.policy import load_all

    profiles = load_all(g.policy_dir)
    digests = [policy_of(p).digest for p in profiles]  # the operator's policy checked whole, as everywhere
    if g.output == "json":
        print_json({"profiles": [{"name": p.name, "summary": p.summary, "digest": d}
                                 for p, d in zip(profiles, digests)]})
        return 0
    from rich.table import Table

    from rich.text import Text

    from gpu_tune.views.text import printable

    t = Table(header_style="bold")
    t.add_column("profile")
    t.add_column("summary")
    for p in profiles:
        t.add_row(Text(printable(p.name)), Text(printable(p.summary)))
    console().print(t)
    return 0


def _emit_report(g: Globals, report, title: str, *, show_changed: bool = False) -> None:
    if g.output == "json":
        print_json(report.as_dict())
        return
    from gpu_tune.views.settings import settings_lines, settings_table, summary_line

    if to_journal():  # a unit's output: one line a setting, not a table (docs/systemd.md)
        print("\n".join(settings_lines(title, report.settings, show_changed=show_changed)), flush=True)
        return
    c = console()
    c.print(settings_table(title, report.settings, show_changed=show_changed))
    verdict = "[green]compliant[/]" if report.compliant else "[yellow]not compliant[/]"
    c.print(f"{summary_line(report.settings)} → {verdict}")


@command("audit", help="Read-only: each setting's current vs desired value. Exit 0 compliant, 1 drift.")
def audit_cmd(g: Globals, profile: ProfileOpt = "training") -> int:
    from gpu_tune.tune.engine import audit, make_context

    prof = profile_of(g, profile)
    fs = open_host(g)
    report = audit(make_context(fs, prof, gpu_backend(g)))
    _emit_report(g, report, f"audit: profile {prof.name} on {fs.root}")
    return 0 if report.compliant else 1


@command("apply", help="Record originals, change what differs, verify. Exit 0 applied and verified, 1 not.")
def apply_cmd(
    g: Globals,
    profile: ProfileOpt = "training",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would change; change nothing")] = False,
    agent_mode: Annotated[Optional[Mode], typer.Option(
        "--agent-mode", case_sensitive=False, help="The agent's mode, as gpu-tune-apply.service passes "
        "GPU_TUNE_MODE: audit and enforce apply; revert applies nothing and restores the recorded originals "
        "instead (the node boots untuned, as the agent in revert mode leaves it)")] = None,
) -> int:
    from gpu_tune.tune.engine import apply, make_context

    if agent_mode is Mode.revert and not dry_run:
        print("gpu-tune: agent mode revert: nothing applied; restoring the originals earlier applies recorded",
              file=sys.stderr, flush=True)
        return _revert(g)
    prof = profile_of(g, profile)
    fs = open_host(g)
    if not dry_run:
        check_journal(fs)
    report = apply(make_context(fs, prof, gpu_backend(g)), dry=dry_run)
    title = f"apply{' --dry-run' if dry_run else ''}: profile {prof.name} on {fs.root}"
    _emit_report(g, report, title, show_changed=True)
    if dry_run:
        return 0
    return 0 if report.compliant else 1


@command("revert", help="Restore every original recorded by earlier applies. Exit 0 restored, 1 not.")
def revert_cmd(g: Globals) -> int:
    return _revert(g)


def _revert(g: Globals) -> int:
    from gpu_tune.tune.engine import Context, revert

    fs = open_host(g)
    check_journal(fs)
    gpu = None
    try:
        gpu = gpu_backend(g)
    except InputError:
        raise
    ok, rows = revert(Context(fs=fs, profile=None, gpu=gpu))
    if g.output == "json":
        print_json({"restored": ok, "settings": [r.as_dict() for r in rows]})
    elif to_journal() and rows:
        from gpu_tune.views.settings import settings_lines

        print("\n".join(settings_lines(f"revert on {fs.root}", rows, show_changed=True)), flush=True)
    else:
        c = console()
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

    topo = discover(open_host(g), gpu_backend(g))
    if g.output == "json":
        print_json(topo.as_dict())
    else:
        from gpu_tune.views.topology import render_topology

        console().print(render_topology(topo))
    return 0


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
    prof = profile_of(g, profile)
    backend = gpu_backend(g) if gpu is not None else None
    topo = discover(open_host(g), backend)
    binding = runner.binding_for_profile(topo, prof, gpu=gpu, numa_node=numa_node)
    runner.exec_run(binding, prof, argv)
    return 3  # exec_run does not return
