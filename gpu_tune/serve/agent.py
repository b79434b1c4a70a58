"""``gpu-tune serve``: the loop and the read-only HTTP API in one process.

Each pass: discover -> GPUs -> audit (mode ``audit``) or re-apply drift (mode ``enforce``, at most
once per ``enforce_min_interval`` per setting) -> verdict -> publish -> snapshot. Intervals carry
+-10 % jitter. The probe runs in its own thread (it spawns its own process), at start, every
``probe interval`` and whenever the GPU set, the driver version or the boot id changes, so
``/healthz`` and ``/readiness`` keep answering while it runs; when it finishes the loop runs a
pass at once to publish the new verdict. Each probe run is saved under
``<root>/var/lib/gpu-tune/probe.json`` (what ``gpu-tune label`` judges by), and at start the saved
verdicts are loaded back: a busy GPU that is skipped keeps its last verdict across restarts.

Every stage is a callable on :class:`Stages`: :func:`default_stages` builds the real ones, tests
pass fakes. A stage that raises is a failed collector (``gpu_tune_collector_success 0``) and a
failed readiness check naming the reason; the loop goes on. SIGTERM/SIGINT end the process with
0 and leave the settings as they are unless ``revert_on_exit`` is set.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from gpu_tune import __version__
from gpu_tune.serve.snapshot import AgentState, CollectorStatus, Snapshot
from gpu_tune.errors import InputError
from gpu_tune.tune.knobs import fixable
from gpu_tune.judge.readiness import Verdict, verdict

log = logging.getLogger("gpu_tune")

MODES = ("audit", "enforce", "revert")
# Modes a Node's gpu-tune.io/mode label may ask for over --mode: only ones that write less.
NODE_MODES = ("audit", "revert")


@dataclass
class ServeOptions:
    root: str = "/"
    gpu_backend: str = "auto"
    gpu_fixture: str | None = None
    policy_dir: str | None = None
    profile: str = "training"
    host: str = "127.0.0.1"  # the DaemonSet passes the node's address
    port: int = 9410
    mode: str = "audit"
    interval: float = 60.0
    probe_interval: float | None = None  # None: the profile's probe.interval_s
    no_kube: bool = False
    kubeconfig: str | None = None
    node: str | None = None
    revert_on_exit: bool = False
    metrics_detail: bool = False  # per-target, per-stage and launch-bound busy series (~1,500 more on a big node)
    probe_device: str = "auto"
    probe_data: str | None = None
    verbose: bool = False
    enforce_min_interval: float = 300.0
    jitter: float = 0.1

    def validate(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"--mode {self.mode!r}: expected one of {', '.join(MODES)}")
        if not self.interval > 0:
            raise InputError(f"--interval {self.interval}: must be greater than 0")
        if self.probe_interval is not None and self.probe_interval < 0:
            raise InputError(f"--probe-interval {self.probe_interval}: must be 0 or more")
        if not 0 <= int(self.port) <= 65535:
            raise InputError(f"--port {self.port}: must be within 0..65535")
        if self.probe_device not in ("auto", "gpu", "cpu"):
            raise InputError(f"--probe-device {self.probe_device!r}: expected auto, gpu or cpu")
        if not 0 <= self.jitter < 1:
            raise InputError(f"jitter {self.jitter}: must be within 0..1")


def node_name(option: str | None) -> str:
    return option or os.environ.get("NODE_NAME") or socket.gethostname()


def as_doc(obj: Any) -> Any:
    """Plain data from a stage result (objects with ``as_dict()``, dataclasses, dicts)."""
    if obj is None or isinstance(obj, (dict, list, str, int, float, bool)):
        return obj
    if hasattr(obj, "as_dict"):
        return obj.as_dict()
    if isinstance(obj, (tuple, set)):
        return [as_doc(o) for o in obj]
    raise TypeError(f"cannot turn {type(obj).__name__} into a document")


def _field(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass
class Stages:
    """The loop's stages. ``discover() -> Topology|dict``; ``audit()``/``enforce() -> Report|dict``;
    ``gpus() -> list[GpuInfo]``; ``identity() -> {"driver_version", "boot_id"}``;
    ``probe(topology, previous) -> list[ProbeVerdict|dict]``;
    ``publish(verdict, topology_doc, gpu_docs, driver_version, *, audit, probes) -> PublishResult``
    (``audit`` and ``probes``: the documents the node summary annotation is made of; ``mode``:
    the pass's mode, ``audit`` and ``revert`` never put the taint on);
    ``revert() -> (ok, rows)``; ``close()``."""

    node: str
    profile: Any
    discover: Callable[[], Any]
    audit: Callable[[], Any]
    enforce: Callable[[], Any]
    gpus: Callable[[], list[Any]]
    probe: Callable[[Any, Any], list[Any]]
    publish: Callable[[Verdict, Any, list[Any], Any], Any]
    identity: Callable[[], dict[str, Any]] = lambda: {}
    revert: Callable[[], Any] | None = None
    close: Callable[[], None] | None = None
    probe_interval: float = 3600.0
    # One read of the Node without writing (a PublishResult with the facts): used before the
    # first publish, so the first verdict already knows the device plugin's capacity, whether
    # the Node says it has GPUs, its gpu-tune.io/mode label and the condition left by the
    # previous agent.
    read_node: Callable[[], Any] | None = None
    # ``gain(topology) -> gpu-tune gain document``: measured once per start before the first probe,
    # in enforce mode, when the profile's ``gain.measure_on_start`` is set (None: never).
    gain: Callable[[Any], Any] | None = None


def default_stages(options: ServeOptions) -> Stages:
    """The real stages over the host under ``options.root``. Raises InputError on bad input."""
    from gpu_tune.tune import engine
    from gpu_tune.gpu import select_backend
    from gpu_tune.host.fs import HostFS
    from gpu_tune.cluster.labels import desired_node_state
    from gpu_tune.tune.policy import default_policy_dir, load_profile
    from gpu_tune.judge.probe.saved import load_probe_results, save_probe_results

    fs = HostFS(options.root)
    profile = load_profile(options.profile, options.policy_dir)
    backend = select_backend(options.gpu_backend, options.gpu_fixture)
    log.info("GPU backend %s: %s", getattr(backend, "name", "?"), getattr(backend, "reason", ""))
    node = node_name(options.node)
    from gpu_tune.cluster.publisher import make_publisher

    publisher = make_publisher(node, options.kubeconfig, options.no_kube)
    policy_dir = options.policy_dir or default_policy_dir()

    def discover():
        from gpu_tune.discover.topology import discover as _discover

        return _discover(fs, backend)

    def audit():
        return engine.audit(engine.make_context(fs, profile, backend))

    def enforce(only=None):
        return engine.apply(engine.make_context(fs, profile, backend), dry=False, only=only)

    def gpus():
        return list(backend.gpus())

    def identity():
        boot = fs.read_optional("/proc/sys/kernel/random/boot_id")
        return {"driver_version": backend.driver_version(), "boot_id": boot.strip() if boot else None}

    baselines_cache: dict[str, Any] = {}
    # The verdicts saved by the last probe (this agent before a restart, or `gpu-tune probe`):
    # what stands for a busy GPU that is skipped until this agent has its own.
    saved = {str(d["gpu"]): d for d in load_probe_results(fs, profile.name) or []
             if isinstance(d, dict) and "gpu" in d}
    if saved:
        log.info("previous probe verdicts loaded for %s", ", ".join(sorted(saved)))

    def probe(topology, previous):
        from gpu_tune.judge import probe as _probe

        if "b" not in baselines_cache:
            baselines_cache["b"] = _probe.load_baselines(policy_dir)
        targets = _probe.plan_targets(topology, profile, backend, gpu="all", device=options.probe_device)
        # this agent's own latest verdicts win over the saved ones, GPU by GPU
        if isinstance(previous, dict) or not previous:
            prev: Any = {**saved, **{str(k): v for k, v in (previous or {}).items()}}
        else:
            prev = previous
        verdicts = _probe.run_probes(targets, profile.probe, baselines_cache["b"], data=options.probe_data,
                                     timeout=None, device=options.probe_device, previous=prev or None,
                                     gpu_backend=backend)
        from gpu_tune.judge.probe.run import stopping

        if stopping():  # killed by SIGTERM: not a verdict on the node, never saved
            raise RuntimeError("the agent is stopping: probe run cut short")
        err = save_probe_results(fs, profile.name, [as_doc(v) for v in verdicts])
        if err:
            log.warning("probe results not saved for `gpu-tune label`: %s", err)
        return verdicts

    def publish(v: Verdict, topology_doc, gpu_docs, driver_version, *, audit=None, probes=None, mode="enforce",
                gain=None):
        topo = dict(topology_doc or {})
        topo.setdefault("cuda_driver_version", backend.cuda_driver_version())
        want = desired_node_state(profile=profile.name, ready=v.ready, reason=v.reason(),
                                  message=v.message(), topology=topo, gpus=gpu_docs,
                                  driver_version=driver_version,
                                  taint_when_not_ready=profile.readiness.taint,
                                  checks=v.checks, audit=audit, probes=probes, mode=mode, gain=gain)
        return publisher.publish(want)

    def revert():
        return engine.revert(engine.make_context(fs, profile, backend))

    def gain(topology):
        from gpu_tune.judge.gain.measure import measure_gain

        return measure_gain(fs=fs, profile=profile, backend=backend, topology=topology, gpu=None,
                            pairs=profile.gain.pairs, keep=True, force=False, data=options.probe_data,
                            window=profile.gain.window_seconds)

    def close():
        for thing in (publisher, backend):
            try:
                thing.close()
            except Exception as exc:
                log.debug("close %s: %s", type(thing).__name__, exc)

    interval = options.probe_interval if options.probe_interval is not None else profile.probe.interval_s
    return Stages(node=node, profile=profile, discover=discover, audit=audit, enforce=enforce, gpus=gpus,
                  probe=probe, publish=publish, identity=identity, revert=revert, close=close,
                  probe_interval=interval, read_node=publisher.read,
                  gain=gain if options.mode == "enforce" and profile.gain.measure_on_start else None)


@dataclass
class _ProbeState:
    results: tuple[dict[str, Any], ...] = ()
    raw: dict[str, Any] = field(default_factory=dict)  # gpu -> last verdict object, for ``previous``
    last_success: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    status: CollectorStatus | None = None
    runs: int = 0


class Agent:
    """The loop. ``run_pass()`` does one pass; ``start()`` runs the loop and the probe threads."""

    def __init__(self, stages: Stages, *, mode: str = "audit", interval: float = 60.0,
                 enforce_min_interval: float = 300.0, jitter: float = 0.1, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic,
                 probe_enabled: bool = True, first_publish_max_wait: float = 900.0,
                 metrics_detail: bool = False) -> None:
        self.stages = stages
        self.metrics_detail = metrics_detail
        # Hold the first publish until the first probe has a verdict (bounded), so a starting
        # node is published once (labels, condition, Event: 3 writes) instead of "not ready"
        # and then "ready" a few seconds later.
        self.first_publish_max_wait = float(first_publish_max_wait)
        self._started_at: float | None = None
        self.mode = mode
        self.interval = float(interval)
        self.enforce_min_interval = float(enforce_min_interval)
        self.jitter = jitter
        self.rng = rng or random.Random()
        self.clock = clock
        self.monotonic = monotonic
        self.probe_enabled = probe_enabled
        self.state = AgentState(stages.node, getattr(stages.profile, "name", str(stages.profile)), interval,
                                clock=monotonic)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._probe_request = threading.Event()
        self._lock = threading.Lock()
        self._probe = _ProbeState()
        self._probe_key: Any = None
        self._probe_next_due: float | None = None
        self._probe_running = False
        self._last_enforced: dict[tuple[str, str], float] = {}
        self._topology_obj: Any = None
        self._topology_doc: dict[str, Any] | None = None
        self._gpus: list[dict[str, Any]] = []
        self._audit: dict[str, Any] | None = None
        self._ready: bool | None = None
        self._since: float = clock()
        self._threads: list[threading.Thread] = []
        self._last_publish: Any = None
        self._facts: Any = None  # the latest facts read from the Node (a publish or a read)
        self._node_was_ready: bool | None = None  # GPUHostReady=True as this agent first read it
        self._node_condition_at_start: str | None = None
        self._mode_note: str | None = None
        self._revert: dict[str, Any] | None = None
        # The gain measurement (once per start, enforce mode): it switches the host between
        # untuned and tuned, so the loop does not re-apply drift while it holds this lock.
        self._host_lock = threading.Lock()
        self._gain_wanted = mode == "enforce" and stages.gain is not None
        self._gain: dict[str, Any] | None = None

    # -- stages -----------------------------------------------------------------------------
    def _run(self, name: str, fn: Callable[[], Any]) -> tuple[Any, CollectorStatus]:
        t0 = time.perf_counter()
        try:
            value = fn()
        except Exception as exc:  # a stage failure is a value, not the end of the loop
            took = time.perf_counter() - t0
            log.warning("stage %s failed: %s", name, _reason(exc), exc_info=log.isEnabledFor(logging.DEBUG))
            return None, CollectorStatus(name, False, took, _reason(exc))
        return value, CollectorStatus(name, True, time.perf_counter() - t0)

    def _enforce(self) -> dict[str, Any]:
        """Audit; re-apply when some drifted setting was not re-applied within the rate limit."""
        before = as_doc(self.stages.audit())
        now = self.monotonic()
        drifted = [(str(s["id"]), str(s["target"])) for s in before.get("settings", []) if s.get("status") == "drift"
                   and fixable(str(s["id"]))]  # read-only checks (limits.memlock, gpu.mig_mode) are never re-applied
        if not drifted:
            return before
        due = [k for k in drifted if now - self._last_enforced.get(k, float("-inf")) >= self.enforce_min_interval]
        held = set(drifted) - set(due)

        def hold_detail(doc: dict[str, Any]) -> dict[str, Any]:
            """Rows held back by the rate limit say so (and when the next re-apply may happen)."""
            rows = []
            for s in doc.get("settings", []):
                k = (str(s.get("id")), str(s.get("target")))
                if s.get("status") == "drift" and k in held:
                    ago = now - self._last_enforced[k]
                    s = {**s, "detail": f"held back by the enforce rate limit: re-applied {ago:.0f}s ago, "
                                        f"next re-apply allowed in {self.enforce_min_interval - ago:.0f}s"}
                rows.append(s)
            return {**doc, "settings": rows}

        if not due:
            return hold_detail(before)
        for k in due:
            self._last_enforced[k] = now
        try:
            return hold_detail(as_doc(self.stages.enforce(only=set(due))))
        except Exception as exc:
            reason = _reason(exc)
            rows = [{**s, "status": "error", "changed": False, "detail": f"not re-applied: {reason}"}
                    if s.get("status") == "drift" and (str(s.get("id")), str(s.get("target"))) not in held else s
                    for s in before.get("settings", [])]
            return hold_detail({**before, "compliant": False, "settings": rows})

    def _identity_key(self, gpus: list[dict[str, Any]], identity: dict[str, Any]) -> tuple:
        uuids = tuple(sorted(str(g.get("uuid")) for g in gpus if not g.get("error")))
        return (uuids, identity.get("driver_version"), identity.get("boot_id"))

    # -- one pass -----------------------------------------------------------------------------
    def run_pass(self) -> Snapshot:
        errors: dict[str, str] = {}
        statuses: list[CollectorStatus] = []

        topo, st = self._run("discover", self.stages.discover)
        statuses.append(st)
        if st.success:
            self._topology_obj = topo
            self._topology_doc = as_doc(topo)
        else:
            errors["discover"] = st.error

        gpus, st = self._run("gpus", self.stages.gpus)
        statuses.append(st)
        if st.success:
            self._gpus = [as_doc(g) for g in gpus or []]
        else:
            errors["gpus"] = st.error

        if self._last_publish is None and self.stages.read_node is not None:
            facts, st = self._run("read", self.stages.read_node)  # before the first publish
            if st.success and _field(facts, "node_read", False):
                self._note_facts(facts)
        mode = self.effective_mode()
        if mode == "revert":
            if self._host_lock.acquire(blocking=False):
                try:
                    doc, st = self._run("revert", self._do_revert)
                finally:
                    self._host_lock.release()
                statuses.append(st)
                if not st.success:
                    errors["revert"] = st.error
            else:
                log.info("mode revert: waiting for the gain measurement to hand the host back")
        stage = "enforce" if mode == "enforce" else "audit"
        if mode == "enforce" and not self._host_lock.acquire(blocking=False):
            # the gain measurement holds the host: read only, re-apply after it (it ends tuned)
            doc, st = self._run(stage, self.stages.audit)
        elif mode == "enforce":
            try:
                doc, st = self._run(stage, self._enforce)
            finally:
                self._host_lock.release()
        else:
            doc, st = self._run(stage, self.stages.audit)
        if st.success:
            self._audit = as_doc(doc)
        else:
            errors[stage] = st.error
        statuses.append(st)

        identity, st_id = self._run("identity", self.stages.identity)
        key = self._identity_key(self._gpus, identity or {}) if st_id.success else self._probe_key
        if self.probe_enabled and self._topology_obj is not None:
            now = self.monotonic()
            if key != self._probe_key:
                if self._probe_key is not None:
                    log.info("GPU set, driver or boot id changed: probing again")
                self._probe_key = key
                self._probe_request.set()
            elif self._probe_next_due is not None and now >= self._probe_next_due:
                self._probe_next_due = None
                self._probe_request.set()

        with self._lock:
            probe = self._probe
        if probe.status is not None:
            statuses.append(probe.status)
        if probe.error:
            errors["probe"] = probe.error
        probes = list(probe.results)

        profile = self.stages.profile
        judge = dict(profile=profile, audit=self._audit, gpus=self._gpus, topology=self._topology_doc,
                     probes=probes, errors=errors, mode=mode, last_publish=self._facts, revert=self._revert)
        pre = verdict(**judge, pending_publish=True)
        driver = (identity or {}).get("driver_version")
        if self._holding_first_publish(probe):
            pub, st = None, CollectorStatus("publish", True, 0.0)
            wait = self.first_publish_max_wait - (self.monotonic() - (self._started_at or 0.0))
            log.info("first publish waits for the first probe verdict (at most %.0fs more)", max(wait, 0.0))
        else:
            extra = {"gain": self._gain} if self._gain is not None else {}
            pub, st = self._run("publish", lambda: self.stages.publish(
                pre, self._topology_doc, self._gpus, driver, audit=self._audit, probes=probes, mode=mode,
                **extra))
        statuses.append(st)
        if pub is None and st.success:
            pass
        elif st.success:
            self._last_publish = pub
            if _field(pub, "node_read", False):
                self._note_facts(pub)
            if not _field(pub, "ok", False):
                statuses[-1] = CollectorStatus("publish", False, st.duration,
                                               str(_field(pub, "detail", "") or "not ok"))
        else:
            errors["publish"] = st.error
        final = verdict(**{**judge, "errors": errors}, publish=pub if st.success else None)

        now = self.clock()
        if final.ready != self._ready:
            if self._ready is not None:
                log.info("readiness changed to %s: %s", final.ready, final.message())
            self._ready = final.ready
            self._since = now
        agent_ready, agent_detail = self._agent_ready(final, mode)
        snap = Snapshot.build(
            node=self.stages.node, profile=self.state.profile, verdict=final, since=self._since, created=now,
            mode=mode, agent_ready=agent_ready, agent_ready_detail=agent_detail, audit=self._audit, topology=self._topology_doc, gpus=self._gpus, probes=probes,
            probe_last_success=dict(probe.last_success), collectors=statuses,
            metrics_detail=self.metrics_detail, gain=self._gain,
        )
        self.state.publish(snap)
        return snap

    # -- mode, Node facts, the pod's own readiness -----------------------------------------------
    def _note_facts(self, facts: Any) -> None:
        self._facts = facts
        if self._node_was_ready is None:
            self._node_condition_at_start = _field(facts, "condition_status")
            self._node_was_ready = self._node_condition_at_start == "True"

    def effective_mode(self) -> str:
        """``--mode``, unless the Node's ``gpu-tune.io/mode`` label asks for one that writes less
        (``audit``: stop enforcing, ``revert``: take the node back). Read from the Node every
        publish, so a label change takes effect on the next pass, without a restart."""
        want = _field(self._facts, "mode_request") if self._facts is not None else None
        note = None
        mode = self.mode
        if want:
            if want in NODE_MODES:
                mode = want
                note = f"mode {want}: asked for by the Node's gpu-tune.io/mode label (--mode {self.mode})"
            else:
                note = (f"the Node's gpu-tune.io/mode={want} is ignored: it may only be one of "
                        f"{', '.join(NODE_MODES)}; keeping --mode {self.mode}")
        if note != self._mode_note:  # a deliberate override by a person: shown at the default level
            if note:
                log.warning("%s", note)
            elif self._mode_note:
                log.warning("the Node's gpu-tune.io/mode label is gone: mode %s", self.mode)
            self._mode_note = note
        return mode

    def _do_revert(self) -> dict[str, Any]:
        """Restore every recorded original (the journal); each pass, so a failed one is retried
        and a knob written by someone else after it is left alone (nothing is re-applied)."""
        if self.stages.revert is None:
            raise RuntimeError("this agent cannot revert (no revert stage)")
        result = self.stages.revert()
        ok, rows = (result if isinstance(result, tuple) else (bool(result), ()))
        docs = [as_doc(r) for r in rows or ()]
        restored = sum(1 for r in docs if r.get("status") == "ok")
        if restored or not ok:  # the host changed (or could not be): worth a line at the default level
            log.warning("mode revert: %d original(s) restored, %d not", restored, len(docs) - restored)
        prev = (self._revert or {}).get("restored_total", 0)
        self._revert = {"ok": bool(ok), "restored": restored, "restored_total": prev + restored, "settings": docs}
        return self._revert

    def _agent_ready(self, final: Verdict, mode: str) -> tuple[bool, str]:
        """The pod's readiness (``GET /agent-ready``), not the node's: the agent completed a pass
        and published it, and it has not turned a node that was ready when it started into a
        not-ready one. A rollout under ``maxUnavailable`` then goes on across untuned nodes
        (audit mode) and stops where a new version breaks nodes the old one kept ready."""
        pub = self._last_publish
        if pub is None:
            return False, "the agent has not published a verdict yet (the first waits for the first probe)"
        if not _field(pub, "ok", False):
            return False, f"the latest publish failed: {_field(pub, 'detail', '')}"
        if mode == "revert":
            return True, "mode revert: the node is taken back on purpose"
        if self._node_was_ready and not final.ready:
            return False, ("the node was ready (GPUHostReady=True) when this agent started and this agent "
                           f"judges it not ready: {final.message()}")
        was = ("the Node was not read" if self._node_was_ready is None else
               f"GPUHostReady={self._node_condition_at_start or 'absent'}")
        return True, f"published; node {'ready' if final.ready else 'not ready'} (when this agent started: {was})"

    # -- the probe thread -----------------------------------------------------------------------
    def measure_gain_once(self) -> None:
        """The first probe run's prelude: measure the profile's gain (untuned vs tuned) while the
        node is not yet published ready; a failure is a document with the reason."""
        self._gain_wanted = False
        with self._host_lock:
            doc, st = self._run("gain", lambda: self.stages.gain(self._topology_obj))
        self._gain = as_doc(doc) if st.success else {"verdict": "error", "error": st.error, "targets": []}
        if st.success:
            log.info("tuning gain measured: %s", (self._gain or {}).get("verdict"))

    def run_probe_once(self) -> None:
        if self._gain_wanted and self.stages.gain is not None and self.effective_mode() == "enforce":
            self.measure_gain_once()
        with self._lock:
            previous = dict(self._probe.raw) or None
            old = self._probe
        self._probe_running = True
        try:
            out, st = self._run("probe", lambda: self.stages.probe(self._topology_obj, previous))
        finally:
            self._probe_running = False
        new = _ProbeState(results=old.results, raw=dict(old.raw), last_success=dict(old.last_success),
                          status=st, runs=old.runs + 1)
        if st.success:
            results, raw = [], {}
            for v in out or []:
                d = as_doc(v)
                results.append(d)
                raw[str(d.get("gpu"))] = v
                if d.get("passed"):
                    from gpu_tune.timestamps import parse_rfc3339

                    new.last_success[str(d.get("gpu"))] = parse_rfc3339(d.get("finished_at")) or self.clock()
            new.results, new.raw, new.error = tuple(results), raw, None
        else:
            new.error = st.error
        with self._lock:
            self._probe = new
        interval = float(self.stages.probe_interval or 0)
        self._probe_next_due = self.monotonic() + self._jittered(interval) if interval > 0 else None

    def _probe_loop(self) -> None:
        while not self._stop.is_set():
            self._probe_request.wait()
            if self._stop.is_set():
                return
            self._probe_request.clear()
            self.run_probe_once()
            self._wake.set()  # publish the new verdict now

    # -- the main loop --------------------------------------------------------------------------
    def _jittered(self, seconds: float) -> float:
        return seconds * (1 + self.rng.uniform(-self.jitter, self.jitter))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.run_pass()
            except Exception:  # a bug in a pass: /healthz turns 500 if it keeps happening
                log.exception("loop pass failed")
            self._wake.wait(self._jittered(self.interval))

    def _holding_first_publish(self, probe: "_ProbeState") -> bool:
        if self._started_at is None or not self.probe_enabled or self._last_publish is not None:
            return False
        if probe.runs > 0:
            return False
        return self.monotonic() - self._started_at < self.first_publish_max_wait

    def start(self) -> None:
        self._started_at = self.monotonic()
        self._threads = [threading.Thread(target=self._loop, name="gpu-tune-loop", daemon=True)]
        if self.probe_enabled:
            self._threads.append(threading.Thread(target=self._probe_loop, name="gpu-tune-probe", daemon=True))
        for t in self._threads:
            t.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._probe_request.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP,
    # and without it small responses wait ~40 ms for delayed ACKs (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise InputError(f"--host {host} --port {port}: cannot listen: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(options: ServeOptions, *, stages: Stages | None = None,
          ready_callback: Callable[[int], None] | None = None) -> int:
    """Run the agent until SIGTERM/SIGINT; return 0. ``stages`` replaces :func:`default_stages`."""
    import uvicorn

    from gpu_tune.serve import httpserver
    from gpu_tune.serve.app import create_app

    options.validate()
    stages = stages or default_stages(options)
    pp = getattr(stages.profile, "probe", None)
    hold = (float(getattr(pp, "timeout_s", 300.0)) * (int(getattr(pp, "retries", 0)) + 1) + 60.0) if pp else 900.0
    gp = getattr(stages.profile, "gain", None)
    if stages.gain is not None and options.mode == "enforce" and gp is not None:
        hold += 2 * int(gp.pairs) * float(getattr(pp, "timeout_s", 300.0))  # the gain runs before the probe
    agent = Agent(stages, mode=options.mode, interval=options.interval,
                  enforce_min_interval=options.enforce_min_interval, jitter=options.jitter,
                  first_publish_max_wait=hold, metrics_detail=options.metrics_detail)
    app = create_app(agent.state)
    sock = _bind(options.host, int(options.port))
    config = httpserver.config(app)
    server = uvicorn.Server(config)

    from gpu_tune.judge.probe.run import stop_all

    def on_signal(signum, frame):  # uvicorn re-raises the signal it caught after shutting down
        stop_all()  # a running probe's process group dies now: the exit fits the grace period
        server.should_exit = True
        agent._stop.set()
        agent._wake.set()
        agent._probe_request.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    agent.start()
    host, port = sock.getsockname()[:2]
    shown = "localhost" if host in ("127.0.0.1", "::1") else ("<node-ip>" if host in ("0.0.0.0", "::") else host)
    print(f"gpu-tune {__version__}: node {stages.node}, profile {getattr(stages.profile, 'name', stages.profile)}, "
          f"mode {options.mode}; serving on {host}:{port} "
          f"(curl http://{shown}:{port}/readiness, /metrics); Ctrl-C or SIGTERM to stop", file=sys.stderr, flush=True)
    if ready_callback is not None:
        ready_callback(port)
    try:
        server.run(sockets=[sock])
    finally:
        agent.stop()
        sock.close()
        for s, h in old.items():
            signal.signal(s, h)
    rc = 0
    if options.revert_on_exit and stages.revert is not None:
        try:
            result = stages.revert()
            ok = result[0] if isinstance(result, tuple) else bool(getattr(result, "compliant", True))
            if not ok:
                log.warning("--revert-on-exit: some originals could not be restored")
                rc = 1
        except Exception as exc:
            log.warning("--revert-on-exit failed: %s", _reason(exc))
            rc = 1
    if stages.close is not None:
        try:
            stages.close()
        except Exception:
            pass
    return rc
