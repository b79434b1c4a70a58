"""Prometheus exposition: golden files compared whole (GPU_TUNE_REGEN_GOLDEN=1 rewrites them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpu_tune import __version__
from gpu_tune.serve.snapshot import CollectorStatus, Snapshot
from gpu_tune.serve.metrics import FAMILIES, GPU_LABELS, SnapshotCollector, make_registry, nvml_bus_id, render_metrics
from gpu_tune.tune.profile import Profile
from gpu_tune.judge.readiness import verdict

from .fixtures.probes import PEER_GROUP, count_series, probe_result, probe_verdict, probed_pass
from .test_readiness import AUDIT_DRIFT, Pub, h100

GOLDEN = Path(__file__).parent / "golden"
# What the default exposition is made of (docs/monitoring.md, "Cardinality"): per GPU with a full
# probe result, its NUMA node, PCIe generation and width (current and max), accuracy, fingerprint,
# images/s per regime, the device-bound busy ratio, host-to-GPU and GPU-to-host bandwidth from the
# GPU's own NUMA node, the GPU's memory bandwidth, probe duration and last success; besides: build
# info and ready; the health readings of a healthy GPU (its active NVLinks; error counters only when
# they are not 0) and one series per InfiniBand port. Nothing is per CPU or per IRQ. --metrics-detail
# adds a series per setting target, the success and duration of each stage, and per GPU the
# launch-bound busy ratio, the bandwidth from the remote NUMA node and the probe's phases.
SERIES_PER_GPU = 1 + 2 + 2 + 1 + 1 + 2 + 1 + 2 + 1 + 1 + 1 + 1
SERIES_FIXED = 3  # build_info, ready, profile_info
# The 8-GPU, 224-CPU fixture with the default flags: 150 before the health checks and the data path;
# the health checks add a check_ok series per family (about 10), the active NVLinks per GPU and one
# per InfiniBand port; the data path 3 per GPU; the operator's policy one severity series per check.
SERIES_BUDGET = 245
T0 = 1735689600.0  # 2025-01-01T00:00:00Z

TOPOLOGY = {
    "numa_nodes": [{"id": 0}, {"id": 1}],
    "gpus": [
        {"index": 0, "uuid": "GPU-00000000", "name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "0000:18:00.0",
         "numa_node": 0, "pcie": {"gen_current": 5, "gen_max": 5, "width_current": 16, "width_max": 16,
                                  "degraded": False}},
        {"index": 1, "uuid": "GPU-00000001", "name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "0000:19:00.0",
         "numa_node": 1, "pcie": {"gen_current": 4, "gen_max": 5, "width_current": 16, "width_max": 16,
                                  "degraded": True}},
    ],
    "nics": [], "warnings": [],
}


def snapshot(*, lost: bool = False, metrics_detail: bool = False, audit: dict | None = None) -> Snapshot:
    # GPU 1 is busy: its link below the top generation is a fault, not idle power saving
    gpus = [h100(0), h100(1, error="Unknown Error", error_kind="lost") if lost else h100(1, utilization_percent=85.0)]
    # GPU 0: a result of the current probe; GPU 1: one saved by an older probe (no regimes, no fingerprint)
    probes = [probe_verdict("0", probe_result()),
              probe_verdict("1", {"accuracy": 0.41, "train_images_per_second": 39000.5}, passed=False, duration=9.0)]
    prof = Profile(name="training")
    audit = AUDIT_DRIFT if audit is None else audit
    v = verdict(profile=prof, audit=audit, gpus=gpus, topology=TOPOLOGY, probes=probes, publish=Pub(True))
    collectors = [CollectorStatus("discover", True, 0.012), CollectorStatus("gpus", not lost, 0.003,
                                                                            "" if not lost else "lost"),
                  CollectorStatus("audit", True, 0.25), CollectorStatus("probe", True, 21.5),
                  CollectorStatus("publish", True, 0.04)]
    return Snapshot.build(node="gpu-node-1", profile="training", verdict=v, since=T0, created=T0 + 60,
                          audit=audit, topology=TOPOLOGY, gpus=[g.as_dict() for g in gpus],
                          probes=probes, probe_last_success={"0": T0 - 3600}, collectors=collectors,
                          metrics_detail=metrics_detail)


def golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("GPU_TUNE_REGEN_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with GPU_TUNE_REGEN_GOLDEN=1"
    assert text == path.read_text(), f"{path} differs (GPU_TUNE_REGEN_GOLDEN=1 to regenerate)"


def normalised(body: bytes) -> str:
    # build_info carries the package version; keep the golden file stable across releases.
    return body.decode().replace(f'version="{__version__}"', 'version="VERSION"')


def test_golden_exposition():
    golden("metrics.prom", normalised(snapshot().metrics_body))


def test_golden_exposition_lost_gpu():
    golden("metrics_lost_gpu.prom", normalised(snapshot(lost=True).metrics_body))


def test_golden_exposition_before_first_pass():
    golden("metrics_empty.prom", normalised(render_metrics(None)))


def samples(body: bytes) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_contract_names_and_dcgm_labels():
    body = snapshot().metrics_body
    names = {k[0] for k in samples(body)}
    for required in ("gpu_tune_ready", "gpu_tune_check_ok", "gpu_tune_setting_compliant", "gpu_tune_setting_targets",
                     "gpu_tune_probe_accuracy", "gpu_tune_probe_fingerprint_info",
                     "gpu_tune_probe_train_images_per_second", "gpu_tune_probe_gpu_busy_ratio",
                     "gpu_tune_probe_duration_seconds", "gpu_tune_probe_last_success_timestamp_seconds",
                     "gpu_tune_gpu_numa_node", "gpu_tune_gpu_pcie_link_generation", "gpu_tune_gpu_pcie_link_width",
                     "gpu_tune_build_info"):
        assert required in names, required
    # opt-in (serve --metrics-detail): per-target and per-stage series
    for detail in ("gpu_tune_setting_target_compliant", "gpu_tune_collector_success",
                   "gpu_tune_collector_duration_seconds"):
        assert detail not in names, detail
    detailed = samples(snapshot(metrics_detail=True).metrics_body)
    assert detailed[("gpu_tune_collector_success", (("collector", "audit"),))] == 1.0
    assert detailed[("gpu_tune_collector_duration_seconds", (("collector", "probe"),))] == 21.5
    s = samples(body)
    gen1 = {k: v for k, v in s.items() if k[0] == "gpu_tune_gpu_pcie_link_generation" and ("gpu", "1") in k[1]}
    labels = dict(next(iter(gen1))[1])
    assert set(labels) == {"gpu", "UUID", "pci_bus_id", "modelName", "Hostname", "numa_node", "kind"}
    assert labels["pci_bus_id"] == "00000000:19:00.0" and labels["Hostname"] == "gpu-node-1"
    assert sorted(gen1.values()) == [4.0, 5.0]
    assert s[("gpu_tune_ready", ())] == 0.0
    assert s[("gpu_tune_setting_compliant", (("id", "sysctl.vm.swappiness"),))] == 0.0
    assert s[("gpu_tune_setting_targets", (("id", "sysctl.vm.swappiness"), ("status", "drift")))] == 1.0
    assert s[("gpu_tune_check_ok", (("check", "gpu.pcie"),))] == 0.0  # GPU 1's link trained down
    failing = {k: v for k, v in s.items() if k[0] == "gpu_tune_gpu_check_failing"}
    assert len(failing) == 1  # only the GPU and check that fail have a series
    (key, value), = failing.items()
    lab = dict(key[1])
    assert (lab["gpu"], lab["check"], lab["severity"], lab["pci_bus_id"], value) == (
        "1", "gpu.pcie", "fatal", "00000000:19:00.0", 1.0)


def gpu_series(body: bytes, name: str, gpu: str) -> dict[tuple, float]:
    """{extra labels (beyond the GPU labels): value} of one family for one GPU."""
    out = {}
    for (n, labels), v in samples(body).items():
        d = dict(labels)
        if n == name and d.get("gpu") == gpu:
            assert {k: d[k] for k in ("UUID", "Hostname")} == {"UUID": f"GPU-{int(gpu):08d}", "Hostname": "gpu-node-1"}
            out[tuple(sorted((k, d[k]) for k in set(d) - set(GPU_LABELS)))] = v
    return out


def test_probe_families_from_the_result_shape():
    body = snapshot().metrics_body
    assert gpu_series(body, "gpu_tune_probe_accuracy", "0") == {(): 0.9812}
    assert gpu_series(body, "gpu_tune_probe_fingerprint_info", "0") == {
        (("fingerprint", "3f2a9c1d"), ("peer_group", PEER_GROUP)): 1.0}
    assert gpu_series(body, "gpu_tune_probe_train_images_per_second", "0") == {
        (("regime", "launch_bound"),): 41234.5, (("regime", "device_bound"),): 98765.0}
    # the device-bound busy ratio by default (a healthy GPU is >= 90 % busy there); both with detail
    assert gpu_series(body, "gpu_tune_probe_gpu_busy_ratio", "0") == {(("regime", "device_bound"),): 0.97}
    assert gpu_series(snapshot(metrics_detail=True).metrics_body, "gpu_tune_probe_gpu_busy_ratio", "0") == {
        (("regime", "launch_bound"),): 0.31, (("regime", "device_bound"),): 0.97}
    assert gpu_series(body, "gpu_tune_probe_duration_seconds", "0") == {(): 12.5}
    assert gpu_series(body, "gpu_tune_probe_last_success_timestamp_seconds", "0") == {(): T0 - 3600}
    # an old saved result: its throughput is the launch-bound regime; no fingerprint, no busy ratio
    assert gpu_series(body, "gpu_tune_probe_train_images_per_second", "1") == {(("regime", "launch_bound"),): 39000.5}
    assert gpu_series(body, "gpu_tune_probe_fingerprint_info", "1") == {}
    assert gpu_series(body, "gpu_tune_probe_gpu_busy_ratio", "1") == {}
    assert gpu_series(body, "gpu_tune_probe_accuracy", "1") == {(): 0.41}


def test_data_path_families_local_by_default_remote_and_phases_with_detail():
    body = snapshot().metrics_body
    assert gpu_series(body, "gpu_tune_probe_h2d_bytes_per_second", "0") == {(("numa", "local"),): 55.2e9}
    assert gpu_series(body, "gpu_tune_probe_d2h_bytes_per_second", "0") == {(("numa", "local"),): 53.1e9}
    assert gpu_series(body, "gpu_tune_probe_memory_bandwidth_bytes_per_second", "0") == {(): 2.61e12}
    assert gpu_series(body, "gpu_tune_probe_phase_seconds", "0") == {}
    detail = snapshot(metrics_detail=True).metrics_body
    assert gpu_series(detail, "gpu_tune_probe_h2d_bytes_per_second", "0") == {
        (("numa", "local"),): 55.2e9, (("numa", "remote"),): 41.5e9}
    phases = gpu_series(detail, "gpu_tune_probe_phase_seconds", "0")
    assert phases[(("phase", "tensorflow_import"),)] == 10.0 and phases[(("phase", "total"),)] == 24.5
    # an older probe's result (GPU 1) has no data path: no series
    assert gpu_series(detail, "gpu_tune_probe_h2d_bytes_per_second", "1") == {}


@pytest.mark.parametrize("path, want", [
    ({}, 0),  # a result of an older probe
    ({"bandwidth": {"status": "not_measured", "reason": "no GPU: bandwidth not measured"},
      "memory_bandwidth": {"status": "not_measured"}}, 0),  # a CPU run
    ({"bandwidth": {"status": "measured", "local": {"status": "measured", "h2d": {"bytes_per_second": "fast"},
                                                    "d2h": {"bytes_per_second": float("nan")}}},
      "memory_bandwidth": {"status": "measured", "bytes_per_second": -1}}, 0),  # not numbers
    ({"bandwidth": {"status": "measured", "local": {"status": "measured", "h2d": {"bytes_per_second": 5e10}},
                    "remote": {"status": "error", "reason": "x"}},
      "memory_bandwidth": {"status": "measured", "bytes_per_second": 2e12}}, 2),  # one direction, and memory
    ({"bandwidth": "garbage", "memory_bandwidth": None}, 0),
])
def test_data_path_families_tolerate_partial_results(path, want):
    snap = Snapshot.build(node="gpu-node-1", profile="training", verdict=verdict(profile=Profile(name="training"),
                          audit=None, gpus=[h100(0)], probes=[]), since=T0, created=T0,
                          gpus=[h100(0).as_dict()], topology=TOPOLOGY, probes=[probe_verdict("0", probe_result(path=path))],
                          metrics_detail=True)
    body = snap.metrics_body
    got = sum(len(gpu_series(body, f, "0")) for f in ("gpu_tune_probe_h2d_bytes_per_second",
                                                      "gpu_tune_probe_d2h_bytes_per_second",
                                                      "gpu_tune_probe_memory_bandwidth_bytes_per_second"))
    assert got == want


@pytest.mark.parametrize("result, want_ips, want_busy, want_fp", [
    # no fingerprint, an empty one, or not a string: no info series
    (probe_result(fingerprint=None), 2, 2, False),
    (probe_result(fingerprint=""), 2, 2, False),
    ({**probe_result(), "fingerprint": 1234}, 2, 2, False),
    # busy fraction missing (a CPU run), out of 0..1, or not a number: no busy series for that regime
    (probe_result(busy_launch=None, busy_device=None), 2, 0, True),
    (probe_result(busy_launch=1.7, busy_device=float("nan")), 2, 0, True),
    (probe_result(busy_launch="0.3"), 2, 1, True),
    # one regime missing; no regime in it (a failed run): the old field, as the probe's judge reads it
    ({**probe_result(), "regimes": {"device_bound": {"images_per_second": 5.0}}}, 1, 0, True),
    ({**probe_result(), "regimes": {}, "train_images_per_second": 7.0}, 1, 0, True),
    ({**probe_result(), "regimes": {}, "train_images_per_second": None}, 0, 0, True),
    # the whole result missing or not a mapping (a crashed probe)
    (None, 0, 0, False),
    ("garbage", 0, 0, False),
])
def test_probe_families_tolerate_partial_results(result, want_ips, want_busy, want_fp):
    snap = Snapshot.build(node="gpu-node-1", profile="training", verdict=verdict(profile=Profile(name="training"),
                          audit=None, gpus=[h100(0)], probes=[]), since=T0, created=T0,
                          gpus=[h100(0).as_dict()], topology=TOPOLOGY, probes=[probe_verdict("0", result)],
                          metrics_detail=True)
    body = snap.metrics_body
    assert len(gpu_series(body, "gpu_tune_probe_train_images_per_second", "0")) == want_ips
    assert len(gpu_series(body, "gpu_tune_probe_gpu_busy_ratio", "0")) == want_busy
    assert bool(gpu_series(body, "gpu_tune_probe_fingerprint_info", "0")) == want_fp
    assert gpu_series(body, "gpu_tune_probe_duration_seconds", "0") == {(): 12.5}


def many_targets_audit() -> dict:
    rows = [{"id": "sysctl.vm.swappiness", "target": "host", "current": "0", "desired": "0", "status": "ok",
             "detail": ""}]
    rows += [{"id": "cpu.governor", "target": f"cpu{i}", "current": "performance", "desired": "performance",
              "status": "ok" if i < 200 else "drift", "detail": ""} for i in range(224)]
    rows += [{"id": "irq.affinity", "target": str(100 + i), "current": "0-55", "desired": "0-55",
              "status": ["ok", "unsupported", "conflict", "error"][i % 4], "detail": ""} for i in range(980)]
    rows += [{"id": "gpu.persistence_mode", "target": str(i), "current": "1", "desired": "1",
              "status": "ok" if i else "unsupported", "detail": ""} for i in range(8)]
    return {"profile": "training", "compliant": False, "settings": rows}


def test_settings_exported_per_setting_with_status_counts():
    s = samples(snapshot(audit=many_targets_audit()).metrics_body)
    compliant = {dict(k)["id"]: v for (n, k), v in s.items() if n == "gpu_tune_setting_compliant"}
    assert compliant == {"sysctl.vm.swappiness": 1.0, "cpu.governor": 0.0, "irq.affinity": 0.0,
                         "gpu.persistence_mode": 1.0}  # unsupported targets count as compliant
    targets = {(dict(k)["id"], dict(k)["status"]): v for (n, k), v in s.items() if n == "gpu_tune_setting_targets"}
    assert targets == {("sysctl.vm.swappiness", "ok"): 1, ("cpu.governor", "ok"): 200, ("cpu.governor", "drift"): 24,
                       ("irq.affinity", "ok"): 245, ("irq.affinity", "unsupported"): 245,
                       ("irq.affinity", "conflict"): 245, ("irq.affinity", "error"): 245,
                       ("gpu.persistence_mode", "ok"): 7, ("gpu.persistence_mode", "unsupported"): 1}
    assert not any(n == "gpu_tune_setting_target_compliant" for n, _ in s)
    # 1,213 targets, 13 series
    assert sum(1 for n, _ in s if n.startswith("gpu_tune_setting_")) == 13


def test_per_target_series_only_with_metrics_detail():
    audit = many_targets_audit()
    s = samples(snapshot(audit=audit, metrics_detail=True).metrics_body)
    per = {(dict(k)["id"], dict(k)["target"]): v for (n, k), v in s.items() if n == "gpu_tune_setting_target_compliant"}
    assert len(per) == len(audit["settings"]) == 1213
    assert per[("cpu.governor", "cpu3")] == 1.0 and per[("cpu.governor", "cpu223")] == 0.0
    assert per[("irq.affinity", "101")] == 1.0 and per[("irq.affinity", "102")] == 0.0  # unsupported, conflict
    # the per-setting families are there too
    assert s[("gpu_tune_setting_compliant", (("id", "cpu.governor"),))] == 0.0


def test_collector_describes_without_collecting():
    calls = []

    def source():
        calls.append(1)
        return None

    reg = make_registry(source)
    assert calls == []  # registering used describe(), not collect()
    assert {f.name for f in SnapshotCollector(source).describe()} == set(FAMILIES)
    reg.get_sample_value("gpu_tune_build_info", {"version": __version__})
    assert calls == [1]


def test_series_budget_on_the_8_gpu_224_cpu_fixture(tmp_path):
    """The real agent pass over the DGX-like fixture (224 CPUs, 8 GPUs, 8 NICs, 984 IRQs: 1,225 audit
    rows), every GPU probed with a full result: the default exposition stays under the budget and
    does not grow with CPUs or IRQs; --metrics-detail adds one series per target."""
    snap = probed_pass(tmp_path / "default")
    rows = len(snap.audit["settings"])
    ids = len({s["id"] for s in snap.audit["settings"]})
    assert rows > 1200 and ids >= 10
    per_family = count_series(snap.metrics_body)
    total = sum(per_family.values())
    pairs = len({(s["id"], s["status"]) for s in snap.audit["settings"]})
    checks = len(snap.verdict.checks)
    ib_ports = 8
    assert total == SERIES_FIXED + 2 * checks + ids + pairs + 8 * SERIES_PER_GPU + ib_ports, per_family
    assert per_family["gpu_tune_check_severity_info"] == per_family["gpu_tune_check_ok"] == checks
    assert total <= SERIES_BUDGET, per_family
    assert per_family["gpu_tune_setting_compliant"] == ids
    assert per_family["gpu_tune_setting_targets"] == pairs <= 2 * ids
    assert total < rows / 6  # ~1,460 audit rows: a series per GPU and check family, never per CPU or IRQ
    assert "gpu_tune_setting_target_compliant" not in per_family
    gpu_families = [n for n in per_family if n.startswith(("gpu_tune_gpu_", "gpu_tune_probe_"))]
    assert all(per_family[n] <= 2 * 8 for n in gpu_families)  # per GPU (x2: kind or regime)

    full = count_series(probed_pass(tmp_path / "targets", metrics_detail=True).metrics_body)
    assert full["gpu_tune_setting_target_compliant"] == rows
    stages = full["gpu_tune_collector_success"]
    assert stages == full["gpu_tune_collector_duration_seconds"] >= 4
    assert full["gpu_tune_probe_gpu_busy_ratio"] == 2 * per_family["gpu_tune_probe_gpu_busy_ratio"] == 16
    assert full["gpu_tune_probe_h2d_bytes_per_second"] == 2 * per_family["gpu_tune_probe_h2d_bytes_per_second"] == 16
    phases = full["gpu_tune_probe_phase_seconds"]
    assert phases == 8 * 7  # the 7 phases the fixture's results time
    assert sum(full.values()) == total + rows + 2 * stages + 8 + 16 + phases


@pytest.mark.parametrize("given,want", [("0000:18:00.0", "00000000:18:00.0"), ("0000:af:00.0", "00000000:AF:00.0"),
                                        ("00000000:3B:00.0", "00000000:3B:00.0"), (None, "")])
def test_nvml_bus_id(given, want):
    assert nvml_bus_id(given) == want


@pytest.mark.parametrize("result", [
    probe_result(), probe_result(busy_launch=None), {"accuracy": 0.9, "train_images_per_second": 5000.0},
    {**probe_result(), "regimes": {}, "train_images_per_second": 7.0}, {"regimes": {}}, {},
    {**probe_result(), "regimes": {"device_bound": {"images_per_second": 5.0}}},
])
def test_metrics_read_the_regimes_as_the_probe_judge_does(result):
    """The exposition and the summary annotation read a result's throughput the way the probe's
    own judge does (gpu_tune/judge/probe/judge.py), old saved results included."""
    from gpu_tune.judge.probe.judge import regime_figures
    from gpu_tune.judge.figures import throughput

    judged = {k: v.get("images_per_second") for k, v in regime_figures(result).items()
              if v.get("images_per_second") is not None}
    assert {k: v["images_per_second"] for k, v in throughput(result).items()} == judged
