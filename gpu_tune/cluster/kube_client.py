"""The kubernetes client's packages, loaded part by part: what :mod:`gpu_tune.cluster.api` calls
(``ApiClient``, ``Configuration``, the exceptions, the in-cluster or kubeconfig loader), not the
whole client.

``import kubernetes`` runs the package's ``__init__``, which imports the dynamic client (and
``jsonschema``), watch, stream (websocket), utils, leader election, the informers and the
kubeconfig loader (``requests``, ``oauthlib``): about 11.5 MiB resident for the agent's life, of
which it uses the ``ApiClient``, its configuration and, out of a cluster, the kubeconfig loader
(benchmarks/bench_rss.py). :func:`modules` puts the
packages ``kubernetes``, ``kubernetes.client``, ``kubernetes.client.models``, ``kubernetes.config``
and ``kubernetes.utils`` in ``sys.modules`` without running their ``__init__`` (their submodules
import as usual from the package's folder), then imports the few modules named above.

Nothing is lost: a name of a package's ``__init__`` that is not loaded yet (``client.CoreV1Api``,
``client.models.V1Node``, ``config.load_kube_config``, ``from kubernetes import watch``) loads on
first use, the submodule or the whole ``__init__`` then, as a plain import would have. Where
``kubernetes`` was imported whole before (a test, a tool), that is what is used.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import threading
from types import ModuleType
from typing import Any

PACKAGES = ("kubernetes", "kubernetes.client", "kubernetes.client.models", "kubernetes.config", "kubernetes.utils")
_lock = threading.RLock()
_PROBED = frozenset({"__wrapped__", "__getattr__", "__dir__"})  # asked of any module (inspect): no package's


def _partial(name: str, folder: str) -> ModuleType:
    """Package ``name`` (its folder, not its ``__init__``) whose missing names load on first use."""
    init = os.path.join(folder, "__init__.py")
    loader = importlib.machinery.SourceFileLoader(name, init)
    spec = importlib.util.spec_from_file_location(name, init, loader=loader, submodule_search_locations=[folder])
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)

    def __getattr__(attr: str) -> Any:
        if attr in _PROBED:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")
        if os.path.isfile(os.path.join(folder, attr + ".py")) or os.path.isdir(os.path.join(folder, attr)):
            return importlib.import_module(f"{name}.{attr}")
        with _lock:  # the rest of the package: its own __init__, once
            if mod.__dict__.get("__getattr__") is __getattr__:
                del mod.__dict__["__getattr__"]
                loader.exec_module(mod)
        if attr in mod.__dict__:
            return mod.__dict__[attr]
        own = mod.__dict__.get("__getattr__")  # the package's own lazy names (kubernetes.client's)
        if own is None or own is __getattr__:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")
        return own(attr)

    mod.__getattr__ = __getattr__  # type: ignore[method-assign]
    return mod


def _install() -> None:
    if "kubernetes" in sys.modules:
        return
    spec = importlib.util.find_spec("kubernetes")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("No module named 'kubernetes'", name="kubernetes")
    top = list(spec.submodule_search_locations)[0]
    for name in PACKAGES:
        mod = _partial(name, os.path.join(top, *name.split(".")[1:]))
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, mod)
    try:  # what gpu_tune.cluster.api names on the packages themselves
        from kubernetes.client.api_client import ApiClient
        from kubernetes.client.configuration import Configuration
        from kubernetes.config.config_exception import ConfigException
        from kubernetes.config.incluster_config import load_incluster_config
    except BaseException:
        for name in [m for m in sys.modules if m == "kubernetes" or m.startswith("kubernetes.")]:
            del sys.modules[name]  # as if never imported: the next import starts again, whole
        raise

    client, config = sys.modules["kubernetes.client"], sys.modules["kubernetes.config"]
    client.ApiClient, client.Configuration = ApiClient, Configuration  # type: ignore[attr-defined]
    config.ConfigException, config.load_incluster_config = ConfigException, load_incluster_config  # type: ignore[attr-defined]


def modules() -> tuple[Any, Any]:
    """(``kubernetes.client``, ``kubernetes.config``), loaded part by part (this module's doc)."""
    with _lock:
        _install()
    return sys.modules["kubernetes.client"], sys.modules["kubernetes.config"]
