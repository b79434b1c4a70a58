"""The health commands: ``check`` (every readiness check that needs no workload, once: no agent, no
cluster; with ``--probe`` the probe too) and ``set-healthy`` (clear this boot's fatal XIDs after a
GPU reset). docs/health.md."""


import logging
import re
import socket
from typing import Annotated, Optional

import typer

from gpu_tune.cli.app import Device, Globals, ProfileOpt, command, console, gpu_backend, open_host, print_json, profile_of
from gpu_tune.errors import InputError

log = logging.getLogger("gpu_tune")


@command("check", help="Every readiness check that needs no workload, once (with --probe, the MNIST probe too): "
                       "no agent, no cluster. -o json: the /readiness document. Exit 0 ready, 1 not ready. "
                       "With --slurm: also drain this Slurm node when not ready, resume it when ready if gpu-tune "
                       "drained it (HealthCheckProgram, Prolog, Epilog; docs/slurm.md); exit 3 when slurmctld "
                       "does not answer (nothing changed). --slurm --dry-run: decide and print what it would write, "
                       "writing nothing to Slurm or under --root.")
def check_cmd(
    g: Globals,
    profile: ProfileOpt = "training",
    probe: Annotated[bool, typer.Option("--probe", help="Run the MNIST probe on every GPU as well (seconds "
                                                        "to minutes)")] = False,
    device: Annotated[Device, typer.Option("--device", case_sensitive=False, help="With --probe: auto, gpu or cpu")]
    = Device.auto,
    slurm: Annotated[bool, typer.Option("--slurm", help="Tell Slurm: drain this node when not ready (reason "
                                                        "'gpu-tune: ...'), resume it when ready again if gpu-tune "
                                                        "drained it")] = False,
    slurm_node: Annotated[Optional[str], typer.Option("--slurm-node", metavar="NAME",
                                                      help="With --slurm: the node's name in Slurm [default: "
                                                           "SLURMD_NODENAME, else the node whose NodeHostName is "
                                                           "this host]")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="With --slurm: read the node, decide, print the "
                                                            "decision and the reason it would write; write nothing "
                                                            "to Slurm and nothing under --root")] = False,
) -> int:
    if slurm_node is not None and not slurm:
        raise InputError("--slurm-node needs --slurm")
    if dry_run and not slurm:
        raise InputError("--dry-run needs --slurm (gpu-tune check alone tells no scheduler anything)")
    from gpu_tune.judge.evidence import settings_from_env

    bounds = settings_from_env()  # the evidence's bounds, checked before anything runs (a dry run too)
    evidence = None if dry_run else bounds
    scontrol = None
    if slurm:  # Slurm's command and configuration, and the name, checked before anything runs
        import os

        from gpu_tune.slurm.health import Scontrol, check_names

        check_names(slurm_node, os.environ)
        scontrol = Scontrol()
    fs = open_host(g)
    v, host, doc, gpus, topo_doc = _judge(g, fs, profile, probe, device, read_only=dry_run, evidence=evidence)
    if scontrol is not None:
        return _slurm(g, fs, v, host, doc, gpus, topo_doc, slurm_node, scontrol, dry_run=dry_run)
    _print_verdict(g, v, host, doc)
    return 0 if v.ready else 1


