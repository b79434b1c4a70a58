"""``gpu-tune gain``'s tables: the tuned arm (or the A/A arm) against untuned per measure, and with
``--per-setting`` one line per setting family."""

from __future__ import annotations

from typing import Any

from gpu_tune.judge.gain.measure import FAMILY_WORDS, UNTUNED
from gpu_tune.judge.gain.stats import LOSS
from gpu_tune.views.text import printable

_UNITS = {"images_per_second": ("images/s", 1.0, "{:,.0f}"), "step_p50_seconds": ("step p50 ms", 1e3, "{:.2f}"),
          "step_p99_seconds": ("step p99 ms", 1e3, "{:.2f}"), "jitter_p99_over_p50": ("jitter p99/p50", 1.0, "{:.3f}")}
_STYLE = {"loss": "bold red", "gain": "green", "inconclusive": "yellow"}


def _verdict_text(verdict: str) -> Any:
    from rich.text import Text

    return Text(verdict.upper() if verdict == LOSS else verdict, style=_STYLE.get(verdict, ""))


def _level(doc: dict[str, Any]) -> str:
    c = float(doc.get("confidence") or 0.95)
    return f"{c * 100:.3g}%"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def render_gain(doc: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    null = doc.get("mode") == "null"
    blocks: list[Any] = []
    letters = {UNTUNED: "A"}
    for t in doc["targets"]:
        who = "CPU" if t["gpu"] == "cpu" else f"GPU {t['gpu']}"
        seq = " ".join(letters.get(s, "B") for s in doc["order"]) if len(doc.get("arms", [])) <= 2 else \
            f"{len(doc.get('arms', []))} arms a round"
        what = "A/A calibration (both sides untuned)" if null else "launch-bound regime"
        title = (f"gain: profile {doc['profile']}, {who}, {what}, {t['pairs_complete']}/{doc['pairs']} "
                 f"pairs ({seq})")
        tab = Table(title=title, header_style="bold", title_justify="left")
        b_name = "untuned again (B)" if null else "tuned (B)"
        for col in ("measure", "untuned (A)", b_name, f"B/A [{_level(doc)} interval]", "verdict"):
            tab.add_column(col)
        for name, m in t["measures"].items():
            label, scale, fmt = _UNITS[name]
            mu = "-" if m["median_untuned"] is None else fmt.format(m["median_untuned"] * scale)
            mt = "-" if m["median_tuned"] is None else fmt.format(m["median_tuned"] * scale)
            tab.add_row(label, mu, mt, m["change"] if m["ratio"] is not None else "-", _verdict_text(m["verdict"]))
        blocks.append(tab)
        families = t.get("families") or {}
        if families:
            ft = Table(title=f"per setting family, {who}: each alone on top of untuned, images/s against untuned "
                             f"(simultaneous {_level(doc)} intervals)", header_style="bold", title_justify="left")
            for col in ("family", "what", "pairs", f"B/A [{_level(doc)} interval]", "verdict"):
                ft.add_column(col)
            for fam, a in families.items():
                m = a["measures"]["images_per_second"]
                ft.add_row(fam, FAMILY_WORDS.get(fam, fam), str(a["pairs_complete"]),
                           m["change"] if m["ratio"] is not None else "-", _verdict_text(a["verdict"]))
            m = t["measures"]["images_per_second"]
            ft.add_row("tuned", "the whole profile", str(t["pairs_complete"]),
                       m["change"] if m["ratio"] is not None else "-", _verdict_text(t["verdict"]))
            blocks.append(ft)
        u, b = t["untuned"], t["tuned"]
        if null:
            blocks.append(Text("  A and B: unbound, system allocator, host as the originals leave it: any "
                               "difference is the method's own noise"))
        else:
            blocks.append(Text(f"  A untuned: {'bound' if u['bound'] else 'unbound'}, {u['allocator']} allocator, host "
                               f"as the originals leave it; B tuned: NUMA node {b['numa_node']}, CPUs {b['cpus']}, "
                               f"{b['allocator']} allocator, profile applied"))
        busy = t.get("busy") or {}
        if busy.get("cpu_pressure_median") is not None or busy.get("steal_median") is not None:
            blocks.append(Text(f"  while it ran: some task waited for a CPU {_pct(busy.get('cpu_pressure_median'))} "
                               f"of the time, {_pct(busy.get('steal_median'))} of CPU time stolen (medians per run)"))
        for f in t["failed_runs"]:
            blocks.append(Text(printable(f"  failed run: {f}"), style="red"))
    for s in doc.get("skipped_families") or []:
        blocks.append(Text(printable(f"  not measured: {s['family']} ({s['why']})")))
    v = doc["verdict"]
    if null:
        blocks.append(Text(f"A/A verdict: {v}" + ("" if v != LOSS and v != "gain" else
                                                 " (a false alarm: see docs/gain.md for the rate)")))
    elif v == LOSS:
        blocks.append(Text(f"LOSS: profile {doc['profile']} makes the launch-bound regime SLOWER on this node: "
                           "do not keep it here without looking (docs/gain.md)", style="bold red"))
    else:
        blocks.append(Text(f"verdict: {v}"))
    where = f"host left {doc['ended']}" + (" (--keep)" if doc["kept"] else f" as found ({doc['found']})")
    if not doc["host_left_as_asked"]:
        where = (f"host NOT left as asked (now {doc['ended']}, found {doc['found']}): `gpu-tune revert` restores "
                 "the originals")
    blocks.append(Text(f"{where}; {len(doc['switches'])} switch(es) through the journal; "
                       f"{doc['duration_seconds']:.1f} s"))
    return Group(*blocks)


__all__ = ["render_gain"]
