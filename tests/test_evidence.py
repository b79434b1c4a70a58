"""Evidence kept at the moment a hardware fault is first seen (docs/health.md "Evidence"), through
``gpu-tune check`` on the 8-GPU fixture host and through the agent's own pass: one bounded bundle
per fault (across passes and an agent restart), what it holds, the bounds by count and bytes, a
folder that is full, read-only or a symlink (a note, the verdict unchanged), ``gpu-tune evidence``,
and ``nvidia-bug-report.sh`` (a stand-in first on PATH) that is slow, huge or never exits: the
pass never waits for it, its output is capped, and nothing it started is left running."""

from __future__ import annotations

import json
import os

import pytest

from gpu_tune.judge.checks import state_file
from tests import skips
from tests.evidence_kit import (FOLDER, add_kmsg, alive, bundle_bytes, bundles, check, standin, standin_pids, status,
                                this_machine, wait_done, xid)
from tests.healthkit import HEALTH_ONLY, dgx_tree, gpu_json, host, policies  # noqa: F401 (fixtures)

MIN = 60_000_000


def test_a_fatal_xid_keeps_one_bundle_named_by_check_and_written_once(cli, host, policies):
    rc0, before, _ = check(host, policies)
    assert rc0 == 0 and "evidence" not in before and not (host / FOLDER).exists()  # a healthy node keeps none
    add_kmsg(host, "6,50,88000000,-;nvidia 0000:5d:00.0: a record of that GPU a while before\n"
             + xid(90, 88_310_022) + "6,91,95000000,-;mlx5_core 0000:17:00.0: a record after it\n")
    rc, doc, err = check(host, policies)
    assert rc == 1 and doc["reason"] == "FatalXid"
    ev = doc["evidence"]
    [b] = ev["bundles"]
    assert b["new"] and b["findings"] == ["xid/0000:5d:00/79"] and b["path"] == f"/{FOLDER}/{b['name']}"
    assert b["name"].endswith("Z-xid-0000-5d-00-79") and ev["notes"] == []
    assert "not the machine this runs on" in ev["bug_report"]  # a fixture root is not this machine
    d = host / FOLDER / b["name"]
    assert sorted(p.name for p in d.iterdir()) == ["kernel-log.txt", "manifest.json", "nvidia-bug-report.json",
                                                    "nvml.json", "pci.json", "verdict.json"]
    verdict = json.loads((d / "verdict.json").read_text())
    assert (verdict["ready"], verdict["reason"], verdict["message"]) == (False, "FatalXid", doc["message"])
    nvml = json.loads((d / "nvml.json").read_text())
    assert [g["index"] for g in nvml["gpus"]] == [3] and nvml["gpus"][0]["pci_bus_id"] == "0000:5d:00.0"
    pci = json.loads((d / "pci.json").read_text())["devices"]
    assert list(pci) == ["0000:5d:00.0"] and pci["0000:5d:00.0"]["current_link_width"] == "16"
    assert pci["0000:5d:00.0"]["aer_dev_fatal"].endswith("TOTAL_ERR_FATAL 0")
    log = (d / "kernel-log.txt").read_text()
    assert "[    88.310022] <3>NVRM: Xid (PCI:0000:5d:00): 79" in log and "a record of that GPU a while before" in log
    assert "a record after it" in log
    man = json.loads((d / "manifest.json").read_text())
    assert man["findings"][0]["gpu"] == 3 and not man["cut"] and man["boot_id"] == doc.get("boot_id", man["boot_id"])
    marks = json.loads((host / "var/lib/gpu-tune/health.json").read_text())["evidence"]
    assert marks["xid/0000:5d:00/79"]["bundle"] == b["name"]

    rc, again, _ = check(host, policies)  # the same finding, the next pass: nothing new
    assert rc == 1 and again["evidence"]["bundles"] == [{**b, "new": False}] and bundles(host) == [b["name"]]
    r = cli("check", "--root", str(host), "--gpu-fixture", str(gpu_json(host.parent)), "--policy-dir", str(policies),
            "--profile", "health")
    assert r.returncode == 1 and f"evidence: /{FOLDER}/{b['name']}" in r.stdout, r.stdout


