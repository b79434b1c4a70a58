"""What the health tests share: the generated 8-GPU host tree, a policy folder holding one health
profile beside the real baselines, the 8-GPU fixture's JSON (edited per test) and the kernel log
line of an XID 79. Test modules import the fixtures by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest

from tests.fixtures import hostgen

TESTS = Path(__file__).parent
GPU_FIXTURE = TESTS / "fixtures/gpu/dgx-8gpu.json"
BASELINES = TESTS.parent / "policies" / "baselines.yaml"
XID79 = "3,{seq},{usec},-;NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
HEALTH_ONLY = "include: training.yaml\nreadiness:\n  require_compliant: false\n"


def health_policies(folder: Path, profile: str = HEALTH_ONLY) -> Path:
    """A policy folder with the profile ``health`` and the GPU models' expectations (baselines)."""
    folder.mkdir()
    (folder / "health.yaml").write_text(profile)
    shutil.copy(BASELINES, folder)
    return folder


def profiles_folder(tmp_path: Path, **profiles: str) -> Path:
    """A policy folder beside the test: the baselines and each profile ``name`` as ``training.yaml``
    with ``readiness.require_compliant: false`` and the lines given (indented under ``readiness:``)."""
    folder = tmp_path / "policies"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(BASELINES, folder)
    for name, body in profiles.items():
        (folder / f"{name}.yaml").write_text("include: training.yaml\nreadiness:\n  require_compliant: false\n" + body)
    return folder


def gpu_json(tmp_path: Path, edit: Callable[[dict], None] | None = None) -> Path:
    """The 8-GPU fixture, changed by ``edit``, written beside the test."""
    data = json.loads(GPU_FIXTURE.read_text())
    if edit:
        edit(data)
    f = tmp_path / "gpus.json"
    f.write_text(json.dumps(data))
    return f


@pytest.fixture(scope="module")
def dgx_tree(tmp_path_factory) -> Path:
    return hostgen.build("dgx-8gpu", tmp_path_factory.mktemp("dgx") / "h")


@pytest.fixture
def host(dgx_tree, tmp_path) -> Path:
    """A copy of the 8-GPU host tree this test may change."""
    root = tmp_path / "h"
    shutil.copytree(dgx_tree, root, symlinks=True)
    return root


@pytest.fixture
def policies(tmp_path) -> Path:
    return health_policies(tmp_path / "policies")
