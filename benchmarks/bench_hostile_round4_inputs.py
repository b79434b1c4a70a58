#!/usr/bin/env python3
"""Hostile health inputs, round 4: what the InfiniBand read and the health state file cost at
their bounds, each ``gpu-tune check`` run as a process of its own on the 8-GPU fixture host.

    .venv/bin/python benchmarks/bench_hostile_round4_inputs.py [--scale 1.0] [--only NAME] [--json]

Cases (``--scale`` multiplies the numbers of devices and records):

- ``baseline``: the fixture as built: 8 HCAs (4 InfiniBand, 4 RoCE), no state file.
- ``ib-520``: 520 RDMA devices (the 8 HCAs and 512 SR-IOV virtual functions, each with a port
  up), ``mlx5_7``'s port down: the virtual functions are counted, not read, and ``mlx5_7`` fails
  the node. ``ib-520-named``: the same with every virtual function named in the profile
  (``readiness.expect.ib_ports``), so all 520 ports are read.
- ``ib-5000``: 5,000 RDMA devices, past the 4,096 looked at per pass: the rest is said, not read.
- ``state-full``: a valid state file at the tool's own limits (512 records, 512 histories of 8
  boots, 1,024 clears, 4,096 NVML counts): read, checked field by field, and kept.
- ``state-deep``: 4 MiB of ``[`` (nesting far past Python's recursion limit); ``state-5000-digits``:
  a clear whose time has 5,000 digits; ``state-over-cap``: 5 MiB, past the 4 MiB cap (never read
  whole); ``state-fifo``: a FIFO: each set aside, a new file started.

Printed per case: exit status, wall seconds, peak RSS (``wait4``), and the in-process time of the
read alone (the InfiniBand read, or the state file's load), median of 5. Targets: every case exits
0 or 1, never 3; ``ib-520`` names ``mlx5_7/1``; the reads stay within 0.5 s and the check within
40 MB of the baseline's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._util import report  # noqa: E402

from benchmarks.bench_hostile_round3 import _run  # noqa: E402
from tests.fixtures import hostgen  # noqa: E402

GPU_FIXTURE = REPO / "tests/fixtures/gpu/dgx-8gpu.json"
PROFILE = "include: training.yaml\nreadiness:\n  require_compliant: false\n  require_probe: false\n"
MLX5_7 = "sys/devices/pci0000:d0/0000:d0:01.0/0000:da:00.0/infiniband/mlx5_7/ports/1/state"
STATE = "var/lib/gpu-tune/health.json"


def add_virtual_functions(root: Path, n: int) -> None:
    cls = root / "sys/class/infiniband"
    for i in range(8, 8 + n):
        dev = cls / f"mlx5_{i}"
        (dev / "device").mkdir(parents=True)
        os.symlink("../../../../bus/pci/devices/0000:29:00.0", dev / "device/physfn")
        port = dev / "ports/1"
        (port / "counters").mkdir(parents=True)
        for name, text in (("state", "4: ACTIVE"), ("phys_state", "5: LinkUp"), ("rate", "400 Gb/sec (4X NDR)"),
                           ("link_layer", "InfiniBand"), ("counters/link_downed", "0")):
            (port / name).write_text(text + "\n")


def full_state() -> str:
    boots = [f"00000000-0000-4000-8000-{b:012d}" for b in range(8)]
    records, history = {}, {}
    for i in range(512):
        bus = f"0000:{i // 4:02x}:{i % 4:02x}"
        key = f"xid/{bus}/79"
        records[key] = {"kind": "xid", "bus": bus, "code": 79, "count": 3, "first_seen": 1.8e9, "first_usec": 1000,
                        "last_usec": 2000, "message": "x" * 240, "source": "kernel log"}
        history[key] = boots
    cleared = {f"0000:{i // 4:02x}:{i % 4:02x}": {"usec": 1, "epoch": 1.0} for i in range(1024)}
    base = {f"0000:{i // 16:02x}:00/{i % 16}": {"n": 1, "at": 1.0} for i in range(4096)}
    return json.dumps({"version": 1, "boot_id": boots[0], "records": records, "cleared": cleared, "history": history,
                       "nvml_baseline": base, "applied_tokens": [str(i) for i in range(16)],
                       "cleared_words": ["w" * 4096] * 4})


READ_IB = """
import statistics, sys, time
from gpu_tune.discover.sysfs_health import read_infiniband
from gpu_tune.host.fs import HostFS
fs, named = HostFS(sys.argv[1]), sys.argv[2].split(",") if sys.argv[2] else []
times = []
for _ in range(5):
    t0 = time.perf_counter(); got = read_infiniband(fs, named); times.append(time.perf_counter() - t0)
print(statistics.median(times), len(got.ports))
"""
READ_STATE = """
import os, shutil, statistics, sys, time
from gpu_tune.host.fs import HostFS
from gpu_tune.judge.checks import state_file
root = sys.argv[1]
p = os.path.join(root, "var/lib/gpu-tune/health.json")
keep = open(p, "rb").read() if os.path.isfile(p) else None
times = []
for _ in range(5):
    if not os.path.lexists(p):
        (open(p, "wb").write(keep) if keep is not None else os.mkfifo(p))
    t0 = time.perf_counter(); state_file.load(HostFS(root)); times.append(time.perf_counter() - t0)
