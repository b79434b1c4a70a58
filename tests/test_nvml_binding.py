"""The NVML backend and every check that reads it, through the REAL nvidia-ml-py (``pynvml``) with
only its C library faked (tests/nvmlfake.py): the binding's own wrappers, ctypes structs, versioned
C names, return codes and exception classes are what the code meets.

Scenarios on an 8-GPU HGX H100 board: healthy; one GPU lost; one needing a reset; readings that
answer NO_PERMISSION or UNKNOWN; each fabric health field; MIG on every GPU; each recovery action;
field 230 unknown to an older driver; XID events through the real event struct; a Gen5 GPU in a Gen4
host. And a name check: the code names nothing the pinned binding does not have.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pynvml
import pytest

from gpu_tune.gpu.base import GpuInfo
from gpu_tune.gpu.nvml_calls import CALLS
from gpu_tune.judge.checks.expect import expectations
from gpu_tune.judge.probe.baselines import load_baselines
from gpu_tune.judge.readiness import verdict
from gpu_tune.tune.policy import load_profile
from tests import nvmlfake
from tests.nvmlfake import FakeGpu, FakeNvmlLib, hgx_h100

ROOT = Path(__file__).resolve().parents[1]
PYNVML_SRC = Path(pynvml.__file__).read_text()
C_NAMES = set(re.findall(r'_nvmlGetFunctionPointer\("(\w+)"\)', PYNVML_SRC))
# the fields of the binding's structs (c_nvmlFieldValue_t.nvmlReturn, ...): read on values, not the module
STRUCT_FIELDS = {f[0] for v in vars(pynvml).values() if isinstance(getattr(v, "_fields_", None), list)
                 for f in v._fields_}


def read(monkeypatch, gpus: list[FakeGpu] | None = None, **kw) -> tuple[list[GpuInfo], FakeNvmlLib]:
    b, lib = nvmlfake.backend(monkeypatch, gpus, **kw)
    try:
        return b.gpus(), lib
    finally:
        b.close()


def judge(gpus: list[GpuInfo], expect=None, **kw):
    prof = load_profile("training")
    exp = expect or expectations(prof, load_baselines(), gpus)
    return verdict(profile=prof, audit={"settings": []}, gpus=gpus, expect=exp,
                   probes=[{"gpu": str(g.index), "passed": True} for g in gpus], **kw)


def checks(v) -> dict:
    return {c.name: c for c in v.checks}


# -- the binding itself ---------------------------------------------------------------------------
def _names_in(path: Path) -> set[str]:
    """Every pynvml name a module uses: attributes of nv / self.nv / pynvml, and strings that look
    like NVML names (getattr(nv, "..."), readings' call names, struct class names)."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = node.value
            owner = base.id if isinstance(base, ast.Name) else (base.attr if isinstance(base, ast.Attribute) else "")
            if owner in ("nv", "pynvml"):
                out.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"(nvml[A-Z]\w+|NVML_[A-Z0-9_]*[A-Z0-9]|NVMLError_\w+|c_nvml\w+)", node.value):
                out.add(node.value)
    return out


def test_the_code_names_only_what_the_pinned_binding_has():
    """Every pynvml function, constant, struct and exception class the code names exists in the
    nvidia-ml-py the lock pins; the C functions the call table lists are the ones the binding
    looks up; the fake library defines no C function the binding would never ask for."""
    lock = (ROOT / "requirements" / "gpu.lock").read_text()
    pinned = re.search(r"^nvidia-ml-py==([\d.]+)", lock, re.M).group(1)
    from importlib.metadata import version

    assert version("nvidia-ml-py") == pinned, "the tests must run against the binding the image ships"
    files = [ROOT / "gpu_tune" / "gpu" / f for f in ("nvml.py", "nvml_health.py", "nvml_read.py")]
    files += [ROOT / "tools" / "nvml_privileges.py"]
    missing = {f.name: sorted(n for n in _names_in(f) if not hasattr(pynvml, n) and n not in STRUCT_FIELDS)
               for f in files}
    assert not any(missing.values()), missing
    for call in CALLS:
        assert hasattr(pynvml, call.binding), call
        assert call.c_function in C_NAMES, call
    assert nvmlfake.c_functions() <= C_NAMES, nvmlfake.c_functions() - C_NAMES


