"""tools/gpu_payload.py, tools/gpu_bootstrap.sh and tools/gpu_proof.py, without a GPU and without the network.

- the fatbin pruner on synthetic fatbin containers and a synthetic ELF file;
- the payload's parts, manifest and their reassembly by the bootstrap, one part per "call";
- the proof's report: merging partial reports, the Markdown, the budget;
- the whole proof on the CPU (``--device cpu``: fixture trees, the real probe), checked for real.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


gp = _load("gpu_payload")
proof = _load("gpu_proof")


# -- synthetic fatbins ---------------------------------------------------------------------------
def _payload(n: int, seed: int) -> bytes:
    """n pseudo-random bytes, none of them zero, different for every seed."""
    out = b""
    k = 0
    while len(out) < n:
        out += hashlib.sha256(f"{seed}:{k}".encode()).digest()
        k += 1
    return out[:n].replace(b"\0", b"\1")


def _entry(kind: int, arch: int, payload: bytes, header_size: int = 64) -> bytes:
    head = struct.pack("<HHIQ", kind, 0x0101, header_size, len(payload))
    head += bytes(gp.ENTRY_ARCH_AT - len(head)) + struct.pack("<I", arch)
    head += b"\x11\x20" + bytes(header_size - len(head) - 2)  # flags-like bytes that must survive
    return head + payload


def _container(entries: list[bytes]) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", gp.FATBIN_MAGIC, 1, 16, len(body)) + body


def _h100_like(seed: int = 0) -> tuple[bytes, dict[str, bytes]]:
    """One container as TensorFlow's: sm_60, 70, 80, 89, 90 machine code and compute_90 PTX."""
    payloads = {f"sm_{a}": _payload(100 + a, seed + a) for a in (60, 70, 80, 89, 90)}
    payloads["compute_90"] = _payload(333, seed + 1)
    entries = [_entry(2, a, payloads[f"sm_{a}"]) for a in (60, 70, 80, 89, 90)]
    entries.append(_entry(1, 90, payloads["compute_90"], header_size=80))
    return _container(entries), payloads


def test_the_pruner_zeroes_other_architectures_and_keeps_every_header():
    c1, p1 = _h100_like(0)
    c2, p2 = _h100_like(50)
    blob = bytearray(b"\0" * 8 + c1 + b"\0" * 8 + c2)  # padding before and between containers
    original = bytes(blob)
    stats = gp.prune_fatbin(blob, 0, len(blob))
    assert stats["containers"] == 2 and stats["entries"] == 12
    assert stats["kept"] == 4 and stats["zeroed"] == 8 and stats["verified"]
    assert stats["skipped_bytes"] == 16 and stats["malformed"] == []
    zeroed = sum(len(p1[f"sm_{a}"]) + len(p2[f"sm_{a}"]) for a in (60, 70, 80, 89))
    assert stats["zeroed_bytes"] == zeroed
    assert stats["by_arch"]["sm_60"] == {"kept": 0, "zeroed": len(p1["sm_60"]) + len(p2["sm_60"])}
    assert stats["by_arch"]["compute_90"]["zeroed"] == 0
    assert len(blob) == len(original)
    # counted for real: exactly the zeroed payloads' bytes changed, to zero
    changed = [i for i in range(len(blob)) if blob[i] != original[i]]
    assert len(changed) == zeroed and all(blob[i] == 0 for i in changed)
    # what a GPU of sm_90 loads is still there, byte for byte, and the headers walk the same
    for p in (p1, p2):
        assert bytes(blob).count(p["sm_90"]) == 1 and bytes(blob).count(p["compute_90"]) == 1
    before = gp.scan_fatbin(original, 0, len(original)).entries
    after = gp.scan_fatbin(bytes(blob), 0, len(blob)).entries
    assert [(e.offset, e.header_size, e.payload_size, e.kind, e.arch) for e in after] == \
           [(e.offset, e.header_size, e.payload_size, e.kind, e.arch) for e in before]
    assert all(bytes(blob[e.offset:e.payload_offset]) == original[e.offset:e.payload_offset] for e in before)


