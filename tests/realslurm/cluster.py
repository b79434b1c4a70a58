"""One real Slurm on this machine: munged, slurmctld and slurmd (Debian's 22.05) on 127.0.0.1.

Everything lives in one folder (:class:`SlurmCluster` ``base``): munge's key (its own, made with
``mungekey``) and socket, ``slurm.conf`` and ``gres.conf``, the controller's state, slurmd's
spool, the logs, eight character devices standing for ``/dev/nvidia0..7`` (Slurm 22.05 counts a
GPU only with a ``File=``), and the three programs slurmd runs, ``health-check``, ``prolog`` and
``epilog``, which a test rewrites (:meth:`SlurmCluster.use`). Ports are free ones of 127.0.0.1.

Beside the one node with a slurmd (:data:`NODE`) the configuration names :data:`FLEET`: 20 more
GPU nodes in a partition of their own with no slurmd of their own (``NodeAddr=127.0.0.1`` and
``SlurmdTimeout=0`` keep them idle and drainable), for the tests of the blast-radius limit, which
run ``gpu-tune check --slurm --slurm-node NAME`` for them.

slurmd runs in a mount namespace of its own in which the folder's ``etc`` is bound over
``/etc/slurm``: slurmd, and every ``scontrol`` its ``HealthCheckProgram`` and ``Prolog`` run,
find ``/etc/slurm/slurm.conf`` as on a real node, with no ``SLURM_CONF`` (slurmd gives a health
check program only ``SLURMD_NODENAME``). The test process and slurmctld use ``SLURM_CONF``.

Every process is started in one cgroup of this run (every process slurmd starts, slurmstepd and
jobs included, stays in it) and recorded in the run's ledger before it starts
(:mod:`tests.realkube.cleanup`): :meth:`SlurmCluster.stop` ends them, then kills whatever is
left in the cgroup, and a run killed outright is cleaned by the janitor of the next run.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from tests.realkube.cleanup import Ledger, cgroup_mounts, cgroup_pids, kill_cgroup
from tests.realkube.procs import Proc

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
NODE = "gpu-slurm-0"  # not the host's name: gpu-tune must learn it from Slurm
PARTITION = "gpu"
GPUS = 8
FLEET = tuple(f"gpu-slurm-{i}" for i in range(1, 21))  # no slurmd of their own
FLEET_PARTITION = "fleet"
PROGRAMS = ("health-check", "prolog", "epilog")
HEALTH_INTERVAL = 3  # seconds (HealthCheckInterval)
TOOLS = {"munged": "munge", "mungekey": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd",
         "scontrol": "slurm-client", "sinfo": "slurm-client", "sbatch": "slurm-client", "squeue": "slurm-client",
         "scancel": "slurm-client", "unshare": "util-linux", "mount": "mount"}


class SlurmError(RuntimeError):
    pass


@dataclass(frozen=True)
class Run:
    """One run of a program slurmd ran: who ran it (``SLURM_SCRIPT_CONTEXT``, or health_check),
    start and end (``time.time()`` seconds), exit code, ``SLURM_CONF`` as it saw it ("unset"), and
    the CPU seconds (user + system) of what it ran."""

    context: str
    start: float
    end: float
    rc: int
    conf: str
    cpu: float

    @property
    def wall(self) -> float:
        return self.end - self.start

    @classmethod
    def parse(cls, line: str) -> "Run":
        ctx, a, b, rc, conf, cpu = line.split()
        secs = sum(float(m) * 60 + float(s) for m, s in re.findall(r"(\d+)m([\d.]+)s", cpu))
        return cls(ctx, int(a) / 1e9, int(b) / 1e9, int(rc), conf, secs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, fn: Callable[[], T | None], timeout: float, every: float = 0.1) -> T:
    """Poll ``fn`` until it returns something true; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = fn()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s (last: {last!r})")
        time.sleep(every)


def _tracking_root() -> Path:
    """One cgroup hierarchy to keep every process of the cluster in (v2, else v1's pids, else any
    but cpuset, whose new groups take no process before their CPUs are set)."""
    mounts = cgroup_mounts()
    for want in ("cgroup2", "pids", "systemd"):
        for root, kind in mounts.items():
            if kind == want or root.name == want or root.name == f"name={want}":
                if (root / "cgroup.procs").exists():
                    return root
    for root in mounts:
        if root.name != "cpuset" and (root / "cgroup.procs").exists():
            return root
    raise SlurmError("no cgroup hierarchy to keep the cluster's processes in")


