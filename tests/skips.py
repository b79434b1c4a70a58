"""The suite's one skip policy (docs/cluster-tests.md, "When a test may skip").

Every conditional skip in tests/ goes through this module, with a key from the documented list;
tests/test_skips.py reads every test file and fails on a skip that does not. Two kinds:

* :func:`missing`: a piece the suite needs is not installed.

  - ``"tool"``: a test extra (``pip install -e '.[probe,test]'``) or a Debian tool ``make tools``
    installs. It fails; ``GPU_TUNE_ALLOW_MISSING_TOOLS=1`` turns that into a skip, except under
    ``make test`` or CI.
  - ``"image"``: podman, able to run, for the image tests (root). Skipped, except under
    ``make test`` or CI, where ``make image-tools`` has installed it.
  - ``"cluster"``: the Kubernetes server binaries and the packages of a node
    (``tests/realkube``): the harness's own rule, :func:`tests.realkube.plugin.skip_or_fail`
    (skipped unless ``GPU_TUNE_REQUIRE_CLUSTER=1`` or CI).

  ``make test`` says it is ``make test`` with ``GPU_TUNE_REQUIRE_ALL=1``; ``CI=true`` means the same.

* :func:`condition` / :func:`skipif`: a fact of this machine that no install changes (its
  kernel, its hardware, not being root). Always a skip, whatever runs the suite, and only with a
  key the document lists.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest

PIECES = ("tool", "image", "cluster")


def under_make_test() -> bool:
    """``make test`` (it sets ``GPU_TUNE_REQUIRE_ALL=1``) or CI (``CI=true``)."""
    return (os.environ.get("GPU_TUNE_REQUIRE_ALL", "") == "1"
            or os.environ.get("CI", "").lower() in ("1", "true", "yes"))


def required(piece: str) -> bool:
    """Whether a missing ``piece`` fails the test here (else it is skipped)."""
    if piece == "tool":
        return under_make_test() or os.environ.get("GPU_TUNE_ALLOW_MISSING_TOOLS", "") != "1"
    if piece == "image":
        return under_make_test()
    if piece == "cluster":
        from tests.realkube.plugin import required as cluster_required

        return cluster_required()
    raise ValueError(f"unknown piece {piece!r} (one of {', '.join(PIECES)})")


def missing(piece: str, msg: str) -> NoReturn:
    """A piece the test needs is not here: fail or skip, by the policy above."""
    if piece == "cluster":
        from tests.realkube.plugin import skip_or_fail

        skip_or_fail(msg)
    if required(piece):
        why = ("make test / CI needs it" if under_make_test()
               else "set GPU_TUNE_ALLOW_MISSING_TOOLS=1 to skip instead")
        pytest.fail(f"{msg} ({why})", pytrace=False)
    pytest.skip(msg, allow_module_level=True)


def module(name: str, hint: str) -> ModuleType:
    """Import a test tool's module; missing, it is a missing ``"tool"``."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing("tool", f"{name} is not importable ({exc}): {hint}")


def condition(key: str, msg: str) -> NoReturn:
    """Skip: this machine lacks what the test is about (``key``: one of the documented list)."""
    pytest.skip(f"{msg} [{key}]")


def skipif(key: str, cond: bool, msg: str) -> pytest.MarkDecorator:
    """The mark for :func:`condition` decided at collection (a decorator, or ``pytest.param(marks=)``)."""
    return pytest.mark.skipif(cond, reason=f"{msg} [{key}]")