def test_a_container_without_sm_90_keeps_its_newest_ptx_and_unknown_kinds_stay():
    old_ptx, new_ptx, sass80, odd = _payload(50, 1), _payload(60, 2), _payload(70, 3), _payload(40, 4)
    blob = bytearray(_container([_entry(1, 70, old_ptx), _entry(1, 80, new_ptx), _entry(2, 80, sass80),
                                 _entry(8, 100, odd)]))
    stats = gp.prune_fatbin(blob, 0, len(blob))
    assert stats["kept"] == 2 and stats["zeroed"] == 2
    assert bytes(blob).count(new_ptx) == 1 and bytes(blob).count(odd) == 1
    assert bytes(blob).count(old_ptx) == 0 and bytes(blob).count(sass80) == 0


def test_a_malformed_container_is_left_untouched():
    good, _ = _h100_like(0)
    bad = bytearray(_container([_entry(2, 60, _payload(64, 9))]))
    struct.pack_into("<Q", bad, 16 + 8, 10**6)  # the entry claims more than its container holds
    blob = bytearray(good + bytes(bad))
    before = bytes(blob[len(good):])
    stats = gp.prune_fatbin(blob, 0, len(blob))
    assert stats["containers"] == 2 and len(stats["malformed"]) == 1
    assert bytes(blob[len(good):]) == before


