"""Hostile kernel logs through `gpu-tune check` and the agent's passes on the 8-GPU fixture: a
forged, embedded, drowned or late XID never makes a healthy node unhealthy and never hides a real
fault; what was ignored or skipped is said (docs/health.md "XIDs", docs/security.md round 4)."""

from __future__ import annotations

import pytest

from gpu_tune.host.fs import HostFS
from gpu_tune.judge.checks.monitor import HealthMonitor
from tests.test_health import _append_kmsg, check, dgx_tree, gpu_json, host, one_pass, policies  # noqa: F401

GPU0 = "0000:18:00"  # GPU 0 of the fixture
GPU3 = "0000:5d:00"  # GPU 3
XID79 = "NVRM: Xid (PCI:{bus}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


def checks_of(doc):
    return {c["name"]: c for c in doc["checks"]}


def test_xids_written_from_user_space_never_fail_the_node(cli, host, tmp_path, policies):
    forged = "".join(f"{p},{100 + i},{90_000_000 + i},-;{XID79.format(bus=GPU0)}\n"
                     for i, p in enumerate((14, 30, 38, 190)))
    _append_kmsg(forged)(host)
    rc, doc = check(cli, host, gpu_json(tmp_path), policies)
    assert rc == 0 and doc["ready"], doc["message"]
    assert "4 records naming an XID not written by the kernel ignored" in checks_of(doc)["gpu.xid"]["detail"]


def test_xid_text_inside_other_records_never_fails_the_node(cli, host, tmp_path, policies):
    _append_kmsg(f"6,100,90000000,-;usb 1-1: Product: {XID79.format(bus=GPU0)}\n"
                 f"6,101,90000001,-;hid-generic 0003:046D:C52B.0001: input: {XID79.format(bus=GPU0)} on usb-1\n"
                 f"6,102,90000002,-;usb 1-1: Manufacturer: x\\x0a{XID79.format(bus=GPU0)}\n")(host)
    rc, doc = check(cli, host, gpu_json(tmp_path), policies)
    assert rc == 0 and doc["ready"], doc["message"]
    assert "3 XID texts inside other records ignored" in checks_of(doc)["gpu.xid"]["detail"]


def test_a_flood_of_distinct_xids_does_not_hide_a_later_fatal_one(cli, host, tmp_path, policies):
    flood = "".join(f"4,{100 + i},{9_000_000 + i},-;NVRM: Xid (PCI:0000:{i % 256:02x}:{i // 256:02x}): 13, pid=1, "
                    "name=x, Graphics Exception\n" for i in range(1100))
    _append_kmsg(flood + f"3,2000,99000000,-;{XID79.format(bus=GPU3)}\n")(host)
    rc, doc = check(cli, host, gpu_json(tmp_path), policies)
    assert rc == 1 and doc["reason"] == "FatalXid" and "GPU 3: XID 79" in doc["message"], doc["message"]
    assert "non-fatal sightings not kept (beyond 1,024)" in checks_of(doc)["gpu.xid"]["detail"]


def test_the_newest_records_are_judged_when_the_log_is_longer_than_one_read(cli, host, tmp_path, policies):
    """2.5 million short records (30 MB, within the 32 MiB window) and then XID 79: one read takes
    the newest 2^20 lines, so the 79 is seen and the older lines are said to be skipped."""
    with open(host / "dev/kmsg", "a") as f:
        line = "6,1,1,-;chatter\n"
        for _ in range(25):
            f.write(line * 100_000)
        f.write(f"3,2,99000000,-;{XID79.format(bus=GPU3)}\n")
    rc, doc = check(cli, host, gpu_json(tmp_path), policies)
    assert rc == 1 and doc["reason"] == "FatalXid" and "GPU 3: XID 79" in doc["message"], doc["message"]
    assert "older than the newest read were not read" in checks_of(doc)["gpu.xid"]["detail"]


