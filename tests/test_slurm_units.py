"""The Slurm mode's pure parts (gpu_tune/slurm): ``scontrol -o show node`` lines as Slurm 22.05 prints
them, ``Gres=`` counts, the ``slurm.gres`` check, the drain/resume rules, the reason's shape, and the
CLI's bad input. The whole mode on a real Slurm: tests/test_slurm.py."""

from __future__ import annotations

import json

import pytest

from gpu_tune.gpu.base import GpuInfo
from gpu_tune.host.fs import HostFS
from gpu_tune.judge.checks.base import FATAL, Check
from gpu_tune.judge.readiness import Verdict
from gpu_tune.slurm import passes
from gpu_tune.slurm.decide import MAX_REASON, PREFIX, clean, decide, drain_reason, ours
from gpu_tune.slurm.gres import gres_check
from gpu_tune.slurm.health import context_of, node_name
from gpu_tune.slurm.node import NodeLineError, SlurmNode, gres_count, parse_node, parse_nodes

# as Slurm 22.05.8 printed them on this project's test cluster
IDLE = ("NodeName=gpu-a Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=1.17 "
        "AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:8 NodeAddr=127.0.0.1 NodeHostName=vm "
        "Version=22.05.8 OS=Linux 6.18.44-fc-v857 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=1000 AllocMem=0 FreeMem=20431 "
        "Sockets=2 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=gpu  "
        "BootTime=2026-11-28T04:16:35 SlurmdStartTime=2026-11-28T04:23:10 LastBusyTime=2026-11-28T04:23:13 "
        "CfgTRES=cpu=2,mem=1000M,billing=2 AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s "
        "ExtSensorsWatts=0 ExtSensorsTemp=n/s")
DRAINED = IDLE.replace("State=IDLE ", "State=IDLE+DRAIN+INVALID_REG ") + \
    " Reason=gres/gpu count reported lower than configured (0 < 8) [root@2026-11-28T04:23:10]"


def node(state="IDLE", reason="", gres="gpu:8", by="root") -> SlurmNode:
    return SlurmNode("gpu-a", state, reason, by if reason else "", "2026-11-28T04:28:01" if reason else "", "vm",
                     "127.0.0.1", gres)


def gpus(n=8, mig=()) -> list[GpuInfo]:
    return [GpuInfo(index=i, uuid=f"GPU-{i}", name="NVIDIA H100 80GB HBM3", pci_bus_id=f"0000:{0x18 + i:02x}:00.0",
                    mig_mode=(i in mig) or None) for i in range(n)]


def topo(n=8) -> dict:
    return {"gpus": [{"pci_bus_id": f"0000:{0x18 + i:02x}:00.0"} for i in range(n)]}


def verdict(*failing: tuple[str, str, str]) -> Verdict:
    checks = [Check("gpu.present", True, "8 present", category="presence")]
    for name, detail, category in failing:
        checks.append(Check(name, False, detail, severity=FATAL, category=category))
    return Verdict(not failing, tuple(checks))


XID = ("gpu.xid", "GPU 3: XID 79 (GPU has fallen off the bus)", "recovery")


# -- scontrol's lines --------------------------------------------------------------------------------
def test_a_line_of_scontrol_show_node():
    n = parse_node(IDLE)
    assert (n.name, n.state, n.hostname, n.addr, n.gres, n.reason) == ("gpu-a", "IDLE", "vm", "127.0.0.1", "gpu:8", "")
    assert not n.drain and n.out_of_service == []
    d = parse_node(DRAINED)
    assert d.reason == "gres/gpu count reported lower than configured (0 < 8)"
    assert (d.reason_by, d.reason_at) == ("root", "2026-11-28T04:23:10")
    assert d.drain and d.flags == {"IDLE", "DRAIN", "INVALID_REG"}
    # a reason with spaces, equals signs in lower case and brackets of its own; Comment after it
    odd = parse_node(IDLE + " Reason=maint: swap psu=2 [ticket 7] [alice@2026-11-28T05:00:00] Comment=rack 4")
    assert (odd.reason, odd.reason_by) == ("maint: swap psu=2 [ticket 7]", "alice")
    assert parse_node(IDLE.replace("State=IDLE ", "State=DOWN+DRAIN+NOT_RESPONDING ")).out_of_service == ["DOWN"]


