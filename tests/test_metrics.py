"""Prometheus exposition: golden files compared whole (GPU_TUNE_REGEN_GOLDEN=1 rewrites them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent import __version__
from agent.snapshot import CollectorStatus, Snapshot
from agent.metrics import FAMILIES, SnapshotCollector, make_registry, nvml_bus_id, render_metrics
from agent.policy import Profile
from agent.readiness import verdict

from .test_readiness import AUDIT_DRIFT, PROBE_OK, Pub, h100

GOLDEN = Path(__file__).parent / "golden"
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


def snapshot(*, lost: bool = False) -> Snapshot:
    # GPU 1 is busy: its link below the top generation is a fault, not idle power saving
    gpus = [h100(0), h100(1, error="Unknown Error", error_kind="lost") if lost else h100(1, utilization_percent=85.0)]
    probes = PROBE_OK + [{"gpu": "1", "status": "failed", "passed": False, "reasons": ["accuracy 0.41 < 0.90"],
                          "finished_at": "2025-01-01T00:00:00Z", "duration_seconds": 9.0,
                          "result": {"accuracy": 0.41, "train_images_per_second": 39000.5}}]
    prof = Profile(name="training")
    v = verdict(profile=prof, audit=AUDIT_DRIFT, gpus=gpus, topology=TOPOLOGY, probes=probes, publish=Pub(True))
    collectors = [CollectorStatus("discover", True, 0.012), CollectorStatus("gpus", not lost, 0.003,
                                                                            "" if not lost else "lost"),
                  CollectorStatus("audit", True, 0.25), CollectorStatus("probe", True, 21.5),
                  CollectorStatus("publish", True, 0.04)]
    return Snapshot.build(node="gpu-node-1", profile="training", verdict=v, since=T0, created=T0 + 60,
                          audit=AUDIT_DRIFT, topology=TOPOLOGY, gpus=[g.as_dict() for g in gpus],
                          probes=probes, probe_last_success={"0": T0 - 3600}, collectors=collectors)


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
    for required in ("gpu_tune_ready", "gpu_tune_check_ok", "gpu_tune_setting_compliant",
                     "gpu_tune_probe_accuracy", "gpu_tune_probe_train_images_per_second",
                     "gpu_tune_probe_duration_seconds", "gpu_tune_probe_last_success_timestamp_seconds",
                     "gpu_tune_gpu_numa_node", "gpu_tune_gpu_pcie_link_generation", "gpu_tune_gpu_pcie_link_width",
                     "gpu_tune_build_info", "gpu_tune_collector_success", "gpu_tune_collector_duration_seconds"):
        assert required in names, required
    s = samples(body)
    gen1 = {k: v for k, v in s.items() if k[0] == "gpu_tune_gpu_pcie_link_generation" and ("gpu", "1") in k[1]}
    labels = dict(next(iter(gen1))[1])
    assert set(labels) == {"gpu", "UUID", "pci_bus_id", "modelName", "Hostname", "numa_node", "kind"}
    assert labels["pci_bus_id"] == "00000000:19:00.0" and labels["Hostname"] == "gpu-node-1"
    assert sorted(gen1.values()) == [4.0, 5.0]
    assert s[("gpu_tune_ready", ())] == 0.0
    assert s[("gpu_tune_setting_compliant", (("id", "sysctl.vm.swappiness"), ("target", "host")))] == 0.0
    assert s[("gpu_tune_check_ok", (("check", "gpu.1.healthy"),))] == 0.0  # link trained down


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


@pytest.mark.parametrize("given,want", [("0000:18:00.0", "00000000:18:00.0"), ("0000:af:00.0", "00000000:AF:00.0"),
                                        ("00000000:3B:00.0", "00000000:3B:00.0"), (None, "")])
def test_nvml_bus_id(given, want):
    assert nvml_bus_id(given) == want
