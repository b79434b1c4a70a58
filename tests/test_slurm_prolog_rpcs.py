"""The prolog and the epilog without slurmctld on the happy path, on the real Slurm (tests/realslurm):
counted with slurmctld's own counters (``sdiag``, its RPCs by message type), never timed.

Slurm's documentation asks prologs not to call Slurm commands: before, ``check --slurm`` as a prolog
sent ``scontrol show node`` (REQUEST_NODE_INFO and REQUEST_PARTITION_INFO) on every job start on
every node of the job. Now a prolog or an epilog on a ready host whose record under ``--root`` says
gpu-tune has not drained this node sends none; any doubt (no record, another node's, a record of a
drain, not ready) reads Slurm as before. Figures: RPCs per prolog on the happy path, on a fault and on
the pass after the drain (docs/slurm.md; benchmarks/bench_slurm_fleet.py).
"""

from __future__ import annotations

import json

import pytest

from tests.healthkit import policies, profiles_folder  # noqa: F401 (fixtures)
from tests.realkube.plugin import TIMINGS
from tests.realslurm.cluster import NODE, wait_for
from tests.slurmkit import COUNT, check, dgx_tree, gpu_json, host, standin  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow

# what gpu-tune's scontrol calls cost slurmctld: `show node` (one node or all) is REQUEST_NODE_INFO and
# REQUEST_PARTITION_INFO, `update` REQUEST_UPDATE_NODE; none of these is a job's own (sbatch, slurmd)
GPU_TUNE_RPCS = ("REQUEST_NODE_INFO", "REQUEST_NODE_INFO_SINGLE", "REQUEST_PARTITION_INFO", "REQUEST_UPDATE_NODE")
PROLOG = {"SLURM_SCRIPT_CONTEXT": "prolog_slurmd", "SLURMD_NODENAME": NODE, "SLURM_JOB_ID": "41"}


def rpcs(before: dict, after: dict) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in GPU_TUNE_RPCS if after.get(k, 0) != before.get(k, 0)}


def counted(slurm, run) -> tuple[object, dict[str, int]]:
    """``run()`` and the RPCs of gpu-tune's kinds slurmctld counted meanwhile."""
    before = slurm.sdiag()
    out = run()
    return out, rpcs(before, slurm.sdiag())


def job_done(slurm, job: str) -> dict:
    return wait_for(f"job {job} completed", lambda: (j := slurm.job(job)).get("JobState") in
                    ("COMPLETED", "FAILED") and j, 120, every=0.1)


def test_a_ready_prolog_and_epilog_send_slurmctld_nothing(slurm, host, tmp_path, policies):
    fixture = gpu_json(tmp_path)
    first = check(slurm, host, fixture, policies)  # a pass that reads Slurm keeps the record
    assert first.returncode == 0, first.stderr
    command = slurm.gpu_tune_command(host, fixture, policies)
    slurm.use("prolog", command)
    slurm.use("epilog", command)

    def jobs():
        for job in [slurm.submit("true") for _ in range(3)]:
            assert job_done(slurm, job)["JobState"] == "COMPLETED"
        return wait_for("3 epilogs", lambda: len(slurm.runs("epilog")) >= 3 and slurm.runs("epilog"), 120)

    _, sent = counted(slurm, jobs)
    ran = slurm.runs("prolog") + slurm.runs("epilog")
    assert [r.rc for r in ran] == [0] * 6 and {r.context for r in ran} == {"prolog_slurmd", "epilog_slurmd"}, ran
    TIMINGS["slurm RPCs per prolog or epilog, happy path"] = sum(sent.values()) / 6
    assert sum(sent.values()) == 0, f"3 prologs and 3 epilogs on a ready node sent slurmctld {sent}"
    said = (slurm.base / "gpu-tune.log").read_text().splitlines()
    assert len(said) == 6 and all("ready; Slurm not asked: gpu-tune's record" in ln for ln in said), said


