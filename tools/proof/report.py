"""The report: merging the reports of several calls, and the Markdown for docs/gpu.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .common import STEPS, _num, _onoff, _pct
from .probe_steps import datapath_text


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
