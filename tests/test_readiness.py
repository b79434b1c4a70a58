"""The readiness verdict: every check, its reason, and the profile switches."""

from __future__ import annotations

from gpu_tune.gpu.base import GpuInfo
from gpu_tune.tune.profile import Profile
from gpu_tune.judge.readiness import BUSY_UTILIZATION_PERCENT, Check, Verdict, verdict
from gpu_tune.judge.checks.catalog import catalog


def h100(index: int = 0, **kw) -> GpuInfo:
    base = dict(index=index, uuid=f"GPU-{index:08d}", name="NVIDIA H100 80GB HBM3",
                pci_bus_id=f"0000:{0x18 + index:02x}:00.0", persistence_mode=True,
                pcie_link_gen_current=5, pcie_link_gen_max=5, pcie_link_width_current=16,
                pcie_link_width_max=16, ecc_mode=True, ecc_uncorrected_volatile=0,
                retired_pages_pending=False, temperature_c=34.0, clock_throttle_reasons=(), xid_events=())
    base.update(kw)
    return GpuInfo(**base)


AUDIT_OK = {"profile": "training", "compliant": True, "settings": [
    {"id": "sysctl.vm.swappiness", "target": "host", "current": "0", "desired": "0", "status": "ok", "detail": ""},
    {"id": "cpu.governor", "target": "cpu0", "current": None, "desired": "performance",
     "status": "unsupported", "detail": "no cpufreq"}]}
AUDIT_DRIFT = {"profile": "training", "compliant": False, "settings": [
    {"id": "sysctl.vm.swappiness", "target": "host", "current": "60", "desired": "0", "status": "drift", "detail": ""},
    {"id": "irq.affinity", "target": "120", "current": "0-3", "desired": "0-1", "status": "conflict",
     "detail": "irqbalance is running (pid 812)"}]}
PROBE_OK = [{"gpu": "0", "status": "passed", "passed": True, "reasons": [], "finished_at": "2025-01-01T00:00:00Z",
             "duration_seconds": 12.5, "result": {"accuracy": 0.97, "train_images_per_second": 41000.0}}]


class Pub:
    def __init__(self, ok: bool, detail: str = "") -> None:
        self.ok, self.detail, self.writes, self.changed = ok, detail, 0, False


def by_name(v: Verdict) -> dict[str, Check]:
    return {c.name: c for c in v.checks}


GPU_FAMILIES = ("gpu.present", "gpu.xid", "gpu.recovery", "gpu.memory", "gpu.nvlink", "gpu.fabric", "gpu.pcie",
                "gpu.thermal")


def gpu_problems(gpu: GpuInfo, *, max_temperature_c: float | None = 87.0) -> list[str]:
    """The failing fatal GPU checks' details for one GPU (empty: healthy)."""
    prof = Profile(name="training", readiness={"max_temperature_c": max_temperature_c or 120})
    v = verdict(profile=prof, audit=AUDIT_OK, gpus=[gpu], probes=PROBE_OK)
    return [c.detail for c in v.checks if c.name in GPU_FAMILIES and not c.ok and c.gating]


def test_all_good_is_ready():
    v = verdict(profile=Profile(name="training"), audit=AUDIT_OK, gpus=[h100(0), h100(1)],
                probes=PROBE_OK, publish=Pub(True, "2 writes"))
    assert v.ready, v.failed
    assert [c.name for c in v.checks] == ["tuning.compliant", "gpu.present", "gpu.count", "gpu.readings", "gpu.xid",
                                          "gpu.memory", "gpu.pcie", "gpu.thermal", "topology.published",
                                          "probe.0.passed"]
    assert "accuracy 0.970" in by_name(v)["probe.0.passed"].detail
    assert v.reason() == "AllChecksPassed"
    assert all(c.severity == "fatal" for c in v.checks if c.name != "gpu.readings")


def test_drift_names_rows_and_fix():
    v = verdict(profile=Profile(name="training"), audit=AUDIT_DRIFT, gpus=[], probes=PROBE_OK)
    c = by_name(v)["tuning.compliant"]
    assert not v.ready and not c.ok
    assert "sysctl.vm.swappiness[host] drift: 60 != 0" in c.detail
    assert "irqbalance is running" in c.detail and "gpu-tune apply" in c.detail
    assert v.reason() == "TuningNotCompliant"


def test_require_compliant_false_keeps_finding_in_detail():
    prof = Profile(name="training", readiness={"require_compliant": False, "require_probe": False})
    v = verdict(profile=prof, audit=AUDIT_DRIFT, gpus=[], probes=[])
    assert v.ready
    assert by_name(v)["tuning.compliant"].detail.startswith("ignored")
    assert by_name(v)["probe.ran"].detail.startswith("ignored")


