"""The health checks (docs/health.md) on the 8-GPU fixture: each failure injected makes `gpu-tune
check` exit 1 naming it first; the healthy fixture passes every one; what is remembered across
passes (fatal XIDs per boot, set-healthy, windows) and recovery."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from gpu_tune.discover.topology import discover
from gpu_tune.gpu import select_backend
from gpu_tune.host.fs import HostFS
from gpu_tune.judge.checks.catalog import catalog
from gpu_tune.judge.checks.expect import device_ids, expectations
from gpu_tune.judge.checks.monitor import HealthMonitor
from gpu_tune.judge.checks.state import HealthState
from gpu_tune.judge.probe.baselines import load_baselines
from gpu_tune.judge.readiness import verdict
from gpu_tune.tune.policy import load_profile
from tests.fixtures import hostgen
from tests.healthkit import HEALTH_ONLY, XID79, dgx_tree, gpu_json, host, policies  # noqa: F401 (fixtures)




def check(cli, root, fixture, policies, *extra):
    r = cli("check", "--root", str(root), "--gpu-fixture", str(fixture), "--policy-dir", str(policies),
            "--profile", "health", "-o", "json", *extra)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)


# -- the healthy fixture ----------------------------------------------------------------------------
def test_the_healthy_8_gpu_node_passes_every_health_check(cli, host, tmp_path, policies):
    rc, doc = check(cli, host, gpu_json(tmp_path), policies)
    names = {c["name"]: c for c in doc["checks"]}
    for name in ("gpu.present", "gpu.count", "gpu.xid", "gpu.recovery", "gpu.memory", "gpu.nvlink", "gpu.fabric",
                 "network.infiniband", "gpu.pcie", "gpu.thermal", "gpu.inforom"):
        assert names[name]["ok"], names[name]
    assert rc == 0 and doc["ready"] and doc["reason"] == "AllChecksPassed", doc["message"]
    assert names["gpu.count"]["detail"] == "8 GPU(s): PCI bus 8, NVML 8, expected 8"
    assert "18 NVLinks active per GPU (18 expected)" in names["gpu.nvlink"]["detail"]
    assert names["gpu.inforom"]["severity"] == "warning" and names["gpu.memory"]["severity"] == "fatal"
    assert set(doc) == {"ready", "node", "profile", "reason", "message", "checks", "since", "profile_digest", "off"}
    assert all(set(c) == {"name", "ok", "severity", "severity_from", "detail"} for c in doc["checks"])
    assert {c["severity_from"] for c in doc["checks"]} == {"catalog"} and doc["off"] == []
    assert not any(c["name"].startswith("probe.") for c in doc["checks"])  # no --probe


# -- every failure, injected --------------------------------------------------------------------------
def _gpu(i, **kw):
    def edit(d):
        d["gpus"][i].update(kw)
    return edit


def _link_down(i, links):
    def edit(d):
        for n in links:
            d["gpus"][i]["nvlink"][n]["active"] = False
    return edit


def _no_p2p(i, peer):
    def edit(d):
        d["gpus"][i]["nvlink_p2p"][peer] = False
    return edit


def _drop_gpu(i):
    def edit(d):
        del d["gpus"][i]
    return edit


def _host_file(path, text):
    def edit(root):
        (root / path.lstrip("/")).write_text(text)
    return edit


def _append_kmsg(text):
    def edit(root):
        with open(root / "dev/kmsg", "a") as f:
            f.write(text)
    return edit


IB0 = "sys/devices/pci0000:20/0000:20:01.0/0000:29:00.0/infiniband/mlx5_1/ports/1"  # InfiniBand (mlx5_0 is RoCE)
GPU3_AER = "sys/devices/pci0000:50/0000:50:01.0/0000:5d:00.0/aer_dev_fatal"
FAILURES = [
    # (id, GPU JSON edit, host edit, reason, check named first, words in the message)
    ("lost", _gpu(3, lost=True), None, "GpuLost", "gpu.present", "GPU 3 (0000:5d:00.0) is lost"),
    ("fell-off-before-boot", _drop_gpu(5), None, "GpuMissing", "gpu.count",
     "8 NVIDIA GPU(s) on the PCI bus but NVML lists 7: missing from NVML 0000:ab:00.0"),
    ("xid-79", None, _append_kmsg(XID79.format(seq=90, usec=88310022)), "FatalXid", "gpu.xid",
     "GPU 3: XID 79 (GPU has fallen off the bus)"),
    ("reset-required", _gpu(2, reset_required=True), None, "GpuResetRequired", "gpu.recovery", "GPU 2"),
    ("recovery-reboot", _gpu(6, recovery_action="reboot"), None, "GpuResetRequired", "gpu.recovery",
     "NVML recovery action reboot"),
    ("remap-failure", _gpu(1, remapped_rows={"correctable": 3, "uncorrectable": 40, "pending": False, "failure": True}),
     None, "GpuMemoryErrors", "gpu.memory", "row remapping failed"),
    ("remap-pending", _gpu(1, remapped_rows={"correctable": 0, "uncorrectable": 1, "pending": True, "failure": False}),
     None, "GpuMemoryErrors", "gpu.memory", "a row remapping is pending"),
    ("remap-512", _gpu(4, remapped_rows={"correctable": 0, "uncorrectable": 512, "pending": False, "failure": False}),
     None, "GpuMemoryErrors", "gpu.memory", "512 rows remapped for uncorrectable errors"),
    ("sram", _gpu(0, sram_ecc={"uncorrected": 2, "threshold_exceeded": False}), None, "GpuMemoryErrors", "gpu.memory",
     "2 uncorrected SRAM ECC error(s)"),
    ("sram-threshold", _gpu(0, sram_ecc={"uncorrected": 0, "threshold_exceeded": True}), None, "GpuMemoryErrors",
     "gpu.memory", "SRAM ECC error threshold is exceeded"),
    ("nvlink-down", _link_down(7, (3, 4)), None, "NvlinkDown", "gpu.nvlink", "GPU 7: 16 of 18 NVLinks active"),
    ("p2p", _no_p2p(2, "0000:ba:00.0"), None, "NvlinkDown", "gpu.nvlink", "no P2P over NVLink to 0000:ba:00.0"),
    ("fabric", _gpu(5, fabric={"state": "in_progress", "status": "success"}), None, "FabricNotReady", "gpu.fabric",
     "fabric registration in progress"),
    ("ib-down", None, _host_file(f"{IB0}/state", "1: DOWN\n"), "InfinibandPortDown", "network.infiniband",
     "mlx5_1/1 is DOWN / LinkUp"),
    ("ib-rate", None, _host_file(f"{IB0}/rate", "200 Gb/sec (4X HDR)\n"), "InfinibandPortDown", "network.infiniband",
     "mlx5_1/1 runs at 200 Gb/s of 400"),
    ("aer-fatal", None, _host_file(GPU3_AER, "DLP 1\nTOTAL_ERR_FATAL 1\n"), "PcieDegraded", "gpu.pcie",
     "1 fatal uncorrectable PCIe error(s) since boot"),
    ("pcie-width", _gpu(6, pcie_link_width_current=8), None, "PcieDegraded", "gpu.pcie", "x8 of x16"),
    ("hot", _gpu(3, temperature_c=95), None, "GpuSlowedDown", "gpu.thermal", "temperature above 87 C"),
]


@pytest.mark.parametrize("case", FAILURES, ids=[f[0] for f in FAILURES])
def test_each_failure_makes_check_exit_1_naming_it_first(cli, host, tmp_path, policies, case):
    _, gpu_edit, host_edit, reason, first, words = case
    if host_edit:
        host_edit(host)
    if first == "network.infiniband" and "rate" in case[0]:
        (policies / "health.yaml").write_text(HEALTH_ONLY + "  expect:\n    ib_rate_gbps: 400\n")
    if case[0] == "pcie-width":  # sysfs says it too, as on a real host
        (host / "sys/devices/pci0000:b0/0000:b0:01.0/0000:ba:00.0/current_link_width").write_text("8\n")
    rc, doc = check(cli, host, gpu_json(tmp_path, gpu_edit), policies)
    assert rc == 1 and not doc["ready"], doc["message"]
    assert doc["reason"] == reason, doc["message"]
    assert doc["message"].startswith(f"{first}: "), doc["message"]
    assert words in doc["message"] or words in next(c["detail"] for c in doc["checks"] if c["name"] == first), doc
    failing = [c["name"] for c in doc["checks"] if not c["ok"] and c["severity"] == "fatal"]
    assert first in failing


def test_a_missing_gpu_is_named_before_every_other_failure(cli, host, tmp_path, policies):
    """Several failures at once: the lost GPU leads; the rest are named after it in urgency order."""
    _append_kmsg(XID79.format(seq=90, usec=88310022))(host)
    _host_file(f"{IB0}/state", "1: DOWN\n")(host)

    def edit(d):
        _gpu(0, lost=True)(d)
        _gpu(1, remapped_rows={"correctable": 0, "uncorrectable": 0, "pending": True, "failure": False})(d)
        _gpu(2, temperature_c=99)(d)
    rc, doc = check(cli, host, gpu_json(tmp_path, edit), policies)
    assert rc == 1 and doc["reason"] == "GpuLost"
    assert doc["message"].split("also failing: ")[1] == "gpu.xid, gpu.memory, network.infiniband, gpu.thermal"


def test_xids_the_catalog_calls_application_faults_never_fail_a_node(cli, host, tmp_path, policies):
    records = "".join(f"4,{100 + i},{9_000_000 + i},-;NVRM: Xid (PCI:0000:18:00): {x}, pid=4242, name=python3, fault\n"
                      for i, x in enumerate((13, 31, 43, 45, 63, 92, 94)))
    _append_kmsg(records)(host)
    rc, doc = check(cli, host, gpu_json(tmp_path), policies)
    assert rc == 0 and doc["ready"], doc["message"]
    for x in (79, 48, 119, 140):
        h2 = tmp_path / f"h{x}"
        shutil.copytree(host, h2, symlinks=True)
        _append_kmsg(f"3,200,99000000,-;NVRM: Xid (PCI:0000:18:00): {x}, pid='<unknown>', name=<unknown>, x\n")(h2)
        rc, doc = check(cli, h2, gpu_json(tmp_path), policies)
        assert rc == 1 and doc["reason"] == "FatalXid" and f"XID {x}" in doc["message"], (x, doc["message"])


def test_check_is_exit_2_on_bad_input(cli, host, tmp_path, policies):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"gpus": [{"index": 0, "uuid": "u", "name": "n", "pci_bus_id": "0000:18:00.0",
                                         "remapped_rows": {"pending": "yes"}}]}))
    r = cli("check", "--root", str(host), "--gpu-fixture", str(bad))
    assert r.returncode == 2 and "remapped_rows.pending: expected boolean" in r.stderr and not r.stdout
    r = cli("check", "--root", str(host), "--profile", "no-such-profile")
    assert r.returncode == 2


# -- remembered across passes -------------------------------------------------------------------------
class Clock:
    def __init__(self, t=1_800_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


def one_pass(root, fixture, monitor, clear=()):
    fs = HostFS(root)
    backend = select_backend("fixture", str(fixture))
    gpus = backend.gpus()
    topo = discover(fs, backend).as_dict()
    host, view = monitor.read(gpus, topo, clear_tokens=clear)
    prof = load_profile("training")
    exp = expectations(prof, load_baselines(), gpus, device_ids=device_ids(topo))
    return verdict(profile=prof, audit={"settings": []}, gpus=gpus, topology=topo, probes=[{"gpu": "0", "passed": True}],
                   host=host, history=view, expect=exp)


def test_a_fatal_xid_stays_until_reboot_or_set_healthy(cli, host, tmp_path):
    f = gpu_json(tmp_path)
    _append_kmsg(XID79.format(seq=90, usec=88310022))(host)
    v = one_pass(host, f, HealthMonitor(HostFS(host)))
    assert not v.ready and v.reason() == "FatalXid"
    # the ring buffer moved on (or the agent restarted): the XID is remembered, not re-read
    (host / "dev/kmsg").write_text(hostgen.KMSG_BOOT)
    v = one_pass(host, f, HealthMonitor(HostFS(host)))
    assert v.reason() == "FatalXid", v.message()
    # a reboot: a new boot id
    (host / "proc/sys/kernel/random/boot_id").write_text("9d0e7c1a-0000-4000-8000-000000000002\n")
    v = one_pass(host, f, HealthMonitor(HostFS(host)))
    assert v.ready, v.message()
    # again in this boot, then cleared by an operator after a GPU reset
    _append_kmsg(XID79.format(seq=91, usec=99000000))(host)
    mon = HealthMonitor(HostFS(host))
    assert one_pass(host, f, mon).reason() == "FatalXid"
    r = cli("set-healthy", "--root", str(host), "--gpu-fixture", str(f), "--gpu", "3")
    assert r.returncode == 0 and "XID 79 on 0000:5d:00" in r.stdout, r.stderr
    v = one_pass(host, f, mon)  # the same reader, the same log: the old record does not come back
    assert v.ready, v.message()
    assert "gpu-tune set-healthy --gpu 3: XID 79 on 0000:5d:00" in next(c for c in v.checks if c.name == "gpu.xid").detail
    v = one_pass(host, f, HealthMonitor(HostFS(host)))  # nor for a new reader of the whole log
    assert v.ready, v.message()
    # a new one after the clear counts again
    _append_kmsg(XID79.format(seq=92, usec=86_500_000_000))(host)  # after the clear (uptime 86,400 s)
    assert one_pass(host, f, mon).reason() == "FatalXid"


def test_the_same_fatal_xid_in_a_third_boot_says_inspect_the_hardware(host, tmp_path):
    f = gpu_json(tmp_path)
    for boot in range(3):
        (host / "proc/sys/kernel/random/boot_id").write_text(f"00000000-0000-4000-8000-00000000000{boot}\n")
        (host / "dev/kmsg").write_text(hostgen.KMSG_BOOT + XID79.format(seq=90, usec=88310022))
        v = one_pass(host, f, HealthMonitor(HostFS(host)))
        c = next(c for c in v.checks if c.name == "gpu.xid")
        assert not c.ok
        assert ("inspect the hardware" in c.detail) == (boot == 2), (boot, c.detail)
    assert "seen in 3 boots" in c.detail


def test_the_node_label_clears_once_per_value(host, tmp_path):
    """A value of gpu-tune.io/set-healthy the agent has not acted on clears what is recorded up to
    now (the fixture's uptime: 86,400 s); the same value again clears nothing."""
    f = gpu_json(tmp_path)
    mon = HealthMonitor(HostFS(host))
    _append_kmsg(XID79.format(seq=90, usec=88310022))(host)
    assert one_pass(host, f, mon).reason() == "FatalXid"
    assert one_pass(host, f, mon, clear=["2026-11-26a"]).ready
    _append_kmsg(XID79.format(seq=91, usec=86_500_000_000))(host)  # after the clear
    assert one_pass(host, f, mon, clear=["2026-11-26a"]).reason() == "FatalXid"  # acted on already
    assert one_pass(host, f, mon, clear=["2026-11-26b"]).ready


def test_nvml_events_count_once_and_clear(host, tmp_path):
    f = gpu_json(tmp_path, _gpu(1, xid_events=[48, 13]))
    mon = HealthMonitor(HostFS(host))
    v = one_pass(host, f, mon)
    c = next(c for c in v.checks if c.name == "gpu.xid")
    assert not c.ok and "XID 48" in c.detail and "NVML events" in c.detail and "XID 13" not in c.detail
    HealthState(HostFS(host)).clear(None, uptime_usec=None, why="test")
    assert one_pass(host, f, mon).ready  # the same events: seen before the clear
    f2 = gpu_json(tmp_path, _gpu(1, xid_events=[48, 13, 48]))
    assert one_pass(host, f2, mon).reason() == "FatalXid"  # one more


def test_recovery_a_failing_check_passes_again_when_its_cause_is_gone(host, tmp_path):
    mon = HealthMonitor(HostFS(host))
    bad = gpu_json(tmp_path, lambda d: (
        _gpu(0, recovery_action="reset")(d),
        _gpu(1, remapped_rows={"correctable": 0, "uncorrectable": 0, "pending": True, "failure": False})(d)))
    _host_file(f"{IB0}/state", "1: DOWN\n")(host)
    v = one_pass(host, bad, mon)
    assert {c.name for c in v.failed} == {"gpu.recovery", "gpu.memory", "network.infiniband"}
    _host_file(f"{IB0}/state", "4: ACTIVE\n")(host)
    good = tmp_path / "good.json"
    good.write_text((Path(__file__).parent / "fixtures/gpu/dgx-8gpu.json").read_text())
    v = one_pass(host, good, mon)
    assert v.ready, v.message()
    assert any(c.name == "network.link_flaps" and not c.ok and c.severity == "warning" for c in v.checks)


def test_a_slowdown_is_fatal_only_over_six_of_ten_minutes(host, tmp_path):
    clock = Clock()
    mon = HealthMonitor(HostFS(host), clock=clock)
    slow = gpu_json(tmp_path, _gpu(2, clock_event_reasons=["hw_power_brake_slowdown"]))
    for minute in range(6):
        v = one_pass(host, slow, mon)
        by = {c.name: c for c in v.checks}
        if minute < 5:
            assert v.ready and not by["gpu.clocks"].ok, minute
        clock.t += 60
    assert v.reason() == "GpuSlowedDown" and "hw_power_brake_slowdown in 6 of the last 10 min" in v.message()
    ok = tmp_path / "ok.json"
    ok.write_text((Path(__file__).parent / "fixtures/gpu/dgx-8gpu.json").read_text())
    for _ in range(5):  # the window slides past the slowdown
        clock.t += 60
        v = one_pass(host, ok, mon)
    assert v.ready, v.message()


def test_pcie_replays_above_the_rate_warn(host, tmp_path):
    clock = Clock()
    mon = HealthMonitor(HostFS(host), clock=clock)
    one_pass(host, gpu_json(tmp_path, _gpu(4, pcie_replay_count=100)), mon)
    clock.t += 120
    v = one_pass(host, gpu_json(tmp_path, _gpu(4, pcie_replay_count=160)), mon)  # 30/min; Gen5 x16: 30.72/min
    assert not any(c.name == "gpu.pcie_errors" for c in v.checks)
    clock.t += 60
    v = one_pass(host, gpu_json(tmp_path, _gpu(4, pcie_replay_count=400)), mon)  # 100/min over 3 min
    c = next(c for c in v.checks if c.name == "gpu.pcie_errors")
    assert not c.ok and c.severity == "warning" and v.ready and "above 30.72/min (Gen5 x16)" in c.detail


def test_state_file_that_is_not_ours_is_set_aside_with_a_warning(host, tmp_path):
    p = host / "var/lib/gpu-tune/health.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("[1, 2")
    v = one_pass(host, gpu_json(tmp_path), HealthMonitor(HostFS(host)))
    c = next(c for c in v.checks if c.name == "gpu.health_state")
    assert not c.ok and c.severity == "warning" and v.ready and "a new one is started" in c.detail
    assert json.loads(p.read_text())["version"] == 1


def test_catalog_rows_and_sources():
    cat = catalog()
    assert cat.version and cat.source.startswith("https://docs.nvidia.com/deploy/xid-errors/")
    assert {x for x in (46, 62, 110, 136, 140, 143, 155, 156, 158) if cat.xid(x).action == "reset_gpu"} == {
        46, 62, 110, 136, 140, 143, 155, 156, 158}
    assert all(cat.xid(x) is not None for x in range(144, 151))
    assert cat.xid(144).fatal_for("SAW_MVB Fatal XC0 i0 Link 01") and not cat.xid(144).fatal_for("RLW Nonfatal XC1")
    assert cat.xid(1).unused and not cat.xid(1).fatal  # not expected on A100..GB200: never gating
    assert cat.sxid(12020).action == "reboot" and cat.sxid(12028).action == "ignore"


# -- the NVML code path, through the real nvidia-ml-py over a fake C library (tests/nvmlfake.py) --------
def nvml_gpus(monkeypatch, per_gpu: dict | None = None):
    from tests import nvmlfake

    gpus = nvmlfake.hgx_h100(2)
    for i, kw in (per_gpu or {}).items():
        gpus[i] = dataclasses.replace(gpus[i], **kw)
    b, _ = nvmlfake.backend(monkeypatch, gpus)
    try:
        return b.gpus()
    finally:
        b.close()


def test_nvml_reads_every_health_field(monkeypatch):
    g0, g1 = nvml_gpus(monkeypatch)
    assert (g0.recovery_action, g0.reset_required, g0.inforom_valid) == ("none", False, True)
    assert (g0.remapped_rows.pending, g0.remapped_rows.failure, g0.sram_ecc.uncorrected) == (False, False, 0)
    assert len(g0.nvlink) == 18 and all(link.active for link in g0.nvlink)
    assert g0.nvlink_p2p == (("0000:2a:00.0", True),) and g0.fabric.state == "completed"
    assert (g0.pcie_replay_count, g0.sm_clock_mhz, g0.sm_clock_max_mhz) == (0, 1980, 1980)
    v = verdict(profile=load_profile("training"), audit={"settings": []}, gpus=[g0, g1], probes=[{"gpu": "0", "passed": True}])
    assert v.ready, v.message()


@pytest.mark.parametrize("gpu1, reason, words", [
    ({"recovery": 4}, "GpuResetRequired", "NVML recovery action drain_and_reset"),
    ({"reset_required": True}, "GpuResetRequired", 'NVML answers "GPU requires reset"'),
    ({"remap": (0, 3, 1, 0)}, "GpuMemoryErrors", "a row remapping is pending"),
    ({"remap": (0, 600, 0, 1)}, "GpuMemoryErrors", "row remapping failed"),
    ({"sram": (1, 0, 0)}, "GpuMemoryErrors", "1 uncorrected SRAM ECC error(s)"),
    ({"sram": (0, 0, 1)}, "GpuMemoryErrors", "SRAM ECC error threshold is exceeded"),
    ({"links": [True] * 17 + [False]}, "NvlinkDown", "17 of 18 NVLinks active (down: 17)"),
    ({"p2p": {0: 1}}, "NvlinkDown", "no P2P over NVLink to 0000:18:00.0"),
    ({"fabric": (2, 0, 0, 0)}, "FabricNotReady", "fabric registration in progress"),
    ({"fabric": (3, 999, 0, 0)}, "FabricNotReady", "fabric registration failed"),
    ({"clock_reasons": 0x80, "temperature": 99}, "GpuSlowedDown", "temperature above 87 C"),
])
def test_nvml_failures_are_judged(monkeypatch, gpu1, reason, words):
    g0, g1 = nvml_gpus(monkeypatch, {1: gpu1})
    exp = expectations(load_profile("training"), load_baselines(), [g0, g1])
    assert (exp.gpus, exp.nvlink_active_per_gpu) == (8, 18)  # an H100 on an NVSwitch baseboard
    exp = dataclasses.replace(exp, gpus=2)  # as a profile's readiness.expect.gpus would
    v = verdict(profile=load_profile("training"), audit={"settings": []}, gpus=[g0, g1], expect=exp,
                probes=[{"gpu": "0", "passed": True}])
    assert not v.ready and v.reason() == reason, v.message()
    assert words in v.message() or words in v.most_urgent().detail, (v.message(), v.most_urgent().detail)
    assert dict(v.most_urgent().gpus).get("0", True) is True  # GPU 0 is not blamed


def test_nvml_without_the_health_calls_reports_nothing_rather_than_healthy(monkeypatch):
    """An older driver without the calls (the binding raises its own FunctionNotFound): the fields
    stay None, nothing is "not read", and no family says "healthy" for what it did not read."""
    from tests import nvmlfake

    missing = frozenset({"nvmlDeviceGetFieldValues", "nvmlDeviceValidateInforom", "nvmlDeviceGetSramEccErrorStatus",
                         "nvmlDeviceGetMemoryErrorCounter", "nvmlDeviceGetNvLinkState", "nvmlDeviceGetGpuFabricInfoV",
                         "nvmlDeviceGetGpuFabricInfo", "nvmlDeviceGetPcieReplayCounter"})
    b, _ = nvmlfake.backend(monkeypatch, nvmlfake.hgx_h100(1), missing=missing)
    (g,) = b.gpus()
    b.close()
    assert (g.recovery_action, g.inforom_valid, g.sram_ecc, g.nvlink, g.fabric, g.pcie_replay_count) == (None,) * 6
    assert g.unread == ()
    v = verdict(profile=load_profile("training"), audit={"settings": []}, gpus=[g], probes=[])
    names = {c.name: c for c in v.checks}
    assert not set(names) & {"gpu.inforom", "gpu.fabric"}
    assert names["gpu.recovery"].detail == "no GPU requires a reset (NVML reports no recovery action here)"


# -- node auto-repair: the hardware condition -------------------------------------------------------
def test_the_hardware_condition_is_false_only_on_a_hardware_fault():
    from gpu_tune.cluster.labels import desired_node_state
    from gpu_tune.cluster.node_diff import plan_node
    from gpu_tune.gpu.base import GpuInfo
    from gpu_tune.cluster.node_state import hardware as hardware_condition

    def gpu(**kw):
        return GpuInfo(index=0, uuid="u", name="NVIDIA H100 80GB HBM3", pci_bus_id="0000:18:00.0", **kw)

    drift = {"settings": [{"id": "sysctl.vm.swappiness", "target": "host", "current": "60", "desired": "0",
                           "status": "drift", "detail": ""}]}
    prof = load_profile("training")
    tuned_out = verdict(profile=prof, audit=drift, gpus=[gpu()], probes=[])
    assert not tuned_out.ready and tuned_out.hardware().ready  # drift and no probe: not the hardware's fault
    broken = verdict(profile=prof, audit=drift, gpus=[gpu(recovery_action="reboot")], probes=[])
    hw = broken.hardware()
    assert not hw.ready and hw.reason() == "GpuResetRequired" and hw.message().startswith("gpu.recovery: GPU 0")
    assert "tuning.compliant" not in hw.message()
    want = desired_node_state(profile="training", ready=broken.ready, reason=broken.reason(), message=broken.message(),
                              topology={}, gpus=[], driver_version=None,
                              hardware=hardware_condition("AcceleratedHardwareReady", broken))
    (cond,) = want.more_conditions
    assert (cond["type"], cond["status"], cond["reason"]) == ("AcceleratedHardwareReady", "False", "GpuResetRequired")
    node = {"metadata": {"name": "n"}, "status": {"conditions": []}}
    plan = plan_node(node, want)
    assert [c["type"] for c in plan.conditions] == ["GPUHostReady", "AcceleratedHardwareReady"]
    node["status"]["conditions"] = plan.conditions
    assert plan_node(node, want).conditions == []  # written once: a steady pass writes nothing
    assert hardware_condition(None, broken) is None


def test_a_bad_hardware_condition_type_is_exit_2(cli):
    for bad in ("Ready", "GPUHostReady", "not-camel", "x" * 80):
        r = cli("serve", "--no-kube", "--hardware-condition", bad, "--port", "1")
        assert r.returncode == 2 and "--hardware-condition" in r.stderr, (bad, r.stderr)


def test_the_fleet_view_leads_with_the_most_urgent_check_and_names_warnings():
    """The summary annotation lists failing fatal checks most urgent first, warnings by name; the
    fleet's why column reads them in that order."""
    import time as _time

    from gpu_tune.cluster.fleet import NOT_READY, fleet_report, render_table
    from gpu_tune.cluster.labels import desired_node_state
    from gpu_tune.gpu.base import GpuInfo
    from tests.fixtures.fleet import agent_node

    gpus = [GpuInfo(index=0, uuid="u0", name="NVIDIA H100 80GB HBM3", pci_bus_id="0000:18:00.0", inforom_valid=False,
                    remapped_rows=None),
            GpuInfo(index=1, uuid="u1", name="NVIDIA H100 80GB HBM3", pci_bus_id="0000:19:00.0", error="GPU is lost",
                    error_kind="lost")]
    drift = {"settings": [{"id": "sysctl.vm.swappiness", "target": "host", "current": "60", "desired": "0",
                           "status": "drift", "detail": ""}]}
    v = verdict(profile=load_profile("training"), audit=drift, gpus=gpus, probes=[{"gpu": "0", "passed": True}])
    want = desired_node_state(profile="training", ready=v.ready, reason=v.reason(), message=v.message(),
                              topology={}, gpus=[g.as_dict() for g in gpus], driver_version=None, checks=v.checks,
                              audit=drift)
    now = _time.time()
    node = agent_node("gpu-a", want, now=now)
    report = fleet_report([{"metadata": {"name": node["name"], "labels": node["labels"],
                                         "annotations": node["annotations"]},
                            "status": {"conditions": node["conditions"]}}], now=now)
    (row,) = report.nodes
    assert row.status == NOT_READY
    assert [f["check"] for f in row.failing] == ["gpu.present", "tuning.compliant"]  # not the listing order
    assert row.warnings == ("gpu.inforom",)
    assert "gpu.present: GPU 1 (0000:19:00.0) is lost" in render_table(report) and "warnings: gpu.inforom" in \
        render_table(report)


@pytest.mark.parametrize("expect, words", [
    ("{gpus: -1}", "gpus"),
    ("{ib_ports: [\"mlx5 0\"]}", "not an InfiniBand port"),
    ("{ib_ports: true}", "boolean"),
    ("{ib_rate_gbps: 0}", "ib_rate_gbps"),
    ("{nvlinks: 18}", "nvlinks"),
])
def test_readiness_expect_is_checked(cli, host, tmp_path, expect, words):
    d = tmp_path / "pol"
    d.mkdir()
    (d / "p.yaml").write_text(f"include: training.yaml\nreadiness:\n  expect: {expect}\n")
    r = cli("check", "--root", str(host), "--policy-dir", str(d), "--profile", "p")
    assert r.returncode == 2 and words in r.stderr and "p.yaml" in r.stderr, r.stderr


def test_a_profile_overrides_the_models_expectations(host, tmp_path):
    from gpu_tune.tune.profile import Profile

    f = gpu_json(tmp_path, _link_down(0, range(6, 18)))  # 6 links up on every... GPU 0 only
    backend = select_backend("fixture", str(f))
    gpus = backend.gpus()
    fewer = Profile(name="t", readiness={"expect": {"nvlink_active_per_gpu": 6, "gpus": 8}})
    exp = expectations(fewer, load_baselines(), gpus)
    assert (exp.gpus, exp.nvlink_active_per_gpu) == (8, 6) and "profile t readiness.expect" in exp.source
    v = verdict(profile=fewer, audit={"settings": []}, gpus=gpus, probes=[{"gpu": "0", "passed": True}], expect=exp)
    assert next(c for c in v.checks if c.name == "gpu.nvlink").ok
    v = verdict(profile=fewer, audit={"settings": []}, gpus=gpus, probes=[{"gpu": "0", "passed": True}],
                expect=expectations(load_profile("training"), load_baselines(), gpus))
    assert v.reason() == "NvlinkDown" and "GPU 0: 6 of 18 NVLinks active" in v.message()
