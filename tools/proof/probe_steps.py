"""The probe's steps: probe, fingerprint, verdict and gain."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .common import GOAL_WARM_BUSY_S, GOAL_WARM_IDLE_S, LIMIT, VERDICT_PLAN, _gbps, _num, _pct, loadavg, say, tail
from .hosts import audit_values, host_for, snapshot
from .runner import Runner, cmd_summary, why


def probe_rows(doc: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The figures of a ``gpu-tune probe -o json`` document that the report shows, per GPU."""
    rows = []
    for v in (doc or {}).get("results", []):
        res = v.get("result") or {}
        regimes = {}
        for name, w in (res.get("regimes") or {}).items():
            regimes[name] = {k: w.get(k) for k in ("batch_size", "images_per_second", "gpu_busy_fraction", "gpu_samples",
                                                   "gpu_utilization_percent_max", "steps", "steps_per_call", "seconds",
                                                   "precision", "xla", "compile_seconds")}
        for name, w in (res.get("regimes") or {}).items():
            regimes[name].update({k: w.get(k) for k in ("gpu_busy_fraction_all", "gpu_busy_settled") if k in w})
        t = res.get("timings") or {}
        rows.append({"gpu": v.get("gpu"), "status": v.get("status"), "passed": v.get("passed"),
                     "bandwidth": res.get("bandwidth"), "memory_bandwidth": res.get("memory_bandwidth"),
                     "compile_cache": res.get("compile_cache"), "datapath": v.get("datapath"),
                     "reasons": v.get("reasons"), "notes": v.get("notes"), "attempts": v.get("attempts"),
                     "duration_seconds": v.get("duration_seconds"), "accuracy": res.get("accuracy"),
                     "fingerprint": res.get("fingerprint"), "peer_group": res.get("peer_group"),
                     "time_to_verdict_seconds": res.get("time_to_verdict_seconds"), "timings": t,
                     "regimes": regimes, "inference_images_per_second": res.get("inference_images_per_second"),
                     "device": res.get("device"), "host": res.get("host"), "software": res.get("software"),
                     "error": res.get("error"), "stderr_tail": tail(v.get("stderr_tail"), 6) if not v.get("passed") else ""})
    return rows


def run_probe(ctx: dict[str, Any], r: Runner, host: dict[str, Any], *extra: str) -> dict[str, Any]:
    args = ["probe", "--gpu", "all", "--device", ctx["device"], "-o", "json", "--timeout", str(ctx["probe_timeout"])]
    if ctx.get("data"):
        args += ["--data", ctx["data"]]
    return r.gpu_tune(*args, *extra, timeout=ctx["probe_timeout"] + 60, host=host)


def datapath_text(row: dict[str, Any]) -> str:
    """The data path of one probe row in a line: local and remote host<->GPU, GPU memory."""
    bw = row.get("bandwidth") or {}
    if bw.get("status") != "measured":
        return f"data path: {bw.get('reason') or bw.get('status') or '-'}"
    parts = []
    for side in ("local", "remote"):
        sd = bw.get(side) or {}
        if sd.get("status") == "measured":
            parts.append(f"{side} node {sd.get('numa_node')} H2D {_gbps((sd.get('h2d') or {}).get('bytes_per_second'))}, "
                         f"D2H {_gbps((sd.get('d2h') or {}).get('bytes_per_second'))}")
        elif side == "remote":
            parts.append(f"remote: {sd.get('reason') or sd.get('status')}")
    mem = row.get("memory_bandwidth") or {}
    parts.append(f"GPU memory {_gbps(mem.get('bytes_per_second'))}" if mem.get("status") == "measured"
                 else f"GPU memory: {mem.get('reason') or mem.get('status') or '-'}")
    return f"data path ({row.get('datapath') or '-'}): " + "; ".join(parts)


def step_probe(ctx: dict[str, Any], r: Runner) -> dict[str, Any]:
    host = host_for(ctx, "run")
    p = run_probe(ctx, r, host)
    rows = probe_rows(p["json"])
    if not rows:
        return {"status": "failed", "reason": f"gpu-tune probe gave no result ({why(p)}): {tail(p['stderr'], 4)}",
                "data": {"command": cmd_summary(p)}}
    parts = []
    for row in rows:
        reg = row["regimes"]
        lb, db = reg.get("launch_bound") or {}, reg.get("device_bound") or {}
        parts.append(f"{row['gpu']}: {row['status']}, accuracy {row['accuracy']}, fingerprint {row['fingerprint']}, "
                     f"launch-bound {_num(lb.get('images_per_second'))} img/s (GPU busy {_pct(lb.get('gpu_busy_fraction'))}), "
                     f"device-bound {_num(db.get('images_per_second'))} img/s (GPU busy {_pct(db.get('gpu_busy_fraction'))}), "
                     f"time to verdict {row['time_to_verdict_seconds']} s, {datapath_text(row)}")
    failed = [f"{row['gpu']}: {row['status']} ({'; '.join(row['reasons'] or [])})" for row in rows if not row["passed"]]
    return {"status": "failed" if failed or p["rc"] != 0 else "passed", "reason": "; ".join(failed),
            "summary": "; ".join(parts), "data": {"host": host["root"], "command": cmd_summary(p), "results": rows}}


def busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(n)]


def probe_under_load(ctx: dict[str, Any], r: Runner, host: dict[str, Any], load: str,
                     *args: str) -> tuple[dict[str, Any], Any, int]:
    """One probe run, idle or (``load == "busy"``) with one busy loop per CPU started a second
    before it and stopped after it: (the run, the load average before it, how many loops)."""
    loops: list[subprocess.Popen] = []
    try:
        if load == "busy":
            loops = busy_loops(os.cpu_count() or 1)
            time.sleep(1.0)
        la = loadavg()
        p = run_probe(ctx, r, host, *args)
    finally:
        for lp in loops:
            lp.kill()
        for lp in loops:
            lp.wait()
    return p, la, len(loops)


def step_fingerprint(ctx: dict[str, Any], r: Runner) -> dict[str, Any]:
    """The probe ``n`` times idle and ``n`` times with one busy loop per CPU, interleaved (idle,
    busy, idle, ...) so that a step cut short by its time still compares both. A run is not
    started when what is left of the step's time is less than the longest run so far, plus a
    margin: the runs done are kept and the report says how many there were."""
    host = host_for(ctx, "run")
    n = int(ctx["fingerprint_runs"])
    runs: list[dict[str, Any]] = []
    notes: list[str] = []
    plan = [(load, i) for i in range(n) for load in ("idle", "busy")]
    for k, (load, i) in enumerate(plan):
        if runs and r.left() < max(x["seconds"] for x in runs) * 1.3 + 10:
            notes.append(f"stopped after {len(runs)} of {len(plan)} runs: {r.left():.0f} s of the step's time left")
            say(f"    {notes[-1]}")
            break
        p, la, nloops = probe_under_load(ctx, r, host, load)
        rows = probe_rows(p["json"])
        runs.append({"load": load, "run": i + 1, "busy_loops": nloops, "loadavg_before": la,
                     "rc": p["rc"], "seconds": p["seconds"],
                     "gpus": [{k2: row[k2] for k2 in ("gpu", "status", "fingerprint", "accuracy",
                                                      "time_to_verdict_seconds", "peer_group")} for row in rows],
                     **({"stderr_tail": tail(p["stderr"], 4), "why": why(p)} if not rows else {})})
        say(f"    {load} run {i + 1}: " + (", ".join(f"{g['gpu']} {g['fingerprint']} (accuracy {g['accuracy']}, "
                                                    f"{g['time_to_verdict_seconds']} s)" for g in runs[-1]["gpus"])
                                          or f"no result ({why(p)})"))
    by_gpu: dict[str, set] = {}
    missing = 0
    for run in runs:
        if not run["gpus"]:
            missing += 1
        for g in run["gpus"]:
            by_gpu.setdefault(str(g["gpu"]), set()).add(g["fingerprint"])
    equal = bool(by_gpu) and not missing and all(len(v) == 1 and None not in v for v in by_gpu.values())
    done = {load: sum(1 for x in runs if x["load"] == load and x["gpus"]) for load in ("idle", "busy")}
    equal = equal and done["idle"] > 0 and done["busy"] > 0
    summary = (f"{done['idle']} idle + {done['busy']} busy runs, interleaved ({os.cpu_count()} busy loops): "
               + "; ".join(f"{k}: {', '.join(sorted(str(x) for x in v))}" for k, v in by_gpu.items())
               + f" -> {'all equal' if equal else 'NOT all equal'}")
    reasons = []
    if missing:
        reasons.append(f"{missing} run(s) gave no result")
    if not done["idle"] or not done["busy"]:
        reasons.append("no comparison: idle and busy runs are both needed")
    if any(len(v) > 1 for v in by_gpu.values()):
        reasons.append("fingerprints differ: " + "; ".join(f"{k}: {sorted(str(x) for x in v)}" for k, v in by_gpu.items()))
    return {"status": "passed" if equal else "failed", "reason": "; ".join(reasons), "summary": summary,
            "data": {"host": host["root"], "runs_per_load": n, "busy_loops": os.cpu_count(), "all_equal": equal,
                     "notes": notes,
                     "fingerprints": {k: sorted(str(x) for x in v) for k, v in by_gpu.items()}, "runs": runs}}