FINDINGS = [  # (id, GPU JSON edit, the key its evidence is kept under)
    ("lost", lambda d: d["gpus"][3].update(lost=True), "gpu.present/0000:5d:00"),
    ("missing", lambda d: d["gpus"].pop(5), "gpu.count"),
    ("reset", lambda d: d["gpus"][2].update(reset_required=True), "gpu.recovery/0000:3a:00"),
    ("remap", lambda d: d["gpus"][1].update(remapped_rows={"correctable": 0, "uncorrectable": 1, "pending": True,
                                                           "failure": False}), "gpu.memory/0000:2a:00"),
    ("nvlink", lambda d: [lk.update(active=False) for lk in d["gpus"][7]["nvlink"][:2]], "gpu.nvlink/0000:db:00"),
    ("fabric", lambda d: d["gpus"][5].update(fabric={"state": "in_progress", "status": "success"}),
     "gpu.fabric/0000:ab:00"),
    ("pcie", lambda d: d["gpus"][6].update(pcie_link_width_current=8), "gpu.pcie/0000:ba:00"),
    ("hot", lambda d: d["gpus"][3].update(temperature_c=95), "gpu.thermal/0000:5d:00"),
]


@pytest.mark.parametrize("case", FINDINGS, ids=[f[0] for f in FINDINGS])
def test_each_hardware_finding_keeps_evidence_under_its_key(host, tmp_path, policies, case):
    _, edit, key = case
    if case[0] == "pcie":
        (host / "sys/devices/pci0000:b0/0000:b0:01.0/0000:ba:00.0/current_link_width").write_text("8\n")
    rc, doc, _ = check(host, policies, fixture=gpu_json(tmp_path, edit))
    assert rc == 1, doc["message"]
    [b] = doc["evidence"]["bundles"]
    assert b["findings"] == [key] and b["new"]
    nvml = json.loads((host / FOLDER / b["name"] / "nvml.json").read_text())["gpus"]
    assert len(nvml) == (7 if case[0] == "missing" else 1)  # a finding about the node: every GPU's readings
    if case[0] == "missing":  # the GPU NVML lost is on the bus: its files are there
        assert "0000:ab:00.0" in json.loads((host / FOLDER / b["name"] / "pci.json").read_text())["devices"]


def test_a_network_fault_or_a_warning_keeps_none(host, tmp_path, policies):
    ib = "sys/devices/pci0000:20/0000:20:01.0/0000:29:00.0/infiniband/mlx5_1/ports/1/state"
    (host / ib).write_text("1: DOWN\n")
    rc, doc, _ = check(host, policies, fixture=gpu_json(tmp_path, lambda d: d["gpus"][0].update(inforom_valid=False)))
    assert rc == 1 and doc["reason"] == "InfinibandPortDown" and "evidence" not in doc
    assert not (host / FOLDER).exists()


def test_the_bounds_by_count_and_by_bytes_remove_the_oldest(host, policies):
    usec = 88_000_000
    names = []
    for i, bus in enumerate(("18", "2a", "3a")):  # a new fault each pass: a bundle each
        add_kmsg(host, xid(90 + i, usec + i * MIN, bus))
        _, doc, _ = check(host, policies, env={"GPU_TUNE_EVIDENCE_KEEP": "2"})
        names.append(next(b["name"] for b in doc["evidence"]["bundles"] if b["new"]))
    assert bundles(host) == names[1:]  # the newest two

    env = {"GPU_TUNE_EVIDENCE_BUNDLE_BYTES": "64Ki", "GPU_TUNE_EVIDENCE_MAX_BYTES": "64Ki"}
    for i, bus in enumerate(("5d", "9a", "ab", "ba", "db")):  # each bundle ~25 KB: that GPU's records
        t = usec + (10 + i) * MIN
        add_kmsg(host, "".join(f"6,{1000 * i + k},{t - 1000 + k},-;nvidia 0000:{bus}:00.0: {'y' * 100}\n"
                               for k in range(150)) + xid(100 + i, t, bus))
        _, doc, _ = check(host, policies, env=env)
        names.append(next(b["name"] for b in doc["evidence"]["bundles"] if b["new"]))
    kept = bundles(host)
    assert sum(bundle_bytes(host, n) for n in kept) <= 64 << 10
    assert kept == names[len(names) - len(kept):] and len(kept) < 4  # the newest, as many as fit
    # the findings whose bundles went are still marked: not written again
    _, doc, _ = check(host, policies, env=env)
    assert not any(b["new"] for b in doc["evidence"]["bundles"]) and bundles(host) == kept


