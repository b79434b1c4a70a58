"""The agent's stages: one callable per step of the flow, over the real host (:func:`default_stages`),
or fakes in tests.

A stage that raises is a failed collector (``gpu_tune_collector_success 0``) and a failed
readiness check naming the reason; the loop (:mod:`gpu_tune.serve.agent`) goes on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from gpu_tune.judge.readiness import Verdict
from gpu_tune.cluster.publisher import node_name
from gpu_tune.serve.options import ServeOptions

log = logging.getLogger("gpu_tune")


def as_doc(obj: Any) -> Any:
    """Plain data from a stage result (objects with ``as_dict()``, dataclasses, dicts)."""
    if obj is None or isinstance(obj, (dict, list, str, int, float, bool)):
        return obj
    if hasattr(obj, "as_dict"):
        return obj.as_dict()
    if isinstance(obj, (tuple, set)):
        return [as_doc(o) for o in obj]
    raise TypeError(f"cannot turn {type(obj).__name__} into a document")


def field_of(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def error_reason(exc: BaseException) -> str:
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
    ``revert() -> (ok, rows)``; ``revert_pending() -> rows``; ``close()``."""

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
    # ``health(gpu_docs, topology_doc, clear_tokens) -> (HostHealth, HealthView, Expect)``: the host's
    # health files (kernel log, AER, InfiniBand), what is remembered across passes and what a healthy
    # node of this kind has (docs/health.md). None: only what the GPU backend says is judged. When it
    # raises (or does not return in time) the pass fails closed: the fatal check gpu.health.
    health: Callable[..., Any] | None = None
    # ``revert_pending() -> rows``: the recorded originals not back in place, read only (what an
    # agent that never writes the host reports when a revert is asked of it).
    revert_pending: Callable[[], Any] | None = None
    # ``next_pass()``: called at the start of each pass, never waits: the GPU backend reads the
    # GPUs again at the pass's first ask and answers its other asks from that reading
    # (gpu_tune.gpu.per_pass). None: every ask reads.
    next_pass: Callable[[], None] | None = None
    # ``evidence(verdict, gpu_docs, topology_doc, view) -> EvidenceNote | None``: the evidence of a
    # hardware finding that first appears (gpu_tune.judge.evidence), before the verdict is published
    # (the Event names it). None: none kept. Its failure is a collector's, never the verdict's.
    evidence: Callable[..., Any] | None = None


