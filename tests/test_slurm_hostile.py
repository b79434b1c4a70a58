"""Hostile values for ``gpu-tune check --slurm``, round 5, on the real Slurm (tests/realslurm): a
ready-pass count that cannot be saved or is read through a link, a node name that looks like an
option, an administrator's reason with a leading space, ``Gres=gpu:0``, a job id of 5,000 digits,
the pass's one deadline, ``scontrol``'s output past its cap, a node line without ``State=``.

Each test runs ``gpu-tune check --slurm`` itself against the real slurmctld (``SLURM_CONF``),
pass by pass, and reads the node back with the real ``scontrol``. Where a real slurmctld cannot
be made to print the hostile value (an endless answer, a line without ``State=``, a ``Gres=``
slurmctld refuses to take: ``gpu:-8``, ``gpu:h100:٨``) or to hang on one call only, a stand-in
``scontrol`` first on PATH prints it and passes every other call to the real one; each such test
says so. Memory and time at these bounds: benchmarks/bench_slurm_bounds.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.healthkit import policies  # noqa: F401 (fixtures)
from tests.realslurm.cluster import NODE
from tests.slurmkit import COUNT, STATE, check, dgx_tree, gpu_json, host, said, standin, standin_log  # noqa: F401

pytestmark = pytest.mark.slow

DRAIN_FIRST = "not ready; drained"


def drained(slurm) -> dict:
    node = slurm.node()
    return node if "DRAIN" in node.get("State", "") else {}


def assert_drained_by_gpu_tune(slurm, why: str) -> None:
    node = slurm.node()
    assert "DRAIN" in node.get("State", "") and node.get("Reason", "").startswith("gpu-tune:"), \
        f"{why}: the node is {node.get('State')} ({node.get('Reason')!r})"


def ready_pass(slurm, host, tmp_path, policies, **kw):
    r = check(slurm, host, gpu_json(tmp_path), policies, **kw)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    return r


def fault_pass(slurm, host, tmp_path, policies, **kw):
    r = check(slurm, host, gpu_json(tmp_path, drop=5), policies, **kw)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    return r


# -- 1. a count that was not saved never resumes the node ------------------------------------------------
@pytest.mark.parametrize("link", ["symlink", "hard link"])
def test_a_count_behind_a_link_never_resumes_the_node(slurm, host, tmp_path, policies, link):
    fault_pass(slurm, host, tmp_path, policies)
    assert_drained_by_gpu_tune(slurm, "the fault pass")
    r = ready_pass(slurm, host, tmp_path, policies)
    assert "(1 of 2 in a row)" in said(r), said(r)
    # the count gpu-tune just saved (1, for this drain), now read through a link
    count = host / COUNT
    kept = host / STATE / "kept.json"
    os.replace(count, kept)
    if link == "symlink":
        os.symlink("kept.json", count)
    else:
        os.link(kept, count)
    for _ in range(2):
        r = ready_pass(slurm, host, tmp_path, policies)
        assert_drained_by_gpu_tune(slurm, f"resumed on a count read through a {link}, which could not be saved "
                                          f"({said(r)})")
        assert "the ready-pass count was not saved" in said(r) and "no resume until it can be" in said(r), said(r)
        assert ("symlink" if link == "symlink" else "hard links") in said(r), said(r)
        assert json.loads(r.stdout)["slurm"]["action"] == "hold"
    # the link gone: counted afresh, resumed on the second ready pass
    count.unlink()
    assert "(1 of 2 in a row)" in said(ready_pass(slurm, host, tmp_path, policies))
    assert_drained_by_gpu_tune(slurm, "after one ready pass")
    assert "ready; resumed" in said(ready_pass(slurm, host, tmp_path, policies))
    assert not drained(slurm)


def test_a_read_only_state_folder_with_a_count_left_never_resumes_the_node(slurm, host, tmp_path, policies):
    ready_pass(slurm, host, tmp_path, policies)  # in service: 1 ready pass saved
    assert json.loads((host / COUNT).read_text())["ready_in_a_row"] == 1
    r = fault_pass(slurm, host, tmp_path, policies, read_only=True)  # its 0 cannot be saved
    assert DRAIN_FIRST in said(r) and "the ready-pass count was not saved" in said(r), said(r)
    assert_drained_by_gpu_tune(slurm, "the fault pass")
    for i in range(2):
        r = ready_pass(slurm, host, tmp_path, policies, read_only=True)
        assert_drained_by_gpu_tune(slurm, f"ready pass {i + 1} after the fault, its count not saved: resumed "
                                          f"({said(r)})")
    # writable again: the count left from before the fault is not this drain's; counted afresh
    r = ready_pass(slurm, host, tmp_path, policies)
    assert_drained_by_gpu_tune(slurm, f"resumed on the count left from before the fault ({said(r)})")
    assert "(1 of 2 in a row)" in said(r), said(r)
    assert "ready; resumed" in said(ready_pass(slurm, host, tmp_path, policies))


def test_a_fault_that_flaps_while_the_count_cannot_be_saved_stays_drained(slurm, host, tmp_path, policies):
    """ready, fault, ready: the fault's 0 not saved (read-only for that pass only)."""
    ready_pass(slurm, host, tmp_path, policies)
    fault_pass(slurm, host, tmp_path, policies, read_only=True)
    assert_drained_by_gpu_tune(slurm, "the fault pass")
    r = ready_pass(slurm, host, tmp_path, policies)
    assert_drained_by_gpu_tune(slurm, f"a fault that flapped (ready, fault, ready) was resumed at once ({said(r)})")
    assert "(1 of 2 in a row)" in said(r), said(r)


