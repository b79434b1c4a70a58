"""The readiness probe, agent side: plan targets, spawn the workload, judge its result.

Each target runs ``python -m workload.mnist_probe`` in its own process group behind a command
prefix (the NUMA binder) and an environment (CUDA_VISIBLE_DEVICES, allocator preload). A hard
timeout kills the whole group. Targets on different NUMA nodes run in parallel, targets on the
same node one after another. The verdict is judged against the profile's ``probe`` section and
``policies/baselines.yaml``. TensorFlow is never imported here.
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import InputError
from .parse import ParseError, format_cpulist, parse_cpulist
from .policy import ProbePolicy, default_policy_dir

WORKLOAD_MODULE = "workload.mnist_probe"
STDERR_TAIL_LINES = 25
STATUSES = ("passed", "failed", "timeout", "crashed", "skipped", "error")


# -- baselines ---------------------------------------------------------------------------------
def normalize_pci_device(dev: str | int | None) -> str | None:
    """``0x2330`` / ``2330`` / ``10de:2330`` / 0x2330 -> ``0x2330``; None when unusable."""
    if dev is None:
        return None
    if isinstance(dev, int):
        return f"0x{dev:04x}"
    s = str(dev).strip().lower()
    if ":" in s:
        s = s.rsplit(":", 1)[1]
    s = s[2:] if s.startswith("0x") else s
    try:
        return f"0x{int(s, 16):04x}"
    except ValueError:
        return None


class Baseline(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    names: list[str] = Field(default_factory=list)
    pci_device_ids: list[str] = Field(default_factory=list)
    train_images_per_second: float = Field(gt=0)
    batch_size: int | None = Field(None, ge=1)
    source: str = ""
    # False for a target that no healthy node has measured yet: reported against, never failed
    # on (an unmeasured number must not take a fleet's nodes out of service).
    measured: bool = True

    @field_validator("pci_device_ids")
    @classmethod
    def _ids(cls, v: list[str]) -> list[str]:
        out = []
        for d in v:
            n = normalize_pci_device(d)
            if n is None:
                raise ValueError(f"{d!r} is not a PCI device id (expected e.g. '0x2330')")
            out.append(n)
        return out


class Baselines(BaseModel):
    """Train throughput of a healthy node per GPU model (and optionally for CPU runs)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    gpus: list[Baseline] = Field(default_factory=list)
    cpu: Baseline | None = None
    path: str = ""

    def for_gpu(self, name: str | None, pci_device_id: str | None) -> Baseline | None:
        want = (name or "").strip().lower()
        dev = normalize_pci_device(pci_device_id)
        if want:
            for b in self.gpus:
                if any(want == n.strip().lower() for n in b.names):
                    return b
        if dev:
            for b in self.gpus:
                if dev in b.pci_device_ids:
                    return b
        return None