def test_the_name_check_catches_a_misspelt_class(tmp_path):
    """The defect this check exists for: nvidia-ml-py derives class names with string.capwords, so
    NVML_ERROR_GPU_IS_LOST is NVMLError_GpuIsLost; NVMLError_GPUIsLost does not exist."""
    f = tmp_path / "m.py"
    f.write_text('LOST = getattr(nv, "NVMLError_GPUIsLost", None)\nx = nv.nvmlDeviceGetPciInfo\n')
    assert {n for n in _names_in(f) if not hasattr(pynvml, n)} == {"NVMLError_GPUIsLost"}
    assert hasattr(pynvml, "NVMLError_GpuIsLost") and not hasattr(pynvml, "NVMLError_GPUIsLost")


def test_every_c_function_the_backend_calls_is_in_the_privilege_table(monkeypatch):
    b, lib = nvmlfake.backend(monkeypatch, hgx_h100(g0=dict(procs=(4242,))))
    lib.events.append((1, 48))
    b.gpus()
    b.processes(0)
    b.cpu_affinity(0)
    b.set_persistence_mode(0, True)
    b.driver_version(), b.cuda_driver_version()
    b.close()
    listed = {c.c_function for c in CALLS}
    assert set(lib.calls) <= listed, set(lib.calls) - listed


# -- a healthy board ------------------------------------------------------------------------------
def test_a_healthy_hgx_h100_is_ready_through_the_real_binding(monkeypatch):
    gpus, lib = read(monkeypatch)
    assert len(gpus) == 8 and all(g.error is None and not g.unread for g in gpus)
    g = gpus[0]
    assert (g.pci_bus_id, g.name, g.uuid) == ("0000:18:00.0", nvmlfake.H100, "GPU-00000000-h100")
    assert (g.memory_total_mib, g.compute_capability, g.persistence_mode, g.ecc_mode) == (81559, "9.0", True, True)
    assert (g.recovery_action, g.inforom_valid, g.reset_required) == ("none", True, False)
    assert len(g.nvlink) == 18 and all(link.active for link in g.nvlink)
    assert len(g.nvlink_p2p) == 7 and all(ok for _, ok in g.nvlink_p2p)
    assert g.fabric == dataclasses.replace(g.fabric, state="completed", status="success", health=(), summary="healthy")
    assert (g.pcie_link_gen_max, g.pcie_link_gen_gpu_max, g.pcie_link_width_current) == (5, 5, 16)
    v = judge(gpus)
    assert v.ready, v.message()
    c = checks(v)
    assert c["gpu.readings"].ok and c["gpu.readings"].detail == "every NVML reading answered on 8 GPU(s)"
    assert c["gpu.nvlink"].detail == "18 NVLinks active per GPU (18 expected); P2P over NVLink OK"
    assert c["gpu.fabric"].detail.startswith("8 GPU(s) registered with the NVSwitch fabric")


# -- one GPU lost, one needing a reset: only that GPU is named ---------------------------------------
def test_one_lost_gpu_is_named_alone_as_lost(monkeypatch):
    gpus, _ = read(monkeypatch, hgx_h100(g3=dict(lost=True)))
    assert [g.index for g in gpus if g.error] == [3]
    lost = gpus[3]
    assert lost.error_kind == "lost" and "GPU is lost" in lost.error
    # the others read every pair with the peers that answered, and blame no one for GPU 3
    for g in gpus:
        if g.index != 3:
            assert g.error is None and not g.unread, (g.index, g.unread)
            assert len(g.nvlink_p2p) == 6 and "0000:5d:00.0" not in dict(g.nvlink_p2p)
    v = judge(gpus)
    assert not v.ready and v.reason() == "GpuLost"
    present = checks(v)["gpu.present"]
    assert dict(present.gpus) == {str(i): i != 3 for i in range(8)}
    # a GPU that answers nothing (the fake's lost GPU) cannot name its bus id: gpu.count, from the
    # PCI bus, does where sysfs is read
    assert present.detail.startswith("GPU 3 is lost (NVML: GPU is lost (NVML_ERROR_GPU_IS_LOST))")
    assert "Xid 79" in present.detail
    assert "GPU 0 " not in present.detail and "does not answer" not in present.detail
    assert checks(v)["gpu.nvlink"].ok, checks(v)["gpu.nvlink"].detail


