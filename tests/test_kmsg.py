"""The kernel log reader (gpu_tune/host/kmsg.py) and the XID sightings read from it: formats,
incremental reads, the three sources, and hostile input kept bounded. Nothing here writes to this
machine's /dev/kmsg (a record written there stays until the machine reboots): the live host is only
read."""

from __future__ import annotations

import re
import tracemalloc
from pathlib import Path

import pytest

from gpu_tune.discover.health import MAX_SIGHTINGS, WANT, read_kernel_xids
from gpu_tune.host.fs import HostFS
from gpu_tune.host.kmsg import MAX_RECORD, KernelLog, ReadStats, live_host, parse_record

BOOT_ID = "6c1f2b1e-8a9d-4c8e-9d7e-2f1f3b6a9c11"
XID = "3,{seq},{usec},-;NVRM: Xid (PCI:0000:{bus}:00): {code}, pid='<unknown>', name=<unknown>, {text}\n"


def tree(tmp_path: Path, kmsg: str | bytes | None, boot_id: str = BOOT_ID) -> Path:
    root = tmp_path / "h"
    for d in ("proc/sys/kernel/random", "sys", "dev"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "proc/sys/kernel/random/boot_id").write_text(boot_id + "\n")
    if kmsg is not None:
        (root / "dev/kmsg").write_bytes(kmsg if isinstance(kmsg, bytes) else kmsg.encode())
    return root


def read_all(log: KernelLog, want=None) -> tuple[list, ReadStats]:
    st = ReadStats()
    return list(log.read(want, st)), st


def test_records_in_kmsg_and_syslog_formats():
    r = parse_record(b"3,1207,88310022,-;NVRM: Xid (PCI:0000:1b:00): 79, x")
    assert (r.seq, r.usec, r.message) == (1207, 88310022, "NVRM: Xid (PCI:0000:1b:00): 79, x")
    r = parse_record(b"6,12,4000,-,caller=T1;with a caller field")
    assert (r.seq, r.message) == (12, "with a caller field")
    r = parse_record(b"<3>[   88.310022] NVRM: Xid (PCI:0000:1b:00): 79, x")
    assert (r.seq, r.usec, r.message) == (None, 88310022, "NVRM: Xid (PCI:0000:1b:00): 79, x")
    assert parse_record(b"plain dmesg text").message == "plain dmesg text"


def test_a_fixture_log_is_read_then_only_what_is_new(tmp_path):
    root = tree(tmp_path, "6,0,0,-;hello\n SUBSYSTEM=pci\n DEVICE=+pci:0000:1b:00.0\n"
                          + XID.format(seq=1, usec=10, bus="1b", code=79, text="GPU has fallen off the bus."))
    log = KernelLog(HostFS(root))
    recs, st = read_all(log)
    assert [r.seq for r in recs] == [0, 1] and st.scanned == 2 and st.error is None  # continuation lines skipped
    assert "(a file)" in st.source
    with open(root / "dev/kmsg", "a") as f:
        f.write(XID.format(seq=2, usec=20, bus="1b", code=13, text="app fault"))
    recs, st = read_all(log)
    assert [r.seq for r in recs] == [2]
    assert read_all(log)[0] == []
    (root / "dev/kmsg").write_text("6,0,0,-;a new boot's log\n")  # cut shorter: read from its start
    assert [r.message for r in read_all(log)[0]] == ["a new boot's log"]


def test_no_kernel_log_under_a_fixture_root_is_said_not_guessed(tmp_path):
    root = tree(tmp_path, None, boot_id="00000000-0000-4000-8000-000000000000")
    recs, st = read_all(KernelLog(HostFS(root)))
    assert recs == [] and st.error and "does not exist" in st.error and "boot_id differs" in st.error


def test_the_running_host_is_read_without_writing(tmp_path):
    """A root whose boot id is this kernel's is the live host (the DaemonSet's /host): its log is
    the kernel's own, read from /dev/kmsg or syslog(2), never written."""
    ours = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    root = tree(tmp_path, None, boot_id=ours)
    assert live_host(HostFS(root))
    log = KernelLog(HostFS(root))
    recs, st = read_all(log)
    if st.error is None:
        assert st.source in ("/dev/kmsg", "syslog(2)") and st.scanned > 0
        recs2, st2 = read_all(log)
        assert st2.scanned < st.scanned  # the second read hands out only what is new
    else:  # not root, and dmesg_restrict: the reason names the capability
        assert "CAP_SYSLOG" in st.error or "not permitted" in st.error.lower()
    log.close()


