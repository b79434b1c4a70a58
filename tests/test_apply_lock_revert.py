"""One lock over audit -> plan -> apply -> verify; revert skips originals that were never
overwritten and reports a journal it cannot update (a full disk) as what it is."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import threading
import time

import pytest

from gpu_tune import cli
from gpu_tune.tune import engine
from gpu_tune.errors import HostError
from gpu_tune.host.fs import HostFS
from gpu_tune.tune.journal import JOURNAL, Journal
from gpu_tune.tune.knobs.base import Context, encode_raw
from gpu_tune.tune.policy import load_profile
from tests.conftest import snapshot_tree


def _rows(report):
    return {(r.id, r.target): r for r in report.settings}


def _wait_for_either(a: threading.Event, b: threading.Event, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while not (a.is_set() or b.is_set()):
        assert time.monotonic() < deadline, "the second apply neither finished nor waited for the lock"
        time.sleep(0.005)


def test_racing_applies_never_verify_each_other(make_host, monkeypatch):
    """training's apply is between its writes and its verify when inference's apply starts:
    inference must wait for the lock (not run its audit, writes and verify in that gap)."""
    root = make_host("small-2cpu")
    training, inference = load_profile("training"), load_profile("inference")
    waiting, finished = threading.Event(), threading.Event()
    results: dict[str, object] = {}
    order: list[str] = []
    real_audit, real_flock = engine.audit, fcntl.flock

    def flock(fd, op):
        try:
            return real_flock(fd, op)
        except BlockingIOError:
            if threading.current_thread().name == "inference":
                waiting.set()
            raise

    def run_inference():
        try:
            results["inference"] = engine.apply(engine.make_context(HostFS(root), inference, None), lock_timeout=300)
        finally:
            finished.set()

    audits = {"training": 0}

    def audit(ctx, knobs=engine.KNOBS):
        name = threading.current_thread().name
        if name == "training":
            audits["training"] += 1
            if audits["training"] == 2:  # training's verify, after its writes
                threading.Thread(target=run_inference, name="inference").start()
                _wait_for_either(waiting, finished)
        order.append(name)
        return real_audit(ctx, knobs)

    monkeypatch.setattr(fcntl, "flock", flock)
    monkeypatch.setattr(engine, "audit", audit)
    t = threading.Thread(target=lambda: results.update(training=engine.apply(
        engine.make_context(HostFS(root), training, None))), name="training")
    t.start()
    t.join(300)
    assert finished.wait(300)
    assert waiting.is_set(), "inference never had to wait for training's lock"
    # training verified its own values, then inference audited, wrote and verified its own
    assert order == ["training", "training", "inference", "inference"]
    for name, want in (("training", "0"), ("inference", "1")):
        sw = _rows(results[name])[("sysctl.vm.swappiness", "host")]
        assert sw.status == "ok" and sw.changed and sw.current == want, (name, sw)
    assert (root / "proc/sys/vm/swappiness").read_text().strip() == "1"


def test_revert_waits_for_an_apply_holding_the_lock(make_host, monkeypatch):
    root = make_host("small-2cpu")
    prof = load_profile("training")
    engine.apply(engine.make_context(HostFS(root), prof, None))
    (root / "proc/sys/vm/swappiness").write_text("60\n")  # drift again
    waiting, finished = threading.Event(), threading.Event()
    real_audit, real_flock = engine.audit, fcntl.flock
    seen: dict[str, str] = {}

    def flock(fd, op):
        try:
            return real_flock(fd, op)
        except BlockingIOError:
            if threading.current_thread().name == "revert":
                waiting.set()
            raise

    def run_revert():
        try:
            seen["revert"] = repr(engine.revert(Context(fs=HostFS(root), profile=None), lock_timeout=300))
        finally:
            finished.set()

    calls = {"n": 0}

    def audit(ctx, knobs=engine.KNOBS):
        calls["n"] += 1
        if calls["n"] == 2 and threading.current_thread().name == "apply":
            threading.Thread(target=run_revert, name="revert").start()
            _wait_for_either(waiting, finished)
        return real_audit(ctx, knobs)

    monkeypatch.setattr(fcntl, "flock", flock)
    monkeypatch.setattr(engine, "audit", audit)
    out = {}
    t = threading.Thread(target=lambda: out.update(r=engine.apply(engine.make_context(HostFS(root), prof, None))),
                         name="apply")
    t.start()
    t.join(300)
    assert finished.wait(300) and waiting.is_set()
    assert _rows(out["r"])[("sysctl.vm.swappiness", "host")].status == "ok"
    assert (root / "proc/sys/vm/swappiness").read_text() == "60\n"  # revert ran after, restoring the original


def _refuse_writes_to(monkeypatch, path: str, code: int = errno.EROFS):
    """Writes into ``path`` fail with ``code``, as a read-only file or a full disk answers."""
    real_text, real_bytes = HostFS.write_text, HostFS.write_bytes_exact

    def write_text(self, host_path, value):
        if host_path == path:
            raise HostError(f"cannot write {value!r} to {host_path}: {errno.errorcode[code]}", code)
        return real_text(self, host_path, value)

    def write_bytes_exact(self, host_path, data):
        if host_path == path:
            raise HostError(f"{host_path}: {errno.errorcode[code]}", code)
        return real_bytes(self, host_path, data)

    monkeypatch.setattr(HostFS, "write_text", write_text)
    monkeypatch.setattr(HostFS, "write_bytes_exact", write_bytes_exact)


def test_a_failed_write_leaves_no_original_to_restore(make_host, monkeypatch):
    """swappiness cannot be written (read-only): apply reports it, and revert neither retries it
    nor fails for it."""
    root = make_host("small-2cpu")
    _refuse_writes_to(monkeypatch, "/proc/sys/vm/swappiness")
    before = snapshot_tree(root)
    rep = engine.apply(engine.make_context(HostFS(root), load_profile("training"), None))
    sw = _rows(rep)[("sysctl.vm.swappiness", "host")]
    assert sw.status == "error" and not sw.changed and "EROFS" in sw.detail
    assert _rows(rep)[("thp.enabled", "host")].changed
    ids = {e["id"] for e in Journal(HostFS(root)).load().entries}
    assert "sysctl.vm.swappiness" not in ids and "thp.enabled" in ids
    ok, rows = engine.revert(Context(fs=HostFS(root), profile=None))
    assert ok, [(r.id, r.detail) for r in rows if r.status != "ok"]
    assert "sysctl.vm.swappiness" not in {r.id for r in rows}
    assert snapshot_tree(root) == before


def test_revert_skips_an_original_still_in_place(make_host, monkeypatch):
    """A journal entry whose target still holds the recorded bytes (a crash between the journal
    and the write, or a journal from before) is dropped without writing."""
    root = make_host("small-2cpu")
    fs = HostFS(root)
    raw = fs.read_bytes("/proc/sys/vm/swappiness")
    j = Journal(fs).load()
    j.add({"id": "sysctl.vm.swappiness", "target": "host", "family": "sysctl", "path": "/proc/sys/vm/swappiness",
           "value": "60", "raw": encode_raw(raw)})
    j.save()
    _refuse_writes_to(monkeypatch, "/proc/sys/vm/swappiness")
    ok, rows = engine.revert(Context(fs=HostFS(root), profile=None))
    assert ok and [(r.id, r.status, r.changed) for r in rows] == [("sysctl.vm.swappiness", "ok", False)]
    assert "the original is in place" in rows[0].detail
    assert Journal(HostFS(root)).load().entries == []


def test_a_failed_write_that_changed_the_file_keeps_its_original(make_host, monkeypatch):
    """A write that fails after changing the target (a truncated regular file) is not 'never
    happened': its original stays in the journal and revert restores it."""
    root = make_host("small-2cpu")
    real = HostFS.write_text

    def write_text(self, host_path, value):
        if host_path == "/proc/sys/vm/swappiness":
            (root / "proc/sys/vm/swappiness").write_bytes(b"")
            raise HostError(f"cannot write {value!r} to {host_path}: ENOSPC", errno.ENOSPC)
        return real(self, host_path, value)

    monkeypatch.setattr(HostFS, "write_text", write_text)
    engine.apply(engine.make_context(HostFS(root), load_profile("training"), None))
    assert "sysctl.vm.swappiness" in {e["id"] for e in Journal(HostFS(root)).load().entries}
    monkeypatch.setattr(HostFS, "write_text", real)
    ok, _ = engine.revert(Context(fs=HostFS(root), profile=None))
    assert ok and (root / "proc/sys/vm/swappiness").read_text() == "60\n"


