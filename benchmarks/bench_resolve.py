"""What resolving host paths beneath --root costs: `gpu-tune audit` of the 224-CPU, 8-GPU fixture
run from another revision (default ``main``, extracted with ``git archive``) and from this tree,
interleaved in one run, whole process (wall and CPU medians); then the engine's audit in-process
with each resolver (CPU time).

Target: this tree's whole-process CPU median at most 1.1 x the other revision's.

    .venv/bin/python benchmarks/bench_resolve.py [--ref main] [--runs N]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _util import REPO, build_host, median_ms


def _run(tree: Path, args: list[str]) -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    module = "gpu_tune" if (tree / "gpu_tune").is_dir() else "agent.cli"  # revisions before the package's move
    p = subprocess.run([sys.executable, "-m", module, *args], cwd=tree, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode not in (0, 1):
        raise SystemExit(f"{tree}: audit exited {p.returncode}: {p.stderr.decode()[-500:]}")
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", default="main")
    ap.add_argument("--runs", type=int, default=15)
    a = ap.parse_args()

    arc = subprocess.run(["git", "-C", str(REPO), "archive", a.ref], capture_output=True)
    if arc.returncode != 0:
        print(f"SKIP  no revision {a.ref!r} to compare with here: {arc.stderr.decode().strip()[:200]}")
        return 0
    old = Path(tempfile.mkdtemp(prefix="gpu-tune-bench-ref-"))
    subprocess.run(["tar", "-x", "-C", str(old)], input=arc.stdout, check=True)
    big = build_host("dgx-8gpu")
    fixture = big.parent / "dgx-8gpu.json"
    shutil.copy(REPO / "tests" / "fixtures" / "gpu" / "dgx-8gpu.json", fixture)
    args = ["--root", str(big), "--gpu-backend", "fixture", "--gpu-fixture", str(fixture), "audit"]
    trees = {f"{a.ref}": old, "this tree": REPO}
    wall: dict[str, list[float]] = {k: [] for k in trees}
    cpu: dict[str, list[float]] = {k: [] for k in trees}
    for i in range(a.runs + 2):
        for k, tree in trees.items():
            w, c = _run(tree, args)
            if i >= 2:
                wall[k].append(w)
                cpu[k].append(c)

    sys.path.insert(0, str(REPO))
    from gpu_tune.tune.engine import audit, make_context
    from gpu_tune.gpu import select_backend
    from gpu_tune.host.fs import HostFS
    from gpu_tune.tune.policy import load_profile

    prof = load_profile("training")
    backend = select_backend("fixture", str(fixture))
    fss = {}
    for name in ("openat2", "walk"):
        try:
            fss[name] = HostFS(big, resolver=name)
        except Exception as exc:  # no openat2 in this kernel
            print(f"  ({name}: {exc})")
    inproc: dict[str, list[float]] = {k: [] for k in fss}
    for i in range(a.runs + 1):
        for name, fs in fss.items():
            t0 = time.process_time()
            audit(make_context(fs, prof, backend))
            if i:
                inproc[name].append(time.process_time() - t0)

    print(f"gpu-tune audit of the 224-CPU 8-GPU fixture, whole process, {a.runs} interleaved runs each:")
    for k in trees:
        print(f"  {k:12s} wall median {median_ms(wall[k]):7.1f} ms   CPU median {median_ms(cpu[k]):7.1f} ms "
              f"(stdev {statistics.pstdev(cpu[k]) * 1000:.0f} ms)")
    print("engine audit in-process, CPU time per audit: " + ", ".join(
        f"{k} {median_ms(v):.1f} ms" for k, v in inproc.items()))
    ratio = median_ms(cpu["this tree"]) / median_ms(cpu[a.ref])
    ok = ratio <= 1.1
    print(f"{'PASS' if ok else 'FAIL'}  CPU this tree / {a.ref}: {ratio:.2f} x (target <= 1.10 x)")
    shutil.rmtree(old, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
