"""A newcomer's first screen: `make run` and `make test` print nothing to worry about.

- `pip install -e .` (both make targets) gets no warning from setuptools: every package lies where
  its name says (the profiles through the link gpu_tune/policies -> ../policies), so the editable
  install is one .pth line naming the checkout, not an import hook with its "Editable installation"
  warning.
- The test client imports without Starlette's deprecation warning: it takes httpx2 (the test
  extra), not httpx.
"""

from __future__ import annotations

import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A warning a Python library emits has a category (BuildBackendWarning, SetuptoolsDeprecationWarning,
# StarletteDeprecationWarning, ...); setuptools frames its own between "!!" lines. pip's lines about
# this machine's own pip configuration ("WARNING: Location ... is ignored") are neither.
WARNING = re.compile(r"\b[A-Za-z]*Warning\b|^\s*!!\s*$|Editable install", re.M)


@pytest.mark.slow
def test_an_editable_install_of_the_checkout_prints_no_warning(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    p = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "-e",
                        str(REPO)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not WARNING.search(p.stderr), p.stderr[-3000:]
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (pth,) = site.glob("__editable__.gpu_tune-*.pth")
    assert pth.read_text().split() == [str(REPO)]
    where = subprocess.run([str(py), "-c", "import gpu_tune; print(gpu_tune.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert where.stdout.strip() == str(REPO / "gpu_tune" / "__init__.py"), where.stderr
    assert (REPO / "gpu_tune" / "policies" / "training.yaml").resolve() == REPO / "policies" / "training.yaml"


def test_the_test_client_uses_httpx2():
    import starlette.testclient

    assert starlette.testclient.httpx.__name__ == "httpx2"


def test_importing_the_test_client_warns_nothing():
    p = subprocess.run([sys.executable, "-W", "error", "-c", "import fastapi.testclient"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and not p.stderr, p.stderr[-2000:]
