"""A probe process dies with the gpu-tune process that started it: SIGKILL ``gpu-tune probe`` or
``gpu-tune gain`` (nothing of theirs runs after SIGKILL) and the workload it was running must not
live on, reparented to init, for up to ``probe.timeout_s`` (300 s) with a GPU kept busy. The
parent is killed for real; the child is watched in ``/proc``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, run_cli
from tests.realkube.cleanup import alive


def _kill_parent_and_watch_the_child(argv: list[str], env: dict[str, str], log) -> tuple[int, float]:
    """Start ``gpu-tune argv``, wait for its workload to log its pid, SIGKILL gpu-tune; return
    the workload's pid and how long it lived on (capped at 20 s; then it is killed here)."""
    proc = subprocess.Popen([sys.executable, "-m", "gpu_tune", *argv], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    child = 0
    try:
        deadline = time.monotonic() + 120
        while not child:
            if proc.poll() is not None:
                pytest.fail(f"gpu-tune ended before its workload started: {proc.stderr.read().decode()[-2000:]}")
            assert time.monotonic() < deadline, "the workload never started"
            if log.exists() and log.read_text().strip():
                child = json.loads(log.read_text().splitlines()[0])["pid"]
            time.sleep(0.05)
        assert alive(child, None)
    finally:
        proc.kill()
        proc.wait(30)
    t0 = time.monotonic()
    while alive(child, None) and time.monotonic() - t0 < 20:
        time.sleep(0.05)
    lived = time.monotonic() - t0
    if alive(child, None):
        os.kill(child, signal.SIGKILL)  # leave nothing behind, whatever the test says
    return child, lived


def _env(root, log) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "GPU_TUNE_PROBE_MODULE": "tests.gain_workload",
            "GAIN_TEST_ROOT": str(root), "GAIN_TEST_LOG": str(log), "GAIN_TEST_SLEEP": "300",
            "GAIN_TEST_TUNED_IPS": "1100", "GAIN_TEST_UNTUNED_IPS": "1000"}


def test_a_probe_dies_with_a_killed_gpu_tune_probe(make_host, tmp_path):
    root = make_host("small-2cpu")
    log = tmp_path / "runs.jsonl"
    child, lived = _kill_parent_and_watch_the_child(
        ["probe", "--root", str(root), "--gpu-backend", "none", "--device", "cpu", "--timeout", "300"],
        _env(root, log), log)
    assert lived < 5, f"probe process {child} lived on {lived:.1f} s after gpu-tune probe was killed"


def test_a_probe_dies_with_a_killed_gpu_tune_gain(make_host, tmp_path):
    root = make_host("small-2cpu")
    log = tmp_path / "runs.jsonl"
    child, lived = _kill_parent_and_watch_the_child(
        ["gain", "--root", str(root), "--gpu-backend", "none", "--pairs", "3"], _env(root, log), log)
    assert lived < 5, f"probe process {child} lived on {lived:.1f} s after gpu-tune gain was killed"
    r = run_cli("revert", "--root", str(root), "--gpu-backend", "none")  # what gain had applied, if anything
    assert r.returncode == 0, r.stdout + r.stderr
