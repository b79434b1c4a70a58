#!/usr/bin/env python3
"""``gpu-tune check --slurm`` against slurmctld, counted by slurmctld itself (``sdiag``, its RPCs by
message type) on the test suite's real Slurm (tests/realslurm: Debian's slurmctld and slurmd on
127.0.0.1, the 8-GPU fixture host; root, ``make slurm-tools``):

- **RPCs per prolog**: the prologs and epilogs slurmd runs for ``--jobs`` jobs on a ready node
  (the happy path), a prolog pass that finds a fault and drains, the pass after the drain (still
  not ready, and ready again), and a pass once the drain has settled under the limit.
- **The race**: the cluster's 20 fleet nodes (no slurmd of their own) each failing at once,
  ``readiness.max_out_of_service: 5``, their 20 passes started together and held at their first
  ``scontrol`` call until all are there (tests/test_slurm_fleet.py): nodes drained by gpu-tune at
  the peak (slurmctld's log replayed) and at the end, writes and reads, and the time from the first
  write to the last; ``--rounds`` times, then one more pass of each.

    .venv/bin/python benchmarks/bench_slurm_fleet.py [--jobs 5] [--rounds 3] [--code DIR] [--json]

An RPC of gpu-tune's is REQUEST_NODE_INFO and REQUEST_PARTITION_INFO (``scontrol show node``, one
node or all: two each) or REQUEST_UPDATE_NODE (``scontrol update``). Targets: 0 per prolog and
epilog on the happy path; the race ends with exactly the limit drained, and the pass after it writes
nothing. ``--code DIR`` runs another checkout's ``gpu_tune`` for the prolog figures (the "before":
``git archive <rev> | tar -x -C DIR``); the race needs this one's (an older one refuses the key).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._util import report  # noqa: E402
from tests.fixtures import hostgen  # noqa: E402
from tests.healthkit import profiles_folder  # noqa: E402
from tests.realkube.cleanup import Ledger, ledger_root  # noqa: E402
from tests.realslurm.cluster import NODE, SlurmCluster, wait_for  # noqa: E402
from tests.slurmkit import READS, WRITE, check, fleet_roots, gpu_json, race  # noqa: E402

KINDS = (*READS, WRITE)
PROLOG = {"SLURM_SCRIPT_CONTEXT": "prolog_slurmd", "SLURMD_NODENAME": NODE, "SLURM_JOB_ID": "41"}


def sent(slurm: SlurmCluster, run) -> int:
    before = slurm.sdiag()
    run()
    after = slurm.sdiag()
    return sum(after.get(k, 0) - before.get(k, 0) for k in KINDS)


def prolog_figures(slurm: SlurmCluster, work: Path, code: Path, jobs: int) -> dict[str, float]:
    host = hostgen.build("dgx-8gpu", work / "host")
    pol = profiles_folder(work / "p", health="")  # the shipped default limit, 10%
    ok, sick = gpu_json(work, None), gpu_json(work, 5)
    # the passes after the drain with 1 s for Slurm: a drain settles 6 s after it, not 45 (the default)
    env = {"PYTHONPATH": str(code), "GPU_TUNE_SLURM_TIMEOUT": "1"}
    out: dict[str, float] = {}
    assert check(slurm, host, ok, pol, env=env).returncode == 0  # the record, from a pass that read Slurm
    # `python -m` puts the working folder first on sys.path: the passes run in the checkout measured
    command = f"cd {shlex.quote(str(code))} && " + slurm.gpu_tune_command(host, ok, pol).replace(
        f"PYTHONPATH={shlex.quote(str(REPO))}", f"PYTHONPATH={shlex.quote(str(code))}")
    os.chdir(code)
    slurm.use("prolog", command)
    slurm.use("epilog", command)

    def run_jobs() -> None:
        for job in [slurm.submit("true") for _ in range(jobs)]:
            wait_for(f"job {job}", lambda j=job: slurm.job(j).get("JobState") in ("COMPLETED", "FAILED"), 300)
        wait_for("the epilogs", lambda: len(slurm.runs("epilog")) >= jobs, 300)

    out["happy path: prolog or epilog run by slurmd"] = sent(slurm, run_jobs) / (2 * jobs)
    slurm.use("prolog", "")
    slurm.use("epilog", "")
    out["a fault: the prolog that drains"] = sent(slurm, lambda: check(slurm, host, sick, pol, node=None,
                                                                         env={**PROLOG, "PYTHONPATH": str(code)}))
    out["the pass after the drain, still not ready"] = sent(slurm, lambda: check(slurm, host, sick, pol, node=None,
                                                                                  env={**PROLOG, **env}))
    time.sleep(7)  # past the settling time (GPU_TUNE_SLURM_TIMEOUT 1 s + 5 s)
    out["a pass 7 s after the drain (settles)"] = sent(slurm, lambda: check(slurm, host, sick, pol, node=None,
                                                                            env={**PROLOG, **env}))
    out["a pass once settled, still not ready"] = sent(slurm, lambda: check(slurm, host, sick, pol, node=None,
                                                                            env={**PROLOG, **env}))
    out["the pass after the drain, ready again"] = sent(slurm, lambda: check(slurm, host, ok, pol, node=None,
                                                                             env={**PROLOG, **env}))
    os.chdir(REPO)
    return out


def race_figures(slurm: SlurmCluster, work: Path, rounds: int) -> list[dict]:
    base = hostgen.build("dgx-8gpu", work / "fleet-base")
    pol = profiles_folder(work / "limit5", health="  max_out_of_service: 5\n")
    sick = gpu_json(work, 5)
    out = []
    for i in range(rounds):
        slurm.reset()
        roots = fleet_roots(base, work / f"fleet-{i}")
        _, one = race(slurm, roots, sick, pol, work / f"race-{i}")
        _, two = race(slurm, roots, sick, pol, work / f"race-{i}", tag="2")
        out.append({"peak": one["peak"], "end": len(one["out"]), "writes": one["writes"], "reads": one["reads"],
                    "first to last write (s)": one["first to last write (s)"], "wave (s)": one["start to end (s)"],
                    "next pass: end": len(two["out"]), "next pass: writes": two["writes"],
                    "next pass: reads": two["reads"]})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=5, help="jobs whose prolog and epilog are counted (default 5)")
    ap.add_argument("--rounds", type=int, default=3, help="races of the 20 fleet nodes (default 3; 0: none)")
    ap.add_argument("--code", type=Path, default=REPO, help="the checkout whose gpu_tune the prolog figures run")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    a = ap.parse_args()
    missing = [t for t in ("slurmctld", "slurmd", "scontrol", "sdiag", "munged") if not shutil.which(t)
               and not Path("/usr/sbin", t).exists()]
    if os.geteuid() != 0 or missing:
        print(f"SKIP: a real Slurm needs root and Slurm's packages (`make slurm-tools`); missing: {missing or 'root'}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="bench-slurm-fleet-"))
    led = Ledger(f"slurm-bench-{time.time_ns()}", ledger_root())
    slurm = SlurmCluster(work / "slurm", led)
    try:
        slurm.start()
        prolog = prolog_figures(slurm, work, a.code.resolve(), a.jobs)
        races = race_figures(slurm, work, a.rounds) if a.code.resolve() == REPO else []
    finally:
        left = slurm.stop() + led.clean()
        shutil.rmtree(work, ignore_errors=True)
    if not a.json:
        print("RPCs to slurmctld (sdiag: REQUEST_NODE_INFO, REQUEST_PARTITION_INFO, REQUEST_UPDATE_NODE)")
        for k, v in prolog.items():
            print(f"  {k:48} {v:g}")
        for i, r in enumerate(races, 1):
            print(f"race {i}: " + ", ".join(f"{k} {v}" for k, v in r.items()))
    happy = prolog["happy path: prolog or epilog run by slurmd"]
    checks = {"0 RPCs per prolog or epilog on the happy path": happy == 0,
              "nothing left behind by the cluster": not left}
    if races:
        checks["each race ends with exactly 5 drained (the limit)"] = all(r["end"] == 5 for r in races)
        checks["the pass after each race writes nothing"] = all(r["next pass: writes"] == 0 for r in races)
    return report(checks, a.json, {"code": str(a.code), "prolog": prolog, "races": races, "left": left})


if __name__ == "__main__":
    sys.exit(main())
