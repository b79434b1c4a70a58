"""The one place gpu-tune talks to Slurm: Slurm's own ``scontrol``, run as a child process.

``scontrol`` finds Slurm's configuration itself, the way every Slurm command does:
``SLURM_CONF`` when set, else the path compiled into Slurm (``/etc/slurm/slurm.conf`` on Debian
and Ubuntu, ``/etc/slurm/slurm.conf`` or ``/usr/local/etc/slurm.conf`` in a source build), else a
configless node's cached copy that slurmd keeps (``/run/slurm/conf``). gpu-tune passes its own
environment on untouched, so a ``HealthCheckProgram`` (which slurmd starts with only
``SLURMD_NODENAME`` set: no ``SLURM_CONF``, no ``PATH``) and a ``Prolog`` (``SLURM_CONF`` set)
read the same file that slurmd read.

Failures are typed: :class:`SlurmUnreachable` (exit 3: slurmctld did not answer),
:class:`NoAnswer` (the same, when no answer came in time: a write may still land),
:class:`SlurmConfigError` (exit 2: no ``scontrol``, or a configuration it cannot read),
:class:`NoSuchNode` (exit 2), :class:`SlurmRefused` (exit 3: slurmctld answered no, or
``scontrol`` printed what cannot be read). What was changed is said by the caller
(:mod:`gpu_tune.slurm.health`), which knows which calls came before.

Times: every call runs with ``TZ=UTC0`` and ``SLURM_TIME_FORMAT=standard``, so the time Slurm
stamps on a reason reads ``2026-11-28T04:28:01``, in UTC, on every node whatever its time zone or
the site's ``SLURM_TIME_FORMAT``: the order the blast-radius limit ranks drains by
(:mod:`gpu_tune.slurm.fleet`) is then the same on every node, and ``[user@time]`` always parses.

Bounds: the calls of one pass share one deadline (:data:`BUDGET` seconds from the first,
``GPU_TUNE_SLURM_TIMEOUT``), well inside the 60 s slurmd gives a ``HealthCheckProgram``; a call
still running at the deadline is stopped (``SIGKILL`` to its process group) and the pass asked no
further. ``scontrol``'s output is read as it comes, at most :data:`OUTPUT_CAP` bytes of it (per
line, where the whole listing of nodes is read line by line), and the child stopped as soon as
there is more: 300 MB printed costs what 4 MiB does.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import time
from typing import Callable, Mapping, Sequence

from gpu_tune.errors import GpuTuneError, InputError
from gpu_tune.slurm.node import NodeLineError, SlurmNode, parse_node, parse_nodes

# slurmd gives a HealthCheckProgram 60 s; scontrol's own MessageTimeout is 10 s by default. The
# checks before the Slurm part take about half a second, so the calls of one pass share 40 s.
BUDGET = 40.0
BUDGET_VAR = "GPU_TUNE_SLURM_TIMEOUT"
OUTPUT_CAP = 4 << 20
_CHUNK = 1 << 16
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
    """slurmctld did not answer (exit 3)."""

    exit_code = 3


class NoAnswer(SlurmUnreachable):
    """No answer before the pass's deadline: the call was stopped; a write may still land."""


class SlurmRefused(GpuTuneError):
    """slurmctld answered, and refused; or scontrol printed what cannot be read (exit 3)."""

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


