"""irq.affinity reads each IRQ's files once per run: the audit rows and the journal's record of the
original share one sweep; only the verify step after the writes reads them again."""

from __future__ import annotations

from collections import Counter

import pytest

from gpu_tune.tune import engine
from gpu_tune.gpu import select_backend
from gpu_tune.host.fs import HostFS
from gpu_tune.tune.journal import Journal
from gpu_tune.tune.policy import load_profile


@pytest.fixture()
def counted(monkeypatch):
    reads: Counter[str] = Counter()
    real_bytes, real_text = HostFS.read_bytes, HostFS.read_text

    def read_bytes(self, p, **kw):
        reads[p] += 1
        return real_bytes(self, p, **kw)

    def read_text(self, p, **kw):
        reads[p] += 1
        return real_text(self, p, **kw)

    monkeypatch.setattr(HostFS, "read_bytes", read_bytes)
    monkeypatch.setattr(HostFS, "read_text", read_text)
    return reads


def irq_reads(reads: Counter[str]) -> Counter[str]:
    return Counter({p: n for p, n in reads.items() if p.startswith("/proc/irq/")})


def test_audit_reads_every_irq_file_once(make_host, gpu_fixture, counted):
    root = make_host("dgx-8gpu")
    ctx = engine.make_context(HostFS(root), load_profile("training"), select_backend("fixture", str(gpu_fixture("dgx-8gpu"))))
    report = engine.audit(ctx)
    irq_rows = [r for r in report.settings if r.id == "irq.affinity"]
    got = irq_reads(counted)
    assert len(irq_rows) > 900
    # smp_affinity_list and effective_affinity_list of each IRQ, once each
    assert len(got) == 2 * len(irq_rows) and set(got.values()) == {1}
    # a second audit on the same context (as apply's journal step does) reads nothing again
    engine.audit(ctx)
    assert irq_reads(counted) == got


def test_apply_records_the_original_from_the_sweep_and_verifies_afresh(make_host, gpu_fixture, counted):
    root = make_host("link-degraded")
    irq_files = sorted((root / "proc/irq").glob("*/smp_affinity_list"))
    fs = HostFS(root)
    backend = select_backend("fixture", str(gpu_fixture("link-degraded")))
    ctx = engine.make_context(fs, load_profile("training"), backend)
    before = {p: p.read_bytes() for p in irq_files}
    report = engine.apply(ctx)
    rows = [r for r in report.settings if r.id == "irq.affinity"]
    assert rows and all(r.status == "ok" and r.changed for r in rows)
    got = irq_reads(counted)
    # read once before the writes (audit + journal) and once to verify: twice, never three times
    assert {p: n for p, n in got.items() if p.endswith("/smp_affinity_list")} == {
        f"/proc/irq/{r.target}/smp_affinity_list": 2 for r in rows}
    # the journal holds the bytes as they were, and revert puts them back byte for byte
    journal = {(e["id"], e["target"]): e for e in Journal(fs).load().newest_first()}
    assert all(journal[("irq.affinity", r.target)]["value"] for r in rows)
    ok, _ = engine.revert(engine.Context(fs=fs, profile=None, gpu=backend))
    assert ok and {p: p.read_bytes() for p in irq_files} == before
