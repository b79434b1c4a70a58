"""Shared fixtures: generated host trees (copied fresh per test), CLI runner helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.fixtures import hostgen  # noqa: E402
from tests.realkube.plugin import (  # noqa: E402,F401
    _kube_node_keeper,
    api,
    control_plane,
    kube_node,
    pytest_sessionfinish,
    pytest_terminal_summary,
    pytest_testnodedown,
    second_kube_node,
)
from tests.realslurm.plugin import _slurm_cluster, slurm  # noqa: E402,F401

GPU_FIXTURES = REPO / "tests" / "fixtures" / "gpu"

# `make test` runs the suite on several workers (pytest-xdist, `-n`). Each module runs whole on one
# worker, so its module-scoped fixtures are made once; the modules that share this machine's one
# Kubernetes node or write its kernel settings (the images' privileged containers too, and podman's
# one store) run on one worker, one after the other, as do the real Slurm's. The longest of these
# goes first, so the other workers run everything else beside it.
XDIST_GROUPS = {
    "test_image.py": "this-host", "test_image_gpu.py": "this-host", "test_cluster_e2e.py": "this-host",
    "test_cluster_two_nodes.py": "this-host", "test_systemd_live.py": "this-host", "test_slurm.py": "slurm",
    "test_slurm_hostile.py": "slurm", "test_slurm_fleet.py": "slurm",
    "test_slurm_prolog_rpcs.py": "slurm",
}


def _xdist_scope(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return XDIST_GROUPS.get(path.rsplit("/", 1)[-1], path)


def pytest_xdist_make_scheduler(config, log):  # noqa: ANN001
    """Work units by module, and by the groups above (pytest-xdist's own xdist_group marks go through
    a node id suffix that pytest 9.2 no longer takes)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModuleAndGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _xdist_scope(nodeid)

    config.option.loadscopereorder = False  # the collection's order: the groups first (below)
    return ByModuleAndGroup(config, log)


def pytest_collection_modifyitems(config, items):  # noqa: ANN001
    # the longest group first (its images and node take most of the run), then Slurm's; within a
    # group the order stays the collection's
    first = {"this-host": 0, "slurm": 1}
    items.sort(key=lambda item: first.get(XDIST_GROUPS.get(item.path.name, ""), 2))


@pytest.fixture
def make_host(tmp_path):
    """make_host("two-socket-224") -> a fresh tree under tmp_path (each call a new folder)."""
    count = {"n": 0}

    def _make(scenario: str) -> Path:
        count["n"] += 1
        dest = tmp_path / f"host{count['n']}-{scenario}"
        return hostgen.build(scenario, dest)

    return _make


@pytest.fixture
def gpu_fixture(tmp_path):
    """gpu_fixture("dgx-8gpu") -> a writable copy of tests/fixtures/gpu/<name>.json."""

    def _copy(name: str) -> Path:
        src = GPU_FIXTURES / f"{name}.json"
        dst = tmp_path / f"gpu-{name}.json"
        dst.write_text(src.read_text())
        return dst

    return _copy


def run_cli(*args: str, env: dict | None = None, timeout: float = 600, input: str | None = None,
            program: tuple[str, ...] = ("-m", "gpu_tune")):
    """Run the real console script in a subprocess; returns CompletedProcess (text). ``program``:
    what the interpreter runs (another entry to the same command line, say)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO)}
    for k in ("GPU_TUNE_ROOT", "GPU_TUNE_PROFILE", "GPU_TUNE_POLICY_DIR", "GPU_TUNE_GPU_BACKEND", "GPU_TUNE_GPU_FIXTURE",
              "GPU_TUNE_TAINT"):
        full_env.pop(k, None)
    full_env["COLUMNS"] = "200"  # whatever the terminal (or a pytest-xdist worker) says
    if env:
        full_env.update(env)
    return subprocess.run([sys.executable, *program, *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, input=input)


@pytest.fixture
def cli():
    return run_cli


def snapshot_tree(root: Path) -> dict[str, bytes]:
    """Every regular file's bytes and every folder under root (to prove byte-for-byte restores).

    The tool's own state folder (/var/lib/gpu-tune and the folders leading to it) is left out.
    """
    out = {}
    state = ("var", "var/lib", "var/lib/gpu-tune")
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if rel in state or rel.startswith("var/lib/gpu-tune/") or p.is_symlink():
            continue
        if p.is_file():
            out[rel] = p.read_bytes()
        elif p.is_dir():
            out[rel + "/"] = b"<dir>"
    return out


def jdoc(proc) -> dict:
    assert proc.stdout.strip(), f"no stdout; stderr: {proc.stderr}"
    return json.loads(proc.stdout)
