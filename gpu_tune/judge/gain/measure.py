"""``gpu-tune gain``: what the profile gains, or loses, on this node, measured with an interval.

Two sides of the probe's launch-bound regime (batch 256, short steps: the host path the profile
tunes), each run in its own process as a job would run:

- **untuned**: the host as the profile's originals leave it (nothing applied, or every journalled
  original restored), the probe process unbound (no CPU or memory binding) and with the system
  allocator (no ``LD_PRELOAD``);
- **tuned**: the profile applied, the probe bound to its GPU's NUMA node with the profile's
  allocator preload, exactly as ``gpu-tune run`` launches jobs (:mod:`gpu_tune.launch.runner`).

Runs are interleaved A/B/B/A/A/B… (pair *i* is untuned-then-tuned for even *i*, tuned-then-untuned
for odd *i*), so drift, warm-up and a neighbour's load fall on both sides. Every switch goes through
the engine: to tuned is :func:`gpu_tune.tune.engine.apply` (originals journalled before any write), to
untuned is :func:`gpu_tune.tune.engine.revert`. A SIGKILL at any moment therefore loses nothing:
``gpu-tune revert`` restores every original byte for byte. At the end the host is left as it was
found (tuned when the journal held originals at the start, else untuned), or tuned with ``keep``.

The statistics are in :mod:`gpu_tune.judge.gain.stats`. Nothing here imports TensorFlow.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from gpu_tune.errors import GpuTuneError, InputError
from gpu_tune.judge.gain.stats import GAIN, INCONCLUSIVE, LOSS, SAME, compare
from gpu_tune.host.parse import format_cpulist

log = logging.getLogger("gpu_tune")

UNTUNED, TUNED = "untuned", "tuned"
REGIME = "launch_bound"
DEFAULT_PAIRS = 3
MAX_PAIRS = 50
# (measure, higher is better, where it is in the workload's launch-bound result)
MEASURES: tuple[tuple[str, bool], ...] = (
    ("images_per_second", True),
    ("step_p50_seconds", False),
    ("step_p99_seconds", False),
    ("jitter_p99_over_p50", False),
)
GAIN_ARGS = ("--launch-bound-only", "--step-times")


class GainRefused(GpuTuneError):
    """The comparison will not run here (a busy GPU, a NUMA node this process may not use)."""

    exit_code = 1


def interleaved(pairs: int) -> list[tuple[int, str]]:
    """``[(pair, side), ...]`` in run order: A B, B A, A B, … (A = untuned, B = tuned)."""
    out: list[tuple[int, str]] = []
    for i in range(pairs):
        out += [(i, UNTUNED), (i, TUNED)] if i % 2 == 0 else [(i, TUNED), (i, UNTUNED)]
    return out


@dataclass(frozen=True)
class GainTarget:
    """One GPU (or the CPU run) measured both ways."""

    label: str
    untuned: Any  # ProbeTarget
    tuned: Any  # ProbeTarget
    device: str

    def side(self, name: str) -> Any:
        return self.tuned if name == TUNED else self.untuned


def _describe(t: Any) -> dict[str, Any]:
    cpus = format_cpulist(t.expected_cpus) if t.expected_cpus is not None else None
    pre = str(t.env.get("LD_PRELOAD", "")) or None
    return {"numa_node": t.expected_node, "cpus": cpus, "bound": bool(t.prefix),
            "allocator": "jemalloc" if pre and "jemalloc" in pre else "system", "ld_preload": pre}


def plan_gain_targets(topology: Any, profile: Any, backend: Any, *, gpu: str | None, force: bool) -> list[GainTarget]:
    """The tuned targets are the probe's own (bound as ``gpu-tune run`` binds); each untuned twin
    runs the same device unbound with the system allocator. Raises :class:`GainRefused` for a busy
    GPU (unless ``force``) or a target that cannot be bound here."""
    from gpu_tune.judge import probe as probe_mod

    gpus = [g for g in (getattr(topology, "gpus", None) or []) if getattr(g, "gpu_index", None) is not None]
    if gpus:
        tuned = probe_mod.plan_targets(topology, profile, backend, gpu=gpu or "all", device="gpu")
    else:
        if gpu not in (None, "all"):
            raise InputError(f"--gpu {gpu}: no GPU on this host; leave --gpu out to compare on the CPU")
        nodes = [n.id for n in getattr(topology, "numa_nodes", ()) or () if n.cpus]
        # No GPU: the CPU run bound to the first NUMA node stands for a job's binding.
        tuned = probe_mod.plan_targets(topology, profile, backend, gpu=None, device="cpu",
                                       numa_node=nodes[0] if nodes else None)
    out: list[GainTarget] = []
    for t in tuned:
        if t.skip:
            log.warning("GPU %s: %s", t.label, t.skip)
            continue
        if t.gpu_index is not None and not force:
            try:
                pids = list(backend.processes(t.gpu_index)) if backend is not None else []
            except Exception as exc:  # noqa: BLE001 - cannot tell: refuse rather than disturb work
                raise GainRefused(f"GPU {t.gpu_index}: cannot list its processes ({exc}); --force to compare anyway") from None
            if pids:
                raise GainRefused(f"GPU {t.gpu_index} is busy with {len(pids)} other process(es) (pid "
                                  f"{', '.join(map(str, pids[:8]))}): a comparison would disturb that work and be "
                                  "disturbed by it; --force to compare anyway")
        if t.blocked:
            raise GainRefused(f"GPU {t.label}: {t.blocked}")
        env = {k: v for k, v in t.env.items() if k == "CUDA_VISIBLE_DEVICES"}
        env["LD_PRELOAD"] = ""  # the system allocator, even where this process itself preloads one
        env.pop("MALLOC_CONF", None)
        try:
            mine = frozenset(os.sched_getaffinity(0))
        except OSError:
            mine = None
        untuned = replace(t, prefix=[], env=env, expected_cpus=mine, expected_node=None, notes=())
        out.append(GainTarget(t.label, untuned, t, t.device or ("gpu" if t.gpu_index is not None else "cpu")))
    if not out:
        raise GainRefused("nothing to compare: every GPU was skipped")
    return out


# -- one side, one run ----------------------------------------------------------------------------
def _figures(result: dict[str, Any]) -> dict[str, float | None]:
    lb = ((result.get("regimes") or {}).get(REGIME)) or {}
    steps = lb.get("step_seconds") or {}

    def num(x: Any) -> float | None:
        return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None

    return {"images_per_second": num(lb.get("images_per_second")), "step_p50_seconds": num(steps.get("p50")),
            "step_p99_seconds": num(steps.get("p99")), "jitter_p99_over_p50": num(steps.get("p99_over_p50"))}


def run_side(target: Any, policy: Any, *, device: str, data: str | None, window: float | None,
             timeout: float, module: str | None = None) -> dict[str, Any]:
    """Run the workload once for ``target``; the run's figures, or its failure, as a document."""
    from gpu_tune.judge.probe.run import WORKLOAD_MODULE, _child_env, run_once, workload_args

    module = module or os.environ.get("GPU_TUNE_PROBE_MODULE") or WORKLOAD_MODULE
    cmd = list(target.prefix) + [sys.executable, "-m", module, "--device", device] + workload_args(policy)
    cmd += list(GAIN_ARGS)
    if window is not None:
        cmd += ["--window-seconds", f"{window:g}"]
    if data:
        cmd += ["--data", data]
    env = _child_env(target, device, module)
    if target.env.get("LD_PRELOAD") == "":  # the untuned side: the system allocator
        env.pop("LD_PRELOAD", None)
        env.pop("MALLOC_CONF", None)
    t0 = time.monotonic()
    run = run_once(cmd, env, timeout)
    doc: dict[str, Any] = {"seconds": round(time.monotonic() - t0, 3)}
    res = run.result or {}
    if run.status != "ok" or not res.get("ok"):
        reason = run.reason or str(res.get("error") or "the workload reported no result")
        return {**doc, "ok": False, "reason": reason, "stderr_tail": run.stderr_tail[-600:]}
    host = res.get("host") or {}
    figs = _figures(res)
    if figs["images_per_second"] is None:
        return {**doc, "ok": False, "reason": "no launch-bound images/s in the result"}
    return {**doc, "ok": True, **figs,
            "host": {k: host.get(k) for k in ("cpu_affinity", "mems_allowed", "jemalloc_mapped", "ld_preload")},
            "steps": (res.get("regimes") or {}).get(REGIME, {}).get("steps"),
            "step_seconds_all": (res.get("regimes") or {}).get(REGIME, {}).get("step_seconds_all")}


