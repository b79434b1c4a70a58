"""Everything gpu-tune owes a GPU, in one command, written up as one report.

    python3 tools/gpu_proof.py --device gpu --out DIR [--steps a,b,...] [--budget S]
    python3 tools/gpu_proof.py --device cpu --out DIR ...        # the same path on a CPU host, fixture trees
    python3 tools/gpu_proof.py --merge A/report.json B/report.json --out DIR

Steps, in this order (``--steps`` picks some):

environment  GPU model, driver and CUDA through NVML; Python; TensorFlow and its build info; CPUs
topology     ``gpu-tune topology -o json`` (NVML backend on a GPU)
health       ``gpu-tune check -o json``: every health check (docs/health.md) on this GPU host, its
             readings (NVLink links, PCIe replays, clocks, recovery action, remapped rows, fabric)
             and the kernel log's source; a healthy GPU passes every fatal health check (no false
             alarm)
tuning       ``audit`` -> ``apply`` -> ``audit`` (compliant?) -> ``revert`` -> ``audit``: every file the
             journal recorded is compared byte for byte with what it held before (and with the
             journal's copy); NVML persistence mode before, after apply, after revert
probe        ``gpu-tune probe --gpu all -o json``: both regimes with the GPU busy fraction per window,
             accuracy, fingerprint, time to verdict, the data path (host<->GPU bandwidth from the
             GPU's NUMA node and from a remote one, GPU memory bandwidth)
verdict      the time to verdict with the compilation cache cold (emptied first) and warm, idle and
             with every CPU busy, and once without the cache: every phase's seconds, the cache's
             state, the device-bound GPU busy fraction, the data path, and whether the fingerprint
             is the same in every run
torch        the device-bound regime's network in PyTorch eager (tools/torch_cnn.py), data on the
             device, against the probe's device-bound images/s (skipped where PyTorch is absent)
fingerprint  the probe N times idle and N times with every CPU busy (one busy loop per CPU): are all
             fingerprints equal?
gain         ``gpu-tune gain --gpu all -o json``: interleaved untuned/tuned pairs
serve        ``gpu-tune serve --no-kube`` on a free loopback port: time to the first ``/readiness``
             answer, the agent's RSS then, after a few hundred requests and after its first probe;
             SIGTERM and its exit code

On a GPU (``--device gpu``) the host is the real one (``--root /``, as root, NVML). With ``--device
cpu`` every step that writes runs on generated fixture trees (tests/fixtures/hostgen.py) and the GPU
fixture backend, so the whole path runs on a machine without a GPU, as the tests do.

Each step runs in a process of its own with a time limit; a step that fails, breaks or times out is
recorded with its reason and the next one runs. Processes a step leaves behind are killed (this
process is their subreaper). ``--budget S`` bounds the whole run: a step that would not fit in what
is left is not started and is marked ``not_run``, to be run in another call. Progress goes to stdout
as it happens (and to DIR/proof.log). DIR gets ``report.json`` and ``report.md`` (a Markdown
report for docs/gpu.md); ``--merge`` joins reports of several calls into one.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any, Callable

# The steps are the modules of the ``proof`` package beside this file (tools/proof/).
TOOLS = Path(__file__).resolve().parent
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

from proof.common import (EXPECT, FIXTURE_RUN, FIXTURE_TUNE, FORMAT, GOAL_WARM_BUSY_S, GOAL_WARM_IDLE_S,  # noqa: E402
                          LIMIT, REPO, STATUSES, STEPS, VERDICT_PLAN, _gbps, _num, _onoff, _pct, loadavg, now,
                          read_text, say, tail, vm_status)
from proof.host_steps import step_environment, step_health, step_topology, step_tuning  # noqa: E402
from proof.hosts import audit_values, host_for, nvml_facts, persistence, snapshot  # noqa: E402
from proof.runner import Runner, _killpg, _set_subreaper, _signal_group, cmd_summary, kill_leftovers, why  # noqa: E402

# Names this module keeps for whoever loads it (tests/test_gpu_proof.py): the package's, re-exported.
__all__ = ["EXPECT", "FIXTURE_RUN", "FIXTURE_TUNE", "FORMAT", "GOAL_WARM_BUSY_S", "GOAL_WARM_IDLE_S", "LIMIT", "REPO",
           "STATUSES", "STEPS", "STEP_FUNCS", "VERDICT_PLAN", "Runner", "cmd_summary", "commit_info", "datapath_text",
           "device_bound_ratio", "host_for", "main", "merge_reports", "nvml_facts", "persistence", "probe_rows",
           "render_markdown", "run_all", "run_probe", "run_step_child", "snapshot", "step_environment",
           "step_fingerprint", "step_gain", "step_health", "step_probe", "step_serve", "step_topology", "step_torch",
           "step_tuning", "step_verdict", "tail", "torch_env", "why", "write_report"]


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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int | None, bytes]:
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        c.request("GET", path)
        resp = c.getresponse()
        body = resp.read()
        c.close()
        return resp.status, body
    except (OSError, http.client.HTTPException):
        return None, b""


SERVE_PATHS = ("/readiness", "/healthz", "/metrics", "/probe", "/audit", "/topology")


def step_serve(ctx: dict[str, Any], r: Runner) -> dict[str, Any]:
    host = host_for(ctx, "run")
    port = free_port()
    argv = list(ctx["gpu_tune"]) + ["serve", "--no-kube", "--host", "127.0.0.1", "--port", str(port), "--interval", "5",
                                    "--probe-device", ctx["device"]] + host["args"]
    if ctx.get("data"):
        argv += ["--probe-data", ctx["data"]]
    log_path = Path(ctx["work"]) / f"serve-{port}.log"
    say(f"    $ gpu-tune serve --no-kube --port {port} --probe-device {ctx['device']} {' '.join(host['args'])}")
    data: dict[str, Any] = {"host": host["root"], "port": port, "backend": host["args"][host["args"].index("--gpu-backend") + 1],
                            "requests": {}, "rss_mib": {}}
    reasons: list[str] = []
    with open(log_path, "wb") as logf:
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, env=r.env,
                                cwd=r.cwd, start_new_session=True)
        try:
            first = None
            while time.monotonic() - t0 < 90 and proc.poll() is None:
                code, _ = http_get(port, "/readiness", timeout=2)
                if code is not None:
                    first = (code, round(time.monotonic() - t0, 2))
                    break
                time.sleep(0.1)
            if first is None:
                reasons.append(f"no answer on /readiness within 90 s (exit {proc.poll()}): {tail(read_text(log_path), 4)}")
                return {"status": "failed", "reason": "; ".join(reasons), "data": data}
            data["first_readiness"] = {"status": first[0], "seconds": first[1]}
            data["rss_mib"]["first_answer"] = vm_status(proc.pid)
            # /audit and /topology answer 503 until the agent's first pass has completed (the
            # first /readiness answer comes before it): wait for that pass before the burst
            while time.monotonic() - t0 < 90 and proc.poll() is None:
                if http_get(port, "/audit", timeout=2)[0] == 200:
                    data["first_pass_seconds"] = round(time.monotonic() - t0, 2)
                    break
                time.sleep(0.1)
            counts: dict[str, int] = {}
            errors = 0
            n = int(ctx["serve_requests"])
            t1 = time.monotonic()
            for i in range(n):
                path = SERVE_PATHS[i % len(SERVE_PATHS)]
                code, _ = http_get(port, path)
                key = f"{path} {code}"
                counts[key] = counts.get(key, 0) + 1
                if code is None or (code >= 500 and not (code == 503 and path in ("/readiness", "/probe"))):
                    errors += 1
            took = time.monotonic() - t1
            data["requests"] = {"count": n, "seconds": round(took, 2), "per_second": round(n / took, 1),
                                "by_path_status": counts, "errors": errors}
            data["rss_mib"][f"after_{n}_requests"] = vm_status(proc.pid)
            if errors:
                reasons.append(f"{errors} of {n} requests failed or answered 5xx")
            wait = float(ctx["serve_probe_wait"])
            probed = None
            t2 = time.monotonic()
            while wait > 0 and time.monotonic() - t2 < wait and proc.poll() is None and r.left() > 30:
                code, body = http_get(port, "/probe")
                try:
                    verdicts = json.loads(body) if code == 200 else []
                except ValueError:
                    verdicts = []
                if isinstance(verdicts, list) and verdicts:  # an empty list until the first probe ends
                    probed = round(time.monotonic() - t0, 2)
                    data["probe"] = [{"gpu": v.get("gpu"), "status": v.get("status"), "reasons": v.get("reasons")}
                                     for v in verdicts if isinstance(v, dict)]
                    break
                time.sleep(1.0)
            if probed is not None:
                data["first_probe_seconds"] = probed
                for i in range(100):
                    http_get(port, SERVE_PATHS[i % len(SERVE_PATHS)])
                code, body = http_get(port, "/readiness")
                data["readiness_after_probe"] = {"status": code, "body": _json_or_text(body)}
                data["rss_mib"]["after_first_probe_and_100_more"] = vm_status(proc.pid)
            else:
                data["first_probe_seconds"] = None
                data["note"] = f"the first probe had not finished after {wait:g} s (not waited for longer)"
        finally:
            t3 = time.monotonic()
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                rc = None
                _killpg(proc.pid)
                proc.wait()
            _killpg(proc.pid)
            data["sigterm"] = {"exit_code": rc, "seconds_to_exit": round(time.monotonic() - t3, 2)}
    data["log_tail"] = tail(read_text(log_path), 8)
    if data["sigterm"]["exit_code"] != 0:
        reasons.append(f"SIGTERM: exit {data['sigterm']['exit_code']}")
    rss = data["rss_mib"]
    summary = (f"first /readiness answer {data['first_readiness']['status']} after {data['first_readiness']['seconds']} s "
               f"(backend {data['backend']}); RSS " + ", ".join(f"{v.get('VmRSS')} MiB {k.replace('_', ' ')}" for k, v in rss.items())
               + f"; {data['requests'].get('count')} requests at {data['requests'].get('per_second')}/s, "
               f"{data['requests'].get('errors')} failed; first probe "
               + (f"after {data['first_probe_seconds']} s" if data.get("first_probe_seconds") else "not waited for")
               + f"; SIGTERM -> exit {data['sigterm']['exit_code']} in {data['sigterm']['seconds_to_exit']} s")
    return {"status": "failed" if reasons else "passed", "reason": "; ".join(reasons), "summary": summary, "data": data}


def _json_or_text(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return body[:500].decode("utf-8", "replace")


def torch_env() -> dict[str, str]:
    """PyTorch as the machine has it: without the folders the payload's bootstrap put first on
    PYTHONPATH and LD_LIBRARY_PATH for TensorFlow (its CUDA 12 runtime, the CUDA 12 sonames that
    point at CUDA 13, its copies of typing_extensions and the like), with this checkout's
    gpu_tune (NumPy-only modules: the data loader and the NVML sampler) on the path."""
    site = os.environ.get("GPU_TUNE_SITE_DIR")
    added = set(filter(None, os.environ.get("GPU_TUNE_LD_ADDED", "").split(":")))
    pp = [p for p in os.environ.get("PYTHONPATH", "").split(":") if p and p != site]
    env = {"PYTHONPATH": ":".join([str(REPO)] + pp)}
    if added:
        env["LD_LIBRARY_PATH"] = ":".join(p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":")
                                          if p and p not in added)
    return env


def step_torch(ctx: dict[str, Any], r: Runner) -> dict[str, Any]:
    argv = [sys.executable, str(REPO / "tools" / "torch_cnn.py"), "--device", ctx["device"],
            "--seconds", str(ctx["torch_seconds"])]
    if ctx.get("data"):
        argv += ["--data", ctx["data"]]
    t = r.run(argv, timeout=240, env=torch_env(), label="python tools/torch_cnn.py --device " + ctx["device"])
    try:
        doc = json.loads(t["stdout"].strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"status": "failed", "reason": f"tools/torch_cnn.py: {why(t)}: {tail(t['stderr'], 4)}",
                "data": {"command": cmd_summary(t)}}
    if doc.get("error_kind") == "missing":
        return {"status": "skipped", "reason": doc.get("error"), "summary": doc.get("error"), "data": doc}
    if not doc.get("ok"):
        return {"status": "failed", "reason": doc.get("error") or f"exit {t['rc']}", "data": doc}
    summary = (f"PyTorch {doc['torch']} eager, batch {doc['batch_size']}, {doc['precision']}: "
               f"{_num(doc['images_per_second'])} img/s (GPU busy {_pct(doc.get('gpu_busy_fraction'))}, "
               f"{doc['steps']} steps in {doc['seconds']} s)")
    return {"status": "passed", "reason": "", "summary": summary, "data": doc}


STEP_FUNCS: dict[str, Callable[[dict[str, Any], Runner], dict[str, Any]]] = {
    "environment": step_environment, "topology": step_topology, "health": step_health, "tuning": step_tuning, "probe": step_probe,
    "fingerprint": step_fingerprint, "gain": step_gain, "serve": step_serve, "torch": step_torch,
    "verdict": step_verdict,
}


def run_step_child(name: str, ctx_file: str, result_file: str) -> int:
    """Inside the step's own process: run it, write its result (an exception is an ``error``)."""
    ctx = json.loads(Path(ctx_file).read_text())
    t0 = time.monotonic()
    try:
        res = STEP_FUNCS[name](ctx, Runner(ctx))
    except Exception as exc:  # the step broke: say how, the rest goes on
        import traceback

        res = {"status": "error", "reason": f"{type(exc).__name__}: {exc}", "data": {"traceback": traceback.format_exc()[-3000:]}}
    res.setdefault("summary", res.get("reason", ""))
    res["seconds"] = round(time.monotonic() - t0, 2)
    Path(result_file).write_text(json.dumps(res, indent=1, default=str))
    return 0


