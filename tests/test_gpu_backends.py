"""GPU backends: fixture (validation, write-back), null, selection. NVML through the real binding:
tests/test_nvml_binding.py."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from gpu_tune.errors import InputError
from gpu_tune.gpu import select_backend
from gpu_tune.gpu.base import GpuError
from gpu_tune.gpu.fixture import FixtureBackend
from gpu_tune.gpu.null import NullBackend

GPU_DIR = Path(__file__).resolve().parent / "fixtures" / "gpu"


def test_committed_fixture_json_matches_generator():
    from tests.fixtures import pcigen

    for name in ("link-degraded", "gpu-numa-unknown"):
        assert json.loads((GPU_DIR / f"{name}.json").read_text()) == pcigen.gpu_json(name)


def test_fixture_reads_every_field(gpu_fixture):
    b = FixtureBackend(gpu_fixture("dgx-8gpu"))
    gpus = b.gpus()
    assert [g.index for g in gpus] == list(range(8))
    g = gpus[2]
    assert g.pci_bus_id == "0000:3a:00.0" and g.name == "NVIDIA H100 80GB HBM3"
    assert g.memory_total_mib == 81559 and g.compute_capability == "9.0" and g.persistence_mode is False
    assert g.pcie_link_gen_max == 5 and g.ecc_mode is True and g.clock_throttle_reasons == ()
    assert b.driver_version() == "570.124.06" and b.cuda_driver_version() == "12.8"
    assert b.processes(0) == [] and b.cpu_affinity(0) is None


def test_fixture_normalises_nvml_bus_ids_and_optional_keys(gpu_fixture, tmp_path):
    b = FixtureBackend(gpu_fixture("gpu-numa-unknown"))
    assert b.gpus()[0].pci_bus_id == "0000:41:00.0"
    assert b.cpu_affinity(0) == frozenset(range(8, 16))
    data = json.loads((GPU_DIR / "dgx-8gpu.json").read_text())
    data["gpus"][1].update(lost=True, processes=[4242, 17], future_key={"x": 1})
    data["top_level_unknown"] = 1
    f = tmp_path / "g.json"
    f.write_text(json.dumps(data))
    b = FixtureBackend(f)
    lost = b.gpus()[1]
    assert lost.error == "GPU is lost" and lost.error_kind == "lost" and lost.persistence_mode is None
    assert b.processes(1) == [4242, 17]
    with pytest.raises(GpuError) as ei:
        b.set_persistence_mode(1, True)
    assert ei.value.kind == "lost"


def test_fixture_writes_persistence_back(gpu_fixture):
    f = gpu_fixture("link-degraded")
    b = FixtureBackend(f)
    b.set_persistence_mode(1, True)
    assert json.loads(f.read_text())["gpus"][1]["persistence_mode"] is True
    assert FixtureBackend(f).gpus()[1].persistence_mode is True  # a later run sees it
    assert b.gpus()[1].persistence_mode is True
    assert not [p for p in f.parent.iterdir() if p.name.startswith(".")]  # no temp file left
    with pytest.raises(GpuError):
        b.set_persistence_mode(9, True)


@pytest.mark.parametrize("mutate,needle", [
    (lambda d: d["gpus"][0].pop("uuid"), "gpus[0]: missing required key 'uuid'"),
    (lambda d: d["gpus"][1].pop("pci_bus_id"), "gpus[1]: missing required key 'pci_bus_id'"),
    (lambda d: d["gpus"][0].update(index="zero"), "gpus[0].index"),
    (lambda d: d["gpus"][1].update(index=0), "appears twice"),
    (lambda d: d["gpus"][0].update(cpu_affinity="a-b"), "cpu_affinity"),
])
def test_fixture_bad_content_is_input_error(tmp_path, mutate, needle):
    data = json.loads((GPU_DIR / "link-degraded.json").read_text())
    mutate(data)
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(data))
    with pytest.raises(InputError) as ei:
        FixtureBackend(f)
    assert str(f) in str(ei.value) and needle in str(ei.value)
    assert ei.value.exit_code == 2


def test_fixture_malformed_json_names_line(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text('{\n  "gpus": [\n    {"index": 0,}\n  ]\n}\n')
    with pytest.raises(InputError) as ei:
        FixtureBackend(f)
    assert str(ei.value).startswith(f"{f}:3:")
    assert "malformed JSON" in str(ei.value)


def test_select_backend(tmp_path, caplog, gpu_fixture):
    with pytest.raises(InputError, match="no such file"):
        select_backend("fixture", str(tmp_path / "missing.json"))
    with pytest.raises(InputError, match="needs --gpu-fixture"):
        select_backend("fixture", None)
    with pytest.raises(InputError, match="expected one of"):
        select_backend("cuda")
    with caplog.at_level(logging.INFO, logger="gpu_tune"):
        b = select_backend("none")
    assert isinstance(b, NullBackend) and b.gpus() == [] and b.cpu_affinity(0) is None
    assert [r.message for r in caplog.records] == ["GPU backend: none (--gpu-backend none)"]
    assert select_backend("auto", str(gpu_fixture("dgx-8gpu"))).name == "fixture"
    with pytest.raises(GpuError):
        b.set_persistence_mode(0, True)


@pytest.mark.parametrize("key,value,needle", [
    ("clock_throttle_reasons", 5, "expected a list of strings"),
    ("xid_events", ["abc"], "expected a list of integers"),
    ("temperature_c", "hot", "expected integer/number"),
    ("persistence_mode", 1, "expected bool"),
    ("pci_bus_id", "zz", "is not a PCI bus id"),
])
def test_fixture_value_types_are_checked_when_loading(tmp_path, key, value, needle):
    import json as _json

    from gpu_tune.errors import InputError
    from gpu_tune.gpu.fixture import FixtureBackend

    doc = {"gpus": [{"index": 0, "uuid": "GPU-0", "name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "0000:18:00.0"}]}
    doc["gpus"][0][key] = value
    f = tmp_path / "g.json"
    f.write_text(_json.dumps(doc))
    with pytest.raises(InputError) as ei:
        FixtureBackend(f)
    assert f"gpus[0].{key}" in str(ei.value) and needle in str(ei.value) and str(f) in str(ei.value)


def test_a_write_killed_midway_leaves_a_temporary_file_the_next_load_removes(gpu_fixture, tmp_path):
    """SIGKILL while the fixture backend writes persistence mode back (after its temp file is
    made, before the rename): the file is intact, and the temp file it left is removed by the next
    load of that fixture. A temp file of a writer still running is left alone, and so is anything
    that only looks like one of another file's."""
    import os
    import signal
    import subprocess

    fx = gpu_fixture("dgx-8gpu")
    before = fx.read_bytes()
    child = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        "from gpu_tune.gpu.fixture import FixtureBackend\n"
        "def stall(fd):\n"
        "    print('writing', flush=True); time.sleep(120)\n"
        "os.fsync = stall\n"
        f"FixtureBackend({str(fx)!r}).set_persistence_mode(0, True)\n")],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    try:
        assert child.stdout.readline().strip() == "writing"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    left = [p.name for p in fx.parent.iterdir() if p.name.startswith(f".{fx.name}.")]
    assert len(left) == 1, left  # the case is real: the kill left the temp file
    assert fx.read_bytes() == before
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = fx.parent / f".{fx.name}.{sleeper.pid}-0123abcd"  # a write in flight in another process
        live.write_text("{")
        other = fx.parent / f".other.json.{child.pid}-0123abcd"
        other.write_text("{")
        assert FixtureBackend(fx).gpus()[0].persistence_mode is False
        names = sorted(p.name for p in fx.parent.iterdir() if p.name.startswith("."))
        assert names == sorted([live.name, other.name]), names
        # and a write of that fixture removes a temp file a killed writer left, too
        backend = FixtureBackend(fx)
        (fx.parent / f".{fx.name}.{child.pid}-89abcdef").write_text("{")
        backend.set_persistence_mode(1, True)
        assert sorted(p.name for p in fx.parent.iterdir() if p.name.startswith(f".{fx.name}.")) == [live.name]
        assert json.loads(fx.read_text())["gpus"][1]["persistence_mode"] is True
    finally:
        sleeper.kill()
        sleeper.wait()