# -- the comparison -------------------------------------------------------------------------------
@dataclass
class Switcher:
    """Moves the host between untuned (journalled originals restored) and tuned (profile applied),
    only through the engine's apply and revert."""

    ctx: Any
    state: str
    log: list[dict[str, Any]] = field(default_factory=list)

    def to(self, side: str) -> None:
        from gpu_tune.tune import engine

        if side == self.state:
            return
        t0 = time.monotonic()
        if side == TUNED:
            report = engine.apply(self.ctx)
            changed = sum(1 for r in report.settings if r.changed)
            ok = report.compliant
            detail = "" if ok else "; ".join(f"{r.id}[{r.target}]: {r.detail}" for r in report.settings
                                              if r.status in ("drift", "error", "conflict"))[:400]
        else:
            ok, rows = engine.revert(self.ctx)
            changed = sum(1 for r in rows if r.changed)
            detail = "" if ok else "; ".join(f"{r.id}[{r.target}]: {r.detail}" for r in rows if r.status != "ok")[:400]
        self.state = side
        self.log.append({"to": side, "changed": changed, "ok": ok, "seconds": round(time.monotonic() - t0, 3),
                         **({"detail": detail} if detail else {})})


def found_state(fs: Any) -> str:
    """``tuned`` when the journal holds originals (an earlier apply left the host tuned), else
    ``untuned``."""
    from gpu_tune.tune.journal import Journal

    return TUNED if Journal(fs).load().entries else UNTUNED