def _elf(sections: list[tuple[str, int, int, bytes, int]]) -> bytes:
    """A minimal ELF64 file: (name, type, flags, data, link) per section after the null one."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n, *_ in sections) + b".shstrtab\0"
    body, offsets, off = b"", [], 64
    for _n, _t, _f, data, _l in sections:
        offsets.append(off)
        body += data
        off += len(data)
    shstr_off = off
    body += names
    off += len(names)
    shoff = off + (-off % 8)
    body += bytes(shoff - off)
    shdrs = bytes(64)
    name_at = 1
    for (n, t, f, data, link), o in zip(sections, offsets):
        shdrs += struct.pack("<IIQQQQIIQQ", name_at, t, f, 0, o, len(data), link, 0, 1, 0)
        name_at += len(n) + 1
    shdrs += struct.pack("<IIQQQQIIQQ", name_at, 3, 0, 0, shstr_off, len(names), 0, 0, 1, 0)
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header = ident + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64,
                                 len(sections) + 2, len(sections) + 1)
    return header + body + shdrs


def test_a_shared_object_is_slimmed_in_place(tmp_path):
    fat, payloads = _h100_like(3)
    dynstr = b"\0libfoo.so\0keep_me\0"
    symtab = _payload(48, 5)
    strtab = b"\0static_symbol_name\0"
    so = tmp_path / "libfake.so.2"
    so.write_bytes(_elf([(".nv_fatbin", 1, 2, fat, 0), (".dynstr", 3, 2, dynstr, 0),
                         (".symtab", 2, 0, symtab, 4), (".strtab", 3, 0, strtab, 0)]))
    size = so.stat().st_size
    r = gp.slim_shared_object(so)
    data = so.read_bytes()
    assert len(data) == size
    assert r["fatbin"]["zeroed"] == 4 and r["fatbin"]["kept"] == 2
    assert r["symbols"]["sections"] == [".symtab", ".strtab"]
    assert r["symbols"]["zeroed_bytes"] == len(symtab) + len(strtab)
    assert symtab not in data and b"static_symbol_name" not in data
    assert dynstr in data  # loaded at run time: untouched
    assert payloads["sm_90"] in data and payloads["compute_90"] in data and payloads["sm_80"] not in data
    assert [s.name for s in gp.elf_sections(data)][1:] == [".nv_fatbin", ".dynstr", ".symtab", ".strtab", ".shstrtab"]
    plain = tmp_path / "notes.txt"
    plain.write_text("not ELF")
    assert gp.slim_shared_object(plain) is None


def test_tensorflow_requirements_come_from_the_wheels_metadata(tmp_path):
    whl = tmp_path / "tensorflow-2.21.0-cp312-cp312-manylinux_2_27_x86_64.whl"
    meta = ("Metadata-Version: 2.1\nName: tensorflow\nVersion: 2.21.0\n"
            "Requires-Dist: absl-py>=1.0.0\nRequires-Dist: protobuf<8.0.0,>=6.31.1\n"
            "Requires-Dist: ml_dtypes<1.0.0,>=0.5.1\n"
            'Requires-Dist: nvidia-cuda-runtime-cu12<13.0,>=12.5.82; extra == "and-cuda"\n'
            'Requires-Dist: tensorflow-io-gcs-filesystem>=0.23.1; extra == "gcs-filesystem"\n')
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("tensorflow-2.21.0.dist-info/METADATA", meta)
    reqs = gp.tf_requirements(whl)
    assert reqs["protobuf"] == "<8.0.0,>=6.31.1" and reqs["ml-dtypes"] == "<1.0.0,>=0.5.1"
    assert reqs["nvidia-cuda-runtime-cu12"] == "<13.0,>=12.5.82"
    assert "tensorflow-io-gcs-filesystem" not in reqs


# -- the payload and its bootstrap ------------------------------------------------------------------
def _wheel(dest: Path) -> Path:
    whl = dest / "fakewheel-1.0-py3-none-any.whl"
    files = {"fakewheel/__init__.py": "VALUE = 42\n",
             "fakewheel-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: fakewheel\nVersion: 1.0\n",
             "fakewheel-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},,\n" for n in files) + "fakewheel-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(whl, "w") as z:
        for n, text in files.items():
            z.writestr(n, text)
        z.writestr("fakewheel-1.0.dist-info/RECORD", record)
    return whl


def _stage(tmp_path: Path) -> Path:
    stage = tmp_path / "stage"
    for sub in ("site/fakepkg", "wheels", "debs", "data"):
        (stage / sub).mkdir(parents=True)
    (stage / "site/fakepkg/__init__.py").write_text("NAME = 'fakepkg'\n")
    (stage / "site/fakepkg/blob.bin").write_bytes(os.urandom(300_000))  # incompressible: several parts
    _wheel(stage / "wheels")
    (stage / "data/mnist_5k.csv.gz").write_bytes(b"not really mnist")
    if shutil.which("dpkg-deb"):
        pkg = tmp_path / "debsrc"
        (pkg / "DEBIAN").mkdir(parents=True)
        (pkg / "usr/lib/fake").mkdir(parents=True)
        (pkg / "usr/lib/fake/libfake.txt").write_text("from a .deb\n")
        (pkg / "DEBIAN/control").write_text("Package: fake\nVersion: 1.0\nArchitecture: all\n"
                                            "Maintainer: test <t@example.org>\nDescription: test\n")
        subprocess.run(["dpkg-deb", "-b", str(pkg), str(stage / "debs/fake_1.0_all.deb")], check=True,
                       capture_output=True)
    return stage


def _bootstrap_env(tmp_path: Path) -> dict[str, str]:
    torch = tmp_path / "torch"
    (torch / "nvidia/cu13/lib").mkdir(parents=True)
    (torch / "nvidia/cudnn/lib").mkdir(parents=True)
    for lib in ("libcublas.so.13", "libcublasLt.so.13", "libcufft.so.12", "libcusolver.so.12",
                "libnvJitLink.so.13", "libcupti.so.13"):
        (torch / "nvidia/cu13/lib" / lib).write_text("stand-in")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.update({
        "GPU_TUNE_PAYLOAD_DIR": str(tmp_path / "there/payload"), "GPU_TUNE_SITE": str(tmp_path / "there/site"),
        "GPU_TUNE_ENV_FILE": str(tmp_path / "there/env.sh"), "GPU_TUNE_DATA_DIR": str(tmp_path / "there/data"),
        "GPU_TUNE_DEB_ROOT": str(tmp_path / "there/root"), "GPU_TUNE_SHIM_DIR": str(tmp_path / "there/shim"),
        "GPU_TUNE_TORCH_SITE": str(torch), "GPU_TUNE_CUDA_DIR": "/opt/cuda-test", "HOME": str(tmp_path / "home"),
        "PYTHON": sys.executable,
    })
    (tmp_path / "there/root").mkdir(parents=True)
    return env


def _call(tmp_path: Path, parts_dir: Path, folder: str | None, env: dict[str, str], *args: str):
    """One call to the GPU machine: a fresh copy of the repository with one part folder carried."""
    repo = tmp_path / "call"
    if repo.exists():
        shutil.rmtree(repo)
    (repo / ".gpu-payload").mkdir(parents=True)
    if folder:
        shutil.copytree(parts_dir / folder, repo / ".gpu-payload" / folder)
    return subprocess.run(["bash", str(TOOLS / "gpu_bootstrap.sh"), *args], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_payload_travels_in_parts_and_the_bootstrap_puts_it_together(tmp_path):
    stage = _stage(tmp_path)
    out = tmp_path / "payload"
    m = gp.pack(stage, out, xz_threads=1, xz_level=1, part_bytes=100_000,
                extra={"commit": "abc123", "check_imports": ["fakepkg", "fakewheel"]})
    parts = m["parts"]
    assert len(parts) >= 3 and [p["folder"] for p in parts] == [f"p{k}" for k in range(len(parts))]
    whole = hashlib.sha256()
    for p in parts:
        folder = out / p["folder"]
        assert sorted(f.name for f in folder.iterdir()) == sorted([p["name"], "manifest.json"])
        data = (folder / p["name"]).read_bytes()
        assert len(data) == p["bytes"] <= 100_000 and hashlib.sha256(data).hexdigest() == p["sha256"]
        assert json.loads((folder / "manifest.json").read_text()) == m
        whole.update(data)
    assert whole.hexdigest() == m["archive"]["sha256"] and m["payload_id"] == m["archive"]["sha256"][:16]
    assert not (out / ".work" / gp.ARCHIVE).exists()  # the parts are the archive

    env = _bootstrap_env(tmp_path)
    there = tmp_path / "there"
    # without any part, nothing to do: a clear error
    r = _call(tmp_path, out, None, env)
    assert r.returncode == 2 and "carry .gpu-payload/p0 first" in r.stderr
    for k, p in enumerate(parts[:-1]):
        r = _call(tmp_path, out, p["folder"], env)
        assert r.returncode == 0, r.stderr
        assert f"part {p['name']} arrived" in r.stdout and f"{k + 1} of {len(parts)} parts here" in r.stdout
        assert not (there / "site").exists()
    # asked to be complete with the last part still missing: exit 3, naming it
    r = _call(tmp_path, out, None, env, "--require-complete")
    assert r.returncode == 3 and parts[-1]["folder"] in r.stderr
    r = _call(tmp_path, out, parts[-1]["folder"], env, "--require-complete")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout
    assert f"all {len(parts)} parts here" in lines and "sha256 ok" in lines and "every sha256 ok" in lines
    assert "check: imported fakepkg, fakewheel" in lines
    assert (there / "site/fakepkg/blob.bin").read_bytes() == (stage / "site/fakepkg/blob.bin").read_bytes()
    assert (there / "site/fakewheel/__init__.py").exists()
    assert (there / "data/mnist_5k.csv.gz").read_bytes() == b"not really mnist"
    assert (tmp_path / "home/.keras/datasets/mnist_5k.csv.gz").exists()
    if shutil.which("dpkg-deb"):
        assert (there / "root/usr/lib/fake/libfake.txt").read_text() == "from a .deb\n"
    shim = there / "shim"
    assert os.readlink(shim / "libcublas.so.12") == str(tmp_path / "torch/nvidia/cu13/lib/libcublas.so.13")
    assert os.readlink(shim / "libcufft.so.11").endswith("cu13/lib/libcufft.so.12")
    assert sorted(p.name for p in shim.iterdir()) == ["libcublas.so.12", "libcublasLt.so.12", "libcufft.so.11",
                                                    "libcupti.so.12", "libcusolver.so.11", "libnvJitLink.so.12"]
    env_text = (there / "env.sh").read_text()
    assert f"export PYTHONPATH={there / 'site'}" in env_text
    assert f"export LD_LIBRARY_PATH={there / 'site'}/nvidia/cuda_runtime/lib:{shim}:" in env_text
    assert "export XLA_FLAGS=--xla_gpu_cuda_data_dir=/opt/cuda-test" in env_text
    assert "export GPU_TUNE_COMMIT=abc123" in env_text
    assert f"export GPU_TUNE_DATA={there / 'data/mnist_5k.csv.gz'}" in env_text
    assert f"export GPU_TUNE_SITE_DIR={there / 'site'}" in env_text
    # the environment file works: the installed package imports from any folder
    sourced = subprocess.run(["bash", "-c", f". {there / 'env.sh'} && cd / && {sys.executable} -c "
                              "'import fakewheel; print(fakewheel.VALUE)'"], capture_output=True, text=True, env=env)
    assert sourced.stdout.strip() == "42", sourced.stderr

    # again, with the last part still carried: nothing is redone
    r = _call(tmp_path, out, parts[-1]["folder"], env, "--require-complete")
    assert r.returncode == 0 and "already installed" in r.stdout and "extracted" not in r.stdout

    # a part damaged on the way is refused, naming it
    (out / "p1" / parts[1]["name"]).write_bytes(b"broken")
    env2 = dict(env, GPU_TUNE_PAYLOAD_DIR=str(tmp_path / "other"))
    r = _call(tmp_path, out, "p1", env2)
    assert r.returncode == 4 and parts[1]["name"] in r.stderr and "sha256" in r.stderr


def test_pytorch_runs_without_what_the_bootstrap_put_first_for_tensorflow(monkeypatch):
    monkeypatch.setenv("GPU_TUNE_SITE_DIR", "/tmp/site")
    monkeypatch.setenv("GPU_TUNE_LD_ADDED", "/tmp/site/nvidia/cuda_runtime/lib:/tmp/shim:/t/cu13/lib")
    monkeypatch.setenv("PYTHONPATH", "/tmp/site:/extra")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/tmp/site/nvidia/cuda_runtime/lib:/tmp/shim:/t/cu13/lib:/usr/local/nvidia/lib64")
    env = proof.torch_env()
    assert env == {"PYTHONPATH": f"{ROOT}:/extra", "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64"}


def _ctx(tmp_path: Path, device: str = "gpu", seconds: float = 120) -> dict:
    import time

    return {"device": device, "work": str(tmp_path), "env": {}, "gpu_tune": [sys.executable, "-m", "gpu_tune"],
            "deadline": time.time() + seconds, "data": None}


def test_the_real_host_check_compares_each_journalled_file_with_what_it_held_before(tmp_path, monkeypatch):
    """The tuning step as on a GPU machine (only the files the journal names, read before apply
    through the real host's globs), here on a fixture tree instead of /."""
    from tests.fixtures import hostgen

    root = hostgen.build("vm-virtio-2node", tmp_path / "root")
    fixture = tmp_path / "gpus.json"
    shutil.copyfile(ROOT / "tests/fixtures/gpu/vm-virtio-2node.json", fixture)
    host = {"root": str(root), "args": ["--root", str(root), "--gpu-backend", "fixture", "--gpu-fixture", str(fixture)],
            "fixture": str(fixture), "real": True}
    # the step looks the host up where it lives (tools/proof/host_steps.py): a fixture tree, never /
    monkeypatch.setattr(sys.modules["proof.host_steps"], "host_for", lambda ctx, kind: host)
    res = proof.step_tuning(_ctx(tmp_path), proof.Runner(_ctx(tmp_path)))
    d = res["data"]
    assert res["status"] == "passed", res["reason"]
    assert d["byte_exact"] and d["fixture_tree_files"] is None and d["journal_files"] == 24
    assert d["journal_files_absent_before"] == 1 and d["compared_with_snapshot"] == 23
    assert {f["path"] for f in d["files"]} >= {"/proc/sys/vm/swappiness", "/sys/kernel/mm/transparent_hugepage/enabled",
                                              "/etc/gpu-tune/allocator.env"}
    # a file left changed after revert is named
    (root / "proc/sys/vm/swappiness").write_text("60\n")
    real_revert = proof.Runner.gpu_tune

    def revert_then_break(self, *args, **kw):
        out = real_revert(self, *args, **kw)
        if args[0] == "revert":
            (root / "proc/sys/vm/swappiness").write_text("1\n")
        return out

    monkeypatch.setattr(proof.Runner, "gpu_tune", revert_then_break)
    res = proof.step_tuning(_ctx(tmp_path), proof.Runner(_ctx(tmp_path)))
    assert res["status"] == "failed" and "/proc/sys/vm/swappiness" in res["reason"]
    assert res["data"]["byte_exact"] is False


def test_every_command_of_a_step_is_bounded(tmp_path):
    import time

    t0 = time.monotonic()
    r = proof.Runner(_ctx(tmp_path, seconds=900)).run(["sleep", "600"], timeout=1)
    assert r["timed_out"] and r["rc"] is None and time.monotonic() - t0 < 60  # stopped, not waited for
    assert "time limit" in proof.why(r)


# -- the report ----------------------------------------------------------------------------------
def _report(steps: dict, started: str, commit: str = "c1") -> dict:
    return {"format": 1, "device": "gpu", "commit": {"commit": commit}, "machine": {},
            "runs": [{"started": started, "steps": list(steps), "seconds": 1.0}], "steps": steps}


PROBE_STEP = {"status": "passed", "summary": "p", "seconds": 50.0, "data": {"results": [{
    "gpu": "0", "status": "passed", "accuracy": 0.949, "fingerprint": "abcd", "time_to_verdict_seconds": 41.0,
    "timings": {"tensorflow_import_seconds": 11.0}, "peer_group": "H100",
    "regimes": {"launch_bound": {"batch_size": 256, "images_per_second": 270000.0, "gpu_busy_fraction": 0.34,
                                 "gpu_samples": 20, "steps": 2000, "precision": "bfloat16", "xla": True},
                "device_bound": {"batch_size": 4096, "images_per_second": 900000.0, "gpu_busy_fraction": 0.93,
                                 "gpu_samples": 20, "steps": 400, "precision": "bfloat16", "xla": True}}}]}}


def test_partial_reports_merge_into_one():
    a = _report({"environment": {"status": "passed", "summary": "H100", "seconds": 10},
                 "probe": PROBE_STEP,
                 "fingerprint": {"status": "not_run", "reason": "not started: budget"}}, "t1")
    b = _report({"fingerprint": {"status": "passed", "summary": "all equal", "seconds": 300,
                                 "data": {"all_equal": True, "runs": [
                                     {"run": 1, "load": "idle", "busy_loops": 0, "loadavg_before": [0.1],
                                      "gpus": [{"gpu": "0", "fingerprint": "abcd", "accuracy": 0.949,
                                                "time_to_verdict_seconds": 40}]}]}},
                 "torch": {"status": "passed", "summary": "torch", "seconds": 20,
                           "data": {"images_per_second": 800000.0, "batch_size": 4096, "gpu_busy_fraction": 0.95,
                                    "precision": "bfloat16 autocast", "torch": "2.11.0"}}}, "t2", commit="c2")
    m = proof.merge_reports([a, b])
    assert list(m["steps"]) == ["environment", "probe", "torch", "fingerprint"]
    assert m["steps"]["fingerprint"]["status"] == "passed"  # ran in b, not_run in a
    assert [r["started"] for r in m["runs"]] == ["t1", "t2"] and m["commits_differ"] == ["c1", "c2"]
    ratio = proof.device_bound_ratio(m)
    assert ratio["ratio"] == pytest.approx(900000 / 800000, abs=1e-3)
    md = proof.render_markdown(m)
    assert "| step | status | what it showed | seconds |" in md
    assert "| fingerprint | passed | all equal | 300 |" in md
    assert "| 0 | device-bound | 4096 | 900,000 | 93% (20 samples) | 400 | bfloat16, XLA on |" in md
    assert "TensorFlow probe / PyTorch eager: **1.125x**" in md
    assert "All fingerprints equal: **yes**" in md
    # a step that ran nowhere stays not_run, shown in bold
    c = proof.merge_reports([_report({"gain": {"status": "not_run", "reason": "not started"}}, "t3")])
    assert c["steps"]["gain"]["status"] == "not_run" and "| gain | **not_run** |" in proof.render_markdown(c)


def _proof(tmp_path: Path, *args: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(TOOLS / "gpu_proof.py"), "--out", str(out), *args],
                       capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    return p, json.loads((out / "report.json").read_text())


def test_a_failing_step_is_recorded_and_the_rest_goes_on_and_the_budget_holds(tmp_path):
    p, rep = _proof(tmp_path, "--device", "cpu", "--steps", "topology,probe,gain", "--data", str(tmp_path / "absent"),
                    "--budget", "30", "--mirror", str(tmp_path / "mirror"))
    steps = rep["steps"]
    assert steps["topology"]["status"] == "passed"
    assert steps["probe"]["status"] == "failed" and "no such file or folder" in steps["probe"]["reason"]
    assert steps["gain"]["status"] == "not_run" and "--steps gain" in steps["gain"]["reason"]
    assert p.returncode == 1
    assert "== probe: failed" in p.stdout and "== gain: not_run" in p.stdout
    log = (tmp_path / "out/proof.log").read_text()
    assert "== topology: passed" in log
    md = (tmp_path / "out/report.md").read_text()
    assert "| probe | **failed** |" in md
    for f in ("report.json", "report.md", "proof.log"):  # --mirror: a copy after every step
        assert (tmp_path / "mirror" / f).read_bytes() == (tmp_path / "out" / f).read_bytes()


def test_a_step_out_of_time_is_stopped_and_leaves_no_process_behind(tmp_path):
    """The probe's workload runs in a session of its own; when its step runs out of time, the
    workload dies with the gpu-tune process that started it (PR_SET_PDEATHSIG), and whatever
    else would be left comes to the proof (the subreaper), which stops it: nothing stays."""
    p, rep = _proof(tmp_path, "--device", "cpu", "--steps", "fingerprint", "--limit", "fingerprint=6")
    fp = rep["steps"]["fingerprint"]
    assert fp["status"] == "failed" and "gave no result" in fp["reason"]  # stopped at its limit
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path) not in ps


