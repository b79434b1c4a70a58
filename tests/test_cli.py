"""The real `gpu-tune` process: exit codes, JSON shape, tables, locking, and a SIGKILLed apply."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, jdoc, run_cli, snapshot_tree

GOLDEN = REPO / "tests" / "golden"
BASE = ("--gpu-backend", "none")


def _one_clean_line(proc):
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert lines[0].startswith("gpu-tune: error: ")
    return lines[0]


def test_audit_json_matches_contract_and_golden(make_host):
    root = make_host("two-socket-224")
    p = run_cli("audit", "--root", str(root), *BASE, "--profile", "training", "-o", "json")
    assert p.returncode == 1, p.stderr
    doc = jdoc(p)
    assert set(doc) == {"profile", "compliant", "settings"}
    assert doc["profile"] == "training" and doc["compliant"] is False
    for s in doc["settings"]:
        assert set(s) == {"id", "target", "current", "desired", "status", "detail"}
        assert s["status"] in {"ok", "drift", "unsupported", "conflict", "error"}
    ids = {s["id"] for s in doc["settings"]}
    assert {"sysctl.vm.swappiness", "thp.enabled", "thp.defrag", "cpu.governor"} <= ids
    golden = GOLDEN / "audit-training-two-socket-224.json"
    if os.environ.get("GPU_TUNE_REGEN_GOLDEN") == "1" or not golden.exists():
        golden.write_text(json.dumps(doc, indent=2) + "\n")
    assert doc == json.loads(golden.read_text())


def test_apply_revert_roundtrip_through_the_cli(make_host):
    root = make_host("two-socket-224")
    before = snapshot_tree(root)
    dry = run_cli("apply", "--dry-run", "--root", str(root), *BASE, "-o", "json")
    assert dry.returncode == 0 and snapshot_tree(root) == before
    assert any(s["status"] == "drift" and s["changed"] is False for s in jdoc(dry)["settings"])
    p = run_cli("apply", "--root", str(root), *BASE, "-o", "json")
    doc = jdoc(p)
    assert p.returncode == 0, [s for s in doc["settings"] if s["status"] not in ("ok", "unsupported")]
    assert doc["compliant"] is True and all("changed" in s for s in doc["settings"])
    assert run_cli("audit", "--root", str(root), *BASE).returncode == 0
    r = run_cli("revert", "--root", str(root), *BASE, "-o", "json")
    assert r.returncode == 0, r.stderr
    assert jdoc(r)["restored"] is True
    assert snapshot_tree(root) == before
    assert run_cli("audit", "--root", str(root), *BASE).returncode == 1


def test_table_groups_rows_and_globals_go_anywhere(make_host):
    root = make_host("two-socket-224")
    p = run_cli("--root", str(root), "--gpu-backend", "none", "audit", "--profile", "inference")
    assert p.returncode == 1
    assert "cpu0-223 (224)" in p.stdout
    assert "schedutil → performance" in p.stdout
    assert "not compliant" in p.stdout
    p2 = run_cli("audit", env={"GPU_TUNE_ROOT": str(root), "GPU_TUNE_GPU_BACKEND": "none", "GPU_TUNE_PROFILE": "inference"})
    assert p2.returncode == 1 and "cpu0-223 (224)" in p2.stdout


@pytest.mark.parametrize("args,needle", [
    (("audit", "--profile", "nope"), "unknown profile 'nope'"),
    (("audit", "--profile", "../etc/passwd"), "no '/' or '..'"),
    (("apply", "--profile", "a/b"), "no '/' or '..'"),
    (("audit", "--gpu-backend", "quantum"), "--gpu-backend"),
    (("audit", "--frobnicate"), "No such option"),
    (("audit", "--gpu-backend", "fixture"), "--gpu-fixture"),
    (("audit", "--gpu-backend", "fixture", "--gpu-fixture", "/nonexistent.json"), "/nonexistent.json"),
])
def test_bad_input_exit_2_one_line_nothing_changed(make_host, args, needle):
    root = make_host("small-2cpu")
    before = snapshot_tree(root)
    p = run_cli(*args, "--root", str(root))
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert needle in _one_clean_line(p)
    assert p.stdout == ""
    assert snapshot_tree(root) == before


def test_missing_root_and_bad_policy_dir(tmp_path, make_host):
    p = run_cli("audit", "--root", str(tmp_path / "nope"), *BASE)
    assert p.returncode == 2 and "no such directory" in _one_clean_line(p)
    root = make_host("small-2cpu")
    before = snapshot_tree(root)
    pol = tmp_path / "pol"
    pol.mkdir()
    (pol / "training.yaml").write_text("name: training\nsysctl:\n  vm.swappiness: 300\n")
    p = run_cli("apply", "--root", str(root), *BASE, "--policy-dir", str(pol))
    assert p.returncode == 2
    assert "training.yaml: sysctl: vm.swappiness: 300 is out of range 0..200" in _one_clean_line(p)
    (pol / "training.yaml").write_text("name: training\nthp: {enabled: sometimes}\n")
    p = run_cli("apply", "--root", str(root), *BASE, "--policy-dir", str(pol))
    assert p.returncode == 2 and "'sometimes' is not allowed" in _one_clean_line(p)
    (pol / "training.yaml").write_text("name: training\nthp: {enabled: [\n")
    p = run_cli("apply", "--root", str(root), *BASE, "--policy-dir", str(pol))
    assert p.returncode == 2 and "malformed YAML" in _one_clean_line(p)
    assert snapshot_tree(root) == before


def test_second_apply_waits_for_the_lock_then_fails_clearly(make_host):
    root = make_host("small-2cpu")
    lock = root / "var/lib/gpu-tune/lock"
    lock.parent.mkdir(parents=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    os.write(fd, str(os.getpid()).encode())
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        t0 = time.monotonic()
        p = run_cli("apply", "--root", str(root), *BASE, env={"GPU_TUNE_LOCK_TIMEOUT": "1"})
        waited = time.monotonic() - t0
    finally:
        os.close(fd)
    assert p.returncode == 1
    assert f"another gpu-tune apply or revert is running (pid {os.getpid()})" in p.stderr
    assert waited >= 1.0
    assert (root / "proc/sys/vm/swappiness").read_text() == "60\n"


def test_sigkill_in_the_middle_of_apply_loses_no_original(make_host):
    root = make_host("two-socket-224")
    before = snapshot_tree(root)
    env = {**os.environ, "PYTHONPATH": str(REPO), "GPU_TUNE_FAILPOINT_WRITE_DELAY": "0.02"}
    proc = subprocess.Popen([sys.executable, "-m", "gpu_tune", "apply", "--root", str(root), *BASE],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    govs = [root / f"sys/devices/system/cpu/cpu{i}/cpufreq/scaling_governor" for i in range(224)]
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if govs[5].read_text() == "performance":
                break
            time.sleep(0.01)
        else:
            pytest.fail("apply never started writing: " + (proc.stderr.read().decode() if proc.poll() is not None else ""))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    changed = sum(1 for g in govs if g.read_text() == "performance")
    assert 0 < changed < 224, "the kill must land in the middle of the writes"
    assert (root / "proc/sys/vm/swappiness").read_text() == "0"  # sysctls come first
    r = run_cli("revert", "--root", str(root), *BASE)
    assert r.returncode == 0, r.stdout + r.stderr
    assert snapshot_tree(root) == before


def test_profiles_command(tmp_path):
    p = run_cli("profiles", "-o", "json")
    assert p.returncode == 0
    names = [x["name"] for x in jdoc(p)["profiles"]]
    assert names == ["inference", "training"]
    t = run_cli("profiles")
    assert "training" in t.stdout and "inference" in t.stdout


def test_audit_imports_stay_light(make_host):
    root = make_host("small-2cpu")
    code = ("import sys; from gpu_tune.cli import main\n"
            "try:\n    main(['audit', '--root', %r, '--gpu-backend', 'none', '-o', 'json'])\n"
            "except SystemExit: pass\n"
            "heavy = [m for m in ('kubernetes', 'fastapi', 'tensorflow', 'uvicorn', 'prometheus_client') if m in sys.modules]\n"
            "sys.stderr.write('HEAVY=' + ','.join(heavy))\n") % str(root)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "HEAVY=" in p.stderr
    assert p.stderr.split("HEAVY=")[1].strip() == ""


def test_eight_gpu_node_table_groups_irqs_per_device(tmp_path, tmp_path_factory):
    from tests.fixtures import pcigen

    root = pcigen.build_shared("dgx-8gpu", tmp_path_factory)
    fixture = tmp_path / "gpu.json"
    fixture.write_text((REPO / "tests/fixtures/gpu/dgx-8gpu.json").read_text())
    p = run_cli("audit", "--root", str(root), "--gpu-fixture", str(fixture), env={"COLUMNS": "220"})
    assert p.returncode == 1, p.stderr
    out = p.stdout
    assert "0000:ab:00.0" in out  # rendered literally: no emoji or markup substitution
    assert "cpu0-223 (224)" in out
    assert "(118)" in out and "NIC mlx5_7" in out  # ~1,000 IRQs read as one row per device
    assert len(out.splitlines()) < 80


def test_every_knob_round_trips_through_apply_and_revert(make_host, gpu_fixture):
    """GPU persistence, IRQ affinity and the allocator file too: revert restores all of them."""
    root = make_host("link-degraded")
    gpus = gpu_fixture("link-degraded")
    before, gpus_before = snapshot_tree(root), gpus.read_text()
    p = run_cli("apply", "--root", str(root), "--gpu-fixture", str(gpus), "-o", "json")
    assert p.returncode == 0, p.stdout + p.stderr
    ids = {s["id"] for s in jdoc(p)["settings"] if s["changed"]}
    assert {"gpu.persistence_mode", "irq.affinity", "allocator.preload", "thp.enabled", "cpu.governor",
            "cpu.cstates"} <= ids
    assert (root / "etc/gpu-tune/allocator.env").exists()
    r = run_cli("revert", "--root", str(root), "--gpu-fixture", str(gpus), "-o", "json")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {(s["id"], s["target"]): s for s in jdoc(r)["settings"]}
    assert rows[("gpu.persistence_mode", "0")]["current"] == "on" and rows[("gpu.persistence_mode", "0")]["desired"] == "off"
    alloc = rows[("allocator.preload", "host")]
    assert alloc["current"].startswith("LD_PRELOAD=") and alloc["desired"] == "absent"
    assert snapshot_tree(root) == before
    assert json.loads(gpus.read_text()) == json.loads(gpus_before)


def test_command_options_keep_their_env_vars_and_limits(make_host):
    root = make_host("small-2cpu")
    p = run_cli("audit", "--root", str(root), *BASE, "-o", "json", env={"GPU_TUNE_PROFILE": "inference"})
    assert jdoc(p)["profile"] == "inference"
    p = run_cli("audit", "--root", str(root), *BASE, env={"GPU_TUNE_PROFILE": "bogus"})
    assert p.returncode == 2 and "unknown profile 'bogus'" in _one_clean_line(p)
    for args in (("serve", "--port", "0"), ("serve", "--interval", "0.01"), ("probe", "--timeout", "0")):
        p = run_cli(*args, "--root", str(root), *BASE)
        assert p.returncode == 2, (args, p.stderr)
        _one_clean_line(p)
    p = run_cli("probe", "--device", "CPU", "--data", "/nonexistent", "--root", str(root), *BASE)
    assert p.returncode == 2 and "--data /nonexistent: no such file" in _one_clean_line(p)
    assert not (root / "var/lib/gpu-tune").exists()


def test_a_root_that_is_not_a_host_is_bad_input(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for cmd in ("audit", "apply", "topology"):
        p = run_cli(cmd, "--root", str(empty), *BASE)
        assert p.returncode == 2 and "not a host root" in _one_clean_line(p)
    afile = tmp_path / "f"
    afile.write_text("x")
    p = run_cli("audit", "--root", str(afile), *BASE)
    assert p.returncode == 2 and "not a directory" in _one_clean_line(p)
    assert list(empty.iterdir()) == []


def test_bad_journal_entries_are_bad_input_not_crashes(make_host):
    """A journal this tool did not write: exit 2 naming the file and the entry, nothing written."""
    root = make_host("small-2cpu")
    j = root / "var/lib/gpu-tune/journal.json"
    j.parent.mkdir(parents=True)
    for bad in ('{"entries": [{"foo": 1}]}', '{"entries": [1, 2]}'):
        j.write_text(bad)
        for cmd in ("revert", "apply"):
            p = run_cli(cmd, "--root", str(root), *BASE)
            line = _one_clean_line(p)
            assert p.returncode == 2 and "unreadable journal" in line and "entry 0" in line
        assert j.read_text() == bad and (root / "proc/sys/vm/swappiness").read_text() == "60\n"
        assert sorted(x.name for x in j.parent.iterdir()) == ["journal.json"]  # not even the lock


def test_revert_with_nothing_recorded_writes_nothing(make_host):
    root = make_host("small-2cpu")
    p = run_cli("revert", "--root", str(root), *BASE)
    assert p.returncode == 0 and "nothing to revert" in p.stdout
    assert not (root / "var").exists()


def test_policy_dir_oddities(tmp_path):
    pd = tmp_path / "pd"
    pd.mkdir()
    (pd / "ok.yaml").write_text("name: ok\nsummary: fine\n")
    (pd / "a.yaml").symlink_to(pd / "b.yaml")
    (pd / "b.yaml").symlink_to(pd / "a.yaml")
    (pd / "dir.yaml").mkdir()
    p = run_cli("profiles", "--policy-dir", str(pd), "-o", "json")
    assert p.returncode == 0 and [x["name"] for x in jdoc(p)["profiles"]] == ["ok"]
    p = run_cli("profiles", "--policy-dir", str(tmp_path / "nope"))
    assert p.returncode == 2 and "no such directory" in _one_clean_line(p)


def test_label_without_a_cluster_says_nothing_was_published(make_host, gpu_fixture):
    root = make_host("link-degraded")
    gpus = gpu_fixture("link-degraded")
    d = run_cli("label", "--root", str(root), "--gpu-fixture", str(gpus), "--node", "n1", "--dry-run", "-o", "json",
                env={"KUBECONFIG": ""})
    assert d.returncode == 0
    labels = jdoc(d)["want"]["labels"]
    assert labels["gpu-tune.io/cuda-driver"] == "12.8" and labels["gpu-tune.io/gpu-driver"] == "570.124.06"
    p = run_cli("label", "--root", str(root), "--gpu-fixture", str(gpus), "--node", "n1", env={"KUBECONFIG": ""})
    assert p.returncode == 1 and "nothing published" in _one_clean_line(p)