# -- 7. a node name that looks like an option -------------------------------------------------------------
@pytest.mark.parametrize("name", ["-V", "-h", "--help", "-a"])
@pytest.mark.parametrize("where", ["--slurm-node", "SLURMD_NODENAME"])
def test_a_node_name_that_looks_like_an_option_is_bad_input(slurm, host, tmp_path, policies, name, where):
    before = slurm.node()
    if where == "--slurm-node":
        r = check(slurm, host, gpu_json(tmp_path, drop=5), policies, f"--slurm-node={name}", node=None)
    else:
        r = check(slurm, host, gpu_json(tmp_path, drop=5), policies, node=None, env={"SLURMD_NODENAME": name})
    assert r.returncode == 2, f"{where}={name}: exit {r.returncode}, not 2 (bad input): {r.stderr[-500:]}"
    assert said(r) == (f"gpu-tune: error: {where} {name!r}: a node name does not start with '-' (scontrol would "
                       "take it for an option)"), said(r)
    assert r.stdout == ""
    assert not (host / STATE).exists()  # refused before the checks ran (they keep their state there)
    assert slurm.node() == before


# -- 9. an administrator's reason with a leading space is not gpu-tune's ------------------------------------
def test_an_administrators_reason_with_a_leading_space_is_never_resumed(slurm, host, tmp_path, policies):
    slurm.scontrol("update", f"NodeName={NODE}", "State=DRAIN", "Reason= gpu-tune: x")
    kept = " State=IDLE+DRAIN ", " Reason= gpu-tune: x [root@"  # as Slurm prints it: the space kept
    assert all(k in slurm.scontrol("-o", "show", "node", NODE).stdout for k in kept)
    for _ in range(3):
        r = ready_pass(slurm, host, tmp_path, policies)
        now = slurm.scontrol("-o", "show", "node", NODE).stdout
        mistaken = f"an administrator's reason ' gpu-tune: x' was taken for gpu-tune's: {said(r)}; now: {now[-120:]}"
        assert all(k in now for k in kept), mistaken
        assert "ready; left as it is: IDLE+DRAIN (' gpu-tune: x' by root" in said(r), mistaken


# -- 9. Gres=gpu:0, which Slurm takes: no GPU offered, not compared ---------------------------------------
def test_gres_gpu_0_is_not_compared_and_does_not_drain(slurm, host, tmp_path, policies):
    slurm.scontrol("update", f"NodeName={NODE}", "Gres=gpu:0")  # the cluster's reset puts gpu:8 back
    assert slurm.node()["Gres"] == "gpu:0"
    r = check(slurm, host, gpu_json(tmp_path), policies)
    gres = {c["name"]: c for c in json.loads(r.stdout)["checks"]}["slurm.gres"] if r.stdout else {}
    assert r.returncode == 0 and not drained(slurm), \
        f"Gres=gpu:0 drained the node: exit {r.returncode}, {gres.get('detail')!r}"
    assert gres["ok"] and gres["detail"].startswith(f"not compared: Slurm offers no gres/gpu on {NODE} (Gres=gpu:0)")