# -- the orchestration --------------------------------------------------------------------------
def commit_info() -> dict[str, Any]:
    out: dict[str, Any] = {}
    if (REPO / ".git").exists() and shutil.which("git"):
        try:
            head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                                  timeout=20).stdout.strip()
            dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=20).stdout.strip()
            if head:
                out = {"commit": head, "dirty": bool(dirty), "source": "git"}
        except (OSError, subprocess.SubprocessError):
            pass
    if os.environ.get("GPU_TUNE_COMMIT") and os.environ["GPU_TUNE_COMMIT"] != out.get("commit"):
        # the code that ran is the payload's wheel: its commit wins over a copied checkout's git
        out = {"commit": os.environ["GPU_TUNE_COMMIT"], "source": "payload (GPU_TUNE_COMMIT)",
               **({"checkout_git": out["commit"]} if out.get("commit") else {})}
    manifest = Path(os.environ.get("GPU_TUNE_PAYLOAD_DIR", "/tmp/gpu-tune-payload")) / "manifest.json"
    if manifest.is_file():
        try:
            m = json.loads(manifest.read_text())
            out.setdefault("commit", m.get("commit"))
            out.setdefault("source", "payload manifest")
            out["payload_id"] = m.get("payload_id")
            out["payload_dirty"] = m.get("dirty")
        except ValueError:
            pass
    if not out.get("commit"):
        try:
            import gpu_tune  # noqa: PLC0415

            out = {"commit": None, "version": gpu_tune.__version__, "source": "installed gpu_tune"}
        except ImportError:
            out = {"commit": None, "source": "unknown"}
    return out


