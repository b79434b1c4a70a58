"""Hostile health inputs (docs/security.md "Round 4"): a state file the tool did not write, a disk
that cannot keep what was seen, a boot that cannot be known, numbers the kernel never writes and
more RDMA devices than a pass reads. Two rules decide every case: hostile input never turns a
healthy node unhealthy and never hides a real fault; and no exit 3, no traceback. Each case runs
through `gpu-tune check` and through the agent's own pass (its real stages over the fixture)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from gpu_tune.errors import HostError
from gpu_tune.host.fs import HostFS
from gpu_tune.serve.agent import Agent
from gpu_tune.serve.options import ServeOptions
from gpu_tune.serve.stages import default_stages
from tests.healthkit import GPU_FIXTURE, XID79, dgx_tree, health_policies, host  # noqa: F401 (fixtures)

PROFILE = ("include: training.yaml\nreadiness:\n  require_compliant: false\n  require_probe: false\n")
IB1 = "sys/devices/pci0000:20/0000:20:01.0/0000:29:00.0/infiniband/mlx5_1/ports/1"  # InfiniBand
GPU3 = "sys/devices/pci0000:50/0000:50:01.0/0000:5d:00.0"
STATE = "var/lib/gpu-tune/health.json"
BOOT = "proc/sys/kernel/random/boot_id"


@pytest.fixture
def policies(tmp_path) -> Path:
    return health_policies(tmp_path / "policies", PROFILE)


def faults(root: Path) -> None:
    """Three real faults at once: XID 79 on GPU 3, InfiniBand port mlx5_1/1 down, a fatal AER error."""
    with open(root / "dev/kmsg", "a") as f:
        f.write(XID79.format(seq=90, usec=88310022))
    (root / IB1 / "state").write_text("1: DOWN\n")
    (root / GPU3 / "aer_dev_fatal").write_text("DLP 1\nTOTAL_ERR_FATAL 1\n")


def check(cli, root, policies, *extra, rc=(0, 1)):
    r = cli("check", "--root", str(root), "--gpu-fixture", str(GPU_FIXTURE), "--policy-dir", str(policies),
            "--profile", "health", "-o", "json", *extra)
    assert r.returncode in rc, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    return r.returncode, json.loads(r.stdout)


def by_name(doc) -> dict:
    return {c["name"]: c for c in doc["checks"]}


def failing(doc) -> set[str]:
    return {c["name"] for c in doc["checks"] if not c["ok"] and c["severity"] == "fatal"}


def agent_for(root, policies, **kw) -> tuple[Agent, object]:
    st = default_stages(ServeOptions(root=str(root), gpu_backend="fixture", gpu_fixture=str(GPU_FIXTURE),
                                     policy_dir=str(policies), profile="health", no_kube=True, **kw))
    return Agent(st, probe_enabled=False), st


def verdict_checks(snap) -> dict:
    return {c.name: c for c in snap.verdict.checks}


# -- a state file the tool did not write -----------------------------------------------------------
REC = {"kind": "xid", "bus": "0000:5d:00", "code": 79, "count": 1, "first_seen": 1.0, "first_usec": 5,
       "last_usec": 5, "message": "m", "source": "kernel log"}


THIS_BOOT = "6c1f2b1e-8a9d-4c8e-9d7e-2f1f3b6a9c11"  # the fixture's boot id: the file is this boot's


def doc(**kw) -> str:
    return json.dumps({"version": 1, "boot_id": THIS_BOOT, "records": {}, **kw})


MISTYPED = [
    ("version-string", json.dumps({"version": "1"})),
    ("version-true", json.dumps({"version": True})),
    ("version-2", json.dumps({"version": 2, "records": {}})),
    ("boot_id-number", doc(boot_id=5)),
    ("records-list", doc(records=[])),
    ("record-number", doc(records={"xid/0000:5d:00/79": 5})),
    ("record-count-text", doc(records={"xid/0000:5d:00/79": {**REC, "count": "3"}})),
    ("record-code-huge", doc(records={"xid/0000:5d:00/79": {**REC, "code": 10**30}})),
    ("record-usec-float", doc(records={"xid/0000:5d:00/79": {**REC, "first_usec": 1.5}})),
    ("record-other-key", doc(records={"xid/0000:18:00/79": REC})),
    ("record-missing-field", doc(records={"xid/0000:5d:00/79": {"kind": "xid"}})),
    ("cleared-list", doc(cleared=[])),
    ("cleared-number", doc(cleared={"*": 5})),
    ("cleared-usec-text", doc(cleared={"*": {"usec": "x", "epoch": 1}})),
    ("history-number", doc(history={"xid/0000:5d:00/79": 5})),
    ("history-items", doc(history={"xid/0000:5d:00/79": [1, 2]})),
    ("baseline-text", doc(nvml_baseline={"0000:5d:00/79": {"n": "x", "at": 1}})),
    ("applied_tokens-number", doc(applied_tokens=5)),
    ("applied_tokens-items", doc(applied_tokens=[1, 2])),
    ("cleared_words-number", doc(cleared_words=5)),
    ("cleared_words-items", doc(cleared_words=[{}])),
    ("unknown-key", doc(mine=1)),
    ("top-list", "[1, 2]"),
    ("null", "null"),
    ("string", '"health"'),
    ("int-5000-digits", '{"version": 1, "cleared": {"*": {"usec": ' + "9" * 5000 + ', "epoch": 1}}}'),
    ("epoch-inf", '{"version": 1, "cleared": {"*": {"usec": 1, "epoch": 1e400}}}'),
    ("nan", '{"version": 1, "cleared": {"*": {"usec": 1, "epoch": NaN}}}'),
    ("deep", "[" * 100_000 + "]" * 100_000),
    ("key-twice", '{"version": 1, "version": 1}'),
    ("lone-surrogate", '{"version": 1, "cleared_words": ["\\ud800"]}'),
    ("not-json", "[1, 2"),
]


@pytest.mark.parametrize("text", [t for _, t in MISTYPED], ids=[i for i, _ in MISTYPED])
def test_a_mistyped_state_file_is_set_aside_and_never_hides_a_fault(cli, host, policies, text):
    faults(host)
    (host / STATE).parent.mkdir(parents=True, exist_ok=True)
    (host / STATE).write_text(text)
    rc, out = check(cli, host, policies)
    assert rc == 1 and out["reason"] == "FatalXid", out["message"]
    assert {"gpu.xid", "network.infiniband", "gpu.pcie"} <= failing(out), out["message"]
    warn = by_name(out)["gpu.health_state"]
    assert warn["severity"] == "warning" and "set aside as health.json.bad" in warn["detail"], warn
    assert (host / STATE).with_name("health.json.bad").read_text() == text  # kept for a person to look at
    assert json.loads((host / STATE).read_text())["version"] == 1  # a new one, of this tool's form


def test_a_mistyped_state_file_leaves_a_healthy_node_ready(cli, host, policies):
    (host / STATE).parent.mkdir(parents=True, exist_ok=True)
    (host / STATE).write_text(doc(records={"xid/0000:5d:00/79": 5}))
    rc, out = check(cli, host, policies)
    assert rc == 0 and out["ready"], out["message"]
    assert not by_name(out)["gpu.health_state"]["ok"]


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_a_state_file_that_is_not_a_regular_file_is_set_aside(cli, host, policies, kind):
    faults(host)
    p = host / STATE
    p.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "directory":
        p.mkdir()
        (p / "x").write_text("x")
    else:
        p.symlink_to("/etc/passwd")
    rc, out = check(cli, host, policies)
    assert rc == 1 and out["reason"] == "FatalXid" and {"gpu.xid", "network.infiniband", "gpu.pcie"} <= failing(out)
    assert "health.json" in by_name(out)["gpu.health_state"]["detail"]
    aside = p.with_name("health.json.bad")
    assert aside.is_symlink() if kind == "symlink" else aside.exists()
    assert json.loads(p.read_text())["records"]  # the XID is saved in a new, regular file
    assert Path("/etc/passwd").stat().st_size > 0


@pytest.mark.parametrize("text", [doc(history={"xid/0000:5d:00/79": 5}), doc(records={"xid/0000:5d:00/79": 5})],
                         ids=["history-number", "record-number"])
def test_the_agent_never_says_all_checks_passed_over_real_faults_with_a_mistyped_state_file(host, policies, text):
    """The agent's own pass: a mistyped file with XID 79, a port down and a fatal AER error: not
    ready, all three named, every pass."""
    faults(host)
    (host / STATE).parent.mkdir(parents=True, exist_ok=True)
    (host / STATE).write_text(text)
    agent, st = agent_for(host, policies)
    try:
        for _ in range(2):
            snap = agent.run_pass()
            assert not snap.verdict.ready and snap.verdict.reason() == "FatalXid", snap.verdict.message()
            names = {c.name for c in snap.verdict.failed}
            assert {"gpu.xid", "network.infiniband", "gpu.pcie"} <= names and "gpu.health" not in names
    finally:
        st.close()


# -- a health stage that cannot judge fails closed ------------------------------------------------
def _broken(*a, **kw):
    raise TypeError("unsupported operand type(s) for +: 'int' and 'list'")


def test_the_agent_fails_closed_when_the_health_stage_raises(host, policies, monkeypatch):
    import gpu_tune.judge.checks.monitor as monitor

    agent, st = agent_for(host, policies)
    try:
        monkeypatch.setattr(monitor, "read_host_health", _broken)
        snap = agent.run_pass()
        v = snap.verdict
        assert not v.ready and v.reason() == "HealthNotJudged", v.message()
        c = verdict_checks(snap)["gpu.health"]
        assert c.severity == "fatal" and "TypeError: unsupported operand" in c.detail
        assert v.hardware().ready  # the agent's own failure is not a hardware fault to repair
        monkeypatch.undo()
        snap = agent.run_pass()
        assert snap.verdict.ready and "gpu.health" not in verdict_checks(snap), snap.verdict.message()
    finally:
        st.close()


def test_check_fails_closed_when_the_health_readings_raise(host, policies, monkeypatch, capsys):
    import gpu_tune.judge.checks.monitor as monitor
    from gpu_tune.cli.main import main

    monkeypatch.setattr(monitor, "read_host_health", _broken)
    with pytest.raises(SystemExit) as exc:
        main(["check", "--root", str(host), "--gpu-fixture", str(GPU_FIXTURE), "--policy-dir", str(policies),
              "--profile", "health", "-o", "json"])
    out = json.loads(capsys.readouterr().out)
    assert exc.value.code == 1 and out["reason"] == "HealthNotJudged", out["message"]
    assert by_name(out)["gpu.health"]["severity"] == "fatal"


# -- what cannot be saved is kept in memory -------------------------------------------------------
def _full_disk(monkeypatch):
    real = HostFS.write_file_atomic

    def write(self, host_path, data, mode=0o644):
        if host_path.endswith("/health.json"):
            raise HostError(f"{host_path}: No space left on device", errno.ENOSPC)
        return real(self, host_path, data, mode)

    monkeypatch.setattr(HostFS, "write_file_atomic", write)


def test_the_agent_keeps_an_xid_it_could_not_save_for_the_rest_of_the_boot(host, policies, monkeypatch):
    _full_disk(monkeypatch)
    with open(host / "dev/kmsg", "a") as f:
        f.write(XID79.format(seq=90, usec=88310022))
    agent, st = agent_for(host, policies)
    try:
        for n in range(3):  # the log is read once; the disk never takes the record
            snap = agent.run_pass()
            assert snap.verdict.reason() == "FatalXid", (n, snap.verdict.message())
            w = verdict_checks(snap)["gpu.health_state"]
            assert "No space left on device" in w.detail and "XID 79 on 0000:5d:00 could not be saved" in w.detail
            assert "kept in this process's memory" in w.detail and w.severity == "warning"
        assert not (host / STATE).exists()
        monkeypatch.undo()  # the disk has room again: the record is written
        agent.run_pass()
        assert "xid/0000:5d:00/79" in json.loads((host / STATE).read_text())["records"]
    finally:
        st.close()


def test_check_sees_an_xid_it_could_not_save_and_says_so(host, policies, monkeypatch, capsys):
    from gpu_tune.cli.main import main

    _full_disk(monkeypatch)
    with open(host / "dev/kmsg", "a") as f:
        f.write(XID79.format(seq=90, usec=88310022))
    with pytest.raises(SystemExit) as exc:
        main(["check", "--root", str(host), "--gpu-fixture", str(GPU_FIXTURE), "--policy-dir", str(policies),
              "--profile", "health", "-o", "json"])
    out = json.loads(capsys.readouterr().out)
    assert exc.value.code == 1 and out["reason"] == "FatalXid"
    assert "could not be saved" in by_name(out)["gpu.health_state"]["detail"]


# -- a boot that cannot be known clears nothing and forgets nothing -------------------------------
def test_without_a_boot_id_an_older_boots_clear_never_hides_this_boots_xid(cli, host, policies):
    (host / STATE).parent.mkdir(parents=True, exist_ok=True)
    older = {"version": 1, "boot_id": "00000000-0000-4000-8000-0000000000aa", "records": {},
             "cleared": {"*": {"usec": 10**12, "epoch": 1.0}}, "history": {}, "nvml_baseline": {},
             "applied_tokens": [], "cleared_words": ["an older boot's clear"]}
    (host / STATE).write_text(json.dumps(older))
    (host / BOOT).unlink()
    with open(host / "dev/kmsg", "a") as f:
        f.write(XID79.format(seq=90, usec=88310022))  # before the older boot's clear, by its kernel time
    rc, out = check(cli, host, policies)
    assert rc == 1 and out["reason"] == "FatalXid", out["message"]
    assert "the boot id cannot be read" in by_name(out)["gpu.health_state"]["detail"]
    r = cli("set-healthy", "--root", str(host), "--gpu-fixture", str(GPU_FIXTURE))
    assert r.returncode == 1 and "nothing cleared" in r.stdout and "boot_id" in r.stdout, (r.stdout, r.stderr)
    rc, out = check(cli, host, policies)
    assert out["reason"] == "FatalXid"


def test_a_boot_id_that_changes_every_pass_never_forgets_the_xid(host, policies):
    with open(host / "dev/kmsg", "a") as f:
        f.write(XID79.format(seq=90, usec=88310022))
    agent, st = agent_for(host, policies)
    try:
        for n in range(4):
            (host / BOOT).write_text(f"00000000-0000-4000-8000-{n:012d}\n")
            snap = agent.run_pass()
            assert snap.verdict.reason() == "FatalXid", (n, snap.verdict.message())
        assert "the boot id changed while this process runs" in verdict_checks(snap)["gpu.health_state"].detail
    finally:
        st.close()


# -- numbers the kernel never writes --------------------------------------------------------------
NOT_NUMBERS = ["²", "٧٩", "9" * 5000, "-1", "1e3", " ", "0x10"]


@pytest.mark.parametrize("value", NOT_NUMBERS, ids=["superscript", "arabic", "5000-digits", "negative", "exponent",
                                                    "blank", "hex"])
def test_an_aer_or_link_value_the_kernel_never_writes_is_unreadable_never_a_pass(cli, host, policies, value):
    (host / GPU3 / "aer_dev_fatal").write_text(f"DLP 0\nTOTAL_ERR_FATAL {value}\n")
    (host / "sys/devices/pci0000:b0/0000:b0:01.0/0000:ba:00.0/current_link_width").write_text(value + "\n")
    (host / IB1 / "counters/link_downed").write_text(value + "\n")
    rc, out = check(cli, host, policies)
    assert rc == 1 and out["reason"] == "PcieDegraded", out["message"]
    pcie = by_name(out)["gpu.pcie"]["detail"]
    assert "unreadable: /sys/bus/pci/devices/0000:5d:00.0/aer_dev_fatal" in pcie, pcie
    assert "unreadable: /sys/bus/pci/devices/0000:ba:00.0/current_link_width" in pcie, pcie
    flaps = by_name(out)["network.link_flaps"]
    assert flaps["severity"] == "warning" and "unreadable: /sys/class/infiniband/mlx5_1/ports/1/counters/link_downed" \
        in flaps["detail"]


@pytest.mark.parametrize("layer", ["InfiniBand\x1b", "fifo", "missing"])
def test_a_down_port_whose_link_layer_cannot_be_read_is_still_judged(cli, host, policies, layer):
    """Only a port the kernel calls Ethernet is left to the profile: one whose link layer is
    garbled, a FIFO or missing is judged as InfiniBand, so its fault is never dropped with it."""
    f = host / IB1 / "link_layer"
    f.unlink()
    if layer == "fifo":
        os.mkfifo(f)
    elif layer != "missing":
        f.write_text(layer + "\n")
    (host / IB1 / "state").write_text("1: DOWN\n")
    rc, out = check(cli, host, policies)
    assert rc == 1 and out["reason"] == "InfinibandPortDown", out["message"]
    assert "mlx5_1/1 is DOWN" in by_name(out)["network.infiniband"]["detail"]
    if layer != "missing":
        assert "unreadable: /sys/class/infiniband/mlx5_1/ports/1/link_layer" in by_name(out)["network.infiniband"]["detail"]


def test_an_uptime_of_inf_is_unreadable_in_check_and_set_healthy(cli, host, policies):
    (host / "proc/uptime").write_text("inf 1\n")
    rc, out = check(cli, host, policies)
    assert rc == 0 and "unreadable: /proc/uptime" in by_name(out)["gpu.health_state"]["detail"]
    r = cli("set-healthy", "--root", str(host), "--gpu-fixture", str(GPU_FIXTURE))
    assert r.returncode == 0 and "unreadable: /proc/uptime" in r.stdout, (r.stdout, r.stderr)


@pytest.mark.parametrize("gpu", ["[/x]:1", "²", "9" * 5000, "0000:18:00.0\x1b[2J", "[red]1[/red]", "-1"])
def test_set_healthy_refuses_a_bad_gpu_before_saving_anything(cli, host, gpu):
    r = cli("set-healthy", "--root", str(host), "--gpu-fixture", str(GPU_FIXTURE), "--gpu", gpu)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln]
    assert len(lines) == 1 and "--gpu" in lines[0] and "\x1b" not in r.stderr and "Traceback" not in r.stderr
    assert not (host / STATE).exists()


def test_set_healthy_prints_what_a_hostile_state_file_holds_escaped(cli, host):
    (host / STATE).parent.mkdir(parents=True, exist_ok=True)
    (host / STATE).write_text('{"version": 1, "records": {"\\u001b]0;owned\\u0007[/x]": 5}}')
    r = cli("set-healthy", "--root", str(host), "--gpu-fixture", str(GPU_FIXTURE), "--gpu", "0000:5d:00.0",
            env={"FORCE_COLOR": "1", "TERM": "xterm-256color"})
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "\x07" not in r.stdout and "\x1b]" not in r.stdout and "set aside" in r.stdout
    assert "\\x1b]0;owned\\x07[/x]" in r.stdout


# -- more RDMA devices than a pass reads ----------------------------------------------------------
def add_virtual_functions(root: Path, n: int, first: int = 8) -> None:
    """``n`` SR-IOV virtual functions as RDMA devices (``device/physfn`` names their physical
    function), each with one InfiniBand port up, as an HCA with VFs enabled shows them."""
    cls = root / "sys/class/infiniband"
    for i in range(first, first + n):
        dev = cls / f"mlx5_{i}"
        (dev / "device").mkdir(parents=True)
        os.symlink("../../../../bus/pci/devices/0000:29:00.0", dev / "device/physfn")
        port = dev / "ports/1"
        (port / "counters").mkdir(parents=True)
        (port / "state").write_text("4: ACTIVE\n")
        (port / "phys_state").write_text("5: LinkUp\n")
        (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
        (port / "link_layer").write_text("InfiniBand\n")
        (port / "counters/link_downed").write_text("0\n")


def test_a_down_physical_port_among_520_rdma_devices_is_read_and_fails_the_node(cli, host, policies):
    add_virtual_functions(host, 512)
    (host / "sys/devices/pci0000:d0/0000:d0:01.0/0000:da:00.0/infiniband/mlx5_7/ports/1/state").write_text("1: DOWN\n")
    rc, out = check(cli, host, policies)
    assert rc == 1 and out["reason"] == "InfinibandPortDown", out["message"]
    assert "mlx5_7/1 is DOWN" in by_name(out)["network.infiniband"]["detail"]
    (host / "sys/devices/pci0000:d0/0000:d0:01.0/0000:da:00.0/infiniband/mlx5_7/ports/1/state").write_text("4: ACTIVE\n")
    rc, out = check(cli, host, policies)
    ib = by_name(out)["network.infiniband"]
    assert rc == 0 and ib["ok"], out["message"]
    assert "512 SR-IOV virtual function(s) not read" in ib["detail"], ib


def test_a_named_virtual_function_is_read_and_judged(cli, host, policies):
    add_virtual_functions(host, 512)
    (host / "sys/class/infiniband/mlx5_519/ports/1/state").write_text("1: DOWN\n")
    (policies / "health.yaml").write_text(PROFILE + "  expect:\n    ib_ports: [mlx5_1, mlx5_519]\n")
    rc, out = check(cli, host, policies)
    assert rc == 1 and "mlx5_519/1 is DOWN" in by_name(out)["network.infiniband"]["detail"], out["message"]


def test_physical_ports_past_the_bound_are_not_judged_and_say_so(host, monkeypatch):
    import gpu_tune.discover.sysfs_health as sh

    monkeypatch.setattr(sh, "MAX_IB_PORTS", 3)
    got = sh.read_infiniband(HostFS(host))
    assert [p.name for p in got.ports] == ["mlx5_0/1", "mlx5_1/1", "mlx5_2/1"]
    assert got.unread_physical == 5 and "0 port(s) and 5 device(s) not read" in got.not_read[0]


# -- the InfiniBand rate, judged by default --------------------------------------------------------
def test_a_port_that_trained_down_fails_an_h100_node_against_the_models_rate(cli, host, policies):
    rc, out = check(cli, host, policies)
    ok = by_name(out)["network.infiniband"]
    assert rc == 0 and "policies/baselines.yaml for NVIDIA H100 80GB HBM3" in ok["detail"], ok
    (host / IB1 / "rate").write_text("200 Gb/sec (4X HDR)\n")
    rc, out = check(cli, host, policies)
    assert rc == 1 and out["reason"] == "InfinibandPortDown", out["message"]
    d = by_name(out)["network.infiniband"]["detail"]
    assert "mlx5_1/1 runs at 200 Gb/s of 400" in d and "3 of 4 expected port(s) at 400 Gb/s or more" in d, d


def _no_fabric(tmp_path) -> Path:
    data = json.loads(GPU_FIXTURE.read_text())
    for g in data["gpus"]:
        g.pop("fabric", None)
    f = tmp_path / "no-fabric.json"
    f.write_text(json.dumps(data))
    return f


def test_without_a_model_rate_a_port_slower_than_its_siblings_fails(cli, host, policies, tmp_path):
    fixture = _no_fabric(tmp_path)
    (host / IB1 / "rate").write_text("200 Gb/sec (4X HDR)\n")
    r = cli("check", "--root", str(host), "--gpu-fixture", str(fixture), "--policy-dir", str(policies),
            "--profile", "health", "-o", "json")
    out = json.loads(r.stdout)
    assert r.returncode == 1 and out["reason"] == "InfinibandPortDown", out["message"]
    d = by_name(out)["network.infiniband"]["detail"]
    assert "mlx5_1/1 runs at 200 Gb/s while 3 of the node's 4 InfiniBand ports run at 400" in d, d
    # two rates by design (half and half): no rate most ports share, nothing to compare with
    (host / "sys/devices/pci0000:50/0000:50:01.0/0000:5c:00.0/infiniband/mlx5_3/ports/1/rate").write_text(
        "200 Gb/sec (4X HDR)\n")
    r = cli("check", "--root", str(host), "--gpu-fixture", str(fixture), "--policy-dir", str(policies),
            "--profile", "health", "-o", "json")
    out = json.loads(r.stdout)
    assert r.returncode == 0, out["message"]
    assert "rate not judged" in by_name(out)["network.infiniband"]["detail"]


def test_the_profiles_rate_wins_over_the_models(cli, host, policies):
    (host / IB1 / "rate").write_text("200 Gb/sec (4X HDR)\n")
    (policies / "health.yaml").write_text(PROFILE + "  expect:\n    ib_rate_gbps: 200\n")
    rc, out = check(cli, host, policies)
    assert rc == 0 and "readiness.expect.ib_rate_gbps 200 Gb/s" in by_name(out)["network.infiniband"]["detail"]


# -- the strict reader itself ----------------------------------------------------------------------
def test_the_strict_reader_takes_only_what_the_kernel_writes():
    from gpu_tune.host.numbers import Unreadable, seconds, uint, uptime_usec
    from gpu_tune.host.parse import link_speed_gen, link_width, parse_int, parse_link_width, parse_meminfo

    assert uint("42\n") == 42 and uint("18446744073709551615") == 2**64 - 1
    for bad in ("²", "٧٩", "9" * 21, "9" * 5000, "-1", "+1", "1e3", "1_000", "0x10", "", " ", "4 2", "inf"):
        with pytest.raises(Unreadable):
            uint(bad)
    assert seconds("86400.25") == 86400.25 and uptime_usec("86400.25 1382400.00\n") == 86_400_250_000
    for bad in ("inf", "nan", "Infinity", "1e9", "-1", "٧٩", "", "1." + "9" * 10):
        with pytest.raises(Unreadable):
            seconds(bad)
    assert link_width("16\n") == 16 and link_width("x8") == 8 and link_width("0") is None and link_width(None) is None
    for bad in ("²", "9" * 5000, "sixteen", "-16"):
        with pytest.raises(Unreadable):
            link_width(bad)
        assert parse_link_width(bad) is None  # the topology's view: not a crash
    assert link_speed_gen("32.0 GT/s PCIe") == 5 and link_speed_gen("5 GT/s") == 2 and link_speed_gen("Unknown") is None
    with pytest.raises(Unreadable):
        link_speed_gen("٣٢.٠ GT/s PCIe")
    assert parse_int("٧") is None and parse_int("-1") == -1 and parse_int("9" * 5000) is None
    assert parse_meminfo("Node 0 MemTotal: ² kB\nNode 0 MemFree: 12 kB\n") == {"MemFree": 12}
    from gpu_tune.host.parse import parse_interrupts

    lines = parse_interrupts("  CPU0 CPU1\n  5: ² 3 IO-APIC 5-edge x\n  6: 1 2 IO-APIC 6-edge y\n")
    assert lines["5"].total == 0 and lines["6"].total == 3


def test_a_proc_entry_that_is_not_a_pid_is_passed_over(tmp_path):
    (tmp_path / "sys").mkdir()
    for name in ("12", "²", "9" * 200, "self"):
        (tmp_path / "proc" / name).mkdir(parents=True)
    assert HostFS(tmp_path).pids() == [12]
