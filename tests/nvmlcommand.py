"""`gpu-tune` itself over the fake NVML library (tests/nvmlfake.py), as a process of its own: the
real command line, the real nvidia-ml-py, only the C library replaced.

    python tests/nvmlcommand.py SCENARIO.json [--calls FILE] -- GPU-TUNE-ARGS...

A scenario file (:func:`write_scenario`) holds the GPUs (:class:`~tests.nvmlfake.FakeGpu`, hostile
bytes and values included) and the library's settings; with ``--calls`` every C call and its
arguments are written to FILE as JSON at the end (what a test counts). Run as a script it uses the
fake beside it, whatever checkout's ``gpu_tune`` is on ``PYTHONPATH`` (a benchmark runs the
revision before a change with it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

if __package__:
    from tests import nvmlfake
else:  # a script: sys.path[0] is this folder
    import nvmlfake  # type: ignore[no-redef]

FakeGpu, FakeNvmlLib = nvmlfake.FakeGpu, nvmlfake.FakeNvmlLib


def _encode(v: Any) -> Any:
    if isinstance(v, bytes):
        return {"bytes": v.hex()}
    if isinstance(v, float) and not math.isfinite(v):
        return {"float": repr(v)}
    if isinstance(v, dict):
        return {"dict": [[_encode(k), _encode(x)] for k, x in v.items()]}
    if isinstance(v, (list, tuple)):
        return [_encode(x) for x in v]
    return v


def _decode(v: Any) -> Any:
    if isinstance(v, dict):
        if "bytes" in v:
            return bytes.fromhex(v["bytes"])
        if "float" in v:
            return float(v["float"])
        return {_decode(k): _decode(x) for k, x in v["dict"]}
    if isinstance(v, list):
        return tuple(_decode(x) for x in v)
    return v


def write_scenario(path: Path, gpus: list[FakeGpu], **lib: Any) -> Path:
    """A scenario file for :func:`run_command`: the GPUs and the library's own settings."""
    doc = {"gpus": [{f.name: _encode(getattr(g, f.name)) for f in dataclasses.fields(g)} for g in gpus],
           "lib": {k: _encode(sorted(v) if isinstance(v, (set, frozenset)) else v) for k, v in lib.items()}}
    path.write_text(json.dumps(doc))
    return path


def read_scenario(path: Path) -> FakeNvmlLib:
    doc = json.loads(Path(path).read_text())
    gpus = []
    for d in doc["gpus"]:
        kw = {k: _decode(v) for k, v in d.items()}
        if kw.get("links") is not None:
            kw["links"] = list(kw["links"])
        gpus.append(FakeGpu(**kw))
    lib = {k: _decode(v) for k, v in doc.get("lib", {}).items()}
    if "missing" in lib:
        lib["missing"] = frozenset(lib["missing"])
    return FakeNvmlLib(gpus, **lib)


def run_command(argv: list[str]) -> int:
    """``SCENARIO.json [--calls FILE] -- GPU-TUNE-ARGS...``: the real ``gpu-tune`` main over the
    fake library; with ``--calls``, every C call and its arguments are written there as JSON at
    the end (what a test counts)."""
    sep = argv.index("--")
    opts, args = argv[:sep], argv[sep + 1:]
    lib = read_scenario(Path(opts[0]))
    calls = Path(opts[opts.index("--calls") + 1]) if "--calls" in opts else None
    lib.record = calls is not None
    import pynvml

    pynvml.nvmlLib = lib
    pynvml._nvmlGetFunctionPointer_cache = {}
    pynvml._nvmlLib_refcount = 0
    from gpu_tune.cli import main

    try:
        main(args)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        if calls is not None:
            calls.write_text(json.dumps(lib.call_keys))
    return 0


def command(scenario: Path, *args: str, calls: Path | None = None, timeout: float = 300):
    """Run ``gpu-tune ARGS`` as a process over the fake library of ``scenario`` (the suite's
    ``run_cli``, with only the C library replaced); a CompletedProcess (text)."""
    from tests.conftest import run_cli

    extra = ("--calls", str(calls)) if calls is not None else ()
    return run_cli(*args, timeout=timeout, program=(__file__, str(scenario), *extra, "--"))


if __name__ == "__main__":
    sys.exit(run_command(sys.argv[1:]))
