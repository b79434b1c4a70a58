"""Running probe targets: one process per target, a hard timeout, bounded retries, verdicts.

Each target runs ``python -m gpu_tune.workload.mnist_probe`` in its own process group behind a command
prefix (the NUMA binder) and an environment (CUDA_VISIBLE_DEVICES, allocator preload). A hard
timeout kills the whole group. Targets on different NUMA nodes run in parallel, targets on the
same node one after another. A busy GPU keeps its previous verdict; a failure of the runner
itself is an ``error`` verdict, never a lost thread. TensorFlow is never imported here.

:func:`stop_all` kills every running probe's process group at once and refuses new ones: what
the agent calls on SIGTERM, so it exits within its grace period with no probe left behind.
The ``stderr_tail`` leaves out TensorFlow's start-up notices (:data:`STDERR_NOISE`: the oneDNN
notice, ``failed call to cuInit`` on a node without a GPU, plugin registration chatter), so
what is left is the workload's own error.

Each workload gets the persistent XLA compilation cache folder (``compile_cache``, in the agent's
state folder; profile ``probe.compile_cache``), checked (what is not the agent's own is set aside,
and said in the verdicts' notes) and pruned to its bound before the run
(:mod:`gpu_tune.judge.probe.cache`); where it cannot be made sound the probes run without it. A workload whose compilation failed with the cache
(``error_kind: compile_cache``: an entry TensorFlow could not use; the workload removed its folder)
is run again at once without it, and the verdict notes it.
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

from gpu_tune.errors import InputError
from gpu_tune.host.parse import format_cpulist
from gpu_tune.tune.profile import ProbePolicy
from gpu_tune.judge.probe.baselines import Baselines
from gpu_tune.judge.probe.judge import judge
from gpu_tune.judge.probe.plan import ProbeTarget

WORKLOAD_MODULE = "gpu_tune.workload.mnist_probe"
STDERR_TAIL_LINES = 25
STATUSES = ("passed", "failed", "timeout", "crashed", "skipped", "error")
# TensorFlow's start-up lines that say nothing about the probe's outcome (matched as substrings).
STDERR_NOISE = (
    "oneDNN custom operations are on",
    "failed call to cuInit",
    "Could not find cuda drivers on your machine",
    "Unable to register cuDNN factory",
    "Unable to register cuFFT factory",
    "Unable to register cuBLAS factory",
    "computation placer already registered",
    "This TensorFlow binary is optimized to use available CPU instructions",
    "To enable the following instructions:",
    "All log messages before absl::InitializeLog() is called are written to STDERR",
    "TF-TRT Warning: Could not find TensorRT",
    # a cache entry is read as text first, then as the binary it is (the XLA compilation cache)
    "Error parsing text-format tensorflow.XlaSerializedCacheEntry",
    # an XLA:CPU entry names LLVM tuning features the host CPU's list leaves out (the cache folder is
    # keyed by the CPU's instruction-set flags)
    "Loading XLA:CPU AOT result. Target machine feature",
)

_live_lock = threading.Lock()
_live: set[int] = set()  # process groups of running probes
_stopping = threading.Event()


def stopping() -> bool:
    """Whether :func:`stop_all` was called (the results of this moment are not the node's)."""
    return _stopping.is_set()


def stop_all() -> int:
    """Kill every running probe's process group now and start no new one (the agent is ending).
    Returns how many groups were signalled."""
    with _live_lock:
        _stopping.set()
        groups = list(_live)
    for pgid in groups:
        _kill_group(pgid)
    return len(groups)


def workload_args(policy: ProbePolicy) -> list[str]:
    """The workload's command line for the profile's ``probe:`` section (device excluded)."""
    args = ["--train-steps", str(policy.train_steps), "--train-batch-size", str(policy.train_batch_size),
            "--batch-size", str(policy.batch_size), "--seed", str(policy.seed)]
    if policy.device_batch_size is not None:
        args += ["--device-batch-size", str(policy.device_batch_size)]
    if policy.window_seconds is not None:
        args += ["--window-seconds", f"{policy.window_seconds:g}"]
    if not policy.bandwidth:
        args += ["--bandwidth", "off"]
    elif policy.bandwidth_size_mib != 256:
        args += ["--bandwidth-size-mib", str(policy.bandwidth_size_mib)]
    return args


def target_args(target: ProbeTarget) -> list[str]:
    """Where the workload's host memory is (reported) and the remote node it measures from."""
    args = []
    if target.expected_node is not None:
        args += ["--numa-node", str(target.expected_node)]
    if target.remote_node is not None:
        args += ["--remote-numa-node", str(target.remote_node)]
    return args


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
    # The data path's verdict (judge.Judgement.datapath): ok, below floor, not judged, not measured.
    datapath: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d = {"gpu": self.gpu, "status": self.status, "passed": self.passed,
             "reasons": list(self.reasons), "notes": list(self.notes), "attempts": self.attempts,
             "started_at": self.started_at, "finished_at": self.finished_at,
             "duration_seconds": self.duration_seconds, "expected_cpus": self.expected_cpus,
             "expected_node": self.expected_node, "result": self.result,
             "stderr_tail": self.stderr_tail}
        if self.stands_for is not None:
            d["stands_for"] = dict(self.stands_for)
        if self.datapath is not None:
            d["datapath"] = self.datapath
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
    kept = [ln for ln in text.rstrip().splitlines() if not any(n in ln for n in STDERR_NOISE)]
    return "\n".join(kept[-lines:])[-4000:]


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


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _dies_with_this_process():
    """The function a probe's child runs between fork and exec so that it dies with this process:
    ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, kept across the exec (the NUMA binder and the workload
    are not set-uid), then a check that this process did not die before it was set. Without it a
    SIGKILLed ``gpu-tune probe`` or ``gain``, which can clean nothing up, left the workload running
    (a GPU kept busy) until its own end. Everything the child calls is looked up here, before
    the fork. None where libc has no ``prctl`` (not Linux).

    The kernel sends the signal when the *thread* that forked the child ends, not the process:
    :func:`run_once` waits for its child in the thread that started it, so that thread outlives it."""
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent, sig = os.getpid(), int(signal.SIGKILL)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # this process died between the fork and the prctl
            os._exit(1)

    return preexec


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_once(cmd: list[str], env: Mapping[str, str], timeout: float) -> _Run:
    """Run ``cmd`` in a new session (its own process group) with a hard timeout.

    On expiry, or when the child exits, the whole group gets SIGKILL so nothing it started
    survives it; and the child dies with this process (:func:`_dies_with_this_process`) when this
    process is killed in a way that leaves it no time to clean up (SIGKILL, the OOM killer).
    """
    with _live_lock:
        if _stopping.is_set():
            return _Run("error", None, "", "not started: the agent is stopping")
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=dict(env), start_new_session=True,
                                    preexec_fn=_dies_with_this_process())
        except OSError as exc:
            return _Run("error", None, "", f"could not start {cmd[0]!r}: {exc.strerror or exc}")
        pgid = proc.pid  # start_new_session: the child leads its own group
        _live.add(pgid)
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
        with _live_lock:
            _live.discard(pgid)
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
               module: str, extra_args: Sequence[str], compile_cache: str | None = None,
               cache_notes: Sequence[str] = ()) -> ProbeVerdict:
    started = _now()
    t0 = time.monotonic()
    exp_cpus = format_cpulist(target.expected_cpus) if target.expected_cpus is not None else None

    def verdict(status: str, reasons: list[str], *, attempts: int, result=None, tail: str = "",
                notes: list[str] | None = None, passed: bool | None = None,
                stands_for: dict[str, Any] | None = None, datapath: str | None = None) -> ProbeVerdict:
        return ProbeVerdict(
            gpu=target.label, status=status, passed=(status == "passed") if passed is None else passed,
            reasons=reasons, attempts=attempts, started_at=_rfc3339(started), finished_at=_rfc3339(_now()),
            duration_seconds=round(time.monotonic() - t0, 3), result=result, stderr_tail=tail,
            notes=notes or [], expected_cpus=exp_cpus, expected_node=target.expected_node,
            stands_for=stands_for, datapath=datapath)

    dev = _target_device(target, device)
    notes: list[str] = list(target.notes)
    if target.skip:  # not probed on purpose (MIG): no process, and not a failure
        return verdict("skipped", [target.skip], attempts=0, notes=notes, passed=True)
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

    cmd = list(target.prefix) + [sys.executable, "-m", module, "--device", dev] + workload_args(policy)
    if dev == "gpu":
        cmd += target_args(target)
    if data:
        cmd += ["--data", data]
    cmd += list(extra_args)
    cache_args = ["--compile-cache", compile_cache] if compile_cache and policy.compile_cache else []
    notes += cache_notes
    env = _child_env(target, dev, module)

    attempts = 0
    max_attempts = 1 + policy.retries
    history: list[str] = []
    while True:
        attempts += 1
        run = run_once(cmd + cache_args, env, timeout)
        if run.status == "ok" and cache_args and (run.result or {}).get("error_kind") == "compile_cache":
            # The workload could not use the cache and removed its folder: run again without it.
            notes.append(f"{(run.result or {}).get('error')}; ran again without the compilation cache")
            cache_args = []
            run = run_once(cmd, env, timeout)
        if run.status != "ok":
            status = {"timeout": "timeout", "crashed": "crashed"}.get(run.status, "error")
            return verdict(status, history + [run.reason], attempts=attempts, tail=run.stderr_tail, notes=notes)
        j = judge(run.result or {}, target, dev, policy, baselines)
        if j.status == "failed" and j.throughput_only and attempts < max_attempts:
            history.append(f"attempt {attempts}: {'; '.join(j.reasons)} (retrying)")
            continue
        return verdict(j.status, history + j.reasons if j.status != "passed" else j.reasons, attempts=attempts,
                       result=run.result, tail=run.stderr_tail,
                       notes=notes + j.notes + (history if j.status == "passed" else []), datapath=j.datapath)


