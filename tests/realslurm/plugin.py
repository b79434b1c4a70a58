"""The pytest fixture for a real Slurm (imported by ``tests/conftest.py``).

``slurm`` (session): one :class:`~tests.realslurm.cluster.SlurmCluster` for the run, started by the
first test that asks for it and stopped at the end of the run; each test starts from
:meth:`~tests.realslurm.cluster.SlurmCluster.reset` (no job, the node idle with no reason, slurmd's
programs doing nothing). Root only (slurmd, a mount namespace, character devices): elsewhere the
tests skip with the reason ``not-root``. A missing Debian package (``munge``, ``slurmctld``,
``slurmd``, ``slurm-client``) is a missing ``tool``: it fails under ``make test`` (which installs
them as root: ``make slurm-tools``), as the other tools do (tests/skips.py).

Its teardown asserts that nothing is left: no process in the cluster's cgroup, nothing in the
run's ledger that could not be undone. A run killed outright is cleaned by the janitor at the
start of the next (:func:`tests.realkube.plugin.new_ledger`).
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Iterator

import pytest

from tests import skips
from tests.realkube.plugin import finish_ledger, new_ledger, record_timing

_SHARED: dict[str, Any] = {}


def _need() -> None:
    from tests.realslurm.cluster import TOOLS

    if os.geteuid() != 0:
        skips.condition("not-root", "a real Slurm needs root (slurmd, a mount namespace, device nodes)")
    for name, package in TOOLS.items():
        if not (shutil.which(name) or os.path.exists(f"/usr/sbin/{name}") or os.path.exists(f"/sbin/{name}")):
            skips.missing("tool", f"{name} is not installed (Debian package {package}; `make slurm-tools` "
                                  "installs Slurm and munge as root, and `make test` runs it)")
    if not os.path.isdir("/etc/slurm"):
        skips.missing("tool", "/etc/slurm is missing (made by Debian's slurmd and slurm-client packages)")


@pytest.fixture(scope="session")
def _slurm_cluster(tmp_path_factory) -> Iterator[Any]:
    from tests.realslurm.cluster import SlurmCluster

    _need()
    if "error" in _SHARED:
        pytest.fail(f"the Slurm cluster did not start for an earlier test: {_SHARED['error']}", pytrace=False)
    led = new_ledger("slurm")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), led)
    left: list[str] = []
    try:
        try:
            cluster.start()
        except BaseException as exc:
            _SHARED["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
            raise
        record_timing("slurm ready (s)", cluster.timings["slurm ready (s)"])
        yield cluster
    finally:
        left = cluster.stop()
        problems = finish_ledger(led)
        record_timing("slurm stopped and cleaned (s)", cluster.timings.get("slurm stopped (s)", 0.0))
    assert not left and not problems, f"the Slurm cluster left: {left}; {problems}"


@pytest.fixture
def slurm(_slurm_cluster) -> Any:
    """The run's Slurm, reset for this test."""
    _slurm_cluster.reset()
    return _slurm_cluster