def _full_disk_for_the_journal(monkeypatch):
    real = HostFS.write_file_atomic

    def write_file_atomic(self, host_path, data, mode=0o644):
        if host_path == JOURNAL:
            raise HostError(f"{host_path}: No space left on device (ENOSPC)", errno.ENOSPC)
        return real(self, host_path, data, mode)

    monkeypatch.setattr(HostFS, "write_file_atomic", write_file_atomic)
    return real


def test_enospc_during_revert_says_what_was_restored_and_keeps_the_journal(make_host, monkeypatch):
    root = make_host("small-2cpu")
    before = snapshot_tree(root)
    engine.apply(engine.make_context(HostFS(root), load_profile("training"), None))
    journal = (root / JOURNAL.lstrip("/")).read_bytes()
    n = len(json.loads(journal)["entries"])
    real = _full_disk_for_the_journal(monkeypatch)
    ok, rows = engine.revert(Context(fs=HostFS(root), profile=None))
    assert not ok
    *restored, last = rows
    assert len(restored) == n and all(r.status == "ok" and r.detail == "restored" for r in restored)
    assert last.id == "journal" and last.status == "error" and "ENOSPC" in last.detail
    assert f"keeps all {n} originals for the next revert" in last.detail
    assert snapshot_tree(root) == before  # every file is back
    assert (root / JOURNAL.lstrip("/")).read_bytes() == journal  # kept whole for the retry
    # once there is space, the retry finds every original in place and empties the journal
    monkeypatch.setattr(HostFS, "write_file_atomic", real)
    ok, rows = engine.revert(Context(fs=HostFS(root), profile=None))
    assert ok and len(rows) == n and all(r.status == "ok" and not r.changed for r in rows)
    assert Journal(HostFS(root)).load().entries == [] and snapshot_tree(root) == before