def _stop(proc: subprocess.Popen) -> None:
    """End a child not yet reaped, and whatever it started (its own process group), then reap it."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:  # pragma: no cover (gone between the check and the kill)
            pass
        proc.wait()
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()


class Scontrol:
    """``scontrol`` with this process's environment (or ``env``); every call of one instance
    shares one deadline (``timeout`` seconds from the first call, else ``GPU_TUNE_SLURM_TIMEOUT``,
    else :data:`BUDGET`)."""

    def __init__(self, binary: str | None = None, *, env: Mapping[str, str] | None = None,
                 timeout: float | None = None) -> None:
        from gpu_tune.tune.engine import env_seconds

        self.env = dict(os.environ if env is None else env)
        self.env.update(TZ="UTC0", SLURM_TIME_FORMAT="standard")  # reason times alike on every node (above)
        self.timeout = timeout if timeout is not None else env_seconds(BUDGET_VAR, BUDGET, 3600.0, least=1.0,
                                                                       env=self.env)
        self._end: float | None = None
        self.binary = binary or shutil.which("scontrol", path=self.env.get("PATH") or DEFAULT_PATH)
        if not self.binary:
            raise SlurmConfigError(f"scontrol not found (PATH {self.env.get('PATH') or DEFAULT_PATH}): run this on a "
                                   "Slurm node, with Slurm's client commands installed")
        conf = self.env.get("SLURM_CONF")
        if conf and not os.path.isfile(conf):  # scontrol would retry reading it for a minute
            raise SlurmConfigError(f"SLURM_CONF={conf}: no such file (Slurm's configuration; unset, Slurm's "
                                   "commands read their default, /etc/slurm/slurm.conf on Debian)")

    def _no_answer(self, what: str, ran: bool = True) -> NoAnswer:
        how = "gave no answer within" if ran else "not run: no time left of"
        return NoAnswer(f"slurmctld not reachable: `{what}` {how} the {self.timeout:g} s a pass has for Slurm "
                        f"({BUDGET_VAR})")

    def _call(self, args: Sequence[str], what: str,
              lines: Callable[[bytes], None] | None) -> tuple[int, str, str]:
        """(exit code, stdout, stderr). With ``lines``, each line of stdout goes there as it comes
        and is not kept. Stopped at the deadline (:class:`NoAnswer`) or past :data:`OUTPUT_CAP`
        (:class:`SlurmRefused`)."""
        now = time.monotonic()
        if self._end is None:
            self._end = now + self.timeout
        if now >= self._end:
            raise self._no_answer(what, ran=False)
        try:
            proc = subprocess.Popen([self.binary, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=self.env, start_new_session=True)
        except OSError as exc:
            raise SlurmConfigError(f"{self.binary}: {exc.strerror or exc}") from None
        out, err = bytearray(), bytearray()
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(proc.stdout, selectors.EVENT_READ, out)  # type: ignore[arg-type]
                sel.register(proc.stderr, selectors.EVENT_READ, err)  # type: ignore[arg-type]
                while sel.get_map():
                    left = self._end - time.monotonic()
                    if left <= 0:
                        raise self._no_answer(what)
                    for key, _ in sel.select(left):
                        buf = key.data
                        chunk = os.read(key.fd, min(_CHUNK, OUTPUT_CAP + 1 - len(buf)))  # never past cap + 1
                        if not chunk:
                            sel.unregister(key.fileobj)
                            continue
                        buf += chunk
                        if lines is not None and buf is out and b"\n" in chunk:
                            cut = buf.rindex(b"\n")
                            for line in bytes(buf[:cut]).split(b"\n"):
                                lines(line)
                            del buf[:cut + 1]
                        if len(buf) > OUTPUT_CAP:
                            raise SlurmRefused(f"`{what}`: more than {OUTPUT_CAP >> 20} MiB of output"
                                               f"{' in one line' if lines is not None else ''}: scontrol stopped, "
                                               "its answer not read")
            try:
                rc = proc.wait(timeout=max(0.0, self._end - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise self._no_answer(what) from None
        finally:
            _stop(proc)
        if lines is not None and out:
            lines(bytes(out))
            out.clear()
        return rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")

    def run(self, args: Sequence[str], what: str, lines: Callable[[bytes], None] | None = None) -> str:
        rc, out, err = self._call(args, what, lines)
        if rc == 0:
            return out
        said = _first_line(err) or _first_line(out) or f"exit code {rc}"
        low = (err + out).lower()
        if any(s in low for s in UNREACHABLE):
            raise SlurmUnreachable(f"slurmctld not reachable: {what}: {said}")
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

    def each_node(self, each: Callable[[SlurmNode], None]) -> int:
        """Every node of ``scontrol show node`` to ``each``, and how many lines it printed: read
        line by line, so a listing of any length costs one line's memory. A line that cannot be
        read is passed over."""
        count = 0

        def line(raw: bytes) -> None:
            nonlocal count
            text = raw.decode("utf-8", "replace")
            if not text.strip() or text.startswith("No nodes"):
                return
            count += 1
            try:
                node = parse_node(text)
            except NodeLineError:
                return
            each(node)

        self.run(["-a", "-o", "show", "node"], "scontrol show node", lines=line)
        return count

    def find_nodes(self, keep: Callable[[SlurmNode], bool], most: int = 100) -> tuple[list[SlurmNode], int]:
        """The nodes of ``scontrol show node`` for which ``keep`` is true (at most ``most``), and
        how many lines it printed (:meth:`each_node`)."""
        found: list[SlurmNode] = []

        def each(node: SlurmNode) -> None:
            if len(found) < most and keep(node):
                found.append(node)

        return found, self.each_node(each)

    def update(self, name: str, state: str, reason: str) -> None:
        """``scontrol update NodeName=NAME State=STATE Reason=REASON`` (one argument each: no shell)."""
        self.run(["update", f"NodeName={name}", f"State={state}", f"Reason={reason}"],
                 f"scontrol update NodeName={name} State={state}")
