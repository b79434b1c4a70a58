"""The kernel log reader (gpu_tune/host/kmsg.py) and the XID sightings read from it: formats,
incremental reads, the three sources, and hostile input kept bounded. Nothing here writes to this
machine's /dev/kmsg (a record written there stays until the machine reboots): the live host is only
read."""

from __future__ import annotations

import errno
import os
import re
import tracemalloc
from collections import deque
from pathlib import Path

import pytest

from gpu_tune.discover.health import MAX_SIGHTINGS, WANT, read_kernel_xids
from gpu_tune.discover.xids import FATAL, MAX_FATAL_BUSES
from gpu_tune.host.fs import HostFS
from gpu_tune.host.kmsg import MAX_RECORD, KernelLog, ReadStats, live_host, parse_record
from gpu_tune.judge.checks.catalog import sighting_rank

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


def test_sightings_that_are_not_fatal_are_capped(tmp_path):
    lines = "".join(XID.format(seq=i, usec=i, bus=f"{i % 256:02x}", code=13, text="x")
                    for i in range(MAX_SIGHTINGS + 500))
    sightings, status = read_kernel_xids(KernelLog(HostFS(tree(tmp_path, lines))), sighting_rank)
    assert len(sightings) == 256 and status.dropped == 0  # 256 bus ids
    lines = "".join(XID.format(seq=i, usec=i, bus=f"{i % 256:02x}", code=13, text="x").replace(":00)", f":{i // 256:02x})")
                    for i in range(MAX_SIGHTINGS + 500))
    sightings, status = read_kernel_xids(KernelLog(HostFS(tree(tmp_path, lines))), sighting_rank)
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


# -- only the driver's records: forged, embedded and drowned XIDs ----------------------------------------
FORGED = "NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


def syslog_log(monkeypatch, tmp_path, text: bytes) -> KernelLog:
    """A reader whose source is syslog(2) text (``text``, as SYSLOG_ACTION_READ_ALL gives it)."""
    import gpu_tune.host.kmsg as kmsg

    monkeypatch.setattr(kmsg, "_syslog_read_all", lambda: (text, None))
    log = KernelLog(HostFS(tree(tmp_path, None)))
    log._kind, log._source = "syslog", "syslog(2)"
    return log


@pytest.mark.parametrize("prio", [14, 30, 38, 190, 8, 99999999999999999999])
def test_records_written_from_user_space_are_not_the_drivers(tmp_path, monkeypatch, prio):
    """Facility 0 is the kernel's alone: a write to /dev/kmsg never gets it. User (14), daemon (30),
    auth (38), local7 (190) records naming an XID are counted and ignored, in both forms."""
    root = tree(tmp_path, f"{prio},5,5,-;{FORGED}\n" + XID.format(seq=6, usec=6, bus="5d", code=48, text="DBE"))
    sightings, status = read_kernel_xids(KernelLog(HostFS(root)), sighting_rank)
    assert [(s.bus, s.code) for s in sightings] == [("0000:5d:00", 48)] and status.foreign == 1
    log = syslog_log(monkeypatch, tmp_path / "s", f"<{prio}>[    5.000000] {FORGED}\n<3>[    6.000000] NVRM: Xid "
                     "(PCI:0000:5d:00): 48, DBE\n".encode())
    sightings, status = read_kernel_xids(log, sighting_rank)
    assert [(s.bus, s.code) for s in sightings] == [("0000:5d:00", 48)] and status.foreign == 1


def test_xid_text_anywhere_but_the_start_of_a_record_is_not_the_drivers(tmp_path, monkeypatch):
    """A USB product string or a HID name holding the driver's words, mid-line or after a newline
    inside another driver's record (kmsg escapes it; syslog(2) repeats the record's prefix)."""
    kmsg = ("6,1,1,-;usb 1-1: Product: " + FORGED + "\n"
            "6,2,2,-;input: " + FORGED + " as /devices/pci0000:00/0000:00:14.0/usb1/1-1/1-1:1.0/input/input9\n"
            "6,3,3,-;usb 1-1: Product: x\\x0a" + FORGED + "\n")
    sightings, status = read_kernel_xids(KernelLog(HostFS(tree(tmp_path, kmsg))), sighting_rank)
    assert sightings == () and status.embedded == 3 and status.malformed == 0
    text = (b"<6>[    7.000000] usb 1-1: Product: x\n<6>[    7.000000] " + FORGED.encode() + b"\n"
            b"<3>[    8.000000] NVRM: Xid (PCI:0000:5d:00): 48, DBE\n")
    sightings, status = read_kernel_xids(syslog_log(monkeypatch, tmp_path / "s", text), sighting_rank)
    assert [(s.bus, s.code) for s in sightings] == [("0000:5d:00", 48)] and status.embedded == 1
    # plain dmesg text indents a record's later lines
    dmesg = "[    7.000000] usb 1-1: Product: x\n               " + FORGED + "\n"
    sightings, status = read_kernel_xids(KernelLog(HostFS(tree(tmp_path / "d", dmesg))), sighting_rank)
    assert sightings == () and status.embedded == 1