def test_a_bundle_over_its_cap_is_cut_and_says_so(host, policies):
    records = "".join(f"6,{1000 + i},{88_000_000 + i * 1000},-;nvidia 0000:5d:00.0: chatter {i} " + "x" * 80 + "\n"
                      for i in range(5000))  # 500 KB of the GPU's records around the fault
    add_kmsg(host, records + xid(9000, 93_100_000))
    _, doc, _ = check(host, policies, env={"GPU_TUNE_EVIDENCE_BUNDLE_BYTES": "64Ki"})
    [b] = doc["evidence"]["bundles"]
    d = host / FOLDER / b["name"]
    assert bundle_bytes(host, b["name"]) <= 64 << 10
    man = json.loads((d / "manifest.json").read_text())
    meta = man["files"]["kernel-log.txt"]
    assert man["cut"] and meta["cut"] and meta["of"] > 500_000 and meta["bytes"] < 64 << 10
    log = (d / "kernel-log.txt").read_text()
    assert log.startswith("# cut: the newest ") and "NVRM: Xid (PCI:0000:5d:00): 79" in log  # the newest kept


@pytest.mark.parametrize("how", ["full", "read-only"])
def test_a_full_or_read_only_evidence_folder_is_a_note_and_the_verdict_is_unchanged(host, policies, how):
    if os.geteuid() != 0:
        skips.condition("not-root", "a mount namespace with a small or read-only tmpfs needs root")
    add_kmsg(host, xid(90, 88_310_022))
    folder = host / FOLDER
    folder.mkdir(parents=True)
    opts = "size=16k" if how == "full" else "ro"
    wrap = ("unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
            f'mount -t tmpfs -o {opts} tmpfs "$0" && exec "$@"', str(folder))
    rc, doc, err = check(host, policies, wrap=wrap)
    assert rc == 1 and doc["reason"] == "FatalXid" and doc["evidence"]["bundles"] == []
    [note] = doc["evidence"]["notes"]
    words = "ENOSPC" if how == "full" else "EROFS"
    assert note.startswith("evidence of xid/0000:5d:00/79: not written: /var/lib/gpu-tune/evidence: ") and words in note
    assert err == ""  # said in the output (-o json: here; table: the evidence line), not logged besides
    state = json.loads((host / "var/lib/gpu-tune/health.json").read_text())
    assert "xid/0000:5d:00/79" in state["records"] and "evidence" not in state  # the health state kept, no mark
    assert bundles(host) == []  # and nothing left where the namespace had its folder
    rc, doc, _ = check(host, policies)  # room again: the next pass keeps it
    assert rc == 1 and doc["evidence"]["bundles"][0]["new"] and len(bundles(host)) == 1


def test_a_symlink_in_the_folders_place_is_refused(cli, host, tmp_path, policies):
    add_kmsg(host, xid(90, 88_310_022))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (host / "var/lib/gpu-tune").mkdir(parents=True)
    (host / FOLDER).symlink_to(elsewhere)
    rc, doc, _ = check(host, policies)
    assert rc == 1 and doc["reason"] == "FatalXid" and doc["evidence"]["bundles"] == []
    assert f"refused: it is a symlink (-> {elsewhere})" in doc["evidence"]["notes"][0]
    assert list(elsewhere.iterdir()) == []
    r = cli("evidence", "--root", str(host))
    assert r.returncode == 1 and "refused: it is a symlink" in r.stdout, r.stdout


