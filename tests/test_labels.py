"""Labels, annotations, condition and taint wanted for a verdict (gpu_tune/cluster/labels.py, pure)."""

from __future__ import annotations

import json
import random
import re

import pytest

from gpu_tune.cluster.labels import (
    ANNOTATION_OWNED,
    ANNOTATION_TOPOLOGY,
    CONDITION_TYPE,
    LABEL_VALUE_RE,
    MAX_TOPOLOGY_ANNOTATION,
    NodeWant,
    desired_node_state,
    gpu_numa_map,
    is_valid_label_value,
    sanitize_label_value,
    topology_annotation,
)

RUN_FORM = re.compile(r"^(\d+(-\d+)?\.n(\d+|x))(_\d+(-\d+)?\.n(\d+|x))*$")


def _gpus(nodes: list[int | None], name: str = "NVIDIA H100 80GB HBM3") -> list[dict]:
    return [{"index": i, "uuid": f"GPU-{i}", "name": name, "pci_bus_id": f"0000:{0x18 + i:02x}:00.0",
             "memory_total_mib": 81559, "compute_capability": "9.0", "numa_node": n}
            for i, n in enumerate(nodes)]


def _topology(nodes: list[int | None], numa: int = 2) -> dict:
    return {
        "numa_nodes": [{"id": k, "cpus": f"{k * 56}-{k * 56 + 55}", "mem_free_kib": 123456 + k}
                       for k in range(numa)],
        "gpus": [{"index": i, "pci_bus_id": f"0000:{0x18 + i:02x}:00.0", "name": "NVIDIA H100 80GB HBM3",
                  "numa_node": n, "temperature_c": 40 + i} for i, n in enumerate(nodes)],
        "nics": [{"name": "ib0", "numa_node": 0}],
    }


@pytest.mark.parametrize("raw, want", [
    ("NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3"),
    ("NVIDIA A100-SXM4-80GB", "NVIDIA-A100-SXM4-80GB"),
    ("  --weird//name__ ", "weird-name"),
    ("Tesla T4 (rev a1)", "Tesla-T4-rev-a1"),
    ("570.124.06", "570.124.06"),
    ("ünïcode GPU", "n-code-GPU"),
    ("", ""),
    (None, ""),
    ("---", ""),
])
def test_sanitize_label_value(raw, want):
    got = sanitize_label_value(raw)
    assert got == want
    assert is_valid_label_value(got)


def test_sanitize_truncates_to_63_and_ends_alnum():
    got = sanitize_label_value("A" * 62 + "-" + "B" * 10)
    assert len(got) <= 63 and LABEL_VALUE_RE.match(got) and got == "A" * 62
    assert sanitize_label_value("x" * 200) == "x" * 63


@pytest.mark.parametrize("nodes, want", [
    ([0, 0, 0, 0, 1, 1, 1, 1], "0-3.n0_4-7.n1"),
    ([None] * 8, "0-7.nx"),
    ([-1, -1], "0-1.nx"),
    ([0], "0.n0"),
    ([0, 1, 0, 0], "0.n0_1.n1_2-3.n0"),
    ([0, 0, None, 3], "0-1.n0_2.nx_3.n3"),
    ([], ""),
])
def test_gpu_numa_map_runs(nodes, want):
    assert gpu_numa_map(_gpus(nodes)) == want


def test_gpu_numa_map_sorts_by_index_and_reads_string_nodes():
    rows = [{"index": 3, "numa_node": "1"}, {"index": 0, "numa_node": 0}, {"index": 2, "numa_node": "-1"},
            {"index": 1, "numa_node": 0}]
    assert gpu_numa_map(rows) == "0-1.n0_2.nx_3.n1"