def _cache_folder(host: dict[str, Any]) -> Path:
    return Path(host["root"]) / "var/lib/gpu-tune/xla-cache"


def step_verdict(ctx: dict[str, Any], r: Runner) -> dict[str, Any]:
    """Time to verdict, cold and warm, idle and busy, and once without the compilation cache
    (:data:`VERDICT_PLAN`, the first ``--verdict-runs``): a run is not started when what is left of
    the step's time is less than the longest run so far, plus a margin."""
    host = host_for(ctx, "run")
    plan = VERDICT_PLAN[:int(ctx["verdict_runs"])]
    runs: list[dict[str, Any]] = []
    notes: list[str] = []
    for cache, load in plan:
        if runs and r.left() < max(x["seconds"] for x in runs) * 1.3 + 10:
            notes.append(f"stopped after {len(runs)} of {len(plan)} runs: {r.left():.0f} s of the step's time left")
            say(f"    {notes[-1]}")
            break
        if cache == "cold":
            shutil.rmtree(_cache_folder(host), ignore_errors=True)
        p, la, nloops = probe_under_load(ctx, r, host, load, *(["--no-compile-cache"] if cache == "none" else []))
        rows = probe_rows(p["json"])
        runs.append({"cache": cache, "load": load, "busy_loops": nloops, "loadavg_before": la, "rc": p["rc"],
                     "seconds": p["seconds"],
                     "gpus": [{"gpu": row["gpu"], "status": row["status"], "fingerprint": row["fingerprint"],
                               "time_to_verdict_seconds": row["time_to_verdict_seconds"], "timings": row["timings"],
                               "compile_cache": (row.get("compile_cache") or {}).get("status"),
                               "device_bound_busy": (row["regimes"].get("device_bound") or {}).get("gpu_busy_fraction"),
                               "device_bound_busy_all": (row["regimes"].get("device_bound") or {}).get(
                                   "gpu_busy_fraction_all"),
                               "datapath": datapath_text(row)} for row in rows],
                     **({"stderr_tail": tail(p["stderr"], 4), "why": why(p)} if not rows else {})})
        say(f"    {cache} cache, {load}: " + (", ".join(
            f"{g['gpu']} {g['time_to_verdict_seconds']} s (cache {g['compile_cache']}, fingerprint {g['fingerprint']})"
            for g in runs[-1]["gpus"]) or f"no result ({why(p)})"))
    fps: dict[str, set] = {}
    for run in runs:
        for g in run["gpus"]:
            fps.setdefault(str(g["gpu"]), set()).add(g["fingerprint"])
    missing = [f"{x['cache']}/{x['load']}" for x in runs if not x["gpus"]]
    failed = [f"{x['cache']}/{x['load']} GPU {g['gpu']}: {g['status']}" for x in runs for g in x["gpus"]
              if g["status"] != "passed"]
    equal = bool(fps) and all(len(v) == 1 and None not in v for v in fps.values())
    not_warm = [f"GPU {g['gpu']}: {g['compile_cache']}" for x in runs if x["cache"] == "warm" for g in x["gpus"]
                if g["compile_cache"] not in ("warm", "off")]

    def med(cache: str, load: str) -> float | None:
        ts = sorted(g["time_to_verdict_seconds"] for x in runs if (x["cache"], x["load"]) == (cache, load)
                    for g in x["gpus"] if isinstance(g["time_to_verdict_seconds"], (int, float)))
        return ts[len(ts) // 2] if ts else None

    figures = {f"{c}_{l}": med(c, l) for c, l in VERDICT_PLAN}
    goals = []
    if ctx["device"] == "gpu":
        for key, goal in (("warm_idle", GOAL_WARM_IDLE_S), ("warm_busy", GOAL_WARM_BUSY_S)):
            if figures[key] is not None:
                goals.append(f"{key.replace('_', ' ')} {figures[key]} s (goal < {goal:g} s: "
                             f"{'met' if figures[key] < goal else 'MISSED'})")
    summary = ("time to verdict: " + ", ".join(f"{k.replace('_', ' ')} {v} s" for k, v in figures.items() if v is not None)
               + (f"; {'; '.join(goals)}" if goals else "")
               + f"; fingerprints {'all equal' if equal else 'NOT all equal'} with and without the cache"
               + "".join(f"; {g['datapath']}" for g in (runs[-1]["gpus"] if runs else [])[:1]))
    reasons = []
    if missing:
        reasons.append(f"no result from {', '.join(missing)}")
    if failed:
        reasons.append("; ".join(failed))
    if not equal and fps:
        reasons.append("fingerprints differ: " + "; ".join(f"{k}: {sorted(str(x) for x in v)}" for k, v in fps.items()))
    if not_warm:
        reasons.append(f"a warm run compiled: {', '.join(not_warm)}")
    return {"status": "failed" if reasons or not runs else "passed", "reason": "; ".join(reasons), "summary": summary,
            "data": {"host": host["root"], "plan": [list(x) for x in plan], "runs": runs, "notes": notes,
                     "time_to_verdict": figures, "fingerprints": {k: sorted(str(x) for x in v) for k, v in fps.items()},
                     "all_equal": equal}}


def step_gain(ctx: dict[str, Any], r: Runner) -> dict[str, Any]:
    host = host_for(ctx, "run")
    whole = not host["real"]
    before = snapshot(host["root"], True) if whole else None
    a1 = r.gpu_tune("audit", "-o", "json", timeout=120, host=host)
    args = ["gain", "--gpu", "all", "--pairs", str(ctx["gain_pairs"]), "-o", "json"]
    if ctx.get("gain_window"):
        args += ["--window", str(ctx["gain_window"])]
    if ctx.get("data"):
        args += ["--data", ctx["data"]]
    g = r.gpu_tune(*args, timeout=LIMIT["gain"], host=host)
    a2 = r.gpu_tune("audit", "-o", "json", timeout=120, host=host)
    doc = g["json"]
    if not isinstance(doc, dict) or "targets" not in doc:
        return {"status": "failed", "reason": f"gpu-tune gain gave no document ({why(g)}): {tail(g['stderr'], 4)}",
                "data": {"command": cmd_summary(g)}}
    targets = []
    for t in doc["targets"]:
        runs = [{k: x.get(k) for k in ("pair", "side", "ok", "images_per_second", "step_p50_seconds", "step_p99_seconds",
                                       "jitter_p99_over_p50", "gpu_busy_fraction", "reason")} for x in t.get("runs", [])]
        targets.append({"gpu": t.get("gpu"), "device": t.get("device"), "verdict": t.get("verdict"),
                        "pairs_complete": t.get("pairs_complete"), "failed_runs": t.get("failed_runs"),
                        "untuned": t.get("untuned"), "tuned": t.get("tuned"), "measures": t.get("measures"), "runs": runs})
    v1, v2 = audit_values(a1["json"]), audit_values(a2["json"])
    audit_diff = sorted(k for k in set(v1) | set(v2) if v1.get(k) != v2.get(k))
    tree_diff = []
    if whole:
        after = snapshot(host["root"], True)
        tree_diff = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    reasons = []
    if not doc.get("host_left_as_asked"):
        reasons.append(f"host not left as found (ended {doc.get('ended')}, found {doc.get('found')})")
    incomplete = [t for t in targets if t["pairs_complete"] != doc.get("pairs")]
    if incomplete:
        reasons.append("pairs incomplete: " + "; ".join(f"{t['gpu']}: {t['pairs_complete']}/{doc.get('pairs')} "
                                                         f"({'; '.join(t['failed_runs'] or [])})" for t in incomplete))
    if audit_diff:
        reasons.append(f"audit values before and after differ: {', '.join(audit_diff[:5])}")
    if tree_diff:
        reasons.append(f"fixture tree differs after gain: {', '.join(tree_diff[:5])}")
    parts = []
    for t in targets:
        m = (t["measures"] or {}).get("images_per_second") or {}
        j = (t["measures"] or {}).get("jitter_p99_over_p50") or {}
        parts.append(f"{t['gpu']}: images/s {m.get('median_untuned')} -> {m.get('median_tuned')}, {m.get('change')} "
                     f"({m.get('verdict')}); jitter {j.get('change')} ({j.get('verdict')})")
    summary = (f"verdict {doc.get('verdict')}, {doc.get('pairs')} pair(s) in {doc.get('duration_seconds')} s: "
               + "; ".join(parts) + f"; host left as found: {doc.get('host_left_as_asked')}")
    return {"status": "failed" if reasons else "passed", "reason": "; ".join(reasons), "summary": summary,
            "data": {"host": host["root"], "command": cmd_summary(g), "exit_code": g["rc"], "verdict": doc.get("verdict"),
                     "pairs": doc.get("pairs"), "order": doc.get("order"), "found": doc.get("found"),
                     "ended": doc.get("ended"), "host_left_as_asked": doc.get("host_left_as_asked"),
                     "window_seconds": doc.get("window_seconds"), "duration_seconds": doc.get("duration_seconds"),
                     "switches": len(doc.get("switches") or []), "targets": targets, "audit_differs": audit_diff,
                     "fixture_tree_differs": tree_diff}}