def child_env() -> dict[str, str]:
    """Make gpu_tune importable for the commands (the repository's own in a checkout without it)."""
    env: dict[str, str] = {}
    probe = subprocess.run([sys.executable, "-c", "import gpu_tune"], cwd="/", capture_output=True)
    if probe.returncode != 0:
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    return env


def run_all(a: argparse.Namespace) -> int:
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work).resolve() if a.work else out.parent / (out.name + ".work")
    work.mkdir(parents=True, exist_ok=True)
    steps = [s.strip() for s in a.steps.split(",") if s.strip()] if a.steps else list(STEPS)
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise SystemExit(f"gpu_proof: --steps: unknown {', '.join(unknown)} (known: {', '.join(STEPS)})")
    steps = [s for s in STEPS if s in steps]
    data = a.data or os.environ.get("GPU_TUNE_DATA") or None
    if data:
        data = os.path.abspath(data)
    subreaper = _set_subreaper()
    t_start = time.monotonic()
    started = now()
    log_file = open(out / "proof.log", "a", buffering=1)

    def emit(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")

    env = child_env()
    ctx_base = {
        "device": a.device, "work": str(work), "data": data, "env": env,
        "gpu_tune": [sys.executable, "-m", "gpu_tune"], "probe_timeout": a.probe_timeout,
        "fingerprint_runs": a.fingerprint_runs, "gain_pairs": a.gain_pairs, "gain_window": a.gain_window,
        "serve_requests": a.serve_requests, "serve_probe_wait": a.serve_probe_wait, "torch_seconds": a.torch_seconds,
        "verdict_runs": a.verdict_runs,
    }
    commit = commit_info()
    emit(f"gpu_proof: device {a.device}, steps {', '.join(steps)}, budget {a.budget:g} s, out {out}, "
         f"commit {commit.get('commit') or commit.get('version')}, data {data or '(the probe default)'}")
    results: dict[str, Any] = {}
    mirror = Path(a.mirror).resolve() if a.mirror else None

    def save(final: bool = False) -> None:
        """The report so far (after every step, so that a call cut short still leaves one)."""
        report = {
            "format": FORMAT, "tool": "tools/gpu_proof.py", "device": a.device, "commit": commit,
            "machine": {"hostname": socket.gethostname(), "cpus": os.cpu_count(), "kernel": platform.release(),
                        "python": sys.version.split()[0]},
            "runs": [{"started": started, "finished": now() if final else None, "steps": steps,
                      "budget_seconds": a.budget, "seconds": round(time.monotonic() - t_start, 1),
                      "options": {k: ctx_base[k] for k in ("probe_timeout", "fingerprint_runs", "gain_pairs",
                                                           "gain_window", "serve_requests", "serve_probe_wait",
                                                           "torch_seconds", "verdict_runs", "data")}}],
            "steps": dict(results),
        }
        write_report(report, out)
        if mirror:
            try:
                mirror.mkdir(parents=True, exist_ok=True)
                log_file.flush()
                for f in ("report.json", "report.md", "proof.log"):
                    shutil.copyfile(out / f, mirror / f)
            except OSError as exc:
                print(f"gpu_proof: could not copy the report to {mirror}: {exc}", flush=True)

    for name in steps:
        elapsed = time.monotonic() - t_start
        left = a.budget - elapsed
        expect = EXPECT[a.device][name]
        if name == "fingerprint":
            expect = int(expect * a.fingerprint_runs / 3) if a.device == "gpu" else expect
        if name == "verdict":
            expect = int(expect * a.verdict_runs / len(VERDICT_PLAN))
        if left < expect:
            results[name] = {"status": "not_run", "reason": f"not started: {left:.0f} s of the --budget left, the step "
                                                          f"needs about {expect} s; run it in another call (--steps {name})",
                             "seconds": 0.0, "started": now()}
            emit(f"== {name}: not_run ({results[name]['reason']})")
            save()
            continue
        limit = max(5.0, min(a.limits.get(name, LIMIT[name]), left - 3.0))
        ctx = dict(ctx_base, deadline=time.time() + limit, step=name)
        ctx_file, res_file = work / f"{name}.ctx.json", work / f"{name}.result.json"
        ctx_file.write_text(json.dumps(ctx))
        if res_file.exists():
            res_file.unlink()
        step_started = now()
        emit(f"== {name}: started ({step_started}, limit {limit:.0f} s)")
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-u", str(Path(__file__).resolve()), "--run-step", name, "--ctx",
                                 str(ctx_file), "--result", str(res_file)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(work),
                                env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)

        def pump(stream=proc.stdout) -> None:
            for raw in iter(stream.readline, b""):
                emit("  " + raw.decode("utf-8", "replace").rstrip())

        th = threading.Thread(target=pump, daemon=True)
        th.start()
        timed_out = False
        try:
            proc.wait(timeout=limit + 5)
        except subprocess.TimeoutExpired:
            timed_out = True
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _killpg(proc.pid)
                proc.wait()
        _killpg(proc.pid)
        th.join(timeout=5)
        leftovers = kill_leftovers() if subreaper else []
        took = round(time.monotonic() - t0, 2)
        if timed_out:
            res = {"status": "timeout", "reason": f"killed after {limit:.0f} s (its time limit)", "seconds": took}
        elif res_file.exists():
            res = json.loads(res_file.read_text())
        else:
            res = {"status": "error", "reason": f"the step's process exited {proc.returncode} without a result",
                   "seconds": took}
        res["started"] = step_started
        if leftovers:
            res["leftovers_killed"] = leftovers
        results[name] = res
        emit(f"== {name}: {res['status']} in {took} s: {res.get('summary') or res.get('reason') or ''}")
        if res.get("reason") and res["status"] != "passed" and res.get("summary") != res.get("reason"):
            emit(f"   reason: {res['reason']}")
        save()
    bad = [n for n, r in results.items() if r["status"] not in ("passed", "skipped")]
    not_passed = ", ".join(f"{n} ({results[n]['status']})" for n in bad)
    emit(f"gpu_proof: {len(results) - len(bad)}/{len(results)} steps passed or skipped; report in {out}/report.md"
         + (f"; not passed: {not_passed}" if bad else ""))
    save(final=True)
    log_file.close()
    return 0 if not bad else 1


