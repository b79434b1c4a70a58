#!/usr/bin/env python3
"""The probe's XLA compilation cache with something in it that is not the agent's own: the time to
verdict of a real probe run with each fault, against the same run with a clean cache.

    .venv/bin/python benchmarks/bench_hostile_round4_cache.py [--timeout 120] [--only NAME] [--json]

Each probe is the real workload on the CPU with the GPU's XLA path (``--xla on``: the cache is
used; on a CPU the default leaves XLA off) through the probe runner, as ``gpu-tune probe`` and the
agent run it (``gpu_tune.judge.probe.run_probes``: the cache's upkeep, then the workload in its own
process with a hard timeout). First a run fills an empty cache (``cold``); every case then starts
from a copy of that filled cache:

- ``clean``: the filled cache as it is (the workload loads both entries: ``warm``);
- ``fifo``: one entry replaced by a FIFO (TensorFlow opens it to read the entry);
- ``link``: the key folder replaced by a symbolic link to a folder outside the state folder that
  holds copies of the entries (executables someone else left there); checked afterwards: nothing
  there changed (listing, sizes, mtimes, the folder's own mtime);
- ``deep``: a folder 1,500 levels deep inside the key folder (more than Python's recursion limit).

Printed per case: the verdict, wall seconds of the whole run (upkeep and workload), the
workload's own time to verdict, the cache status the workload reports (``cold``: it compiled;
``warm``: it loaded), the notes about the cache, the upkeep's own milliseconds on that fault
(again, on a fresh copy), and whether a second upkeep finds nothing left to set aside. Then
``bound``: one upkeep of a cache at its bounds (64 key folders of 1,024 files each: every entry
looked at). Targets: every fault case passes in under 1.5 x the cold run, a second upkeep is
silent, nothing outside is touched, and the upkeep takes under 2 s at the bounds.

Run against the revision before the cache's check (``PYTHONPATH`` of that tree) it measures the
faults as they were: the upkeep figures are then left out.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks._util import report  # noqa: E402

from gpu_tune.judge import probe  # noqa: E402
from gpu_tune.judge.probe.plan import ProbeTarget  # noqa: E402
from gpu_tune.tune.profile import ProbePolicy  # noqa: E402

try:
    from gpu_tune.judge.probe.cache import upkeep
    from gpu_tune.workload import cache_guard
except ImportError:  # the revision before the check
    upkeep = cache_guard = None

POLICY = ProbePolicy(window_seconds=0.2)
XLA_ON = ("--xla", "on", "--infer-seconds", "0.05")
DEPTH = 1500


def _probe(state: Path, timeout: float) -> dict:
    t = ProbeTarget("cpu", None, None, None, prefix=[], env={}, expected_cpus=None, expected_node=None, device="cpu")
    t0 = time.monotonic()
    try:
        (v,) = probe.run_probes([t], POLICY, probe.Baselines(), data=None, timeout=timeout, device="cpu",
                                previous=None, extra_args=XLA_ON, compile_cache=str(state / "xla-cache"))
    except Exception as exc:  # what the revision before did with a folder too deep
        return {"status": f"raised {type(exc).__name__}", "seconds": round(time.monotonic() - t0, 2),
                "workload_seconds": None, "cache": None, "notes": []}
    r = v.result or {}
    return {"status": v.status, "seconds": round(time.monotonic() - t0, 2),
            "workload_seconds": r.get("time_to_verdict_seconds"),
            "cache": (r.get("compile_cache") or {}).get("status"),
            "notes": [n for n in v.notes if "compilation cache" in n] + ([v.reasons[0]] if v.status != "passed" else [])}


def _deep(key: Path, depth: int) -> None:
    """``key/deep/d/d/...``: ``depth`` folders, made one level at a time (no path is too long)."""
    (key / "deep").mkdir()
    fd = os.open(key / "deep", os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth - 1):
        os.mkdir("d", dir_fd=fd)
        nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(fd)


def _tree(p: Path) -> dict:
    out = {".": p.stat().st_mtime}
    for dirpath, dirs, files in os.walk(p):
        for n in dirs + files:
            st = os.lstat(os.path.join(dirpath, n))
            out[os.path.relpath(os.path.join(dirpath, n), p)] = (st.st_size, st.st_mtime)
    return out


def _remove(path: Path) -> None:
    """Remove a benchmark folder, 1,500 levels deep included (shutil.rmtree recurses)."""
    if cache_guard is not None:
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            cache_guard.remove(fd, path.name, budget=1 << 30)
        finally:
            os.close(fd)
    else:
        subprocess.run(["rm", "-rf", str(path)], check=False)  # the revision before has no remover


def plant(name: str, state: Path, tmp: Path) -> dict:
    """Put the fault ``name`` into the filled cache under ``state``; what to check afterwards."""
    key = next(p for p in (state / "xla-cache").iterdir() if p.is_dir() and not p.name.startswith("."))
    if name == "fifo":
        entry = sorted(key.glob("*.pb"))[0]
        entry.unlink()
        os.mkfifo(entry)
    elif name == "link":
        outside = tmp / f"outside-{state.name}"
        shutil.copytree(key, outside)
        os.utime(outside, (1, 1))
        shutil.rmtree(key)
        key.symlink_to(outside)
        return {"outside": outside, "before": _tree(outside)}
    elif name == "deep":
        _deep(key, DEPTH)
    return {}


def _upkeep_ms(name: str, filled: Path, tmp: Path) -> tuple[float | None, bool | None]:
    if upkeep is None or name == "clean":
        return None, None
    state = tmp / f"upkeep-{name}"
    shutil.copytree(filled, state, symlinks=True)
    plant(name, state, tmp)
    t0 = time.perf_counter()
    first = upkeep(str(state / "xla-cache"))
    ms = (time.perf_counter() - t0) * 1000
    again = upkeep(str(state / "xla-cache"))
    return round(ms, 1), bool(first.notes) and not again.notes and again.folder is not None


def case_bound(tmp: Path) -> dict:
    base = tmp / "bound" / "xla-cache"
    base.mkdir(parents=True)
    from gpu_tune.judge.probe.cache import MAX_TOP

    for k in range(MAX_TOP):
        d = base / f"k{k}"
        d.mkdir()
        for i in range(cache_guard.MAX_ENTRIES):
            (d / f"xla_compile_cache__{i}__0__XLA_GPU_JIT.pb").write_bytes(b"")
    t0 = time.perf_counter()
    u = upkeep(str(base), max_bytes=1 << 40, max_folders=MAX_TOP)
    ms = (time.perf_counter() - t0) * 1000
    return {"input": f"{MAX_TOP} key folders x {cache_guard.MAX_ENTRIES} files", "upkeep_ms": round(ms, 1),
            "sound": u.folder is not None and not u.notes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=120.0, help="each probe's hard timeout, seconds (default 120)")
    ap.add_argument("--only", default="", help="run only the cases whose name contains this")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    a = ap.parse_args()
    os.environ.setdefault("KERAS_HOME", tempfile.mkdtemp(prefix="bench-keras-"))  # the shipped MNIST subset
    tmp = Path(tempfile.mkdtemp(prefix="bench-hostile4-"))
    results: dict[str, dict] = {}
    try:
        filled = tmp / "filled"
        filled.mkdir()
        results["cold"] = _probe(filled, a.timeout)
        for name in ("clean", "fifo", "link", "deep"):
            if a.only not in name:
                continue
            state = tmp / name
            shutil.copytree(filled, state, symlinks=True)
            check = plant(name, state, tmp)
            r = _probe(state, a.timeout)
            if check:
                r["outside_untouched"] = _tree(check["outside"]) == check["before"]
            r["upkeep_ms"], r["second_upkeep_silent"] = _upkeep_ms(name, filled, tmp)
            results[name] = r
        if upkeep is not None and a.only in "bound":
            results["bound"] = case_bound(tmp)
    finally:
        _remove(tmp)
    if not a.json:
        for name, r in results.items():
            if name == "bound":
                print(f"{name:6} {r['input']}: upkeep {r['upkeep_ms']:.1f} ms, sound {r['sound']}")
                continue
            extra = "".join(f", {k} {r[k]}" for k in ("upkeep_ms", "second_upkeep_silent", "outside_untouched")
                            if r.get(k) is not None)
            print(f"{name:6} {r['status']:8} {r['seconds']:7.2f} s (workload {r['workload_seconds']} s), cache "
                  f"{r['cache']}{extra}", flush=True)
            for n in r["notes"]:
                print(f"         {n[:200]}")
    checks = {}
    cold = results["cold"]["seconds"]
    for name in ("fifo", "link", "deep"):
        if name in results:
            r = results[name]
            checks[f"{name}: passed in under 1.5 x the cold run ({cold:.1f} s)"] = (
                r["status"] == "passed" and r["seconds"] < 1.5 * cold)
            checks[f"{name}: a second upkeep finds nothing to set aside"] = r.get("second_upkeep_silent") is True
    if "link" in results:
        checks["link: nothing outside the state folder changed"] = results["link"].get("outside_untouched") is True
    if "bound" in results:
        checks["bound: upkeep under 2 s with every entry looked at"] = (results["bound"]["sound"]
                                                                          and results["bound"]["upkeep_ms"] < 2000)
    return report(checks, a.json, {"results": results})


if __name__ == "__main__":
    sys.exit(main())
