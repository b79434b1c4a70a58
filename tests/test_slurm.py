"""``gpu-tune check --slurm`` on a real Slurm (tests/realslurm: Debian's slurmctld, slurmd and
munge on 127.0.0.1), on the 8-GPU fixture host: slurmd runs it as its ``HealthCheckProgram`` every
``HealthCheckInterval`` and as its ``Prolog``, with its own environment (no ``SLURM_CONF``: slurmd
finds ``/etc/slurm/slurm.conf`` in its mount namespace, and so does the ``scontrol`` gpu-tune runs).

Figures (printed, and in pytest's summary): the time from a fault written into the fixture to the
drain, from the clear to the resume, and the prolog's time on the 8-GPU fixture. docs/slurm.md
quotes them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gpu_tune.slurm.decide import MAX_REASON
from tests.conftest import run_cli
from tests.fixtures import hostgen
from tests.healthkit import XID79, policies  # noqa: F401 (fixtures)
from tests.realkube.plugin import record_timing
from tests.realslurm.cluster import HEALTH_INTERVAL, NODE, wait_for
from tests.slurmkit import dgx_tree, gpu_json, host  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow

# How long the tests wait for one health check pass beyond slurmd's interval: a few seconds on a
# busy 2-CPU machine (2.8 s at a load of 12), tens of seconds when slurmd itself is starved. A
# patience for a condition, never a measure of speed: the passes are counted, not timed.
PASS_SLACK = 30.0


def append_xid(root: Path, seq: int, usec: int) -> None:
    with open(root / "dev/kmsg", "a") as f:
        f.write(XID79.format(seq=seq, usec=usec))


def passes_after(slurm, t: float, n: int, rc: int | None = None, program: str = "health-check") -> list:
    """Wait for ``n`` runs of ``program`` that started after ``t`` (with exit code ``rc``)."""
    def got():
        runs = [r for r in slurm.runs(program) if r.start >= t and (rc is None or r.rc == rc)]
        return runs if len(runs) >= n else None
    return wait_for(f"{n} {program} run(s) after t (exit {rc})", got, n * HEALTH_INTERVAL + n * PASS_SLACK + 5)


def drained_by_gpu_tune(slurm, word: str = "", timeout: float = HEALTH_INTERVAL + PASS_SLACK + 5) -> dict:
    def got():
        n = slurm.node()
        return n if "DRAIN" in n.get("State", "") and n.get("Reason", "").startswith("gpu-tune:") \
            and word in n["Reason"] else None
    return wait_for(f"{NODE} drained by gpu-tune ({word})", got, timeout, every=0.05)


def resumed(slurm, timeout: float) -> dict:
    return wait_for(f"{NODE} resumed", lambda: (n := slurm.node()).get("State") == "IDLE" and not n.get("Reason")
                    and n, timeout, every=0.05)


def job_done(slurm, job: str) -> dict:
    return wait_for(f"job {job} completed", lambda: (j := slurm.job(job)).get("JobState") in
                    ("COMPLETED", "FAILED") and j, 120, every=0.1)


# -- 1. a fatal XID: drained within one interval, sinfo -R shows it, a job waits -------------------
def test_a_fatal_xid_drains_the_node_within_one_health_check_interval(slurm, host, tmp_path, policies):
    slurm.use("health-check", slurm.gpu_tune_command(host, gpu_json(tmp_path), policies))
    ok = passes_after(slurm, time.time(), 1, rc=0)
    assert ok[0].conf == "unset", "slurmd ran the health check with SLURM_CONF set"  # found as scontrol finds it
    assert slurm.node()["State"] == "IDLE"

    t0 = time.time()
    append_xid(host, 90, 88310022)
    t_fault = time.time()  # every health check that starts from here on reads the XID
    node = drained_by_gpu_tune(slurm, "FatalXid")
    record_timing("slurm: fault -> drain (s)", time.time() - t0)
    # within one interval: the first health check after the fault is the one that drains it (or
    # the one running as it came, which read it already); counted in runs, not timed
    (first,) = passes_after(slurm, t_fault, 1)[:1]
    assert first.rc == 1, ("the first health check after the fault passed", slurm.runs("health-check"))
    reason = node["Reason"]
    assert reason.startswith("gpu-tune: FatalXid") and "GPU 3" in reason and "XID 79" in reason, reason
    assert len(reason) <= MAX_REASON and node["ReasonBy"] == "root"
    assert slurm.sinfo_reasons() == {NODE: reason}  # sinfo -R, whole

    job = slurm.submit("echo ran")
    waiting = wait_for(f"job {job} judged by the scheduler", lambda: (j := slurm.job(job)).get("Reason") not in
                       (None, "None") and j, 30)
    passes_after(slurm, time.time(), 1, rc=1)  # another pass, still not ready
    assert slurm.job(job)["JobState"] == "PENDING", waiting
    assert not (slurm.base / "jobs" / f"{job}.out").exists()

    # what it did, in Slurm's log and on stderr
    assert f"update_node: node {NODE} reason set to: {reason}" in (slurm.log / "slurmctld.log").read_text()
    assert "health_check failed: rc:1 output:not ready: FatalXid" in (slurm.log / "slurmd.log").read_text()
    assert f"gpu-tune: slurm node {NODE} (health_check): not ready; drained" in (slurm.base / "gpu-tune.log").read_text()


def test_a_node_running_a_job_is_drained_and_the_job_goes_on(slurm, host, tmp_path, policies):
    job = slurm.submit("sleep 60")
    wait_for(f"job {job} running", lambda: slurm.job(job).get("JobState") == "RUNNING", 30)
    slurm.use("health-check", slurm.gpu_tune_command(host, gpu_json(tmp_path), policies))
    append_xid(host, 90, 88310022)
    node = drained_by_gpu_tune(slurm, "FatalXid")
    assert node["State"] in ("ALLOCATED+DRAIN", "MIXED+DRAIN"), node["State"]  # draining: no new job starts
    passes_after(slurm, time.time(), 1, rc=1)
    assert slurm.job(job)["JobState"] == "RUNNING"  # not killed
    assert "its running jobs go on; no new job starts" in (slurm.base / "gpu-tune.log").read_text()


# -- 2. the fault cleared: resumed (on the second ready pass), and a job runs -------------------------
def test_a_cleared_fault_resumes_the_node_and_a_job_runs(slurm, host, tmp_path, policies):
    slurm.use("health-check", slurm.gpu_tune_command(host, gpu_json(tmp_path), policies))
    append_xid(host, 90, 88310022)
    drained_by_gpu_tune(slurm, "FatalXid")
    pending = slurm.submit("echo waited")

    mark = len((slurm.base / "gpu-tune.log").read_text())
    t1 = time.time()
    r = run_cli("set-healthy", "--root", str(host))
    assert r.returncode == 0, r.stderr
    resumed(slurm, 2 * HEALTH_INTERVAL + 2 * PASS_SLACK + 5)
    record_timing("slurm: set-healthy -> resume (s)", time.time() - t1)
    ctld = (slurm.log / "slurmctld.log").read_text()
    assert f"update_node: node {NODE} reason set to: gpu-tune: ready again, resumed" in ctld
    # resumed on the second ready pass, never the first (no flapping) and no later: counted in the
    # passes' own lines since set-healthy (one line each; the first may be of a pass already running,
    # which read the fault), not timed
    said = [ln for ln in (slurm.base / "gpu-tune.log").read_text()[mark:].splitlines() if "(health_check)" in ln]
    done = next(i for i, ln in enumerate(said) if "ready; resumed" in ln)
    assert "ready; stays drained until the next ready pass (1 of 2 in a row)" in said[done - 1], said
    assert done <= 2, said
    assert job_done(slurm, pending)["JobState"] == "COMPLETED"  # the job that waited ran
    job = slurm.submit("echo ran")
    assert job_done(slurm, job)["JobState"] == "COMPLETED"
    assert (slurm.base / "jobs" / f"{job}.out").read_text() == "ran\n"

    # a fault in this boot again, then a new boot (boot id and kernel log anew): resumed
    append_xid(host, 91, 86_500_000_000)
    drained_by_gpu_tune(slurm, "FatalXid")
    t2 = time.time()
    (host / "dev/kmsg").write_text(hostgen.KMSG_BOOT)
    (host / "proc/sys/kernel/random/boot_id").write_text("9d0e7c1a-0000-4000-8000-000000000002\n")
    resumed(slurm, 2 * HEALTH_INTERVAL + 2 * PASS_SLACK + 5)
    record_timing("slurm: new boot -> resume (s)", time.time() - t2)


# -- 3. an administrator's drain is never resumed, and keeps its reason ------------------------------
def test_an_administrators_drain_or_down_is_never_touched(slurm, host, tmp_path, policies):
    slurm.use("health-check", slurm.gpu_tune_command(host, gpu_json(tmp_path), policies))
    slurm.scontrol("update", f"NodeName={NODE}", "State=DRAIN", "Reason=maint")
    passes_after(slurm, time.time(), 2, rc=0)  # ready, twice in a row
    node = slurm.node()
    assert "DRAIN" in node["State"] and node["Reason"] == "maint", node

    append_xid(host, 90, 88310022)  # not ready: still the administrator's reason
    passes_after(slurm, time.time(), 2, rc=1)
    node = slurm.node()
    assert "DRAIN" in node["State"] and node["Reason"] == "maint", node
    assert slurm.sinfo_reasons() == {NODE: "maint"}
    said = (slurm.base / "gpu-tune.log").read_text()
    assert "ready; left as it is: IDLE+DRAIN ('maint' by root" in said, said
    assert "not ready; left as it is: IDLE+DRAIN ('maint' by root" in said, said

    # down, by an administrator: not touched either, healthy or not
    run_cli("set-healthy", "--root", str(host))
    slurm.scontrol("update", f"NodeName={NODE}", "State=DOWN", "Reason=hardware ticket 7")
    passes_after(slurm, time.time(), 2, rc=0)
    node = slurm.node()
    assert node["State"].startswith("DOWN") and node["Reason"] == "hardware ticket 7", node


# -- 4. the prolog: passes when ready; on a fault, the node drained and the job requeued ------
def test_a_failing_prolog_drains_the_node_and_requeues_the_job(slurm, host, tmp_path, policies):
    slurm.use("prolog", slurm.gpu_tune_command(host, gpu_json(tmp_path), policies))
    for _ in range(3):
        assert job_done(slurm, slurm.submit("true"))["JobState"] == "COMPLETED"
    runs = slurm.runs("prolog")
    assert [r.context for r in runs] == ["prolog_slurmd"] * 3 and {r.rc for r in runs} == {0}
    assert {r.conf for r in runs} == {"/etc/slurm/slurm.conf"}  # slurmd passes its own SLURM_CONF to a prolog
    wall, cpu = min(r.wall for r in runs), min(r.cpu for r in runs)
    record_timing("slurm: prolog, ready, 8-GPU fixture, wall (s)", wall)
    record_timing("slurm: prolog, ready, 8-GPU fixture, CPU (s)", cpu)
    # how fast (the budget: well under a second) is a figure, printed in the suite's summary and
    # measured by benchmarks/bench_check.py, not a bound here: a busy machine stretches it

    append_xid(host, 90, 88310022)
    job = slurm.submit("echo must-not-run")
    node = drained_by_gpu_tune(slurm, "FatalXid")
    requeued = wait_for(f"job {job} requeued", lambda: (j := slurm.job(job)).get("JobState") == "PENDING"
                        and int(j.get("Restarts", "0")) >= 1 and j, 30)
    assert requeued["Reason"] == "launch_failed_requeued_held", requeued
    # Slurm writes the prolog's failure into the job's output; the job itself did not run
    assert (slurm.base / "jobs" / f"{job}.out").read_text() == "Error running slurm prolog: 1\n"
    failed = [r for r in slurm.runs("prolog") if r.rc == 1]
    assert len(failed) == 1
    record_timing("slurm: prolog, not ready, drains, wall (s)", failed[0].wall)
    # gpu-tune's reason, not Slurm's "Prolog error": the next ready pass of gpu-tune may resume it
    assert node["Reason"].startswith("gpu-tune: FatalXid"), node
    assert slurm.sinfo_reasons()[NODE].startswith("gpu-tune: FatalXid")


# -- 5. Slurm offers 8 GPUs where NVML lists 7 ------------------------------------------------------------
def test_gres_gpu_8_where_nvml_lists_7_drains_naming_both(slurm, host, tmp_path, policies):
    slurm.use("health-check", slurm.gpu_tune_command(host, gpu_json(tmp_path, drop=5), policies))
    node = drained_by_gpu_tune(slurm)
    reason = node["Reason"]
    assert "Slurm gres/gpu 8, NVML 7" in reason, reason
    assert slurm.sinfo_reasons() == {NODE: reason}


# -- how gpu-tune finds the node and Slurm's configuration; slurmctld away -------------------------------
def test_the_node_is_found_by_its_node_hostname_with_slurm_conf(slurm, host, tmp_path, policies):
    env = {"SLURM_CONF": str(slurm.conf), "SLURMD_NODENAME": ""}
    r = run_cli("check", "--slurm", "--root", str(host), "--gpu-backend", "fixture", "--gpu-fixture",
                str(gpu_json(tmp_path)), "--policy-dir", str(policies), "--profile", "health", "-o", "json", env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    s = doc["slurm"]
    assert (s["node"], s["named_by"], s["action"]) == (NODE, f"NodeHostName {slurm.hostname}", "none"), s
    assert {c["name"]: c for c in doc["checks"]}["slurm.gres"]["detail"] == "Slurm gres/gpu 8, NVML 8, PCI bus 8"
    assert r.stderr.strip() == f"gpu-tune: slurm node {NODE} (command): ready"


def test_slurmctld_not_reachable_is_exit_3_and_changes_nothing(tmp_path, host, policies):
    from tests.realslurm.plugin import _need

    _need()
    conf = tmp_path / "slurm.conf"  # a controller on a port where nothing listens
    conf.write_text(f"ClusterName=away\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort={_closed_port()}\n"
                    "AuthType=auth/none\nCredType=cred/none\nMessageTimeout=2\n"
                    f"NodeName={NODE} CPUs=1\nPartitionName=p Nodes={NODE}\n")
    for out in ("json", "table"):
        r = run_cli("check", "--slurm", "--slurm-node", NODE, "--root", str(host), "--gpu-backend", "fixture",
                    "--gpu-fixture", str(gpu_json(tmp_path)), "--policy-dir", str(policies), "--profile", "health",
                    "-o", out, env={"SLURM_CONF": str(conf)}, timeout=60)
        assert r.returncode == 3, (r.returncode, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("gpu-tune: error: slurmctld not reachable: "), r.stderr
        assert lines[0].endswith("; nothing changed"), lines
        assert r.stdout == "" if out == "json" else r.stdout.startswith("ready: AllChecksPassed")
    assert not (host / "var/lib/gpu-tune/slurm.json").exists()  # not even the count of ready passes


def _closed_port() -> int:
    from tests.realslurm.cluster import free_port

    return free_port()
