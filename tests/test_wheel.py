"""The wheel users install: built from this checkout, installed alone into an empty virtualenv.

It must put one import package, ``gpu_tune`` (and its dist-info), into site-packages, with the
profiles inside, and give working ``gpu-tune`` and ``kubectl-gpu_tune`` commands. The runtime
dependencies are not downloaded again: the new environment reads them from this test run's own
site-packages through a ``.pth`` line (a plain folder on ``sys.path``: the editable install's
import hook there is not activated), so what ``gpu_tune`` resolves to is the wheel's copy alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(REPO)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    # setuptools' deprecation of the license table prints a warning on every build
    assert "license" not in p.stderr.lower() or "deprecat" not in p.stderr.lower(), p.stderr[-2000:]
    wheels = list(out.glob("gpu_tune-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    env_dir = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    p = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                        "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    before = sorted(x.name for x in site.iterdir())
    (site / "zz_gpu_tune_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env_dir, site, before


def test_the_wheel_holds_one_import_package_and_the_profiles(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"gpu_tune", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, tops
    for f in ("gpu_tune/policies/training.yaml", "gpu_tune/policies/inference.yaml",
              "gpu_tune/policies/_base.yaml", "gpu_tune/policies/baselines.yaml",
              "gpu_tune/workload/mnist_probe.py", "gpu_tune/cli/main.py", "gpu_tune/__main__.py",
              "gpu_tune/systemd/gpu-tune.service", "gpu_tune/systemd/gpu-tune-apply.service"):
        assert f in names, f
    assert not [n for n in names if n.startswith(("gpu_tune/tests", "tests/", "benchmarks/"))]
    # every module of the checkout ships (pyproject.toml lists the package folders one by one)
    missing = sorted(str(f.relative_to(REPO)) for f in (REPO / "gpu_tune").rglob("*.py")
                     if "__pycache__" not in f.parts and str(f.relative_to(REPO)) not in names)
    assert not missing, f"not in the wheel (add the folder to [tool.setuptools] packages): {missing}"
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta


def test_only_gpu_tune_lands_in_site_packages(installed):
    _, site, before = installed
    ours = [n for n in before if not n.startswith("_virtualenv") and n not in ("__pycache__",)]
    assert sorted(ours) == ["gpu_tune", "gpu_tune-0.1.0.dist-info"], ours


def _run(env_dir: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_TUNE_", "PYTHON"))}
    return subprocess.run([*argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_commands_work_from_the_wheel_with_its_own_profiles(installed, tmp_path):
    env_dir, site, _ = installed
    bindir = env_dir / "bin"
    where = _run(env_dir, str(bindir / "python"), "-c",
                 "import gpu_tune, gpu_tune.tune.policy as p; print(gpu_tune.__file__); print(p.default_policy_dir())",
                 cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    module_file, policy_dir = where.stdout.split()
    assert Path(module_file).is_relative_to(site) and Path(policy_dir) == site / "gpu_tune" / "policies"

    p = _run(env_dir, str(bindir / "gpu-tune"), "profiles", "-o", "json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert sorted(x["name"] for x in json.loads(p.stdout)["profiles"]) == ["inference", "training"]

    p = _run(env_dir, str(bindir / "python"), "-m", "gpu_tune", "--version", cwd=tmp_path)
    assert p.returncode == 0 and p.stdout.strip() == "gpu-tune 0.1.0", (p.stdout, p.stderr)

    p = _run(env_dir, str(bindir / "gpu-tune"), "systemd-units", cwd=tmp_path)  # the units, where pip put them
    assert p.returncode == 0 and p.stdout.split() == [str(site / "gpu_tune" / "systemd" / u) for u in
                                                      ("gpu-tune.service", "gpu-tune-apply.service")], p

    p = _run(env_dir, str(bindir / "kubectl-gpu_tune"), "fleet", "--help", cwd=tmp_path)
    assert p.returncode == 0 and "kubectl gpu-tune fleet" in p.stdout, p.stdout

    p = _run(env_dir, str(bindir / "gpu-tune"), "audit", "--root", "/", "--gpu-backend", "none", "-o", "json",
             cwd=tmp_path)
    assert p.returncode in (0, 1), p.stderr
    assert json.loads(p.stdout)["profile"] == "training"