def test_lines_that_are_not_scontrols_are_refused():
    for bad in ("", "slurm_load_node error: Unable to contact slurm controller", "Name=x State=IDLE",
                IDLE.replace("State=IDLE ", ""), IDLE.replace("State=IDLE ", "State= "),
                IDLE.replace("State=IDLE ", "State=idle,drain "), "NodeName= State=IDLE"):
        with pytest.raises(NodeLineError):
            parse_node(bad)
    # a reason keeps its leading spaces: ' gpu-tune: x' is not gpu-tune's
    spaced = parse_node(IDLE.replace("State=IDLE ", "State=IDLE+DRAIN ") + " Reason= gpu-tune: x [root@2026-11-28T05:00:00]")
    assert spaced.reason == " gpu-tune: x" and spaced.reason_by == "root" and not ours(spaced)
    assert parse_nodes("No nodes in the system\n") == []
    assert [n.name for n in parse_nodes(IDLE + "\n\n" + DRAINED.replace("gpu-a", "gpu-b", 1) + "\n")] == ["gpu-a", "gpu-b"]


@pytest.mark.parametrize("gres,count", [
    ("gpu:8", 8), ("gpu:h100:8(S:0-1)", 8), ("gpu:a100:4(S:0),gpu:v100:2(S:1),nic:1", 6), ("(null)", None),
    ("", None), ("gpu:2(S:0,1),nic:1", 2), ("gpu", 1), ("gpu:h100", 1), ("shard:8,mps:100", None), ("gpu:1k", 1024),
    ("gpu:h100:no_consume:4", 4), ("gpu:0", 0), ("gpu:3g.40gb:2", 2),
])
def test_gres_counts(gres, count):
    assert gres_count(gres) == count


def test_a_gres_entry_that_is_not_one_is_refused():
    for bad in ("gpu:h100:eight", "gpu:a:b:c", "g p u:2", "gpu:-8", "gpu:h100:-8", "gpu:h100:\u0668", "gpu:\u0668",
                "gpu:h100:\uff18", "gpu:+8"):
        with pytest.raises(ValueError):
            gres_count(bad)


# -- slurm.gres -----------------------------------------------------------------------------------------
def test_slurm_offering_what_the_host_has_passes():
    c = gres_check(node(gres="gpu:h100:8(S:0-1)"), gpus(8), topo(8))
    assert c.ok and c.detail == "Slurm gres/gpu 8, NVML 8, PCI bus 8" and c.severity == FATAL


@pytest.mark.parametrize("offered,nvml,pci,words", [
    (7, 8, 8, "Slurm offers 7 of the 8 GPUs this node has"),
    (8, 7, 8, "Slurm offers 8 GPUs, this node has 7"),
    (8, 7, 7, "Slurm offers 8 GPUs, this node has 7"),
    (4, 8, 8, "Slurm offers 4 of the 8 GPUs"),
])
def test_slurm_offering_fewer_or_more_gpus_than_the_host_has_fails_naming_both(offered, nvml, pci, words):
    c = gres_check(node(gres=f"gpu:{offered}"), gpus(nvml), topo(pci))
    assert not c.ok and c.severity == FATAL and c.reason == "SlurmGresMismatch"
    assert c.summary == f"Slurm gres/gpu {offered}, NVML {nvml}, PCI bus {pci}"
    assert words in c.detail and "scontrol reconfigure" in c.detail


def test_no_gres_mig_and_an_unreadable_gres_are_not_compared():
    none = gres_check(node(gres="(null)"), gpus(8), topo(8))
    assert none.ok and none.detail.startswith("not compared: Slurm offers no gres/gpu on gpu-a")
    mig = gres_check(node(gres="gpu:14"), gpus(8, mig=(0, 1)), topo(8))
    assert mig.ok and "GPU 0, 1 in MIG mode" in mig.detail
    bad = gres_check(node(gres="gpu:h100:many"), gpus(8), topo(8))
    assert not bad.ok and bad.severity == "warning" and not bad.gating


