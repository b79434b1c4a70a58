"""``gpu-tune check``'s table: every readiness check, failing fatal ones first, then warnings,
then the passing ones, each with the severity it ran with and where that came from (the catalog or
the profile's key); the verdict's reason and message above it; the checks the profile turns off and
the profile's digest below it."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from gpu_tune.views.text import printable


def render_checks(v: Any, *, host: Any = None) -> Group:
    state = Text("ready", style="green") if v.ready else Text("not ready", style="bold red")
    head = Text.assemble("node ", state, f": {v.reason()}: {printable(v.message(), one_line=True)}" if not v.ready
                         else f": {printable(v.message(), one_line=True)}")
    t = Table(show_header=True, header_style="bold", expand=False, show_lines=False)
    t.add_column("check", no_wrap=True)
    t.add_column("status", no_wrap=True)
    t.add_column("severity", no_wrap=True)
    t.add_column("from", overflow="fold")
    t.add_column("detail", overflow="fold")

    def order(c: Any) -> tuple[int, int]:
        if not c.ok:
            return (0 if c.gating else 1, 0)
        return (2, 0)

    for c in sorted(v.checks, key=order):
        status = (Text("ok", style="green") if c.ok else
                  Text("FAIL", style="bold red") if c.gating else Text("warn", style="yellow"))
        t.add_row(Text(printable(c.name, one_line=True)), status, c.severity,
                  Text(printable(getattr(c, "severity_from", "catalog"), one_line=True)), Text(printable(c.detail)))
    parts: list[Any] = [head, t]
    for name, w in getattr(v, "off", ()):
        parts.append(Text(printable(f"{name}: off by {w.by} (not evaluated)", one_line=True), style="dim"))
    pol = getattr(v, "policy", None)
    if pol is not None and pol.digest:
        parts.append(Text(printable(f"profile {pol.profile}, digest {pol.digest}", one_line=True), style="dim"))
    log = getattr(host, "kernel_log", None)
    if log is not None and not log.error:
        extra = f", {log.lost} overwritten before read" if log.lost else ""
        parts.append(Text(f"kernel log: {printable(log.source, one_line=True)}, {log.scanned:,} records read{extra}",
                          style="dim"))
    return Group(*parts)