def test_syslog_text_is_read_incrementally(monkeypatch, tmp_path):
    import gpu_tune.host.kmsg as kmsg

    text = [b"<6>[    1.000000] boot\n<3>[   88.310022] NVRM: Xid (PCI:0000:1b:00): 79, x\n"]
    monkeypatch.setattr(kmsg, "_syslog_read_all", lambda: (text[0], None))
    log = KernelLog(HostFS(tree(tmp_path, None)))
    log._kind, log._source = "syslog", "syslog(2)"
    recs, st = read_all(log, WANT)
    assert [r.usec for r in recs] == [88310022] and st.scanned == 2
    text[0] += b"<3>[   90.000001] NVRM: Xid (PCI:0000:1b:00): 48, DBE\n"
    assert [r.message[-3:] for r in read_all(log)[0]] == ["DBE"]


# -- hostile input: bounded, never a crash --------------------------------------------------------------
def test_a_1gb_kernel_log_reads_only_its_newest_part(tmp_path):
    root = tree(tmp_path, None)
    with open(root / "dev/kmsg", "wb") as f:  # sparse: 1 GiB without writing it
        f.truncate(1 << 30)
        f.seek(1 << 30)
        f.write(b"\n" + XID.format(seq=5, usec=5, bus="1b", code=48, text="DBE").encode())
    tracemalloc.start()
    sightings, status = read_kernel_xids(KernelLog(HostFS(root)))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [(s.code, s.count) for s in sightings] == [(48, 1)]
    assert status.notes and "only the newest 32 MiB" in status.notes[0]
    assert peak < 8 << 20, peak  # chunks of 1 MiB, never the file


def test_many_lines_of_a_big_log_stay_bounded(tmp_path):
    line = b"6,1,1,-;" + b"ordinary kernel chatter " * 4 + b"\n"
    body = line * (40_000_000 // len(line)) + XID.format(seq=9, usec=9, bus="1b", code=79, text="x").encode()
    root = tree(tmp_path, body)
    log = KernelLog(HostFS(root), max_file_bytes=16 << 20)
    tracemalloc.start()
    sightings, status = read_kernel_xids(log)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [s.code for s in sightings] == [79] and status.scanned > 100_000
    assert peak < 16 << 20, peak


def test_a_1mb_record_is_cut_and_the_next_one_read(tmp_path):
    root = tree(tmp_path, "6,1,1,-;" + "A" * (1 << 20) + "\n" + XID.format(seq=2, usec=2, bus="1b", code=79, text="x"))
    recs, st = read_all(KernelLog(HostFS(root)))
    assert len(recs) == 2 and len(recs[0].message) <= MAX_RECORD and st.cut == 1
    assert "Xid" in recs[1].message


def test_malformed_and_ten_thousand_xids(tmp_path):
    lines = ["6,0,0,-;NVRM: Xid (PCI:zz:zz): seventy-nine\n", "6,1,1,-;NVRM: Xid (PCI:0000:1b:00): 99999999999, x\n",
             "not a record at all\n", "\x00\xff binary junk\n"]
    lines += [XID.format(seq=10 + i, usec=100 + i, bus="1b", code=13, text="app") for i in range(10_000)]
    lines += [XID.format(seq=20_000, usec=99_999, bus="1b", code=79, text="GPU has fallen off the bus.")]
    root = tree(tmp_path, "".join(lines))
    sightings, status = read_kernel_xids(KernelLog(HostFS(root)))
    got = {(s.code, s.count) for s in sightings}
    assert got == {(13, 10_000), (79, 1)}
    assert status.malformed == 2 and status.error is None


def test_distinct_sightings_are_capped(tmp_path):
    lines = "".join(XID.format(seq=i, usec=i, bus=f"{i % 256:02x}", code=1000 + i, text="x")
                    for i in range(MAX_SIGHTINGS + 500))
    sightings, status = read_kernel_xids(KernelLog(HostFS(tree(tmp_path, lines))))
    assert len(sightings) == MAX_SIGHTINGS and status.dropped == 500


def test_a_device_that_is_not_the_kernel_log_is_refused(tmp_path):
    root = tree(tmp_path, None)
    import os

    os.mkfifo(root / "dev/kmsg")
    recs, st = read_all(KernelLog(HostFS(root)))
    assert recs == [] and st.error and "FIFO" in st.error


def test_the_prefilter_matches_what_the_parser_reads():
    assert WANT.search(b"NVRM: Xid (PCI:0000:1b:00): 79,") and WANT.search(b"nvidia-nvswitch0: SXid (PCI:")
    assert WANT.search(b"NVRM: GPU 0000:91:00.0: GPU has fallen off the bus.")
    assert not WANT.search(b"usb 1-1: new high-speed USB device")
    assert re.compile(WANT.pattern)  # bytes: checked before decoding
