"""``gpu-tune`` itself, with a reporting thread for benchmarks/bench_rss.py: where the memory of a
running agent goes.

    python benchmarks/_rss_agent.py GPU-TUNE-ARGS...

Runs the real command line (``gpu_tune.cli.main``, as the console script does) in this process;
a daemon thread waits on stdin (a blocked read: no CPU, no wake-ups) for one line per report, the
path of a JSON file to write:

* ``modules``: ``sys.modules`` in its order (CPython moves a module to the end when its import
  completes: the list is in the order the agent finished importing them);
* ``caches``: the size of what the agent keeps (the latest snapshot's bodies and documents, the
  loop's documents, the stages' state, the FastAPI app, ...), each measured as the objects reachable
  from it and from nothing measured before it (modules, classes and functions are code, left to
  the per-import figures);
* ``malloc``: glibc's ``mallinfo2`` (bytes in use and free but kept), ``threads``, ``gc`` counts.

A line ``trim PATH`` calls ``malloc_trim(0)`` (glibc hands free heap pages back) and writes
``{"trimmed": true}`` to PATH: the benchmark reads the RSS after it, before a report's own
allocations. The gpu-tune process may
``exec`` a lean agent (``gpu-tune serve``): then this thread is gone with the CLI, and the
benchmark reads the agent from outside (``/proc``) and asks the lean agent for nothing.
"""

from __future__ import annotations

import ctypes
import gc
import json
import sys
import threading
import types
from typing import Any

SKIP = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.CodeType,
        types.MethodDescriptorType, types.WrapperDescriptorType, types.GetSetDescriptorType,
        types.MemberDescriptorType, types.MethodWrapperType)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def deep_size(root: Any, seen: set[int]) -> tuple[int, int]:
    """(bytes, objects) reachable from ``root`` not yet in ``seen`` (which grows), code left out."""
    total = count = 0
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, SKIP):
            continue
        seen.add(id(obj))
        try:
            total += sys.getsizeof(obj)
        except TypeError:
            continue
        count += 1
        stack.extend(gc.get_referents(obj))
    return total, count


def _closure_values(fn: Any) -> dict[str, Any]:
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)
            if not isinstance(getattr(cell, "cell_contents", None), SKIP)}


def _find(kind_module: str, kind_name: str) -> list[Any]:
    mod = sys.modules.get(kind_module)
    cls = getattr(mod, kind_name, None) if mod else None
    if cls is None:
        return []
    return [o for o in gc.get_objects() if isinstance(o, cls)]


def caches() -> list[dict[str, Any]]:
    """What the agent keeps, largest owners first in a fixed order (each object counted once)."""
    seen: set[int] = {id(sys.modules), id(globals())}
    rows: list[dict[str, Any]] = []
    keep: list[Any] = []  # the lists made here stay alive: a freed one's id could be a later one's

    def add(name: str, obj: Any) -> None:
        keep.append(obj)
        size, n = deep_size(obj, seen)
        rows.append({"name": name, "bytes": size, "objects": n})

    for agent in _find("gpu_tune.serve.agent", "Agent")[:1]:
        snap = agent.state.snapshot
        if snap is not None:
            add("snapshot: pre-rendered bodies", [getattr(snap, k) for k in vars(snap) if k.endswith("_body")])
            add("snapshot: documents (audit, topology, gpus, probes, verdict, health)",
                [v for k, v in vars(snap).items() if not k.endswith("_body")])
        add("agent state (empty bodies, liveness)", agent.state)
        add("loop: latest audit", agent._audit)
        add("loop: topology (object and document)", [agent._topology_obj, agent._topology_doc])
        add("loop: GPUs", agent._gpus)
        add("loop: probe results", agent._probe)
        add("loop: health readings (host, remembered, expectations)",
            [agent._host_health, agent._health_view, agent._expect])
        add("loop: Node facts and last publish", [agent._facts, agent._last_publish])
        add("loop: re-apply limits", agent._reapply)
        stages = agent.stages
        cells: dict[str, Any] = {}
        for v in vars(stages).values():
            if callable(v):
                cells.update(_closure_values(v))
        add("stages: profile and its policy", [stages.profile, cells.pop("profile", None), cells.pop("policy", None)])
        for key in ("monitor", "backend", "publisher", "fs", "baselines_cache", "saved"):
            if key in cells:
                add(f"stages: {key}", cells.pop(key))
        add("stages: the rest", list(cells.values()))
        add("loop: the rest of the Agent", agent)
    for app in _find("starlette.applications", "Starlette")[:1]:  # FastAPI's too: a Starlette
        add("the HTTP app (routes, OpenAPI schema once served)", app)
    for server in _find("uvicorn.server", "Server")[:1]:
        add("uvicorn server (config, connections)", server)
    return rows


def pymalloc() -> dict[str, int]:
    """CPython's small-object allocator (``sys._debugmallocstats``, written to fd 2: read back
    through a temporary file; another thread's log line in that instant would land there too)."""
    import os
    import re
    import tempfile

    with tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode(errors="replace")
    out: dict[str, int] = {}
    for key, pattern in (("arenas", r"# arenas allocated current\s*=\s*([\d,]+)"),
                         ("in_use", r"# bytes in allocated blocks\s*=\s*([\d,]+)"),
                         ("free_in_pools", r"# bytes in available blocks\s*=\s*([\d,]+)"),
                         ("unused_pools", r"unused pools \* \d+ bytes\s*=\s*([\d,]+)")):
        m = re.search(pattern, text)
        if m:
            out[key] = int(m.group(1).replace(",", ""))
    return out


def report(path: str) -> None:
    libc = ctypes.CDLL(None)
    gc.collect()
    doc: dict[str, Any] = {"modules": list(sys.modules), "threads": [t.name for t in threading.enumerate()],
                           "gc_objects": len(gc.get_objects()), "caches": caches()}
    try:
        libc.mallinfo2.restype = _Mallinfo2
        mi = libc.mallinfo2()
        doc["malloc"] = {"in_use": mi.uordblks + mi.hblkhd, "free_kept": mi.fordblks,
                         "arena": mi.arena, "mmapped": mi.hblkhd}
    except AttributeError:  # not glibc, or before 2.33
        doc["malloc"] = None
    doc["pymalloc"] = pymalloc()
    with open(path, "w") as f:
        json.dump(doc, f)


def _serve_reports() -> None:
    for line in sys.stdin:
        words = line.split()
        if len(words) == 2 and words[0] == "trim":
            ctypes.CDLL(None).malloc_trim(0)
            with open(words[1], "w") as f:
                json.dump({"trimmed": True}, f)
        elif words:
            report(words[-1])


if __name__ == "__main__":
    threading.Thread(target=_serve_reports, name="bench-rss-report", daemon=True).start()
    from gpu_tune.cli import main

    sys.argv[0] = "gpu-tune"
    main()  # this process's own arguments, as the console script: serve may re-execute it
