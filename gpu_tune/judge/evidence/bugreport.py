"""``nvidia-bug-report.sh`` for an evidence bundle, run out of the pass (docs/health.md "Evidence").

The pass that writes a bundle starts a worker (:func:`spawn`: ``python -m
gpu_tune.judge.evidence.bugreport``, a session of its own, stdin/stdout/stderr on ``/dev/null``)
and never waits for it: the agent reaps it at a later pass (:meth:`Worker.reaped`), and a
``gpu-tune check`` that has exited leaves it to init. The worker:

- makes itself its descendants' reaper (``PR_SET_CHILD_SUBREAPER``), so a process the script
  leaves behind, even one that left its process group, is its child to kill and reap;
- runs the script in the bundle's folder (``--output-file nvidia-bug-report.log``: the script
  adds ``.gz``), in a process group of its own, with ``RLIMIT_FSIZE`` at the room left in the
  bundle (the kernel refuses a write past it: the file is cut there, never larger), killed if the
  worker dies (``PR_SET_PDEATHSIG``); its stdout and stderr are read by the worker, the first
  :data:`~gpu_tune.judge.evidence.bundle.OUT_CAP` bytes kept, all counted;
- at the deadline sends the group SIGTERM, after :data:`GRACE_S` SIGKILL, then kills and reaps
  every descendant left; after a script that exits, what it left running in its group is killed
  too;
- writes ``nvidia-bug-report.json`` (``running``, then ``finished``, ``cut at the deadline``,
  ``cut at the size cap`` or ``failed``) with the figures: seconds, exit, bytes kept and produced,
  processes left (0).

The script describes the machine it runs on: it is run only where ``--root`` is that machine
(``/``, or the DaemonSet's ``/host``: the same boot id), found on ``PATH`` or as
``/usr/bin/nvidia-bug-report.sh``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Mapping

SCRIPT = "nvidia-bug-report.sh"
USUAL = ("/usr/bin/nvidia-bug-report.sh",)
GRACE_S = 2.0
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36


def find_script(env: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    found = shutil.which(SCRIPT, path=env.get("PATH", os.defpath))
    if found:
        return found
    return next((p for p in USUAL if os.path.isfile(p) and os.access(p, os.X_OK)), None)


def spawn(root: str, name: str, script: str, timeout: float, log_cap: int, out_cap: int) -> subprocess.Popen:
    """The worker for bundle ``name``, started and not waited for. Raises OSError."""
    import gpu_tune

    here = os.path.dirname(os.path.dirname(os.path.abspath(gpu_tune.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "gpu_tune.judge.evidence.bugreport", "--root", root, "--bundle", name,
           "--script", script, "--timeout", str(timeout), "--log-cap", str(log_cap), "--out-cap", str(out_cap)]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True, env=env)


def words(status: Any, now: float | None = None) -> str:
    """A bug report's status in a few words (``gpu-tune evidence``, ``/readiness``); a status file
    this tool did not write says so."""
    if not isinstance(status, dict):
        return "no status"
    try:
        return _words(status, now)
    except (TypeError, ValueError, AttributeError):
        return "its status file is not in the form gpu-tune writes"


def _words(status: dict, now: float | None) -> str:
    state = str(status.get("state", "?"))
    if state in ("starting", "running"):
        until = status.get("until")
        if isinstance(until, (int, float)) and now is not None and now > until + 30:
            return f"{state}, and no word since its deadline passed: its worker stopped before it could say"
        return f"{state} (stopped at its deadline, {status.get('timeout_s', '?')} s, if not done by then)"
    if state == "not run":
        return f"not run: {status.get('why', '')}"
    if state == "failed":
        return f"failed: {status.get('why', '')}"
    kept = sum(int(f.get("bytes", 0)) for f in status.get("files", []) if isinstance(f, dict))
    out = status.get("output") or {}
    text = f"{state} after {status.get('seconds', '?')} s ({status.get('exit', '?')}); {kept:,} bytes of report kept"
    if out.get("cut"):
        text += f"; its output cut: {out.get('kept', 0):,} of {out.get('produced', 0):,} bytes kept"
    return text + f"; {status.get('left', 0)} process(es) left"


class Worker:
    """A worker the agent started: reaped by a later pass, never waited for."""

    def __init__(self, proc: subprocess.Popen, name: str) -> None:
        self.proc, self.name = proc, name

    def reaped(self) -> bool:
        return self.proc.poll() is not None


# -- the worker process -------------------------------------------------------------------------
def _prctl(option: int, arg: int, libc: Any = None) -> None:
    try:
        (libc or ctypes.CDLL(None, use_errno=True)).prctl(option, ctypes.c_ulong(arg), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _children() -> list[int]:
    """This process's children (its own and those it reaps for: the subreaper's)."""
    pids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{os.getpid()}/task"):
            with open(f"/proc/{os.getpid()}/task/{tid}/children") as f:
                pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return pids


def _kill_all(pgid: int | None) -> int:
    """Kill the group and then every descendant left, reap them all; the ones still there after."""
    if pgid is not None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            if sig == signal.SIGTERM:
                end = time.monotonic() + GRACE_S
                while time.monotonic() < end and _group_alive(pgid):
                    _reap()
                    time.sleep(0.05)
    for _ in range(50):
        kids = _children()
        if not kids:
            break
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap(block=True)
    _reap()
    return len(_children())


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _reap(block: bool = False) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        block = False


def _limits(log_cap: int):
    """What the script's process sets before it runs (the worker is single-threaded: a preexec_fn is
    safe here): the file size limit, SIGXFSZ's default (it ends a writer past the limit), death with
    the worker."""
    import resource

    libc = ctypes.CDLL(None, use_errno=True)  # loaded before the fork, not in the child

    def pre() -> None:
        os.umask(0o027)  # its files as the bundle's own: not for every user to read
        resource.setrlimit(resource.RLIMIT_FSIZE, (log_cap, log_cap))
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, libc)
    return pre


def _exit_words(rc: int | None) -> str:
    if rc is None:
        return "killed at the deadline"
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit {rc}"


def run(fs, name: str, script: str, timeout: float, log_cap: int, out_cap: int) -> dict[str, Any]:
    """Run the script for bundle ``name`` (its folder the current directory), bounded; its status."""
    from gpu_tune.host import fs_tree
    from gpu_tune.judge.evidence import FOLDER
    from gpu_tune.judge.evidence.bundle import BUG_LOG, BUG_OUT

    t0, wall = time.monotonic(), time.time()
    status: dict[str, Any] = {"state": "running", "script": script, "pid": os.getpid(), "started": wall,
                              "until": wall + timeout, "timeout_s": timeout, "cap_bytes": log_cap}
    save(fs, name, status)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    bfd = fs_tree.open_entry(fs, FOLDER, name)
    try:
        os.fchdir(bfd)
    finally:
        os.close(bfd)
    part = f".{BUG_OUT}.part"
    out = os.open(part, fs_tree.O_NEW, 0o640)
    kept = produced = 0
    try:
        proc = subprocess.Popen([script, "--output-file", BUG_LOG], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                preexec_fn=_limits(log_cap))
    except OSError as exc:
        os.close(out)
        os.unlink(part)
        return {**status, "state": "failed", "why": f"{script}: {exc.strerror or exc}"}
    deadline = t0 + timeout
    pipe = proc.stdout.fileno()  # type: ignore[union-attr]
    os.set_blocking(pipe, False)
    open_pipe, rc = True, None
    while time.monotonic() < deadline:
        ready = open_pipe and select.select([pipe], [], [], max(0.0, min(0.2, deadline - time.monotonic())))[0]
        for _ in range(64 if ready else 0):  # what is there now (at most 4 MiB, then the clock again)
            try:
                chunk = os.read(pipe, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                open_pipe = False
                break
            produced += len(chunk)
            if kept < out_cap:
                take = chunk[:out_cap - kept]
                os.write(out, take)
                kept += len(take)
        rc = proc.poll()
        if rc is not None and not ready:  # it exited and said all it had (what it left running is killed below)
            break
        if not open_pipe and rc is None:
            time.sleep(0.05)
    left = _kill_all(proc.pid)  # at the deadline, or what it left running in its group
    if rc is None:
        proc.poll()
    proc.stdout.close()  # type: ignore[union-attr]
    os.close(out)
    os.rename(part, BUG_OUT)
    files = []
    for fname in (BUG_LOG + ".gz", BUG_LOG):
        try:
            size = os.stat(fname, follow_symlinks=False).st_size
        except OSError:
            continue
        files.append({"file": fname, "bytes": size, "cut": size >= log_cap})
    capped = any(f["cut"] for f in files) or rc == -signal.SIGXFSZ
    state = "cut at the deadline" if rc is None else "cut at the size cap" if capped else "finished"
    return {**status, "state": state, "exit": _exit_words(rc), "seconds": round(time.monotonic() - t0, 2),
            "files": files, "output": {"file": BUG_OUT, "kept": kept, "produced": produced, "cut": produced > kept},
            "left": left}


def save(fs, name: str, status: Mapping[str, Any]) -> str | None:
    """Write the status file into the bundle; None, or why not."""
    import json

    from gpu_tune.errors import HostError
    from gpu_tune.host import fs_tree
    from gpu_tune.judge.evidence import FOLDER
    from gpu_tune.judge.evidence.bundle import BUG_STATUS

    try:
        fs_tree.replace_in(fs, FOLDER, name, BUG_STATUS, (json.dumps(dict(status), indent=1) + "\n").encode())
    except HostError as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_tune.judge.evidence.bugreport")
    p.add_argument("--root", required=True)
    p.add_argument("--bundle", required=True)
    p.add_argument("--script", required=True)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--log-cap", type=int, required=True)
    p.add_argument("--out-cap", type=int, required=True)
    a = p.parse_args(argv)
    from gpu_tune.host.fs import HostFS

    fs = HostFS(a.root)
    try:
        status = run(fs, a.bundle, a.script, a.timeout, a.log_cap, a.out_cap)
    except Exception as exc:  # noqa: BLE001 - said in the bundle, never lost
        status = {"state": "failed", "why": f"{type(exc).__name__}: {exc}"[:300]}
        _kill_all(None)
    return 0 if save(fs, a.bundle, status) is None else 1


if __name__ == "__main__":
    sys.exit(main())
