#!/usr/bin/env python3
"""`gpu-tune check` through the real nvidia-ml-py over the fake C library (tests/nvmlfake.py, run
by tests/nvmlcommand.py): what one pass costs with 8 GPUs and with far more than any node has, each
command a process of its own on the 8-GPU fixture host (docs/security.md "Round 5").

    .venv/bin/python benchmarks/bench_nvml_scale.py [--gpus 1024] [--code DIR] [--json]

Cases:

- ``8``: the HGX H100 board NVML lists on that host. Counted from the fake library's record of
  every C call after the backend's start (``nvmlInit``, the XID event registration): how many
  times each reading (a C function with its arguments: the GPU, the link, the peer, ...) was
  taken in the one pass; ``gpus()`` passes: how many times each GPU's UUID was asked.
- ``N`` (``--gpus``, 1,024 by default): NVML lists N healthy H100s (18 NVLinks each, the fabric
  registered): wall seconds and peak RSS (``wait4``) of the command, its exit status, and the
  C calls it made (a second run that records them).

Targets: every reading taken once per pass with 8 GPUs; ``check`` with 1,024 GPUs under 10 s,
exit 0 or 1 (never 3). ``--code DIR`` runs another checkout's ``gpu_tune`` (the revision before a
change, say) with this checkout's fake library.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._util import report  # noqa: E402
from benchmarks.bench_hostile_round3 import _run  # noqa: E402
from tests import nvmlcommand, nvmlfake  # noqa: E402
from tests.fixtures import hostgen  # noqa: E402
from tests.healthkit import health_policies  # noqa: E402

TARGET_S = 10.0


def case(work: Path, root: Path, policies: Path, n: int, code: Path, timeout: float) -> dict:
    scenario = nvmlcommand.write_scenario(work / f"gpus-{n}.json", nvmlfake.many(n))
    argv = [sys.executable, str(REPO / "tests" / "nvmlcommand.py"), str(scenario), "--", "--root", str(root),
            "--gpu-backend", "nvml", "--policy-dir", str(policies), "check", "--profile", "health", "-o", "json"]
    r = _run(argv, timeout, pythonpath=code)  # calls not recorded: the fake keeps nothing
    calls = work / f"calls-{n}.json"
    rec = _run(argv[:3] + ["--calls", str(calls)] + argv[3:], timeout, pythonpath=code)
    keys = nvmlfake.pass_calls(json.loads(calls.read_text())) if rec["exit"] in (0, 1) and calls.exists() else []
    per_fn = Counter(k[0] for k in keys)
    repeats = Counter(keys)
    uuid = Counter(k[1] for k in keys if k[0] == "nvmlDeviceGetUUID")
    r.update(gpus=n, calls=len(keys), p2p_calls=per_fn.get("nvmlDeviceGetP2PStatus", 0),
             most_repeated=max(repeats.values(), default=0),
             repeated={f"{k[0]}({', '.join(map(str, k[1:]))})": v for k, v in repeats.most_common(3) if v > 1},
             gpus_passes=max(uuid.values(), default=0), calls_by_function=dict(per_fn.most_common()))
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=1024, help="GPUs NVML lists in the large case (default 1024)")
    ap.add_argument("--code", type=Path, default=REPO, help="the checkout whose gpu_tune runs (default: this one)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before a command is killed (default 600)")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-nvml-scale-"))
    root = hostgen.build("dgx-8gpu", work / "h")
    policies = health_policies(work / "policies")
    results = {str(n): case(work, root, policies, n, a.code.resolve(), a.timeout) for n in (8, a.gpus)}
    small, large = results["8"], results[str(a.gpus)]
    if not a.json:
        for name, r in results.items():
            print(f"{name:>5} GPUs: exit {r['exit']}  {r['seconds']:7.2f} s  {r['peak_rss_mb']:6.1f} MB peak RSS  "
                  f"{r['calls']:>9,} C calls in the pass ({r['p2p_calls']:,} P2P)  each reading taken at most "
                  f"{r['most_repeated']}x  GPUs read {r['gpus_passes']}x  {r['stderr_tail'][:60]}")
            if r["repeated"]:
                print(f"       most repeated: {r['repeated']}")
    checks = {
        "8 GPUs: every NVML reading taken once per pass": small["most_repeated"] == 1 and small["gpus_passes"] == 1,
        f"{a.gpus} GPUs: exit 0 or 1": large["exit"] in (0, 1),
        f"{a.gpus} GPUs: check under {TARGET_S:g} s (target)": large["seconds"] < TARGET_S,
    }
    return report(checks, a.json, {"code": str(a.code), "results": results})


if __name__ == "__main__":
    sys.exit(main())
