#!/usr/bin/env python3
"""SIGTERM in the middle of a probe: seconds to exit, probe processes left.

    .venv/bin/python benchmarks/bench_stop.py [--runs 3] [--into 3]

Starts the real ``gpu-tune serve`` (audit mode, ``--no-kube``, the real TensorFlow CPU probe) on a
fresh copy of the ``small-2cpu`` fixture host, waits until the probe process runs and ``--into``
seconds more, sends SIGTERM and measures the time to exit and the probe processes still alive
0.5 s later. Target: exit 0 in < 5 s (the pod's grace period is 30 s) with no probe left.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MARK = "GPU_TUNE_BENCH_STOP"


def _probe_pids(tag: str) -> list[int]:
    """The probe processes started by this run (found by a marker in their environment)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes()
            env = Path(f"/proc/{d}/environ").read_bytes()
        except OSError:
            continue
        if b"mnist_probe" in cmd and f"{MARK}={tag}".encode() in env:
            try:
                state = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                out.append(int(d))
    return out


def one(root: Path, into: float, tag: str) -> tuple[float, int, list[int]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_TUNE_") and k != "KUBECONFIG"}
    env.update(PYTHONPATH=str(REPO), **{MARK: tag})
    proc = subprocess.Popen([sys.executable, "-m", "gpu_tune", "--root", str(root), "--gpu-backend", "none", "serve",
                             "--no-kube", "--host", "127.0.0.1", "--port", str(port), "--probe-device", "cpu"],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not _probe_pids(tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _probe_pids(tag):
            raise SystemExit("the probe did not start within 120 s")
        time.sleep(into)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(0.5)
    left = _probe_pids(tag)
    return took, rc, left


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--into", type=float, default=3.0, help="seconds into the probe before SIGTERM")
    args = ap.parse_args()
    from tests.fixtures import hostgen

    worst = 0.0
    ok = True
    with tempfile.TemporaryDirectory() as d:
        root = hostgen.build("small-2cpu", Path(d) / "host")
        for i in range(args.runs):
            took, rc, left = one(root, args.into, f"{os.getpid()}-{i}")
            worst = max(worst, took)
            ok = ok and rc == 0 and not left and took < 5.0
            print(f"run {i + 1}: SIGTERM {args.into:g} s into the probe -> exit {rc} in {took:.2f} s; "
                  f"probe processes left: {len(left)}")
    print(f"worst: {worst:.2f} s (target < 5 s, none left): {'ok' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