def load_baselines(policy_dir: str | os.PathLike[str] | None = None) -> Baselines:
    """Read ``<policy_dir>/baselines.yaml``; a missing file means no baselines (all unknown)."""
    import yaml

    pdir = Path(policy_dir) if policy_dir else default_policy_dir()
    path = pdir / "baselines.yaml"
    if not path.exists():
        return Baselines(path=str(path))
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"{path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise InputError(f"{path}{where}: malformed YAML: {getattr(exc, 'problem', None) or exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a mapping with 'gpus:' (and optionally 'cpu:')")
    data.pop("version", None)
    try:
        return Baselines.model_validate({**data, "path": str(path)})
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        raise InputError(f"{path}: {loc}: {msg}") from None


# -- targets and verdicts ------------------------------------------------------------------------
@dataclass(frozen=True)
class ProbeTarget:
    label: str  # "0", "1", ... or "cpu": the verdict's "gpu" field
    gpu_index: int | None
    gpu_name: str | None
    pci_device_id: str | None
    prefix: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    expected_cpus: frozenset[int] | None = None
    expected_node: int | None = None
    gpu_uuid: str | None = None
    device: str | None = None  # "gpu" | "cpu"; None: "gpu" when gpu_index is set
    notes: tuple[str, ...] = ()  # facts met while planning (e.g. NUMA node unknown)
    # Set when the target cannot be run as planned (its NUMA node's CPUs or memory are outside
    # this container's cpuset): the verdict is an error with this reason, no process is started.
    blocked: str | None = None


@dataclass(frozen=True)
class ProbeVerdict:
    gpu: str
    status: str
    passed: bool
    reasons: list[str]
    attempts: int
    started_at: str
    finished_at: str
    duration_seconds: float
    result: dict[str, Any] | None
    stderr_tail: str
    notes: list[str] = field(default_factory=list)
    expected_cpus: str | None = None
    expected_node: int | None = None
    # For a skipped (busy) GPU: the real run whose verdict stands ({"status", "finished_at"}).
    stands_for: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        d = {"gpu": self.gpu, "status": self.status, "passed": self.passed,
             "reasons": list(self.reasons), "notes": list(self.notes), "attempts": self.attempts,
             "started_at": self.started_at, "finished_at": self.finished_at,
             "duration_seconds": self.duration_seconds, "expected_cpus": self.expected_cpus,
             "expected_node": self.expected_node, "result": self.result,
             "stderr_tail": self.stderr_tail}
        if self.stands_for is not None:
            d["stands_for"] = dict(self.stands_for)
        return d


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def _rfc3339(t: _dt.datetime) -> str:
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


# -- one process -----------------------------------------------------------------------------
@dataclass
class _Run:
    status: str  # "ok" (a JSON result) | "timeout" | "crashed" | "error"
    result: dict[str, Any] | None
    stderr_tail: str
    reason: str = ""


def _tail(raw: bytes, lines: int = STDERR_TAIL_LINES) -> str:
    text = raw.decode("utf-8", errors="replace")
    return "\n".join(text.rstrip().splitlines()[-lines:])[-4000:]


def _workload_pythonpath(module: str) -> str | None:
    """The folder that holds the workload package, so the child finds it from any cwd."""
    top = module.split(".", 1)[0]
    try:
        spec = importlib.util.find_spec(top)  # does not import the package's contents
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(Path(list(spec.submodule_search_locations)[0]).parent)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_once(cmd: list[str], env: Mapping[str, str], timeout: float) -> _Run:
    """Run ``cmd`` in a new session (its own process group) with a hard timeout.

    On expiry, or when the child exits, the whole group gets SIGKILL so nothing it started
    survives it.
    """
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=dict(env), start_new_session=True)
    except OSError as exc:
        return _Run("error", None, "", f"could not start {cmd[0]!r}: {exc.strerror or exc}")
    pgid = proc.pid  # start_new_session: the child leads its own group
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(pgid)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a grandchild escaped the group and holds the pipes
            proc.kill()
            out, err = b"", b""
        return _Run("timeout", None, _tail(err or b""), f"no result within {timeout:g} s: killed")
    finally:
        _kill_group(pgid)  # leftovers of a finished child, if any
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    tail = _tail(err)
    rc = proc.returncode
    if rc != 0:
        if rc < 0:
            try:
                how = f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                how = f"killed by signal {-rc}"
        else:
            how = f"exited with code {rc}"
        last = tail.splitlines()[-1] if tail else "no stderr output"
        return _Run("crashed", None, tail, f"workload {how}: {last}")
    text = out.decode("utf-8", errors="replace").strip()
    doc = None
    for candidate in (text, text.splitlines()[-1] if text else ""):
        try:
            doc = json.loads(candidate)
            break
        except ValueError:
            continue
    if not isinstance(doc, dict):
        return _Run("crashed", None, tail, "workload exited 0 but printed no JSON result on stdout")
    return _Run("ok", doc, tail)


