"""The image's lock files agree with pyproject.toml and pin the CUDA stack TensorFlow was built for."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests import skips

ROOT = Path(__file__).resolve().parent.parent
LOCKS = {"cpu": ROOT / "requirements" / "cpu.lock", "gpu": ROOT / "requirements" / "gpu.lock"}
# The image's interpreter: CPython 3.11 on x86_64 Linux (the lock's --python-version/--python-platform).
IMAGE_ENV = {**default_environment(), "python_version": "3.11", "python_full_version": "3.11.2",
             "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
             "implementation_name": "cpython", "platform_python_implementation": "CPython",
             "os_name": "posix"}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)")


def parse_lock(text: str) -> dict[str, tuple[Version, list[str]]]:
    """name -> (version, hashes); every requirement must be an exact pin with at least one hash."""
    pins: dict[str, tuple[Version, list[str]]] = {}
    entries = re.split(r"\n(?=[A-Za-z0-9])", text)
    for entry in entries:
        line = entry.strip()
        if not line or line.startswith(("#", "-")):
            continue
        m = PIN.match(line)
        assert m, f"not an exact pin: {line.splitlines()[0]!r}"
        hashes = re.findall(r"--hash=sha256:([0-9a-f]{64})", entry)
        assert hashes, f"{m.group(1)}=={m.group(2)} has no --hash"
        pins[canonicalize_name(m.group(1))] = (Version(m.group(2)), hashes)
    return pins


def runtime_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"]]


def unmet(lock: dict, reqs: list[Requirement]) -> list[str]:
    problems = []
    for req in reqs:
        if req.marker is not None and not req.marker.evaluate(IMAGE_ENV):
            continue
        got = lock.get(canonicalize_name(req.name))
        if got is None:
            problems.append(f"{req.name}: missing from the lock")
        elif not req.specifier.contains(got[0], prereleases=True):
            problems.append(f"{req.name}: locked {got[0]} does not satisfy {req.specifier}")
    return problems


@pytest.mark.parametrize("flavour", sorted(LOCKS))
def test_lock_satisfies_every_runtime_dependency(flavour):
    lock = parse_lock(LOCKS[flavour].read_text())
    assert unmet(lock, runtime_requirements()) == []
    # the probe's TensorFlow, and nothing the image does not import
    tf = "tensorflow-cpu" if flavour == "cpu" else "tensorflow"
    assert tf in lock and lock[tf][0] == Version("2.21.0")
    for absent in ("mlxtend", "scipy", "pandas", "scikit-learn", "matplotlib"):
        assert absent not in lock, f"{absent} is in {LOCKS[flavour].name}"


def test_the_check_catches_a_drifted_lock():
    lock = parse_lock(LOCKS["cpu"].read_text())
    reqs = [Requirement("typer>=0.12,<0.29"), Requirement("fastapi>=0.110"),
            Requirement("uvloop>=0.19; sys_platform == 'win32'")]
    assert unmet(lock, reqs) == []
    drifted = dict(lock)
    drifted["typer"] = (Version("0.29.1"), ["0" * 64])
    del drifted["fastapi"]
    assert unmet(drifted, reqs) == ["typer: locked 0.29.1 does not satisfy <0.29,>=0.12",
                                    "fastapi: missing from the lock"]
    with pytest.raises(AssertionError, match="not an exact pin"):
        parse_lock("fastapi>=0.110 \\\n    --hash=sha256:" + "0" * 64 + "\n")
    with pytest.raises(AssertionError, match="has no --hash"):
        parse_lock("fastapi==0.110.0\n")


def test_gpu_lock_pins_the_cuda_tensorflow_was_built_for():
    # TensorFlow's own metadata: its and-cuda extra's lower bounds are the versions of its build
    # (the CPU wheel carries the same extra, so the installed probe extra is enough to read it).
    try:
        requires = importlib.metadata.requires("tensorflow-cpu") or importlib.metadata.requires("tensorflow")
    except importlib.metadata.PackageNotFoundError:
        skips.missing("tool", "TensorFlow (the probe extra) is not installed")
    built = {}
    for r in map(Requirement, requires):
        if r.marker is not None and "and-cuda" in str(r.marker):
            lows = [s.version for s in r.specifier if s.operator == ">="]
            built[canonicalize_name(r.name)] = Version(lows[0])
    assert len(built) >= 10, built
    lock = parse_lock(LOCKS["gpu"].read_text())
    assert {name: lock[name][0] for name in built if name in lock} == built
    assert not [n for n in lock if n.startswith("nvidia-") and n.endswith("-cu12") and n not in built]
