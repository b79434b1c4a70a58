"""The CUDA versions on both sides of the driver: what the driver supports (NVML's
``cuda_driver_version``) and what the probe's TensorFlow was built for.

TensorFlow is never imported here (its import costs seconds): the package is located with
``importlib.util.find_spec`` and its generated ``tensorflow/python/platform/build_info.py`` is
read as text. That file holds one literal, ``build_info = collections.OrderedDict([...])`` (a
plain dict in older releases), with ``is_cuda_build`` and, for a CUDA build, ``cuda_version``
(``12.5.1``; Windows builds write ``64_112``) and ``cudnn_version``.

The probe runs in this process's own Python environment (``sys.executable -m
gpu_tune.workload.mnist_probe``), so the TensorFlow found here is the probe's: in the DaemonSet, the
container's, not the host's.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

BUILD_INFO = ("python", "platform", "build_info.py")
_VERSION_RE = re.compile(r"^(\d+)\.(\d+)")


@dataclass(frozen=True)
class FrameworkBuild:
    """What the probe's framework was built with. ``cuda_version`` None: a CPU-only build (or
    no framework found, ``found`` False)."""

    framework: str
    found: bool
    is_cuda_build: bool = False
    cuda_version: str | None = None
    cudnn_version: str | None = None
    location: str | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"framework": self.framework, "found": self.found, "is_cuda_build": self.is_cuda_build,
                "cuda_version": self.cuda_version, "cudnn_version": self.cudnn_version,
                "location": self.location, "error": self.error}


def parse_build_info(text: str) -> dict[str, Any]:
    """The ``build_info`` mapping of a TensorFlow ``build_info.py``, from its text (no import).
    Raises ValueError when the file holds no such literal."""
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "build_info" for t in node.targets):
            value = node.value
            # collections.OrderedDict([...]) / OrderedDict([...]) / dict([...]): take the argument
            if isinstance(value, ast.Call) and value.args:
                value = value.args[0]
            data = ast.literal_eval(value)
            return dict(data)
    raise ValueError("no build_info literal")


def cuda_major_minor(version: str | None) -> tuple[int, int] | None:
    """``12.5.1`` -> (12, 5); ``12.8`` -> (12, 8); Windows' ``64_112`` -> (11, 2); else None."""
    if not version:
        return None
    v = str(version).strip()
    m = _VERSION_RE.match(v)
    if m:
        return int(m.group(1)), int(m.group(2))
    win = re.match(r"^64_(\d+)(\d)$", v)
    if win:
        return int(win.group(1)), int(win.group(2))
    return None


def framework_build_from(package_dir: str | Path | None, framework: str = "tensorflow") -> FrameworkBuild:
    """Read the build of the package installed at ``package_dir`` (None: not installed)."""
    if package_dir is None:
        return FrameworkBuild(framework, False)
    path = Path(package_dir).joinpath(*BUILD_INFO)
    try:
        info = parse_build_info(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return FrameworkBuild(framework, True, location=str(package_dir), error=f"{path}: no such file")
    except (OSError, SyntaxError, ValueError) as exc:
        return FrameworkBuild(framework, True, location=str(package_dir), error=f"{path}: {exc}")
    cuda = bool(info.get("is_cuda_build"))
    version = info.get("cuda_version") if cuda else None
    cudnn = info.get("cudnn_version") if cuda else None
    return FrameworkBuild(framework, True, cuda, None if version is None else str(version),
                          None if cudnn is None else str(cudnn), str(package_dir))


@lru_cache(maxsize=None)
def probe_framework_build(framework: str = "tensorflow") -> FrameworkBuild:
    """The probe's TensorFlow as installed in this environment (looked up once per process)."""
    try:
        spec = importlib.util.find_spec(framework)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return framework_build_from(None, framework)
    return framework_build_from(list(spec.submodule_search_locations)[0], framework)