def test_any_doubt_reads_slurm(slurm, host, tmp_path, policies):
    ok, sick = gpu_json(tmp_path), gpu_json(tmp_path, drop=5)
    r, sent = counted(slurm, lambda: check(slurm, host, ok, policies, node=None, env=PROLOG))  # no record yet
    assert r.returncode == 0 and sent, (sent, r.stderr)
    r, sent = counted(slurm, lambda: check(slurm, host, ok, policies, node=None, env=PROLOG))  # now the record
    assert not sent, f"a ready prolog whose record says gpu-tune has not drained the node sent slurmctld {sent}"
    assert json.loads(r.stdout)["slurm"]["slurm_read"] is False
    r, sent = counted(slurm, lambda: check(slurm, host, ok, policies, node=None,  # another node's name
                                           env={**PROLOG, "SLURMD_NODENAME": "gpu-slurm-1"}))
    assert json.loads(r.stdout)["slurm"]["slurm_read"] and sent, sent

    # a fault: Slurm read, the node drained (the limit counted the fleet before and after)
    check(slurm, host, ok, policies)
    r, fault = counted(slurm, lambda: check(slurm, host, sick, policies, node=None, env=PROLOG))
    assert r.returncode == 1 and json.loads(r.stdout)["slurm"]["action"] == "drain", r.stderr
    assert json.loads((host / COUNT).read_text())["drained"] is True
    # the pass after the drain, the host ready again: the record says drained, so Slurm is read
    r, after = counted(slurm, lambda: check(slurm, host, ok, policies, node=None, env=PROLOG))
    doc = json.loads(r.stdout)["slurm"]
    assert doc["slurm_read"] and doc["action"] == "hold", doc
    TIMINGS["slurm RPCs, a prolog on a fault (drain)"] = sum(fault.values())
    TIMINGS["slurm RPCs, the prolog after the drain"] = sum(after.values())
    print(f"RPCs: the fault {fault}; the pass after the drain {after}")
    assert fault.get("REQUEST_UPDATE_NODE") == 1 and after.get("REQUEST_UPDATE_NODE", 0) == 0, (fault, after)


def test_the_kept_gres_decides_without_slurm_and_a_mismatch_reads_it(slurm, host, tmp_path, policies):
    ok = gpu_json(tmp_path)
    check(slurm, host, ok, policies)
    r = check(slurm, host, ok, policies, node=None, env=PROLOG)
    gres = {c["name"]: c for c in json.loads(r.stdout)["checks"]}["slurm.gres"]
    assert gres["detail"].startswith("Slurm gres/gpu 8, NVML 8, PCI bus 8 (Gres=gpu:8 as Slurm listed it at "), \
        f"a ready prolog read Slurm's Gres itself: {gres['detail']}"
    assert gres["detail"].endswith("kept by gpu-tune: Slurm not asked)"), gres
    # a pass that read Slurm while it offered 7 keeps gpu:7 (a stand-in scontrol prints Gres=gpu:7:
    # slurmctld 22.05 refuses to lower a Gres with File=); report only, so the node stays in service
    env = standin(tmp_path, 'if [ "$1 $2 $3 $4" = "-a -o show node" ]; then\n'
                            '  "$REAL" "$@" | sed "s/ Gres=gpu:8 / Gres=gpu:7 /"; exit 0\nfi\nexec "$REAL" "$@"\n')
    quiet = profiles_folder(tmp_path / "quiet", health="  max_out_of_service: 0\n")
    r = check(slurm, host, ok, quiet, env=env)
    assert r.returncode == 1 and "Slurm gres/gpu 7, NVML 8" in r.stdout, r.stdout
    assert json.loads((host / COUNT).read_text())["gres"] == "gpu:7"
    # the prolog judges the kept 7 against the host's 8: in doubt, it reads Slurm (8): ready
    r, sent = counted(slurm, lambda: check(slurm, host, ok, quiet, node=None, env=PROLOG))
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["slurm"]["slurm_read"] and sent, (doc["slurm"], sent)
    gres = {c["name"]: c for c in doc["checks"]}["slurm.gres"]
    assert gres["detail"] == "Slurm gres/gpu 8, NVML 8, PCI bus 8", gres
    assert json.loads((host / COUNT).read_text())["gres"] == "gpu:8"
