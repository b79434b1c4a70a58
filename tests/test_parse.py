import pytest

from gpu_tune.host.parse import (ParseError, format_cpulist, format_cpumask, parse_bracketed, parse_cmdline,
                         parse_cpulist, parse_cpumask, parse_interrupts, parse_link_speed, parse_link_width,
                         parse_meminfo)


@pytest.mark.parametrize("text,expected", [
    ("0-3,8,10-11", {0, 1, 2, 3, 8, 10, 11}),
    ("0", {0}),
    ("", set()),
    ("0-55,112-167\n", set(range(56)) | set(range(112, 168))),
    ("0-7:2", {0, 2, 4, 6}),
])
def test_cpulist_roundtrip(text, expected):
    assert parse_cpulist(text) == expected
    assert parse_cpulist(format_cpulist(expected)) == expected


def test_cpulist_rejects_garbage():
    with pytest.raises(ParseError):
        parse_cpulist("3-1")
    with pytest.raises(ParseError):
        parse_cpulist("a")


def test_cpumask_groups():
    assert parse_cpumask("00000000,0000000f") == {0, 1, 2, 3}
    assert parse_cpumask("80000000,00000000") == {63}
    assert format_cpumask({0, 1, 2, 3}, 64) == "00000000,0000000f"
    assert parse_cpumask(format_cpumask(set(range(56, 112)), 224)) == set(range(56, 112))


def test_bracketed_both_forms():
    c = parse_bracketed("always [madvise] never\n")
    assert c.active == "madvise" and c.options == ("always", "madvise", "never")
    assert parse_bracketed("never").active == "never"  # a fixture after a write holds the bare word
    assert parse_bracketed("always defer [defer+madvise] madvise never").active == "defer+madvise"


def test_cmdline():
    d = parse_cmdline("BOOT_IMAGE=/vmlinuz ro quiet transparent_hugepage=never")
    assert d["transparent_hugepage"] == "never" and d["ro"] == ""


def test_interrupts_wide():
    ncpu = 224
    head = " " + "".join(f"  CPU{c}" for c in range(ncpu)) + "\n"
    line = " 120: " + " ".join(["1"] * ncpu) + "  IR-PCI-MSIX-0000:18:00.0    0-edge      nvidia\n"
    line2 = " NMI: " + " ".join(["0"] * ncpu) + "   Non-maskable interrupts\n"
    parsed = parse_interrupts(head + line + line2)
    assert parsed["120"].total == ncpu
    assert parsed["120"].name == "nvidia"
    assert "NMI" in parsed


def test_link_speed_and_width():
    assert parse_link_speed("32.0 GT/s PCIe") == 5
    assert parse_link_speed("8.0 GT/s PCIe") == 3
    assert parse_link_speed("2.5 GT/s") == 1
    assert parse_link_speed("Unknown") is None
    assert parse_link_width("16") == 16 and parse_link_width("x8") == 8 and parse_link_width("0") is None


def test_meminfo_node_form():
    m = parse_meminfo("Node 0 MemTotal:       131000000 kB\nNode 0 MemFree: 5 kB\n")
    assert m == {"MemTotal": 131000000, "MemFree": 5}


def test_interrupts_handler_names_and_virtio_queues():
    from gpu_tune.host.parse import irqs_named

    text = ("           CPU0       CPU1       \n"
            "  11:          5          6  IO-APIC  11-fasteoi   uhci_hcd:usb1, virtio7\n"
            "  27:          0          0  GICv3  27 Level     arch_timer\n"
            "  37:          0          0  PCI-MSIX-0000:00:03.0   0-edge      virtio2-config\n"
            "  38:          0      10125  PCI-MSIX-0000:00:03.0   1-edge      virtio2-input.0\n"
            "  39:       5762          0  PCI-MSIX-0000:00:03.0   2-edge      virtio2-output.0\n"
            "  40:          0          0  PCI-MSIX-0000:00:04.0   0-edge      virtio22-config\n"
            " NMI:          0          0   Non-maskable interrupts\n")
    lines = parse_interrupts(text)
    assert lines["11"].names == ("uhci_hcd:usb1", "virtio7") and lines["27"].names == ("arch_timer",)
    assert lines["38"].names == ("virtio2-input.0",) and lines["38"].total == 10125
    assert irqs_named(lines, "virtio2") == [37, 38, 39]  # not virtio22
    assert irqs_named(lines, "virtio7") == [11] and irqs_named(lines, "virtio9") == []
