"""gpu.persistence_mode, irq.affinity and allocator.preload: read, apply, verify and restore on
fresh copies of generated host trees (each test builds its own)."""

from __future__ import annotations

import errno

import pytest

from gpu_tune.errors import HostError, UnsupportedWrite
from gpu_tune.gpu import select_backend
from gpu_tune.host.fs import HostFS
from gpu_tune.tune.knobs import KNOBS
from gpu_tune.tune.knobs.allocator import AllocatorKnob, find_host_jemalloc
from gpu_tune.tune.knobs.base import Context
from gpu_tune.tune.knobs.gpu_persistence import GpuPersistenceKnob
from gpu_tune.tune.knobs.irq_affinity import IrqAffinityKnob
from gpu_tune.tune.profile import Profile
from gpu_tune.tune.policy import load_profile
from tests.fixtures import pcigen

N0 = "0-55,112-167"
N1 = "56-111,168-223"


def prof(**sections) -> Profile:
    return Profile(name="t", **sections)


def ctx_for(root, profile, backend=None) -> Context:
    return Context(fs=HostFS(root), profile=profile, gpu=backend)


def roundtrip(knob, ctx, rows):
    """Journal originals, apply drift rows, return (entries, fresh rows)."""
    entries = []
    for r in rows:
        if r.status == "drift":
            entries.append(knob.snapshot(ctx, r))
            knob.apply(ctx, r)
    fresh = Context(fs=ctx.fs, profile=ctx.profile, gpu=ctx.gpu)
    return entries, knob.read(fresh)


def test_registry_order():
    assert [k.family for k in KNOBS] == ["sysctl", "thp", "cpu", "cstates", "gpu", "irq", "allocator", "limits", "mig", "gpudirect"]


# -- gpu.persistence_mode -------------------------------------------------------------------------
def test_persistence_apply_and_restore(make_host, gpu_fixture):
    root = make_host("link-degraded")
    b = select_backend("fixture", str(gpu_fixture("link-degraded")))
    ctx = ctx_for(root, prof(gpu={"persistence_mode": True}), b)
    knob = GpuPersistenceKnob()
    rows = knob.read(ctx)
    assert [(r.target, r.current, r.desired, r.status) for r in rows] == [
        ("0", "off", "on", "drift"), ("1", "off", "on", "drift")]
    entries, after = roundtrip(knob, ctx, rows)
    assert [r.status for r in after] == ["ok", "ok"]
    assert all(g.persistence_mode for g in select_backend("fixture", str(b.path)).gpus())  # written back
    for e in reversed(entries):
        knob.restore(ctx, e)
    assert [r.current for r in knob.read(ctx)] == ["off", "off"]


def test_persistence_null_lost_and_persistenced(make_host, gpu_fixture, tmp_path):
    root = make_host("irqbalance")  # nvidia-persiste runs here; the GPUs already have it on
    knob = GpuPersistenceKnob()
    rows = knob.read(ctx_for(root, prof(gpu={"persistence_mode": True}), select_backend("none")))
    assert [(r.target, r.status, r.detail) for r in rows] == [("-", "unsupported", "no NVIDIA GPU/driver")]
    b = select_backend("fixture", str(gpu_fixture("irqbalance")))
    rows = knob.read(ctx_for(root, prof(gpu={"persistence_mode": True}), b))
    assert {(r.status, r.detail) for r in rows} == {("ok", "managed by nvidia-persistenced")}
    b.set_persistence_mode(1, False)
    rows = knob.read(ctx_for(root, prof(gpu={"persistence_mode": True}), b))
    assert rows[1].status == "conflict" and "nvidia-persistenced" in rows[1].detail
    # with persistenced: ignore the knob sets it through NVML instead
    rows = knob.read(ctx_for(root, prof(gpu={"persistence_mode": True, "persistenced": "ignore"}), b))
    assert rows[1].status == "drift"
    # a lost GPU is an error row; the other GPU still reports
    import json

    data = json.loads(b.path.read_text())
    data["gpus"][0]["lost"] = True
    f = tmp_path / "lost.json"
    f.write_text(json.dumps(data))
    rows = knob.read(ctx_for(root, prof(gpu={"persistence_mode": True}), select_backend("fixture", str(f))))
    assert rows[0].status == "error" and "lost" in rows[0].detail and rows[1].status == "conflict"


# -- irq.affinity ---------------------------------------------------------------------------------
IRQ_PROFILE = {"affinity": "numa-local", "devices": ["gpu", "nic"], "irqbalance": "conflict"}


