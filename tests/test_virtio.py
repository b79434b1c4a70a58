"""NICs behind virtio: a VM's eth0 whose ``device`` link is ``.../0000:00:03.0/virtio2`` is listed
at its PCI function, with the IRQs named after it, and irq.affinity pins them like any NIC's.
Physical (mlx5, ENA-style) NICs whose link is the PCI function keep working."""

from __future__ import annotations

import os
import pytest
import shutil
from pathlib import Path

from rich.console import Console

from gpu_tune.tune.engine import apply, audit, make_context, revert
from gpu_tune.gpu import select_backend
from gpu_tune.host.fs import HostFS
from gpu_tune.tune.knobs.base import Context
from gpu_tune.tune.profile import Profile
from gpu_tune.discover.topology import discover, pci_function_of
from gpu_tune.views.topology import render_topology
from tests import skips
from tests.conftest import snapshot_tree
from tests.fixtures import pcigen, realhost

IRQ = {"affinity": "numa-local", "devices": ["gpu", "nic"], "irqbalance": "conflict"}


def test_vm_virtio_lists_eth0_at_its_pci_function_with_its_irqs(make_host):
    root = make_host("vm-virtio")
    topo = discover(HostFS(root), None)
    assert len(topo.nics) == 1  # not the balloon, disk, vsock or rng functions; not lo/ifb0/ifb1
    nic = topo.nics[0]
    assert (nic.names, nic.address, nic.virtio) == (("eth0",), "0000:00:03.0", "virtio2")
    assert (nic.vendor, nic.device, nic.pci_class) == ("0x1af4", "0x1041", "0x020000")
    assert nic.irqs == (37, 38, 39)  # virtio2-config, virtio2-input.0, virtio2-output.0
    assert (nic.numa_node, nic.numa_source, nic.local_cpus) == (0, "local_cpulist", frozenset({0, 1}))
    doc = topo.as_dict()["nics"][0]
    assert doc["virtio"] == "virtio2" and doc["irqs"] == "37-39" and doc["irq_count"] == 3
    assert doc["pcie"]["gen_current"] is None  # a virtio function has no PCIe link files
    assert topo.as_dict()["numa_nodes"][0]["nics"] == ["eth0"]
    c = Console(width=200, record=True, color_system=None)
    c.print(render_topology(topo))
    text = c.export_text()
    assert "eth0  net  virtio2 on 0000:00:03.0  3 IRQs (37-39)  (node from local_cpulist)" in text
    assert "gen?" not in text


def test_pci_function_of_walks_up_only_from_a_virtio_device(make_host):
    root = make_host("vm-virtio")
    fs = HostFS(root)
    assert pci_function_of(fs, "/sys/class/net/eth0/device") == ("0000:00:03.0", "virtio2")
    # a USB NIC below a PCI controller is not the controller
    usb = root / "sys/devices/pci0000:00/0000:00:14.0/usb1/1-1/1-1:1.0"
    (usb / "net/usb0").mkdir(parents=True)
    (root / "sys/devices/pci0000:00/0000:00:14.0/vendor").write_text("0x8086\n")
    os.symlink("../../devices/pci0000:00/0000:00:14.0", root / "sys/bus/pci/devices/0000:00:14.0")
    os.symlink("../../../1-1:1.0", usb / "net/usb0/device")
    os.symlink("../../devices/pci0000:00/0000:00:14.0/usb1/1-1/1-1:1.0/net/usb0", root / "sys/class/net/usb0")
    assert pci_function_of(fs, "/sys/class/net/usb0/device") == (None, None)
    assert [n.names for n in discover(fs, None).nics] == [("eth0",)]


def test_mlx5_and_ena_style_nics_are_their_pci_function(make_host, tmp_path):
    root = make_host("irqbalance")  # ConnectX: ens0np0 + mlx5_0 on 0000:19:00.0
    topo = discover(HostFS(root), None)
    nic = topo.nics[0]
    assert (nic.address, nic.names, nic.virtio, nic.rdma, len(nic.irqs)) == (
        "0000:19:00.0", ("ens0np0", "mlx5_0"), None, True, 8)
    assert pci_function_of(HostFS(root), "/sys/class/net/ens0np0/device") == ("0000:19:00.0", None)
    # ENA-style (an EC2 instance): ens5's device link is the PCI function on the root bus
    from tests.fixtures.hostgen import HostTree, _base

    t = HostTree(tmp_path / "ena")
    t.cpus({0: list(range(8))}, cpufreq=False, model="AMD EPYC 7R13 Processor", cpuidle=None)
    _base(t)
    p = pcigen.PciHost(t)
    p.add(pcigen.Dev("0000:00:05.0", "nic", -1, list(range(8)), p.alloc_irqs(9), vendor="0x1d0f",
                     device="0xec20", pci_class="0x020000", net="ens5", root_bus=True, link=False))
    p.finish()
    ena = discover(HostFS(t.root), None).nics[0]
    assert (ena.names, ena.address, ena.virtio, len(ena.irqs), ena.numa_node) == (
        ("ens5",), "0000:00:05.0", None, 9, 0)


