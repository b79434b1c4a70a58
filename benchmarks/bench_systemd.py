"""The systemd units under a real systemd: how long they take, on Debian 12 (systemd 252) and
Debian 11 (systemd 247), installed the documented way (tests/sdbox.py, docs/systemd.md).

    flock /tmp/gpu-tune-cluster.lock .venv/bin/python benchmarks/bench_systemd.py [--runs 5] [--cold] [--json]

Per image: its build (cold with ``--cold``: built again from nothing; else the cached image's
look-up), its size, the boot to ``is-system-running``, the documented install; then ``--runs``
times ``systemctl stop gpu-tune`` and ``systemctl start gpu-tune`` up to ``/healthz`` answering 200
(medians), one restart after ``kill -9`` (RestartSec=10s is most of it), and the number of journal
lines of ``gpu-tune-apply.service`` at boot for the profile's rows. Root, podman and mmdebstrap;
the container is privileged and writes this machine's kernel settings (put back afterwards): run it
under this machine's lock, as the tests that do.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._util import report  # noqa: E402
from tests.sdbox import URL, boot_installed, sdi  # noqa: E402

# Targets: what an administrator notices (the measure on Debian 12: stop 0.3 s, boot 2 s,
# images 525 MB, build about 2 minutes cold).
START_TARGET_S = 5.0
STOP_TARGET_S = 2.0
RESTART_TARGET_S = 15.0  # RestartSec=10s, then the start
JOURNAL_LINES_TARGET = 30
SIZE_TARGET_MB = 525.0
COLD_BUILD_TARGET_S = 240.0


def measure(name: str, runs: int, cold: bool) -> dict:
    spec = sdi.SPECS[name]
    t0 = time.monotonic()
    tag, built = sdi.ensure(spec, no_cache=cold)
    fig: dict = {"image": tag, "image_build_s": built if built is not None else time.monotonic() - t0,
                 "image_cached": built is None, "image_mb": sdi.size_bytes(tag) / 1e6}
    with boot_installed(spec, fig) as box:
        starts, stops = [], []
        for _ in range(runs):
            box.run("systemctl", "reset-failed", "gpu-tune")  # each start counts toward StartLimitBurst
            stop = box.tool("stop", "gpu-tune")
            start = box.tool("start", "gpu-tune", URL + "/healthz")
            assert stop["rc"] == 0 and start["rc"] == 0, (stop, start)
            stops.append(stop["stop_s"])
            starts.append(start["healthz_s"])
        fig["start_to_healthz_s"] = statistics.median(starts)
        fig["stop_s"] = statistics.median(stops)
        fig["restart_after_kill9_s"] = box.tool("kill9", "gpu-tune", URL + "/healthz")["restart_s"]
        box.run("gpu-tune", "revert")
        fig["reboot_s"] = box.reboot()
        fig["apply_journal_lines"] = len(box.journal("gpu-tune-apply.service"))
        audit = json.loads(box.run("gpu-tune", "audit", "-o", "json", check=False).stdout)
        fig["apply_rows"] = len(audit["settings"])
        box.run("gpu-tune", "revert", check=False)
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="stop/start rounds per image (medians)")
    ap.add_argument("--cold", action="store_true", help="build each image again from nothing (the cold build time)")
    ap.add_argument("--image", action="append", choices=sorted(sdi.SPECS), help="default: both")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    missing = [t for t in ("podman", "mmdebstrap") if shutil.which(t) is None]
    if missing or os.geteuid() != 0:
        print(f"bench_systemd: not measured: needs root and {', '.join(missing) or 'podman'} "
              "(make image-tools installs them)")
        return 0
    figures = {name: measure(name, a.runs, a.cold) for name in a.image or sorted(sdi.SPECS, reverse=True)}
    if not a.json:
        for name, f in figures.items():
            build = f"{'cached' if f['image_cached'] else 'built'} {f['image_build_s']:.1f} s"
            print(f"{name}: image {f['image_mb']:.0f} MB ({build}); boot {f['boot_s']:.1f} s; install {f['install_s']:.1f} s; "
                  f"start -> /healthz 200 {f['start_to_healthz_s']:.2f} s; stop {f['stop_s']:.2f} s; restart after "
                  f"kill -9 {f['restart_after_kill9_s']:.1f} s; apply at boot: {f['apply_journal_lines']} journal lines "
                  f"for {f['apply_rows']} rows")
    checks = {}
    for name, f in figures.items():
        checks[f"{name}: start -> /healthz 200 within {START_TARGET_S} s"] = f["start_to_healthz_s"] <= START_TARGET_S
        checks[f"{name}: stop within {STOP_TARGET_S} s"] = f["stop_s"] <= STOP_TARGET_S
        checks[f"{name}: restart after kill -9 within {RESTART_TARGET_S} s"] = \
            f["restart_after_kill9_s"] <= RESTART_TARGET_S
        checks[f"{name}: apply's journal at most {JOURNAL_LINES_TARGET} lines"] = \
            f["apply_journal_lines"] <= JOURNAL_LINES_TARGET
        if not f["image_cached"]:
            checks[f"{name}: cold build within {COLD_BUILD_TARGET_S:.0f} s"] = f["image_build_s"] <= COLD_BUILD_TARGET_S
    total = sum(f["image_mb"] for f in figures.values())
    checks[f"images together at most {SIZE_TARGET_MB:.0f} MB ({total:.0f} MB)"] = total <= SIZE_TARGET_MB
    return report(checks, a.json, {"figures": figures})


if __name__ == "__main__":
    sys.exit(main())
