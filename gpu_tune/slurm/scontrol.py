"""The one place gpu-tune talks to Slurm: Slurm's own ``scontrol``, run as a child process.

``scontrol`` finds Slurm's configuration itself, the way every Slurm command does:
``SLURM_CONF`` when set, else the path compiled into Slurm (``/etc/slurm/slurm.conf`` on Debian
and Ubuntu, ``/etc/slurm/slurm.conf`` or ``/usr/local/etc/slurm.conf`` in a source build), else a
configless node's cached copy that slurmd keeps (``/run/slurm/conf``). gpu-tune passes its own
environment on untouched, so a ``HealthCheckProgram`` (which slurmd starts with only
``SLURMD_NODENAME`` set: no ``SLURM_CONF``, no ``PATH``) and a ``Prolog`` (``SLURM_CONF`` set)
read the same file that slurmd read.

Failures are typed: :class:`SlurmUnreachable` (exit 3: slurmctld did not answer; nothing was
changed), :class:`SlurmConfigError` (exit 2: no ``scontrol``, or a configuration it cannot
read), :class:`NoSuchNode` (exit 2), :class:`SlurmRefused` (exit 3: slurmctld answered no).
Every call is bounded in time (:data:`TIMEOUT`) and in what it reads back.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Mapping, Sequence

from gpu_tune.errors import GpuTuneError, InputError
from gpu_tune.slurm.node import NodeLineError, SlurmNode, parse_node, parse_nodes

# slurmd gives a HealthCheckProgram 60 s; scontrol's own MessageTimeout is 10 s by default.
TIMEOUT = 30.0
OUTPUT_CAP = 4 << 20
# Where a process started without PATH (slurmd's HealthCheckProgram) looks for scontrol.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/opt/slurm/bin"
# What scontrol says when slurmctld does not answer (slurm_strerror's texts).
UNREACHABLE = ("unable to contact slurm controller", "socket timed out", "connection refused",
               "zero bytes were transmitted or received", "communication connection failure",
               "connection timed out", "no route to host", "backup controller in standby mode",
               "unable to establish controller machine", "slurmctld is down", "network is unreachable")
CONFIG = ("unable to process configuration file", "s_p_parse_file", "could not establish a configuration source",
          "unable to read", "configuration file not found")


class SlurmUnreachable(GpuTuneError):
    """slurmctld did not answer: nothing was changed (exit 3)."""

    exit_code = 3


class SlurmRefused(GpuTuneError):
    """slurmctld answered, and refused (exit 3)."""

    exit_code = 3


class SlurmConfigError(InputError):
    """No ``scontrol``, or Slurm's configuration cannot be read (exit 2)."""


class NoSuchNode(InputError):
    """Slurm has no node of that name (exit 2)."""


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:300]


def _where_conf(env: Mapping[str, str]) -> str:
    conf = env.get("SLURM_CONF")
    return f"SLURM_CONF={conf}" if conf else "SLURM_CONF unset: scontrol's default, /etc/slurm/slurm.conf on Debian"


class Scontrol:
    """``scontrol`` with this process's environment (or ``env``)."""

    def __init__(self, binary: str | None = None, *, env: Mapping[str, str] | None = None,
                 timeout: float = TIMEOUT) -> None:
        self.env = dict(os.environ if env is None else env)
        self.timeout = timeout
        self.binary = binary or shutil.which("scontrol", path=self.env.get("PATH") or DEFAULT_PATH)
        if not self.binary:
            raise SlurmConfigError(f"scontrol not found (PATH {self.env.get('PATH') or DEFAULT_PATH}): run this on a "
                                   "Slurm node, with Slurm's client commands installed")
        conf = self.env.get("SLURM_CONF")
        if conf and not os.path.isfile(conf):  # scontrol would retry reading it for a minute
            raise SlurmConfigError(f"SLURM_CONF={conf}: no such file (Slurm's configuration; unset, Slurm's "
                                   "commands read their default, /etc/slurm/slurm.conf on Debian)")

    def run(self, args: Sequence[str], what: str) -> str:
        argv = [self.binary, *args]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, errors="replace", env=self.env,
                                  timeout=self.timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise SlurmUnreachable(f"slurmctld not reachable: `scontrol {' '.join(args)}` gave no answer in "
                                   f"{self.timeout:.0f} s; nothing changed") from None
        except OSError as exc:
            raise SlurmConfigError(f"{self.binary}: {exc.strerror or exc}") from None
        out, err = proc.stdout[:OUTPUT_CAP], proc.stderr[:OUTPUT_CAP]
        if proc.returncode == 0:
            return out
        said = _first_line(err) or _first_line(out) or f"exit code {proc.returncode}"
        low = (err + out).lower()
        if any(s in low for s in UNREACHABLE):
            raise SlurmUnreachable(f"slurmctld not reachable: {what}: {said}; nothing changed")
        if any(s in low for s in CONFIG):
            raise SlurmConfigError(f"Slurm's configuration ({_where_conf(self.env)}): {what}: {said}")
        raise SlurmRefused(f"{what}: {said}")

    def show_node(self, name: str) -> SlurmNode:
        what = f"scontrol show node {name}"
        try:
            out = self.run(["-a", "-o", "show", "node", name], what)
        except SlurmRefused as exc:
            if "not found" in str(exc).lower() or "invalid node name" in str(exc).lower():
                raise NoSuchNode(f"Slurm has no node {name!r} ({exc})") from None
            raise
        try:
            nodes = parse_nodes(out)
        except NodeLineError as exc:
            raise SlurmRefused(f"{what}: {exc}") from None
        found = [n for n in nodes if n.name == name]
        if not found:
            raise NoSuchNode(f"Slurm has no node {name!r} (`{what}` printed {len(nodes)} other node(s))")
        return found[0]

    def nodes(self) -> list[SlurmNode]:
        out = self.run(["-a", "-o", "show", "node"], "scontrol show node")
        nodes = []
        for line in out.splitlines():
            if line.strip() and not line.startswith("No nodes"):
                try:
                    nodes.append(parse_node(line))
                except NodeLineError:
                    continue
        return nodes

    def update(self, name: str, state: str, reason: str) -> None:
        """``scontrol update NodeName=NAME State=STATE Reason=REASON`` (one argument each: no shell)."""
        self.run(["update", f"NodeName={name}", f"State={state}", f"Reason={reason}"],
                 f"scontrol update NodeName={name} State={state}")