# -- judging -----------------------------------------------------------------------------------
def judge(result: Mapping[str, Any], target: ProbeTarget, device: str, policy: ProbePolicy,
          baselines: Baselines) -> tuple[str, list[str], list[str], bool]:
    """(status, reasons, notes, throughput_only). ``status`` is passed | failed | error."""
    reasons: list[str] = []
    notes: list[str] = []
    if not result.get("ok"):
        err = str(result.get("error") or "workload reported failure without a reason")
        status = "error" if result.get("error_kind") == "input" else "failed"
        return status, [err], notes, False
    dev = result.get("device") or {}
    if device == "gpu" and dev.get("kind") != "gpu":
        reasons.append(f"a GPU was asked for but the workload ran on {dev.get('kind') or 'an unknown device'}"
                       f" ({dev.get('name') or '?'})")
    acc = result.get("accuracy")
    if not isinstance(acc, (int, float)):
        reasons.append("no accuracy in the result")
    elif acc < policy.accuracy_min:
        reasons.append(f"accuracy {acc:.4f} is below {policy.accuracy_min:g}")
    throughput_fail = False
    ips = result.get("train_images_per_second")
    if device == "gpu":
        base = baselines.for_gpu(target.gpu_name or dev.get("name"), target.pci_device_id)
        model = target.gpu_name or dev.get("name") or target.pci_device_id or "?"
    else:
        base = baselines.cpu
        model = "cpu"
    if base is None:
        notes.append(f"no throughput baseline for {model!r}: measured and reported, not judged")
    elif not base.measured:
        if isinstance(ips, (int, float)):
            notes.append(f"train throughput {ips:.0f} images/s is {ips / base.train_images_per_second:.1%} of the "
                         f"{base.train_images_per_second:g} images/s target for {model!r} (a target, not a "
                         "measured baseline: reported, not judged)")
    elif not isinstance(ips, (int, float)):
        reasons.append("no training throughput in the result")
    else:
        need = policy.throughput_fraction * base.train_images_per_second
        if ips < need:
            throughput_fail = True
            reasons.append(f"train throughput {ips:.0f} images/s is below {need:.0f} "
                           f"({policy.throughput_fraction:g} x baseline {base.train_images_per_second:g} for {model!r})")
    host = result.get("host") or {}
    if policy.require_numa_binding:
        if target.expected_cpus is not None:
            try:
                got = parse_cpulist(str(host.get("cpu_affinity", "")))
            except (ParseError, ValueError):
                got = None
            if got != frozenset(target.expected_cpus):
                reasons.append(f"CPU affinity inside the probe is {host.get('cpu_affinity')!r}, "
                               f"expected {format_cpulist(target.expected_cpus)!r}")
        if target.expected_node is not None:
            try:
                mems = parse_cpulist(str(host.get("mems_allowed", "")))
            except (ParseError, ValueError):
                mems = None
            if mems != frozenset({target.expected_node}):
                reasons.append(f"memory allowed on NUMA node(s) {host.get('mems_allowed')!r}, "
                               f"expected {target.expected_node}")
    if policy.require_jemalloc and not host.get("jemalloc_mapped"):
        reasons.append("jemalloc is required but not mapped in the probe process "
                       f"(LD_PRELOAD={host.get('ld_preload', '')!r})")
    only_throughput = throughput_fail and len(reasons) == 1
    return ("failed" if reasons else "passed"), reasons, notes, only_throughput


# -- orchestration -----------------------------------------------------------------------------
def _previous_by_label(previous: Mapping[str, Any] | Sequence[Any] | None) -> dict[str, dict]:
    if not previous:
        return {}
    items: Iterable[Any]
    if isinstance(previous, Mapping) and isinstance(previous.get("results"), list):
        items = previous["results"]
    elif isinstance(previous, Mapping):
        items = [dict(v, gpu=v.get("gpu", k)) if isinstance(v, Mapping) else v for k, v in previous.items()]
    else:
        items = previous
    out = {}
    for v in items:
        if hasattr(v, "as_dict"):
            v = v.as_dict()
        if isinstance(v, Mapping) and "gpu" in v:
            out[str(v["gpu"])] = dict(v)
    return out