def _judge(g: Globals, fs, profile: str, probe: bool, device: Device, *, read_only: bool = False, evidence=None):
    """The verdict of one pass, as ``/readiness`` has it: (verdict, host health, document, GPUs,
    topology document). ``read_only``: the health state is read, never written (a dry run);
    ``evidence``: the bounds of the evidence kept of a hardware finding (None: none kept), the
    document's ``evidence`` (docs/health.md "Evidence")."""
    import time

    from gpu_tune.discover.topology import discover
    from gpu_tune.judge import probe as probe_mod
    from gpu_tune.judge.checks.expect import device_ids, expectations
    from gpu_tune.judge.checks.monitor import HealthMonitor
    from gpu_tune.judge.checks.network import named_ports
    from gpu_tune.judge.policy import policy_of
    from gpu_tune.judge.readiness import verdict
    from gpu_tune.timestamps import format_rfc3339
    from gpu_tune.tune import engine

    started = time.time()
    prof = profile_of(g, profile)
    backend = gpu_backend(g)
    baselines = probe_mod.load_baselines(g.policy_dir)
    errors: dict[str, str] = {}
    topo = discover(fs, backend)
    topo_doc = topo.as_dict()
    report = engine.audit(engine.make_context(fs, prof, backend)).as_dict()
    gpus = backend.gpus()
    monitor = HealthMonitor(fs, policy=policy_of(prof).xid, read_only=read_only)
    host = view = None
    try:
        host, view = monitor.read(gpus, topo_doc, ib_named=named_ports(prof))
    except Exception as exc:  # fails closed: the node is not ready, with the reason (gpu.health)
        log.debug("health readings failed", exc_info=True)
        text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        errors["health"] = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    finally:
        monitor.close()
    expect = expectations(prof, baselines, gpus, device_ids=device_ids(topo_doc))
    probes = None
    from gpu_tune.judge.checks.probe import Probe

    if probe and not policy_of(prof).all_off(Probe()):  # every probe check off: the probe is not run
        targets = probe_mod.plan_targets(topo, prof, backend, gpu="all", device=device.value)
        probes = [v.as_dict() for v in probe_mod.run_probes(targets, prof.probe, baselines, data=None, timeout=None,
                                                            device=device.value, previous=None, gpu_backend=backend)]
    v = verdict(profile=prof, audit=report, gpus=gpus, topology=topo_doc, probes=probes, errors=errors,
                host=host, history=view, expect=expect)
    doc = _doc(v, prof.name, format_rfc3339(started))
    if evidence is not None:
        doc.update(_evidence(fs, monitor.state, evidence, v, gpus, topo_doc, view, doc))
    return v, host, doc, gpus, topo_doc


def _evidence(fs, state, settings, v, gpus, topo_doc, view, doc: dict) -> dict:
    """``{"evidence": ...}`` when a hardware finding keeps evidence (or it could not be kept), else
    ``{}``; the bug report is left running when this command exits (docs/health.md "Evidence")."""
    from gpu_tune.judge.evidence import wanted

    if not wanted(v):
        return {}
    from gpu_tune.judge.evidence.keeper import EvidenceKeeper

    try:
        keeper = EvidenceKeeper(fs, state, settings, node=doc["node"], log_notes=False)  # its notes: in the output
        note = keeper.keep(v, gpus, topo_doc, view, doc)
    except Exception as exc:  # noqa: BLE001 - evidence is never the verdict's: said, not raised
        log.debug("evidence", exc_info=True)
        return {"evidence": {"bundles": [], "notes": [f"evidence not kept: {type(exc).__name__}: {exc}"[:300]]}}
    return {"evidence": note.as_dict(), "_evidence_line": note.line()} if note is not None else {}


def _public(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if not k.startswith("_")}


def _doc(v, profile: str, since: str) -> dict:
    return {"ready": v.ready, "node": socket.gethostname(), "profile": profile, "reason": v.reason(),
            "message": v.message(), "checks": [c.as_dict() for c in v.checks], "since": since, **v.policy_doc()}


def _print_verdict(g: Globals, v, host, doc: dict) -> None:
    if g.output == "json":
        print_json(_public(doc))
    else:
        from rich.text import Text

        from gpu_tune.views.checks import render_checks
        from gpu_tune.views.text import printable

        console().print(render_checks(v, host=host))
        if doc.get("_evidence_line"):
            console().print(Text(printable(doc["_evidence_line"], one_line=True)), soft_wrap=True)


