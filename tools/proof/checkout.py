"""The checkout the proof runs from: its commit, and gpu_tune made importable for the commands."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from .common import REPO


def commit_info() -> dict[str, Any]:
    out: dict[str, Any] = {}
    if (REPO / ".git").exists() and shutil.which("git"):
        try:
            head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                                  timeout=20).stdout.strip()
            dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=20).stdout.strip()
            if head:
                out = {"commit": head, "dirty": bool(dirty), "source": "git"}
        except (OSError, subprocess.SubprocessError):
            pass
    if os.environ.get("GPU_TUNE_COMMIT") and os.environ["GPU_TUNE_COMMIT"] != out.get("commit"):
        # the code that ran is the payload's wheel: its commit wins over a copied checkout's git
        out = {"commit": os.environ["GPU_TUNE_COMMIT"], "source": "payload (GPU_TUNE_COMMIT)",
               **({"checkout_git": out["commit"]} if out.get("commit") else {})}
    manifest = Path(os.environ.get("GPU_TUNE_PAYLOAD_DIR", "/tmp/gpu-tune-payload")) / "manifest.json"
    if manifest.is_file():
        try:
            m = json.loads(manifest.read_text())
            out.setdefault("commit", m.get("commit"))
            out.setdefault("source", "payload manifest")
            out["payload_id"] = m.get("payload_id")
            out["payload_dirty"] = m.get("dirty")
        except ValueError:
            pass
    if not out.get("commit"):
        try:
            import gpu_tune  # noqa: PLC0415

            out = {"commit": None, "version": gpu_tune.__version__, "source": "installed gpu_tune"}
        except ImportError:
            out = {"commit": None, "source": "unknown"}
    return out


def child_env() -> dict[str, str]:
    """Make gpu_tune importable for the commands (the repository's own in a checkout without it)."""
    env: dict[str, str] = {}
    probe = subprocess.run([sys.executable, "-c", "import gpu_tune"], cwd="/", capture_output=True)
    if probe.returncode != 0:
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    return env
