"""Hostile values from NVML (docs/security.md "Round 5"), each through `gpu-tune check` as a process
of its own and through the agent's own pass, both over the REAL nvidia-ml-py with only its C
library faked (tests/nvmlfake.py) on the 8-GPU fixture host: bytes that are not UTF-8 where the
binding expects a name, a UUID or a bus id; NVML's recovery action as a double or a signed value;
a link state, a temperature and other values NVML cannot hold; every reading taken once per pass;
one GPU listed twice while another is gone. And, from round 4, InfiniBand ports past the read
bound. Two rules decide every case: a value the tool cannot use never fails a healthy GPU and
never hides a real fault; no exit 3."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from gpu_tune.serve.agent import Agent
from gpu_tune.serve.options import ServeOptions
from gpu_tune.serve.stages import default_stages
from tests import nvmlcommand, nvmlfake
from tests.healthkit import GPU_FIXTURE, dgx_tree, health_policies, host  # noqa: F401 (fixtures)
from tests.nvmlfake import FakeNvmlLib, hgx_h100

PROFILE = "include: training.yaml\nreadiness:\n  require_compliant: false\n  require_probe: false\n"
NOT_UTF8 = {"uuid": b"GPU-00000003-\xff\xfe", "name": b"NVIDIA H100 \xc3\x28", "bus_id": b"00000000:5D:00.\xe9"}


@pytest.fixture
def policies(tmp_path) -> Path:
    return health_policies(tmp_path / "policies", PROFILE)


def check(tmp_path, root, policies, gpus, *, calls: Path | None = None) -> tuple[int, dict]:
    scenario = nvmlcommand.write_scenario(tmp_path / "nvml.json", gpus)
    r = nvmlcommand.command(scenario, "--root", str(root), "--gpu-backend", "nvml", "--policy-dir", str(policies),
                         "check", "--profile", "health", "-o", "json", calls=calls)
    assert r.returncode in (0, 1), f"exit {r.returncode}: {r.stderr.strip()[-600:]}"
    assert "Traceback" not in r.stderr
    return r.returncode, json.loads(r.stdout)


def agent_pass(monkeypatch, root, policies, gpus, lib: FakeNvmlLib | None = None):
    """One pass of the agent's real stages over the fake library: its verdict's checks by name."""
    nvmlfake.install(monkeypatch, lib or FakeNvmlLib(gpus))
    st = default_stages(ServeOptions(root=str(root), gpu_backend="nvml", policy_dir=str(policies), profile="health",
                                     no_kube=True))
    try:
        snap = Agent(st, probe_enabled=False).run_pass()
    finally:
        st.close()
    assert all(c.success for c in snap.collectors if c.name != "probe"), [c for c in snap.collectors if not c.success]
    return snap.verdict.ready, {c.name: c for c in snap.verdict.checks}


def by_name(doc) -> dict:
    return {c["name"]: c for c in doc["checks"]}


# -- a name, UUID or bus id that is not UTF-8 ---------------------------------------------------------
@pytest.mark.parametrize("field", ["uuid", "name", "bus_id"])
def test_a_gpu_whose_identity_is_not_utf8_fails_alone_and_named(tmp_path, host, policies, monkeypatch, field):
    """Before: exit 3 (UnicodeDecodeError from the binding) for the whole check, no GPU judged, and
    the GPU lost at the same time unnamed."""
    gpus = hgx_h100(g3={field: NOT_UTF8[field]}, g6=dict(lost=True))
    rc, out = check(tmp_path, host, policies, gpus)
    present = by_name(out)["gpu.present"]
    assert rc == 1 and out["reason"] == "GpuLost", out["message"]
    assert "GPU 6 is lost" in present["detail"], present
    assert "cannot say who it is (NVML: its " in present["detail"] and "is not UTF-8: '" in present["detail"]
    assert "\\\\x" in json.dumps(present["detail"]) and "\ufffd" not in present["detail"]  # escaped, never raw
    # every other GPU is read and judged as usual
    c = by_name(out)
    assert c["gpu.nvlink"]["ok"] and c["gpu.memory"]["ok"] and c["gpu.readings"]["ok"], c["gpu.nvlink"]
    ready, checks = agent_pass(monkeypatch, host, policies, gpus)
    assert not ready and "GPU 3" in checks["gpu.present"].detail and "GPU 6 is lost" in checks["gpu.present"].detail
    assert dict(checks["gpu.present"].gpus) == {str(i): i not in (3, 6) for i in range(8)}


# -- NVML's recovery action (field 230) as a double or a signed value -----------------------------------
@pytest.mark.parametrize("value, vtype, shown", [
    (float("nan"), 0, "nan"), (float("inf"), 0, "inf"), (1.5, 0, "1.5"), (-1, 5, "-1"), (-1, 4, "-1"),
    (2**32 - 1, 1, "4294967295"),
])
def test_a_recovery_action_it_cannot_use_is_not_read(tmp_path, host, policies, monkeypatch, value, vtype, shown):
    """Before: NaN and infinity exit 3 (ValueError, OverflowError); 1.5 read as 1 (reset: the GPU
    failed GpuResetRequired); -1 became unknown_-1 and failed the GPU."""
    gpus = hgx_h100(g2=dict(recovery=value, recovery_type=vtype))
    rc, out = check(tmp_path, host, policies, gpus)
    c = by_name(out)
    assert rc == 0 and out["ready"], out["message"]
    assert c["gpu.recovery"]["ok"] and c["gpu.recovery"]["detail"].endswith("not read on GPU 2 (see gpu.readings)")
    w = c["gpu.readings"]
    assert w["severity"] == "warning" and not w["ok"]
    assert w["detail"].startswith(f"recovery_action on GPU 2 not read: {shown} is not a recovery action"), w["detail"]
    ready, checks = agent_pass(monkeypatch, host, policies, gpus)
    assert ready and "recovery_action on GPU 2 not read" in checks["gpu.readings"].detail


def test_a_recovery_action_of_another_value_type_is_still_judged(monkeypatch):
    """A whole number in a double or a signed field is an action all the same: it still gates."""
    for value, vtype, name in ((1.0, 0, "reset"), (4, 5, "drain_and_reset"), (8, 1, "unknown_8")):
        b, _ = nvmlfake.backend(monkeypatch, hgx_h100(g2=dict(recovery=value, recovery_type=vtype)))
        assert b.gpus()[2].recovery_action == name
        b.close()


# -- values NVML cannot hold ----------------------------------------------------------------------------
LINK_7 = [True] * 3 + [7] + [True] * 14


@pytest.mark.parametrize("gpu, reading, words, judged", [
    (dict(links=LINK_7), "nvlink", "state of link(s) 3: state 7 is not an NVML link state (0 or 1)", "gpu.nvlink"),
    (dict(temperature=2**32 - 1), "temperature", "4294967295 (NVML's \"not available\") is not a GPU temperature in C "
     "(0 to 200)", "gpu.thermal"),
    (dict(pcie=(5, 2**32 - 1, 5, 16, 16), utilization=97), "pcie_link", "4294967295 (NVML's \"not available\") is "
     "not a PCIe generation (1 to 8)", "gpu.pcie"),
    (dict(utilization=2**32 - 1, pcie=(4, 5, 5, 16, 16)), "utilization", "is not a utilization in percent",
     "gpu.pcie"),
    (dict(p2p={0: 99}), "nvlink_p2p", "0000:18:00.0: status 99 is not an NVML P2P status (0 to 6)", "gpu.nvlink"),
    (dict(fabric=(9, 0, nvmlfake.healthy_mask(), 1)), "fabric", "state 9 is not an NVML fabric state (0 to 3)",
     "gpu.fabric"),
])
def test_a_value_nvml_cannot_hold_is_a_warning_not_a_fault(tmp_path, host, policies, monkeypatch, gpu, reading,
                                                           words, judged):
    """Before: NVLink state 7 read as down (NvlinkDown, 17 of 18), a temperature of 2^32-1 was
    GpuSlowedDown at 4.29e9 C, a top PCIe generation of 2^32-1 a link trained down, a utilization
    of 2^32-1 taken without a word for a busy GPU, an unknown P2P status no P2P, a fabric state
    of 9 a registration not finished."""
    gpus = hgx_h100(g1=gpu)
    rc, out = check(tmp_path, host, policies, gpus)
    c = by_name(out)
    assert rc == 0 and out["ready"], out["message"]
    w = c["gpu.readings"]
    assert not w["ok"] and w["severity"] == "warning" and f"{reading} on GPU 1 not read: " in w["detail"], w["detail"]
    assert words in w["detail"], w["detail"]
    assert c[judged]["ok"] if judged in c else judged == "gpu.fabric", c.get(judged)
    ready, checks = agent_pass(monkeypatch, host, policies, gpus)
    assert ready and words in checks["gpu.readings"].detail


def test_counters_at_all_ones_still_fail_closed(monkeypatch):
    """A memory error counter NVML says is 2^32-1 is taken as it says (docs/health.md): failing
    closed there costs a drain, passing would hide a GPU that lost its memory."""
    from tests.test_nvml_binding import checks, judge, read

    gpus, _ = read(monkeypatch, hgx_h100(g4=dict(remap=(0, 2**32 - 1, 0, 0))))
    assert checks(judge(gpus))["gpu.memory"].ok is False


# -- one reading per pass -------------------------------------------------------------------------------
def test_every_nvml_reading_is_taken_once_per_pass(tmp_path, host, policies, monkeypatch):
    """Before: the backend's gpus() ran five times per check (the topology, the audit's MIG and
    persistence knobs, the IRQ knob's topology, the verdict): every reading of every GPU five times."""
    calls = tmp_path / "calls.json"
    rc, out = check(tmp_path, host, policies, hgx_h100(), calls=calls)
    assert rc == 0, out["message"]
    keys = nvmlfake.pass_calls(json.loads(calls.read_text()))
    twice = {k: n for k, n in Counter(keys).items() if n > 1}
    assert not twice, f"readings taken more than once in one check: {sorted(twice.items())[:6]}"
    assert Counter(k[0] for k in keys)["nvmlDeviceGetUUID"] == 8
    # the agent: one reading per pass, and a new one each pass
    lib = FakeNvmlLib(hgx_h100())
    nvmlfake.install(monkeypatch, lib)
    st = default_stages(ServeOptions(root=str(host), gpu_backend="nvml", policy_dir=str(policies), profile="health",
                                     no_kube=True))
    agent = Agent(st, probe_enabled=False)
    try:
        for _ in range(2):
            start = len(lib.call_keys)
            agent.run_pass()
            keys = [tuple(k) for k in lib.call_keys[start:]]
            twice = {k: n for k, n in Counter(keys).items() if n > 1}
            assert not twice, f"readings taken more than once in one pass: {sorted(twice.items())[:6]}"
            assert Counter(k[0] for k in keys)["nvmlDeviceGetUUID"] == 8
    finally:
        st.close()


