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
from pathlib import Path
from typing import Any, Callable

# The steps are the modules of the ``proof`` package beside this file (tools/proof/).
TOOLS = Path(__file__).resolve().parent
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

from proof.checkout import child_env, commit_info  # noqa: E402
from proof.common import (EXPECT, FIXTURE_RUN, FIXTURE_TUNE, FORMAT, GOAL_WARM_BUSY_S, GOAL_WARM_IDLE_S,  # noqa: E402
                          LIMIT, REPO, STATUSES, STEPS, VERDICT_PLAN, now, tail)
from proof.host_steps import step_environment, step_health, step_topology, step_tuning  # noqa: E402
from proof.hosts import host_for, nvml_facts, persistence, snapshot  # noqa: E402
from proof.probe_steps import (datapath_text, probe_rows, run_probe, step_fingerprint, step_gain,  # noqa: E402
                               step_probe, step_verdict)
from proof.report import device_bound_ratio, merge_reports, render_markdown, write_report  # noqa: E402
from proof.runner import Runner, _killpg, _set_subreaper, _signal_group, cmd_summary, kill_leftovers, why  # noqa: E402
from proof.serve import step_serve  # noqa: E402
from proof.torch_step import step_torch, torch_env  # noqa: E402

# Names this module keeps for whoever loads it (tests/test_gpu_proof.py): the package's, re-exported.
__all__ = ["EXPECT", "FIXTURE_RUN", "FIXTURE_TUNE", "FORMAT", "GOAL_WARM_BUSY_S", "GOAL_WARM_IDLE_S", "LIMIT", "REPO",
           "STATUSES", "STEPS", "STEP_FUNCS", "VERDICT_PLAN", "Runner", "cmd_summary", "commit_info", "datapath_text",
           "device_bound_ratio", "host_for", "main", "merge_reports", "nvml_facts", "persistence", "probe_rows",
           "render_markdown", "run_all", "run_probe", "run_step_child", "snapshot", "step_environment",
           "step_fingerprint", "step_gain", "step_health", "step_probe", "step_serve", "step_topology", "step_torch",
           "step_tuning", "step_verdict", "tail", "torch_env", "why", "write_report"]


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


if __name__ == "__main__":
    sys.exit(main())
