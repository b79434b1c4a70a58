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
import types
from pathlib import Path
from typing import Any, Callable

# The steps are the modules of the ``proof`` package beside this file (tools/proof/).
TOOLS = Path(__file__).resolve().parent
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

from proof.common import (EXPECT, FIXTURE_RUN, FIXTURE_TUNE, FORMAT, GOAL_WARM_BUSY_S, GOAL_WARM_IDLE_S,  # noqa: E402
                          LIMIT, REPO, STATUSES, STEPS, VERDICT_PLAN, _num, _onoff, _pct, now, tail)
from proof.host_steps import step_environment, step_health, step_topology, step_tuning  # noqa: E402
from proof.hosts import host_for, nvml_facts, persistence, snapshot  # noqa: E402
from proof.probe_steps import (datapath_text, probe_rows, run_probe, step_fingerprint, step_gain,  # noqa: E402
                               step_probe, step_verdict)
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