def test_enospc_during_revert_exits_1_not_3(make_host, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "400")
    root = make_host("small-2cpu")
    engine.apply(engine.make_context(HostFS(root), load_profile("training"), None))
    _full_disk_for_the_journal(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        cli.main(["--root", str(root), "-o", "json", "revert"])
    out = capsys.readouterr()
    assert exc.value.code == 1, out.err
    doc = json.loads(out.out)
    assert doc["restored"] is False
    statuses = {r["id"]: r["status"] for r in doc["settings"]}
    assert statuses["journal"] == "error" and statuses["sysctl.vm.swappiness"] == "ok"
    assert "unexpected" not in out.err

    with pytest.raises(SystemExit) as exc:
        cli.main(["--root", str(root), "revert"])
    out = capsys.readouterr()
    assert exc.value.code == 1
    assert "No space left on device" in out.out and "run gpu-tune revert again" in out.out


def test_a_restore_that_fails_is_a_row_and_keeps_its_entry(make_host, monkeypatch):
    root = make_host("small-2cpu")
    engine.apply(engine.make_context(HostFS(root), load_profile("training"), None))
    _refuse_writes_to(monkeypatch, "/proc/sys/vm/swappiness", errno.ENOSPC)
    ok, rows = engine.revert(Context(fs=HostFS(root), profile=None))
    assert not ok
    bad = [r for r in rows if r.status != "ok"]
    assert [(r.id, r.status) for r in bad] == [("sysctl.vm.swappiness", "error")]
    assert "not restored" in bad[0].detail and "ENOSPC" in bad[0].detail
    assert [e["id"] for e in Journal(HostFS(root)).load().entries] == ["sysctl.vm.swappiness"]


def test_a_created_file_that_failed_leaves_no_folder_behind(make_host, monkeypatch):
    """allocator.env could not be written after its folder was made: the folder is removed by
    revert, the file's absent original is not 'in place' while the folder stays."""
    root = make_host("link-degraded")
    real = HostFS.write_file_atomic

    def write_file_atomic(self, host_path, data, mode=0o644):
        if host_path == "/etc/gpu-tune/allocator.env":
            (root / "etc/gpu-tune").mkdir(parents=True, exist_ok=True)
            raise HostError(f"{host_path}: No space left on device (ENOSPC)", errno.ENOSPC)
        return real(self, host_path, data, mode)

    monkeypatch.setattr(HostFS, "write_file_atomic", write_file_atomic)
    before = snapshot_tree(root)
    rep = engine.apply(engine.make_context(HostFS(root), load_profile("training"), None))
    assert _rows(rep)[("allocator.preload", "host")].status == "error"
    assert (root / "etc/gpu-tune").is_dir()
    monkeypatch.setattr(HostFS, "write_file_atomic", real)
    ok, _ = engine.revert(Context(fs=HostFS(root), profile=None))
    assert ok and not (root / "etc/gpu-tune").exists() and snapshot_tree(root) == before


# -- a journal names only what its family writes ----------------------------------------------
def test_every_original_apply_records_names_a_file_its_family_writes(make_host, gpu_fixture, tmp_path):
    """What a real apply journals on a GPU host (every writing family, ld.so.preload and a
    created folder included) passes the check that refuses a journal naming anything else, and
    revert restores it all; each declaration is what the knob writes, no more."""
    from gpu_tune.gpu import select_backend
    from gpu_tune.tune.knobs import KNOBS

    root = make_host("link-degraded")
    pol = tmp_path / "pol"
    pol.mkdir()
    (pol / "all.yaml").write_text("include: training.yaml\ngpu: {persistenced: ignore}\n"
                                  "allocator: {ld_so_preload: true}\n")
    backend = select_backend("fixture", str(gpu_fixture("link-degraded")))
    before = {p: p.read_bytes() for p in (root / "proc/irq").glob("*/smp_affinity_list")}
    engine.apply(engine.make_context(HostFS(root), load_profile("all", pol), backend))
    entries = Journal(HostFS(root)).load().entries
    assert {e["family"] for e in entries} == {"sysctl", "thp", "cpu", "cstates", "gpu", "irq", "allocator"}
    assert any(e.get("created_dirs") == ["/etc/gpu-tune"] for e in entries)
    assert any(e["path"] == "/etc/ld.so.preload" for e in entries if e["family"] == "allocator")
    ok, rows = engine.revert(engine.make_context(HostFS(root), None, backend))
    assert ok and rows
    assert {p: p.read_bytes() for p in before} == before and not (root / "etc/gpu-tune").exists()
    for knob in KNOBS:  # a knob that writes says what; one that only reads names nothing
        assert bool(knob.writes) == (knob.writable and knob.family != "gpu"), knob.family


def test_a_path_with_dotdot_is_no_file_here_not_an_error(make_host):
    fs = HostFS(make_host("small-2cpu"))
    assert not fs.exists("/proc/sys/../../etc") and not fs.is_dir("/proc/..")
    assert not fs.is_kernel_file("/proc/sys/vm/../swappiness")


# -- a large journal: work in proportion to it, a table of bounded size ---------------------------
def _many_sysctl_originals(root, n: int, restorable: int) -> None:
    """``n`` sysctl entries (original 60), the first ``restorable`` of them over a file that holds 1."""
    vm = root / "proc/sys/vm"
    entries = []
    for i in range(n):
        if i < restorable:
            (vm / f"many_{i}").write_text("1\n")
        entries.append({"id": f"sysctl.vm.many_{i}", "target": "host", "family": "sysctl",
                        "path": f"/proc/sys/vm/many_{i}", "value": "60", "raw": "NjAK", "seq": i + 1})
    (root / JOURNAL.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    (root / JOURNAL.lstrip("/")).write_text(json.dumps({"format": 1, "entries": entries}))


def test_revert_of_thousands_prints_a_bounded_table_and_json_lists_every_row(make_host, monkeypatch, capsys):
    """3,000 originals: the table shows those that need attention first and counts the rest
    under it (a 100,000-entry journal once took a minute and a gigabyte to print); -o json has
    every row."""
    from gpu_tune.views.settings import MAX_TABLE_GROUPS

    monkeypatch.setenv("COLUMNS", "200")
    root = make_host("small-2cpu")
    _many_sysctl_originals(root, 3000, restorable=2990)  # 10 of them have no file: not restored
    with pytest.raises(SystemExit) as exc:
        cli.main(["--root", str(root), "--gpu-backend", "none", "revert"])
    out = capsys.readouterr().out
    assert exc.value.code == 1
    lines = out.splitlines()
    assert len(lines) < MAX_TABLE_GROUPS + 20, len(lines)
    assert "2,800 more rows not shown (2,800 ok); -o json lists every row" in out
    assert sum("not restored" in ln for ln in lines) == 10  # every failure is shown
    assert (root / "proc/sys/vm/many_0").read_text() == "60\n"
    assert [e["id"] for e in Journal(HostFS(root)).load().entries] == [f"sysctl.vm.many_{i}" for i in range(2990, 3000)]
    with pytest.raises(SystemExit):
        cli.main(["--root", str(root), "--gpu-backend", "none", "-o", "json", "revert"])
    assert len(json.loads(capsys.readouterr().out)["settings"]) == 10


def test_interrupted_writes_are_looked_for_once_per_folder(make_host, monkeypatch):
    """The temporary files beside journalled files are found with one listing of each folder,
    not one per file (2,000 entries in one folder were 2,000 listings of it)."""
    root = make_host("small-2cpu")
    _many_sysctl_originals(root, 2000, restorable=2000)
    (root / "proc/sys/vm/.many_7.0123456789ab").write_text("half")  # an apply killed before its rename
    listed: list[str] = []
    real = os.listdir

    def listdir(path="."):
        listed.append(path)
        return real(path)

    monkeypatch.setattr(os, "listdir", listdir)
    removed = engine.clear_interrupted_writes(HostFS(root), Journal(HostFS(root)).load())
    assert removed == ["/proc/sys/vm/.many_7.0123456789ab"]
    assert len(listed) == 2  # /proc/sys/vm and /var/lib/gpu-tune
