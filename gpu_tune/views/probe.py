"""The ``gpu-tune probe`` table: one block per target (GPU or CPU)."""

from __future__ import annotations

from typing import Any, Sequence

from gpu_tune.judge.figures import host_bandwidth, memory_bandwidth, numa_node_of
from gpu_tune.judge.probe.baselines import REGIME_WORDS
from gpu_tune.judge.probe.judge import regime_figures
from gpu_tune.judge.probe.run import ProbeVerdict
from gpu_tune.views.text import markup_safe as _m

# Timing keys shown in the "seconds" row, in the order they happen, with their short names.
TIMING_ROWS = (("tensorflow_import_seconds", "import"), ("launch_bound_compile_seconds", "compile"),
               ("launch_bound_window_seconds", "launch window"), ("device_bound_compile_seconds", "compile"),
               ("device_bound_window_seconds", "device window"), ("inference_seconds", "inference"),
               ("correctness_train_seconds", "correctness"), ("evaluate_seconds", "evaluate"))


def _regime_line(fig: dict[str, Any]) -> str:
    ips = fig.get("images_per_second")
    text = f"{ips:,.0f} images/s" if isinstance(ips, (int, float)) else "?"
    if fig.get("batch_size"):
        text += f" at batch {fig['batch_size']:,}"
    busy = fig.get("gpu_busy_fraction")
    if isinstance(busy, (int, float)):
        text += f", GPU busy {busy:.0%}"
    return text


def _timings_line(r: dict[str, Any]) -> str | None:
    t = r.get("timings") or {}
    total = r.get("time_to_verdict_seconds")
    parts = [f"{name} {t[key]:.1f}" for key, name in TIMING_ROWS if isinstance(t.get(key), (int, float))]
    if not parts:
        return None
    head = f"{total:.1f} s to verdict: " if isinstance(total, (int, float)) else ""
    return head + ", ".join(parts)


def _datapath_line(r: dict[str, Any]) -> str | None:
    """Host<->GPU bandwidth per side (local, remote) and direction, or why it was not measured."""
    bw = r.get("bandwidth")
    if not isinstance(bw, dict):
        return None
    if bw.get("status") != "measured":
        return str(bw.get("reason") or bw.get("status"))
    figs = host_bandwidth(r)
    parts = []
    for side in ("local", "remote"):
        h2d, d2h = figs.get((side, "h2d")), figs.get((side, "d2h"))
        node = numa_node_of(r, side)
        where = f"{side} (node {node})" if node is not None else side
        if h2d is None and d2h is None:
            why = (bw.get(side) or {}).get("reason")
            if side == "remote" and why:
                parts.append(f"{side}: {why}")
            continue
        parts.append(f"{where}: to the GPU {h2d / 1e9:.1f} GB/s, from it {d2h / 1e9:.1f} GB/s"
                     if h2d is not None and d2h is not None else f"{where}: incomplete")
    took = (r.get("timings") or {}).get("bandwidth_seconds")
    if isinstance(took, (int, float)):
        parts.append(f"measured in {took:.1f} s, while TensorFlow imported")
    return "; ".join(parts)


def render_probe_table(verdicts: Sequence[ProbeVerdict]):
    from rich.console import Group
    from rich.table import Table

    style = {"passed": "green", "skipped": "yellow"}
    blocks = []
    for v in verdicts:
        r = v.result or {}
        dev = r.get("device") or {}
        acc = r.get("accuracy")
        infer = r.get("inference_images_per_second") or {}
        host = r.get("host") or {}
        cfg = r.get("config") or {}
        t = Table(title=f"MNIST probe: {'GPU ' + _m(v.gpu, one_line=True) if v.gpu != 'cpu' else 'CPU'}",
                  title_justify="left", show_header=False, box=None, pad_edge=False)
        t.add_column("field", style="bold", no_wrap=True)
        t.add_column("value", overflow="fold")
        t.add_row("status", f"[{style.get(v.status, 'red')}]{_m(v.status)}[/] after {v.attempts} attempt(s), "
                            f"{v.duration_seconds:.1f} s")
        if dev:
            cc = f", compute capability {dev['compute_capability']}" if dev.get("compute_capability") else ""
            t.add_row("device", _m(f"{dev.get('kind', '?')}: {dev.get('name', '?')}{cc}"))
        if isinstance(acc, (int, float)):
            c = r.get("correctness") or {}
            work = f" after {c['steps']} steps of {c['batch_size']} (fixed work)" if c.get("steps") else ""
            t.add_row("accuracy", _m(f"{acc:.4f}{work}"))
        if r.get("fingerprint"):
            t.add_row("fingerprint", _m(f"{r['fingerprint']}  ({r.get('peer_group') or 'peer group unknown'})"))
        for regime, fig in regime_figures(r).items():
            t.add_row(f"train {REGIME_WORDS.get(regime, regime)}", _m(_regime_line(fig)))
        if cfg.get("precision"):
            t.add_row("settings", _m(f"{cfg['precision']}, XLA {'on' if cfg.get('xla') else 'off'}"
                                     + (f", {cfg['threads']} CPU threads" if cfg.get("threads") else "")))
        if infer:
            t.add_row("inference", _m(", ".join(f"batch {b}: {x:,.0f}/s" for b, x in infer.items()
                                                if isinstance(x, (int, float)))))
        path = _datapath_line(r)
        if path:
            t.add_row("host<->GPU", _m(path))
        mem = memory_bandwidth(r)
        if mem is not None:
            t.add_row("GPU memory", _m(f"{mem / 1e9:,.0f} GB/s (device-to-device copies, read + write)"))
        timing = _timings_line(r)
        if timing:
            cc = r.get("compile_cache") or {}
            if cc.get("status") not in (None, "off"):
                timing += f"; compilation cache {cc['status']}"
            t.add_row("seconds", _m(timing))
        if host:
            binding = f"CPUs {host.get('cpu_affinity')}, memory nodes {host.get('mems_allowed')}, " \
                      f"policy {host.get('mempolicy')}, jemalloc {'mapped' if host.get('jemalloc_mapped') else 'not mapped'}"
            t.add_row("binding", _m(binding))
        for reason in v.reasons:
            t.add_row("[red]reason[/]" if v.status != "skipped" else "reason", _m(reason))
        for note in v.notes:
            t.add_row("note", _m(note))
        if v.stderr_tail and v.status in ("crashed", "error", "timeout"):
            t.add_row("stderr", _m(v.stderr_tail[-600:]))
        blocks.append(t)
    return Group(*blocks)
