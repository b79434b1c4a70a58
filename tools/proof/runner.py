"""The processes of a step: its commands, each bounded by the step's deadline, and what it leaves behind."""

from __future__ import annotations

import ctypes
import glob
import json
import os
import signal
import subprocess
import time
from typing import Any

from .common import read_text, say, tail


def _set_subreaper() -> bool:
    """Orphans of our steps (a probe process whose parent was killed) become our children, so
    that they can be found and killed when their step ends."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def our_children(exclude: set[int] = frozenset()) -> list[int]:
    me = os.getpid()
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        text = read_text(stat, 4096) or ""
        try:
            ppid = int(text.rsplit(")", 1)[1].split()[1])
        except (IndexError, ValueError):
            continue
        pid = int(stat.split("/")[2])
        if ppid == me and pid not in exclude:
            out.append(pid)
    return out


def kill_leftovers(exclude: set[int] = frozenset(), grace: float = 10.0) -> list[str]:
    """Stop every process left behind by a step (our children, reparented to us): SIGTERM first
    (``gpu-tune gain`` then puts the host back as it found it), SIGKILL after ``grace`` seconds;
    reap them. Returns "pid command" of each."""
    stopped = []
    for _ in range(3):  # orphans of the ones stopped here come to us in turn
        pids = our_children(exclude)
        if not pids:
            break
        for pid in pids:
            cmd = (read_text(f"/proc/{pid}/cmdline", 400) or "").replace("\0", " ").strip()
            try:
                os.kill(pid, signal.SIGTERM)
                stopped.append(f"{pid} {cmd[:120]}")
            except ProcessLookupError:
                pass
        alive = set(pids)
        t0 = time.monotonic()
        while alive and time.monotonic() - t0 < grace:
            for pid in list(alive):
                try:
                    if os.waitpid(pid, os.WNOHANG)[0] == pid:
                        alive.discard(pid)
                except ChildProcessError:
                    alive.discard(pid)
            time.sleep(0.1)
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
    return stopped


class Runner:
    """Runs commands for one step, each bounded by the step's deadline."""

    def __init__(self, ctx: dict[str, Any]) -> None:
        self.ctx = ctx
        self.deadline = float(ctx["deadline"])
        self.env = dict(os.environ)
        self.env.update(ctx.get("env") or {})
        self.env["PYTHONUNBUFFERED"] = "1"
        self.cwd = ctx["work"]

    def left(self) -> float:
        return self.deadline - time.time()

    def run(self, argv: list[str], timeout: float | None = None, env: dict[str, str] | None = None,
            label: str | None = None) -> dict[str, Any]:
        """{"rc", "stdout", "stderr", "seconds", "timed_out"}; never raises for a failing command."""
        limit = max(1.0, min(timeout or 1e9, self.left() - 2.0))
        full_env = dict(self.env, **(env or {}))
        t0 = time.monotonic()
        say(f"    $ {label or ' '.join(argv[-8:])}  (limit {limit:.0f} s)")
        try:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 env=full_env, cwd=self.cwd, start_new_session=True)
        except OSError as exc:
            return {"rc": None, "stdout": "", "stderr": f"could not start {argv[0]}: {exc}", "seconds": 0.0,
                    "timed_out": False}
        try:
            out, err = p.communicate(timeout=limit)
            timed_out = False
        except subprocess.TimeoutExpired:
            # SIGTERM first (gpu-tune gain and serve then leave the host as they found it), then SIGKILL
            _signal_group(p.pid, signal.SIGTERM)
            try:
                out, err = p.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                _killpg(p.pid)
                try:
                    out, err = p.communicate(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    out, err = b"", b""
            timed_out = True
        _killpg(p.pid)
        return {"rc": None if timed_out else p.returncode, "stdout": out.decode("utf-8", "replace"),
                "stderr": err.decode("utf-8", "replace"), "seconds": round(time.monotonic() - t0, 2),
                "timed_out": timed_out}

    def gpu_tune(self, *args: str, timeout: float | None = None, host: dict[str, Any] | None = None) -> dict[str, Any]:
        host_args = list((host or {}).get("args", []))
        argv = list(self.ctx["gpu_tune"]) + list(args) + host_args
        r = self.run(argv, timeout=timeout, label="gpu-tune " + " ".join(list(args) + host_args))
        r["json"] = None
        text = r["stdout"].strip()
        if text:
            try:
                r["json"] = json.loads(text)
            except ValueError:
                pass
        return r


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _killpg(pgid: int) -> None:
    _signal_group(pgid, signal.SIGKILL)


def why(r: dict[str, Any]) -> str:
    """How a command ended, for a reason: its exit code, or that it was stopped at its limit."""
    if r.get("timed_out"):
        return f"stopped at its time limit after {r['seconds']} s"
    return f"exit {r['rc']}"


def cmd_summary(r: dict[str, Any]) -> dict[str, Any]:
    """What the report keeps of a command: exit code, time, the end of stderr when it failed."""
    out = {"rc": r["rc"], "seconds": r["seconds"]}
    if r.get("timed_out"):
        out["timed_out"] = True
    if r["rc"] not in (0, 1) or r.get("timed_out") or r.get("json") is None:
        out["stderr_tail"] = tail(r["stderr"])
    return out