# -- the report ---------------------------------------------------------------------------------
def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from several calls: each step from the last report where it ran (not_run only
    where it ran nowhere); the runs of all of them."""
    if not reports:
        raise ValueError("nothing to merge")
    devices = {r.get("device") for r in reports}
    merged = {k: v for k, v in reports[-1].items() if k not in ("steps", "runs")}
    merged["device"] = reports[-1].get("device") if len(devices) == 1 else sorted(str(d) for d in devices)
    commits = []
    for r in reports:
        c = (r.get("commit") or {}).get("commit")
        if c not in commits:
            commits.append(c)
    if len(commits) > 1:
        merged["commits_differ"] = commits
    merged["runs"] = [run for r in reports for run in r.get("runs", [])]
    steps: dict[str, Any] = {}
    for name in STEPS:
        ran = [r["steps"][name] for r in reports if name in r.get("steps", {}) and r["steps"][name].get("status") != "not_run"]
        if ran:
            steps[name] = ran[-1]
        else:
            left = [r["steps"][name] for r in reports if name in r.get("steps", {})]
            if left:
                steps[name] = left[-1]
    merged["steps"] = steps
    return merged


def _cell(v: Any) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def device_bound_ratio(report: dict[str, Any]) -> dict[str, Any] | None:
    """The probe's device-bound images/s against PyTorch eager's, where both were measured."""
    steps = report.get("steps", {})
    probe, torch = steps.get("probe") or {}, steps.get("torch") or {}
    if probe.get("status") in (None, "not_run") or torch.get("status") != "passed":
        return None
    rows = (probe.get("data") or {}).get("results") or []
    if not rows:
        return None
    db = (rows[0].get("regimes") or {}).get("device_bound") or {}
    tf_ips, pt_ips = db.get("images_per_second"), (torch.get("data") or {}).get("images_per_second")
    if not tf_ips or not pt_ips:
        return None
    return {"tensorflow_probe": tf_ips, "tensorflow_batch": db.get("batch_size"),
            "tensorflow_precision": db.get("precision"), "tensorflow_xla": db.get("xla"),
            "pytorch_precision": torch["data"].get("precision"), "pytorch_version": torch["data"].get("torch"),
            "tensorflow_gpu_busy": db.get("gpu_busy_fraction"), "pytorch_eager": pt_ips,
            "pytorch_batch": torch["data"].get("batch_size"), "pytorch_gpu_busy": torch["data"].get("gpu_busy_fraction"),
            "ratio": round(tf_ips / pt_ips, 3)}


def render_markdown(report: dict[str, Any]) -> str:
    steps = report.get("steps", {})
    env = (steps.get("environment") or {}).get("data") or {}
    nv = env.get("nvml") or {}
    tf = env.get("tensorflow") or {}
    gpus = nv.get("gpus") or []
    commit = report.get("commit") or {}
    L: list[str] = []
    dev = report.get("device")
    title = gpus[0]["name"] if gpus else ("CPU (fixture trees)" if dev == "cpu" else "GPU")
    L.append(f"### GPU proof: {title}, `--device {dev}`")
    L.append("")
    L.append("| | |")
    L.append("| --- | --- |")
    if gpus:
        L.append(f"| GPU | {len(gpus)}x {gpus[0]['name']}, {gpus[0].get('memory_total_mib')} MiB, compute capability "
                 f"{gpus[0].get('compute_capability')}, driver {nv.get('driver')} (CUDA {nv.get('cuda_driver')}) |")
    elif env:
        L.append(f"| GPU | none through NVML ({_cell(nv.get('reason', ''))[:80]}) |")
    if env:
        L.append(f"| host | {env.get('cpu_count')} CPUs ({_cell(env.get('cpu_model'))}), {env.get('memory_total_gib')} GiB, "
                 f"kernel {env.get('kernel')}, Python {env.get('python')} |")
        if "error" in tf:
            L.append(f"| TensorFlow | import failed: {_cell(tf['error'])[-200:]} |")
        elif tf:
            bi = tf.get("build_info") or {}
            L.append(f"| TensorFlow | {tf.get('version')}, CUDA build {bi.get('cuda_version')}, cuDNN {bi.get('cudnn_version')}, "
                     f"sees {len(tf.get('gpus') or [])} GPU(s); import {tf.get('import_seconds')} s |")
        L.append(f"| gpu-tune | {(env.get('gpu_tune') or {}).get('version')} from `{(env.get('gpu_tune') or {}).get('file')}` |")
    c = commit.get("commit") or commit.get("version")
    dirty = " (uncommitted changes)" if commit.get("dirty") or commit.get("payload_dirty") else ""
    payload = f", payload {commit['payload_id']}" if commit.get("payload_id") else ""
    L.append(f"| commit | `{c}`{dirty}{payload} |")
    if report.get("commits_differ"):
        L.append(f"| commits | the merged runs used different commits: {', '.join(str(x) for x in report['commits_differ'])} |")
    runs = report.get("runs") or []
    L.append(f"| runs | {len(runs)}: " + "; ".join(f"{r.get('started')} ({', '.join(r.get('steps', []))}; {r.get('seconds')} s)"
                                                for r in runs) + " |")
    L.append("")
    L.append("| step | status | what it showed | seconds |")
    L.append("| --- | --- | --- | --- |")
    for name in STEPS:
        s = steps.get(name)
        if not s:
            continue
        text = s.get("summary") or ""
        if s.get("status") not in ("passed",) and s.get("reason") and s.get("reason") != text:
            text = (text + "; " if text else "") + "reason: " + s["reason"]
        status = s.get("status", "?")
        L.append(f"| {name} | {'**' + status + '**' if status not in ('passed', 'skipped') else status} | "
                 f"{_cell(text)[:700]} | {s.get('seconds', '')} |")
    probe = steps.get("probe") or {}
    rows = (probe.get("data") or {}).get("results") or []
    if rows:
        L += ["", "Probe (`gpu-tune probe --gpu all -o json`):", "",
              "| GPU | regime | batch | images/s | GPU busy | steps | precision, XLA |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for row in rows:
            for reg, w in (row.get("regimes") or {}).items():
                L.append(f"| {row['gpu']} | {reg.replace('_', '-')} | {w.get('batch_size')} | {_num(w.get('images_per_second'))} | "
                         f"{_pct(w.get('gpu_busy_fraction'))} ({w.get('gpu_samples')} samples) | {w.get('steps')} | "
                         f"{w.get('precision')}, XLA {'on' if w.get('xla') else 'off'} |")
        for row in rows:
            t = row.get("timings") or {}
            parts = ", ".join(f"{k.replace('_seconds', '').replace('_', ' ')} {v}" for k, v in t.items()
                              if k != "total_seconds" and isinstance(v, (int, float)))
            L.append("")
            L.append(f"{row['gpu']}: {row['status']}, accuracy {row['accuracy']}, fingerprint `{row['fingerprint']}`, "
                     f"time to verdict {row['time_to_verdict_seconds']} s ({parts}); inference images/s "
                     f"{row.get('inference_images_per_second')}; peer group `{row.get('peer_group')}`; "
                     f"{datapath_text(row)}.")
    vd = steps.get("verdict") or {}
    if (vd.get("data") or {}).get("runs"):
        L += ["", "Time to verdict, with the compilation cache cold (emptied first), warm and off:", "",
              "| cache | load | busy loops | GPU: time to verdict (cache state, compile seconds, device-bound GPU busy "
              "settled / all samples) | fingerprint |", "| --- | --- | --- | --- | --- |"]
        for run in vd["data"]["runs"]:
            cells = []
            for g in run["gpus"]:
                t = g.get("timings") or {}
                comp = sum(v for k, v in t.items() if k.endswith("_compile_seconds") and isinstance(v, (int, float)))
                cells.append(f"{g['gpu']}: {g['time_to_verdict_seconds']} s ({g['compile_cache']}, compile {comp:.1f} s, "
                             f"busy {_pct(g.get('device_bound_busy'))} / {_pct(g.get('device_bound_busy_all'))})")
            fps = ", ".join(f"`{g['fingerprint']}`" for g in run["gpus"])
            L.append(f"| {run['cache']} | {run['load']} | {run['busy_loops']} | {'; '.join(cells) or 'no result'} | {fps} |")
        L.append("")
        L.append(f"All fingerprints equal with and without the cache: **{'yes' if vd['data'].get('all_equal') else 'no'}**."
                 + "".join(f" {n}." for n in vd["data"].get("notes") or []))
    fp = steps.get("fingerprint") or {}
    if (fp.get("data") or {}).get("runs"):
        L += ["", "Fingerprint, idle and with every CPU busy:", "",
              "| run | load | busy loops | load average | GPU: fingerprint (accuracy, time to verdict) |", "| --- | --- | --- | --- | --- |"]
        for run in fp["data"]["runs"]:
            g = "; ".join(f"{x['gpu']}: `{x['fingerprint']}` ({x['accuracy']}, {x['time_to_verdict_seconds']} s)" for x in run["gpus"]) or \
                "no result"
            L.append(f"| {run['run']} | {run['load']} | {run['busy_loops']} | {run.get('loadavg_before')} | {g} |")
        L.append("")
        L.append(f"All fingerprints equal: **{'yes' if fp['data'].get('all_equal') else 'no'}**."
                 + "".join(f" {n}." for n in fp["data"].get("notes") or []))
    ratio = device_bound_ratio(report)
    if ratio:
        L += ["", "Device-bound regime against PyTorch eager (same network, data on the device):", "",
              "| | batch | images/s | GPU busy |", "| --- | --- | --- | --- |",
              f"| TensorFlow probe ({ratio['tensorflow_precision']}, XLA {'on' if ratio['tensorflow_xla'] else 'off'}) | {ratio['tensorflow_batch']} | {_num(ratio['tensorflow_probe'])} | {_pct(ratio['tensorflow_gpu_busy'])} |",
              f"| PyTorch {ratio['pytorch_version']} eager ({ratio['pytorch_precision']}) | {ratio['pytorch_batch']} | {_num(ratio['pytorch_eager'])} | {_pct(ratio['pytorch_gpu_busy'])} |",
              "", f"TensorFlow probe / PyTorch eager: **{ratio['ratio']}x**."]
    gain = steps.get("gain") or {}
    for t in (gain.get("data") or {}).get("targets") or []:
        L += ["", f"Gain, {t['gpu']} ({gain['data'].get('pairs')} pairs, order {' '.join('A' if s == 'untuned' else 'B' for s in gain['data'].get('order') or [])}):", "",
              "| measure | untuned (A) | tuned (B) | tuned/untuned [95% interval] | verdict |", "| --- | --- | --- | --- | --- |"]
        for mname, m in (t.get("measures") or {}).items():
            L.append(f"| {mname} | {m.get('median_untuned')} | {m.get('median_tuned')} | {m.get('change')} | {m.get('verdict')} |")
    serve = steps.get("serve") or {}
    rss = (serve.get("data") or {}).get("rss_mib")
    if rss:
        L += ["", "Agent (`gpu-tune serve --no-kube`): RSS (VmRSS / VmHWM, MiB): "
              + "; ".join(f"{k.replace('_', ' ')}: {v.get('VmRSS')} / {v.get('VmHWM')}" for k, v in rss.items()) + "."]
    tuning = steps.get("tuning") or {}
    td = tuning.get("data") or {}
    if td:
        L += ["", f"Tuning on `{td.get('host')}`: audit before {td.get('audit_before', {}).get('counts')}; apply "
              f"{td.get('apply', {}).get('counts')} ({td.get('apply', {}).get('changed')} changed); after revert "
              f"{td.get('audit_after_revert', {}).get('counts')}; {td.get('journal_files')} files in the journal "
              f"({td.get('journal_files_absent_before')} absent before apply: absent again), "
              f"{td.get('compared_with_snapshot')} compared with both the journal's copy and the file as read before "
              f"apply: byte-exact **{td.get('byte_exact')}**; persistence mode (NVML, or the fixture backend's file) "
              + ", ".join(f"GPU {k}: {_onoff(v)} → {_onoff(pm.get('after_apply', {}).get(k))} → "
                          f"{_onoff(pm.get('after_revert', {}).get(k))}"
                          for pm in [td.get("persistence_mode") or {}] for k, v in (pm.get("before") or {}).items())
              + "."]
    L.append("")
    return "\n".join(L)


def write_report(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    ratio = device_bound_ratio(report)
    if ratio:
        report["device_bound_vs_pytorch"] = ratio
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "report.md").write_text(render_markdown(report))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[6:24]))
    ap.add_argument("--device", choices=("gpu", "cpu"), default=None)
    ap.add_argument("--out", required=False, help="report folder (report.json, report.md, proof.log)")
    ap.add_argument("--work", default=None, help="scratch folder [default: OUT.work beside OUT]")
    ap.add_argument("--mirror", default=None, metavar="DIR",
                    help="also copy report.json, report.md and proof.log there after every step")
    ap.add_argument("--steps", default=None, help=f"comma-separated subset of {','.join(STEPS)}")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run; steps that would not fit are not started")
    ap.add_argument("--data", default=None, help="MNIST file for the probe [default: env GPU_TUNE_DATA, else the probe's default]")
    ap.add_argument("--probe-timeout", type=float, default=300.0, help="gpu-tune probe --timeout")
    ap.add_argument("--fingerprint-runs", type=int, default=3, help="probe runs idle and again busy")
    ap.add_argument("--gain-pairs", type=int, default=6, help="gpu-tune gain --pairs (6: the fewest a verdict can rest on)")
    ap.add_argument("--gain-window", type=float, default=None, help="gpu-tune gain --window [default: the profile's]")
    ap.add_argument("--serve-requests", type=int, default=300)
    ap.add_argument("--serve-probe-wait", type=float, default=120.0, help="seconds to wait for the agent's first probe")
    ap.add_argument("--torch-seconds", type=float, default=3.0)
    ap.add_argument("--verdict-runs", type=int, default=len(VERDICT_PLAN),
                    help="runs of the verdict step, the first N of: " + ", ".join(f"{c} {l}" for c, l in VERDICT_PLAN))
    ap.add_argument("--limit", action="append", default=[], metavar="STEP=S",
                    help="hard time limit of a step in seconds (repeatable) [default: " +
                         ", ".join(f"{k} {v}" for k, v in LIMIT.items()) + "]")
    ap.add_argument("--merge", nargs="+", metavar="REPORT", help="merge these report.json files into --out")
    ap.add_argument("--run-step", help=argparse.SUPPRESS)
    ap.add_argument("--ctx", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.run_step:
        return run_step_child(a.run_step, a.ctx, a.result)
    if not a.out:
        ap.error("--out is required")
    if a.merge:
        reports = [json.loads(Path(p).read_text()) for p in a.merge]
        merged = merge_reports(reports)
        write_report(merged, Path(a.out))
        print(f"gpu_proof: merged {len(reports)} reports into {Path(a.out) / 'report.md'}")
        return 0
    if not a.device:
        ap.error("--device gpu|cpu is required (or --merge)")
    a.limits = {}
    for item in a.limit:
        name, _, sec = item.partition("=")
        try:
            a.limits[name] = float(sec)
        except ValueError:
            ap.error(f"--limit {item}: expected STEP=SECONDS")
        if name not in STEPS or a.limits[name] <= 0:
            ap.error(f"--limit {item}: expected one of {', '.join(STEPS)} and a positive number of seconds")
    if a.fingerprint_runs < 1 or a.gain_pairs < 1 or a.serve_requests < 1:
        ap.error("--fingerprint-runs, --gain-pairs and --serve-requests must be at least 1")
    if not 1 <= a.verdict_runs <= len(VERDICT_PLAN):
        ap.error(f"--verdict-runs {a.verdict_runs}: expected 1..{len(VERDICT_PLAN)}")
    return run_all(a)


_UNSET = object()


class _ReExports(types.ModuleType):
    """Assigning one of the re-exported names on this module (a test putting a fixture host in
    place of ``host_for``) assigns it, too, in every module of the package that holds the same
    object, so that the steps use what was put here."""

    def __setattr__(self, name: str, value: Any) -> None:
        old = self.__dict__.get(name, _UNSET)
        if old is not _UNSET and name in __all__:
            for mod_name, mod in list(sys.modules.items()):
                if (mod_name == "proof" or mod_name.startswith("proof.")) and getattr(mod, name, _UNSET) is old:
                    setattr(mod, name, value)
        super().__setattr__(name, value)


_this = sys.modules.get(__name__)
if _this is not None and _this.__dict__ is globals():
    _this.__class__ = _ReExports


if __name__ == "__main__":
    sys.exit(main())