# -- 9. a stand-in prints Gres values slurmctld refuses to take (scontrol update says "Invalid generic
#       resource (gres) specification" for both) ------------------------------------------------------------
@pytest.mark.parametrize("gres", ["gpu:-8", "gpu:h100:\u0668", "gpu:\u0668"])
def test_a_gres_value_it_cannot_read_is_a_warning_never_a_drain(slurm, host, tmp_path, policies, gres):
    env = standin(tmp_path, 'if [ "$1 $2 $3 $4" = "-a -o show node" ]; then\n'
                            f'  "$REAL" "$@" | sed "s/ Gres=gpu:8 / Gres={gres} /"; exit 0\nfi\n'
                            'echo "$*" >> "$LOG"; exec "$REAL" "$@"\n')
    r = check(slurm, host, gpu_json(tmp_path), policies, env=env)
    c = {c["name"]: c for c in json.loads(r.stdout)["checks"]}["slurm.gres"] if r.stdout else {}
    assert c.get("severity") == "warning" and "could not be read" in c.get("detail", ""), \
        f"Gres={gres} was read as a count: {c.get('detail')!r} (exit {r.returncode})"
    assert r.returncode == 0 and not drained(slurm) and standin_log(tmp_path) == []


# -- 9. a job id of 5,000 digits: the line still says what was done -------------------------------------------
def test_a_job_id_of_5000_digits_leaves_room_for_what_was_done(slurm, host, tmp_path, policies):
    job = "9" * 5000
    r = fault_pass(slurm, host, tmp_path, policies, env={"SLURM_SCRIPT_CONTEXT": "prolog_slurmd", "SLURM_JOB_ID": job})
    assert_drained_by_gpu_tune(slurm, "the fault pass")
    line = said(r)
    assert DRAIN_FIRST in line, f"the stderr line does not say what was done: {line[:120]}...{line[-80:]}"
    assert line.startswith(f"gpu-tune: slurm node {NODE} (prolog of job 999999999999999999999999999999...(5000 "
                           "characters)): not ready; drained"), line[:200]
    assert json.loads(r.stdout)["slurm"]["job"] == job  # -o json: exact


# -- 9. one deadline for the pass, shared by its calls ----------------------------------------------------------
def test_the_calls_of_a_pass_share_one_deadline(slurm, host, tmp_path, policies):
    """A stand-in answers each call 1.5 s late (a slurmctld that answers slowly); the pass has 2 s
    for Slurm in all: the second call is stopped where the first used the time (each was within
    the old per-call limit of 30 s, and three took 76 s at 25 s each)."""
    env = standin(tmp_path, 'echo "start $$ $*" >> "$LOG"; /bin/sleep 1.5; "$REAL" "$@"; rc=$?\n'
                            'echo "end $$" >> "$LOG"; exit $rc\n')
    env["GPU_TUNE_SLURM_TIMEOUT"] = "2"
    r = check(slurm, host, gpu_json(tmp_path, drop=5), policies, env=env, node=None)  # by NodeHostName: 3 calls
    log = standin_log(tmp_path)
    started = [ln.split()[1] for ln in log if ln.startswith("start ")]
    ended = {ln.split()[1] for ln in log if ln.startswith("end ")}
    assert r.returncode == 3, f"exit {r.returncode}: {len(started)} scontrol calls, one after another, no deadline " \
                              f"for the pass: {log}"
    assert len(ended) <= 1 and len(started) == len(ended) + 1, log  # the last one started was stopped
    stopped = next(pid for pid in started if pid not in ended)
    assert not Path(f"/proc/{stopped}").exists(), "the stopped scontrol was left running"
    assert said(r).startswith("gpu-tune: error: slurmctld not reachable: `scontrol show node")
    assert "within the 2 s a pass has for Slurm (GPU_TUNE_SLURM_TIMEOUT)" in said(r), said(r)
    assert said(r).endswith("; nothing changed"), said(r)
    assert not drained(slurm) and not (host / COUNT).exists()


