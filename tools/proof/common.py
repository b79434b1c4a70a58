"""What every part of the proof shares: the steps and their time, and small functions."""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
FORMAT = 1
STEPS = ("environment", "topology", "health", "tuning", "probe", "torch", "verdict", "fingerprint", "gain", "serve")
# Seconds a step is expected to take (to decide whether it fits the budget) and its hard limit.
EXPECT = {
    "gpu": {"environment": 40, "topology": 10, "health": 10, "tuning": 30, "probe": 75, "fingerprint": 330, "gain": 360,
            "serve": 110, "torch": 50, "verdict": 300},
    "cpu": {"environment": 15, "topology": 5, "health": 5, "tuning": 10, "probe": 25, "fingerprint": 90, "gain": 50,
            "serve": 40, "torch": 30, "verdict": 75},
}
LIMIT = {"environment": 240, "topology": 60, "health": 60, "tuning": 240, "probe": 420, "fingerprint": 1200,
         "gain": 900, "serve": 420, "torch": 300, "verdict": 900}
# The verdict step's runs, in this order (--verdict-runs N takes the first N): the cache emptied
# first (cold: the first probe ever), then warm, without the cache, busy and warm, busy and cold.
VERDICT_PLAN = (("cold", "idle"), ("warm", "idle"), ("none", "idle"), ("warm", "busy"), ("cold", "busy"))
GOAL_WARM_IDLE_S, GOAL_WARM_BUSY_S = 30.0, 40.0  # on the H100
FIXTURE_TUNE = "vm-virtio-2node"  # a VM with an H100 passed through (tests/fixtures/pcigen.py)
FIXTURE_RUN = "small-2cpu"  # CPUs 0-1 exist on every test machine: the probe binds to them
STATUSES = ("passed", "failed", "error", "timeout", "skipped", "not_run")


# -- small functions ----------------------------------------------------------------------------
def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def say(msg: str) -> None:
    print(msg, flush=True)


def read_text(path: str | Path, limit: int = 1 << 20) -> str | None:
    try:
        with open(path, "rb") as fh:
            return fh.read(limit).decode("utf-8", "replace")
    except OSError:
        return None


def tail(text: str | bytes | None, lines: int = 12) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    kept = [ln for ln in (text or "").rstrip().splitlines() if ln.strip()]
    return "\n".join(kept[-lines:])[-3000:]


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def vm_status(pid: int) -> dict[str, float]:
    out = {}
    for line in (read_text(f"/proc/{pid}/status") or "").splitlines():
        key, _, val = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = round(int(val.split()[0]) / 1024.0, 1)  # MiB
    return out


def cpu_model() -> str | None:
    for line in (read_text("/proc/cpuinfo") or "").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return None


def _onoff(v: Any) -> str:
    return "on" if v is True else "off" if v is False else str(v)


def _gbps(v: Any) -> str:
    return f"{v / 1e9:,.1f} GB/s" if isinstance(v, (int, float)) else "-"


def _num(v: Any) -> str:
    return f"{v:,.0f}" if isinstance(v, (int, float)) else "-"


def _pct(v: Any) -> str:
    return f"{v * 100:.0f}%" if isinstance(v, (int, float)) else "-"
