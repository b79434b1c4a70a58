"""Does TensorFlow's GPU path find every library it needs here, with nothing but the driver missing?

    python tools/gpu_libs.py [--import-check] [-o json]

Run inside the GPU image (the image test mounts it there), on a machine without an NVIDIA driver.
The list of libraries comes from TensorFlow itself, not from memory:

1. **Its loader's own entry points.** ``libtensorflow_framework.so.2`` exports one
   ``tsl::internal::DsoLoader::Get<Name>DsoHandle()`` per library TensorFlow dlopens (read from the
   ELF's dynamic symbol table). Each CUDA one is *called*, so the library is found the way
   TensorFlow finds it (its soname, its RUNPATH into the ``nvidia/*/lib`` wheels) and loaded with
   every symbol resolved (TensorFlow dlopens with ``RTLD_NOW``); the files each call maps are read
   from ``/proc/self/maps``. The driver's (``CudaDriver``, ``Nvml``) must be the only ones missing;
   TensorRT and NVSHMEM are reported, not required (TensorFlow's ``and-cuda`` extra does not ship
   them and ``is_tensorrt_build`` says so).
2. **The wheels it declares.** Every ``nvidia-*`` distribution in TensorFlow's
   ``Requires-Dist: ...; extra == "and-cuda"``: installed, at a version the specifier allows, and
   every shared library in it loads (``RTLD_NOW``) or fails only for want of the driver
   (``libcuda.so.1``, ``libnvidia-ml.so.1``): cuDNN's sub-libraries, NVRTC, cuRAND, nvJitLink and
   the rest. ``ptxas`` and ``libdevice`` (XLA's GPU compiler) are there and run.
3. **The build's versions.** ``build_info``'s CUDA (major.minor) and cuDNN (major) agree with the
   installed runtime and cuDNN wheels.
4. With ``--import-check``: ``import tensorflow`` in a fresh process lists no GPU, says why (no
   driver), and never "Cannot dlopen some GPU libraries".

Exit 0 when all hold, 1 with each problem on a line (and in the JSON with ``-o json``).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata as md
import importlib.util
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

DRIVER_LIBS = ("libcuda.so.1", "libnvidia-ml.so.1", "libcuda.so")
DRIVER_GETTERS = ("CudaDriver", "Nvml")
OPTIONAL_GETTERS = {"NvInfer": "TensorRT: not among TensorFlow's and-cuda wheels (is_tensorrt_build: False)",
                    "NvInferPlugin": "TensorRT: not among TensorFlow's and-cuda wheels (is_tensorrt_build: False)",
                    "Nvshmem": "NVSHMEM: not among TensorFlow's and-cuda wheels"}
ROCM = re.compile(r"^(Hip|Roc|Miopen)")
# The order TensorFlow opens them in when it finds a driver (tsl's MaybeTryDlopenGPULibraries), then
# the ones it opens on demand. The order matters: CUPTI, once loaded, wraps dlopen, and a library
# searched for after it is no longer found through TensorFlow's RUNPATH.
STARTUP_ORDER = ("CudaDriver", "CudaRuntime", "Cublas", "CublasLt", "Cufft", "Cusolver", "Cusparse", "Cudnn")
GETTER = re.compile(r"^_ZN3tsl8internal9DsoLoader\d+Get([A-Za-z]+)DsoHandleEv$")


def dynamic_symbols(path: str) -> list[str]:
    """Names in an ELF64 little-endian file's .dynsym (no binutils needed)."""
    with open(path, "rb") as fh:
        data = fh.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for s in sections:
        if s[1] != 11:  # SHT_DYNSYM
            continue
        strtab = sections[s[6]]
        str_off = strtab[4]
        for off in range(s[4], s[4] + s[5], s[9] or 24):
            name_off, = struct.unpack_from("<I", data, off)
            end = data.index(b"\0", str_off + name_off)
            names.append(data[str_off + name_off:end].decode("ascii", "replace"))
    return names


def mapped_files() -> set[str]:
    with open("/proc/self/maps", encoding="ascii", errors="replace") as fh:
        return {line.split(None, 5)[5].strip() for line in fh if len(line.split(None, 5)) == 6 and ".so" in line}