def test_gpu_tune_evidence_lists_and_shows(cli, host, policies):
    add_kmsg(host, xid(90, 88_310_022))
    _, doc, _ = check(host, policies)
    name = doc["evidence"]["bundles"][0]["name"]
    r = cli("evidence", "--root", str(host), "-o", "json")
    assert r.returncode == 0, r.stderr
    listing = json.loads(r.stdout)
    [row] = listing["bundles"]
    assert (row["name"], row["findings"], row["bytes"]) == (name, ["xid/0000:5d:00/79"], bundle_bytes(host, name))
    assert row["bug_report"].startswith("not run: --root ") and listing["bounds"]["keep"] == 16
    r = cli("evidence", "--root", str(host))
    assert r.returncode == 0 and name in r.stdout and "1 bundle(s)" in r.stdout
    r = cli("evidence", "show", name, "--root", str(host), "-o", "json")
    shown = json.loads(r.stdout)
    assert r.returncode == 0 and shown["verdict"]["reason"] == "FatalXid" and "Xid (PCI:0000:5d:00): 79" in \
        shown["kernel_log"] and [f["file"] for f in shown["files"]][0] == "kernel-log.txt"
    r = cli("evidence", "show", name, "--root", str(host))
    assert r.returncode == 0 and "finding xid/0000:5d:00/79" in r.stdout and "kernel log (kernel-log.txt):" in r.stdout
    for args, words in ((("show", "20990101T000000.000Z-nothing"), "no bundle 20990101T000000.000Z-nothing in"),
                        (("show", "../../etc"), "not an evidence bundle's name"), (("show",), "give the bundle's NAME"),
                        (("remove",), "expected list or show NAME")):
        r = cli("evidence", *args, "--root", str(host))
        assert r.returncode == 2 and words in r.stderr and not r.stdout, (args, r.stderr)
    r = cli("check", "--root", str(host), "--policy-dir", str(policies), env={"GPU_TUNE_EVIDENCE_KEEP": "lots"})
    assert r.returncode == 2 and "GPU_TUNE_EVIDENCE_KEEP='lots'" in r.stderr


def test_set_healthy_makes_that_gpus_next_fault_a_new_one(cli, host, policies):
    add_kmsg(host, xid(90, 88_310_022))
    _, doc, _ = check(host, policies)
    first = doc["evidence"]["bundles"][0]["name"]
    r = cli("set-healthy", "--root", str(host), "--gpu-fixture", str(gpu_json(host.parent)), "--gpu", "3")
    assert r.returncode == 0, r.stderr
    add_kmsg(host, xid(91, 86_500_000_000))  # after the clear (uptime 86,400 s)
    _, doc, _ = check(host, policies)
    [b] = doc["evidence"]["bundles"]
    assert b["new"] and b["name"] != first and bundles(host) == [first, b["name"]]


def test_the_state_file_keeps_marks_strictly_and_an_empty_one_as_before():
    doc = state_file.empty("6c1f2b1e-8a9d-4c8e-9d7e-2f1f3b6a9c11")
    assert "evidence" not in json.loads(state_file.dump({**doc, "evidence": {}}))  # as an earlier version wrote it
    doc["evidence"] = {"gpu.memory/0000:29:00": {"bundle": "20261207T101502.318Z-gpu.memory-0000-29-00", "at": 1.0}}
    assert state_file.parse(state_file.dump(doc).decode())["evidence"] == doc["evidence"]
    doc["evidence"] = {"gpu.memory/0000:29:00": {"bundle": "../../etc", "at": 1.0}}
    with pytest.raises(ValueError, match="evidence"):
        state_file.parse(state_file.dump(doc).decode())