def measure_gain(*, fs: Any, profile: Any, backend: Any, topology: Any, gpu: str | None = None,
                 pairs: int = DEFAULT_PAIRS, keep: bool = False, force: bool = False, data: str | None = None,
                 window: float | None = None, timeout: float | None = None,
                 runner: Callable[..., dict[str, Any]] = run_side,
                 progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Plan, run the interleaved pairs, restore, judge. Returns the ``gpu-tune gain -o json`` document."""
    from gpu_tune.tune import engine

    if not 1 <= int(pairs) <= MAX_PAIRS:
        raise InputError(f"--pairs {pairs}: expected 1..{MAX_PAIRS}")
    if window is not None and not 0 < window <= 600:
        raise InputError(f"--window {window}: expected 0 < S <= 600")
    targets = plan_gain_targets(topology, profile, backend, gpu=gpu, force=force)
    limit = float(timeout if timeout is not None else profile.probe.timeout_s)
    found = found_state(fs)
    sw = Switcher(engine.make_context(fs, profile, backend), found)
    order = interleaved(int(pairs))
    runs: dict[str, list[dict[str, Any]]] = {t.label: [] for t in targets}
    started, t0 = time.time(), time.monotonic()
    end = TUNED if keep or found == TUNED else UNTUNED
    try:
        for k, (pair, side) in enumerate(order):
            sw.to(side)
            for t in targets:
                if progress:
                    progress(f"run {k + 1}/{len(order)}: pair {pair + 1}, {side}, {'GPU ' + t.label if t.label != 'cpu' else 'CPU'}")
                doc = runner(t.side(side), profile.probe, device=t.device, data=data, window=window, timeout=limit)
                runs[t.label].append({"order": k, "pair": pair, "side": side, **doc})
    finally:
        try:
            sw.to(end)
        except Exception as exc:  # noqa: BLE001 - say it loudly; the journal still holds every original
            log.error("could not leave the host %s (%s): `gpu-tune revert` restores the originals", end, exc)
            sw.log.append({"to": end, "ok": False, "detail": str(exc)})
    results = [_judge_target(t, runs[t.label]) for t in targets]
    return {
        "profile": profile.name, "regime": REGIME, "pairs": int(pairs),
        "order": [side for _, side in order], "found": found, "ended": sw.state, "kept": bool(keep),
        "host_left_as_asked": sw.state == end and all(s.get("ok", False) for s in sw.log[-1:]),
        "window_seconds": window, "measured_at": _rfc3339(started),
        "duration_seconds": round(time.monotonic() - t0, 3), "switches": sw.log,
        "verdict": overall_verdict(results), "targets": results,
    }


def _rfc3339(t: float) -> str:
    from gpu_tune.timestamps import format_rfc3339

    return format_rfc3339(t)


def _judge_target(t: GainTarget, runs: list[dict[str, Any]]) -> dict[str, Any]:
    by_pair: dict[int, dict[str, dict[str, Any]]] = {}
    for r in runs:
        by_pair.setdefault(r["pair"], {})[r["side"]] = r
    complete = [p for _, p in sorted(by_pair.items()) if all(p.get(s, {}).get("ok") for s in (UNTUNED, TUNED))]
    failed = [f"pair {r['pair'] + 1} {r['side']}: {r.get('reason')}" for r in runs if not r.get("ok")]
    measures = {}
    for name, higher in MEASURES:
        u = [p[UNTUNED].get(name) for p in complete]
        v = [p[TUNED].get(name) for p in complete]
        keep = [(a, b) for a, b in zip(u, v) if a is not None and b is not None]
        measures[name] = compare(name, [a for a, _ in keep], [b for _, b in keep], higher_is_better=higher).as_dict()
    slim = [{k: v for k, v in r.items() if k not in ("step_seconds_all", "stderr_tail")} for r in runs]
    return {"gpu": t.label, "device": t.device, "untuned": _describe(t.untuned), "tuned": _describe(t.tuned),
            "pairs_complete": len(complete), "failed_runs": failed,
            "verdict": measures["images_per_second"]["verdict"], "measures": measures, "runs": slim}


def overall_verdict(targets: Sequence[dict[str, Any]]) -> str:
    """The node's verdict from its targets' images/s verdicts: a loss anywhere is a loss; else
    inconclusive anywhere is inconclusive; else a gain anywhere is a gain; else no difference."""
    vs = [t.get("verdict") for t in targets]
    for v in (LOSS, INCONCLUSIVE, GAIN):
        if v in vs:
            return v
    return SAME if vs else INCONCLUSIVE


def exit_code(doc: dict[str, Any]) -> int:
    """0: a gain or no significant difference, and the host left as asked; 1 otherwise."""
    if not doc.get("host_left_as_asked"):
        return 1
    return 0 if doc.get("verdict") in (GAIN, SAME) else 1


# -- table -----------------------------------------------------------------------------------------
_UNITS = {"images_per_second": ("images/s", 1.0, "{:,.0f}"), "step_p50_seconds": ("step p50 ms", 1e3, "{:.2f}"),
          "step_p99_seconds": ("step p99 ms", 1e3, "{:.2f}"), "jitter_p99_over_p50": ("jitter p99/p50", 1.0, "{:.3f}")}


def render_gain(doc: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from gpu_tune.views.text import printable

    blocks: list[Any] = []
    for t in doc["targets"]:
        who = "CPU" if t["gpu"] == "cpu" else f"GPU {t['gpu']}"
        title = (f"gain: profile {doc['profile']}, {who}, launch-bound regime, {t['pairs_complete']}/{doc['pairs']} "
                 f"pairs ({' '.join('A' if s == UNTUNED else 'B' for s in doc['order'])})")
        tab = Table(title=title, header_style="bold", title_justify="left")
        for col in ("measure", "untuned (A)", "tuned (B)", "tuned/untuned [95% interval]", "verdict"):
            tab.add_column(col)
        for name, m in t["measures"].items():
            label, scale, fmt = _UNITS[name]
            mu = "-" if m["median_untuned"] is None else fmt.format(m["median_untuned"] * scale)
            mt = "-" if m["median_tuned"] is None else fmt.format(m["median_tuned"] * scale)
            change = m["change"] if m["ratio"] is not None else "-"
            verdict = m["verdict"]
            style = {"loss": "bold red", "gain": "green", "inconclusive": "yellow"}.get(verdict, "")
            tab.add_row(label, mu, mt, change, Text(verdict.upper() if verdict == LOSS else verdict, style=style))
        blocks.append(tab)
        u, b = t["untuned"], t["tuned"]
        blocks.append(Text(f"  A untuned: {'bound' if u['bound'] else 'unbound'}, {u['allocator']} allocator, host as "
                           f"the originals leave it; B tuned: NUMA node {b['numa_node']}, CPUs {b['cpus']}, "
                           f"{b['allocator']} allocator, profile applied"))
        for f in t["failed_runs"]:
            blocks.append(Text(printable(f"  failed run: {f}"), style="red"))
    v = doc["verdict"]
    if v == LOSS:
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