# -- 9. an update that hangs: the line and the count say what happened ---------------------------------------
def test_an_update_that_hangs_says_what_happened_and_the_count_matches(slurm, host, tmp_path, policies):
    """A stand-in passes ``show`` to the real scontrol and hangs on ``update`` (a slurmctld that
    takes the request and never answers)."""
    env = standin(tmp_path, 'case "$*" in update*) echo "update $$" >> "$LOG"; exec /bin/sleep 3600;; esac\n'
                            'exec "$REAL" "$@"\n')
    env["GPU_TUNE_SLURM_TIMEOUT"] = "3"
    r = check(slurm, host, gpu_json(tmp_path, drop=5), policies, env=env)
    assert r.returncode == 3, (r.returncode, r.stderr[-500:])
    line = said(r)
    assert not (host / COUNT).exists(), f"slurm.json written by a pass that exited 3 saying: {line}"
    assert "nothing changed" not in line, line  # slurmctld may yet apply an update it did not answer
    assert line.startswith(f"gpu-tune: error: slurmctld not reachable: `scontrol update NodeName={NODE} "
                           "State=DRAIN` gave no answer within the 3 s"), line
    assert line.endswith("slurmctld may still apply it, the next pass reads the node again; the ready-pass count "
                         "was not written"), line
    pid = standin_log(tmp_path)[0].split()[1]
    assert not Path(f"/proc/{pid}").exists(), "the hanging scontrol update was left running"
    assert not drained(slurm)

    # a resume that hangs: its count was saved first, and the line says so
    fault_pass(slurm, host, tmp_path, policies)
    ready_pass(slurm, host, tmp_path, policies)  # 1 of 2
    r = check(slurm, host, gpu_json(tmp_path), policies, env=env)
    assert r.returncode == 3 and said(r).endswith("the ready-pass count was saved (2 in a row)"), said(r)
    assert json.loads((host / COUNT).read_text())["ready_in_a_row"] == 2
    assert_drained_by_gpu_tune(slurm, "the resume that hung")
    assert "ready; resumed" in said(ready_pass(slurm, host, tmp_path, policies))  # the next pass resumes it


# -- 5. scontrol's output past the cap: read no further, stop it ---------------------------------------------
def test_scontrol_output_past_the_cap_is_stopped_and_changes_nothing(slurm, host, tmp_path, policies):
    """A stand-in prints the real node line, then 64 MB more on it (a real slurmctld cannot be
    made to print that); ``update`` is logged and passed to the real scontrol."""
    env = standin(tmp_path, 'if [ "$1 $2 $3 $4" = "-a -o show node" ]; then echo "show $$" >> "$LOG"\n'
                            '  "$REAL" "$@" | tr -d "\\n"; /usr/bin/head -c 67108864 /dev/zero | tr "\\0" x\n'
                            '  echo "show-done $$" >> "$LOG"; exit 0\nfi\n'
                            'echo "$*" >> "$LOG"; exec "$REAL" "$@"\n')
    r = check(slurm, host, gpu_json(tmp_path, drop=5), policies, env=env)
    log = standin_log(tmp_path)
    assert r.returncode == 3, f"exit {r.returncode}: 64 MB of scontrol output read whole and taken: {said(r)}"
    assert said(r) == (f"gpu-tune: error: `scontrol show node {NODE}`: more than 4 MiB of output: scontrol stopped, "
                       "its answer not read; nothing changed"), said(r)
    assert log[0].startswith("show ") and len(log) == 1, f"the stand-in printed all it had, or update ran: {log}"
    assert not Path(f"/proc/{log[0].split()[1]}").exists(), "the scontrol that printed too much was left running"
    assert not drained(slurm) and not (host / COUNT).exists()


# -- 6. a node line without State=: not read, nothing written ----------------------------------------------
def test_a_node_line_without_a_state_is_not_taken_as_in_service(slurm, host, tmp_path, policies):
    """A stand-in prints the real node line without ``State=`` (a real slurmctld always prints
    it); ``update`` is logged and passed to the real scontrol. The administrator's drain, which
    gpu-tune cannot see in that line, stays."""
    slurm.scontrol("update", f"NodeName={NODE}", "State=DRAIN", "Reason=maint")
    env = standin(tmp_path, 'if [ "$1 $2 $3 $4" = "-a -o show node" ]; then\n'
                            '  "$REAL" "$@" | sed "s/ State=[^ ]*//"; exit 0\nfi\n'
                            'echo "$*" >> "$LOG"; exec "$REAL" "$@"\n')
    r = check(slurm, host, gpu_json(tmp_path, drop=5), policies, env=env)
    node = slurm.node()
    assert node["Reason"] == "maint", f"an administrator's drain was replaced: {node['Reason']!r} ({r.stderr[-300:]})"
    assert r.returncode == 3 and standin_log(tmp_path) == [], (r.returncode, standin_log(tmp_path))
    assert said(r) == (f"gpu-tune: error: scontrol show node {NODE}: node '{NODE}': a line of `scontrol -o show "
                       "node` without State=: its state is not known; nothing changed"), said(r)
    assert not (host / COUNT).exists()