class SlurmCluster:
    def __init__(self, base: Path, ledger: Ledger) -> None:
        self.base = base
        self.ledger = ledger
        self.etc = base / "etc"
        self.conf = self.etc / "slurm.conf"
        self.log = base / "log"
        self.ctld_port, self.slurmd_port = free_port(), free_port()
        self.cgroup = f"gpu-tune-slurm-{os.getpid()}"
        # munged wants every folder above its socket searchable by all (pytest's are not)
        self.run_dir = Path("/run") / f"gpu-tune-slurm-{os.getpid()}"
        self.cg_root = _tracking_root()
        self.procs: list[Proc] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.timings: dict[str, float] = {}
        self.hostname = socket.gethostname()

    # -- files ------------------------------------------------------------------------------------
    def _write(self, path: Path, text: str, mode: int = 0o644) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        tmp.chmod(mode)
        os.replace(tmp, path)

    def _files(self) -> None:
        b = self.base
        for d in ("etc", "key", "state", "spool", "log", "dev", "jobs"):
            (b / d).mkdir(parents=True, exist_ok=True)
        (b / "key").chmod(0o700)
        self.ledger.note("paths", str(self.run_dir))
        self.run_dir.mkdir(mode=0o755, exist_ok=True)
        subprocess.run(["mungekey", "--create", f"--keyfile={b / 'key' / 'munge.key'}"], check=True,
                       capture_output=True)
        for i in range(GPUS):  # character devices as /dev/nvidiaN (Slurm stats them; nothing opens them)
            dev = b / "dev" / f"nvidia{i}"
            if not dev.exists():
                os.mknod(dev, 0o600 | 0o020000, os.makedev(1, 3))
        self._write(self.conf, self.slurm_conf())
        self._write(self.etc / "gres.conf", f"NodeName={NODE} Name=gpu File={b}/dev/nvidia[0-{GPUS - 1}]\n")
        for name in PROGRAMS:
            self.use(name, "")

    def slurm_conf(self) -> str:
        b = self.base
        return "\n".join([
            "ClusterName=gputune",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={self.slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.run_dir}/munge.socket",
            f"StateSaveLocation={b}/state",
            f"SlurmdSpoolDir={b}/spool",
            f"SlurmctldPidFile={b}/slurmctld.pid",
            f"SlurmdPidFile={b}/slurmd.pid",
            f"SlurmctldLogFile={self.log}/slurmctld.log",
            f"SlurmdLogFile={self.log}/slurmd.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "GresTypes=gpu",
            "ReturnToService=1",  # an administrator's DOWN stays down
            "SlurmdTimeout=0",  # never marks a node down for not answering: the fleet has no slurmd
            "InactiveLimit=0",
            "KillWait=2",
            f"HealthCheckProgram={b}/health-check",
            f"HealthCheckInterval={HEALTH_INTERVAL}",
            "HealthCheckNodeState=ANY",
            f"Prolog={b}/prolog",
            f"Epilog={b}/epilog",
            f"NodeName={NODE} NodeHostname={self.hostname} NodeAddr=127.0.0.1 CPUs=1 RealMemory=100 "
            f"Gres=gpu:{GPUS} State=UNKNOWN",
            f"NodeName=gpu-slurm-[1-{len(FLEET)}] NodeAddr=127.0.0.1 CPUs=1 RealMemory=100 Gres=gpu:{GPUS} "
            "State=UNKNOWN",
            f"PartitionName={PARTITION} Nodes={NODE} Default=YES MaxTime=INFINITE State=UP",
            f"PartitionName={FLEET_PARTITION} Nodes=gpu-slurm-[1-{len(FLEET)}] Default=NO MaxTime=INFINITE State=UP",
            "",
        ])

    def use(self, program: str, command: str) -> None:
        """Make slurmd's ``program`` (``health-check``, ``prolog`` or ``epilog``) run ``command`` (shell words),
        recording each run in ``runs-<program>`` (:meth:`runs`); an empty command exits 0 at once."""
        runs, times = self.base / f"runs-{program}", self.base / f".times-{program}"
        body = f"{command}\nrc=$?\n" if command else "rc=0\n"
        # slurmctld asks every node whose NodeAddr is slurmd's for a health check: the fleet's 20 too,
        # so slurmd gets 21 requests an interval; one runs, the others end at once, unrecorded
        once = (f"exec 9>>{self.base}/.lock-{program}\n/usr/bin/flock -n 9 || exit 0\n"
                if program == "health-check" else "")
        self._write(self.base / program,
                    "#!/bin/sh\n# the test's; slurmd runs it with its own environment (no SLURM_CONF, no PATH)\n"
                    + once + "start=$(/bin/date +%s%N)\n" + body +
                    f"end=$(/bin/date +%s%N)\ntimes > {times}.$$\n"  # the CPU time of what it ran
                    f"cpu=$(/usr/bin/tail -n 1 {times}.$$ | /usr/bin/tr ' ' ,)\n/bin/rm -f {times}.$$\n"
                    f'echo "${{SLURM_SCRIPT_CONTEXT:-health_check}} $start $end $rc ${{SLURM_CONF:-unset}} $cpu" '
                    f">> {runs}\nexit $rc\n", 0o755)

    def runs(self, program: str) -> list[Run]:
        """Each finished run of ``program``, in order."""
        try:
            lines = (self.base / f"runs-{program}").read_text().splitlines()
        except FileNotFoundError:
            return []
        return [Run.parse(ln) for ln in lines if ln.strip()]

    def busy(self) -> list[int]:
        """The gpu-tune processes slurmd's programs are running now."""
        out = []
        for pid in cgroup_pids(self.cgroup, [self.cg_root]):
            try:
                if b"gpu_tune" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    out.append(pid)
            except OSError:
                continue
        return out

    def gpu_tune_command(self, root: Path, fixture: Path, policies: Path, *extra: str) -> str:
        """``gpu-tune check --slurm`` on a fixture host, as a program slurmd runs."""
        argv = [sys.executable, "-m", "gpu_tune", "check", "--slurm", "--root", str(root), "--gpu-backend", "fixture",
                "--gpu-fixture", str(fixture), "--policy-dir", str(policies), "--profile", "health", *extra]
        # stdout: what slurmd writes to its log when the program fails; stderr: the line saying what
        # gpu-tune did, kept in gpu-tune.log
        return (f"PYTHONPATH={shlex.quote(str(REPO))} {' '.join(shlex.quote(a) for a in argv)} "
                f"2>>{self.base}/gpu-tune.log")

    # -- processes ------------------------------------------------------------------------------
    def _proc(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        procs = self.cg_root / self.cgroup / "cgroup.procs"
        inner = " ".join(shlex.quote(a) for a in argv)
        p = Proc(name, ["sh", "-c", f"echo $$ > {shlex.quote(str(procs))} && exec {inner}"], self.log / f"{name}.out",
                 self.ledger, env=env or self.env, grace=10.0)
        self.procs.append(p)
        return p.start()

    def start(self) -> None:
        t0 = time.monotonic()
        self.ledger.note("cgroups", self.cgroup)
        (self.cg_root / self.cgroup).mkdir(exist_ok=True)
        self._files()
        b = self.base
        r = self.run_dir
        self._proc("munged", ["munged", "-F", f"--socket={r}/munge.socket", f"--key-file={b}/key/munge.key",
                              f"--pid-file={r}/munged.pid", f"--log-file={self.log}/munged.log",
                              f"--seed-file={b}/key/munged.seed"])
        wait_for("munged's socket", lambda: (r / "munge.socket").exists() or self._check(), 20)
        self._proc("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        wait_for("slurmctld answering", lambda: self.scontrol("ping", check=False).returncode == 0 or self._check(),
                 30, every=0.2)
        # slurmd reads /etc/slurm/slurm.conf (the default) in its own mount namespace
        self._proc("slurmd", ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                              f"mount --bind {shlex.quote(str(self.etc))} /etc/slurm && exec slurmd -D -N {NODE}"],
                   env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        wait_for(f"{NODE} idle", lambda: self.node().get("State") == "IDLE" or self._check(), 120, every=0.2)
        wait_for("the fleet idle", lambda: set(self.states(FLEET).values()) == {"IDLE"} or self._check(), 120,
                 every=0.2)
        self.timings["slurm ready (s)"] = time.monotonic() - t0

    def _check(self) -> bool:
        for p in self.procs:
            p.check()
        return False

    def stop(self) -> list[str]:
        """End the cluster; returns what was left behind (processes still in its cgroup)."""
        t0 = time.monotonic()
        if self.procs and all(p.running() for p in self.procs):
            self.scontrol("update", f"PartitionName={PARTITION}", "State=DOWN", check=False)
            subprocess.run(["scancel", "--full", "--partition", PARTITION], env=self.env, capture_output=True)
        for p in reversed(self.procs):
            p.stop()
        kill_cgroup(self.cgroup, roots=[self.cg_root])
        left = [f"process {pid} still in cgroup {self.cgroup}" for pid in cgroup_pids(self.cgroup, [self.cg_root])]
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if (self.cg_root / self.cgroup).exists():
            left.append(f"cgroup {self.cg_root / self.cgroup} still there")
        self.timings["slurm stopped (s)"] = time.monotonic() - t0
        return left

    # -- Slurm's commands ---------------------------------------------------------------------------
    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        r = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise SlurmError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip() or r.stdout.strip()}")
        return r

    def scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run("scontrol", *args, check=check)

    def node(self) -> dict[str, str]:
        """The node as ``scontrol -o show node`` prints it (key -> value; Reason without [user@time])."""
        from gpu_tune.slurm.node import parse_node, split_line

        r = self.scontrol("-o", "show", "node", NODE, check=False)
        if r.returncode != 0:
            return {}
        kv = split_line(r.stdout)
        n = parse_node(r.stdout)
        kv.update(Reason=n.reason, ReasonBy=n.reason_by)
        return kv

    def nodes(self) -> dict:
        """Every node as ``scontrol -o show node`` prints it, by name (one call)."""
        from gpu_tune.slurm.node import parse_nodes

        return {n.name: n for n in parse_nodes(self.scontrol("-a", "-o", "show", "node").stdout)}

    def states(self, names) -> dict[str, str]:
        return {k: n.state for k, n in self.nodes().items() if k in names}

    def sdiag(self) -> dict[str, int]:
        """slurmctld's RPC counts by message type (``sdiag``), and ``user:NAME`` by user."""
        out, rows, by_user = self.run("sdiag").stdout, {}, False
        for line in out.splitlines():
            by_user = by_user or line.startswith("Remote Procedure Call statistics by user")
            m = re.match(r"\s+(\S+)\s+\(\s*\d+\)\s+count:(\d+)", line)
            if m:
                rows[("user:" if by_user else "") + m.group(1)] = int(m.group(2))
        return rows

    def sinfo_reasons(self) -> dict[str, str]:
        """``sinfo -R``'s reasons, whole (``%E``, no width): node -> reason."""
        out = self.run("sinfo", "-R", "-h", "-o", "%N|%E").stdout
        return dict(ln.split("|", 1) for ln in out.splitlines() if "|" in ln)

    def submit(self, command: str = "true") -> str:
        out = self.base / "jobs" / "%j.out"
        return self.run("sbatch", "--parsable", "-p", PARTITION, "-o", str(out), "--wrap", command).stdout.strip()

    def job(self, job_id: str) -> dict[str, str]:
        r = self.scontrol("-o", "show", "job", job_id, check=False)
        if r.returncode != 0:
            return {}
        return dict(tok.split("=", 1) for tok in r.stdout.split() if "=" in tok)

    def reset(self) -> None:
        """Between tests: no job, the programs doing nothing and their records (and gpu-tune.log) empty,
        the node idle with no reason and the configuration's Gres (a test may lower it with ``scontrol
        update Gres=``), the fleet idle."""
        for program in PROGRAMS:
            self.use(program, "")
        wait_for("slurmd's programs done", lambda: not self.busy(), 30)
        self.run("scancel", "--full", "--partition", PARTITION, check=False)
        wait_for("no job left", lambda: not self.run("squeue", "-h", "-p", PARTITION).stdout.strip(), 120, every=0.2)
        if self.node().get("Gres") != f"gpu:{GPUS}":
            self.scontrol("reconfigure")
            wait_for(f"{NODE} Gres=gpu:{GPUS} again", lambda: self.node().get("Gres") == f"gpu:{GPUS}", 120, every=0.2)
        node = self.node()
        if node.get("State") != "IDLE":
            self.scontrol("update", f"NodeName={NODE}", "State=RESUME", check=False)
        wait_for(f"{NODE} idle", lambda: self.node().get("State") == "IDLE", 120, every=0.2)
        held = sorted(k for k, state in self.states(FLEET).items() if state != "IDLE")
        for name in held:
            self.scontrol("update", f"NodeName={name}", "State=RESUME", check=False)
        if held:
            wait_for("the fleet idle", lambda: set(self.states(FLEET).values()) == {"IDLE"}, 120, every=0.2)
        for program in PROGRAMS:
            (self.base / f"runs-{program}").unlink(missing_ok=True)
        (self.base / "gpu-tune.log").unlink(missing_ok=True)  # what gpu-tune said is this test's alone