def _target_device(target: ProbeTarget, device: str) -> str:
    if target.device in ("gpu", "cpu"):
        return target.device
    if target.gpu_index is not None:
        return "gpu"
    return "gpu" if device == "gpu" else "cpu"


def _child_env(target: ProbeTarget, dev: str, module: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in target.env.items()})
    env["TF_CPP_MIN_LOG_LEVEL"] = env.get("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONUNBUFFERED"] = "1"
    if dev == "gpu" and target.gpu_index is not None and "CUDA_VISIBLE_DEVICES" not in target.env:
        env["CUDA_VISIBLE_DEVICES"] = target.gpu_uuid or str(target.gpu_index)
    if dev == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU run must not take a GPU
    pp = _workload_pythonpath(module)
    if pp:
        env["PYTHONPATH"] = pp + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _probe_one(target: ProbeTarget, policy: ProbePolicy, baselines: Baselines, *, data: str | None,
               timeout: float, device: str, previous: dict | None, gpu_backend: Any,
               module: str, extra_args: Sequence[str]) -> ProbeVerdict:
    started = _now()
    t0 = time.monotonic()
    exp_cpus = format_cpulist(target.expected_cpus) if target.expected_cpus is not None else None

    def verdict(status: str, reasons: list[str], *, attempts: int, result=None, tail: str = "",
                notes: list[str] | None = None, passed: bool | None = None,
                stands_for: dict[str, Any] | None = None) -> ProbeVerdict:
        return ProbeVerdict(
            gpu=target.label, status=status, passed=(status == "passed") if passed is None else passed,
            reasons=reasons, attempts=attempts, started_at=_rfc3339(started), finished_at=_rfc3339(_now()),
            duration_seconds=round(time.monotonic() - t0, 3), result=result, stderr_tail=tail,
            notes=notes or [], expected_cpus=exp_cpus, expected_node=target.expected_node,
            stands_for=stands_for)

    dev = _target_device(target, device)
    notes: list[str] = list(target.notes)
    if dev == "gpu" and target.gpu_index is not None and policy.skip_busy_gpus and gpu_backend is not None:
        try:
            pids = list(gpu_backend.processes(target.gpu_index))
        except Exception as exc:  # the backend's failure is a fact to report, not a reason to stop
            pids = []
            notes.append(f"could not list processes on GPU {target.gpu_index}: {exc}")
        if pids:
            busy = f"GPU {target.gpu_index} is busy with {len(pids)} other process(es) (pid {', '.join(map(str, pids[:8]))})"
            if previous:
                # A previous skip carries the run it stood for: keep pointing at that real run.
                real = previous.get("stands_for") or {"status": previous.get("status", "?"),
                                                      "finished_at": previous.get("finished_at", "?")}
                carried = (previous.get("notes") if previous.get("status") == "skipped"
                           else previous.get("reasons")) or []
                return verdict("skipped", [f"{busy}: not probed; the previous verdict stands "
                                           f"({real.get('status')}, finished {real.get('finished_at')})"],
                               attempts=0, result=previous.get("result"), passed=bool(previous.get("passed")),
                               notes=notes + [n for n in carried if n not in notes], stands_for=dict(real))
            return verdict("skipped", [f"{busy}: not probed, and there is no previous verdict"],
                           attempts=0, notes=notes, passed=False)
    if target.blocked:
        return verdict("error", [target.blocked], attempts=0, notes=notes)

    cmd = list(target.prefix) + [
        sys.executable, "-m", module, "--device", dev,
        "--train-seconds", f"{policy.train_seconds:g}", "--batch-size", str(policy.batch_size),
    ]
    if data:
        cmd += ["--data", data]
    cmd += list(extra_args)
    env = _child_env(target, dev, module)

    attempts = 0
    max_attempts = 1 + policy.retries
    history: list[str] = []
    while True:
        attempts += 1
        run = run_once(cmd, env, timeout)
        if run.status != "ok":
            status = {"timeout": "timeout", "crashed": "crashed"}.get(run.status, "error")
            return verdict(status, history + [run.reason], attempts=attempts, tail=run.stderr_tail, notes=notes)
        status, reasons, jnotes, throughput_only = judge(run.result or {}, target, dev, policy, baselines)
        if status == "failed" and throughput_only and attempts < max_attempts:
            history.append(f"attempt {attempts}: {reasons[0]} (retrying)")
            continue
        return verdict(status, history + reasons if status != "passed" else reasons, attempts=attempts,
                       result=run.result, tail=run.stderr_tail, notes=notes + jnotes + (history if status == "passed" else []))