def test_a_gpu_lost_in_the_middle_of_its_readings_is_lost_not_an_error(monkeypatch):
    gpus, _ = read(monkeypatch, hgx_h100(g5=dict(errors={"nvmlDeviceGetNvLinkState": nvmlfake.GPU_IS_LOST})))
    assert [(g.index, g.error_kind) for g in gpus if g.error] == [(5, "lost")]
    assert "nvlink" in gpus[5].error


def test_reset_required_on_one_gpu_names_it_alone(monkeypatch):
    gpus, _ = read(monkeypatch, hgx_h100(g6=dict(reset_required=True)))
    assert [(g.index, g.error_kind, g.reset_required) for g in gpus if g.error] == [(6, "reset_required", True)]
    assert all(len(g.nvlink_p2p) == 6 for g in gpus if g.index != 6)
    v = judge(gpus)
    assert v.reason() == "GpuResetRequired", v.message()
    rec = checks(v)["gpu.recovery"]
    assert dict(rec.gpus) == {str(i): i != 6 for i in range(8)} and rec.detail.startswith("GPU 6: NVML answers")
    assert checks(v)["gpu.present"].ok  # a reset is the recovery family's, not a lost GPU


def test_a_pair_answering_a_gpu_state_blames_no_gpu(monkeypatch):
    """GPU 0's P2P calls answer RESET_REQUIRED while GPU 0 and every peer answer everything else:
    the pair's answer is not GPU 0's state (nor a peer's): a warning on GPU 0's P2P reading."""
    gpus = hgx_h100()
    gpus[0].errors["nvmlDeviceGetP2PStatus"] = nvmlfake.RESET_REQUIRED
    got, _ = read(monkeypatch, gpus)
    assert not [g for g in got if g.error]
    assert got[0].nvlink_p2p is None and "GPU requires restart" in dict(got[0].unread)["nvlink_p2p"]
    v = judge(got)
    assert v.ready, v.message()
    assert "nvlink_p2p on GPU 0 not read" in checks(v)["gpu.readings"].detail


def test_a_lost_gpu_that_still_names_its_bus_is_named_by_it(monkeypatch):
    gpus = hgx_h100()
    gpus[3].errors.update({"nvmlDeviceGetUUID": nvmlfake.GPU_IS_LOST, "nvmlDeviceGetName": nvmlfake.GPU_IS_LOST})
    got, _ = read(monkeypatch, gpus)
    assert (got[3].error_kind, got[3].pci_bus_id) == ("lost", "0000:5d:00.0")
    assert checks(judge(got))["gpu.present"].detail.startswith("GPU 3 (0000:5d:00.0) is lost")


# -- one reading's error is that reading's, for that GPU ----------------------------------------------
def test_no_permission_on_sram_and_inforom_leaves_a_ready_node_with_a_warning(monkeypatch):
    """The audit pod drops every capability: nvml.h reserves the SRAM ECC status for root."""
    denied = {"nvmlDeviceGetSramEccErrorStatus": nvmlfake.NO_PERMISSION,
              "nvmlDeviceValidateInforom": nvmlfake.NO_PERMISSION}
    gpus, _ = read(monkeypatch, hgx_h100(**{f"g{i}": dict(errors=dict(denied)) for i in range(8)}))
    assert all(g.error is None for g in gpus)
    g = gpus[0]
    assert g.sram_ecc is None and g.inforom_valid is None and g.remapped_rows is not None
    assert dict(g.unread) == {"inforom": "not read: Insufficient Permissions (NVML_ERROR_NO_PERMISSION)",
                              "sram_ecc": "not read: Insufficient Permissions (NVML_ERROR_NO_PERMISSION)"}
    v = judge(gpus)
    assert v.ready, v.message()
    c = checks(v)
    warn = c["gpu.readings"]
    assert not warn.ok and warn.severity == "warning"
    assert "sram_ecc on 8 of 8 GPUs (0, 1, 2, 3, 4, 5, 6, 7) not read: Insufficient Permissions" in warn.detail
    assert "nvml.h: requires root" in warn.detail and "gpu.memory judged without it" in warn.detail
    assert "inforom on 8 of 8 GPUs" in warn.detail
    assert c["gpu.memory"].ok and "not read: sram_ecc on GPU 0, 1" in c["gpu.memory"].detail
    assert "gpu.inforom" not in c  # nothing read, nothing said healthy


