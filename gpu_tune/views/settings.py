"""Human output: rich tables for settings rows, grouped so a 224-CPU node reads at a glance."""

from __future__ import annotations

import re
from typing import Iterable

from gpu_tune.tune.model import Setting
from gpu_tune.host.parse import format_cpulist
from gpu_tune.views.text import markup_safe, printable

STATUS_STYLE = {
    "ok": "green",
    "drift": "yellow",
    "unsupported": "dim",
    "conflict": "magenta",
    "error": "bold red",
}

_NUM_TARGET = re.compile(r"^([a-z]*)(\d+)$")
# A table shows at most this many lines (groups of rows); the rest are counted under it. A
# journal of 100,000 originals would otherwise be rendered whole, in memory, before a line shows.
MAX_TABLE_GROUPS = 200


def compress_targets(targets: list[str]) -> str:
    """``cpu0, cpu1, ..., cpu223`` -> ``cpu0-223``; IRQs ``120, 121, 122`` -> ``120-122``."""
    if len(targets) == 1:
        return targets[0]
    prefixes: dict[str, list[int]] = {}
    other: list[str] = []
    for t in targets:
        m = _NUM_TARGET.match(t)
        if m:
            prefixes.setdefault(m.group(1), []).append(int(m.group(2)))
        else:
            other.append(t)
    parts = []
    for prefix, nums in prefixes.items():
        listed = format_cpulist(nums)
        parts.append(f"{prefix}{listed}" if prefix else listed)
    parts.extend(other)
    text = ",".join(parts)
    if len(targets) > 1:
        text += f" ({len(targets)})"
    return text


# Per-target readings that should not split a group (an IRQ's effective CPU).
_VOLATILE_DETAIL = re.compile(r";?\s*effective (affinity )?[0-9,-]+")


def group_rows(rows: Iterable[Setting]) -> list[tuple[Setting, list[str]]]:
    """Merge rows equal in everything but the target, keeping first-seen order."""
    groups: dict[tuple, tuple[Setting, list[str]]] = {}
    for r in rows:
        detail = _VOLATILE_DETAIL.sub("", r.detail).strip()
        key = (r.id, r.current, r.desired, r.status, detail, r.changed)
        if key in groups:
            groups[key][1].append(r.target)
        else:
            groups[key] = (r.with_(detail=detail) if detail != r.detail else r, [r.target])
    return list(groups.values())


def _shown(groups: list[tuple[Setting, list[str]]], limit: int) -> tuple[list[tuple[Setting, list[str]]], str]:
    """At most ``limit`` groups, those that need attention (not ``ok``) first, each kind in its
    order; and what was left out, counted by status, in words ('' when nothing was)."""
    if len(groups) <= limit:
        return groups, ""
    keep = sorted(range(len(groups)), key=lambda i: (groups[i][0].status == "ok", i))[:limit]
    kept = set(keep)
    left: dict[str, int] = {}
    for i, (row, targets) in enumerate(groups):
        if i not in kept:
            left[row.status] = left.get(row.status, 0) + len(targets)
    shown = [groups[i] for i in sorted(keep)]
    counts = ", ".join(f"{n:,} {s}" for s, n in sorted(left.items(), key=lambda kv: -kv[1]))
    return shown, (f"{sum(left.values()):,} more rows not shown ({counts}); "
                   "-o json lists every row")


def settings_table(title: str, rows: Iterable[Setting], *, show_changed: bool = False,
                   limit: int = MAX_TABLE_GROUPS):
    """The rows as one table, grouped; at most ``limit`` lines (those not ``ok`` first), the
    rest counted in the caption."""
    from rich.table import Table
    from rich.text import Text

    groups, left_out = _shown(group_rows(rows), limit)
    table = Table(title=markup_safe(title, one_line=True), title_justify="left", header_style="bold", expand=False,
                  caption=left_out or None, caption_justify="left")
    table.add_column("setting", no_wrap=True)
    table.add_column("target", overflow="fold", max_width=28)
    table.add_column("current → desired", overflow="fold")
    table.add_column("status", no_wrap=True)
    if show_changed:
        table.add_column("changed", no_wrap=True)
    table.add_column("detail", overflow="fold", max_width=60)
    for row, targets in groups:
        cur = "—" if row.current is None else printable(row.current)
        arrow = Text(cur)
        # an ok row whose desired value is a bound (≥ 1048576) or a budget satisfies it: no arrow
        satisfied = row.status == "ok" and (row.desired or "")[:1] in ("≥", "≤")
        if row.current != row.desired and not satisfied:
            arrow.append(" → ")
            arrow.append(printable(row.desired) or "—", style="bold")
        cells = [Text(printable(row.id)), Text(printable(compress_targets(targets))), arrow,
                 Text(printable(row.status), style=STATUS_STYLE.get(row.status, ""))]
        if show_changed:
            cells.append(Text("yes" if row.changed else ""))
        cells.append(Text(printable(row.detail)))
        table.add_row(*cells)
    return table


def summary_line(rows: Iterable[Setting]) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    order = ["ok", "drift", "conflict", "error", "unsupported"]
    return ", ".join(f"{counts[s]} {s}" for s in order if s in counts) or "nothing to check"


def settings_lines(title: str, rows: Iterable[Setting], *, show_changed: bool = False,
                   limit: int = MAX_TABLE_GROUPS) -> list[str]:
    """The rows as plain lines, one per group, for the journal (``gpu-tune-apply.service``): a
    table at 80 columns spread 17 rows over 158 journal lines. Each line names its status, setting,
    targets, values and detail; the summary comes last (what ``systemctl status`` shows)."""
    rows = list(rows)
    groups, left_out = _shown(group_rows(rows), limit)
    out = [printable(title, one_line=True)]
    for row, targets in groups:
        cur = "-" if row.current is None else printable(row.current, one_line=True)
        satisfied = row.status == "ok" and (row.desired or "")[:1] in ("≥", "≤")  # a bound it meets: no arrow
        values = cur if row.current == row.desired or not row.desired or satisfied else \
            f"{cur} -> {printable(row.desired, one_line=True)}"
        changed = ", changed" if show_changed and row.changed else ""
        detail = f": {printable(row.detail, one_line=True)}" if row.detail else ""
        out.append(f"{row.status}{changed} {printable(row.id, one_line=True)} "
                   f"[{printable(compress_targets(targets), one_line=True)}] {values}{detail}")
    if left_out:
        out.append(left_out)
    n_changed = sum(1 for r in rows if r.changed)
    changed = f"{n_changed} changed; " if show_changed else ""
    compliant = all(r.status in ("ok", "unsupported") for r in rows)
    out.append(f"{printable(title, one_line=True)}: {changed}{summary_line(rows)} -> "
               f"{'compliant' if compliant else 'not compliant'}")
    return out