def test_irqs_found_by_name_when_msi_irqs_lists_none(make_host):
    """Legacy INTx: no msi_irqs/, one shared line that names the virtio device."""
    root = make_host("vm-virtio")
    shutil.rmtree(root / "sys/devices/pci0000:00/0000:00:03.0/msi_irqs")
    text = (root / "proc/interrupts").read_text()
    text = "\n".join(ln for ln in text.splitlines() if "virtio2-" not in ln) + "\n"
    text = text.replace(" NMI:", "  11:          5          6  IO-APIC   11-fasteoi   uhci_hcd:usb1, virtio2\n NMI:")
    (root / "proc/interrupts").write_text(text)
    nic = discover(HostFS(root), None).nics[0]
    assert nic.irqs == (11,)


def test_virtio_mmio_nic_is_warned_not_listed(make_host):
    root = make_host("vm-virtio")
    mmio = root / "sys/devices/platform/virtio-mmio.0/virtio5"
    (mmio / "net/eth1").mkdir(parents=True)
    os.symlink("../../../virtio5", mmio / "net/eth1/device")
    os.symlink("../../devices/platform/virtio-mmio.0/virtio5/net/eth1", root / "sys/class/net/eth1")
    topo = discover(HostFS(root), None)
    assert [n.names for n in topo.nics] == [("eth0",)]
    assert any(w.startswith("NIC eth1: virtio5 is not behind a PCI function") for w in topo.warnings)


def test_plain_directories_work_for_virtio(make_host, tmp_path):
    root = make_host("vm-virtio")
    bus = root / "sys/bus/pci/devices"
    for link in list(bus.iterdir()):
        real = link.resolve()
        link.unlink()
        shutil.copytree(real, link, symlinks=True)
    nic = discover(HostFS(root), None).nics[0]
    assert (nic.address, nic.virtio, nic.irqs) == ("0000:00:03.0", "virtio2", (37, 38, 39))


def test_virtio_irqs_pinned_numa_local_and_reverted_byte_for_byte(make_host):
    root = make_host("vm-virtio-2node")
    b = select_backend("fixture", str(pcigen.GPU_JSON_DIR / "vm-virtio-2node.json"))
    topo = discover(HostFS(root), b)
    nic = topo.nics[0]
    assert (nic.names, nic.virtio, nic.numa_node, nic.numa_source) == (("eth0",), "virtio1", 1, "firmware")
    assert len(nic.irqs) == 9 and topo.gpu_local_nics[topo.gpus[0].address] == ("eth0",)
    before = snapshot_tree(root)
    prof = Profile(name="t", irq=IRQ)
    rows = [r for r in audit(make_context(HostFS(root), prof, b)).settings if r.id == "irq.affinity"]
    nic_rows = [r for r in rows if r.target in {str(i) for i in nic.irqs}]
    assert len(nic_rows) == 9 and {(r.current, r.desired, r.status) for r in nic_rows} == {("0-7", "4-7", "drift")}
    assert all(r.detail.startswith("NIC eth0 (0000:80:02.0) node 1") for r in nic_rows)
    rep = apply(make_context(HostFS(root), prof, b))
    assert rep.compliant and all(r.changed for r in rep.settings)
    for irq in nic.irqs:
        assert (root / f"proc/irq/{irq}/smp_affinity_list").read_text() == "4-7"
    ok, restored = revert(Context(fs=HostFS(root), profile=None))
    assert ok and len(restored) == len(rows)
    assert snapshot_tree(root) == before


# -- this machine ---------------------------------------------------------------------------------
needs_virtio = skips.skipif("no-virtio-nic", not realhost.virtio_nics(), "this machine has no virtio-pci NIC")


