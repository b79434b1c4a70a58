"""pytest fixtures for a real Kubernetes (imported by ``tests/conftest.py``).

- ``control_plane`` (session): etcd + kube-apiserver on 127.0.0.1, started on first use;
- ``api`` (per test): :class:`~tests.realkube.testapi.RealAPI` over it, the test's Nodes and
  their Events deleted afterwards;
- ``kube_node`` (module-scoped, one node for the run): a whole node
  (:class:`~tests.realkube.node.Node` named :data:`NODE_NAME`, labelled as a GPU node), root
  only. Started by the first module that uses it, shared by the next ones, stopped after the
  last of them (or at the end of the run): the cluster's state carries over from module to
  module. Its teardown checks that the machine is as before: every kernel setting back, no
  namespace, cgroup or compiled-in path left;
- ``second_kube_node`` (module): a second node joining it
  (:class:`~tests.realkube.joined.JoinedNode` named :data:`SECOND_NODE_NAME`, also a GPU node),
  stopped at the end of the module.

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


# -- whole nodes ------------------------------------------------------------------------------------
NODE_NAME = "gpu-node-e2e"
SECOND_NODE_NAME = "gpu-node-e2e-b"
NODE_LABELS = {"nvidia.com/gpu.present": "true"}  # as the GPU Operator labels a GPU node
_SHARED: dict[str, Any] = {}


def read_or_none(path: str) -> bytes | None:
    """The file's bytes, or None where it cannot be read."""
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return None


def _need_node() -> None:
    from tests.realkube.node import why_no_node

    why = why_no_node()
    if why is None:
        try:
            binaries()
        except Missing as exc:
            why = str(exc)
    if why:
        skip_or_fail(why)


def traces(node: Any, before: dict[str, Any]) -> list[str]:
    """What ``node`` left on this machine after its stop: kernel files that differ from
    ``before["kernel"]``, its namespaces, links and cgroups, compiled-in paths it made."""
    from tests.realkube.cleanup import cgroup_dirs
    from tests.realkube.node import kernel_files

    out = [f"kernel file {p} changed: {before['kernel'].get(p)!r} -> {v!r}"
           for p, v in ((p, read_or_none(p)) for p in kernel_files()) if p in before["kernel"] and before["kernel"][p] != v]
    suffix = "b" * node.index
    for p in (f"/run/netns/{node.netns}", f"/sys/class/net/gtkh{node.run_id}{suffix}"[:31], str(node.state),
              *before["absent"]):
        if os.path.lexists(p):
            out.append(f"{p} is still there")
    out += [f"cgroup {d} is still there" for d in cgroup_dirs(node.cgroup)]
    return out


def _before_node() -> dict[str, Any]:
    from tests.realkube.node import FIXED_PATHS, kernel_files

    return {"kernel": {p: read_or_none(p) for p in kernel_files()}, "absent": [p for p in FIXED_PATHS if not os.path.exists(p)]}


def _stop_shared() -> None:
    node = _SHARED.pop("node", None)
    if node is None:
        return
    led, before = _SHARED.pop("ledger"), _SHARED.pop("before")
    problems: list[str] = []
    try:
        problems += node.stop()
    finally:
        problems += finish_ledger(led)
    record_timing("node stopped and cleaned (s)", node.timings.get("stop_s", 0.0))
    left = traces(node, before)
    assert not problems and not left, f"the node left: {problems}; {left}"


@pytest.fixture(scope="session")
def _kube_node_keeper() -> Iterator[dict[str, Any]]:
    yield _SHARED
    _stop_shared()  # a run that ended before the last module using it


def _node_modules(session: Any) -> list[str]:
    """The modules of this run that use ``kube_node``, in the order they run."""
    mods: list[str] = []
    for item in session.items:
        if "kube_node" in getattr(item, "fixturenames", ()):
            mod = item.nodeid.split("::")[0]
            if mod not in mods:
                mods.append(mod)
    return mods


@pytest.fixture(scope="module")
def kube_node(request, tmp_path_factory, _kube_node_keeper) -> Iterator[Any]:
    """The run's whole node (see the module docstring): ``node.before`` holds the kernel files as
    they were before it started, ``node.started`` as they were once its kubelet ran."""
    from tests.realkube.node import Node, kernel_files

    if "error" in _SHARED:
        pytest.fail(f"the node did not start for an earlier module: {_SHARED['error']}", pytrace=False)
    if "node" not in _SHARED:
        _need_node()
        before = _before_node()
        led = new_ledger("node")
        node = Node(tmp_path_factory.mktemp("node") / "node", led, name=NODE_NAME, labels=NODE_LABELS)
        _SHARED.update(node=node, ledger=led, before=before)
        try:
            node.start()
        except BaseException as exc:
            _SHARED["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
            _stop_shared()
            raise
        record_timing("e2e control plane ready (s)", node.timings["control_plane_ready_s"])
        record_timing("node Ready (s)", node.timings["node_ready_s"])
        node.before = before["kernel"]
        # what the kubelet itself set at its start (vm.overcommit_memory, kernel.panic ...) aside
        node.started = {p: read_or_none(p) for p in kernel_files() if p in before["kernel"]}
    yield _SHARED["node"]
    mods = _node_modules(request.session)
    if not mods or mods[-1] == request.node.nodeid.split("::")[0]:
        _stop_shared()


@pytest.fixture(scope="module")
def second_kube_node(kube_node, tmp_path_factory) -> Iterator[Any]:
    """A second node in ``kube_node``'s cluster (see the module docstring), stopped after the module."""
    from tests.realkube.joined import JoinedNode

    before = _before_node()
    led = new_ledger("node2")
    node = JoinedNode(kube_node, tmp_path_factory.mktemp("node2") / "node", led, name=SECOND_NODE_NAME,
                      labels=NODE_LABELS)
    problems: list[str] = []
    try:
        node.start()
        record_timing("second node Ready (s)", node.timings["node_ready_s"])
        yield node
    finally:
        try:
            problems = node.stop()
        finally:
            problems += finish_ledger(led)
        record_timing("second node stopped and cleaned (s)", node.timings.get("stop_s", 0.0))
    left = traces(node, before)
    assert not problems and not left, f"the second node left: {problems}; {left}"


def pytest_sessionfinish(session) -> None:  # noqa: ANN001
    """On a pytest-xdist worker: hand this worker's timings to the controller, which prints them."""
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out["realkube_timings"] = dict(TIMINGS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # noqa: ANN001
    TIMINGS.update(getattr(node, "workeroutput", {}).get("realkube_timings", {}))


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


__all__ = ["control_plane", "api", "kube_node", "second_kube_node", "pytest_terminal_summary", "pytest_sessionfinish",
           "pytest_testnodedown", "skip_or_fail",
           "new_ledger", "finish_ledger", "record_timing", "on_ci", "TIMINGS", "Path"]
