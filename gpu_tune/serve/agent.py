"""The agent's loop (:class:`Agent`): the flow on an interval, and the probe in a thread of its own.

Each pass: discover -> GPUs -> audit (mode ``audit``) or re-apply drift (mode ``enforce``, at most
once per ``enforce_min_interval`` per setting) -> verdict -> evidence (a hardware fault seen first:
gpu_tune.judge.evidence) -> publish -> snapshot. Intervals carry
+-10 % jitter, and the one after the first publish is drawn over the whole interval
(:func:`pass_wait`: agents started together by a rollout do not keep passing together). The probe runs in its own thread (it spawns its own process), at start, every
``probe interval`` and whenever the GPU set, the driver version or the boot id changes, so
``/healthz`` and ``/readiness`` keep answering while it runs; when it finishes the loop runs a
pass at once to publish the new verdict. Each probe run is saved under
``<root>/var/lib/gpu-tune/probe.json`` (what ``gpu-tune label`` judges by), and at start the saved
verdicts are loaded back: a busy GPU that is skipped keeps its last verdict across restarts.

Every stage is a callable on :class:`~gpu_tune.serve.stages.Stages`:
:func:`~gpu_tune.serve.stages.default_stages` builds the real ones, tests pass fakes. A stage that
raises is a failed collector (``gpu_tune_collector_success 0``) and a failed readiness check
naming the reason; the loop goes on. :func:`gpu_tune.serve.server.serve` runs it beside uvicorn.

A pass has a deadline (``pass_deadline``, by default twice the interval plus 5 s, well within
``/healthz``'s 3 intervals plus 10 s): each stage runs in a worker thread of its own, and a stage
still running at the deadline (a host file on a hung NFS mount, a GPU driver or an API server that
does not answer) is a failed collector for that pass, which goes on without it. The stuck worker is
left to finish alone and that stage is not started again while it runs, so stuck workers never
pile up (at most one per stage); every pass meanwhile reports it. The probe and the gain
measurement keep their own timeouts.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from gpu_tune.cluster.node_state import ModeChoice, choose_mode
from gpu_tune.judge.readiness import Verdict, verdict
from gpu_tune.serve.memory import release
from gpu_tune.serve.reapply import ReapplyLimit
from gpu_tune.serve.snapshot import AgentState, CollectorStatus, Snapshot
from gpu_tune.serve.stages import Stages, field_of, error_reason, as_doc
from gpu_tune.serve.timing import pass_wait

log = logging.getLogger("gpu_tune")

# A stage is waited for at least this long, even when an earlier stage used up the pass's
# deadline (so a pass with one stuck stage still publishes what it has).
MIN_STAGE_WAIT = 1.0
# A stuck stage's failure, the same words in every pass from the first: it reaches the condition's
# message and the summary annotation, so a figure that moves (how long ago it started) would make
# every pass a Node write. Its age is the collector's duration and in the log.
STUCK = ("stuck: did not return within the pass's deadline (a host file, the GPU driver or the API server "
         "does not answer); the passes go on without it and do not start it again until it returns")


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
                 metrics_detail: bool = False, pass_deadline: float | None = None) -> None:
        self.stages = stages
        self.metrics_detail = metrics_detail
        # Hold the first publish until the first probe has a verdict (bounded), so a starting
        # node is published once (labels, condition, Event: 3 writes) instead of "not ready"
        # and then "ready" a few seconds later.
        self.first_publish_max_wait = float(first_publish_max_wait)
        self._started_at: float | None = None
        self.mode = mode
        self.interval = float(interval)
        self.pass_deadline = 2 * self.interval + 5.0 if pass_deadline is None else float(pass_deadline)
        self._stuck: dict[str, tuple[threading.Thread, float]] = {}  # stage -> its worker past the deadline
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
        self._reapply = ReapplyLimit(self.enforce_min_interval)
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
        # the latest health readings (docs/health.md): host files, what is remembered, expectations
        self._host_health: Any = None
        self._health_view: Any = None
        self._expect: Any = None
        # The gain measurement (once per start, enforce mode): it switches the host between
        # untuned and tuned, so the loop does not re-apply drift while it holds this lock.
        self._host_lock = threading.Lock()
        self._gain_wanted = mode == "enforce" and stages.gain is not None
        self._gain: dict[str, Any] | None = None

    # -- stages -----------------------------------------------------------------------------
    def _run(self, name: str, fn: Callable[[], Any], until: float | None = None,
             not_started: Callable[[], Any] | None = None) -> tuple[Any, CollectorStatus]:
        """Run one stage; its failure is a value. With ``until`` (``time.monotonic()``), in a worker
        thread, waited for until then (at least :data:`MIN_STAGE_WAIT`): see the module's note;
        ``not_started`` is called when the stage is not started because its last run is stuck."""
        if until is not None:
            return self._run_bounded(name, fn, until, not_started)
        t0 = time.perf_counter()
        try:
            value = fn()
        except Exception as exc:  # a stage failure is a value, not the end of the loop
            took = time.perf_counter() - t0
            log.warning("stage %s failed: %s", name, error_reason(exc), exc_info=log.isEnabledFor(logging.DEBUG))
            return None, CollectorStatus(name, False, took, error_reason(exc))
        return value, CollectorStatus(name, True, time.perf_counter() - t0)

    def _run_bounded(self, name: str, fn: Callable[[], Any], until: float,
                     not_started: Callable[[], Any] | None) -> tuple[Any, CollectorStatus]:
        stuck = self._stuck.get(name)
        if stuck is not None:
            if stuck[0].is_alive():
                if not_started is not None:
                    not_started()
                age = time.monotonic() - stuck[1]
                log.debug("stage %s: still stuck, started %.0fs ago", name, age)
                return None, CollectorStatus(name, False, age, STUCK)  # its age: the duration, never the text
            del self._stuck[name]
        box: dict[str, Any] = {}
        done = threading.Event()

        def work() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the loop as a value
                box["error"] = exc
            finally:
                done.set()

        t0, started = time.perf_counter(), time.monotonic()
        until = max(until, started + MIN_STAGE_WAIT)
        worker = threading.Thread(target=work, name=f"gpu-tune-stage-{name}", daemon=True)
        worker.start()
        while not done.wait(min(0.25, max(0.0, until - time.monotonic()))):
            if self._stop.is_set() or time.monotonic() >= until:
                break
        took = time.perf_counter() - t0
        if not done.is_set():
            self._stuck[name] = (worker, started)
            log.warning("stage %s did not finish within %.0fs, the pass's deadline: %s", name, took, STUCK)
            return None, CollectorStatus(name, False, took, STUCK)
        exc = box.get("error")
        if exc is not None:
            if not isinstance(exc, Exception):
                raise exc
            log.warning("stage %s failed: %s", name, error_reason(exc),
                        exc_info=exc if log.isEnabledFor(logging.DEBUG) else None)
            return None, CollectorStatus(name, False, took, error_reason(exc))
        return box.get("value"), CollectorStatus(name, True, took)

    def _holding_host(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """``fn`` that lets go of the host lock (taken by the loop) when it returns, even after
        its pass has moved on without it."""

        def run() -> Any:
            try:
                return fn()
            finally:
                self._host_lock.release()

        return run

    def _enforce(self) -> dict[str, Any]:
        """Audit; re-apply drift within the rate limit (:class:`~gpu_tune.serve.reapply.ReapplyLimit`)."""
        return self._reapply.run(as_doc(self.stages.audit()), self.monotonic(),
                                 lambda only: as_doc(self.stages.enforce(only=only)), error_reason)

    def _identity_key(self, gpus: list[dict[str, Any]], identity: dict[str, Any]) -> tuple:
        uuids = tuple(sorted(str(g.get("uuid")) for g in gpus if not g.get("error")))
        return (uuids, identity.get("driver_version"), identity.get("boot_id"))

    # -- one pass -----------------------------------------------------------------------------
    def run_pass(self) -> Snapshot:
        errors: dict[str, str] = {}
        statuses: list[CollectorStatus] = []
        until = time.monotonic() + self.pass_deadline
        if self.stages.next_pass is not None:  # every stage of this pass sees one reading of the GPUs
            self.stages.next_pass()
        topo, st = self._run("discover", self.stages.discover, until)
        statuses.append(st)
        if st.success:
            self._topology_obj = topo
            self._topology_doc = as_doc(topo)
        else:
            errors["discover"] = st.error

        gpus, st = self._run("gpus", self.stages.gpus, until)
        statuses.append(st)
        if st.success:
            self._gpus = [as_doc(g) for g in gpus or []]
        else:
            errors["gpus"] = st.error

        if self.stages.read_node is not None:
            # The Node first, every pass: the mode label a person set takes effect in this pass (not
            # the next one), and the first verdict already knows the device plugin's capacity. The
            # publish below reuses this read: a steady pass still makes one GET and no write.
            facts, st = self._run("read", self.stages.read_node, until)
            if st.success and field_of(facts, "node_read", False):
                self._note_facts(facts)
        if self.stages.health is not None:
            clear = [field_of(self._facts, "set_healthy")] if self._facts is not None else []
            got, st = self._run("health", lambda: self.stages.health(self._gpus, self._topology_doc, clear), until)
            statuses.append(st)
            if st.success:
                self._host_health, self._health_view, self._expect = got
            else:
                errors["health"] = st.error
        choice = self.mode_choice()
        mode = choice.mode
        if not choice.revert_read_only and (self._revert or {}).get("read_only"):
            self._revert = None  # what an earlier read found is not a revert this agent made
        if choice.revert_read_only and self.stages.revert_pending is not None:
            # a revert asked of an agent that never writes the host: what is still to revert, read only
            doc, st = self._run("revert", self._read_pending_revert, until)
            statuses.append(st)
            if not st.success:
                errors["revert"] = st.error
        elif mode == "revert":
            if self._host_lock.acquire(blocking=False):
                doc, st = self._run("revert", self._holding_host(self._do_revert), until, self._host_lock.release)
                statuses.append(st)
                if not st.success:
                    errors["revert"] = st.error
            else:
                log.info("mode revert: waiting for the gain measurement to hand the host back")
        stage = "enforce" if mode == "enforce" else "audit"
        if mode == "enforce" and not self._host_lock.acquire(blocking=False):
            # the gain measurement (or a stuck re-apply) holds the host: read only, re-apply after it
            doc, st = self._run(stage, self.stages.audit, until)
        elif mode == "enforce":
            doc, st = self._run(stage, self._holding_host(self._enforce), until, self._host_lock.release)
        else:
            doc, st = self._run(stage, self.stages.audit, until)
        if st.success:
            self._audit = as_doc(doc)
        else:
            errors[stage] = st.error
        statuses.append(st)

        identity, st_id = self._run("identity", self.stages.identity, until)
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
                     probes=probes, errors=errors, mode=choice.judged, last_publish=self._facts,
                     revert=self._revert if choice.judged == "revert" else None,
                     host=self._host_health, history=self._health_view, expect=self._expect)
        pre = verdict(**judge, pending_publish=True)
        evidence = self._keep_evidence(pre, statuses, until)
        driver = (identity or {}).get("driver_version")
        if self._holding_first_publish(probe):
            pub, st = None, CollectorStatus("publish", True, 0.0)
            wait = self.first_publish_max_wait - (self.monotonic() - (self._started_at or 0.0))
            log.info("first publish waits for the first probe verdict (at most %.0fs more)", max(wait, 0.0))
        else:
            extra = {k: v for k, v in (("gain", self._gain), ("evidence", evidence)) if v is not None}
            pub, st = self._run("publish", lambda: self.stages.publish(
                pre, self._topology_doc, self._gpus, driver, audit=self._audit, probes=probes, mode=mode,
                **extra), until)
        statuses.append(st)
        if not st.success:
            errors["publish"] = st.error
        elif pub is not None:
            self._last_publish = pub
            if field_of(pub, "node_read", False):
                self._note_facts(pub)
            if not field_of(pub, "ok", False):
                statuses[-1] = CollectorStatus("publish", False, st.duration,
                                               str(field_of(pub, "detail", "") or "not ok"))
        final = verdict(**{**judge, "errors": errors}, publish=pub if st.success else None)

        now = self.clock()
        if final.ready != self._ready:
            if self._ready is not None:
                log.info("readiness changed to %s: %s", final.ready, final.message())
            self._ready = final.ready
            self._since = now
        agent_ready, agent_detail = self._agent_ready(final, choice)
        snap = Snapshot.build(
            node=self.stages.node, profile=self.state.profile, verdict=final, since=self._since, created=now,
            mode=mode, agent_ready=agent_ready, agent_ready_detail=agent_detail, audit=self._audit, topology=self._topology_doc, gpus=self._gpus, probes=probes,
            probe_last_success=dict(probe.last_success), collectors=statuses,
            metrics_detail=self.metrics_detail, gain=self._gain, host=self._host_health, history=self._health_view,
            evidence=evidence.as_dict() if evidence is not None else None,
            limit=field_of(pub, "limit") if st.success else None,
        )
        self.state.publish(snap)
        return snap

    def _keep_evidence(self, v: Verdict, statuses: list[CollectorStatus], until: float) -> Any:
        """The evidence of a hardware finding that first appears (gpu_tune.judge.evidence), kept
        before the verdict is published; its failure is a collector's, never the verdict's."""
        if self.stages.evidence is None:
            return None
        got, st = self._run("evidence", lambda: self.stages.evidence(v, self._gpus, self._topology_doc,
                                                                      self._health_view), until)
        statuses.append(st)
        return got

    # -- mode, Node facts, the pod's own readiness -----------------------------------------------
    def _note_facts(self, facts: Any) -> None:
        self._facts = facts
        if self._node_was_ready is None:
            self._node_condition_at_start = field_of(facts, "condition_status")
            self._node_was_ready = self._node_condition_at_start == "True"

    def mode_choice(self) -> ModeChoice:
        """This pass's mode (:func:`~gpu_tune.cluster.node_state.choose_mode`): ``--mode``, unless
        the Node's ``gpu-tune.io/mode`` label asks for one that writes less (``audit``: stop
        enforcing, ``revert``: take the node back); a revert asked of an agent that never writes
        the host is judged (what is left to revert), not carried out. Read from the Node at the
        start of every pass, so a label change takes effect in that pass, without a restart."""
        want = field_of(self._facts, "mode_request") if self._facts is not None else None
        choice = choose_mode(self.mode, want)
        if choice.note != self._mode_note:  # a deliberate override by a person: shown at the default level
            if choice.note:
                log.warning("%s", choice.note)
            elif self._mode_note:
                log.warning("the Node's gpu-tune.io/mode label is gone: mode %s", self.mode)
            self._mode_note = choice.note
        return choice

    def effective_mode(self) -> str:
        """What this pass does to the host (:attr:`ModeChoice.mode`)."""
        return self.mode_choice().mode

    def _read_pending_revert(self) -> dict[str, Any]:
        """Mode revert asked of an agent that never writes the host: the originals not yet back,
        read from the journal and the host (nothing written, not even the lock)."""
        rows = [as_doc(r) for r in self.stages.revert_pending() or ()]
        self._revert = {"ok": not rows, "read_only": True, "settings": rows,
                        "by": f"this agent runs in mode {self.mode} and never writes the host"}
        return self._revert

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

    def _agent_ready(self, final: Verdict, choice: ModeChoice) -> tuple[bool, str]:
        """The pod's readiness (``GET /agent-ready``), not the node's: the agent completed a pass
        and published it, and it has not turned a node that was ready when it started into a
        not-ready one. A rollout under ``maxUnavailable`` then goes on across untuned nodes
        (audit mode) and stops where a new version breaks nodes the old one kept ready."""
        pub = self._last_publish
        if pub is None:
            return False, "the agent has not published a verdict yet (the first waits for the first probe)"
        if not field_of(pub, "ok", False):
            return False, f"the latest publish failed: {field_of(pub, 'detail', '')}"
        if choice.judged == "revert":
            if choice.revert_read_only:
                return True, (f"mode revert asked for by the Node's label; this agent runs in mode {choice.mode} "
                              f"and never writes the host: {final.reason()}")
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
            published = self._last_publish is not None
            try:
                self.run_pass()
            except Exception:  # a bug in a pass: /healthz turns 500 if it keeps happening
                log.exception("loop pass failed")
            release()  # what the pass freed goes back to the kernel (gpu_tune/serve/memory.py)
            first = not published and self._last_publish is not None
            self._wake.wait(pass_wait(self.rng, self.interval, self.jitter, after_first_publish=first))

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