def test_digits_that_are_not_ascii_are_no_xid_and_an_unknown_xid_is_a_named_warning(cli, host, tmp_path, policies):
    _append_kmsg(f"3,100,90000000,-;NVRM: Xid (PCI:{GPU0}): \u0667\u0669, pid='<unknown>', name=<unknown>, x\n"
                 f"3,101,91000000,-;NVRM: Xid (PCI:{GPU3}): 999, pid='<unknown>', name=<unknown>, new fault\n"
                 f"3,102,92000000,-;NVRM: Xid (PCI:{GPU3}): 15, pid='<unknown>', name=<unknown>, old fault\n")(host)
    rc, doc = check(cli, host, gpu_json(tmp_path), policies)
    assert rc == 0 and doc["ready"], doc["message"]
    c = checks_of(doc)
    assert "1 malformed XID record" in c["gpu.xid"]["detail"]
    unknown = c["gpu.xid_unknown"]
    assert unknown["severity"] == "warning" and not unknown["ok"]
    assert "GPU 3 (0000:5d:00.0): XID 999 not in the catalog" in unknown["detail"]
    assert "XID 15 marked unused on every GPU generation" in unknown["detail"]


def test_the_agent_names_an_unknown_xid_on_every_pass(host, tmp_path):
    f = gpu_json(tmp_path)
    _append_kmsg(f"3,100,90000000,-;NVRM: Xid (PCI:{GPU3}): 999, pid='<unknown>', name=<unknown>, x\n"
                 f"14,101,90000001,-;{XID79.format(bus=GPU0)}\n")(host)
    mon = HealthMonitor(HostFS(host))
    for _ in range(2):  # the second pass reads nothing new: what the first read is still said
        v = one_pass(host, f, mon)
        c = {c.name: c for c in v.checks}
        assert v.ready and "XID 999" in c["gpu.xid_unknown"].detail
        assert "1 record naming an XID not written by the kernel" in c["gpu.xid"].detail


FALLEN3 = ("3,900,1843308145,-;NVRM: The NVIDIA GPU 0000:5d:00.0\\x0aNVRM: (PCI ID: 10de:2330) installed in this "
           "system has\\x0aNVRM: fallen off the bus and is not responding to commands.\n")


@pytest.mark.parametrize("text", [FALLEN3, "3,900,1843308145,-;NVRM: GPU 0000:5d:00.0: GPU has fallen off the bus.\n",
                                  "3,900,1843308145,-;NVRM: GPU at PCI:0000:5d:00: GPU-5f2a0c4e-81d3-7a52-e1b9-"
                                  "0c6f3d2a4b18 has fallen off the bus.\n"], ids=["probe-time", "gpu", "gpu-at"])
def test_a_gpu_fallen_off_the_bus_without_an_xid_fails_it_as_xid_79(cli, host, tmp_path, policies, text):
    _append_kmsg(text)(host)
    rc, doc = check(cli, host, gpu_json(tmp_path), policies)
    assert rc == 1 and doc["reason"] == "FatalXid" and "GPU 3: XID 79" in doc["message"], doc["message"]


NVLINK5 = ("4,{seq},{usec},-;NVRM: Xid (PCI:0000:5d:00): 145, RLW_RXPIPE Nonfatal XC1 i0 Link 03 (0x004505c6 0x0)\n",
           "4,{seq},{usec},-;NVRM: Xid (PCI:0000:5d:00): 145, RLW_SRC_TRACK Fatal XC0 i0 Link 01 (0x004505c6 0x1)\n")


@pytest.mark.parametrize("order", [(0, 1), (1, 0)], ids=["nonfatal-first", "fatal-first"])
def test_an_nvlink5_xid_is_fatal_whatever_the_order_of_its_records(cli, host, tmp_path, policies, order):
    _append_kmsg("".join(NVLINK5[k].format(seq=100 + i, usec=90_000_000 + i) for i, k in enumerate(order)))(host)
    rc, doc = check(cli, host, gpu_json(tmp_path), policies)
    assert rc == 1 and doc["reason"] == "FatalXid" and "GPU 3: XID 145" in doc["message"], doc["message"]
    # the agent, reading them in two passes, agrees
    h2 = tmp_path / "agent"
    import shutil

    shutil.copytree(host, h2, symlinks=True)
    (h2 / "dev/kmsg").write_text((host / "dev/kmsg").read_text().rsplit("4,100,", 1)[0])
    mon = HealthMonitor(HostFS(h2))
    f = gpu_json(tmp_path)
    one_pass(h2, f, mon)
    for i, k in enumerate(order):
        _append_kmsg(NVLINK5[k].format(seq=100 + i, usec=90_000_000 + i))(h2)
        v = one_pass(h2, f, mon)
    assert v.reason() == "FatalXid", v.message()
