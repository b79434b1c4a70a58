"""The host's steps: environment, topology, health and tuning."""

from __future__ import annotations

import glob
import json
import os
import platform
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

from .common import _onoff, cpu_model, loadavg, read_text, tail
from .hosts import audit_counts, audit_values, host_file, host_for, journal_files, nvml_facts, persistence, snapshot
from .runner import Runner, cmd_summary, why


def step_environment(ctx: dict[str, Any], r: Runner) -> dict[str, Any]:
    data: dict[str, Any] = {
        "python": sys.version.split()[0], "python_executable": sys.executable, "platform": platform.platform(),
        "kernel": platform.release(), "hostname": socket.gethostname(), "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)), "cpu_model": cpu_model(), "loadavg": loadavg(),
        "memory_total_gib": None, "nvml": nvml_facts(),
        "env": {k: os.environ.get(k) for k in ("PYTHONPATH", "LD_LIBRARY_PATH", "XLA_FLAGS", "CUDA_VISIBLE_DEVICES",
                                                "GPU_TUNE_PAYLOAD_ID", "GPU_TUNE_COMMIT")},
        "numactl": shutil.which("numactl"),
        "jemalloc": sorted(set(glob.glob("/usr/lib/*/libjemalloc.so.2") + glob.glob("/usr/lib64/libjemalloc.so.2"))),
    }
    for line in (read_text("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            data["memory_total_gib"] = round(int(line.split()[1]) / 2**20, 1)
    script = ("import json,gpu_tune; print(json.dumps({'version': gpu_tune.__version__, "
              "'file': gpu_tune.__file__}))")
    g = r.run([sys.executable, "-c", script], timeout=60, label="python -c 'import gpu_tune'")
    try:
        data["gpu_tune"] = json.loads(g["stdout"].strip().splitlines()[-1])
    except (ValueError, IndexError):
        data["gpu_tune"] = {"error": tail(g["stderr"])}
    tf_script = r"""
import json, time
t = time.monotonic()
from gpu_tune.workload import train as tr
tf = tr.tf
took = time.monotonic() - t
info = {k: (v if isinstance(v, (str, int, float, bool)) or v is None else str(v))
        for k, v in dict(tf.sysconfig.get_build_info()).items()}
gpus = tf.config.list_physical_devices("GPU")
details = []
for g in gpus:
    d = tf.config.experimental.get_device_details(g)
    details.append({"name": d.get("device_name"), "compute_capability": list(d.get("compute_capability") or [])})
print(json.dumps({"version": tf.__version__, "import_seconds": round(took, 2), "build_info": info,
                  "built_with_cuda": tf.test.is_built_with_cuda(), "gpus": details}))
"""
    t = r.run([sys.executable, "-c", tf_script], timeout=200, label="python -c 'import tensorflow (as the probe does)'")
    try:
        data["tensorflow"] = json.loads(t["stdout"].strip().splitlines()[-1])
    except (ValueError, IndexError):
        data["tensorflow"] = {"error": tail(t["stderr"]) or f"exit {t['rc']}"}
    tf = data["tensorflow"]
    nv = data["nvml"]
    reasons = []
    if "error" in data["gpu_tune"]:
        reasons.append(f"gpu_tune does not import: {data['gpu_tune']['error'][-300:]}")
    if "error" in tf:
        reasons.append(f"TensorFlow does not import: {tf['error'][-400:]}")
    if ctx["device"] == "gpu":
        if nv.get("status") != "ok" or not nv.get("gpus"):
            reasons.append(f"NVML: {nv.get('reason') or 'no GPU'}")
        if "error" not in tf and not tf.get("gpus"):
            reasons.append("TensorFlow sees no GPU")
    gpus = nv.get("gpus") or []
    what = (f"{len(gpus)}x {gpus[0]['name']}, driver {nv.get('driver')} (CUDA {nv.get('cuda_driver')})" if gpus
            else f"no GPU through NVML ({nv.get('reason', '')[:60]})")
    tfs = (f"TensorFlow {tf.get('version')} (CUDA build {tf.get('build_info', {}).get('cuda_version')}, cuDNN "
           f"{tf.get('build_info', {}).get('cudnn_version')}) sees {len(tf.get('gpus') or [])} GPU(s), import "
           f"{tf.get('import_seconds')} s" if "error" not in tf else "TensorFlow: import failed")
    summary = f"{what}; Python {data['python']}; {data['cpu_count']} CPUs; {tfs}"
    return {"status": "failed" if reasons else "passed", "reason": "; ".join(reasons), "summary": summary, "data": data}


def step_topology(ctx: dict[str, Any], r: Runner) -> dict[str, Any]:
    host = host_for(ctx, "tune")
    t = r.gpu_tune("topology", "-o", "json", timeout=60, host=host)
    doc = t["json"]
    if t["rc"] != 0 or not isinstance(doc, dict):
        return {"status": "failed", "reason": f"gpu-tune topology: {why(t)}: {tail(t['stderr'], 3)}",
                "data": {"command": cmd_summary(t)}}
    gpus = doc.get("gpus") or []
    nodes = doc.get("numa_nodes") or []
    gl = ", ".join(f"GPU {g['index']} {g.get('name')} on node {g.get('numa_node')} ({g.get('numa_source')}), "
                   f"PCIe gen{(g.get('pcie') or {}).get('gen_current')} x{(g.get('pcie') or {}).get('width_current')}"
                   for g in gpus)
    summary = f"{len(nodes)} NUMA node(s), {doc.get('cpu_count')} CPUs, {len(gpus)} GPU(s): {gl or '-'}"
    ok = bool(gpus) or ctx["device"] == "cpu"
    return {"status": "passed" if ok else "failed", "reason": "" if ok else "no GPU in the topology",
            "summary": summary, "data": {"host": host["root"], "command": cmd_summary(t), "topology": doc}}


# The GPU backend's health readings per GPU, as JSON (run with the proof's interpreter):
# argv: backend, fixture file or "".
READINGS = """
import json, sys
from gpu_tune.gpu import select_backend
KEYS = ("recovery_action", "reset_required", "inforom_valid", "remapped_rows", "sram_ecc", "nvlink_p2p", "fabric",
        "pcie_replay_count", "clock_throttle_reasons", "sm_clock_mhz", "sm_clock_max_mhz", "pcie_link_gen_current",
        "pcie_link_width_current", "pcie_link_gen_max", "pcie_link_gen_gpu_max", "mig_mode", "unread")
out = []
for g in select_backend(sys.argv[1], sys.argv[2] or None).gpus():
    d = g.as_dict()
    row = {"index": g.index, "name": g.name, "pci_bus_id": g.pci_bus_id, "error": g.error}
    row.update({k: d.get(k) for k in KEYS})
    links = d.get("nvlink")
    row["nvlink_active"] = None if links is None else sum(1 for x in links if x.get("active"))
    row["nvlink_errors"] = None if links is None else {
        k: sum(x.get(k) or 0 for x in links) for k in ("crc_errors", "replay_errors", "recovery_errors")}
    out.append(row)
print(json.dumps(out))
"""
HARDWARE_CHECKS = ("gpu.backend", "gpu.present", "gpu.count", "gpu.xid", "gpu.recovery", "gpu.memory", "gpu.nvlink",
                   "gpu.fabric", "nvswitch.sxid", "network.infiniband", "gpu.pcie", "gpu.thermal")


def step_health(ctx: dict[str, Any], r: Runner) -> dict[str, Any]:
    host = host_for(ctx, "tune")
    t = r.gpu_tune("check", "-o", "json", timeout=60, host=host)
    doc = t["json"]
    if t["rc"] not in (0, 1) or not isinstance(doc, dict):
        return {"status": "failed", "reason": f"gpu-tune check: {why(t)}: {tail(t['stderr'], 3)}",
                "data": {"command": cmd_summary(t)}}
    checks = {c["name"]: c for c in doc.get("checks") or []}
    false_alarms = [f"{n}: {c['detail']}" for n, c in checks.items()
                    if n in HARDWARE_CHECKS and not c["ok"] and c.get("severity") == "fatal"]
    warnings = [f"{n}: {c['detail']}" for n, c in checks.items() if not c["ok"] and c.get("severity") == "warning"]
    # the GPU backend's own health readings: what the H100 fixture should hold (docs/health.md)
    back = host["args"][host["args"].index("--gpu-backend") + 1]
    fix = host["fixture"] or ""
    rd = r.run([sys.executable, "-c", READINGS, back, fix], timeout=60, label="the GPU backend's health readings")
    try:
        readings = json.loads(rd["stdout"])
    except ValueError:
        readings = {"error": tail(rd["stderr"], 3)}
    listed = ", ".join(f"{n} {'ok' if c['ok'] else 'FAIL'}" for n, c in checks.items() if n in HARDWARE_CHECKS)
    summary = (f"{len(checks)} checks ({listed}); kernel log: "
               + ((checks.get("gpu.xid") or {}).get("detail", "-"))[:160]
               + (f"; warnings: {'; '.join(w[:120] for w in warnings)}" if warnings else ""))
    ok = not false_alarms
    return {"status": "passed" if ok else "failed",
            "reason": "" if ok else "a healthy host fails: " + "; ".join(f[:200] for f in false_alarms),
            "summary": summary, "data": {"host": host["root"], "command": cmd_summary(t), "check": doc,
                                         "readings": readings}}


def step_tuning(ctx: dict[str, Any], r: Runner) -> dict[str, Any]:
    host = host_for(ctx, "tune")
    root, whole = host["root"], not host["real"]
    notes = []
    pre_journal = host_file(root, "/var/lib/gpu-tune/journal.json")
    if pre_journal and json.loads(pre_journal or b"{}").get("entries"):
        rv0 = r.gpu_tune("revert", "-o", "json", timeout=120, host=host)
        notes.append(f"the journal held originals of an earlier apply: reverted first (exit {rv0['rc']})")
    before = snapshot(root, whole)
    pm = {"before": persistence(host)}
    a1 = r.gpu_tune("audit", "-o", "json", timeout=120, host=host)
    ap = r.gpu_tune("apply", "-o", "json", timeout=180, host=host)
    jtext = host_file(root, "/var/lib/gpu-tune/journal.json")
    try:
        entries = json.loads(jtext or b"{}").get("entries") or []
    except ValueError:
        entries = []
    pm["after_apply"] = persistence(host)
    a2 = r.gpu_tune("audit", "-o", "json", timeout=120, host=host)
    rv = r.gpu_tune("revert", "-o", "json", timeout=180, host=host)
    pm["after_revert"] = persistence(host)
    a3 = r.gpu_tune("audit", "-o", "json", timeout=120, host=host)

    files = journal_files(entries)
    checked, mismatches, vs_snapshot = [], [], 0
    for f in files:
        now_bytes = host_file(root, f["path"])
        row = {"id": f["id"], "target": f["target"], "path": f["path"]}
        if f["absent"]:
            row["ok"] = now_bytes is None and not (Path(root) / f["path"].lstrip("/")).exists()
            row["compared_with"] = "absent before"
        else:
            ok = now_bytes is not None and (f["raw"] is None or now_bytes == f["raw"])
            row["compared_with"] = "journal"
            if f["path"] in before:
                vs_snapshot += 1
                ok = ok and now_bytes == before[f["path"]]
                row["compared_with"] = "journal and the file read before apply"
            row["ok"] = ok
            if not ok:
                row["now"] = (now_bytes or b"")[:200].decode("utf-8", "replace")
                row["before"] = (before.get(f["path"]) or f["raw"] or b"")[:200].decode("utf-8", "replace")
        checked.append(row)
        if not row["ok"]:
            mismatches.append(row)
    for e in entries:  # folders apply created (they did not exist before it) are gone again
        for d in e.get("created_dirs") or []:
            if (Path(root) / d.lstrip("/")).exists():
                mismatches.append({"id": e.get("id"), "target": e.get("target"), "path": d, "ok": False,
                                   "compared_with": "created by apply", "now": "still there after revert"})
    tree_diff: list[str] = []
    if whole:  # a fixture tree: every file, not only those the journal names
        after = snapshot(root, True)
        tree_diff = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    v1, v3 = audit_values(a1["json"]), audit_values(a3["json"])
    audit_diff = sorted(k for k in set(v1) | set(v3) if v1.get(k) != v3.get(k))
    applied = ap["json"] or {}
    changed = sum(1 for s in applied.get("settings", []) if s.get("changed"))
    not_applied = [f"{s['id']}@{s['target']}: {s['status']} {s.get('detail', '')}".strip()
                   for s in applied.get("settings", []) if s.get("status") in ("drift", "error", "conflict")]
    byte_exact = bool(files) and not mismatches and not tree_diff
    reasons = []
    if ap["rc"] != 0:
        reasons.append(f"apply exited {ap['rc']}" + (f": {'; '.join(not_applied[:5])}" if not_applied else
                                                      f": {tail(ap['stderr'], 2)}"))
    if a2["rc"] != 0:
        reasons.append(f"audit after apply exited {a2['rc']} (not compliant: "
                       f"{', '.join(k for k, v in audit_counts(a2['json']).items() if k in ('drift', 'error', 'conflict'))})")
    restored = (rv["json"] or {}).get("restored")
    if rv["rc"] != 0 or not restored:
        reasons.append(f"revert exited {rv['rc']}, restored {restored}")
    if not files:
        reasons.append("the journal recorded no file (nothing to compare)")
    if mismatches:
        reasons.append(f"{len(mismatches)} file(s) differ after revert: "
                       + ", ".join(m["path"] for m in mismatches[:5]))
    if tree_diff:
        reasons.append(f"{len(tree_diff)} file(s) of the fixture tree differ after revert: {', '.join(tree_diff[:5])}")
    if audit_diff:
        reasons.append(f"audit values before apply and after revert differ: {', '.join(audit_diff[:5])}")
    if pm["after_revert"] != pm["before"]:
        reasons.append(f"persistence mode {pm['before']} before, {pm['after_revert']} after revert")
    pm_line = ", ".join(f"GPU {k}: {_onoff(pm['before'].get(k))} -> {_onoff(pm['after_apply'].get(k))} -> "
                        f"{_onoff(pm['after_revert'].get(k))}" for k in pm["before"])
    summary = (f"apply changed {changed} setting(s) (exit {ap['rc']}); audit after apply "
               f"{'compliant' if a2['rc'] == 0 else 'NOT compliant'}; revert {'restored' if restored else 'NOT restored'}; "
               f"{len(files)} file(s) recorded, {'all byte-exact' if byte_exact else 'NOT byte-exact'} after revert"
               f"{f' (fixture tree: all {len(before)} files equal)' if whole and not tree_diff else ''}; "
               f"persistence mode {pm_line or '-'}")
    data = {"host": root, "real_host": host["real"], "notes": notes,
            "audit_before": {"rc": a1["rc"], "counts": audit_counts(a1["json"])},
            "apply": {**cmd_summary(ap), "changed": changed, "counts": audit_counts(ap["json"]), "not_applied": not_applied},
            "audit_after_apply": {"rc": a2["rc"], "compliant": (a2["json"] or {}).get("compliant"),
                                  "counts": audit_counts(a2["json"])},
            "revert": {**cmd_summary(rv), "restored": restored},
            "audit_after_revert": {"rc": a3["rc"], "counts": audit_counts(a3["json"]), "differs_from_before": audit_diff},
            "journal_files": len(files), "journal_files_absent_before": sum(1 for f in files if f["absent"]),
            "compared_with_snapshot": vs_snapshot, "byte_exact": byte_exact,
            "mismatches": mismatches, "fixture_tree_files": len(before) if whole else None,
            "fixture_tree_differs": tree_diff, "persistence_mode": pm,
            "files": [{k: v for k, v in c.items() if k in ("id", "target", "path", "ok")} for c in checked]}
    return {"status": "failed" if reasons else "passed", "reason": "; ".join(reasons), "summary": summary, "data": data}
