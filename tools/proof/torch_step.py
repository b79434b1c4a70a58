"""The torch step: the device-bound regime's network in PyTorch eager (tools/torch_cnn.py)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from .common import REPO, _num, _pct, tail
from .runner import Runner, cmd_summary, why


def torch_env() -> dict[str, str]:
    """PyTorch as the machine has it: without the folders the payload's bootstrap put first on
    PYTHONPATH and LD_LIBRARY_PATH for TensorFlow (its CUDA 12 runtime, the CUDA 12 sonames that
    point at CUDA 13, its copies of typing_extensions and the like), with this checkout's
    gpu_tune (NumPy-only modules: the data loader and the NVML sampler) on the path."""
    site = os.environ.get("GPU_TUNE_SITE_DIR")
    added = set(filter(None, os.environ.get("GPU_TUNE_LD_ADDED", "").split(":")))
    pp = [p for p in os.environ.get("PYTHONPATH", "").split(":") if p and p != site]
    env = {"PYTHONPATH": ":".join([str(REPO)] + pp)}
    if added:
        env["LD_LIBRARY_PATH"] = ":".join(p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":")
                                          if p and p not in added)
    return env


def step_torch(ctx: dict[str, Any], r: Runner) -> dict[str, Any]:
    argv = [sys.executable, str(REPO / "tools" / "torch_cnn.py"), "--device", ctx["device"],
            "--seconds", str(ctx["torch_seconds"])]
    if ctx.get("data"):
        argv += ["--data", ctx["data"]]
    t = r.run(argv, timeout=240, env=torch_env(), label="python tools/torch_cnn.py --device " + ctx["device"])
    try:
        doc = json.loads(t["stdout"].strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"status": "failed", "reason": f"tools/torch_cnn.py: {why(t)}: {tail(t['stderr'], 4)}",
                "data": {"command": cmd_summary(t)}}
    if doc.get("error_kind") == "missing":
        return {"status": "skipped", "reason": doc.get("error"), "summary": doc.get("error"), "data": doc}
    if not doc.get("ok"):
        return {"status": "failed", "reason": doc.get("error") or f"exit {t['rc']}", "data": doc}
    summary = (f"PyTorch {doc['torch']} eager, batch {doc['batch_size']}, {doc['precision']}: "
               f"{_num(doc['images_per_second'])} img/s (GPU busy {_pct(doc.get('gpu_busy_fraction'))}, "
               f"{doc['steps']} steps in {doc['seconds']} s)")
    return {"status": "passed", "reason": "", "summary": summary, "data": doc}
