"""GPU backends: fixture (validation, write-back), null, selection, and NVML against a fake pynvml."""

from __future__ import annotations

import json
import logging
import sys
import types
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


def test_auto_falls_back_to_null_without_nvml(monkeypatch, caplog):
    fake = make_fake_pynvml(init_error=9)  # NVML_ERROR_DRIVER_NOT_LOADED
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with caplog.at_level(logging.INFO, logger="gpu_tune"):
        b = select_backend("auto")
    assert b.name == "none" and "NVML unavailable" in b.reason and "Driver Not Loaded" in b.reason
    assert len([r for r in caplog.records if r.message.startswith("GPU backend:")]) == 1
    with pytest.raises(InputError, match="--gpu-backend nvml"):
        select_backend("nvml")


# -- a fake pynvml with the real module's shape ------------------------------------------------------
ERRORS = {1: "Uninitialized", 2: "InvalidArgument", 3: "NotSupported", 4: "NoPermission",
          9: "DriverNotLoaded", 10: "Timeout", 15: "GPUIsLost", 999: "Unknown"}
TEXT = {3: "Not Supported", 4: "Insufficient Permissions", 9: "Driver Not Loaded", 10: "Timeout",
        15: "GPU is lost", 999: "Unknown Error", 2: "Invalid Argument", 1: "Uninitialized"}