print(statistics.median(times), 0)
"""


def _read(code: str, *args: str) -> tuple[float | None, int]:
    """The in-process read alone, median of 5, in a process of its own (so this one stays small
    and the next command's peak RSS is its own)."""
    import subprocess

    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    if r.returncode != 0:
        return None, 0  # a checkout without these readers
    secs, n = r.stdout.split()
    return round(float(secs), 4), int(n)


def case(tmp: Path, base: Path, scale: float, timeout: float, name: str) -> dict:
    root = tmp / "h"
    shutil.copytree(base, root, symlinks=True)
    pol = tmp / "pol"
    pol.mkdir()
    shutil.copy(REPO / "policies/baselines.yaml", pol)
    profile = PROFILE
    read = None
    note = ""
    if name.startswith("ib-"):
        n = {"ib-520": 512, "ib-520-named": 512, "ib-5000": 4992}[name]
        n = max(1, int(n * scale))
        add_virtual_functions(root, n)
        (root / MLX5_7).write_text("1: DOWN\n")
        named = [f"mlx5_{i}" for i in range(8 + n)] if name == "ib-520-named" else []
        if named:
            profile += "  expect:\n    ib_ports: [" + ", ".join(named) + "]\n"
        read, nports = _read(READ_IB, str(root), ",".join(named))
        note = f"{8 + n:,} RDMA devices, {nports:,} ports read"
    elif name.startswith("state-"):
        p = root / STATE
        p.parent.mkdir(parents=True, exist_ok=True)
        if name == "state-full":
            p.write_text(full_state())
        elif name == "state-deep":
            p.write_text("[" * (4 << 20))
        elif name == "state-5000-digits":
            p.write_text('{"version": 1, "cleared": {"*": {"usec": ' + "9" * 5000 + ', "epoch": 1}}}')
        elif name == "state-over-cap":
            p.write_text(" " * (5 << 20) + "{}")
        elif name == "state-fifo":
            os.mkfifo(p)
        size = p.stat().st_size if p.is_file() else 0
        shutil.copy(p, tmp / "state.keep") if p.is_file() else None
        read, _ = _read(READ_STATE, str(root))
        for aside in p.parent.glob("health.json*"):
            aside.unlink()
        if size:
            shutil.copy(tmp / "state.keep", p)
        else:
            os.mkfifo(p)
        note = f"{size / (1 << 20):.1f} MiB state file" if size else "a FIFO"
    else:
        note = "8 RDMA devices, no state file"
    (pol / "health.yaml").write_text(profile)
    r = _run([sys.executable, "-m", "gpu_tune", "check", "--root", str(root), "--gpu-fixture", str(GPU_FIXTURE),
              "--policy-dir", str(pol), "--profile", "health", "-o", "json"], timeout)
    r["input"] = note
    r["read_seconds"] = read
    if name.startswith("ib-"):
        import subprocess

        out = subprocess.run([sys.executable, "-m", "gpu_tune", "check", "--root", str(root), "--gpu-fixture",
                              str(GPU_FIXTURE), "--policy-dir", str(pol), "--profile", "health", "-o", "json"],
                             capture_output=True, text=True, timeout=timeout, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        ib = next((c for c in json.loads(out.stdout)["checks"] if c["name"] == "network.infiniband"), {})
        r["names_mlx5_7"] = not ib.get("ok", True) and "mlx5_7/1 is DOWN" in ib.get("detail", "")
    if name.startswith("state-") and name != "state-full":
        r["set_aside"] = (root / "var/lib/gpu-tune/health.json.bad").exists() or \
            (root / "var/lib/gpu-tune/health.json.bad").is_symlink()
    return r


CASES = ("baseline", "ib-520", "ib-520-named", "ib-5000", "state-full", "state-deep", "state-5000-digits",
         "state-over-cap", "state-fifo")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the devices added (default 1.0)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before a command is killed (default 120)")
    ap.add_argument("--only", default="", help="run only the cases whose name contains this (baseline always runs)")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-hostile4-"))
    results = {}
    try:
        base = hostgen.build("dgx-8gpu", work / "base")
        for name in CASES:
            if a.only not in name and name != "baseline":
                continue
            tmp = work / name
            tmp.mkdir()
            try:
                results[name] = r = case(tmp, base, a.scale, a.timeout, name)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            if not a.json:
                read = "" if r["read_seconds"] is None else f"read {r['read_seconds'] * 1000:8.1f} ms"
                print(f"{name:18} {r['input']:40} exit {str(r['exit']):5} {r['seconds']:6.2f} s "
                      f"{r['peak_rss_mb']:6.1f} MB peak RSS  {read}  {r['stderr_tail'][:60]}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base_rss = results["baseline"]["peak_rss_mb"]
    checks = {"every case exits 0 or 1": all(r["exit"] in (0, 1) for r in results.values())}
    for name, r in results.items():
        if r["read_seconds"] is not None:
            checks[f"{name}: the read within 0.5 s"] = r["read_seconds"] < 0.5
        checks[f"{name}: peak RSS within 40 MB of the baseline's"] = r["peak_rss_mb"] - base_rss < 40
        if "names_mlx5_7" in r:
            checks[f"{name}: the down mlx5_7 fails the node"] = r["names_mlx5_7"]
        if "set_aside" in r:
            checks[f"{name}: set aside"] = r["set_aside"]
    return report(checks, a.json, {"scale": a.scale, "results": results})


if __name__ == "__main__":
    sys.exit(main())