def test_unknown_from_one_nvlink_counter_is_a_warning_on_that_gpu(monkeypatch):
    gpus, _ = read(monkeypatch, hgx_h100(g2=dict(errors={"nvmlDeviceGetNvLinkErrorCounter": nvmlfake.UNKNOWN})))
    assert all(g.error is None for g in gpus)
    assert dict(gpus[2].unread) == {"nvlink_error_counters": "not read: Unknown Error (NVML_ERROR_UNKNOWN)"}
    assert all(link.active and link.crc_errors is None for link in gpus[2].nvlink)
    v = judge(gpus)
    assert v.ready, v.message()
    assert dict(checks(v)["gpu.readings"].gpus) == {str(i): i != 2 for i in range(8)}


def test_an_unreadable_nvlink_state_is_not_judged_as_links_down(monkeypatch):
    gpus, _ = read(monkeypatch, hgx_h100(g4=dict(errors={"nvmlDeviceGetNvLinkState": nvmlfake.UNKNOWN})))
    assert gpus[4].nvlink is None and "nvlink" in dict(gpus[4].unread)
    v = judge(gpus)
    assert v.ready, v.message()
    assert "not judged: GPU 4 (not read: state of link(s) 0, 1" in checks(v)["gpu.nvlink"].detail


@pytest.mark.parametrize("c_function, reading", [
    ("nvmlDeviceGetMemoryInfo", "memory"), ("nvmlDeviceGetTemperature", "temperature"),
    ("nvmlDeviceGetRemappedRows", "remapped_rows"), ("nvmlDeviceGetFieldValues", "recovery_action"),
    ("nvmlDeviceGetGpuFabricInfoV", "fabric"), ("nvmlDeviceGetP2PStatus", "nvlink_p2p"),
    ("nvmlDeviceGetCurrPcieLinkGeneration", "pcie_link"), ("nvmlDeviceGetPersistenceMode", "persistence_mode"),
])
def test_any_one_reading_failing_never_fails_the_gpu(monkeypatch, c_function, reading):
    gpus, _ = read(monkeypatch, hgx_h100(g1=dict(errors={c_function: nvmlfake.UNKNOWN})))
    assert all(g.error is None for g in gpus), [g.error for g in gpus if g.error]
    assert reading in dict(gpus[1].unread)
    v = judge(gpus)
    assert v.ready, v.message()
    assert "GPU 1" in checks(v)["gpu.readings"].detail or "GPU 1 " in checks(v)["gpu.readings"].detail


# -- fabric health ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mask, words", [
    (nvmlfake.healthy_mask() & ~(0x3 << 0) | (1 << 0), "degraded bandwidth"),
    (nvmlfake.healthy_mask() & ~(0x3 << 2) | (1 << 2), "route recovery in progress"),
    (nvmlfake.healthy_mask() & ~(0x3 << 4) | (1 << 4), "route unhealthy"),
    (nvmlfake.healthy_mask() & ~(0x3 << 6) | (1 << 6), "access timeout recovery in progress"),
    (nvmlfake.healthy_mask() & ~(0xF << 8) | (5 << 8), "incorrect configuration: insufficient nvlinks"),
    (nvmlfake.healthy_mask() & ~(0xF << 8) | (2 << 8), "incorrect configuration: incorrect sysguid"),
])
def test_each_fabric_health_field_fails_the_fabric(monkeypatch, mask, words):
    gpus, _ = read(monkeypatch, hgx_h100(g7=dict(fabric=(3, 0, mask, 1))))
    assert gpus[7].fabric.state == "completed" and gpus[7].fabric.status == "success"
    v = judge(gpus)
    assert not v.ready and v.reason() == "FabricNotReady", v.message()
    fab = checks(v)["gpu.fabric"]
    assert fab.detail.startswith(f"GPU 7 (0000:db:00.0): fabric health: {words}"), fab.detail
    assert dict(fab.gpus) == {str(i): i != 7 for i in range(8)}


