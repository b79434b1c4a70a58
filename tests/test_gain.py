"""`gpu-tune gain`: interleaving, switching through the journal, leaving the host as found,
refusing busy GPUs, SIGKILL safety, and one real run of the probe (slow)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from gpu_tune.judge.gain.measure import TUNED, UNTUNED, interleaved, overall_verdict, schedule
from tests.conftest import REPO, jdoc, run_cli, snapshot_tree

BASE = ("--gpu-backend", "none")


def fake_env(root, log, tuned_ips=1100.0, untuned_ips=1000.0, sleep=0.0):
    return {"GPU_TUNE_PROBE_MODULE": "tests.gain_workload", "GAIN_TEST_ROOT": str(root), "GAIN_TEST_LOG": str(log),
            "GAIN_TEST_TUNED_IPS": str(tuned_ips), "GAIN_TEST_UNTUNED_IPS": str(untuned_ips),
            "GAIN_TEST_SLEEP": str(sleep)}


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_each_round_holds_every_arm_once_in_a_random_order_that_the_seed_repeats():
    arms = ["untuned", "sysctl", "thp", "numa", "tuned"]
    order = schedule(arms, 40, seed=7)
    assert [r for r, _ in order] == [r for r in range(40) for _ in arms]
    rounds = [[a for r, a in order if r == k] for k in range(40)]
    assert all(sorted(x) == sorted(arms) for x in rounds)
    assert schedule(arms, 40, seed=7) == order and schedule(arms, 40, seed=8) != order
    # no fixed pattern: over many rounds each arm goes first about as often as any other, and for
    # the two-arm comparison the order of one pair says nothing about the next one's
    firsts = [x[0] for x in rounds]
    assert all(firsts.count(a) >= 3 for a in arms)
    two = [[a for _, a in interleaved(1, seed=s)] for s in range(400)]
    assert 160 <= sum(x == [UNTUNED, TUNED] for x in two) <= 240
    long = [a for _, a in interleaved(400, seed=3)][::2]
    same = sum(long[i] == long[i + 1] for i in range(len(long) - 1))
    assert 160 <= same <= 240  # a fixed A B, B A order would make this 0


def test_overall_verdict_puts_a_loss_first():
    assert overall_verdict([{"verdict": "gain"}, {"verdict": "loss"}]) == "loss"
    assert overall_verdict([{"verdict": "gain"}, {"verdict": "no significant difference"}]) == "gain"
    assert overall_verdict([]) == "inconclusive"


def test_gain_switches_through_the_journal_and_leaves_the_host_as_found(make_host, tmp_path):
    root = make_host("small-2cpu")
    before = snapshot_tree(root)
    log = tmp_path / "runs.jsonl"
    p = run_cli("gain", "--root", str(root), *BASE, "-o", "json", env=fake_env(root, log))
    assert p.returncode == 0, p.stderr
    doc = jdoc(p)
    seen = lines(log)
    # one warm-up run of the control, not counted; then each run saw the host in the state of its
    # side, in the rounds' random order (6 pairs by default), which the recorded seed repeats
    assert doc["warmup"] == 1 and doc["pairs"] == 6
    assert [("tuned" if r["swappiness"] == "0" else "untuned") for r in seen] == ["untuned"] + doc["order"]
    assert doc["order"] == [a for _, a in interleaved(6, doc["order_seed"])]
    assert all(sorted(doc["order"][i:i + 2]) == ["tuned", "untuned"] for i in range(0, 12, 2))
    seen = seen[1:]
    # tuned: bound to node 0's CPUs with jemalloc; untuned: this process's CPUs, no preload
    for r, side in zip(seen, doc["order"]):
        if side == TUNED:
            assert "libjemalloc" in r["ld_preload"] and r["affinity"] == [0, 1]
        else:
            assert r["ld_preload"] == "" and r["affinity"] == sorted(os.sched_getaffinity(0))
        assert "--launch-bound-only" in r["argv"] and "--step-times" in r["argv"]
    # a switch each time the side changes (from the warm-up on), and back to untuned at the end
    states = ["untuned"] + doc["order"] + ["untuned"]
    assert [s["to"] for s in doc["switches"]] == [b for a, b in zip(states, states[1:]) if a != b]
    assert all(s["ok"] for s in doc["switches"])
    assert doc["found"] == "untuned" and doc["ended"] == "untuned" and doc["host_left_as_asked"]
    t = doc["targets"][0]
    assert t["gpu"] == "cpu" and t["pairs_complete"] == 6
    assert [r.get("warmup", False) for r in t["runs"]] == [True] + [False] * 12
    m = t["measures"]["images_per_second"]
    assert m["verdict"] == "gain" and m["ci95"][0] < 1.1 < m["ci95"][1]
    assert doc["verdict"] == "gain"
    assert snapshot_tree(root) == before
    assert not (root / "var/lib/gpu-tune/journal.json").exists() or \
        json.loads((root / "var/lib/gpu-tune/journal.json").read_text())["entries"] == []


def test_a_loss_is_loud_and_exits_1(make_host, tmp_path):
    root = make_host("small-2cpu")
    p = run_cli("gain", "--root", str(root), *BASE,
                env={**fake_env(root, tmp_path / "l.jsonl", tuned_ips=800.0, untuned_ips=1000.0), "COLUMNS": "160"})
    assert p.returncode == 1, p.stderr
    assert "LOSS: profile training makes the launch-bound regime SLOWER" in p.stdout
    assert "LOSS" in p.stdout.split("images/s", 1)[1].splitlines()[0]


def test_keep_leaves_the_host_tuned(make_host, tmp_path):
    root = make_host("small-2cpu")
    p = run_cli("gain", "--root", str(root), *BASE, "--pairs", "2", "--keep", "-o", "json",
                env=fake_env(root, tmp_path / "k.jsonl"))
    doc = jdoc(p)
    assert doc["ended"] == "tuned" and doc["kept"]
    assert (root / "proc/sys/vm/swappiness").read_text().strip() == "0"
    assert doc["verdict"] == "inconclusive"  # 2 pairs: too few for an interval
    assert doc["targets"][0]["measures"]["images_per_second"]["ratio"] is None
    assert p.returncode == 1
    r = run_cli("revert", "--root", str(root), *BASE)
    assert r.returncode == 0


def test_a_host_found_tuned_is_left_tuned(make_host, tmp_path):
    root = make_host("small-2cpu")
    assert run_cli("apply", "--root", str(root), *BASE).returncode == 0
    tuned = snapshot_tree(root)
    doc = jdoc(run_cli("gain", "--root", str(root), *BASE, "--pairs", "3", "-o", "json",
                       env=fake_env(root, tmp_path / "f.jsonl")))
    assert doc["found"] == "tuned" and doc["ended"] == "tuned"
    assert doc["switches"][0]["to"] == "untuned"  # the warm-up run is untuned
    assert snapshot_tree(root) == tuned


def test_busy_gpu_is_refused_unless_forced(make_host, gpu_fixture, tmp_path):
    root = make_host("vm-virtio-2node")
    fx = gpu_fixture("vm-virtio-2node")
    data = json.loads(fx.read_text())
    data["gpus"][0]["processes"] = [4242]
    fx.write_text(json.dumps(data))
    before = snapshot_tree(root)
    p = run_cli("gain", "--root", str(root), "--gpu-backend", "fixture", "--gpu-fixture", str(fx),
                env=fake_env(root, tmp_path / "b.jsonl"))
    assert p.returncode == 1
    assert "busy with 1 other process(es) (pid 4242)" in p.stderr and "--force" in p.stderr
    assert snapshot_tree(root) == before and not (tmp_path / "b.jsonl").exists()
    # forced past the busy rule, the GPU's NUMA node (1: CPUs 4-7) is still not usable from here
    f = run_cli("gain", "--root", str(root), "--gpu-backend", "fixture", "--gpu-fixture", str(fx), "--force",
                env=fake_env(root, tmp_path / "b.jsonl"))
    assert f.returncode == 1 and "busy" not in f.stderr and "GPU 0:" in f.stderr
    assert snapshot_tree(root) == before and not (tmp_path / "b.jsonl").exists()


@pytest.mark.parametrize("args,what", [(("--pairs", "0"), "--pairs 0"), (("--window", "0"), "--window 0"),
                                       (("--gpu", "x"), "--gpu 'x'"), (("--gpu", "3"), "--gpu 3")])
def test_bad_input_exits_2_and_changes_nothing(make_host, args, what):
    root = make_host("small-2cpu")
    before = snapshot_tree(root)
    p = run_cli("gain", "--root", str(root), *BASE, *args)
    assert p.returncode == 2, p.stderr
    assert what in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert snapshot_tree(root) == before


@pytest.mark.parametrize("when", ["tuned run", "apply writes"])
def test_sigkill_at_any_moment_loses_nothing(make_host, tmp_path, when):
    root = make_host("small-2cpu")
    before = snapshot_tree(root)
    log = tmp_path / "s.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO), **fake_env(root, log, sleep=0.5)}
    if when == "apply writes":
        env["GPU_TUNE_FAILPOINT_WRITE_DELAY"] = "0.3"
    proc = subprocess.Popen([sys.executable, "-m", "gpu_tune", "gain", "--root", str(root), *BASE, "--pairs", "3"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    swap = root / "proc/sys/vm/swappiness"
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if when == "tuned run" and log.exists() and any(r["swappiness"] == "0" for r in lines(log)):
                break
            if when == "apply writes" and swap.read_text().strip() == "0":
                break
            time.sleep(0.01)
        else:
            pytest.fail("never reached the moment to kill: " + (proc.stderr.read().decode() if proc.poll() is not None else ""))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert swap.read_text().strip() == "0"  # killed while tuned
    if when == "apply writes":
        gov = (root / "sys/devices/system/cpu/cpu1/cpufreq/scaling_governor").read_text().strip()
        assert gov != "performance", "the kill must land in the middle of the writes"
    r = run_cli("revert", "--root", str(root), *BASE)
    assert r.returncode == 0, r.stdout + r.stderr
    assert snapshot_tree(root) == before


def test_sigterm_restores_the_host(make_host, tmp_path):
    root = make_host("small-2cpu")
    before = snapshot_tree(root)
    log = tmp_path / "t.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO), **fake_env(root, log, sleep=2.0)}
    proc = subprocess.Popen([sys.executable, "-m", "gpu_tune", "gain", "--root", str(root), *BASE, "--pairs", "3"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (log.exists() and len(lines(log)) >= 2):
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(30)
    assert rc == 130
    assert snapshot_tree(root) == before


@pytest.mark.slow
def test_real_probe_gain_on_this_machine(make_host):
    """The real workload, both sides, 3 short pairs on a fixture host tree: asserts the machinery,
    never a gain (this VM may well show none)."""
    root = make_host("small-2cpu")
    before = snapshot_tree(root)
    p = run_cli("gain", "--root", str(root), *BASE, "--pairs", "3", "--window", "0.5", "-o", "json", timeout=600)
    assert p.returncode in (0, 1), p.stderr
    doc = jdoc(p)
    assert all(sorted(doc["order"][i:i + 2]) == ["tuned", "untuned"] for i in range(0, 6, 2))
    t = doc["targets"][0]
    assert t["failed_runs"] == [] and t["pairs_complete"] == 3
    warmup = [r for r in t["runs"] if r.get("warmup")]
    assert [r["side"] for r in warmup] == ["untuned"] * doc["warmup"] and doc["warmup"] == 1
    assert [r["side"] for r in t["runs"] if not r.get("warmup")] == doc["order"]
    for r in t["runs"]:
        assert r["ok"] and r["images_per_second"] > 0 and r["step_p99_seconds"] >= r["step_p50_seconds"] > 0
        if r["side"] == TUNED:
            assert r["host"]["jemalloc_mapped"] and r["host"]["mems_allowed"] == "0"
        else:
            assert not r["host"]["jemalloc_mapped"]
    for m in t["measures"].values():
        assert m["verdict"] in ("gain", "loss", "no significant difference", "inconclusive")
        assert m["ratio"] is not None and m["ci95"][0] <= m["ratio"] <= m["ci95"][1]
    assert doc["host_left_as_asked"] and snapshot_tree(root) == before


@pytest.mark.slow
def test_workload_times_each_launch_bound_step_when_asked():
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "gpu_tune.workload.mnist_probe", "--device", "cpu", "--window-seconds", "0.3"]
    p = subprocess.run(cmd + ["--launch-bound-only", "--step-times"], capture_output=True, text=True, env=env,
                       timeout=300)
    doc = json.loads(p.stdout)
    assert doc["ok"], doc.get("error")
    lb = doc["regimes"]["launch_bound"]
    st = lb["step_seconds"]
    assert lb["steps_per_call"] == 1 and st["samples"] == lb["steps"] == len(lb["step_seconds_all"])
    assert 0 < st["p50"] <= st["p99"] and st["p99_over_p50"] == pytest.approx(st["p99"] / st["p50"], rel=1e-3)
    assert min(lb["step_seconds_all"]) <= st["p50"] <= max(lb["step_seconds_all"])
    # only the launch-bound window ran: no device-bound window, no correctness run
    assert list(doc["regimes"]) == ["launch_bound"] and doc["accuracy"] is None


# -- A/A, per setting, the written profile ---------------------------------------------------------
def test_null_runs_the_control_twice_through_the_same_machinery(make_host, tmp_path):
    root = make_host("small-2cpu")
    before = snapshot_tree(root)
    log = tmp_path / "null.jsonl"
    # the fake reports the tuned figure whenever the host reads tuned: an A/A run never tunes it
    p = run_cli("gain", "--root", str(root), *BASE, "--null", "-o", "json",
                env=fake_env(root, log, tuned_ips=2000.0, untuned_ips=1000.0))
    doc = jdoc(p)
    assert doc["mode"] == "null" and doc["switches"] == [] and len(doc["arms"]) == 2
    assert all(sorted(doc["order"][i:i + 2]) == ["untuned", "untuned-again"] for i in range(0, 12, 2))
    assert all(r["swappiness"] != "0" and r["ld_preload"] == "" for r in lines(log))
    assert doc["verdict"] == "no significant difference" and p.returncode == 0
    assert doc["targets"][0]["tuned"]["allocator"] == "system" and not doc["targets"][0]["tuned"]["bound"]
    assert snapshot_tree(root) == before


def _effects_env(root, log, effects):
    return {**fake_env(root, log), "GAIN_TEST_EFFECTS": json.dumps(effects)}


def test_per_setting_measures_each_family_alone_and_writes_a_profile_without_the_losses(make_host, tmp_path):
    """THP measured 20 % slower alone, jemalloc 15 % faster, the rest no different: THP is the
    LOSS, the written profile includes training and leaves THP out (and loads as a profile)."""
    root = make_host("small-2cpu")
    before = snapshot_tree(root)
    log = tmp_path / "per.jsonl"
    out = tmp_path / "profiles" / "mynode.yaml"
    out.parent.mkdir()
    p = run_cli("gain", "--root", str(root), *BASE, "--per-setting", "--write-profile", str(out), "-o", "json",
                env=_effects_env(root, log, {"thp": 0.8, "allocator": 1.15}), timeout=600)
    assert p.returncode == 1, p.stderr  # the whole profile loses (0.8 x 1.15)
    doc = jdoc(p)
    assert doc["mode"] == "per-setting" and doc["pairs"] == 8 and doc["confidence"] > 0.95  # Bonferroni
    arms = [a["name"] for a in doc["arms"]]
    assert arms[0] == "untuned" and arms[-1] == "tuned"
    assert {"sysctl", "thp", "cpu", "numa", "allocator"} <= set(arms)
    skipped = {s["family"]: s["why"] for s in doc["skipped_families"]}
    assert "gpu" in skipped  # no GPU on this host
    t = doc["targets"][0]
    fam = {name: a["verdict"] for name, a in t["families"].items()}
    assert fam["thp"] == "loss" and fam["allocator"] == "gain"
    assert fam["sysctl"] == fam["numa"] == fam["cpu"] == "no significant difference"
    assert t["verdict"] == "loss" and doc["verdict"] == "loss", (t["measures"]["images_per_second"], [(r["side"], r.get("images_per_second")) for r in t["runs"]])
    # each family's runs saw that family alone
    for r in lines(log)[1:]:
        assert len(r["families"]) <= 1 or set(r["families"]) >= {"sysctl", "thp", "numa", "allocator"}
    assert snapshot_tree(root) == before
    # the profile written for this node
    w = doc["written_profile"]
    assert w["left_out"] == ["thp"] and w["name"] == "mynode"
    text = out.read_text()
    assert text.count("include: training.yaml") == 1 and "\nthp:\n" in text
    assert re.search(r"# thp \(transparent hugepages\) left out: CPU LOSS -(19|20)\.\d% \[", text), text
    from gpu_tune.tune.policy import load_profile

    mine, shipped = load_profile("mynode", out.parent), load_profile("training")
    assert mine.thp.enabled is None and mine.thp.defrag is None
    assert mine.sysctl == shipped.sysctl and mine.allocator == shipped.allocator and mine.cpu == shipped.cpu
    assert run_cli("--policy-dir", str(out.parent), "audit", "--root", str(root), *BASE, "--profile",
                   "mynode").returncode in (0, 1)


@pytest.mark.parametrize("args,what", [
    (("--write-profile", "x.yaml"), "--write-profile needs --per-setting"),
    (("--per-setting", "--write-profile", "Bad Name.yaml"), "expected NAME.yaml"),
    (("--per-setting", "--write-profile", "/nonexistent/dir/p.yaml"), "no such folder"),
    (("--per-setting", "--null"), "--per-setting and --null"),
    (("--warmup", "11"), "--warmup"),
])
def test_gain_options_are_checked_before_anything_runs(make_host, tmp_path, args, what):
    root = make_host("small-2cpu")
    before = snapshot_tree(root)
    p = run_cli("gain", "--root", str(root), *BASE, *args, env=fake_env(root, tmp_path / "x.jsonl"))
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert what in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.jsonl").exists() and snapshot_tree(root) == before


def test_a_dropped_numa_and_allocator_family_become_launch_settings(tmp_path):
    from gpu_tune.judge.gain.advice import profile_without_losses
    from gpu_tune.tune.policy import load_profile

    prof = load_profile("training")

    def fam(verdict, ratio):
        m = {"images_per_second": {"ratio": ratio, "change": f"{(ratio - 1) * 100:+.1f}% [x, y]", "verdict": verdict}}
        return {"verdict": verdict, "measures": m, "pairs_complete": 8}

    doc = {"mode": "per-setting", "confidence": 0.99, "pairs": 8, "measured_at": "2026-11-25T00:00:00Z",
           "skipped_families": [], "targets": [{"gpu": "0", "families": {
               "numa": fam("loss", 0.9), "allocator": fam("loss", 0.93), "sysctl": fam("loss", 0.95),
               "thp": fam("no significant difference", 1.0)}}]}
    text, dropped = profile_without_losses(doc, prof, "node7")
    assert dropped == ["numa", "allocator", "sysctl"]
    assert text.count("\nprobe:") == 1  # one block per key: a key given twice is an error
    (tmp_path / "node7.yaml").write_text(text)
    mine = load_profile("node7", tmp_path)
    assert mine.launch.numa_binding is False and mine.probe.require_numa_binding is False
    assert mine.allocator.preload == "none" and mine.probe.require_jemalloc is False
    assert mine.sysctl == {} and mine.thp == prof.thp