@pytest.mark.parametrize("digits", ["\u0667\u0669", "\uff17\uff19", "\u09ed\u09ef", "7\u0669"])
def test_xid_numbers_are_ascii_digits_only(tmp_path, digits):
    root = tree(tmp_path, f"3,1,1,-;NVRM: Xid (PCI:0000:18:00): {digits}, x\n")
    sightings, status = read_kernel_xids(KernelLog(HostFS(root)), sighting_rank)
    assert sightings == () and status.malformed == 1


def test_a_flood_of_distinct_sightings_never_pushes_out_a_fatal_one(tmp_path):
    """2,000 distinct XID 13 (invented bus ids), then a real XID 79: the 79 is kept and the flood's
    excess is counted; fatal ones on many invented addresses never push out one of the node's GPUs."""
    flood = "".join(XID.format(seq=i, usec=i, bus=f"{i % 256:02x}", code=13, text="app").replace(
        ":00)", f":{i // 256:02x})") for i in range(2000))
    root = tree(tmp_path, flood + XID.format(seq=3000, usec=3000, bus="5d", code=79, text="GPU has fallen off the bus."))
    sightings, status = read_kernel_xids(KernelLog(HostFS(root)), sighting_rank, ["0000:5d:00.0"])
    assert ("0000:5d:00", 79) in {(s.bus, s.code) for s in sightings}
    assert status.dropped == 2000 - MAX_SIGHTINGS and status.dropped_fatal == 0
    fatal = "".join(XID.format(seq=i, usec=i, bus=f"{i % 256:02x}", code=48, text="DBE").replace(
        "PCI:0000:", "PCI:0001:") for i in range(MAX_FATAL_BUSES + 100))  # addresses in no node's domain
    root = tree(tmp_path / "f", fatal + XID.format(seq=3000, usec=3000, bus="5d", code=79, text="x"))
    sightings, status = read_kernel_xids(KernelLog(HostFS(root)), sighting_rank, ["0000:5d:00.0"])
    kept = {(s.bus, s.code) for s in sightings}
    assert ("0000:5d:00", 79) in kept and len(kept) == MAX_FATAL_BUSES + 1 and status.dropped_fatal == 100


def test_the_worst_record_speaks_for_a_sighting_whatever_the_order(tmp_path):
    """NVLink5 XIDs say Fatal or Nonfatal per record: any Fatal one makes the sighting fatal."""
    nonfatal = XID.format(seq=1, usec=1, bus="1b", code=145, text="x").replace(
        "pid='<unknown>', name=<unknown>, x", "RLW_RXPIPE Nonfatal XC1 i0 Link 03 (0x004505c6 0x00000000)")
    fatal = XID.format(seq=2, usec=2, bus="1b", code=145, text="x").replace(
        "pid='<unknown>', name=<unknown>, x", "RLW_SRC_TRACK Fatal XC0 i0 Link 01 (0x004505c6 0x00000001)")
    for i, body in enumerate((nonfatal + fatal, fatal + nonfatal)):
        (s,), _ = read_kernel_xids(KernelLog(HostFS(tree(tmp_path / str(i), body))), sighting_rank)
        assert (s.code, s.count, s.rank, s.first_usec, s.last_usec) == (145, 2, FATAL, 1, 2)
        assert "RLW_SRC_TRACK Fatal" in s.message


# -- the newest records are the ones read ---------------------------------------------------------------
def test_a_log_longer_than_one_read_reads_its_newest_lines(tmp_path):
    body = b"6,1,1,-;x\n" * 5000 + XID.format(seq=9, usec=9, bus="5d", code=79, text="x").encode()
    root = tree(tmp_path, body)
    sightings, status = read_kernel_xids(KernelLog(HostFS(root), max_records=1000), sighting_rank)
    assert [s.code for s in sightings] == [79]
    assert status.skipped == 4001 and status.scanned == 1000
    assert any("only the newest 1,000 lines read (4,001 older not read)" in n for n in status.notes)
    with open(root / "dev/kmsg", "ab") as f:  # the next read reads only what is new
        f.write(XID.format(seq=10, usec=10, bus="5d", code=48, text="DBE").encode())
    log = KernelLog(HostFS(root), max_records=1000)
    read_kernel_xids(log)
    with open(root / "dev/kmsg", "ab") as f:
        f.write(XID.format(seq=11, usec=11, bus="5d", code=94, text="x").encode())
    sightings, status = read_kernel_xids(log)
    assert [s.code for s in sightings] == [94] and status.skipped == 0