# -- the reason ---------------------------------------------------------------------------------------------
def test_the_drain_reason_names_the_verdicts_reason_and_headline():
    assert drain_reason(verdict(XID)) == "gpu-tune: FatalXid GPU 3: XID 79 (GPU has fallen off the bus)"
    gres = gres_check(node(), gpus(7), topo(8))
    v = Verdict(False, verdict(("gpu.count", "8 NVIDIA GPU(s) on the PCI bus but NVML lists 7", "presence")).checks
                + (gres,))
    assert drain_reason(v) == ("gpu-tune: GpuMissing 8 NVIDIA GPU(s) on the PCI bus but NVML lists 7; "
                               "Slurm gres/gpu 8, NVML 7, PCI bus 8")
    only_gres = Verdict(False, (Check("gpu.present", True, ""), gres_check(node(gres="gpu:7"), gpus(8), topo(8))))
    assert drain_reason(only_gres) == "gpu-tune: SlurmGresMismatch Slurm gres/gpu 7, NVML 8, PCI bus 8"


def test_a_reason_is_one_line_of_plain_ascii_within_the_limit():
    hostile = verdict(("gpu.xid", 'GPU 3: "x"\nline two\x1b[31m é ' + "y" * 400, "recovery"))
    r = drain_reason(hostile)
    assert r.startswith(PREFIX) and len(r) == MAX_REASON and r.endswith("...")
    assert all(0x20 <= ord(ch) < 0x7f for ch in r) and '"' not in r
    assert clean("a\tb\n\nc") == "a b c"


# -- what to do -----------------------------------------------------------------------------------------------
MINE = "gpu-tune: FatalXid GPU 3: XID 79 (GPU has fallen off the bus)"


@pytest.mark.parametrize("state,reason,ready,in_a_row,action", [
    ("IDLE", "", False, 0, "drain"),
    ("MIXED", "", False, 0, "drain"),
    ("IDLE+DRAIN", MINE, False, 0, "none"),
    ("IDLE+DRAIN", "gpu-tune: NvlinkDown GPU 7: 16 of 18 NVLinks active", False, 0, "update_reason"),
    ("IDLE+DRAIN", "maint", False, 0, "left_alone"),
    ("IDLE+DRAIN", "maint", True, 5, "left_alone"),
    ("IDLE+DRAIN", "Prolog error", True, 5, "left_alone"),
    ("DOWN", "hardware ticket 7", True, 5, "left_alone"),
    ("DOWN", "hardware ticket 7", False, 0, "left_alone"),
    ("DOWN+DRAIN", MINE, True, 5, "left_alone"),
    ("IDLE+DRAIN+REBOOT_REQUESTED", MINE, True, 5, "left_alone"),
    ("IDLE", "", True, 1, "none"),
    ("IDLE+DRAIN", MINE, True, 1, "hold"),
    ("IDLE+DRAIN", MINE, True, 2, "resume"),
    ("ALLOCATED+DRAIN", MINE, True, 3, "resume"),
])
def test_drain_and_resume_rules(state, reason, ready, in_a_row, action):
    d = decide(verdict() if ready else verdict(XID), node(state, reason), in_a_row)
    assert d.action == action, d
    assert d.writes == (action in ("drain", "update_reason", "resume"))
    if action in ("drain", "update_reason"):
        assert d.reason.startswith(PREFIX) and "FatalXid" in d.reason
    if action == "resume":
        assert d.reason.startswith("gpu-tune: ready again, resumed") and "FatalXid" in d.reason
    if action == "left_alone":
        assert reason in d.says and "someone other than gpu-tune" in d.says


def test_a_node_with_running_jobs_is_drained_not_killed():
    d = decide(verdict(XID), node("MIXED"), 0)
    assert "its running jobs go on; no new job starts" in d.says


# -- where it runs, and its name ---------------------------------------------------------------------------
def test_the_context_comes_from_slurmds_variables():
    assert context_of({"SLURMD_NODENAME": "n1"}) == ("health_check", None)
    assert context_of({"SLURMD_NODENAME": "n1", "SLURM_SCRIPT_CONTEXT": "prolog_slurmd", "SLURM_JOB_ID": "7"}) == \
        ("prolog", "7")
    assert context_of({"SLURM_SCRIPT_CONTEXT": "epilog_slurmd", "SLURM_JOB_ID": "8"}) == ("epilog", "8")
    assert context_of({}) == ("command", None)