def run_probes(targets: list[ProbeTarget], policy: ProbePolicy, baselines: Baselines, *,
               data: str | None, timeout: float | None, device: str, previous: dict | None,
               gpu_backend: Any = None, workload_module: str | None = None,
               extra_args: Sequence[str] = (), compile_cache: str | None = None) -> list[ProbeVerdict]:
    """Probe every target; one verdict per target, in the targets' order.

    Targets on different NUMA nodes run in parallel threads; those on the same node (or with
    no known node) one after another. ``previous`` (``{"results": [verdict...]}``, a list of
    verdicts, or ``{label: verdict}``) is what stands for a busy GPU that is skipped.
    ``workload_module`` (env ``GPU_TUNE_PROBE_MODULE``) replaces ``gpu_tune.workload.mnist_probe``.
    ``compile_cache``: the persistent XLA compilation cache folder (:func:`gpu_tune.judge.probe.cache.cache_folder`),
    pruned here, used when the profile's ``probe.compile_cache`` is on.
    """
    if device not in ("auto", "gpu", "cpu"):
        raise InputError(f"--device {device!r}: expected auto, gpu or cpu")
    if timeout is not None and not timeout > 0:
        raise InputError(f"--timeout {timeout}: expected a positive number of seconds")
    limit = float(timeout if timeout is not None else policy.timeout_s)
    module = workload_module or os.environ.get("GPU_TUNE_PROBE_MODULE") or WORKLOAD_MODULE
    prev = _previous_by_label(previous)
    out: list[ProbeVerdict | None] = [None] * len(targets)
    cache_notes: list[str] = []
    if compile_cache and policy.compile_cache:
        from gpu_tune.judge.probe.cache import upkeep

        try:
            kept = upkeep(compile_cache)
            compile_cache, cache_notes = kept.folder, kept.notes
        except Exception as exc:  # the cache is an optimisation: a failure is said and the probe runs without it
            compile_cache, cache_notes = None, [f"compilation cache not used: its upkeep failed: {exc!r}"]

    groups: dict[Any, list[int]] = {}
    for i, t in enumerate(targets):
        groups.setdefault(t.expected_node if t.expected_node is not None else "none", []).append(i)

    def run_group(indices: list[int]) -> None:
        for i in indices:
            t = targets[i]
            try:
                out[i] = _probe_one(t, policy, baselines, data=data, timeout=limit, device=device,
                                    previous=prev.get(t.label), gpu_backend=gpu_backend, module=module,
                                    extra_args=extra_args, compile_cache=compile_cache, cache_notes=cache_notes)
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
