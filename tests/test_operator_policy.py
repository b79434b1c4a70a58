"""The operator's policy (docs/health.md "Your policy"), through `gpu-tune check` on the 8-GPU fixture:
per-check severity (``readiness.checks``) and per-XID weight (``readiness.xid``, repeat rules on the
kernel log's own times), each override turning a passing node into a failing one and back; the
repeat rule at K-1 and K bursts and at its window's edge; the count held across runs through
health.json; the shipped default rule; every refusal at load with its one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.healthkit import XID79, dgx_tree, gpu_json, host, profiles_folder  # noqa: F401 (fixtures)

GPU = {0: "0000:18:00", 1: "0000:2a:00", 2: "0000:3a:00", 3: "0000:5d:00", 4: "0000:9a:00", 5: "0000:ab:00",
       6: "0000:ba:00", 7: "0000:db:00"}
IB0 = "sys/devices/pci0000:20/0000:20:01.0/0000:29:00.0/infiniband/mlx5_1/ports/1"
MIN = 60_000_000  # a minute, in the kernel log's microseconds


def xid_line(seq: int, usec: int, gpu: int, code: int) -> str:
    return f"4,{seq},{usec},-;NVRM: Xid (PCI:{GPU[gpu]}): {code}, pid=4242, name=python3, fault {seq}\n"


def append(root: Path, lines) -> None:
    with open(root / "dev/kmsg", "a") as f:
        f.write("".join(lines))


def profile_dir(tmp_path: Path, body: str, name: str = "p") -> Path:
    return profiles_folder(tmp_path / name, **{name: body})


def check(cli, root, fixture, policies, profile="p", *extra):
    r = cli("check", "--root", str(root), "--gpu-fixture", str(fixture), "--policy-dir", str(policies),
            "--profile", profile, "-o", "json", *extra)
    assert r.returncode in (0, 1), r.stderr
    doc = json.loads(r.stdout)
    return r.returncode, doc, {c["name"]: c for c in doc["checks"]}


# -- readiness.checks: a passing node made to fail, a failing one made to pass -------------------------
def test_a_warning_made_fatal_fails_a_passing_node_and_says_whose_decision_it_was(cli, host, tmp_path):
    f = gpu_json(tmp_path, lambda d: d["gpus"][2].update(inforom_valid=False))
    rc, doc, c = check(cli, host, f, profile_dir(tmp_path, ""))
    assert rc == 0 and doc["ready"] and c["gpu.inforom"]["severity"] == "warning" and not c["gpu.inforom"]["ok"]
    assert c["gpu.inforom"]["severity_from"] == "catalog"

    rc, doc, c = check(cli, host, f, profile_dir(tmp_path, "  checks:\n    gpu.inforom: fatal\n"))
    assert rc == 1 and doc["reason"] == "InforomInvalid", doc["message"]
    assert c["gpu.inforom"]["severity"] == "fatal"
    assert c["gpu.inforom"]["severity_from"] == "profile p: readiness.checks.gpu.inforom"
    assert doc["message"].startswith("gpu.inforom: [readiness.checks.gpu.inforom] "), doc["message"]
    assert re.fullmatch(r"sha256:[0-9a-f]{16}", doc["profile_digest"]) and doc["off"] == []


def test_a_check_turned_off_passes_a_failing_node_and_is_said_once(cli, host, tmp_path):
    (host / IB0 / "state").write_text("1: DOWN\n")
    f = gpu_json(tmp_path)
    rc, doc, c = check(cli, host, f, profile_dir(tmp_path, ""))
    assert rc == 1 and doc["reason"] == "InfinibandPortDown", doc["message"]

    # silence InfiniBand on nodes without it, from a file the fleet's profiles include
    folder = profile_dir(tmp_path, "", "no-ib")
    (folder / "_no_ib.yaml").write_text("readiness:\n  checks:\n    network.infiniband: off\n")
    (folder / "no-ib.yaml").write_text("include: [training.yaml, _no_ib.yaml]\nreadiness:\n  require_compliant: false\n"
                                       "  checks:\n    gpu.inforom: warning\n")
    rc, doc, c = check(cli, host, f, folder, "no-ib")
    assert rc == 0 and doc["ready"], doc["message"]
    assert "network.infiniband" not in c  # not evaluated
    assert doc["off"] == [{"name": "network.infiniband",
                           "severity_from": "profile no-ib: readiness.checks.network.infiniband (in _no_ib.yaml)"}]
    assert doc["message"].endswith("checks passed; off by profile no-ib: network.infiniband"), doc["message"]
    assert c["gpu.inforom"]["severity_from"] == "profile no-ib: readiness.checks.gpu.inforom"
    table = cli("check", "--root", str(host), "--gpu-fixture", str(f), "--policy-dir", str(folder), "--profile",
                "no-ib")
    assert table.returncode == 0
    text = " ".join(table.stdout.split())
    assert text.count("network.infiniband: off by") == 1 and "│ network.infiniband │" not in table.stdout  # said once
    assert "network.infiniband: off by profile no-ib: readiness.checks.network.infiniband (in _no_ib.yaml) (not " \
           "evaluated)" in text
    assert "profile no-ib, digest sha256:" in text


def test_a_family_name_and_the_probe_pattern_weigh_every_check_they_name(cli, host, tmp_path):
    (host / IB0 / "state").write_text("1: DOWN\n")
    rc, doc, c = check(cli, host, gpu_json(tmp_path), profile_dir(
        tmp_path, "  checks:\n    network: warning\n    network.link_flaps: fatal\n    probe.*.passed: off\n"))
    assert rc == 0 and doc["ready"], doc["message"]
    assert (c["network.infiniband"]["severity"], c["network.infiniband"]["severity_from"]) == (
        "warning", "profile p: readiness.checks.network")
    assert [o["name"] for o in doc["off"]] == ["probe.*.passed"]


# -- readiness.xid: an XID made fatal, a fatal one made harmless -----------------------------------------
def test_xid_45_made_fatal_fails_the_node_and_79_ignored_passes_it(cli, host, tmp_path):
    append(host, [xid_line(100, 30 * MIN, 3, 45)])
    f = gpu_json(tmp_path)
    rc, doc, c = check(cli, host, f, profile_dir(tmp_path, ""))
    assert rc == 0 and doc["ready"], doc["message"]  # the catalog ignores 45

    # "xid 45 was a very good predictor of node failure" (k8s-device-plugin #1333): gate on it
    rc, doc, c = check(cli, host, f, profile_dir(tmp_path, "  xid:\n    45: reset_gpu\n", "gate45"), "gate45")
    assert rc == 1 and doc["reason"] == "FatalXid", doc["message"]
    assert "GPU 3: XID 45 [readiness.xid.45]" in doc["message"]
    assert "drain the node and reset the GPU (by profile gate45: readiness.xid.45)" in c["gpu.xid"]["detail"]

    append(host, [XID79.format(seq=101, usec=31 * MIN)])
    rc, doc, c = check(cli, host, f, profile_dir(tmp_path, ""))
    assert rc == 1 and "XID 79" in doc["message"] and "[readiness.xid" not in doc["message"]  # the catalog's
    rc, doc, c = check(cli, host, f, profile_dir(tmp_path, "  xid:\n    79: ignore\n", "quiet"), "quiet")
    assert rc == 0 and doc["ready"], doc["message"]  # what the health.json of the run before holds is weighed anew
    assert "79 ignore" in c["gpu.xid"]["detail"]


def test_a_rule_for_an_xid_the_catalog_does_not_know_is_allowed_and_said(cli, host, tmp_path):
    append(host, [xid_line(100, 30 * MIN, 1, 999)])
    rc, doc, c = check(cli, host, gpu_json(tmp_path), profile_dir(tmp_path, "  xid:\n    999: reboot\n"))
    assert rc == 1 and "GPU 1: XID 999 [readiness.xid.999]" in doc["message"], doc["message"]
    assert "drain the node and reboot it (by profile p: readiness.xid.999)" in c["gpu.xid"]["detail"]
    assert "XID 999 not in the catalog 2025-10-29: judged by this rule alone" in c["gpu.xid"]["detail"]
    assert "gpu.xid_unknown" not in c  # the profile's, not an unknown one


# -- repeat rules: K-1 and K bursts, the window's edge, one fault's lines one burst ----------------------
RULE = "  xid:\n    31: {action: reset_gpu, count: 3, within: 1h}\n"


def test_a_repeat_rule_applies_at_k_bursts_not_k_minus_1_and_at_its_windows_edge(cli, host, tmp_path):
    lines = []
    seq = iter(range(100, 10_000))
    for i in range(2):  # GPU 2: K-1 bursts
        lines.append(xid_line(next(seq), 10 * MIN + i * 20 * MIN, 2, 31))
    for i in range(3):  # GPU 3: K bursts, 20 minutes apart
        lines.append(xid_line(next(seq), 10 * MIN + i * 20 * MIN, 3, 31))
    for i, at in enumerate((0, 30 * MIN, 60 * MIN)):  # GPU 4: the first and the last exactly the window apart
        lines.append(xid_line(next(seq), 200 * MIN + at, 4, 31))
    for at in (0, 30 * MIN, 60 * MIN + 1_000_000):  # GPU 5: one second more
        lines.append(xid_line(next(seq), 400 * MIN + at, 5, 31))
    for start in (600 * MIN, 620 * MIN):  # GPU 6: a fault printing 40 lines within a second, twice: 2 bursts
        lines += [xid_line(next(seq), start + n * 20_000, 6, 31) for n in range(40)]
    append(host, lines)
    rc, doc, c = check(cli, host, gpu_json(tmp_path), profile_dir(tmp_path, RULE))
    assert rc == 1 and doc["reason"] == "FatalXid"
    gated = {int(g) for g in re.findall(r"GPU (\d+) \(0000", c["gpu.xid"]["detail"])}
    assert gated == {3, 4}, c["gpu.xid"]["detail"]
    assert "GPU 3 (0000:5d:00.0): XID 31 GPU memory page fault (3 bursts; reset_gpu after 3 within 1h, first 600.0 s " \
           "after boot)" in c["gpu.xid"]["detail"]
    assert "drain the node and reset the GPU (by profile p: readiness.xid.31)" in c["gpu.xid"]["detail"]


def test_the_count_is_held_across_runs_through_health_json_and_a_clear_starts_it_again(cli, host, tmp_path):
    f, pol = gpu_json(tmp_path), profile_dir(tmp_path, RULE)
    base = (host / "dev/kmsg").read_text()
    append(host, [xid_line(100, 10 * MIN, 3, 31), xid_line(101, 20 * MIN, 3, 31)])
    rc, doc, _ = check(cli, host, f, pol)
    assert rc == 0, doc["message"]  # 2 of 3
    kept = json.loads((host / "var/lib/gpu-tune/health.json").read_text())["repeats"]
    assert [(b["s"], b["e"]) for b in kept["xid/0000:5d:00/31"]] == [(10 * MIN, 10 * MIN), (20 * MIN, 20 * MIN)]
    # the ring buffer overwrote those records: only the third is left to read
    (host / "dev/kmsg").write_text(base + xid_line(102, 30 * MIN, 3, 31))
    rc, doc, c = check(cli, host, f, pol)
    assert rc == 1 and "GPU 3: XID 31 [readiness.xid.31]" in doc["message"], doc["message"]
    rc, doc, _ = check(cli, host, f, pol)
    assert rc == 1  # held: a fatal action holds until a reboot or a clear
    r = cli("set-healthy", "--root", str(host), "--gpu", "3", "--gpu-fixture", str(f))
    assert r.returncode == 0, r.stderr
    rc, doc, _ = check(cli, host, f, pol)
    assert rc == 0, doc["message"]  # the clear forgot the bursts: the count starts again
    assert json.loads((host / "var/lib/gpu-tune/health.json").read_text())["repeats"] == {}


def test_a_window_across_boots_counts_the_boots_before_this_one(cli, host, tmp_path):
    f = gpu_json(tmp_path)
    pol = profile_dir(tmp_path, "  xid:\n    43: {action: inspect_hw, count: 2, within: 7d across boots}\n")
    boot = host / "proc/sys/kernel/random/boot_id"
    base = (host / "dev/kmsg").read_text()
    append(host, [xid_line(100, 10 * MIN, 1, 43)])
    assert check(cli, host, f, pol)[0] == 0
    boot.write_text("9d0e7c1a-0000-4000-8000-000000000002\n")  # a reboot an hour ago: a new boot id and log
    (host / "proc/uptime").write_text("3600.00 7200.00\n")
    (host / "dev/kmsg").write_text(base + xid_line(100, 5 * MIN, 1, 43))
    rc, doc, c = check(cli, host, f, pol)
    assert rc == 1 and "GPU 1: XID 43 [readiness.xid.43]" in doc["message"], doc["message"]
    assert "2 bursts (1 in earlier boots); inspect_hw after 2 within 7d across boots" in c["gpu.xid"]["detail"]
    assert "inspect the hardware" in c["gpu.xid"]["detail"]
    within_boot = profile_dir(tmp_path, "  xid:\n    43: {action: inspect_hw, count: 2, within: 7d}\n", "b")
    assert check(cli, host, f, within_boot, "b")[0] == 0  # the same count within this boot alone: 1


# -- the shipped default: application XIDs recurring on one GPU are a warning -----------------------------
def test_the_default_warns_on_5_bursts_of_an_application_xid_on_one_gpu_and_never_gates(cli, host, tmp_path):
    lines = [xid_line(100 + i, (100 + 30 * i) * MIN, 3, 13) for i in range(5)]  # GPU 3: 5 bursts in 2 h
    lines += [xid_line(200 + i, (100 + 30 * i) * MIN, 4, 13) for i in range(4)]  # GPU 4: 4
    # NVSentinel #1629: one multi-node job crashes; every GPU logs its 43s and 45s once
    lines += [xid_line(300 + 2 * g + k, 1300 * MIN + g * 1000 + k, g, 45 if k else 43) for g in range(8)
              for k in range(2)]
    append(host, lines)
    rc, doc, c = check(cli, host, gpu_json(tmp_path), profiles_folder(tmp_path, health=""), "health")
    assert rc == 0 and doc["ready"], doc["message"]
    w = c["gpu.xid_recurring"]
    assert (w["ok"], w["severity"]) == (False, "warning")
    assert w["detail"].startswith("GPU 3 (0000:5d:00.0): XID 13 Graphics Engine Exception: 5 bursts (the last "
                                  "13200.0 s after boot): restart_app after 5 within 24h (by profile health: "
                                  "readiness.xid.13 (in _base.yaml))"), w["detail"]
    assert "GPU 4" not in w["detail"] and "XID 45" not in w["detail"]


# -- refusals: exit 2, one line naming the file and the key --------------------------------------------
@pytest.mark.parametrize("body,line", [
    ("  checks:\n    gpu.inforrom: off\n",
     r"p\.yaml: readiness\.checks\.gpu\.inforrom: no such check \(the closest: gpu\.inforom\); "),
    ("  checks:\n    gpu.inforom: silent\n",
     r"p\.yaml: readiness\.checks: gpu\.inforom: 'silent' is not a severity \(one of fatal, warning, off\)"),
    ("  xid:\n    45: rest_gpu\n",
     r"p\.yaml: readiness\.xid: XID 45: unknown action 'rest_gpu' \(one of ignore, restart_app, reset_gpu, "
     r"reboot, inspect_hw\)"),
    ("  xid:\n    70000: reboot\n", r"p\.yaml: readiness\.xid: '70000' is not an XID \(a number 1-65535\)"),
    ("  xid:\n    0: reboot\n", r"p\.yaml: readiness\.xid: '0' is not an XID \(a number 1-65535\)"),
    ("  xid:\n    13: {action: reset_gpu, count: 0, within: 1h}\n",
     r"p\.yaml: readiness\.xid: XID 13: count: '0': a repeat rule counts 1 to 100 bursts"),
    ("  xid:\n    13: {action: reset_gpu, count: 3, within: an hour}\n",
     r"p\.yaml: readiness\.xid: XID 13: within: 'an hour' does not parse \(write a duration"),
    ("  xid:\n    13: {action: reset_gpu, count: 3, within: 0s}\n",
     r"p\.yaml: readiness\.xid: XID 13: within: '0s': a window is 1s to 90d"),
    ("  xid:\n    8: {action: reset_gpu, count: 3}\n", r"XID 8: a repeat rule has both count and within"),
    ("  xid:\n    13: {action: reset_gpu, count: 3, within: 1h, burst: 1s}\n", r"XID 13: unknown key 'burst'"),
    ("  xid:\n    13: {action: ignore, count: 3, within: 1h}\n", r"XID 13: a repeat rule's action ignore does nothing"),
    ("  xid:\n    79: {action: inspect_hw, count: 3, within: 7d across boots}\n",
     r"p\.yaml: readiness\.xid\.79: XID 79 is fatal at its first record \(catalog: reboot\)"),
    ("  max_out_of_service: 10 percent\n", r"p\.yaml: readiness\.max_out_of_service: '10 percent' is not a count of "
     r"nodes \(0 to 1,000,000\) or a percentage \(0% to 100%, e\.g\. 10% or 2\.5%\); 0 reports only"),
    ("  max_out_of_service: 150%\n", r"readiness\.max_out_of_service: '150%' is not a count of nodes"),
    ("  max_out_of_service: -1\n", r"readiness\.max_out_of_service: '-1' is not a count of nodes"),
    ("  max_out_of_service: 2.5\n", r"readiness\.max_out_of_service: '2\.5' is not a count of nodes"),
    ("  max_out_of_service: yes\n", r"readiness\.max_out_of_service: true \(YAML reads on and yes so\) is not a count"),
])
def test_nonsense_is_refused_at_load_with_one_line(cli, host, tmp_path, body, line):
    r = cli("check", "--root", str(host), "--gpu-fixture", str(gpu_json(tmp_path)), "--policy-dir",
            str(profile_dir(tmp_path, body)), "--profile", "p")
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(line, lines[0]), lines
    assert not (host / "var/lib/gpu-tune").exists()  # nothing written


def test_every_command_that_loads_the_profile_refuses_a_misspelt_check(cli, host, tmp_path):
    pol = profile_dir(tmp_path, "  checks:\n    network.infinband: warning\n")
    for command in (("audit", "--profile", "p"), ("profiles",), ("serve", "--profile", "p", "--no-kube")):
        r = cli(*command, "--root", str(host), "--policy-dir", str(pol))
        assert r.returncode == 2, (command, r.stdout, r.stderr)
        assert r.stderr.strip().endswith("p.yaml: readiness.checks.network.infinband: no such check (the closest: "
                                         "network.infiniband); `gpu-tune check -o json` lists the checks, "
                                         "docs/health.md the families"), r.stderr


def test_off_no_and_false_are_off_and_on_is_refused(cli, host, tmp_path):
    rc, doc, c = check(cli, host, gpu_json(tmp_path), profile_dir(tmp_path, "  checks:\n    gpu.inforom: no\n"))
    assert rc == 0 and [o["name"] for o in doc["off"]] == ["gpu.inforom"]
    r = cli("audit", "--policy-dir", str(profile_dir(tmp_path, "  checks:\n    gpu.inforom: on\n")), "--profile", "p",
            "--root", str(host))
    assert r.returncode == 2 and "gpu.inforom: true (YAML reads on and yes so) is not a severity" in r.stderr


# -- the metrics and the fleet view: each weight and the profile's digest ----------------------------------
def test_the_metrics_the_node_and_the_fleet_view_say_each_weight_and_the_digest(tmp_path):
    import time

    from gpu_tune.cluster.fleet import fleet_report, render_table
    from gpu_tune.cluster.labels import ANNOTATION_DIGEST
    from gpu_tune.cluster.node_state import node_want
    from gpu_tune.judge.readiness import verdict
    from gpu_tune.serve.snapshot import Snapshot
    from gpu_tune.tune.policy import load_profile

    folder = profile_dir(tmp_path, "  checks:\n    gpu.inforom: fatal\n    network.infiniband: off\n")
    prof = load_profile("p", folder)
    gpus = [{"index": 0, "uuid": "GPU-0", "name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "0000:18:00.0",
             "inforom_valid": False}]
    v = verdict(profile=prof, audit=None, gpus=gpus)
    body = Snapshot.build(node="n", profile="p", verdict=v, since=0.0, created=0.0).metrics_body.decode()
    assert 'gpu_tune_check_severity_info{by="readiness.checks.gpu.inforom",check="gpu.inforom",severity="fatal"} ' \
           '1.0' in body
    assert 'gpu_tune_check_severity_info{by="readiness.checks.network.infiniband",check="network.infiniband",' \
           'severity="off"} 1.0' in body
    assert 'gpu_tune_check_severity_info{by="catalog",check="gpu.present",severity="fatal"} 1.0' in body
    assert f'gpu_tune_profile_info{{digest="{v.policy.digest}",profile="p"}} 1.0' in body
    assert 'gpu_tune_check_ok{check="network.infiniband"}' not in body  # not evaluated

    want = node_want(v, profile=prof, mode="enforce", topology={}, gpus=gpus, driver_version=None)
    assert want.annotations[ANNOTATION_DIGEST] == v.policy.digest
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    node = {"metadata": {"name": "n", "labels": want.labels, "annotations": want.annotations},
            "status": {"conditions": [{**want.condition, "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}]}}
    report = fleet_report([node], now=now)
    row = report.nodes[0]
    assert row.profile_digest == v.policy.digest and row.weights == {
        "gpu.inforom": "fatal readiness.checks.gpu.inforom", "network.infiniband": "off readiness.checks.network.infiniband"}
    table = render_table(report)
    assert f"p@{v.policy.digest[7:15]}" in table
    assert "gpu.inforom [fatal readiness.checks.gpu.inforom]: " in table and "off: network.infiniband" in table