def test_each_gpu_problem_is_reported():
    assert gpu_problems(h100()) == []
    lost = gpu_problems(h100(error="GPU is lost", error_kind="lost"))
    assert len(lost) == 1 and "lost" in lost[0] and "drain" in lost[0]
    # persistence mode is a tuning setting (gpu.persistence_mode in the audit), never a GPU's health
    assert gpu_problems(h100(persistence_mode=False)) == []
    assert any("2 uncorrected ECC" in p for p in gpu_problems(h100(ecc_uncorrected_volatile=2)))
    assert any("page retirement is pending" in p for p in gpu_problems(h100(retired_pages_pending=True)))
    xid = gpu_problems(h100(xid_events=(13, 79)))
    assert len(xid) == 1 and "XID 79 GPU has fallen off the bus" in xid[0] and "XID 13" not in xid[0]
    assert gpu_problems(h100(xid_events=(13, 31, 43))) == []  # application faults
    link = gpu_problems(h100(pcie_link_gen_current=3, pcie_link_width_current=8))
    assert link and "Gen3 of Gen5" in link[0] and "x8 of x16" in link[0]
    busy = gpu_problems(h100(pcie_link_gen_current=3, utilization_percent=80.0))
    assert busy and "Gen3 of Gen5 at 80% utilization" in busy[0]
    # a slowdown seen once is a warning; the agent's window makes it fatal (tests/test_health.py)
    v = verdict(profile=Profile(name="training"), audit=AUDIT_OK, gpus=[h100(clock_throttle_reasons=("hw_thermal_slowdown",))],
                probes=PROBE_OK)
    assert v.ready and not by_name(v)["gpu.clocks"].ok and by_name(v)["gpu.clocks"].severity == "warning"
    assert gpu_problems(h100(clock_throttle_reasons=("gpu_idle",))) == []
    assert any("above 87" in p for p in gpu_problems(h100(temperature_c=91.0), max_temperature_c=87))


def test_catalog_says_which_xids_are_fatal():
    """NVIDIA's catalog, not a list of our own: application faults and informational XIDs never
    make a node not ready; a reset, a reboot or a hardware check does."""
    cat = catalog()
    for code in (13, 31, 43, 45, 63, 92, 94):
        assert cat.xid(code) is not None and not cat.xid(code).fatal, code
    for code in (79, 48, 119, 140):
        assert cat.xid(code).fatal, code
    for code in (13, 31, 43, 45, 63, 92, 94):
        assert gpu_problems(h100(xid_events=(code,))) == [], code
    for code in (79, 48, 119, 140):
        assert gpu_problems(h100(xid_events=(code,))), code


def test_topology_pcie_overrides_backend_fields():
    topo = {"gpus": [{"index": 0, "pci_bus_id": "0000:18:00.0",
                      "pcie": {"gen_current": 4, "gen_max": 5, "width_current": 16, "width_max": 16}}]}
    v = verdict(profile=Profile(name="training"), audit=AUDIT_OK, gpus=[h100(0, utilization_percent=95.0)],
                topology=topo, probes=PROBE_OK)
    c = by_name(v)["gpu.pcie"]
    assert not c.ok and "Gen4 of Gen5 at 95% utilization" in c.detail
    topo["gpus"][0]["pcie"]["width_current"] = 8  # sysfs says narrower than the backend does
    c = by_name(verdict(profile=Profile(name="training"), audit=AUDIT_OK, gpus=[h100(0)], topology=topo,
                        probes=PROBE_OK))["gpu.pcie"]
    assert not c.ok and "x8 of x16" in c.detail


