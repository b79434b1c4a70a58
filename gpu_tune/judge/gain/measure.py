"""``gpu-tune gain``: what the profile gains, or loses, on this node, measured with an interval.

The probe's launch-bound regime (batch 256, short steps: the host path the profile tunes) is run
in **arms**, each run its own process as a job would run:

- **untuned** (the control, A): the host as the profile's originals leave it (nothing applied, or
  every journalled original restored), the probe process unbound and with the system allocator;
- **tuned** (B): the profile applied, the probe bound to its GPU's NUMA node with the profile's
  allocator preload, exactly as ``gpu-tune run`` launches jobs (:mod:`gpu_tune.launch.runner`);
- with ``per_setting``, one arm per **setting family** the profile touches on this node, each that
  family alone on top of untuned (:data:`FAMILIES`): host families switched through the engine
  (sysctls, THP, the CPU governor and idle states, GPU persistence mode, IRQ placement), launch
  families by how the probe process starts (NUMA binding, the allocator preload). One family at a
  time, not "all but one": each family's figure is then its own effect against the same control,
  readable without knowing the others, and the tuned arm beside them shows whether the whole is
  more than its parts;
- with ``null``, an **A/A** run: the second arm is the control again, through the same machinery.
  Whatever it reports is the method's own noise: it calibrates the verdicts (docs/gain.md).

Arms run in rounds, each round every arm once, **in an order drawn at random for each round**
(seeded; the seed and the order are in the document). A fixed order (A B, B A, A B, …) cancels a
steady drift, but anything that recurs with the order's own period (a neighbour's job every few
runs, a timer) then falls on the same arm every time, and on this VM an A/A run in that order
measured the second arm 4.5 % faster over 48 pairs (about 3 standard errors). Drawn at random,
such a disturbance is noise in the interval, not a bias, and the sign-flip test in
:mod:`~gpu_tune.judge.gain.stats` is valid by construction: under "no difference" each pair's
order, and so the sign of its ratio, was a fair coin. One warm-up run of the control comes first
and is not counted (the first process of a series pays for cold caches). Every host switch goes through the engine: families on
is :func:`gpu_tune.tune.engine.apply` with those knobs (originals journalled before any write),
untuned is :func:`gpu_tune.tune.engine.revert`. A SIGKILL at any moment therefore loses nothing:
``gpu-tune revert`` restores every original byte for byte. At the end the host is left as it was
found (tuned when the journal held originals at the start, else untuned), or tuned with ``keep``.

Each run also records how busy the machine was while it ran: the share of the run's time some task
waited for a CPU (``/proc/pressure/cpu``) and the share of CPU time the hypervisor stole
(``/proc/stat``), read from this process's own kernel: the machine the runs share, whatever
``--root`` the settings are under.

The statistics are in :mod:`gpu_tune.judge.gain.stats`. Nothing here imports TensorFlow.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from gpu_tune.errors import GpuTuneError, InputError
from gpu_tune.host.parse import format_cpulist
from gpu_tune.judge.gain.stats import CONFIDENCE, GAIN, INCONCLUSIVE, LOSS, SAME, bonferroni, compare, median, pairs_needed

log = logging.getLogger("gpu_tune")

UNTUNED, TUNED, NULL = "untuned", "tuned", "untuned-again"
REGIME = "launch_bound"
DEFAULT_PAIRS = 6  # the fewest pairs whose sign-flip test can confirm a verdict at 95 % (stats.pairs_needed)
MAX_PAIRS = 50
DEFAULT_WARMUP = 1
# (measure, higher is better, where it is in the workload's launch-bound result)
MEASURES: tuple[tuple[str, bool], ...] = (
    ("images_per_second", True),
    ("step_p50_seconds", False),
    ("step_p99_seconds", False),
    ("jitter_p99_over_p50", False),
)
GAIN_ARGS = ("--launch-bound-only", "--step-times")

# The setting families a profile touches, as ``gpu-tune gain --per-setting`` switches them: the
# host knobs' families (gpu_tune.tune.knobs) and the two launch families. Read-only checks (memlock,
# MIG, GPUDirect) change nothing and are not measured.
HOST_FAMILIES: dict[str, tuple[str, ...]] = {
    "sysctl": ("sysctl",), "thp": ("thp",), "cpu": ("cpu", "cstates"), "gpu": ("gpu",), "irq": ("irq",),
}
LAUNCH_FAMILIES = ("numa", "allocator")
FAMILIES = ("sysctl", "thp", "cpu", "gpu", "irq", "numa", "allocator")
FAMILY_WORDS = {
    "sysctl": "sysctls", "thp": "transparent hugepages", "cpu": "CPU governor and idle states",
    "gpu": "GPU persistence mode", "irq": "IRQ placement", "numa": "NUMA binding of the job",
    "allocator": "jemalloc preload",
}


class GainRefused(GpuTuneError):
    """The comparison will not run here (a busy GPU, a NUMA node this process may not use)."""

    exit_code = 1


@dataclass(frozen=True)
class Arm:
    """One way of running the probe: which host families are applied, and how it is launched."""

    name: str
    host: tuple[str, ...] = ()  # knob families applied (gpu_tune.tune.knobs BY_FAMILY keys)
    bound: bool = False
    jemalloc: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "host": list(self.host), "bound": self.bound,
                "allocator": "jemalloc" if self.jemalloc else "system"}


def interleaved(pairs: int, seed: int = 0) -> list[tuple[int, str]]:
    """``[(pair, side), ...]`` in run order for the two-arm comparison (see :func:`schedule`)."""
    return schedule([UNTUNED, TUNED], pairs, seed)


def schedule(arms: Sequence[str], rounds: int, seed: int) -> list[tuple[int, str]]:
    """``[(round, arm), ...]``: every arm once per round, each round's order a random permutation
    drawn from ``seed`` (the same seed gives the same order)."""
    rng = random.Random(seed)
    out: list[tuple[int, str]] = []
    for r in range(rounds):
        order = list(arms)
        rng.shuffle(order)
        out += [(r, a) for a in order]
    return out


def new_seed() -> int:
    return int.from_bytes(os.urandom(4), "big")


@dataclass(frozen=True)
class GainTarget:
    """One GPU (or the CPU run): its probe target as each arm launches it."""

    label: str
    bound_target: Any  # ProbeTarget: bound, with the profile's allocator (the tuned launch)
    device: str
    own_cpus: frozenset[int] | None

    def for_arm(self, arm: Arm) -> Any:
        t = self.bound_target
        env = {k: v for k, v in t.env.items() if k == "CUDA_VISIBLE_DEVICES"}
        if arm.jemalloc:
            env.update({k: v for k, v in t.env.items() if k in ("LD_PRELOAD", "MALLOC_CONF")})
        else:
            env["LD_PRELOAD"] = ""  # the system allocator, even where this process itself preloads one
        if arm.bound:
            return replace(t, env=env)
        return replace(t, prefix=[], env=env, expected_cpus=self.own_cpus, expected_node=None, notes=())

    @property
    def untuned(self) -> Any:
        return self.for_arm(Arm(UNTUNED))

    @property
    def tuned(self) -> Any:
        return self.for_arm(Arm(TUNED, bound=True, jemalloc=True))


def _describe(t: Any) -> dict[str, Any]:
    cpus = format_cpulist(t.expected_cpus) if t.expected_cpus is not None else None
    pre = str(t.env.get("LD_PRELOAD", "")) or None
    return {"numa_node": t.expected_node, "cpus": cpus, "bound": bool(t.prefix),
            "allocator": "jemalloc" if pre and "jemalloc" in pre else "system", "ld_preload": pre}


def plan_gain_targets(topology: Any, profile: Any, backend: Any, *, gpu: str | None, force: bool) -> list[GainTarget]:
    """The bound targets are the probe's own (bound as ``gpu-tune run`` binds); an arm without
    binding runs the same device unbound, with the system allocator unless it is the allocator's.
    Raises :class:`GainRefused` for a busy GPU (unless ``force``) or a target that cannot be bound
    here."""
    from gpu_tune.judge import probe as probe_mod

    gpus = [g for g in (getattr(topology, "gpus", None) or []) if getattr(g, "gpu_index", None) is not None]
    if gpus:
        bound = probe_mod.plan_targets(topology, profile, backend, gpu=gpu or "all", device="gpu")
    else:
        if gpu not in (None, "all"):
            raise InputError(f"--gpu {gpu}: no GPU on this host; leave --gpu out to compare on the CPU")
        nodes = [n.id for n in getattr(topology, "numa_nodes", ()) or () if n.cpus]
        # No GPU: the CPU run bound to the first NUMA node stands for a job's binding.
        bound = probe_mod.plan_targets(topology, profile, backend, gpu=None, device="cpu",
                                       numa_node=nodes[0] if nodes else None)
    try:
        mine = frozenset(os.sched_getaffinity(0))
    except OSError:
        mine = None
    out: list[GainTarget] = []
    for t in bound:
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
        out.append(GainTarget(t.label, t, t.device or ("gpu" if t.gpu_index is not None else "cpu"), mine))
    if not out:
        raise GainRefused("nothing to compare: every GPU was skipped")
    return out


def plan_arms(ctx: Any, profile: Any, targets: Sequence[GainTarget], *, per_setting: bool, null: bool
              ) -> tuple[list[Arm], list[dict[str, Any]]]:
    """The arms to run, control first, and the families left out with the reason."""
    from gpu_tune.tune import engine
    from gpu_tune.tune.knobs import BY_FAMILY

    wanted = [k for k in BY_FAMILY.values() if k.writable and k.wanted(profile)]
    tuned_host = tuple(k.family for k in wanted)
    control = Arm(UNTUNED)
    if null:
        return [control, Arm(NULL)], []
    full = Arm(TUNED, tuned_host, bound=True, jemalloc=True)
    if not per_setting:
        return [control, full], []
    arms, skipped = [control], []
    report = engine.audit(ctx, knobs=wanted) if wanted else None
    rows = list(report.settings) if report is not None else []
    for fam in FAMILIES:
        if fam in HOST_FAMILIES:
            knobs = [BY_FAMILY[f] for f in HOST_FAMILIES[fam] if f in BY_FAMILY and BY_FAMILY[f] in wanted]
            if not knobs:
                skipped.append({"family": fam, "why": "the profile does not set it"})
                continue
            mine = [r for r in rows if any(k.owns(r.id) for k in knobs)]
            if not mine or all(r.status == "unsupported" for r in mine):
                why = (mine[0].detail if mine else "") or "nothing to switch on this node"
                skipped.append({"family": fam, "why": f"not on this node: {why}"})
                continue
            arms.append(Arm(fam, tuple(k.family for k in knobs)))
        elif fam == "numa":
            if not any(t.bound_target.prefix for t in targets):
                skipped.append({"family": fam, "why": "the probe is not bound on this node"})
                continue
            arms.append(Arm(fam, bound=True))
        elif fam == "allocator":
            if not any("jemalloc" in str(t.bound_target.env.get("LD_PRELOAD", "")) for t in targets):
                skipped.append({"family": fam, "why": "no jemalloc preload here (the profile asks for none, "
                                                      "or the library is not installed)"})
                continue
            arms.append(Arm(fam, tuple(f for f in ("allocator",) if f in tuned_host), jemalloc=True))
    arms.append(full)
    return arms, skipped


# -- how busy the machine was ----------------------------------------------------------------------
def _read(path: str) -> str | None:
    # This process's own kernel (the machine the runs share), not --root: see the module's docstring.
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            return fh.read(65536)
    except OSError:
        return None


def load_sample() -> dict[str, float] | None:
    """Cumulative CPU-pressure microseconds and jiffies (steal, total) now; None where unreadable."""
    out: dict[str, float] = {"t": time.monotonic()}
    psi = _read("/proc/pressure/cpu")
    if psi:
        for line in psi.splitlines():
            if line.startswith("some "):
                for part in line.split():
                    if part.startswith("total="):
                        out["some_us"] = float(part[6:])
    stat = _read("/proc/stat")
    if stat and stat.startswith("cpu "):
        f = [float(x) for x in stat.splitlines()[0].split()[1:]]
        out["steal"] = f[7] if len(f) > 7 else 0.0
        out["jiffies"] = sum(f[:8])
    return out


def load_between(a: dict[str, float] | None, b: dict[str, float] | None) -> dict[str, float | None]:
    """The share of the time some task waited for a CPU, and of CPU time stolen, between two samples."""
    if not a or not b:
        return {"cpu_pressure": None, "steal": None}
    dt = b["t"] - a["t"]
    pressure = None
    if "some_us" in a and "some_us" in b and dt > 0:
        pressure = round(min(1.0, max(0.0, (b["some_us"] - a["some_us"]) / 1e6 / dt)), 4)
    steal = None
    if "jiffies" in a and "jiffies" in b and b["jiffies"] > a["jiffies"]:
        steal = round((b["steal"] - a["steal"]) / (b["jiffies"] - a["jiffies"]), 4)
    return {"cpu_pressure": pressure, "steal": steal}


# -- one arm, one run ------------------------------------------------------------------------------
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
    if target.env.get("LD_PRELOAD") == "":  # the system allocator
        env.pop("LD_PRELOAD", None)
        env.pop("MALLOC_CONF", None)
    t0 = time.monotonic()
    before = load_sample()
    run = run_once(cmd, env, timeout)
    busy = load_between(before, load_sample())
    doc: dict[str, Any] = {"seconds": round(time.monotonic() - t0, 3), **busy}
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


# -- switching the host ----------------------------------------------------------------------------
@dataclass
class Switcher:
    """Moves the host between arms (the set of knob families applied), only through the engine's
    apply (with those families' knobs) and revert."""

    ctx: Any
    state: tuple[str, ...]  # families applied now; the found state is the whole profile or none
    log: list[dict[str, Any]] = field(default_factory=list)

    def to(self, families: Sequence[str], label: str) -> None:
        from gpu_tune.tune import engine
        from gpu_tune.tune.knobs import BY_FAMILY

        want = tuple(families)
        if set(want) == set(self.state):
            return
        t0 = time.monotonic()
        ok, changed, detail = True, 0, ""
        if self.state:
            good, rows = engine.revert(self.ctx)
            changed += sum(1 for r in rows if r.changed)
            if not good:
                ok = False
                detail = "; ".join(f"{r.id}[{r.target}]: {r.detail}" for r in rows if r.status != "ok")[:400]
            self.state = ()
        if want and ok:
            report = engine.apply(self.ctx, knobs=[BY_FAMILY[f] for f in want])
            changed += sum(1 for r in report.settings if r.changed)
            if not report.compliant:
                ok = False
                detail = "; ".join(f"{r.id}[{r.target}]: {r.detail}" for r in report.settings
                                   if r.status in ("drift", "error", "conflict"))[:400]
            self.state = want
        self.log.append({"to": label, "changed": changed, "ok": ok, "seconds": round(time.monotonic() - t0, 3),
                         **({"detail": detail} if detail else {})})


def found_state(fs: Any) -> str:
    """``tuned`` when the journal holds originals (an earlier apply left the host tuned), else
    ``untuned``."""
    from gpu_tune.tune.journal import Journal

    return TUNED if Journal(fs).load().entries else UNTUNED


# -- the measurement -------------------------------------------------------------------------------
def measure_gain(*, fs: Any, profile: Any, backend: Any, topology: Any, gpu: str | None = None,
                 pairs: int | None = None, keep: bool = False, force: bool = False, data: str | None = None,
                 window: float | None = None, timeout: float | None = None, per_setting: bool = False,
                 null: bool = False, warmup: int = DEFAULT_WARMUP, seed: int | None = None,
                 runner: Callable[..., dict[str, Any]] = run_side,
                 progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Plan, run the interleaved rounds, restore, judge. Returns the ``gpu-tune gain -o json`` document."""
    from gpu_tune.tune import engine

    if per_setting and null:
        raise InputError("--per-setting and --null: give one (an A/A run has no settings to split)")
    if pairs is not None and not 1 <= int(pairs) <= MAX_PAIRS:
        raise InputError(f"--pairs {pairs}: expected 1..{MAX_PAIRS}")
    if window is not None and not 0 < window <= 600:
        raise InputError(f"--window {window}: expected 0 < S <= 600")
    if not 0 <= int(warmup) <= 10:
        raise InputError(f"--warmup {warmup}: expected 0..10")
    targets = plan_gain_targets(topology, profile, backend, gpu=gpu, force=force)
    ctx = engine.make_context(fs, profile, backend)
    arms, skipped = plan_arms(ctx, profile, targets, per_setting=per_setting, null=null)
    confidence = bonferroni(len(arms) - 1, CONFIDENCE)
    rounds = int(pairs) if pairs is not None else max(DEFAULT_PAIRS, pairs_needed(confidence))
    limit = float(timeout if timeout is not None else profile.probe.timeout_s)
    found = found_state(fs)
    full_host = next((a.host for a in arms if a.name == TUNED), ())
    if not full_host and found == TUNED:
        from gpu_tune.tune.knobs import BY_FAMILY

        full_host = tuple(k.family for k in BY_FAMILY.values() if k.writable and k.wanted(profile))
    sw = Switcher(ctx, full_host if found == TUNED else ())
    by_name = {a.name: a for a in arms}
    seed = new_seed() if seed is None else int(seed)
    order = schedule([a.name for a in arms], rounds, seed)
    runs: dict[str, list[dict[str, Any]]] = {t.label: [] for t in targets}
    started, t0 = time.time(), time.monotonic()
    end = TUNED if keep or found == TUNED else UNTUNED
    plan = [(-1, UNTUNED)] * int(warmup) + order
    try:
        for k, (rnd, name) in enumerate(plan):
            arm = by_name[name]
            sw.to(arm.host, name)
            for t in targets:
                if progress:
                    what = "warm-up" if rnd < 0 else f"round {rnd + 1}/{rounds}"
                    progress(f"run {k + 1}/{len(plan)}: {what}, {name}, "
                             f"{'GPU ' + t.label if t.label != 'cpu' else 'CPU'}")
                doc = runner(t.for_arm(arm), profile.probe, device=t.device, data=data, window=window, timeout=limit)
                runs[t.label].append({"order": k, "pair": rnd, "side": name, **({"warmup": True} if rnd < 0 else {}),
                                      **doc})
    finally:
        try:
            sw.to(full_host if end == TUNED else (), end)
        except Exception as exc:  # noqa: BLE001 - say it loudly; the journal still holds every original
            log.error("could not leave the host %s (%s): `gpu-tune revert` restores the originals", end, exc)
            sw.log.append({"to": end, "ok": False, "detail": str(exc)})
    control, compared = arms[0], arms[1:]
    results = [_judge_target(t, runs[t.label], control, compared, confidence) for t in targets]
    ended = TUNED if sw.state else UNTUNED
    mode = "null" if null else ("per-setting" if per_setting else "profile")
    return {
        "profile": profile.name, "regime": REGIME, "mode": mode, "pairs": rounds, "warmup": int(warmup),
        "confidence": round(confidence, 5), "arms": [a.as_dict() for a in arms], "skipped_families": skipped,
        "order": [name for _, name in order], "order_seed": seed, "found": found, "ended": ended, "kept": bool(keep),
        "host_left_as_asked": ended == end and all(s.get("ok", False) for s in sw.log[-1:]),
        "window_seconds": window, "measured_at": _rfc3339(started),
        "duration_seconds": round(time.monotonic() - t0, 3), "switches": sw.log,
        "verdict": overall_verdict(results), "targets": results,
    }


def _rfc3339(t: float) -> str:
    from gpu_tune.timestamps import format_rfc3339

    return format_rfc3339(t)


def _measures(control_runs: list[dict[str, Any]], arm_runs: list[dict[str, Any]], confidence: float) -> dict[str, Any]:
    out = {}
    for name, higher in MEASURES:
        keep = [(a.get(name), b.get(name)) for a, b in zip(control_runs, arm_runs)]
        keep = [(a, b) for a, b in keep if a is not None and b is not None]
        out[name] = compare(name, [a for a, _ in keep], [b for _, b in keep], higher_is_better=higher,
                            confidence=confidence).as_dict()
    return out


def _judge_target(t: GainTarget, runs: list[dict[str, Any]], control: Arm, compared: Sequence[Arm],
                  confidence: float) -> dict[str, Any]:
    counted = [r for r in runs if not r.get("warmup")]
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for r in counted:
        by_round.setdefault(r["pair"], {})[r["side"]] = r
    failed = [f"{'warm-up' if r.get('warmup') else 'round ' + str(r['pair'] + 1)} {r['side']}: {r.get('reason')}"
              for r in runs if not r.get("ok")]
    arms: dict[str, Any] = {}
    for arm in compared:
        complete = [p for _, p in sorted(by_round.items()) if p.get(control.name, {}).get("ok")
                    and p.get(arm.name, {}).get("ok")]
        measures = _measures([p[control.name] for p in complete], [p[arm.name] for p in complete], confidence)
        arms[arm.name] = {"pairs_complete": len(complete), "verdict": measures["images_per_second"]["verdict"],
                          "measures": measures}
    main = arms.get(TUNED) or arms.get(NULL) or next(iter(arms.values()))
    b_arm = next((a for a in compared if a.name in (TUNED, NULL)), compared[-1])
    pressure = [r["cpu_pressure"] for r in counted if r.get("cpu_pressure") is not None]
    steal = [r["steal"] for r in counted if r.get("steal") is not None]
    slim = [{k: v for k, v in r.items() if k not in ("step_seconds_all", "stderr_tail")} for r in runs]
    doc = {"gpu": t.label, "device": t.device, "untuned": _describe(t.for_arm(control)),
           "tuned": _describe(t.for_arm(b_arm)), "pairs_complete": main["pairs_complete"], "failed_runs": failed,
           "verdict": main["verdict"], "measures": main["measures"],
           "busy": {"cpu_pressure_median": median(pressure), "steal_median": median(steal)},
           "runs": slim}
    families = {name: a for name, a in arms.items() if name not in (TUNED, NULL)}
    if families:
        doc["families"] = families
    return doc


def overall_verdict(targets: Sequence[dict[str, Any]]) -> str:
    """The node's verdict from its targets' images/s verdicts: a loss anywhere is a loss; else
    inconclusive anywhere is inconclusive; else a gain anywhere is a gain; else no difference."""
    vs = [t.get("verdict") for t in targets]
    for v in (LOSS, INCONCLUSIVE, GAIN):
        if v in vs:
            return v
    return SAME if vs else INCONCLUSIVE


def family_verdicts(doc: dict[str, Any]) -> dict[str, str]:
    """Each measured family's images/s verdict over the node's targets (a loss on any target is a
    loss), from a ``--per-setting`` document; empty for the other modes."""
    out: dict[str, list[str]] = {}
    for t in doc.get("targets", []):
        for fam, a in (t.get("families") or {}).items():
            out.setdefault(fam, []).append(a.get("verdict"))
    return {fam: overall_verdict([{"verdict": v} for v in vs]) for fam, vs in out.items()}


def exit_code(doc: dict[str, Any]) -> int:
    """0: a gain or no significant difference, and the host left as asked; 1 otherwise. An A/A
    run (``null``) succeeds when it finds no difference: that is what it is for."""
    if not doc.get("host_left_as_asked"):
        return 1
    if doc.get("mode") == "null":
        return 0 if doc.get("verdict") == SAME else 1
    return 0 if doc.get("verdict") in (GAIN, SAME) else 1