def test_irq_dgx_audit_rows(tmp_path_factory):
    root = pcigen.build_shared("dgx-8gpu", tmp_path_factory)
    b = select_backend("fixture", str(pcigen.GPU_JSON_DIR / "dgx-8gpu.json"))
    ctx = ctx_for(root, prof(irq=IRQ_PROFILE), b)
    rows = IrqAffinityKnob().read(ctx)
    topo = ctx.topology()
    expected = sum(len(d.irqs) for d in (*topo.gpus, *topo.nics))
    assert len(rows) == expected and 980 <= expected <= 1000
    by = {int(r.target): r for r in rows}
    g0, g7 = topo.gpu(0), topo.gpu(7)
    assert by[g0.irqs[0]].desired == N0 and by[g7.irqs[-1]].desired == N1
    assert by[g0.irqs[0]].current == "0-223" and by[g0.irqs[0]].status == "drift"
    assert by[g0.irqs[0]].path == f"/proc/irq/{g0.irqs[0]}/smp_affinity_list"
    assert "effective" in by[g0.irqs[0]].detail  # effective_affinity_list differs from 0-223
    assert not ({8, 9} & set(by))  # timer/other IRQs untouched


def test_irq_apply_restore_and_exclude(make_host, gpu_fixture):
    root = make_host("link-degraded")
    b = select_backend("fixture", str(gpu_fixture("link-degraded")))
    p = prof(irq=dict(IRQ_PROFILE, exclude_cpus="0,8"))
    ctx = ctx_for(root, p, b)
    knob = IrqAffinityKnob()
    rows = knob.read(ctx)
    assert len(rows) == 8 and {r.status for r in rows} == {"drift"}
    assert {r.desired for r in rows} == {"1-7", "9-15"}
    irq0 = rows[0].target
    before = (root / f"proc/irq/{irq0}/smp_affinity_list").read_bytes()
    entries, after = roundtrip(knob, ctx, rows)
    assert {r.status for r in after} == {"ok"}
    assert (root / f"proc/irq/{irq0}/smp_affinity_list").read_text() == "1-7"
    for e in reversed(entries):
        knob.restore(ctx, e)
    assert (root / f"proc/irq/{irq0}/smp_affinity_list").read_bytes() == before
    assert {r.status for r in knob.read(Context(fs=ctx.fs, profile=p, gpu=b))} == {"drift"}


def test_irq_mask_form_when_no_list(make_host, gpu_fixture):
    root = make_host("no-jemalloc")
    b = select_backend("fixture", str(gpu_fixture("no-jemalloc")))
    p = prof(irq=IRQ_PROFILE)
    ctx = ctx_for(root, p, b)
    irq = ctx.topology().gpu(0).irqs[0]
    (root / f"proc/irq/{irq}/smp_affinity_list").unlink()
    (root / f"proc/irq/{irq}/smp_affinity").write_text("0000ffff\n")
    knob = IrqAffinityKnob()
    row = next(r for r in knob.read(ctx) if r.target == str(irq))
    assert (row.current, row.desired, row.status) == ("0-15", "0-7", "drift")
    assert row.path.endswith("/smp_affinity")
    entry = knob.snapshot(ctx, row)
    knob.apply(ctx, row)
    assert (root / f"proc/irq/{irq}/smp_affinity").read_text() == "000000ff"
    assert knob.restore_value(entry) == "0000ffff"
    knob.restore(ctx, entry)
    assert (root / f"proc/irq/{irq}/smp_affinity").read_text() == "0000ffff\n"


def test_irq_unknown_node_irqbalance_and_managed(make_host, gpu_fixture, monkeypatch):
    knob = IrqAffinityKnob()
    root = make_host("gpu-numa-unknown")
    b = select_backend("fixture", str(gpu_fixture("gpu-numa-unknown")))
    rows = knob.read(ctx_for(root, prof(irq=IRQ_PROFILE), b))
    by_status = {}
    for r in rows:
        by_status.setdefault(r.status, []).append(r)
    assert len(by_status["unsupported"]) == 4 and "NUMA node unknown" in by_status["unsupported"][0].detail
    assert {r.desired for r in by_status["drift"]} == {"8-15"}  # GPU 0 and eth0, derived node 1

    root = make_host("irqbalance")
    b = select_backend("fixture", str(gpu_fixture("irqbalance")))
    rows = knob.read(ctx_for(root, prof(irq=IRQ_PROFILE), b))
    assert {r.status for r in rows} == {"conflict"} and "--banirq" in rows[0].detail
    ctx = ctx_for(root, prof(irq=dict(IRQ_PROFILE, irqbalance="ignore")), b)
    rows = knob.read(ctx)
    assert {r.status for r in rows} == {"drift"}

    def eio(path, value):
        raise HostError(f"cannot write {value!r} to {path}: Input/output error (EIO)", errno.EIO)

    monkeypatch.setattr(ctx.fs, "write_text", eio)
    with pytest.raises(UnsupportedWrite, match="kernel-managed"):
        knob.apply(ctx, rows[0])

    def eperm(path, value):
        raise HostError(f"{path}: Permission denied (EACCES)", errno.EACCES)

    monkeypatch.setattr(ctx.fs, "write_text", eperm)
    with pytest.raises(HostError) as ei:
        knob.apply(ctx, rows[0])
    assert not isinstance(ei.value, UnsupportedWrite)