def run_probes(targets: list[ProbeTarget], policy: ProbePolicy, baselines: Baselines, *,
               data: str | None, timeout: float | None, device: str, previous: dict | None,
               gpu_backend: Any = None, workload_module: str | None = None,
               extra_args: Sequence[str] = ()) -> list[ProbeVerdict]:
    """Probe every target; one verdict per target, in the targets' order.

    Targets on different NUMA nodes run in parallel threads; those on the same node (or with
    no known node) one after another. ``previous`` (``{"results": [verdict...]}``, a list of
    verdicts, or ``{label: verdict}``) is what stands for a busy GPU that is skipped.
    ``workload_module`` (env ``GPU_TUNE_PROBE_MODULE``) replaces ``workload.mnist_probe``.
    """
    if device not in ("auto", "gpu", "cpu"):
        raise InputError(f"--device {device!r}: expected auto, gpu or cpu")
    if timeout is not None and not timeout > 0:
        raise InputError(f"--timeout {timeout}: expected a positive number of seconds")
    limit = float(timeout if timeout is not None else policy.timeout_s)
    module = workload_module or os.environ.get("GPU_TUNE_PROBE_MODULE") or WORKLOAD_MODULE
    prev = _previous_by_label(previous)
    out: list[ProbeVerdict | None] = [None] * len(targets)

    groups: dict[Any, list[int]] = {}
    for i, t in enumerate(targets):
        groups.setdefault(t.expected_node if t.expected_node is not None else "none", []).append(i)

    def run_group(indices: list[int]) -> None:
        for i in indices:
            t = targets[i]
            try:
                out[i] = _probe_one(t, policy, baselines, data=data, timeout=limit, device=device,
                                    previous=prev.get(t.label), gpu_backend=gpu_backend, module=module,
                                    extra_args=extra_args)
            except Exception as exc:  # a failure is a verdict, never a lost thread
                now = _rfc3339(_now())
                out[i] = ProbeVerdict(t.label, "error", False, [f"probe runner failed: {exc}"], 0, now, now,
                                      0.0, None, "")

    threads = [threading.Thread(target=run_group, args=(idx,), name=f"probe-node-{k}", daemon=True)
               for k, idx in groups.items()]
    if len(threads) == 1:
        run_group(next(iter(groups.values())))
    else:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    return [v for v in out if v is not None]


# -- planning ----------------------------------------------------------------------------------
def _topology_gpus(topology: Any) -> list[Any]:
    # A GPU that sysfs shows but the GPU backend did not match has no index to probe by.
    gpus = [g for g in (getattr(topology, "gpus", None) or []) if getattr(g, "gpu_index", None) is not None]
    return sorted(gpus, key=lambda g: g.gpu_index)