def test_fabric_summary_and_older_drivers(monkeypatch):
    gpus, _ = read(monkeypatch, hgx_h100(g0=dict(fabric=(3, 0, nvmlfake.healthy_mask(), 3))))
    assert "fabric health summary limited capacity" in checks(judge(gpus))["gpu.fabric"].detail
    # a driver that takes only the v2 struct: the health mask is still judged
    gpus, _ = read(monkeypatch, hgx_h100(g0=dict(fabric=(3, 0, 1, 0), fabric_versions=(1, 2))))
    assert gpus[0].fabric.health == ("degraded_bandwidth",) and gpus[0].fabric.summary is None
    # a driver without the versioned call: state and status only
    gpus, _ = read(monkeypatch, hgx_h100(), missing=frozenset({"nvmlDeviceGetGpuFabricInfoV"}))
    assert gpus[0].fabric.state == "completed" and gpus[0].fabric.health == () and not gpus[0].unread
    assert judge(gpus).ready
    # registration not finished still fails, as before
    gpus, _ = read(monkeypatch, hgx_h100(g1=dict(fabric=(2, 0, 0, 0))))
    assert "fabric registration in progress" in checks(judge(gpus))["gpu.fabric"].detail


# -- MIG ----------------------------------------------------------------------------------------------
def test_a_mig_node_is_not_failed_on_nvlink(monkeypatch):
    gpus, _ = read(monkeypatch, hgx_h100(**{f"g{i}": dict(mig=(1, 1)) for i in range(8)}))
    assert all(g.mig_mode and not any(link.active for link in g.nvlink) for g in gpus)
    assert all(g.nvlink_p2p is None and g.remapped_rows is None for g in gpus)
    v = judge(gpus)
    assert v.ready, v.message()
    nv = checks(v)["gpu.nvlink"]
    assert nv.ok and nv.detail.startswith("not judged: no GPU's NVLinks could be judged; GPU 0, 1, 2, 3, 4, 5, 6, 7: "
                                          "MIG enabled")


def test_one_mig_gpu_beside_a_real_link_fault(monkeypatch):
    gpus, _ = read(monkeypatch, hgx_h100(g0=dict(mig=(1, 1)), g1=dict(links=[True] * 17 + [False])))
    v = judge(gpus)
    nv = checks(v)["gpu.nvlink"]
    assert not nv.ok and nv.detail.startswith("GPU 1 (0000:2a:00.0): 17 of 18 NVLinks active (down: 17)")
    assert "GPU 0: MIG enabled" in nv.detail and dict(nv.gpus)["0"] is True


# -- recovery action ---------------------------------------------------------------------------------
@pytest.mark.parametrize("code, name, fatal, words", [
    (0, "none", False, ""),
    (1, "reset", True, "reset the GPU (nvidia-smi -r"),
    (2, "reboot", True, "reboot the node"),
    (3, "drain_p2p", False, "disable UVM persistence mode"),
    (4, "drain_and_reset", True, "schedule no new work on it, then reset the GPU"),
    (5, "recover_imex_domain", True, "recover the node's IMEX domain"),
    (6, "bus_reset", True, "reset the GPU's PCIe bus"),
    (7, "system_reboot", True, "reboot the system"),
])
def test_each_recovery_action(monkeypatch, code, name, fatal, words):
    gpus, _ = read(monkeypatch, hgx_h100(g2=dict(recovery=code)))
    assert gpus[2].recovery_action == name
    v = judge(gpus)
    c = checks(v)
    assert v.ready is not fatal, v.message()
    if fatal:
        assert v.reason() == "GpuResetRequired" and words in c["gpu.recovery"].detail
        assert c["gpu.recovery"].detail.startswith(f"GPU 2 (0000:3a:00.0): NVML recovery action {name}")
        assert "nvidia-smi -r" not in c["gpu.recovery"].detail or name == "reset" or name == "bus_reset"
    elif name == "drain_p2p":
        w = c["gpu.recovery_p2p"]
        assert w.severity == "warning" and not w.ok and words in w.detail and "read again" in w.detail
        assert c["gpu.recovery"].ok
    else:
        assert c["gpu.recovery"].detail == "NVML asks no recovery action of any GPU"


