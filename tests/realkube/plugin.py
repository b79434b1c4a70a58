"""pytest fixtures for a real Kubernetes (imported by ``tests/conftest.py``).

- ``control_plane`` (session): etcd + kube-apiserver on 127.0.0.1, started on first use;
- ``api`` (per test): :class:`~tests.realkube.testapi.RealAPI` over it, the test's Nodes and
  their Events deleted afterwards;
- ``kube_node`` (session): a whole node (:class:`~tests.realkube.node.Node`), root only.

Without the binaries a test using them is skipped with the reason (which version, from where);
under ``CI=true`` or ``GPU_TUNE_REQUIRE_CLUSTER=1`` it fails instead. Whatever a run starts is undone by the fixtures' teardown,
by an ``atexit`` hook if pytest ends without it, on SIGTERM (turned into KeyboardInterrupt so
the teardown runs) and, after a run killed outright, by the janitor at the start of the next.
The session's timings (control plane ready, node Ready, ...) are printed in pytest's summary.
"""

from __future__ import annotations

import atexit
import os
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.realkube.binaries import Missing, binaries, tool
from tests.realkube.cleanup import Ledger, janitor, ledger_root

TIMINGS: dict[str, float] = {}
_LEDGERS: list[Ledger] = []
_janitor_done = False


def on_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def required() -> bool:
    """``CI=true``, or ``GPU_TUNE_REQUIRE_CLUSTER=1`` (``make test`` sets it when run as root with
    the binaries beside the clone): a missing piece fails the test instead of skipping it."""
    return on_ci() or os.environ.get("GPU_TUNE_REQUIRE_CLUSTER", "") == "1"


def skip_or_fail(msg: str) -> None:
    if required():
        pytest.fail(f"the real-cluster tests must run here (CI=true or GPU_TUNE_REQUIRE_CLUSTER=1): {msg}",
                    pytrace=False)
    pytest.skip(msg)


def _clean_all() -> None:
    while _LEDGERS:
        led = _LEDGERS.pop()
        try:
            led.clean()
        except Exception:  # noqa: BLE001 - at exit: do what can be done
            pass


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def new_ledger(kind: str) -> Ledger:
    """A ledger for this run's ``kind`` of cluster, after the janitor cleaned earlier runs'."""
    global _janitor_done
    if not _janitor_done:
        _janitor_done = True
        for line in janitor():
            print(f"realkube janitor: {line}")
        atexit.register(_clean_all)
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _on_sigterm)
    led = Ledger(f"{kind}-{os.getpid()}", ledger_root())
    _LEDGERS.append(led)
    return led


def finish_ledger(led: Ledger) -> list[str]:
    problems = led.clean()
    if led in _LEDGERS:
        _LEDGERS.remove(led)
    return problems


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory) -> Iterator[Any]:
    from tests.realkube.controlplane import ControlPlane

    try:
        binaries(("kube-apiserver",))
        tool("etcd", "etcd-server")
        tool("openssl", "openssl")
    except Missing as exc:
        skip_or_fail(str(exc))
    led = new_ledger("cp")
    cp = ControlPlane(tmp_path_factory.mktemp("kube-cp"), led)
    try:
        cp.start()
        TIMINGS["control plane ready (s)"] = cp.ready_s or 0.0
        yield cp
    finally:
        cp.stop()
        problems = finish_ledger(led)
        assert not problems, f"the control plane left: {problems}"


@pytest.fixture
def api(control_plane) -> Iterator[Any]:
    """The real API server behind a recording, fault-injecting proxy; the test's Nodes (and
    their Events) are deleted afterwards."""
    from tests.realkube.testapi import RealAPI

    real = RealAPI(control_plane)
    try:
        yield real
    finally:
        real.close()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ANN001
    if TIMINGS:
        load = os.getloadavg()
        terminalreporter.write_sep("-", "real Kubernetes timings")
        for k, v in TIMINGS.items():
            terminalreporter.write_line(f"{k:<40} {v:8.1f}")
        terminalreporter.write_line(f"{'load average (1, 5, 15 min) at the end':<40} "
                                    f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")


def record_timing(name: str, seconds: float) -> None:
    TIMINGS[name] = seconds
    print(f"realkube: {name}: {seconds:.1f} s (load {os.getloadavg()[0]:.2f})")


def now() -> float:
    return time.monotonic()


__all__ = ["control_plane", "api", "pytest_terminal_summary", "skip_or_fail", "new_ledger", "finish_ledger",
           "record_timing", "on_ci", "TIMINGS", "Path"]
