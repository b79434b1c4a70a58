"""Readings that are not read, through `gpu-tune check` on the 8-GPU fixture host: a reading the
audit pod may not take is a warning naming it, never a failed GPU; the fixture's health objects are
checked when the file loads (a fabric without its state is bad input, exit 2, not a crash)."""

from __future__ import annotations

import json
import re

import pytest

from tests.healthkit import dgx_tree, gpu_json, host, policies  # noqa: F401 (fixtures)




def check(cli, root, fixture, policies):
    r = cli("check", "--root", str(root), "--gpu-fixture", str(fixture), "--policy-dir", str(policies),
            "--profile", "health", "-o", "json")
    return r


def test_a_healthy_node_whose_sram_and_inforom_are_not_readable_is_ready(cli, host, tmp_path, policies):
    def deny(d):
        for g in d["gpus"]:
            g.pop("sram_ecc", None)
            g.pop("inforom_valid", None)
            g["unread"] = {"sram_ecc": "Insufficient Permissions (NVML_ERROR_NO_PERMISSION)",
                           "inforom": "Insufficient Permissions (NVML_ERROR_NO_PERMISSION)"}

    r = check(cli, host, gpu_json(tmp_path, deny), policies)
    assert r.returncode == 0, r.stdout
    doc = json.loads(r.stdout)
    names = {c["name"]: c for c in doc["checks"]}
    assert doc["ready"] and doc["reason"] == "AllChecksPassed"
    w = names["gpu.readings"]
    assert w["severity"] == "warning" and not w["ok"]
    assert w["detail"].startswith("inforom on 8 of 8 GPUs (0, 1, 2, 3, 4, 5, 6, 7) not read: Insufficient Permissions")
    assert "sram_ecc on 8 of 8 GPUs" in w["detail"] and "nvml.h: requires root (gpu.memory judged without it)" in w["detail"]
    assert names["gpu.memory"]["ok"] and "not read: sram_ecc on GPU 0, 1, 2, 3, 4, 5, 6, 7" in names["gpu.memory"]["detail"]


def test_a_lost_gpu_on_the_fixture_host_is_named_alone(cli, host, tmp_path, policies):
    r = check(cli, host, gpu_json(tmp_path, lambda d: d["gpus"][3].update(lost=True)), policies)
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and doc["reason"] == "GpuLost"
    present = next(c for c in doc["checks"] if c["name"] == "gpu.present")
    assert present["detail"].startswith("GPU 3 (0000:5d:00.0) is lost (NVML: GPU is lost)")
    assert re.findall(r"GPU \d+", present["detail"]) == ["GPU 3"]


@pytest.mark.parametrize("fabric, needle", [
    ({}, "gpus[2].fabric: missing required key 'state'"),
    ({"status": "success"}, "gpus[2].fabric: missing required key 'state'"),
    ({"state": "completed", "health": "degraded"}, "gpus[2].fabric.health: expected a list of fault names"),
    ({"state": "completed", "summary": "fine"}, "gpus[2].fabric.summary: 'fine' is not one of"),
])
def test_a_fixture_fabric_without_its_state_is_bad_input_not_a_crash(cli, host, tmp_path, policies, fabric, needle):
    r = check(cli, host, gpu_json(tmp_path, lambda d: d["gpus"][2].update(fabric=fabric)), policies)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_degraded_fabric_on_the_fixture_host(cli, host, tmp_path, policies):
    def degrade(d):
        d["gpus"][6]["fabric"] = {"state": "completed", "status": "success", "health": ["degraded_bandwidth"],
                                  "summary": "limited_capacity"}

    r = check(cli, host, gpu_json(tmp_path, degrade), policies)
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and doc["reason"] == "FabricNotReady"
    fab = next(c for c in doc["checks"] if c["name"] == "gpu.fabric")
    assert fab["detail"].startswith("GPU 6 (0000:ba:00.0): fabric health: degraded bandwidth; fabric health "
                                    "summary limited capacity")