def test_field_230_unknown_to_an_older_driver(monkeypatch):
    """Before R550 the field answers NOT_SUPPORTED in its own nvmlReturn while the call succeeds."""
    gpus, _ = read(monkeypatch, hgx_h100(**{f"g{i}": dict(recovery=None) for i in range(8)}))
    assert all(g.recovery_action is None and not g.unread for g in gpus)
    v = judge(gpus)
    assert v.ready and checks(v)["gpu.recovery"].detail == "no GPU requires a reset (NVML reports no recovery action here)"


# -- XID events, PCIe, the rest of the backend ----------------------------------------------------------
def test_xid_events_through_the_real_event_struct(monkeypatch):
    b, lib = nvmlfake.backend(monkeypatch)
    assert lib.registered == list(range(8))
    lib.events += [(2, 79), (5, 48), (2, 31)]
    gpus = b.gpus()
    assert gpus[2].xid_events == (79, 31) and gpus[5].xid_events == (48,)
    assert b.gpus()[2].xid_events == (79, 31)  # kept between reads
    b.close()


def test_xid_events_that_cannot_be_registered_are_said(monkeypatch):
    gpus, _ = read(monkeypatch, hgx_h100(g1=dict(errors={"nvmlDeviceRegisterEvents": nvmlfake.NO_PERMISSION})))
    assert dict(gpus[1].unread) == {"xid_events": "not read: NVML events: Insufficient Permissions "
                                                  "(NVML_ERROR_NO_PERMISSION)"}
    # NOT_SUPPORTED (a platform without XID events, e.g. some VMs): nothing to say
    gpus, _ = read(monkeypatch, hgx_h100(g1=dict(errors={"nvmlDeviceRegisterEvents": nvmlfake.NOT_SUPPORTED})))
    assert not gpus[1].unread


def test_a_gen5_gpu_in_a_gen4_host_passes_under_load(monkeypatch):
    busy = dict(pcie=(4, 4, 5, 16, 16), utilization=97)
    gpus, _ = read(monkeypatch, hgx_h100(**{f"g{i}": dict(busy) for i in range(8)}))
    assert (gpus[0].pcie_link_gen_max, gpus[0].pcie_link_gen_gpu_max) == (4, 5)
    v = judge(gpus, topology={"gpus": [{"pci_bus_id": g.pci_bus_id, "pcie": {
        "gen_current": 4, "gen_max": 5, "gen_device_max": 5, "width_current": 16, "width_max": 16}} for g in gpus]})
    pc = checks(v)["gpu.pcie"]
    assert pc.ok, pc.detail
    assert "GPU 0 is Gen5-capable in a Gen4 link (its slot or host): judged against Gen4" in pc.detail
    # the same GPU trained down to Gen4 in a Gen5 host fails under load
    gpus, _ = read(monkeypatch, hgx_h100(g3=dict(pcie=(4, 5, 5, 16, 16), utilization=97)))
    pc = checks(judge(gpus))["gpu.pcie"]
    assert not pc.ok and pc.detail.startswith("GPU 3 (0000:5d:00.0): PCIe link trained down (Gen4 of Gen5")


def test_persistence_processes_affinity_and_permission(monkeypatch):
    b, lib = nvmlfake.backend(monkeypatch, hgx_h100(g0=dict(procs=(1234, 99), persistence=0),
                                                    g2=dict(errors={"nvmlDeviceSetPersistenceMode": nvmlfake.NO_PERMISSION}),
                                                    g1=dict(lost=True)))
    assert b.processes(0) == [99, 1234] and b.processes(3) == []
    b.set_persistence_mode(0, True)
    assert lib.gpus[0].persistence == 1 and b.gpus()[0].persistence_mode is True
    from gpu_tune.gpu.base import GpuError

    with pytest.raises(GpuError) as ei:
        b.set_persistence_mode(2, True)
    assert ei.value.kind == "no_permission" and "needs root" in str(ei.value)
    with pytest.raises(GpuError) as ei:
        b.set_persistence_mode(1, True)
    assert ei.value.kind == "lost"
    assert b.cpu_affinity(0) == frozenset(range(56)) and b.cpu_affinity(5) == frozenset(range(56, 112))
    assert b.cpu_affinity(1) is None  # lost
    b.close()


