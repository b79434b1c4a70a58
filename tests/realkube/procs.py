"""A component process: started in its own process group (optionally inside a network
namespace, and a mount namespace), its output in a log file, recorded in the run's ledger before
anything else."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.realkube.cleanup import Ledger, alive, kill_tree, start_time


class Proc:
    def __init__(self, name: str, argv: list[str], log: Path, ledger: Ledger, *, netns: str | None = None,
                 env: dict[str, str] | None = None, grace: float = 10.0, prlimit: list[str] | None = None,
                 mntns: str | None = None) -> None:
        self.name, self.log, self.ledger, self.grace = name, log, ledger, grace
        cmd = list(argv)
        if prlimit:
            cmd = ["prlimit", *prlimit, "--", *cmd]
        if netns or mntns:  # (a persistent mount namespace: a file that unshare --mount=FILE bound it to)
            cmd = ["nsenter", *([f"--net=/run/netns/{netns}"] if netns else []),
                   *([f"--mount={mntns}"] if mntns else []), "--", *cmd]
        self.argv = cmd
        self.env = env
        self.popen: subprocess.Popen | None = None
        self.started: str | None = None

    def start(self) -> "Proc":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True, env=self.env, close_fds=True)
        self.started = start_time(self.popen.pid)
        self.ledger.note("procs", {"pid": self.popen.pid, "started": self.started, "what": self.name,
                                   "grace": self.grace})
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None and alive(self.pid, self.started)

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        if self.popen is None:
            return
        kill_tree(self.pid, self.started, grace=self.grace)
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def check(self) -> None:
        """Raise with the log's tail when the process has exited."""
        if self.popen is not None and self.popen.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.popen.returncode}; {self.log} ends:\n{self.tail()}")


def env_without_proxy() -> dict[str, str]:
    """The environment minus proxy settings: a component talks to 127.0.0.1 and the node."""
    return {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