@needs_virtio
def test_this_vm_topology_lists_its_virtio_nic(cli):
    import json

    p = cli("topology", "--root", "/", "--gpu-backend", "none", "-o", "json")
    assert p.returncode == 0, p.stderr
    nics = {n["name"]: n for n in json.loads(p.stdout)["nics"]}
    for name in realhost.virtio_nics():
        real = os.path.realpath(f"/sys/class/net/{name}/device")
        fn = os.path.basename(os.path.dirname(real))
        irqs = sorted(int(i) for i in os.listdir(os.path.join(os.path.dirname(real), "msi_irqs")))
        assert nics[name]["pci_bus_id"] == fn and nics[name]["virtio"] == os.path.basename(real)
        assert nics[name]["irq_count"] >= len(irqs) > 0


@needs_virtio
def test_this_vm_irq_apply_revert_round_trip_on_a_copy(tmp_path):
    """This machine's real /sys and /proc layout, copied (links kept): pin the virtio NIC's IRQs
    off the last CPU, then revert; every IRQ file comes back byte for byte."""
    root = realhost.copy_real_host(tmp_path / "host")
    topo = discover(HostFS(root), None)
    vnics = [n for n in topo.nics if n.virtio]
    assert vnics and all(n.irqs for n in vnics), topo.as_dict()["nics"]
    for n in vnics:
        real = Path(os.path.realpath(f"/sys/class/net/{n.names[0]}/device")).parent
        assert set(n.irqs) >= {int(i) for i in os.listdir(real / "msi_irqs")}
    cpus = sorted(topo.cpus_online)
    if len(cpus) < 2 or any(n.numa_node is None for n in vnics):
        skips.condition("virtio-nic-unpinnable", "needs 2+ CPUs and a known NUMA node for the NIC")
    before = snapshot_tree(root)
    prof = Profile(name="t", irq=dict(IRQ, devices=["nic"], irqbalance="ignore", exclude_cpus=str(cpus[-1])))
    rep = apply(make_context(HostFS(root), prof, None))
    rows = [r for r in rep.settings if r.id == "irq.affinity"]
    assert rows and all(r.status == "ok" for r in rows), rows
    assert {int(r.target) for r in rows} == {i for n in vnics for i in n.irqs}
    assert any(r.changed for r in rows)
    ok, restored = revert(Context(fs=HostFS(root), profile=None))
    assert ok and restored
    assert snapshot_tree(root) == before


def test_a_huge_proc_interrupts_costs_memory_for_the_lines_kept_not_the_file(make_host):
    """600,000 lines (7 MB) of IRQs no device has after the real ones: discovery keeps the lines
    of the virtio NIC and reads the rest piece by piece (the whole text, its lines and an object
    per line once took 430 MB for 4.5 million lines). A line the NIC's own IRQs end up in last
    is still found."""
    import tracemalloc

    root = make_host("vm-virtio")
    path = root / "proc/interrupts"
    with open(path, "a", encoding="ascii") as fh:
        fh.write("".join(f"{1000 + i}: 0 X\n" for i in range(600_000)))
        fh.write(" 44:   7   9  PCI-MSIX-0000:00:03.0  4-edge  virtio2-input.1")  # no newline at the end
    assert path.stat().st_size > 7_000_000
    fs = HostFS(root)
    tracemalloc.start()
    try:
        topo = discover(fs, None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert topo.nics[0].irqs == (37, 38, 39, 44)
    assert peak < 3_000_000, peak  # bytes: a few 64 KiB pieces, never the file


def test_reading_lines_keeps_what_is_asked_and_refuses_what_is_too_large(make_host):
    from gpu_tune.errors import NotAFile

    root = make_host("vm-virtio")
    fs = HostFS(root)
    (root / "etc/many").write_text("".join(f"line {i}\n" for i in range(100_000)) + "last")
    assert fs.read_lines("/etc/many", lambda n, line: n % 25_000 == 0 or line == "last", limit=2 << 20) == \
        ["line 0", "line 25000", "line 50000", "line 75000", "last"]
    with pytest.raises(NotAFile, match="larger than 64 KiB"):
        fs.read_lines("/etc/many", lambda n, line: False, limit=65536)
    (root / "etc/long").write_text("x" * 300_000 + "\n")
    with pytest.raises(NotAFile, match="a line longer than 128 KiB"):
        fs.read_lines("/etc/long", lambda n, line: True, line_limit=128 << 10)
    os.mkfifo(root / "etc/fifo")
    with pytest.raises(NotAFile, match="FIFO"):
        fs.read_lines("/etc/fifo", lambda n, line: True)