def default_stages(options: ServeOptions) -> Stages:
    """The real stages over the host under ``options.root``. Raises InputError on bad input."""
    from gpu_tune.tune import engine
    from gpu_tune.gpu import select_backend
    from gpu_tune.host.fs import HostFS
    from gpu_tune.cluster.node_state import node_want, taint_plan
    from gpu_tune.tune.policy import default_policy_dir, load_profile
    from gpu_tune.errors import InputError
    from gpu_tune.judge.probe.saved import load_probe_results, save_probe_results

    from gpu_tune.judge.policy import policy_of
    from gpu_tune.judge.evidence import settings_from_env as evidence_settings

    fs = HostFS(options.root)
    profile = load_profile(options.profile, options.policy_dir)
    policy = policy_of(profile)  # the operator's policy checked whole before anything runs
    taint = taint_plan(profile, options.taint)
    if taint.note:
        log.warning("%s", taint.note)
    settings = evidence_settings()  # the evidence's bounds (GPU_TUNE_EVIDENCE_*), checked as well
    backend = select_backend(options.gpu_backend, options.gpu_fixture)
    log.info("GPU backend %s: %s", getattr(backend, "name", "?"), getattr(backend, "reason", ""))
    node = node_name(options.node)
    from gpu_tune.cluster.publisher import make_publisher

    # the blast-radius limit: a taint or a hardware condition False only while the fleet's ledger has room
    publisher = make_publisher(node, options.kubeconfig, options.no_kube,
                               limit=profile.readiness.max_out_of_service)
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
    try:
        saved_results = load_probe_results(fs, profile.name) or []
    except InputError as exc:  # not a reason to stop the agent: the next probe writes the file again
        log.warning("previous probe verdicts not loaded: %s", exc)
        saved_results = []
    saved = {str(d["gpu"]): d for d in saved_results if isinstance(d, dict) and "gpu" in d}
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
        from gpu_tune.judge.probe.cache import cache_folder

        folder, why_not = cache_folder(fs) if profile.probe.compile_cache else (None, None)
        if why_not:
            log.warning("%s", why_not)
        verdicts = _probe.run_probes(targets, profile.probe, baselines_cache["b"], data=options.probe_data,
                                     timeout=None, device=options.probe_device, previous=prev or None,
                                     gpu_backend=backend, compile_cache=folder)
        from gpu_tune.judge.probe.run import stopping

        if stopping():  # killed by SIGTERM: not a verdict on the node, never saved
            raise RuntimeError("the agent is stopping: probe run cut short")
        for d in (as_doc(v) for v in verdicts):  # in the journal too: one line each (docs/systemd.md)
            if d.get("status") == "error":
                log.warning("probe %s: %s", d.get("gpu"), "; ".join(map(str, d.get("reasons") or [])) or "error")
        err = save_probe_results(fs, profile.name, [as_doc(v) for v in verdicts])
        if err:
            log.warning("probe results not saved for `gpu-tune label`: %s", err)
        return verdicts

    unannounced: list[str] = []  # bundles written and not yet in an Event (a publish that failed)

    def publish(v: Verdict, topology_doc, gpu_docs, driver_version, *, audit=None, probes=None, mode="enforce",
                gain=None, evidence=None):
        want = node_want(v, profile=profile, mode=mode, topology=topology_doc, gpus=gpu_docs,
                         driver_version=driver_version, cuda_driver_version=backend.cuda_driver_version(),
                         audit=audit, probes=probes, gain=gain, hardware_condition=options.hardware_condition,
                         taint=taint)
        if evidence is not None:  # the Event names the bundles (docs/health.md "Evidence")
            import dataclasses

            if evidence.new_path and evidence.new_path not in unannounced:
                unannounced.append(evidence.new_path)
            want = dataclasses.replace(want, evidence=evidence.paths, evidence_new=tuple(unannounced))
        got = publisher.publish(want)
        if getattr(got, "ok", False):
            unannounced.clear()
        return got

    def revert():
        return engine.revert(engine.make_context(fs, profile, backend))

    from gpu_tune.judge.checks.monitor import HealthMonitor

    monitor = HealthMonitor(fs, policy=policy.xid)

    def health(gpu_docs, topology_doc, clear_tokens=()):
        from gpu_tune.gpu.base import GpuInfo
        from gpu_tune.judge import probe as _probe
        from gpu_tune.judge.checks.expect import device_ids, expectations

        from gpu_tune.judge.checks.network import named_ports

        infos = [g if isinstance(g, GpuInfo) else GpuInfo.from_dict(g) for g in gpu_docs or ()]
        host, view = monitor.read(infos, topology_doc, clear_tokens=clear_tokens, ib_named=named_ports(profile))
        if "b" not in baselines_cache:
            baselines_cache["b"] = _probe.load_baselines(policy_dir)
        return host, view, expectations(profile, baselines_cache["b"], infos, device_ids=device_ids(topology_doc))

    keeper: dict[str, Any] = {}

    def evidence(v: Verdict, gpu_docs, topology_doc, view):
        from gpu_tune.judge.evidence import wanted

        k = keeper.get("k")
        if k is None and not wanted(v):  # a healthy node never imports the rest
            return None
        if k is None:
            from gpu_tune.judge.evidence.keeper import EvidenceKeeper

            k = keeper["k"] = EvidenceKeeper(fs, monitor.state, settings, node=node)
        return k.keep(v, gpu_docs, topology_doc, view, {"node": node, "profile": profile.name, **v.as_dict()})

    def revert_pending():
        return engine.revert_pending(engine.make_context(fs, profile, backend))

    def gain(topology):
        from gpu_tune.judge.gain.measure import measure_gain

        return measure_gain(fs=fs, profile=profile, backend=backend, topology=topology, gpu=None,
                            pairs=profile.gain.pairs, keep=True, force=False, data=options.probe_data,
                            window=profile.gain.window_seconds, per_setting=profile.gain.per_setting)

    def close():
        for thing in (publisher, backend, monitor):
            try:
                thing.close()
            except Exception as exc:
                log.debug("close %s: %s", type(thing).__name__, exc)

    interval = options.probe_interval if options.probe_interval is not None else profile.probe.interval_s
    return Stages(node=node, profile=profile, discover=discover, audit=audit, enforce=enforce, gpus=gpus,
                  probe=probe, publish=publish, identity=identity, revert=revert, close=close,
                  probe_interval=interval, read_node=publisher.read, revert_pending=revert_pending, health=health,
                  next_pass=getattr(backend, "next_pass", None), evidence=evidence,
                  gain=gain if options.mode == "enforce" and profile.gain.measure_on_start else None)