def test_idle_gpu_at_lower_pcie_generation_passes_with_a_note():
    """GPUs lower the link generation when idle (power saving): only width, or generation under load, fails."""
    for util in (0.0, 9.5, None):
        g = h100(0, pcie_link_gen_current=1, utilization_percent=util)
        assert gpu_problems(g) == [], util
        v = verdict(profile=Profile(name="training"), audit=AUDIT_OK, gpus=[g], probes=PROBE_OK)
        c = by_name(v)["gpu.pcie"]
        assert v.ready and c.ok
        assert "PCIe link at Gen1 of Gen5 while" in c.detail and "judged only under load" in c.detail
        assert ("utilization unknown" if util is None else f"idle ({util:g}% utilization)") in c.detail
    assert "Gen" not in by_name(verdict(profile=Profile(name="training"), audit=AUDIT_OK, gpus=[h100(0)],
                                        probes=PROBE_OK))["gpu.pcie"].detail
    # at the threshold the GPU counts as busy
    busy = gpu_problems(h100(0, pcie_link_gen_current=4, utilization_percent=float(BUSY_UTILIZATION_PERCENT)))
    assert len(busy) == 1 and f"Gen4 of Gen5 at {BUSY_UTILIZATION_PERCENT}% utilization" in busy[0]
    # a narrow link fails whatever the load, and names the generation too
    narrow = gpu_problems(h100(0, pcie_link_gen_current=3, pcie_link_width_current=8, utilization_percent=0.0))
    assert len(narrow) == 1 and "Gen3 of Gen5" in narrow[0] and "x8 of x16" in narrow[0]
    only_width = gpu_problems(h100(0, pcie_link_width_current=4, utilization_percent=0.0))
    assert len(only_width) == 1 and "x4 of x16" in only_width[0] and "Gen" not in only_width[0]
    # a lost GPU gets no link note
    v = verdict(profile=Profile(name="training"), audit=AUDIT_OK, probes=PROBE_OK,
                gpus=[h100(0, pcie_link_gen_current=1, error="Unknown Error", error_kind="lost")])
    assert "gpu.pcie" not in by_name(v)  # a lost GPU reads nothing else
    assert not by_name(v)["gpu.present"].ok


def test_lost_gpu_fails_only_that_gpu():
    v = verdict(profile=Profile(name="training"), audit=AUDIT_OK,
                gpus=[h100(0), h100(1, error="Unknown Error", error_kind="lost")], probes=PROBE_OK)
    c = by_name(v)["gpu.present"]
    assert not c.ok and c.gpus == (("0", True), ("1", False)) and "GPU 1" in c.detail and "GPU 0" not in c.detail
    assert by_name(v)["gpu.memory"].gpus == (("0", True),)  # the lost GPU is judged by presence only
    assert not v.ready and v.reason() == "GpuLost"


def test_stage_errors_become_failed_checks():
    v = verdict(profile=Profile(name="training"), audit=None, gpus=None, probes=None,
                errors={"audit": "HostError: /proc/sys/vm/swappiness: Permission denied (EACCES)",
                        "gpus": "GpuError: NVML not loaded", "discover": "HostError: boom",
                        "probe": "RuntimeError: spawn failed"})
    c = by_name(v)
    assert "audit failed: HostError" in c["tuning.compliant"].detail
    assert "NVML not loaded" in c["gpu.backend"].detail
    assert "topology discovery failed" in c["topology.published"].detail
    assert "probe run failed: RuntimeError" in c["probe.ran"].detail
    assert not any(x.ok for x in v.checks)


def test_probe_timeout_and_publish_forbidden():
    probes = [{"gpu": "0", "status": "timeout", "passed": False, "reasons": ["no result within 300s"],
               "finished_at": "2025-01-01T00:00:00Z", "duration_seconds": 300.0, "result": None}]
    hint = "403 Forbidden: nodes \"n1\" is forbidden; grant patch on nodes/status to the agent's ServiceAccount"
    v = verdict(profile=Profile(name="training"), audit=AUDIT_OK, gpus=[], probes=probes, publish=Pub(False, hint))
    c = by_name(v)
    assert c["probe.0.passed"].detail.startswith("timeout: no result within 300s")
    assert "timeout" in c["probe.0.passed"].detail
    assert not c["topology.published"].ok and "grant patch on nodes/status" in c["topology.published"].detail
    # the most urgent failing check leads, with its figures; the others are named
    assert v.reason() == "ProbeFailed"
    assert v.message() == "probe.0.passed: timeout: no result within 300s; also failing: topology.published"


def test_no_probe_yet_is_not_ready():
    v = verdict(profile=Profile(name="training"), audit=AUDIT_OK, gpus=[], probes=[])
    assert not v.ready and by_name(v)["probe.ran"].detail == "the probe has not completed yet"


def test_a_skipped_probe_that_counts_as_passed_says_why():
    from gpu_tune.judge.checks.probe import Probe

    probe_checks = Probe().checks_of

    mig = {"gpu": "1", "status": "skipped", "passed": True, "result": None,
           "reasons": ["MIG mode is enabled on GPU 1: the probe runs on whole GPUs (not a failure)"]}
    busy = {"gpu": "0", "status": "skipped", "passed": True, "result": {"accuracy": 0.95},
            "reasons": ["GPU 0 is busy: the previous verdict stands"]}
    c1, c0 = probe_checks([mig, busy])
    assert c1.ok and c1.detail == "skipped: " + mig["reasons"][0]
    assert c0.ok and c0.detail == "skipped: GPU 0 is busy: the previous verdict stands; previous run passed (accuracy 0.950)"