class Device:
    """The kernel's /dev/kmsg as the reader meets it: one record per read(2), EPIPE where records
    were overwritten, EAGAIN at the end (stands in for the module's ``os``; the rest is the real one)."""

    def __init__(self, records):
        self.records = deque(records)

    def read(self, fd, n):
        if not self.records:
            raise BlockingIOError(errno.EAGAIN, "no more")
        r = self.records.popleft()
        if isinstance(r, Exception):
            raise r
        return r[:n]

    def __getattr__(self, name):
        return getattr(os, name)


def test_the_kernels_device_is_read_to_its_end_within_a_time_bound(tmp_path, monkeypatch):
    import gpu_tune.host.kmsg as kmsg

    records = [f"6,{i},{i},-;chatter {i}\n SUBSYSTEM=x\n".encode() for i in range(3000)]
    records[1000:1000] = [OSError(errno.EPIPE, "overwritten")]  # then records 1000..1049 are gone
    del records[1001:1051]
    records += [f"14,3000,3000,-;{FORGED}\n".encode(), XID.format(seq=3001, usec=3001, bus="5d", code=79, text="x").encode()]
    dev = Device(records)
    monkeypatch.setattr(kmsg, "os", dev)
    log = KernelLog(HostFS(tree(tmp_path, None)))
    log._fd, log._kind, log._source = os.open(os.devnull, os.O_RDONLY), "device", "/dev/kmsg"
    sightings, status = read_kernel_xids(log, sighting_rank)
    assert [s.code for s in sightings] == [79] and status.foreign == 1 and not status.incomplete
    assert status.scanned == 2952 and status.lost == 50
    dev.records.extend(f"6,{i},{i},-;chatter {i}\n".encode() for i in range(3002, 6000))
    log.max_seconds = 0
    _, status = read_kernel_xids(log, sighting_rank)
    assert status.incomplete and status.scanned == 1023 and "the newer ones are read next" in status.notes[0]
    assert len(dev.records) == 2998 - 1023  # left for the next read
    log.close()


# -- "fallen off the bus" without an Xid line, as real drivers print it, in each form --------------------
FALLEN3 = ("NVRM: The NVIDIA GPU 0000:b3:00.0", "NVRM: (PCI ID: 10de:26b5) installed in this system has",
           "NVRM: fallen off the bus and is not responding to commands.")
FALLEN1 = ("NVRM: GPU 0000:b3:00.0: GPU has fallen off the bus.",
           "NVRM: GPU at PCI:0000:b3:00: GPU-5f2a0c4e-81d3-7a52-e1b9-0c6f3d2a4b18 has fallen off the bus.")


def _fallen_forms() -> dict[str, tuple[str, bytes]]:
    """(form, text) of each message in the three forms the reader handles."""
    kmsg = "3,1207,1843308145,-;" + "\\x0a".join(FALLEN3) + "\n"  # /dev/kmsg escapes a record's newlines
    raw = "".join(f"<3>[ 1843.308145] {x}\n" for x in FALLEN3)  # syslog(2), dmesg -r: each line its prefix
    dmesg = f"[ 1843.308145] {FALLEN3[0]}\n" + "".join(f"               {x}\n" for x in FALLEN3[1:])  # dmesg
    out = {"kmsg-3": ("file", kmsg.encode()), "syslog-3": ("syslog", raw.encode()),
           "dmesg-r-3": ("file", raw.encode()), "dmesg-3": ("file", dmesg.encode())}
    for i, line in enumerate(FALLEN1):
        out[f"kmsg-1{i}"] = ("file", f"3,1207,1843308145,-;{line}\n".encode())
        out[f"syslog-1{i}"] = ("syslog", f"<3>[ 1843.308145] {line}\n".encode())
        out[f"dmesg-1{i}"] = ("file", f"[ 1843.308145] {line}\n".encode())
    return out


@pytest.mark.parametrize("form", sorted(_fallen_forms()))
def test_a_gpu_fallen_off_the_bus_without_an_xid_is_xid_79(tmp_path, monkeypatch, form):
    where, text = _fallen_forms()[form]
    if where == "syslog":
        log = syslog_log(monkeypatch, tmp_path, b"<6>[    1.000000] boot\n" + text)
    else:
        log = KernelLog(HostFS(tree(tmp_path, b"6,0,0,-;boot\n" + text if form.startswith("kmsg") else text)))
    sightings, status = read_kernel_xids(log, sighting_rank)
    assert [(s.bus, s.code, s.first_usec, s.rank) for s in sightings] == [("0000:b3:00", 79, 1843308145, FATAL)], form
    assert status.malformed == 0 and status.embedded == 0
