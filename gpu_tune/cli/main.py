"""``gpu-tune`` (and ``kubectl gpu-tune``, through the plugin executable ``kubectl-gpu_tune``):
the commands registered, in the order ``--help`` lists them, and the exit codes of docs/cli.md."""

from __future__ import annotations

import os
import sys

import typer

from gpu_tune.cli import cluster, evidence, health, host, judge, serve  # noqa: F401  (each module registers its commands)
from gpu_tune.cli.app import _cx, app, set_own_command_line
from gpu_tune.views.text import printable

ORDER = ("profiles", "audit", "apply", "revert", "topology", "check", "set-healthy", "evidence", "probe", "gain",
         "label", "run", "serve", "systemd-units", "fleet")
app.registered_commands.sort(key=lambda c: ORDER.index(c.name) if c.name in ORDER else len(ORDER))


def _prog_name() -> str:
    """``kubectl gpu-tune`` when run as the kubectl plugin ``kubectl-gpu_tune``."""
    name = os.path.basename(sys.argv[0] or "")
    return "kubectl gpu-tune" if name.startswith("kubectl-") else "gpu-tune"


def main(argv: list[str] | None = None) -> None:
    """``gpu-tune ARGV`` (default: this process's own arguments; only then may ``serve`` re-execute
    the process as the agent alone, gpu_tune/serve/lean.py)."""
    set_own_command_line(argv is None)
    cmd = typer.main.get_command(app)
    try:
        rv = cmd.main(args=argv, prog_name=_prog_name(), standalone_mode=False)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except _cx.UsageError as exc:
        hint = f" (see {_prog_name()} {exc.ctx.info_name + ' ' if exc.ctx and exc.ctx.parent else ''}--help)"
        print(f"gpu-tune: error: {printable(exc.format_message(), one_line=True)}{hint}", file=sys.stderr)
        sys.exit(2)
    except _cx.ClickException as exc:
        print(f"gpu-tune: error: {printable(exc.format_message(), one_line=True)}", file=sys.stderr)
        sys.exit(2)
    except typer.Abort:
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)