def test_pairs_are_bounded_and_what_is_left_is_said(monkeypatch):
    """Past 33 GPUs each reads P2P with 32 peers, the next ones round the list: every GPU read, the
    pairs O(n); the pairs left out are said (gpu.readings), never a fault."""
    peers = 32
    b, lib = nvmlfake.backend(monkeypatch, nvmlfake.many(40))
    gpus = b.gpus()
    b.close()
    pairs = Counter(lib.calls)["nvmlDeviceGetP2PStatus"]
    assert pairs == 40 * peers, f"{pairs:,} P2P calls for 40 GPUs: the pairs are not bounded"
    assert all(len(g.nvlink_p2p) == peers for g in gpus)
    asked = Counter(peer for g in gpus for peer, _ in g.nvlink_p2p)
    assert set(asked.values()) == {peers}  # every GPU is a peer as often as it asks
    assert dict(gpus[0].unread)["nvlink_p2p"] == "not read: 7 of 39 peers (at most 32 a GPU per pass)"
    b, lib = nvmlfake.backend(monkeypatch, nvmlfake.many(8))
    assert all(len(g.nvlink_p2p) == 7 and not g.unread for g in b.gpus())
    b.close()


# -- one GPU listed twice, another gone ------------------------------------------------------------------
def test_a_gpu_listed_twice_and_the_one_gone_are_both_named(tmp_path, host, policies, monkeypatch):
    """Before: gpu.count compared counts only: 8 on the bus, 8 from NVML, the node ready while the
    GPU at 0000:5d:00.0 was gone and GPU 2 was listed twice."""
    gpus = hgx_h100()
    gpus[3] = nvmlfake.dataclasses.replace(gpus[2])
    rc, out = check(tmp_path, host, policies, gpus)
    count = by_name(out)["gpu.count"]
    assert rc == 1 and out["reason"] == "GpuMissing", out["message"]
    assert "NVML lists GPU 2, 3 under one UUID GPU-00000002-h100 and bus id 0000:3a:00.0: one GPU listed 2 times" \
        in count["detail"], count["detail"]
    assert "1 NVIDIA GPU(s) on the PCI bus that NVML does not list: 0000:5d:00.0" in count["detail"]
    ready, checks = agent_pass(monkeypatch, host, policies, gpus)
    assert not ready and "0000:5d:00.0" in checks["gpu.count"].detail and "GPU 2, 3" in checks["gpu.count"].detail