class _Struct:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def make_fake_pynvml(init_error=None, gpus=None):
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        _map: dict = {}

        def __new__(cls, value):
            if cls is NVMLError:
                cls = NVMLError._map.get(value, cls)
            obj = Exception.__new__(cls)
            obj.value = value
            return obj

        def __init__(self, value):
            super().__init__(value)

        def __str__(self):
            return TEXT.get(self.value, f"NVML Error with code {self.value}")

    m.NVMLError = NVMLError
    for code, name in ERRORS.items():
        cls = type(f"NVMLError_{name}", (NVMLError,), {})
        NVMLError._map[code] = cls
        setattr(m, f"NVMLError_{name}", cls)
    m.NVML_FEATURE_DISABLED, m.NVML_FEATURE_ENABLED = 0, 1
    m.NVML_TEMPERATURE_GPU = 0
    m.NVML_VOLATILE_ECC = 0
    m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    m.nvmlEventTypeXidCriticalError = 8
    state = {"gpus": gpus if gpus is not None else default_gpus(), "events": [], "calls": []}
    m.state = state

    def err(code):
        raise NVMLError(code)

    def init():
        if init_error:
            err(init_error)

    def dev(h):
        g = state["gpus"][h.index]
        if g.get("lost"):
            err(15)
        return g

    def field(name, conv=lambda v: v):
        def fn(h, *a):
            g = dev(h)
            v = g.get(name)
            if v is None:
                err(3)
            if isinstance(v, Exception):
                raise v
            return conv(v)
        return fn

    m.nvmlInit = init
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: len(state["gpus"])

    def handle(i):
        if i >= len(state["gpus"]):
            err(2)
        return _Struct(index=i)

    m.nvmlDeviceGetHandleByIndex = handle
    m.nvmlSystemGetDriverVersion = lambda: "570.124.06"
    m.nvmlSystemGetCudaDriverVersion = lambda: 12080
    m.nvmlDeviceGetUUID = field("uuid")
    m.nvmlDeviceGetName = field("name", lambda v: v.encode())  # older bindings return bytes
    m.nvmlDeviceGetPciInfo = field("bus", lambda v: _Struct(busId=v))
    m.nvmlDeviceGetMemoryInfo = field("mem", lambda v: _Struct(total=v[0] * 1024 * 1024, used=v[1] * 1024 * 1024))
    m.nvmlDeviceGetCudaComputeCapability = field("cc")
    m.nvmlDeviceGetPersistenceMode = field("pm")
    m.nvmlDeviceGetEccMode = field("ecc", lambda v: (v, v))
    m.nvmlDeviceGetTotalEccErrors = field("ecc_unc")
    m.nvmlDeviceGetRetiredPagesPendingStatus = field("retired")
    m.nvmlDeviceGetRemappedRows = field("remap")
    m.nvmlDeviceGetTemperature = field("temp")
    m.nvmlDeviceGetPowerUsage = field("power_mw")
    m.nvmlDeviceGetUtilizationRates = field("util", lambda v: _Struct(gpu=v, memory=0))
    m.nvmlDeviceGetCurrentClocksEventReasons = field("reasons")
    m.nvmlDeviceGetCurrentClocksThrottleReasons = field("reasons")
    m.nvmlDeviceGetCurrPcieLinkGeneration = field("gen")
    m.nvmlDeviceGetMaxPcieLinkGeneration = field("gen_max")
    m.nvmlDeviceGetCurrPcieLinkWidth = field("width")
    m.nvmlDeviceGetMaxPcieLinkWidth = field("width_max")
    m.nvmlDeviceGetComputeRunningProcesses = field("procs", lambda v: [_Struct(pid=p, usedGpuMemory=1) for p in v])

    def affinity(h, words):
        g = dev(h)
        arr = [0] * words
        for c in g.get("aff", ()):
            arr[c // 64] |= 1 << (c % 64)
        return arr

    m.nvmlDeviceGetCpuAffinity = affinity

    def set_pm(h, mode):
        g = dev(h)
        if g.get("pm_denied"):
            err(4)
        state["calls"].append(("set_pm", h.index, mode))
        g["pm"] = mode

    m.nvmlDeviceSetPersistenceMode = set_pm
    m.nvmlEventSetCreate = lambda: "evset"

    def register(h, types_, evset):
        dev(h)
        state.setdefault("registered", []).append(h.index)

    m.nvmlDeviceRegisterEvents = register

    def wait(evset, timeout_ms):
        if not state["events"]:
            err(10)
        idx, xid = state["events"].pop(0)
        return _Struct(device=_handle_for(idx), eventType=8, eventData=xid)

    handles: dict = {}

    def _handle_for(idx):
        return handles.setdefault(idx, _Struct(index=idx))

    # the backend keys handles it registered: give it the same objects back
    m.nvmlDeviceGetHandleByIndex = lambda i: _handle_for(i) if i < len(state["gpus"]) else err(2)
    m.nvmlEventSetWait = wait
    m.nvmlEventSetFree = lambda s: None
    return m


def default_gpus():
    base = dict(name="NVIDIA H100 80GB HBM3", mem=(81559, 1024), cc=(9, 0), pm=0, ecc=1, ecc_unc=0,
                retired=0, remap=(0, 0, 0, 0), temp=35, power_mw=71500, util=3, reasons=0,
                gen=5, gen_max=5, width=16, width_max=16, procs=[], aff=range(0, 56))
    return [
        dict(base, uuid="GPU-aaa", bus="00000000:18:00.0", reasons=0x40 | 0x04, procs=[1234]),
        dict(base, uuid="GPU-bbb", bus="00000000:2A:00.0", lost=True),
        dict(base, uuid="GPU-ccc", bus="00000000:3A:00.0", remap=(0, 1, 1, 0), retired=None,
             ecc_unc=2, gen=3, width=8, pm_denied=True, temp=None),
    ]


@pytest.fixture
def nvml(monkeypatch):
    fake = make_fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    from gpu_tune.gpu.nvml import NvmlBackend

    b = NvmlBackend()
    yield b, fake
    b.close()


def test_nvml_fills_gpu_info(nvml):
    b, fake = nvml
    assert b.name == "nvml" and b.driver_version() == "570.124.06" and b.cuda_driver_version() == "12.8"
    g0, g1, g2 = b.gpus()
    assert g0.pci_bus_id == "0000:18:00.0" and g0.name == "NVIDIA H100 80GB HBM3" and g0.uuid == "GPU-aaa"
    assert g0.memory_total_mib == 81559 and g0.memory_used_mib == 1024 and g0.compute_capability == "9.0"
    assert g0.persistence_mode is False and g0.ecc_mode is True and g0.ecc_uncorrected_volatile == 0
    assert g0.power_w == 71.5 and g0.temperature_c == 35.0 and g0.utilization_percent == 3.0
    assert g0.clock_throttle_reasons == ("sw_power_cap", "hw_thermal_slowdown")
    assert g0.retired_pages_pending is False and g0.error is None
    # lost GPU: a value, the others still answer
    assert g1.error_kind == "lost" and "GPU is lost" in g1.error and g1.index == 1
    # not supported -> None; row remapping pending -> retired_pages_pending
    assert g2.pci_bus_id == "0000:3a:00.0" and g2.temperature_c is None
    assert g2.retired_pages_pending is True and g2.ecc_uncorrected_volatile == 2
    assert (g2.pcie_link_gen_current, g2.pcie_link_width_current) == (3, 8)


def test_nvml_xids_persistence_processes_affinity(nvml):
    b, fake = nvml
    assert fake.state["registered"] == [0, 2]  # the lost GPU could not register
    fake.state["events"] += [(0, 79), (2, 48), (0, 31)]
    gpus = b.gpus()
    assert gpus[0].xid_events == (79, 31) and gpus[2].xid_events == (48,)
    assert b.gpus()[0].xid_events == (79, 31)  # kept between reads
    b.set_persistence_mode(0, True)
    assert fake.state["calls"] == [("set_pm", 0, 1)] and b.gpus()[0].persistence_mode is True
    with pytest.raises(GpuError) as ei:
        b.set_persistence_mode(2, True)
    assert ei.value.kind == "no_permission" and "needs root" in str(ei.value)
    with pytest.raises(GpuError) as ei:
        b.set_persistence_mode(1, True)
    assert ei.value.kind == "lost"
    assert b.processes(0) == [1234] and b.processes(2) == []
    assert b.cpu_affinity(0) == frozenset(range(56))
    assert b.cpu_affinity(1) is None  # lost


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