# -- the whole proof on the CPU -----------------------------------------------------------------
@pytest.mark.slow
def test_the_whole_proof_runs_on_the_cpu(tmp_path):
    p, rep = _proof(tmp_path, "--device", "cpu", "--fingerprint-runs", "2", "--gain-pairs", "3", "--gain-window", "0.3",
                    "--serve-requests", "200", "--serve-probe-wait", "120", "--torch-seconds", "1", "--budget", "900",
                    "--verdict-runs", "3",
                    timeout=1200)
    steps = rep["steps"]
    assert list(steps) == list(proof.STEPS)
    assert rep["device"] == "cpu" and rep["commit"].get("commit")
    bad = {k: (v["status"], v.get("reason")) for k, v in steps.items() if v["status"] not in ("passed", "skipped")}
    assert not bad, bad
    assert p.returncode == 0, p.stdout[-3000:]

    env = steps["environment"]["data"]
    assert env["tensorflow"]["version"] and env["gpu_tune"]["version"]
    assert steps["topology"]["data"]["topology"]["gpus"]  # the fixture's H100

    tuning = steps["tuning"]["data"]
    assert tuning["byte_exact"] is True and tuning["journal_files"] > 10 and not tuning["mismatches"]
    assert tuning["fixture_tree_files"] > 100 and tuning["fixture_tree_differs"] == []
    assert tuning["apply"]["changed"] > 0 and tuning["audit_after_apply"]["compliant"] is True
    assert tuning["revert"]["restored"] is True and tuning["audit_after_revert"]["differs_from_before"] == []
    assert tuning["persistence_mode"] == {"before": {"0": False}, "after_apply": {"0": True},
                                          "after_revert": {"0": False}}

    [row] = steps["probe"]["data"]["results"]
    assert row["status"] == "passed" and row["accuracy"] >= 0.9 and len(row["fingerprint"]) == 16
    assert set(row["regimes"]) == {"launch_bound", "device_bound"}
    assert all(w["images_per_second"] > 0 for w in row["regimes"].values())
    assert row["time_to_verdict_seconds"] > 0
    # the CPU run says why it measured no data path, and the step says so too
    assert row["bandwidth"] == {"status": "not_measured", "reason": "no GPU: bandwidth not measured"}
    assert "data path: no GPU: bandwidth not measured" in steps["probe"]["summary"]

    vd = steps["verdict"]["data"]
    assert [(r["cache"], r["load"]) for r in vd["runs"]] == [("cold", "idle"), ("warm", "idle"), ("none", "idle")]
    assert vd["all_equal"] is True and vd["fingerprints"] == {"cpu": [row["fingerprint"]]}
    assert all(g["compile_cache"] == "off" for r in vd["runs"] for g in r["gpus"])  # XLA is off on a CPU
    assert vd["time_to_verdict"]["cold_idle"] > 0 and vd["time_to_verdict"]["warm_busy"] is None

    fp = steps["fingerprint"]["data"]
    assert fp["all_equal"] is True
    assert [r["load"] for r in fp["runs"]] == ["idle", "busy", "idle", "busy"]
    assert all(r["busy_loops"] == os.cpu_count() for r in fp["runs"] if r["load"] == "busy")
    assert fp["fingerprints"] == {"cpu": [row["fingerprint"]]}  # the probe step's too

    gain = steps["gain"]["data"]
    assert gain["host_left_as_asked"] is True and gain["pairs"] == 3 and gain["fixture_tree_differs"] == []
    assert gain["targets"][0]["pairs_complete"] == 3 and gain["verdict"] in ("gain", "loss", "no significant difference",
                                                                            "inconclusive")

    serve = steps["serve"]["data"]
    assert serve["first_readiness"]["status"] in (200, 503) and serve["requests"]["errors"] == 0
    assert serve["requests"]["count"] == 200 and serve["sigterm"]["exit_code"] == 0
    assert all(v["VmRSS"] > 10 for v in serve["rss_mib"].values()) and len(serve["rss_mib"]) == 3
    assert serve["first_probe_seconds"] and serve["probe"][0]["status"] == "passed"

    torch = steps["torch"]
    if torch["status"] == "skipped":
        assert "PyTorch is not importable" in torch["reason"]
    else:
        assert torch["data"]["images_per_second"] > 0 and rep["device_bound_vs_pytorch"]["ratio"] > 0

    md = (tmp_path / "out/report.md").read_text()
    for name in proof.STEPS:
        assert f"| {name} | " in md
    assert "All fingerprints equal: **yes**" in md and "byte-exact **True**" in md
    assert "All fingerprints equal with and without the cache: **yes**" in md