# -- InfiniBand ports past the read bound (round 4) -------------------------------------------------------
IB1 = "sys/devices/pci0000:20/0000:20:01.0/0000:29:00.0/infiniband/mlx5_1/ports"


def add_ports(root: Path, n: int, down: int) -> None:
    """Ports 2..n on mlx5_1 (an HCA in switchdev mode numbers a port per representor), all up at
    400 Gb/s but ``down``."""
    for p in range(2, n + 1):
        d = root / IB1 / str(p)
        (d / "counters").mkdir(parents=True)
        for name, text in (("state", "1: DOWN" if p == down else "4: ACTIVE"), ("phys_state", "5: LinkUp"),
                           ("rate", "400 Gb/sec (4X NDR)"), ("link_layer", "InfiniBand"),
                           ("counters/link_downed", "0")):
            (d / name).write_text(text + "\n")


def fixture_check(cli, root, policies) -> tuple[int, dict]:
    r = cli("check", "--root", str(root), "--gpu-fixture", str(GPU_FIXTURE), "--policy-dir", str(policies),
            "--profile", "health", "-o", "json")
    assert r.returncode in (0, 1), f"exit {r.returncode}: {r.stderr.strip()[-600:]}"
    return r.returncode, json.loads(r.stdout)


def test_a_down_port_past_the_read_bound_never_passes_silently(cli, host, policies):
    """Before: 4,096 ports on mlx5_1, port 4096 down: ready, "1002 port(s) ACTIVE/LinkUp", nothing
    said (port numbers past 999 were dropped as "not port numbers", into a list no check shows)."""
    add_ports(host, 4096, down=4096)
    rc, out = fixture_check(cli, host, policies)
    ib = by_name(out)["network.infiniband"]
    assert rc == 1 and not ib["ok"], ib["detail"]
    assert "not judged: 3,073 port(s) and 6 device(s) not read (at most 1,024 ports per pass)" in ib["detail"], ib
    assert "name the node's ports in readiness.expect.ib_ports" in ib["detail"]
    st = default_stages(ServeOptions(root=str(host), gpu_backend="fixture", gpu_fixture=str(GPU_FIXTURE),
                                     policy_dir=str(policies), profile="health", no_kube=True))
    try:
        snap = Agent(st, probe_enabled=False).run_pass()
    finally:
        st.close()
    agent_ib = {c.name: c for c in snap.verdict.checks}["network.infiniband"]
    assert not snap.verdict.ready and "not judged: 3,073 port(s)" in agent_ib.detail