# -- nvidia-bug-report.sh, out of the pass ---------------------------------------------------------
def test_a_slow_bug_report_never_delays_the_pass_and_its_report_comes_later(host, tmp_path, policies):
    this_machine(host)
    add_kmsg(host, xid(90, 88_310_022))
    go = tmp_path / "go"
    rc, doc, _ = check(host, policies, env=standin(tmp_path, "slow", STANDIN_GO=str(go)))
    # check has returned while the stand-in still waits for a file only this test writes: not waited for
    name = doc["evidence"]["bundles"][0]["name"]
    assert rc == 1 and doc["evidence"]["bug_report"].startswith("running in the background (worker pid ")
    assert status(host, name)["state"] in ("starting", "running")
    assert not (host / FOLDER / name / "nvidia-bug-report.log.gz").exists()
    go.touch()
    st = wait_done(host, name)
    assert st["state"] == "finished" and st["exit"] == "exit 0" and st["left"] == 0
    assert st["files"] == [{"file": "nvidia-bug-report.log.gz", "bytes": st["files"][0]["bytes"], "cut": False}]
    out = (host / FOLDER / name / "nvidia-bug-report.out").read_text()
    assert "stand-in, mode slow" in out and out.rstrip().endswith("done")
    assert not any(alive(p) for p in standin_pids(tmp_path))


def test_a_huge_bug_report_is_capped_with_its_figures(host, tmp_path, policies):
    this_machine(host)
    add_kmsg(host, xid(90, 88_310_022))
    env = {**standin(tmp_path, "huge", STANDIN_MIB="64"), "GPU_TUNE_EVIDENCE_BUNDLE_BYTES": "1Mi"}
    _, doc, _ = check(host, policies, env=env)
    name = doc["evidence"]["bundles"][0]["name"]
    st = wait_done(host, name)
    assert st["state"] == "cut at the size cap" and st["left"] == 0, st
    assert st["output"]["produced"] > 64 << 20 and st["output"]["cut"] and st["output"]["kept"] < 1 << 20
    [f] = st["files"]
    assert f["cut"] and f["bytes"] == st["cap_bytes"]
    assert bundle_bytes(host, name) <= 1 << 20  # the whole bundle within its cap, the report included
    assert not any(alive(p) for p in standin_pids(tmp_path))


def test_a_bug_report_that_never_exits_is_killed_at_the_deadline_with_everything_it_started(host, tmp_path, policies):
    this_machine(host)
    add_kmsg(host, xid(90, 88_310_022))
    env = {**standin(tmp_path, "hang"), "GPU_TUNE_EVIDENCE_BUG_REPORT_TIMEOUT": "1"}
    _, doc, _ = check(host, policies, env=env)
    name = doc["evidence"]["bundles"][0]["name"]
    st = wait_done(host, name)
    assert (st["state"], st["exit"], st["left"]) == ("cut at the deadline", "killed at the deadline", 0), st
    pids = standin_pids(tmp_path)
    assert len(pids) == 3  # the script, its child, and a child that left its process group (setsid)
    assert [p for p in pids if alive(p)] == [], "left running after the deadline"


def test_gpu_tune_evidence_says_what_a_bundle_it_did_not_write_holds_and_never_crashes(cli, host, tmp_path):
    folder = host / FOLDER
    bad = folder / "20261207T101502.318Z-gpu.memory-0000-2a-00"
    bad.mkdir(parents=True)
    (bad / "manifest.json").write_text("[" * 50_000)  # nested past what a reader recurses
    (bad / "nvidia-bug-report.json").write_text('{"state": "finished", "files": [{"bytes": "lots"}]}')
    (bad / "verdict.json").write_text('["not", "a", "verdict"]')
    (bad / "kernel-log.txt").symlink_to("/etc/shadow")
    (folder / "20261207T101503.000Z-gpu.count").symlink_to(tmp_path)  # a link named like a bundle: not one
    r = cli("evidence", "--root", str(host), "-o", "json")
    assert r.returncode == 0, r.stderr
    [row] = json.loads(r.stdout)["bundles"]
    assert row["name"] == bad.name and row["findings"] == [] and "not JSON" in row["notes"][0]
    assert row["bug_report"] == "its status file is not in the form gpu-tune writes"
    r = cli("evidence", "show", bad.name, "--root", str(host))
    assert r.returncode == 1 and "not JSON" in r.stdout and "kernel-log.txt: not read: it is a symlink" in r.stdout, r.stdout
    assert "root:" not in r.stdout  # the link was never followed
    r = cli("evidence", "show", "20261207T101503.000Z-gpu.count", "--root", str(host))
    assert r.returncode == 2 and "no bundle 20261207T101503.000Z-gpu.count" in r.stderr
