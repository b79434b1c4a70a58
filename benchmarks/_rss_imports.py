"""What each import of the agent costs: resident memory, anonymous and file-backed, module by module.

    python benchmarks/_rss_imports.py MODULES.json > COSTS.json

``MODULES.json`` holds ``{"modules": [...]}``, ``sys.modules`` of a running agent in its order (the
order the agent finished importing them: benchmarks/_rss_agent.py). This fresh interpreter imports
them in that order with a meter around each module's own loading (``create_module``, where an
extension's shared library is mapped, and ``exec_module``): RssAnon and RssFile of
``/proc/self/status`` before and after, less what the modules it imported in between cost, so every
kilobyte is charged to one module and the charges add up to the whole. A shared library's pages
are charged to the first module that touches them.

Prints ``{"start": [anon, file], "end": [anon, file], "modules": [[name, anon, file], ...]}`` in KiB,
in the order the imports completed; modules that fail to import are listed under ``"failed"``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import json
import sys


def rss() -> tuple[int, int]:
    """(RssAnon, RssFile) of this process in KiB."""
    anon = file = 0
    with open("/proc/self/status", "rb") as fh:
        for line in fh:
            if line.startswith(b"RssAnon:"):
                anon = int(line.split()[1])
            elif line.startswith(b"RssFile:"):
                file = int(line.split()[1])
    return anon, file


COST: dict[str, list[int]] = {}
DONE: list[str] = []
_CHILDREN: list[list[int]] = []  # per module being loaded: what the modules it imported cost


class _Metered:
    """A loader wrapped so its ``create_module``/``exec_module`` are measured."""

    def __init__(self, loader, name: str) -> None:
        self._loader, self._name = loader, name

    def __getattr__(self, attr):
        return getattr(self._loader, attr)

    def _measure(self, fn, arg):
        a0, f0 = rss()
        _CHILDREN.append([0, 0])
        try:
            return fn(arg)
        finally:
            ca, cf = _CHILDREN.pop()
            a1, f1 = rss()
            own = COST.setdefault(self._name, [0, 0])
            own[0] += (a1 - a0) - ca
            own[1] += (f1 - f0) - cf
            if _CHILDREN:
                _CHILDREN[-1][0] += a1 - a0
                _CHILDREN[-1][1] += f1 - f0

    def create_module(self, spec):
        return self._measure(self._loader.create_module, spec)

    def exec_module(self, module):
        self._measure(self._loader.exec_module, module)
        DONE.append(self._name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds a module as the other finders do, and meters its loader."""

    def find_spec(self, name, path, target=None):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Metered(spec.loader, name)
                return spec
        return None


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        wanted = json.load(f)["modules"]
    start = rss()
    sys.meta_path.insert(0, _Finder())
    if "gpu_tune.serve.lean" in wanted:  # as the agent starts: importlib.metadata loaded part by part
        from gpu_tune.serve.lean import defer_package_metadata

        defer_package_metadata()
    failed = []
    for name in wanted:
        if name in sys.modules or name in ("__main__", "__mp_main__"):
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a module the agent made at run time, say
            failed.append(f"{name}: {type(exc).__name__}: {exc}"[:200])
    end = rss()
    sys.meta_path.pop(0)
    rows = [[m, *COST[m]] for m in DONE if m in COST]
    json.dump({"start": start, "end": end, "modules": rows, "failed": failed}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