def test_named_ports_are_read_first_and_the_rest_is_said(cli, host, policies):
    add_ports(host, 4096, down=4096)
    (policies / "health.yaml").write_text(PROFILE + "  expect:\n    ib_ports: [mlx5_0/1, mlx5_1/1, mlx5_1/4096]\n")
    rc, out = fixture_check(cli, host, policies)
    ib = by_name(out)["network.infiniband"]
    assert rc == 1 and "mlx5_1/4096 is DOWN / LinkUp" in ib["detail"], ib["detail"]
    assert "not judged" not in ib["detail"]  # every port the profile names was read
    (host / IB1 / "4096/state").write_text("4: ACTIVE\n")
    rc, out = fixture_check(cli, host, policies)
    ib = by_name(out)["network.infiniband"]
    assert rc == 0 and ib["ok"] and ib["detail"].startswith("3 port(s) ACTIVE/LinkUp"), ib["detail"]
    assert "3,073 port(s) and 6 device(s) not read" in ib["detail"]
    # a named device past the bound is not judged
    (policies / "health.yaml").write_text(PROFILE + "  expect:\n    ib_ports: [mlx5_1]\n")
    rc, out = fixture_check(cli, host, policies)
    ib = by_name(out)["network.infiniband"]
    assert rc == 1 and "not judged: mlx5_1 among them" in ib["detail"], ib["detail"]


def test_a_device_whose_ports_cannot_be_listed_is_not_judged(cli, host, policies):
    """Before: the device was left out silently (its listing error went to a list no check shows)."""
    ports = host / IB1
    import shutil

    shutil.rmtree(ports)
    ports.write_text("")  # not a folder: no port listed
    rc, out = fixture_check(cli, host, policies)
    ib = by_name(out)["network.infiniband"]
    assert rc == 1 and "mlx5_1: ports not listed (no port in" in ib["detail"], ib["detail"]
    assert "not judged: mlx5_1: ports not listed" in ib["detail"], ib["detail"]
