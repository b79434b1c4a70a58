"""``gpu-tune label``: one pass of discover -> audit -> verdict -> publish, without the agent loop.

The probe is not run here (it takes seconds to minutes); the latest verdicts saved by
``gpu-tune probe`` or the agent are used, and their absence is a failed probe check.

The verdict is the agent's (:func:`gpu_tune.judge.readiness.verdict`, judged the way ``serve`` judges a
pass): the Node is read first, so the device plugin's capacity (``gpu.allocatable``) and the
labels saying the node has GPUs (``gpu.visible``) are judged here too, and the condition names
the same checks as the printed verdict. What the Node carries is decided as the agent decides it
(:mod:`gpu_tune.cluster.node_state`): ``mode`` is the mode of the agent this run stands in for
(``audit`` by default: never the taint), lowered by the Node's ``gpu-tune.io/mode`` label as the
agent's is; this command never writes the host, so a revert asked for is judged (what is still
to restore), not carried out.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

log = logging.getLogger("gpu_tune")


def label_once(g: Any, *, profile: str, node: str | None, kubeconfig: str | None, dry_run: bool,
               mode: str = "audit", taint: str | None = None) -> int:
    from gpu_tune.tune import engine
    from gpu_tune.gpu import select_backend
    from gpu_tune.host.fs import HostFS
    from gpu_tune.cluster.publisher import make_publisher
    from gpu_tune.cluster.node_state import choose_mode, node_want, taint_plan
    from gpu_tune.errors import GpuTuneError
    from gpu_tune.tune.policy import load_profile
    from gpu_tune.judge.readiness import verdict
    from gpu_tune.cluster.publisher import node_name
    from gpu_tune.judge.probe.saved import load_probe_results
    from gpu_tune.discover.topology import discover

    from gpu_tune.judge.policy import policy_of

    prof = load_profile(profile, g.policy_dir)
    policy = policy_of(prof)
    owned_taint = taint_plan(prof, taint)
    if owned_taint.note:
        log.warning("%s", owned_taint.note)
    fs = HostFS(g.root)
    backend = select_backend(g.gpu_backend, g.gpu_fixture)
    errors: dict[str, str] = {}
    topo_doc: dict[str, Any] | None = None
    try:
        topo_doc = discover(fs, backend).as_dict()
    except Exception as exc:  # noqa: BLE001 - reported as the publish/topology check
        errors["discover"] = f"{type(exc).__name__}: {exc}"
    report = engine.audit(engine.make_context(fs, prof, backend)).as_dict()
    gpus = [x.as_dict() for x in backend.gpus()]
    from gpu_tune.gpu.base import GpuInfo
    from gpu_tune.judge.checks.expect import device_ids, expectations
    from gpu_tune.judge.checks.monitor import HealthMonitor
    from gpu_tune.judge.probe import load_baselines

    probes = load_probe_results(fs, prof.name)  # bad input (a state file not ours) before anything is written
    infos = [GpuInfo.from_dict(d) for d in gpus]
    expect = expectations(prof, load_baselines(g.policy_dir), infos, device_ids=device_ids(topo_doc))
    monitor = HealthMonitor(fs, policy=policy.xid)
    try:
        host, history = monitor.read(infos, topo_doc)
    finally:
        monitor.close()
    if probes is None:
        errors["probe"] = "no probe result yet: run `gpu-tune probe` (or the agent) first"
    name = node_name(node)
    publisher = make_publisher(name, kubeconfig, False, limit=prof.readiness.max_out_of_service)
    try:
        facts = publisher.read()
        choice = choose_mode(mode, facts.mode_request if facts.node_read else None, who="gpu-tune label")
        if choice.note:
            log.warning("%s", choice.note)
        revert = None
        if choice.judged == "revert":  # this command never writes the host: what is left, read only
            try:
                rows = [r.as_dict() for r in engine.revert_pending(engine.make_context(fs, prof, backend))]
                revert = {"ok": not rows, "read_only": True, "settings": rows,
                          "by": "gpu-tune label never writes the host"}
            except GpuTuneError as exc:
                errors["revert"] = f"{type(exc).__name__}: {exc}"
        judge = dict(profile=prof, audit=report, gpus=gpus, topology=topo_doc, probes=probes or [],
                     errors=errors, last_publish=facts if facts.node_read else None, mode=choice.judged,
                     revert=revert, host=host, history=history, expect=expect)
        pre = verdict(**judge, pending_publish=True)
        want = node_want(pre, profile=prof, mode=choice.mode, topology=topo_doc, gpus=gpus,
                         driver_version=backend.driver_version(), cuda_driver_version=backend.cuda_driver_version(),
                         audit=report, probes=probes, taint=owned_taint)
        result = publisher.publish(want, dry_run=dry_run)
    finally:
        publisher.close()
    v = pre if dry_run else verdict(**judge, publish=result)
    doc = {"node": name, "ready": v.ready, "mode": choice.mode, "checks": [c.as_dict() for c in v.checks],
           "publisher": publisher.describe(), "dry_run": dry_run, "want": want.as_dict(),
           "result": result.as_dict()}
    if g.output == "json":
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        from rich.console import Console

        c = Console(highlight=False, emoji=False)
        c.print(f"node [bold]{name}[/]: {'[green]ready[/]' if v.ready else '[yellow]not ready[/]'} "
                f"({v.message()}); publisher: {publisher.describe()}")
        for k, val in sorted(want.labels.items()):
            c.print(f"  label {k}={val}")
        verb = "would change" if dry_run else "changed"
        for line in result.changed or ["nothing"]:
            c.print(f"  {verb}: {line}")
        c.print(f"  writes: {result.writes}; {result.detail}" if result.detail else f"  writes: {result.writes}")
    if not getattr(publisher, "enabled", True) and not dry_run:
        print(f"gpu-tune: error: nothing published: {publisher.describe()}", file=sys.stderr)
        return 1
    return 0 if result.ok else 1