def test_gpu_numa_map_16_gpus_under_63():
    assert gpu_numa_map(_gpus([k // 4 for k in range(16)])) == "0-3.n0_4-7.n1_8-11.n2_12-15.n3"
    alternating = gpu_numa_map(_gpus([k % 2 for k in range(16)]))
    assert alternating == "c" + "01" * 8
    rng = random.Random(7)
    for _ in range(300):
        nodes = [rng.choice([None, 0, 1, 2, 3, 7, 12]) for _ in range(16)]
        value = gpu_numa_map(_gpus(nodes))
        assert len(value) <= 62, value
        assert is_valid_label_value(value), value
        if not value.startswith("c"):
            assert RUN_FORM.match(value), value
        else:
            assert len(value) == 17
            assert value[1:] == "".join("x" if n is None else "0123456789abcdefghijklmnopqrstuvw"[n] for n in nodes)


def test_desired_state_ready_labels_and_condition():
    want = desired_node_state(profile="training", ready=True, reason="", message="all checks passed",
                              topology=_topology([0, 0, 0, 0, 1, 1, 1, 1]), gpus=_gpus([0] * 4 + [1] * 4),
                              driver_version="570.124.06")
    assert isinstance(want, NodeWant)
    assert want.labels == {
        "gpu-tune.io/profile": "training",
        "gpu-tune.io/ready": "true",
        "gpu-tune.io/numa-nodes": "2",
        "gpu-tune.io/gpu-count": "8",
        "gpu-tune.io/gpu-product": "NVIDIA-H100-80GB-HBM3",
        "gpu-tune.io/gpu-numa-map": "0-3.n0_4-7.n1",
        "gpu-tune.io/gpu-memory-mib": "81559",
        "gpu-tune.io/gpu-compute-capability": "9.0",
        "gpu-tune.io/gpu-driver": "570.124.06",
        "gpu-tune.io/nic-count": "1",
    }
    for k, v in want.labels.items():
        assert k.startswith("gpu-tune.io/") and not k.startswith(("nvidia.com/", "feature.node.kubernetes.io/"))
        assert is_valid_label_value(v), (k, v)
    assert want.condition == {"type": CONDITION_TYPE, "status": "True", "reason": "AllChecksPassed",
                              "message": "all checks passed"}
    assert want.taint_wanted is False
    assert want.annotations[ANNOTATION_OWNED] == ",".join(sorted(want.labels))


def test_taint_wish_is_tri_state():
    kw = dict(profile="training", reason="probe failed", message="accuracy 0.2 < 0.9", topology={}, gpus=[],
              driver_version=None)
    assert desired_node_state(ready=False, **kw).taint_wanted is True
    assert desired_node_state(ready=False, taint_when_not_ready=False, **kw).taint_wanted is None
    assert desired_node_state(ready=True, taint_when_not_ready=False, **kw).taint_wanted is False
    nr = desired_node_state(ready=False, **kw)
    assert nr.condition["status"] == "False" and nr.condition["reason"] == "ProbeFailed"
    assert nr.labels["gpu-tune.io/ready"] == "false"


def test_numa_node_filled_from_topology_when_gpu_rows_lack_it():
    gpus = _gpus([None] * 4)
    for g in gpus:
        del g["numa_node"]
    want = desired_node_state(profile="inference", ready=True, reason="Ready", message="",
                              topology=_topology([1, 1, 0, None]), gpus=gpus, driver_version=None)
    assert want.labels["gpu-tune.io/gpu-numa-map"] == "0-1.n1_2.n0_3.nx"
    assert want.condition["reason"] == "Ready"


def test_missing_topology_keys_and_no_gpus():
    for topo in (None, {}, {"numa_nodes": "garbage", "gpus": None}):
        want = desired_node_state(profile="training", ready=False, reason="no GPUs", message="",
                                  topology=topo, gpus=None, driver_version=None)
        assert want.labels["gpu-tune.io/gpu-count"] == "0"
        assert "gpu-tune.io/gpu-numa-map" not in want.labels
        assert "gpu-tune.io/numa-nodes" not in want.labels
        assert json.loads(want.annotations[ANNOTATION_TOPOLOGY]) == (
            {} if not topo else {"numa_nodes": "garbage", "gpus": None})


def test_mixed_products_and_no_timestamp_label():
    gpus = _gpus([0, 0]) + [{"index": 2, "name": "NVIDIA A100-SXM4-80GB", "numa_node": 1,
                            "compute_capability": "8.0", "memory_total_mib": 81920}]
    want = desired_node_state(profile="training", ready=True, reason="", message="", topology={},
                              gpus=gpus, driver_version="570.124.06")
    assert want.labels["gpu-tune.io/gpu-product"] == "mixed"
    assert "gpu-tune.io/gpu-compute-capability" not in want.labels
    assert want.labels["gpu-tune.io/gpu-memory-mib"] == "81559"
    assert not any(re.search(r"time|date|since|heartbeat", k) for k in want.labels)


def test_topology_annotation_stable_without_volatile_readings():
    a = _topology([0, 1])
    b = json.loads(json.dumps(a))
    b["numa_nodes"][0]["mem_free_kib"] = 1
    b["gpus"][1]["temperature_c"] = 90
    for doc in (a, b):
        for g in doc["gpus"]:
            g["pcie"] = {"gen_max": 5, "width_max": 16, "gen_current": 5, "width_current": 16, "degraded": False}
    b["gpus"][0]["pcie"].update(gen_current=1, degraded=True)  # idle link downshift
    ann_a, ann_b = topology_annotation(a), topology_annotation(b)
    assert ann_a == ann_b
    doc = json.loads(ann_a)
    assert "mem_free_kib" not in doc["numa_nodes"][0] and "temperature_c" not in doc["gpus"][0]
    assert doc["gpus"][1]["pci_bus_id"] == "0000:19:00.0"
    assert doc["gpus"][0]["pcie"] == {"gen_max": 5, "width_max": 16}
    b["gpus"][1]["numa_node"] = 0  # hardware fact: does change it
    assert topology_annotation(b) != ann_a


def test_topology_annotation_bounded():
    topo = _topology([0, 1])
    topo["irqs"] = [{"irq": i, "cpus": "0-223", "device": "0000:18:00.0" * 4} for i in range(20000)]
    text = topology_annotation(topo)
    assert len(text) <= MAX_TOPOLOGY_ANNOTATION
    doc = json.loads(text)
    assert doc["truncated"] is True and "irqs" not in doc and len(doc["gpus"]) == 2


# -- the summary annotation (what `gpu-tune fleet` shows) ---------------------------------------
def _summary_facts(*, temp: float = 91.0, util: float = 85.0, launch: float = 41234.5, fp: str = "3f2a9c1d",
                   swappiness: str = "60"):
    """A not-ready node: drift, a hot GPU with a link trained down under load, a failed probe."""
    from gpu_tune.tune.profile import Profile
    from gpu_tune.judge.readiness import verdict

    from .fixtures.probes import probe_result, probe_verdict
    from .test_readiness import h100

    audit = {"profile": "training", "compliant": False, "settings": [
        {"id": "sysctl.vm.swappiness", "target": "host", "current": swappiness, "desired": "0", "status": "drift",
         "detail": ""},
        {"id": "thp.enabled", "target": "host", "current": "never", "desired": "never", "status": "ok", "detail": ""},
        *[{"id": "cpu.governor", "target": f"cpu{i}", "current": "schedutil", "desired": "performance",
           "status": "drift" if i < 3 else "unsupported", "detail": ""} for i in range(8)],
        {"id": "irq.affinity", "target": "120", "current": "0-3", "desired": "0-1", "status": "conflict",
         "detail": "irqbalance"}]}
    gpus = [h100(0), h100(1, temperature_c=temp, utilization_percent=util, pcie_link_gen_current=4)]
    probes = [probe_verdict("0", probe_result(launch=launch, fingerprint=fp)),
              probe_verdict("1", {"accuracy": 0.41, "train_images_per_second": 39000.5}, passed=False)]
    prof = Profile(name="training", readiness={"max_temperature_c": 83})
    v = verdict(profile=prof, audit=audit, gpus=gpus, probes=probes)
    return dict(checks=v.checks, audit=audit, probes=probes), v


def _want_with_summary(**facts):
    inputs, v = _summary_facts(**facts)
    return desired_node_state(profile="training", ready=v.ready, reason=v.reason(), message=v.message(),
                              topology=_topology([0, 1]), gpus=_gpus([0, 1]), driver_version="580.65.06",
                              **inputs)


def test_summary_annotation_shape():
    from gpu_tune.cluster.labels import ANNOTATION_SUMMARY

    doc = json.loads(_want_with_summary().annotations[ANNOTATION_SUMMARY])
    assert doc["v"] == 1
    assert doc["drift"] == 5  # 1 sysctl + 3 CPUs in drift + 1 IRQ in conflict; ok and unsupported do not count
    failing = {f["check"]: f["detail"] for f in doc["failing"]}
    assert set(failing) == {"tuning.compliant", "gpu.pcie", "gpu.thermal", "probe.1.passed"}
    assert "sysctl.vm.swappiness[host] drift: 60 != 0" in failing["tuning.compliant"]
    assert "PCIe link trained down (Gen4 of Gen5 under load)" in failing["gpu.pcie"]
    assert "temperature above 83 C" in failing["gpu.thermal"]
    assert "warnings" not in doc
    assert "accuracy 0.41 < 0.90" in failing["probe.1.passed"]
    assert doc["probe"] == {
        "0": {"status": "passed", "accuracy": 0.9812, "fingerprint": "3f2a9c1d",
              "peer_group": "NVIDIA H100 80GB HBM3 | driver 580 | tensorflow 2.21.0 | probe 2 | data 3f2a9c1d"},
        "1": {"status": "failed", "accuracy": 0.41},
    }  # no images/s: they vary from run to run and live in the metrics and /probe


def test_summary_is_stable_across_passes_of_a_steady_node():
    """Readings that move every pass (temperature, utilization) and throughput that wobbles from one
    probe run to the next must not change the annotation: a steady node makes no write."""
    from gpu_tune.cluster.labels import ANNOTATION_SUMMARY

    # images/s measured on one node from run to run: 9.8k to 15k
    a = _want_with_summary(temp=91.0, util=85.0, launch=9800.0)
    b = _want_with_summary(temp=96.5, util=99.0, launch=15000.0)
    assert a.annotations == b.annotations and a.labels == b.labels and a.condition == b.condition
    # what does change it: a new fingerprint, a different drift
    assert _want_with_summary(fp="deadbeef").annotations[ANNOTATION_SUMMARY] != a.annotations[ANNOTATION_SUMMARY]
    assert _want_with_summary(swappiness="10").annotations[ANNOTATION_SUMMARY] != a.annotations[ANNOTATION_SUMMARY]


def test_summary_without_facts_and_bounded():
    from gpu_tune.cluster.labels import ANNOTATION_SUMMARY, MAX_SUMMARY_ANNOTATION, node_summary, summary_annotation

    from .fixtures.probes import probe_result, probe_verdict

    bare = json.loads(desired_node_state(profile="training", ready=False, reason="", message="", topology={},
                                         gpus=[], driver_version=None).annotations[ANNOTATION_SUMMARY])
    assert bare == {"v": 1, "drift": None, "failing": [], "probe": {}}
    # 64 GPUs, every check failing with a long detail, long peer groups: still bounded, still JSON
    checks = [{"name": f"probe.{i}.passed", "ok": False, "detail": "x" * 5000} for i in range(64)]
    probes = [probe_verdict(str(i), probe_result(peer_group="p" * 1000)) for i in range(64)]
    text = summary_annotation(node_summary(audit={"settings": [{"status": "drift"}] * 5000}, checks=checks,
                                           probes=probes))
    doc = json.loads(text)
    assert len(text.encode()) <= MAX_SUMMARY_ANNOTATION
    assert doc["drift"] == 5000 and doc["failing_more"] == 64 - len(doc["failing"])
    assert all(len(f["detail"]) <= 240 for f in doc["failing"])
    assert len(doc["probe"]) + doc.get("probe_more", 0) == 64


def test_summary_names_warnings_without_their_figures():
    """A warning is reported by name (its figures move with time: a flap count, minutes of slowdown)
    and never listed among the failing checks."""
    from gpu_tune.cluster.labels import node_summary

    checks = [{"name": "network.link_flaps", "ok": False, "severity": "warning", "detail": "mlx5_0/1: 3 flap(s)"},
              {"name": "gpu.memory", "ok": False, "severity": "fatal", "detail": "GPU 0: row remap pending"},
              {"name": "gpu.inforom", "ok": True, "severity": "warning", "detail": "valid"}]
    doc = node_summary(audit=None, checks=checks, probes=None)
    assert [f["check"] for f in doc["failing"]] == ["gpu.memory"]
    assert doc["warnings"] == ["network.link_flaps"]