def test_irq_gpu_only_devices(make_host, gpu_fixture):
    root = make_host("irqbalance")
    b = select_backend("fixture", str(gpu_fixture("irqbalance")))
    rows = IrqAffinityKnob().read(ctx_for(root, prof(irq=dict(IRQ_PROFILE, devices=["gpu"])), b))
    assert len(rows) == 8  # the NIC's 8 IRQs are left alone


# -- allocator.preload ------------------------------------------------------------------------------
def test_allocator_absent_file_apply_and_revert(make_host):
    root = make_host("link-degraded")
    p = load_profile("training")
    ctx = ctx_for(root, p)
    knob = AllocatorKnob()
    assert find_host_jemalloc(ctx.fs) == "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
    rows = knob.read(ctx)
    assert len(rows) == 1 and rows[0].current == "absent" and rows[0].status == "drift"
    assert rows[0].desired.startswith("LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 MALLOC_CONF=")
    entries, after = roundtrip(knob, ctx, rows)
    assert entries[0]["absent"] is True and entries[0]["raw"] is None
    assert after[0].status == "ok"
    text = (root / "etc/gpu-tune/allocator.env").read_text()
    # a HOST path: no --root prefix in the file
    assert "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n" in text and str(root) not in text
    assert f"MALLOC_CONF={p.allocator.malloc_conf}\n" in text
    knob.restore(ctx, entries[0])
    assert not (root / "etc/gpu-tune/allocator.env").exists()


def test_allocator_previous_bytes_and_ld_so_preload(make_host):
    root = make_host("link-degraded")
    (root / "etc/gpu-tune").mkdir(parents=True)
    old = b"# mine\nLD_PRELOAD=/opt/old/libtcmalloc.so\n"
    (root / "etc/gpu-tune/allocator.env").write_bytes(old)
    (root / "etc/ld.so.preload").write_text("/usr/lib/libfoo.so\n")
    p = prof(allocator={"preload": "jemalloc", "malloc_conf": "background_thread:true", "ld_so_preload": True})
    ctx = ctx_for(root, p)
    knob = AllocatorKnob()
    rows = knob.read(ctx)
    assert [(r.target, r.current, r.status) for r in rows] == [
        ("host", "LD_PRELOAD=/opt/old/libtcmalloc.so", "drift"),
        ("ld.so.preload", "/usr/lib/libfoo.so", "drift")]
    entries, after = roundtrip(knob, ctx, rows)
    assert [r.status for r in after] == ["ok", "ok"]
    assert (root / "etc/ld.so.preload").read_text() == "/usr/lib/libfoo.so\n/usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n"
    for e in reversed(entries):
        knob.restore(ctx, e)
    assert (root / "etc/gpu-tune/allocator.env").read_bytes() == old
    assert (root / "etc/ld.so.preload").read_text() == "/usr/lib/libfoo.so\n"


def test_allocator_no_jemalloc_is_an_error_in_the_probes_words(make_host):
    """A host without the library the profile preloads cannot be brought to the profile: an
    error row (not compliant), worded as the probe words the same missing library."""
    from gpu_tune.launch.runner import LOCAL_JEMALLOC_MISSING

    root = make_host("no-jemalloc")
    rows = AllocatorKnob().read(ctx_for(root, load_profile("training")))
    assert [(r.status, r.current) for r in rows] == [("error", "absent")]
    assert rows[0].detail.split(":", 1)[1] == LOCAL_JEMALLOC_MISSING.split(":", 1)[1]
    assert "apt-get install libjemalloc2" in rows[0].detail and "dnf install jemalloc" in rows[0].detail
    with pytest.raises(HostError):
        AllocatorKnob().apply(ctx_for(root, load_profile("training")), rows[0])
    assert not (root / "etc/gpu-tune").exists()


def test_wanted_follows_profile():
    off = prof()
    assert not GpuPersistenceKnob().wanted(off) and not IrqAffinityKnob().wanted(off)
    assert not AllocatorKnob().wanted(off)
    train = load_profile("training")
    assert GpuPersistenceKnob().wanted(train) and IrqAffinityKnob().wanted(train) and AllocatorKnob().wanted(train)


def test_irq_rows_are_errors_when_the_node_cpulist_is_unreadable(make_host, gpu_fixture):
    from gpu_tune.gpu import select_backend
    from gpu_tune.host.fs import HostFS
    from gpu_tune.tune.knobs.base import Context
    from gpu_tune.tune.knobs.irq_affinity import IrqAffinityKnob
    from gpu_tune.tune.profile import Profile

    root = make_host("link-degraded")
    (root / "sys/devices/system/node/node0/cpulist").write_text("garbage-x\n")
    b = select_backend("fixture", str(gpu_fixture("link-degraded")))
    prof = Profile(name="t", irq={"affinity": "numa-local"})
    rows = IrqAffinityKnob().read(Context(fs=HostFS(root), profile=prof, gpu=b))
    node0 = [r for r in rows if "node 0" in r.detail or "NUMA node 0" in r.detail]
    assert node0 and all(r.status == "error" and "node0/cpulist" in r.detail for r in node0)
