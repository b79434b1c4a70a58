"""A package loaded part by part: the modules the agent calls, not everything its ``__init__``
imports.

Some packages' ``__init__`` imports far more than the agent uses, and all of it stays resident for
the agent's life (benchmarks/bench_rss.py): ``import kubernetes`` brings the dynamic client, watch,
stream, the informers and the kubeconfig loader (:mod:`gpu_tune.cluster.kube_client`); ``import
uvicorn`` brings its command line (click) and its process supervisors (multiprocessing), about
1.5 MiB, for ``uvicorn.Config`` and ``uvicorn.Server`` (:mod:`gpu_tune.serve.httpserver`);
``importlib.metadata``, imported early and called late or never, is loaded whole at the first call
of one of its functions (:func:`on_first_call`, :mod:`gpu_tune.serve.lean`).

:func:`install` puts the named packages in ``sys.modules`` without running their ``__init__``
(their submodules import as usual from the package's folder), imports the modules that define the
names the caller uses and sets those names on the packages. Nothing is lost: a name of a
package's ``__init__`` that is not set yet loads on first use, the submodule or the whole
``__init__`` then, as a plain import would have. Where the package was imported whole before (a
test, a tool), that is what is used.
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

_lock = threading.RLock()
_PROBED = frozenset({"__wrapped__", "__getattr__", "__dir__"})  # asked of any module (inspect): no package's
_WHOLE: dict[str, Any] = {}  # package -> what loads the rest of it


def _partial(name: str, folder: str) -> ModuleType:
    """Package ``name`` (its folder, not its ``__init__``) whose missing names load on first use."""
    init = os.path.join(folder, "__init__.py")
    loader = importlib.machinery.SourceFileLoader(name, init)
    spec = importlib.util.spec_from_file_location(name, init, loader=loader, submodule_search_locations=[folder])
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)

    def whole() -> None:  # the rest of the package: its own __init__, once
        with _lock:
            if mod.__dict__.get("__getattr__") is __getattr__:
                del mod.__dict__["__getattr__"]
                loader.exec_module(mod)

    def __getattr__(attr: str) -> Any:
        if attr in _PROBED:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")
        if os.path.isfile(os.path.join(folder, attr + ".py")) or os.path.isdir(os.path.join(folder, attr)):
            return importlib.import_module(f"{name}.{attr}")
        whole()
        if attr in mod.__dict__:
            return mod.__dict__[attr]
        own = mod.__dict__.get("__getattr__")  # the package's own lazy names (kubernetes.client's)
        if own is None or own is __getattr__:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")
        return own(attr)

    mod.__getattr__ = __getattr__  # type: ignore[method-assign]
    _WHOLE[name] = whole
    return mod


def on_first_call(dotted: str) -> None:
    """``package.function`` of a package :func:`install` loaded part by part becomes a stand-in
    that, when first called, loads the package whole (its ``__init__`` then sets the real one)
    and calls the real function: for a name that is imported early and called late, or never."""
    package, _, attr = dotted.rpartition(".")
    mod = sys.modules[package]
    whole = _WHOLE.get(package)
    if whole is None or mod.__dict__.get("__getattr__") is None:
        return  # imported whole: nothing to defer

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        whole()
        return getattr(mod, attr)(*args, **kwargs)

    stand_in.__name__ = stand_in.__qualname__ = attr
    setattr(mod, attr, stand_in)


def install(packages: tuple[str, ...], names: dict[str, tuple[str, str]]) -> None:
    """Load ``packages`` (the first is the top-level one) part by part: ``names`` maps
    ``"package.Name"`` to (module, attribute) to import and set on the package. Does nothing
    where the top-level package is imported already; raises ImportError where it is not installed
    (and then leaves nothing of it in ``sys.modules``)."""
    top = packages[0]
    with _lock:
        if top in sys.modules:
            return
        spec = importlib.util.find_spec(top)
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(f"No module named {top!r}", name=top)
        folder = list(spec.submodule_search_locations)[0]
        for name in packages:
            below = name[len(top):].lstrip(".")  # the package's folder under the top-level one's
            mod = _partial(name, os.path.join(folder, *(below.split(".") if below else ())))
            sys.modules[name] = mod
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, mod)
        try:
            for dotted, (module, attr) in names.items():
                package, _, name = dotted.rpartition(".")
                setattr(sys.modules[package], name, getattr(importlib.import_module(module), attr))
        except BaseException:
            for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
                del sys.modules[name]  # as if never imported: the next import starts again, whole
            raise