def _slurm(g: Globals, fs, v, host, doc: dict, gpus, topo_doc, slurm_node: Optional[str], scontrol, *,
           dry_run: bool = False) -> int:
    """``check --slurm``: the verdict with Slurm's GPU count beside the host's, told to Slurm
    (gpu_tune.slurm). Table output: the verdict in a few lines (what slurmd writes to its log
    when the check fails); stderr: what was done in Slurm, one line. ``dry_run``: what would be
    done, and the reason it would write; nothing written."""
    import sys

    from gpu_tune.slurm.health import SlurmRefused, SlurmUnreachable, slurm_pass

    try:
        done = slurm_pass(fs, v, gpus, topo_doc, node_flag=slurm_node, scontrol=scontrol, dry_run=dry_run)
    except (SlurmUnreachable, SlurmRefused):
        if g.output != "json":
            print(_summary(v))
        raise
    line = doc.get("_evidence_line")
    if line:  # the Slurm line names the bundle (its notes come last in it)
        done.notes.append(line)
    ev = {"evidence": doc["evidence"]} if "evidence" in doc else {}
    doc = {**_doc(done.verdict, doc["profile"], doc["since"]), **ev, "slurm": {**done.as_dict(), "dry_run": dry_run}}
    if g.output == "json":
        print_json(doc)
    else:
        print(_summary(done.verdict))
        if done.decision.action in ("limit_reached", "put_back"):  # what slurmd logs of a failed health check
            print(f"slurm: {done.decision.says}")
        if dry_run:
            d = done.decision
            would = (f"would {'resume' if d.action == 'resume' else 'drain'} {done.node} with Reason={d.reason!r}"
                     if d.writes else f"would not drain {done.node}: {done.limit.says}" if d.action == "limit_reached"
                     and done.limit else f"would write nothing to Slurm ({d.action})")
            print(f"dry run: {would}")
    line = f"dry run, nothing written: {done.line}" if dry_run else done.line
    print(f"gpu-tune: {line}", file=sys.stderr)
    return done.exit_code


def _summary(v) -> str:
    """The verdict in a few plain lines: ready or not, then each failing check with its detail."""
    from gpu_tune.views.text import printable

    lines = [f"{'ready' if v.ready else 'not ready'}: {v.reason()}: {v.message()}"]
    lines += [f"  {c.name} ({c.severity}{'' if c.severity_from == 'catalog' else ' by ' + c.severity_from}): "
              f"{c.detail}" for c in v.checks if not c.ok]
    return printable("\n".join(lines))


# what --gpu takes besides an index and "all": a PCI address as NVML or sysfs writes it
BUS_ID_RE = re.compile(r"(?:[0-9A-Fa-f]{4,8}:)?[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?")


@command("set-healthy", help="After a GPU reset: clear this boot's fatal XIDs (of one GPU, or all), which otherwise "
                             "keep the node not ready until it reboots. The agent's Node label "
                             "gpu-tune.io/set-healthy=<new value> does the same from the cluster. Exit 0 cleared, "
                             "1 nothing could be cleared (the boot id cannot be read, or the state cannot be saved).")
def set_healthy_cmd(
    g: Globals,
    gpu: Annotated[str, typer.Option("--gpu", metavar="N|BUS|all", help="GPU index, PCI bus id or 'all'")] = "all",
) -> int:
    from gpu_tune.discover.sysfs_health import read_uptime_usec
    from gpu_tune.host.numbers import shown, uint_or_none
    from gpu_tune.host.parse import normalize_bus_id
    from gpu_tune.judge.checks.state import HealthState
    from gpu_tune.views.text import markup_safe

    # checked whole before anything is read or written: one line, exit 2
    bus: Optional[str] = None
    index = uint_or_none(gpu, max_digits=4) if gpu != "all" else None
    if gpu != "all" and index is None:
        if not BUS_ID_RE.fullmatch(gpu):
            raise InputError(f"--gpu {shown(gpu)}: expected a GPU index, a PCI bus id (0000:18:00.0) or 'all'")
        bus = normalize_bus_id(gpu)
    fs = open_host(g)
    if index is not None:
        found = [x for x in gpu_backend(g).gpus() if x.index == index]
        if not found or not found[0].pci_bus_id:
            raise InputError(f"--gpu {index}: no such GPU here (gpu-tune topology lists them)")
        bus = found[0].pci_bus_id
    up = read_uptime_usec(fs)
    res = HealthState(fs).clear(bus, uptime_usec=up.value, why=f"gpu-tune set-healthy --gpu {gpu}")
    notes = [n for n in (res.note, up.problem and f"{up.problem}: the clear covers the fatal XIDs recorded so far")
             if n]
    if g.output == "json":
        print_json({"cleared": list(res.cleared), "gpu": gpu, "error": res.error, "notes": notes})
    else:
        if res.error:
            text = res.error
        elif res.cleared:
            text = f"cleared: {', '.join(res.cleared)}"
        else:
            text = "nothing to clear: no fatal XID recorded in this boot" + ("" if bus is None else f" for {bus}")
        for line in [text, *notes]:  # markup and control characters escaped, never printed raw
            console().print(markup_safe(line, one_line=True), highlight=False)
    return 1 if res.error else 0