def call_getter(lib: ctypes.CDLL, symbol: str) -> tuple[bool, str]:
    """Call ``absl::StatusOr<void*> Get...DsoHandle()``: returned through a hidden pointer (a class
    with a destructor), ``{uintptr_t status_rep; void* value}``. An OK status is rep 1 (Abseil's
    inlined OK code); an error with a message points to its StatusRep
    ``{int32 ref; int32 code; std::string message}`` (libstdc++: pointer, length)."""
    fn = getattr(lib, symbol)
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_void_p]
    buf = (ctypes.c_uint64 * 4)()
    fn(ctypes.addressof(buf))
    rep = buf[0]
    if rep == 1:
        return buf[1] != 0, ""
    if rep & 1:  # an inlined code without a message
        return False, f"status code {rep >> 2}"
    ptr, size = ctypes.c_uint64.from_address(rep + 8).value, ctypes.c_uint64.from_address(rep + 16).value
    return False, ctypes.string_at(ptr, min(size, 400)).decode("utf-8", "replace")


def driver_only(error: str) -> bool:
    return any(d in error for d in DRIVER_LIBS)


def tensorflow_dir() -> Path:
    spec = importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("tensorflow is not installed here")
    return Path(list(spec.submodule_search_locations)[0])


def build_info(tf_dir: Path) -> dict:
    """TensorFlow's build_info module, loaded by path (no TensorFlow import)."""
    spec = importlib.util.spec_from_file_location("tf_build_info", tf_dir / "python" / "platform" / "build_info.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return dict(mod.build_info)


def and_cuda_requirements() -> list:
    from packaging.requirements import Requirement

    dist = next((d for d in ("tensorflow", "tensorflow-cpu") if _version(d)), None)
    reqs = []
    for line in (md.requires(dist) or []) if dist else []:
        r = Requirement(line)
        if r.marker is not None and r.marker.evaluate({"extra": "and-cuda"}) and not r.marker.evaluate({"extra": ""}):
            reqs.append(r)
    return reqs


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def check(import_check: bool) -> dict:
    problems: list[str] = []
    tf_dir = tensorflow_dir()
    info = build_info(tf_dir)
    framework = tf_dir / "libtensorflow_framework.so.2"
    found = {m.group(1): s for s in dynamic_symbols(str(framework)) if (m := GETTER.match(s))}
    getters = [(n, found[n]) for n in STARTUP_ORDER if n in found] + sorted(
        (n, s) for n, s in found.items() if n not in STARTUP_ORDER)
    lib = ctypes.CDLL(str(framework), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    loaded: dict[str, dict] = {}
    for name, symbol in getters:
        if ROCM.match(name):
            continue
        before = mapped_files()
        ok, error = call_getter(lib, symbol)
        files = sorted(f for f in mapped_files() - before if "/tensorflow/" not in f)
        row = {"loaded": ok, "files": [os.path.basename(f) for f in files], **({"error": error} if error else {})}
        if name in DRIVER_GETTERS:
            row["expected"] = "the driver's: missing without a driver"
            if ok:
                row["note"] = "a driver library is present in the image"
        elif name in OPTIONAL_GETTERS:
            row["expected"] = OPTIONAL_GETTERS[name]
        elif not ok:
            problems.append(f"TensorFlow's loader cannot open its {name} library: {error}")
        loaded[name] = row

    wheels: dict[str, dict] = {}
    from packaging.version import Version

    reqs = and_cuda_requirements()
    if not reqs:
        problems.append("TensorFlow declares no and-cuda wheels here: not the GPU build")
    for r in reqs:
        v = _version(r.name)
        row: dict = {"required": str(r.specifier), "installed": v, "libraries": {}}
        wheels[r.name] = row
        if v is None:
            problems.append(f"{r.name} ({r.specifier}): not installed")
            continue
        if not r.specifier.contains(Version(v), prereleases=True):
            problems.append(f"{r.name} {v}: outside what TensorFlow asks for ({r.specifier})")
        for f in md.files(r.name) or []:
            if not re.search(r"\.so(\.\d+)*$", f.name):
                continue
            path = str(f.locate())
            try:
                ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
                row["libraries"][f.name] = "loads"
            except OSError as exc:
                msg = str(exc)
                if driver_only(msg):
                    row["libraries"][f.name] = "needs the driver only"
                else:
                    row["libraries"][f.name] = f"fails: {msg}"
                    problems.append(f"{f.name} ({r.name}): {msg}")
        if r.name == "nvidia-cuda-nvcc-cu12":
            site = Path(str(md.distribution(r.name).locate_file("")))
            ptxas = site / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"
            libdevice = sorted((site / "nvidia" / "cuda_nvcc").glob("nvvm/libdevice/libdevice*.bc"))
            try:
                out = subprocess.run([str(ptxas), "--version"], capture_output=True, text=True, timeout=30)
                row["ptxas"] = (out.stdout.strip().splitlines() or ["?"])[-1] if out.returncode == 0 else f"exit {out.returncode}"
                if out.returncode != 0:
                    problems.append(f"ptxas --version exits {out.returncode}")
            except OSError as exc:
                row["ptxas"] = str(exc)
                problems.append(f"ptxas: {exc} (XLA's GPU compiler needs it)")
            row["libdevice"] = [p.name for p in libdevice]
            if not libdevice:
                problems.append("libdevice*.bc is missing (XLA's GPU compiler needs it)")

    cuda_build, cudnn_build = str(info.get("cuda_version") or ""), str(info.get("cudnn_version") or "")
    runtime, cudnn = _version("nvidia-cuda-runtime-cu12"), _version("nvidia-cudnn-cu12")
    versions = {"build_cuda": cuda_build, "build_cudnn": cudnn_build, "cuda_runtime_wheel": runtime,
                "cudnn_wheel": cudnn, "compute_capabilities": info.get("cuda_compute_capabilities")}
    if runtime and cuda_build.split(".")[:2] != runtime.split(".")[:2]:
        problems.append(f"TensorFlow was built for CUDA {cuda_build}, the runtime wheel is {runtime}")
    if cudnn and cudnn_build.split(".")[:1] != cudnn.split(".")[:1]:
        problems.append(f"TensorFlow was built for cuDNN {cudnn_build}, the cuDNN wheel is {cudnn}")

    doc = {"tensorflow": _version("tensorflow"), "build_info": info, "loader": loaded, "wheels": wheels,
           "versions": versions}
    if import_check:
        doc["import"] = import_without_driver()
        problems += doc["import"]["problems"]
    doc["problems"] = problems
    doc["ok"] = not problems
    return doc


def import_without_driver() -> dict:
    """A fresh ``import tensorflow``: no GPU listed, for want of the driver alone."""
    code = ("import tensorflow as tf, json; "
            "print(json.dumps([d.name for d in tf.config.list_physical_devices('GPU')]))")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_MAX_VLOG_LEVEL": "0"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    problems = []
    gpus = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 and p.stdout.strip() else None
    if p.returncode != 0:
        problems.append(f"import tensorflow failed: {p.stderr.strip().splitlines()[-1:] or p.returncode}")
    if "Cannot dlopen some GPU libraries" in p.stderr:
        problems.append("TensorFlow says: Cannot dlopen some GPU libraries")
    why = [ln for ln in p.stderr.splitlines()
           if re.search(r"cuda drivers|cuInit|libcuda|CUDA driver", ln, re.IGNORECASE)]
    if gpus:
        problems.append(f"TensorFlow lists GPUs without a driver: {gpus}")
    if p.returncode == 0 and not why:
        problems.append("TensorFlow lists no GPU but does not say the driver is missing")
    return {"gpus": gpus, "why": [ln.strip()[-200:] for ln in why][:3], "problems": problems}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--import-check", action="store_true", help="also import TensorFlow: no GPU, for the driver's sake alone")
    ap.add_argument("-o", "--output", choices=("text", "json"), default="text")
    a = ap.parse_args(argv)
    doc = check(a.import_check)
    if a.output == "json":
        print(json.dumps(doc, indent=1))
    else:
        for name, row in doc["loader"].items():
            state = "loaded" if row["loaded"] else "missing"
            print(f"loader {name:<14} {state:<8} {' '.join(row['files']) or '-'}  {row.get('expected', '')}")
        for name, row in doc["wheels"].items():
            libs = row["libraries"]
            print(f"wheel  {name:<26} {row['installed']} ({row['required']}): {len(libs)} libraries, "
                  f"{sum(v == 'loads' for v in libs.values())} load, "
                  f"{sum(v == 'needs the driver only' for v in libs.values())} need the driver only")
        print("versions", json.dumps(doc["versions"]))
        if "import" in doc:
            print("import  ", json.dumps({k: v for k, v in doc["import"].items() if k != "problems"}))
        for p in doc["problems"]:
            print(f"PROBLEM: {p}")
        print("ok" if doc["ok"] else "NOT OK")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
