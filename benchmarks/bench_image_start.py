"""How fast `gpu-tune audit` starts in the image, against the virtualenv and against no bytecode.

    python benchmarks/bench_image_start.py [--image localhost/gpu-tune:0.1.0-cpu] [--runs 7]

Times each `gpu-tune audit --root /host -o json` inside one running container (so the
container's own start is not counted), the same with Python pointed at an empty bytecode cache
(PYTHONPYCACHEPREFIX: what the image was without bytecode compiled at build time, on a read-only
root filesystem), and `gpu-tune audit --root /` from this checkout's .venv. Prints medians.
Build the image first (`make image FLAVOUR=cpu`).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOOP = ('for i in $(seq {n}); do s=$(date +%s%N); gpu-tune audit --root /host -o json >/dev/null; '
        'e=$(date +%s%N); echo $(( (e - s) / 1000 )); done')


def _ti():
    spec = importlib.util.spec_from_file_location("gpu_tune_tools_image", ROOT / "tools" / "image.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def in_image(ti, image: str, runs: int, env: list[str]) -> list[float]:
    cmd = [*ti.PODMAN, "run", "--rm", *ti.run_flags(), "--read-only", "--network", "host",
           "-v", "/proc:/host/proc:ro", "-v", "/sys:/host/sys:ro", "-v", "/etc:/host/etc:ro",
           "-v", "/usr:/host/usr:ro", *env, "--entrypoint", "sh", image, "-c", LOOP.format(n=runs + 1)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()
    return [int(x) / 1e6 for x in out[1:]]  # the first run warms the page cache


def in_venv(runs: int) -> list[float]:
    exe = ROOT / ".venv" / "bin" / "gpu-tune"
    times = []
    for _ in range(runs + 1):
        t0 = time.perf_counter()
        subprocess.run([str(exe), "audit", "--root", "/", "-o", "json"], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return times[1:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image", default="localhost/gpu-tune:0.1.0-cpu")
    ap.add_argument("--runs", type=int, default=7)
    a = ap.parse_args()
    ti = _ti()
    if not ti.image_exists(a.image):
        print(f"bench_image_start: image {a.image} not found: build it with make image FLAVOUR=cpu",
              file=sys.stderr)
        return 2
    rows = [("image, bytecode built in", in_image(ti, a.image, a.runs, [])),
            ("image, no bytecode", in_image(ti, a.image, a.runs, ["-e", "PYTHONPYCACHEPREFIX=/nonexistent"])),
            (".venv on the host", in_venv(a.runs))]
    print(f"gpu-tune audit, median of {a.runs} (min..max), seconds")
    for name, t in rows:
        print(f"  {name:<26} {statistics.median(t):.3f}  ({min(t):.3f}..{max(t):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
