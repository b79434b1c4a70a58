"""What the whole-node modules share (tests/test_cluster_e2e.py, tests/test_cluster_two_nodes.py):
the CPU image on a node (built as tests/test_image.py builds it, saved once per image id, imported
into the node's containerd under the name the chart and the kustomize tree run; podman, which
``make test`` installs when root), ``helm`` against the node's cluster, an agent's HTTP answers, and
waiting on evidence.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

from tests.realkube.binaries import cache_dir
from tests.realkube.controlplane import ApiError
from tests.realkube.node import save_image
from tests.realkube.plugin import record_timing, skip_or_fail

REPO = Path(__file__).resolve().parents[1]
IMAGE_TAG = "localhost/gpu-tune:test-cpu"  # what tests/test_image.py builds
IMAGE_NAME = "docker.io/library/gpu-tune:0.1.0"  # what the chart and the kustomize tree run


def _tools() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_tune_tools_image", REPO / "tools" / "image.py")
    ti = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ti)
    return ti


_BUILT: dict[str, Path] = {}  # this run's archive: the tree does not change during a run


def image_tar(tmp: Path) -> Path:
    """The CPU image built as tests/test_image.py builds it (layer cache: seconds when it ran
    already; once per run), saved once per image id."""
    if "tar" in _BUILT and _BUILT["tar"].is_file():
        return _BUILT["tar"]
    if shutil.which("podman") is None:
        skip_or_fail("podman is not installed (make test installs it when root): the image cannot be built")
    ti = _tools()
    base = ti.choose_base(os.environ.get("PYTHON_IMAGE") or None)
    ti.build(REPO, "cpu", IMAGE_TAG, base, tmp / "build.log")
    image_id = ti.podman("image", "inspect", "--format", "{{.Id}}", IMAGE_TAG).stdout.strip()
    folder = cache_dir().parent / "images"
    tar = folder / f"gpu-tune-cpu-{image_id[:16]}.tar"
    if not tar.is_file():
        for old in folder.glob("gpu-tune-cpu-*.tar"):
            old.unlink()
        # saved under a name of its own: another build may retag IMAGE_TAG meanwhile
        own = f"localhost/gpu-tune:e2e-{image_id[:16]}"
        ti.podman("tag", image_id, own)
        try:
            save_image(own, tar.with_suffix(".part"))
        finally:
            ti.podman("untag", image_id, own, check=False)
        tar.with_suffix(".part").rename(tar)
    _BUILT["tar"] = tar
    return tar


def with_image(node: Any, tmp_path_factory: Any, what: str = "image import into containerd (s)") -> Any:
    """``node`` with the CPU image imported (once per node and image), and ``node.tmp``, a folder
    for the module's files (helm's caches, values files)."""
    tmp = tmp_path_factory.mktemp("cluster")
    t0 = time.monotonic()
    tar = image_tar(tmp)
    record_timing("image build (cached) and save (s)", time.monotonic() - t0)
    if getattr(node, "imported", None) != tar:
        record_timing(what, node.import_image(tar, IMAGE_NAME))
        node.imported = tar
    node.tmp = tmp
    return node


def helm(node: Any, *args: str, check: bool = True, timeout: float = 330,
         namespace: str = "gpu-tune") -> subprocess.CompletedProcess:
    """Helm (the test extra's, tests/helmbin.py) against ``node``'s cluster as the admin; on a
    failure, the namespace's Events and the node's logs in the message."""
    from tests.helmbin import helm_binary
    from tests.realkube.procs import env_without_proxy

    assert node.cp is not None
    env = {**env_without_proxy(), "KUBECONFIG": str(node.cp.kubeconfig),
           "HELM_CACHE_HOME": str(node.tmp / "helm-cache"), "HELM_CONFIG_HOME": str(node.tmp / "helm-config"),
           "HELM_DATA_HOME": str(node.tmp / "helm-data")}
    proc = subprocess.run([str(helm_binary()), *args], capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        evs = node.kubectl("-n", namespace, "get", "events", "--sort-by=.lastTimestamp", check=False).stdout
        raise AssertionError(f"helm {' '.join(args)}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}\nevents in {namespace}:\n{evs[-3000:]}\n{node.logs()}")
    return proc


def agent_http(ip: str, path: str, port: int = 9410) -> tuple[int, dict]:
    """(status, JSON body) of an agent's answer on its node's address."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://{ip}:{port}{path}", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def wait_for(what: str, fn: Callable[[], Any], timeout: float, node: Any = None, every: float = 0.5) -> Any:
    """``fn()``'s first true value within ``timeout`` seconds; else AssertionError with the last
    value (or exception) and the node's logs."""
    t0 = time.monotonic()
    last: Any = None
    while time.monotonic() - t0 < timeout:
        try:
            last = fn()
        except (OSError, ApiError, ValueError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(every)
    extra = f"\n{node.logs()}" if node is not None else ""
    raise AssertionError(f"{what}: not within {timeout:.0f} s (last: {last!r}){extra}")