def _allowed_mems() -> frozenset[int] | None:
    """Memory nodes this process may use (its cpuset), from its own /proc/self/status."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Mems_allowed_list:"):
                    return parse_cpulist(line.split(":", 1)[1])
    except (OSError, ValueError):
        return None
    return None


def _within_allowed(runner: Any, binding: Any) -> tuple[Any, list[str], str | None]:
    """Bind only to CPUs this process may use (a container's cpuset may hold part of a node).

    Returns (binding, notes, blocked): ``blocked`` says why the binding cannot be used at all.
    """
    if binding.numa_node is not None:
        mems = _allowed_mems()
        if mems is not None and binding.numa_node not in mems:
            return binding, [], (f"NUMA node {binding.numa_node} is outside this container's cpuset "
                                 f"(memory nodes allowed: {format_cpulist(mems) or 'none'}): give the agent "
                                 "the whole node (no CPU/memory pinning by the kubelet's CPU manager)")
    try:
        allowed = frozenset(os.sched_getaffinity(0))
    except OSError:
        return binding, [], None
    if not binding.cpus or not allowed or binding.cpus <= allowed:
        return binding, [], None
    usable = binding.cpus & allowed
    if not usable:
        return binding, [], (f"none of NUMA node {binding.numa_node}'s CPUs {format_cpulist(binding.cpus)} may be "
                             f"used here (this process may use {format_cpulist(allowed)})")
    note = (f"CPUs {format_cpulist(binding.cpus - allowed)} of NUMA node {binding.numa_node} are outside "
            f"this process' cpuset; bound to {format_cpulist(usable)}")
    return runner.Binding(binding.numa_node, usable, binding.gpu_index, binding.gpu_uuid), [note], None


def plan_targets(topology: Any, profile: Any, gpu_backend: Any, *, gpu: str | None, device: str,
                 numa_node: int | None = None) -> list[ProbeTarget]:
    """The probe targets for ``gpu-tune probe``.

    GPU targets (``--gpu N|all``; all by default) are bound to their GPU's NUMA node with the
    profile's allocator. ``--device cpu`` (or no GPU with ``auto``) gives one CPU target, run
    unbound on this process' CPUs unless ``numa_node`` asks for a node. ``--device gpu`` on a
    host without GPUs gives one GPU target that fails clearly (the workload finds no GPU).
    """
    from . import runner

    if device not in ("auto", "gpu", "cpu"):
        raise InputError(f"--device {device!r}: expected auto, gpu or cpu")
    gpus = _topology_gpus(topology)
    names: dict[int, tuple[str | None, str | None]] = {}
    if gpu_backend is not None:
        try:
            names = {g.index: (g.name, g.uuid) for g in gpu_backend.gpus()}
        except Exception:
            names = {}

    if gpu is not None and gpu != "all":
        if device == "cpu":
            raise InputError(f"--gpu {gpu} with --device cpu: a CPU probe uses no GPU")
        if not str(gpu).isdigit():
            raise InputError(f"--gpu {gpu!r}: expected a GPU index or 'all'")
        idx = int(gpu)
        have = [g.gpu_index for g in gpus]
        if idx not in have:
            known = ", ".join(map(str, have)) or "none"
            raise InputError(f"--gpu {idx}: no such GPU on this host (GPUs: {known})")
        gpus = [g for g in gpus if g.gpu_index == idx]

    if device == "cpu" or (device == "auto" and not gpus):
        if numa_node is not None:
            binding, _, blocked = _within_allowed(runner, runner.binding_for(topology, numa_node=numa_node))
            if blocked:
                raise InputError(f"--numa-node {numa_node}: {blocked}")
            prefix = runner.bind_prefix(binding)
            exp_cpus, exp_node = binding.cpus, binding.numa_node
        else:
            cpus = frozenset(os.sched_getaffinity(0))
            binding = runner.Binding(numa_node=None, cpus=cpus, gpu_index=None, gpu_uuid=None)
            prefix, exp_cpus, exp_node = [], cpus, None
        wenv = runner.workload_env(binding, profile, {})
        env = dict(wenv)
        env["CUDA_VISIBLE_DEVICES"] = ""
        return [ProbeTarget("cpu", None, None, None, prefix=prefix, env=env, expected_cpus=exp_cpus,
                            expected_node=exp_node, device="cpu",
                            notes=tuple(getattr(wenv, "warnings", ())))]

    if not gpus:  # --device gpu on a host without GPUs: one target that reports it
        return [ProbeTarget("gpu", None, None, None, prefix=[], env={}, expected_cpus=None,
                            expected_node=None, device="gpu")]

    targets = []
    for g in gpus:
        binding, notes, blocked = _within_allowed(runner, runner.binding_for(topology, gpu=g.gpu_index))
        name, uuid = names.get(g.gpu_index, (None, None))
        wenv = runner.workload_env(binding, profile, {})
        env = dict(wenv)
        notes += list(getattr(wenv, "warnings", ()))
        bound = binding.numa_node is not None
        targets.append(ProbeTarget(
            label=str(g.gpu_index), gpu_index=g.gpu_index,
            gpu_name=name or getattr(g, "gpu_name", None), pci_device_id=normalize_pci_device(getattr(g, "device", None)),
            prefix=list(runner.bind_prefix(binding)), env=env,
            expected_cpus=binding.cpus if bound and binding.cpus else None,
            expected_node=binding.numa_node, gpu_uuid=binding.gpu_uuid or uuid or getattr(g, "gpu_uuid", None),
            device="gpu", notes=tuple(dict.fromkeys(notes)), blocked=blocked))
    return targets


# -- output ------------------------------------------------------------------------------------
def render_probe_table(verdicts: Sequence[ProbeVerdict]):
    """One block per target (GPU or CPU): status, device, figures, binding, reasons."""
    from rich.console import Group
    from rich.table import Table

    style = {"passed": "green", "skipped": "yellow"}
    blocks = []
    for v in verdicts:
        r = v.result or {}
        dev = r.get("device") or {}
        acc = r.get("accuracy")
        ips = r.get("train_images_per_second")
        infer = r.get("inference_images_per_second") or {}
        host = r.get("host") or {}
        t = Table(title=f"MNIST probe: {'GPU ' + v.gpu if v.gpu != 'cpu' else 'CPU'}", title_justify="left",
                  show_header=False, box=None, pad_edge=False)
        t.add_column("field", style="bold", no_wrap=True)
        t.add_column("value", overflow="fold")
        t.add_row("status", f"[{style.get(v.status, 'red')}]{v.status}[/] after {v.attempts} attempt(s), "
                            f"{v.duration_seconds:.1f} s")
        if dev:
            cc = f", compute capability {dev['compute_capability']}" if dev.get("compute_capability") else ""
            t.add_row("device", f"{dev.get('kind', '?')}: {dev.get('name', '?')}{cc}")
        if isinstance(acc, (int, float)):
            t.add_row("accuracy", f"{acc:.4f}")
        if isinstance(ips, (int, float)):
            t.add_row("train", f"{ips:,.0f} images/s")
        if infer:
            t.add_row("inference", ", ".join(f"batch {b}: {x:,.0f}/s" for b, x in infer.items()
                                             if isinstance(x, (int, float))))
        if host:
            binding = f"CPUs {host.get('cpu_affinity')}, memory nodes {host.get('mems_allowed')}, " \
                      f"policy {host.get('mempolicy')}, jemalloc {'mapped' if host.get('jemalloc_mapped') else 'not mapped'}"
            t.add_row("binding", binding)
        for reason in v.reasons:
            t.add_row("[red]reason[/]", reason)
        for note in v.notes:
            t.add_row("note", note)
        if v.stderr_tail and v.status in ("crashed", "error", "timeout"):
            t.add_row("stderr", v.stderr_tail[-600:])
        blocks.append(t)
    return Group(*blocks)