def test_nvml_unavailable_falls_back_to_the_null_backend(monkeypatch, caplog):
    import logging

    from gpu_tune.errors import InputError
    from gpu_tune.gpu import select_backend

    nvmlfake.install(monkeypatch, FakeNvmlLib(hgx_h100(), init_error=9))  # NVML_ERROR_DRIVER_NOT_LOADED
    with caplog.at_level(logging.INFO, logger="gpu_tune"):
        b = select_backend("auto")
    assert b.name == "none" and "NVML unavailable" in b.reason and "Driver Not Loaded" in b.reason
    with pytest.raises(InputError, match="--gpu-backend nvml"):
        select_backend("nvml")


def test_the_agent_keeps_the_readings_between_passes(monkeypatch):
    """GpuInfo.as_dict / from_dict (what the agent keeps) carry the new fields whole."""
    gpus, _ = read(monkeypatch, hgx_h100(g0=dict(fabric=(3, 0, 1 | (2 << 2), 2),
                                                 errors={"nvmlDeviceGetSramEccErrorStatus": nvmlfake.NO_PERMISSION})))
    back = GpuInfo.from_dict(gpus[0].as_dict())
    assert back.fabric == gpus[0].fabric and back.unread == gpus[0].unread and back == gpus[0]


def test_a_check_that_read_nothing_says_it_did_not_judge(monkeypatch):
    gpus, _ = read(monkeypatch, hgx_h100(**{f"g{i}": dict(lost=True) for i in range(8)}))
    assert all(g.error_kind == "lost" for g in gpus)
    from gpu_tune.judge.checks.base import Expect

    # a profile that expects the HGX board's figures (readiness.expect), as GPUs that answer nothing
    # cannot name their model
    v = judge(gpus, expect=Expect(gpus=8, nvlink_active_per_gpu=18, source="readiness.expect"))
    nv = checks(v)["gpu.nvlink"]
    assert nv.detail == "not judged: no GPU answered NVML (gpu.present names them)"
    assert "OK" not in nv.detail and v.reason() == "GpuLost"


def test_the_remapped_rows_limit_is_credited_to_dcgm_alone():
    from gpu_tune.judge.checks import memory

    src = Path(memory.__file__).read_text()
    line = next(x for x in src.splitlines() if "UNCORRECTABLE_ROWS_LIMIT = " in x or "512 rows" in x)
    assert "DCGM" in line and "GPUd" not in line
    assert "GPUd's rule" not in (ROOT / "docs" / "health.md").read_text()


def test_the_privilege_tool_calls_every_listed_call_through_the_binding(monkeypatch, capsys):
    """tools/nvml_privileges.py's child, in this process over the fake library: every call the
    table lists is made with the agent's arguments and answers; a refused one shows its code."""
    import json
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import nvml_privileges
    finally:
        sys.path.remove(str(ROOT / "tools"))
    gpus = hgx_h100(2, g1=dict(errors={"nvmlDeviceSetPersistenceMode": nvmlfake.NO_PERMISSION}))
    nvmlfake.install(monkeypatch, FakeNvmlLib(gpus))
    assert nvml_privileges.child() == 0
    out = json.loads(capsys.readouterr().out)
    assert out["init"] == "ok"
    answers = {name: {i: v["answer"] for i, v in per.items()} for name, per in out["calls"].items()}
    assert answers["nvmlDeviceSetPersistenceMode"] == {
        "0": "ok", "1": "Insufficient Permissions (NVML_ERROR_NO_PERMISSION)"}
    assert answers["nvmlDeviceGetRetiredPagesPendingStatus"]["0"] == "Not Supported (NVML_ERROR_NOT_SUPPORTED)"
    others = {n: a for n, a in answers.items()
              if n not in ("nvmlDeviceSetPersistenceMode", "nvmlDeviceGetRetiredPagesPendingStatus")}
    assert all(v == "ok" for a in others.values() for v in a.values()), others
    assert nvml_privileges.main(["--shapes", "root,bogus"]) == 2