# -- the condition: the most urgent failing check, with its figures --------------------------------
class Facts:
    """What the publisher read from the Node."""

    def __init__(self, *, expected=(), cap=None, alloc=None) -> None:
        self.node_read, self.ok, self.detail = True, True, "node read"
        self.gpu_expected, self.gpu_capacity, self.gpu_allocatable = tuple(expected), cap, alloc


def test_a_gpu_node_without_a_visible_gpu_is_named_before_a_drifting_sysctl():
    v = verdict(profile=Profile(name="training"), audit=AUDIT_DRIFT, gpus=[], probes=PROBE_OK,
                last_publish=Facts(expected=("nvidia.com/gpu.present=true",)))
    assert [c.name for c in v.failed][0] == "tuning.compliant"  # listed first, still not the reason
    assert v.reason() == "GpusNotVisible"
    msg = v.message()
    assert msg.startswith("gpu.visible: the Node says it has NVIDIA GPUs (nvidia.com/gpu.present=true) but the "
                          "agent sees none; also failing: tuning.compliant"), msg


def test_the_message_carries_the_device_plugins_figures():
    gpus = [h100(i) for i in range(8)]
    v = verdict(profile=Profile(name="training"), audit=AUDIT_DRIFT, gpus=gpus, probes=PROBE_OK,
                last_publish=Facts(cap=7, alloc=7))
    assert v.reason() == "DevicePluginMissingGpus"
    assert v.message().startswith("gpu.allocatable: 7 of 8 GPUs offered by the device plugin"), v.message()
    assert "also failing: tuning.compliant" in v.message()


def test_urgency_order_and_a_steady_message():
    hot = h100(0, temperature_c=91.0)
    v = verdict(profile=load_profile_training(), audit=AUDIT_DRIFT, gpus=[hot, h100(1)], probes=[])
    assert v.reason() == "GpuSlowedDown"
    assert v.message().startswith("gpu.thermal: GPU 0: temperature above 87 C"), v.message()
    hotter = verdict(profile=load_profile_training(), audit=AUDIT_DRIFT,
                     gpus=[h100(0, temperature_c=93.0), h100(1)], probes=[])
    assert hotter.message() == v.message()  # a reading that moves is not rewritten every pass
    only_drift = verdict(profile=Profile(name="training"), audit=AUDIT_DRIFT, gpus=[], probes=[])
    assert only_drift.reason() == "TuningNotCompliant"  # drift before a probe that has not run yet
    assert only_drift.message().startswith("tuning.compliant: 2 setting(s) not compliant: "
                                           "sysctl.vm.swappiness[host] drift 60 != 0"), only_drift.message()
    assert len(only_drift.message()) <= 512


def load_profile_training():
    from gpu_tune.tune.policy import load_profile

    return load_profile("training")


def test_a_missing_gpu_outranks_tuning_and_the_device_plugin():
    """Urgency by category: a GPU NVML lost (or one missing from the bus) is named before the device
    plugin's count, before a probe, before tuning drift (persistence mode included)."""
    gpus = [h100(i, persistence_mode=False) for i in range(7)] + [h100(7, error="GPU is lost", error_kind="lost")]
    drift = {"profile": "training", "compliant": False, "settings": AUDIT_DRIFT["settings"] + [
        {"id": "gpu.persistence_mode", "target": "0", "current": "off", "desired": "on", "status": "drift",
         "detail": ""}]}
    v = verdict(profile=Profile(name="training"), audit=drift, gpus=gpus, probes=[],
                last_publish=Facts(cap=7, alloc=7))
    assert v.reason() == "GpuLost", v.message()
    assert v.message().startswith("gpu.present: GPU 7 (0000:1f:00.0) is lost"), v.message()
    rest = v.message().split("also failing: ", 1)[1].split(", ")
    assert rest == ["gpu.allocatable", "tuning.compliant", "probe.ran"], rest
    # without the lost GPU: the device plugin's shortfall before the persistence-mode drift
    v2 = verdict(profile=Profile(name="training"), audit=drift, gpus=gpus[:7] + [h100(7)], probes=PROBE_OK,
                 last_publish=Facts(cap=7, alloc=7))
    assert v2.reason() == "DevicePluginMissingGpus" and "tuning.compliant" in v2.message()


def test_warnings_are_reported_and_never_gate():
    v = verdict(profile=Profile(name="training"), audit=AUDIT_OK, probes=PROBE_OK,
                gpus=[h100(0, inforom_valid=False, clock_throttle_reasons=("hw_slowdown",))])
    warn = {c.name for c in v.warnings}
    assert warn == {"gpu.inforom", "gpu.clocks"} and v.ready and v.failed == ()
    assert v.reason() == "AllChecksPassed"
    assert all(c.as_dict()["severity"] == "warning" for c in v.warnings)