def test_the_name_from_the_flag_or_slurmd():
    assert node_name("gpu-a", {"SLURMD_NODENAME": "other"}, None) == ("gpu-a", "--slurm-node")  # type: ignore[arg-type]
    assert node_name(None, {"SLURMD_NODENAME": " n7 "}, None) == ("n7", "SLURMD_NODENAME")  # type: ignore[arg-type]
    for bad in ("", "a b", "a,b", " ", "n[1-2]", "-V", "--help", "a\x1bb"):
        with pytest.raises(Exception, match="--slurm-node"):
            node_name(bad, {}, None)  # type: ignore[arg-type]
    with pytest.raises(Exception, match="SLURMD_NODENAME '-h': a node name does not start with '-'"):
        node_name(None, {"SLURMD_NODENAME": "-h"}, None)  # type: ignore[arg-type]


# -- the count of ready passes ---------------------------------------------------------------------------------
def test_ready_passes_are_counted_per_node_and_a_foreign_file_counts_none(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "sys").mkdir()
    fs = HostFS(tmp_path)
    assert passes.ready_before(fs, "n1") == 0
    assert passes.record(fs, "n1", 1) is None
    assert passes.ready_before(fs, "n1") == 1 and passes.ready_before(fs, "n2") == 0
    assert passes.record(fs, "n1", 0) is None and passes.ready_before(fs, "n1") == 0
    # a count is kept with the drain it counts: under another drain, or in service, it counts none
    mine = node("IDLE+DRAIN", MINE)
    assert passes.drain_of(mine) == f"{MINE} [root@2026-11-28T04:28:01]" and passes.drain_of(node()) == ""
    assert passes.record(fs, "n1", 3, passes.drain_of(mine)) is None
    assert passes.ready_before(fs, "n1", passes.drain_of(mine)) == 3
    assert passes.ready_before(fs, "n1") == 0
    again = SlurmNode("gpu-a", "IDLE+DRAIN", MINE, "root", "2026-11-28T05:00:00")  # drained anew, same words
    assert passes.ready_before(fs, "n1", passes.drain_of(again)) == 0
    f = tmp_path / "var/lib/gpu-tune/slurm.json"
    for junk in ("{", "[]", json.dumps({"node": "n1", "ready_in_a_row": "7"}), json.dumps({"node": "n1",
                                                                                        "ready_in_a_row": True})):
        f.write_text(junk)
        assert passes.ready_before(fs, "n1") == 0


# -- bad input: exit 2, one line, nothing run ----------------------------------------------------------------------
def test_bad_slurm_input_is_exit_2(cli, tmp_path):
    root = tmp_path / "r"
    (root / "proc").mkdir(parents=True)
    (root / "sys").mkdir()
    args = ("check", "--root", str(root), "--gpu-backend", "none")
    r = cli(*args, "--slurm-node", "gpu-a")
    assert r.returncode == 2 and r.stderr.strip() == "gpu-tune: error: --slurm-node needs --slurm", r.stderr
    r = cli(*args, "--slurm", env={"SLURM_CONF": str(tmp_path / "none.conf")})
    assert r.returncode == 2 and "none.conf: no such file" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = cli(*args, "--slurm", "--slurm-node", "gpu-a", env={"PATH": str(tmp_path)})
    assert r.returncode == 2 and "scontrol not found" in r.stderr, r.stderr
    r = cli(*args, "--slurm", "--slurm-node", "gpu-[1-4]")
    assert r.returncode == 2 and "--slurm-node 'gpu-[1-4]': expected one Slurm node name" in r.stderr, r.stderr
    for value in ("nan", "0", "-1", "soon", "1e9"):
        r = cli(*args, "--slurm", "--slurm-node", "gpu-a", env={"GPU_TUNE_SLURM_TIMEOUT": value})
        assert r.returncode == 2 and "GPU_TUNE_SLURM_TIMEOUT" in r.stderr and "seconds" in r.stderr, r.stderr
    assert not (root / "var").exists()  # refused before the checks ran (they keep their state there)
