"""The GPU image GPU nodes pull, built from the same Dockerfile (FLAVOUR=gpu) and checked without a
GPU: every library TensorFlow's GPU path opens is there and loads (tools/gpu_libs.py, run inside
it), its CUDA and cuDNN are the ones TensorFlow was built for, without a driver TensorFlow lists no
GPU for that reason alone, the image fits its size goals, and the agent's commands start in it as
in the CPU image. Skipped without root or podman (without podman failed under make test and CI), like
tests/test_image.py. The first, cold build takes minutes (figures in docs/deploy.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.test_image import ROOT, need_podman, ti, venv_gpu_tune

pytestmark = pytest.mark.slow

TAG = "localhost/gpu-tune:test-gpu"
CHECK = ROOT / "tools" / "gpu_libs.py"
SITE = "/opt/venv/lib/python3.11/site-packages"
GB = 1000 ** 3
GOALS = {"gpu": (6 * GB, 3 * GB), "cpu": (int(1.2 * GB), None)}  # unpacked, compressed
CODE_CHANGE_GOAL = 10 * 1000 ** 2
# TensorFlow's loader entry points that must open a library here (tools/gpu_libs.py finds them in
# libtensorflow_framework.so.2; these are the CUDA ones TensorFlow 2.21 exports).
MUST_LOAD = ("CudaRuntime", "Cublas", "CublasLt", "Cufft", "Cusolver", "Cusparse", "Cudnn", "Nccl", "Cupti")


@pytest.fixture(scope="module")
def gpu_image(tmp_path_factory) -> str:
    need_podman()
    log = tmp_path_factory.mktemp("build") / "build.log"
    base = ti.choose_base(os.environ.get("PYTHON_IMAGE") or None)
    took = ti.build(ROOT, "gpu", TAG, base, log)
    print(f"\nGPU image built in {took:.0f} s ({TAG}, base {base})")
    return TAG


def in_image(image: str, *args: str, entrypoint: str = "python", shell: str | None = None,
             timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [*ti.PODMAN, "run", *ti.run_flags(), "--rm", "-v", f"{CHECK}:/check.py:ro", "--entrypoint", entrypoint,
           image, *args]
    if shell is not None:
        cmd = [*ti.PODMAN, "run", *ti.run_flags(), "--rm", "-v", f"{CHECK}:/check.py:ro", "--entrypoint", "sh",
               image, "-c", shell]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def check_doc(p: subprocess.CompletedProcess) -> dict:
    start = p.stdout.find("{")
    assert start >= 0, (p.stdout[-2000:], p.stderr[-2000:])
    return json.loads(p.stdout[start:])


@pytest.fixture(scope="module")
def libs(gpu_image) -> dict:
    return check_doc(in_image(gpu_image, "/check.py", "--import-check", "-o", "json"))


def test_every_library_tensorflow_opens_loads_with_only_the_driver_missing(libs):
    print()
    for name, row in libs["loader"].items():
        print(f"  loader {name:<14} {'loaded' if row['loaded'] else 'missing':<8} {' '.join(row['files'])}"
              f"{'  (' + row['expected'] + ')' if 'expected' in row else ''}")
    for name, row in libs["wheels"].items():
        print(f"  wheel  {name:<26} {row['installed']}: " + ", ".join(f"{f} {v}" for f, v in row["libraries"].items()))
    assert libs["ok"], libs["problems"]
    loader = libs["loader"]
    assert not loader["CudaDriver"]["loaded"] and not loader["Nvml"]["loaded"]  # the driver comes from the host
    for name in MUST_LOAD:
        assert loader[name]["loaded"], (name, loader[name])
    wheels = libs["wheels"]
    assert len(wheels) >= 12 and all(r["installed"] for r in wheels.values())
    cudnn = wheels["nvidia-cudnn-cu12"]["libraries"]
    assert {"libcudnn_graph.so.9", "libcudnn_engines_precompiled.so.9", "libcudnn_cnn.so.9"} <= set(cudnn)
    assert all(v in ("loads", "needs the driver only") for r in wheels.values() for v in r["libraries"].values())
    nvcc = wheels["nvidia-cuda-nvcc-cu12"]
    assert nvcc["ptxas"].startswith("Build cuda_12.5") and nvcc["libdevice"], nvcc


def test_tensorflow_was_built_for_the_cuda_and_cudnn_installed(libs):
    v = libs["versions"]
    print(f"\n  built for CUDA {v['build_cuda']}, cuDNN {v['build_cudnn']}; installed runtime "
          f"{v['cuda_runtime_wheel']}, cuDNN {v['cudnn_wheel']}")
    assert v["build_cuda"].split(".")[:2] == v["cuda_runtime_wheel"].split(".")[:2]
    assert v["build_cudnn"].split(".")[0] == v["cudnn_wheel"].split(".")[0]
    assert libs["build_info"]["is_cuda_build"] is True


def test_without_a_driver_tensorflow_lists_no_gpu_for_that_reason_alone(libs):
    imp = libs["import"]
    assert imp["gpus"] == [] and imp["problems"] == [], imp
    assert any("cuInit" in w or "driver" in w.lower() for w in imp["why"]), imp


@pytest.mark.parametrize("library", [
    "nvidia/cusolver/lib/libcusolver.so.11",  # opened by TensorFlow's loader at start
    "nvidia/cudnn/lib/libcudnn_engines_precompiled.so.9",  # opened by cuDNN itself, later
    "nvidia/nvjitlink/lib/libnvJitLink.so.12",  # needed by cuSPARSE and cuSOLVER, never opened by name
])
def test_a_missing_library_fails_the_check(gpu_image, library):
    p = in_image(gpu_image, shell=f"rm {SITE}/{library} && python /check.py -o json")
    doc = check_doc(p)
    assert p.returncode == 1 and not doc["ok"]
    assert any(Path(library).name in problem or "Cusolver" in problem or "Cusparse" in problem
               for problem in doc["problems"]), doc["problems"]


def _sizes(tag: str, flavour: str) -> tuple[int, int, list[dict], dict]:
    base = ti.choose_base(os.environ.get("PYTHON_IMAGE") or None)
    rows = ti.layers(tag, base)
    comp = ti.compressed_sizes(tag)
    unpacked, compressed = sum(r["size"] for r in rows), sum(comp.values())
    print(f"\n{flavour} image: {ti.mb(unpacked)} unpacked, {ti.mb(compressed)} compressed (gzip -6), {len(rows)} layers")
    ti.print_table(rows, comp, out=sys.stdout)
    return unpacked, compressed, rows, comp


def test_gpu_image_size_layers_and_code_only_change(gpu_image, tmp_path):
    unpacked, compressed, rows, _ = _sizes(gpu_image, "GPU")
    goal_u, goal_c = GOALS["gpu"]
    assert unpacked <= goal_u and compressed <= goal_c
    assert "tensorflow" in rows[-4]["step"] or "/stage/tf/" in rows[-4]["step"]  # the layer order holds
    base = ti.choose_base(os.environ.get("PYTHON_IMAGE") or None)
    cc = ti.code_change(gpu_image, "gpu", base, tmp_path)
    print(f"code-only change: {len(cc['pulled'])} layer(s) pulled again, {ti.mb(cc['unpacked_bytes'])} unpacked, "
          f"{ti.mb(cc['compressed_bytes'])} compressed")
    assert len(cc["pulled"]) == 1 and cc["compressed_bytes"] < CODE_CHANGE_GOAL


def test_cpu_image_meets_its_size_goal(gpu_image):
    from tests.test_image import TAG as CPU_TAG

    # built from this checkout (the layer cache makes it quick after tests/test_image.py): a tag
    # left by another checkout on this machine must not stand in for it
    ti.build(ROOT, "cpu", CPU_TAG, ti.choose_base(os.environ.get("PYTHON_IMAGE") or None),
             Path(os.environ.get("TMPDIR", "/tmp")) / "gpu-tune-image-cpu.log")
    unpacked, _, _, _ = _sizes(CPU_TAG, "CPU")
    assert unpacked <= GOALS["cpu"][0]


def test_audit_topology_and_serve_start_in_the_gpu_image(gpu_image, tmp_path):
    run = [*ti.PODMAN, "run", *ti.run_flags(), "--rm", "-v", "/proc:/host/proc:ro", "-v", "/sys:/host/sys:ro",
           "-v", "/etc:/host/etc:ro", "-v", "/usr:/host/usr:ro", gpu_image]
    audit = subprocess.run([*run, "audit", "--root", "/host", "-o", "json"], capture_output=True, text=True,
                           timeout=300)
    assert audit.returncode in (0, 1), audit.stderr[-2000:]
    want = subprocess.run([venv_gpu_tune(), "audit", "--root", "/", "-o", "json", "--gpu-backend", "none"],
                          capture_output=True, text=True, timeout=120)
    rows = lambda doc: sorted((r["id"], r["target"], r["status"]) for r in json.loads(doc)["settings"])  # noqa: E731
    assert rows(audit.stdout) == rows(want.stdout)
    topo = subprocess.run([*run, "topology", "--root", "/host", "-o", "json"], capture_output=True, text=True,
                          timeout=300)
    assert topo.returncode == 0 and json.loads(topo.stdout)["gpus"] == [], topo.stderr[-2000:]
    port = _free_port()
    name = f"gpu-tune-gpu-serve-{os.getpid()}"
    srv = subprocess.Popen([*ti.PODMAN, "run", *ti.run_flags(), "--rm", "--name", name, "--network", "host",
                            "-v", "/proc:/host/proc:ro", "-v", "/sys:/host/sys:ro", gpu_image, "serve",
                            "--root", "/host", "--port", str(port), "--no-kube", "--probe-interval", "0"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, status = time.monotonic() + 120, None
        while time.monotonic() < deadline and status != 200:
            try:
                status = urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2).status
            except OSError:
                time.sleep(1)
        assert status == 200
    finally:
        subprocess.run([*ti.PODMAN, "stop", "-t", "10", name], capture_output=True, timeout=60)
        srv.wait(timeout=60)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
