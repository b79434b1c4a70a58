"""The health commands: ``check`` (every readiness check that needs no workload, once: no agent, no
cluster; with ``--probe`` the probe too) and ``set-healthy`` (clear this boot's fatal XIDs after a
GPU reset). docs/health.md."""


import logging
import socket
from typing import Annotated, Optional

import typer

from gpu_tune.cli.app import Device, Globals, ProfileOpt, command, console, gpu_backend, open_host, print_json, profile_of
from gpu_tune.errors import InputError

log = logging.getLogger("gpu_tune")


@command("check", help="Every readiness check that needs no workload, once (with --probe, the MNIST probe too): "
                       "no agent, no cluster. -o json: the /readiness document. Exit 0 ready, 1 not ready.")
def check_cmd(
    g: Globals,
    profile: ProfileOpt = "training",
    probe: Annotated[bool, typer.Option("--probe", help="Run the MNIST probe on every GPU as well (seconds "
                                                        "to minutes)")] = False,
    device: Annotated[Device, typer.Option("--device", case_sensitive=False, help="With --probe: auto, gpu or cpu")]
    = Device.auto,
) -> int:
    from gpu_tune.discover.topology import discover
    from gpu_tune.judge import probe as probe_mod
    from gpu_tune.judge.checks.expect import device_ids, expectations
    from gpu_tune.judge.checks.monitor import HealthMonitor
    from gpu_tune.judge.readiness import verdict
    from gpu_tune.tune import engine
    from gpu_tune.timestamps import format_rfc3339

    import time

    started = time.time()
    prof = profile_of(g, profile)
    fs = open_host(g)
    backend = gpu_backend(g)
    baselines = probe_mod.load_baselines(g.policy_dir)
    errors: dict[str, str] = {}
    topo = discover(fs, backend)
    topo_doc = topo.as_dict()
    report = engine.audit(engine.make_context(fs, prof, backend)).as_dict()
    gpus = backend.gpus()
    monitor = HealthMonitor(fs)
    try:
        host, view = monitor.read(gpus, topo_doc)
    finally:
        monitor.close()
    expect = expectations(prof, baselines, gpus, device_ids=device_ids(topo_doc))
    probes = None
    if probe:
        targets = probe_mod.plan_targets(topo, prof, backend, gpu="all", device=device.value)
        probes = [v.as_dict() for v in probe_mod.run_probes(targets, prof.probe, baselines, data=None, timeout=None,
                                                            device=device.value, previous=None, gpu_backend=backend)]
    v = verdict(profile=prof, audit=report, gpus=gpus, topology=topo_doc, probes=probes, errors=errors,
                host=host, history=view, expect=expect)
    doc = {"ready": v.ready, "node": socket.gethostname(), "profile": prof.name, "reason": v.reason(),
           "message": v.message(), "checks": [c.as_dict() for c in v.checks], "since": format_rfc3339(started)}
    if g.output == "json":
        print_json(doc)
    else:
        from gpu_tune.views.checks import render_checks

        console().print(render_checks(v, host=host))
    return 0 if v.ready else 1


@command("set-healthy", help="After a GPU reset: clear this boot's fatal XIDs (of one GPU, or all), which otherwise "
                             "keep the node not ready until it reboots. The agent's Node label "
                             "gpu-tune.io/set-healthy=<new value> does the same from the cluster.")
def set_healthy_cmd(
    g: Globals,
    gpu: Annotated[str, typer.Option("--gpu", metavar="N|BUS|all", help="GPU index, PCI bus id or 'all'")] = "all",
) -> int:
    from gpu_tune.host.parse import normalize_bus_id
    from gpu_tune.judge.checks.state import HealthState

    fs = open_host(g)
    bus: Optional[str] = None
    if gpu != "all":
        if gpu.isdigit():
            found = [x for x in gpu_backend(g).gpus() if x.index == int(gpu)]
            if not found or not found[0].pci_bus_id:
                raise InputError(f"--gpu {gpu}: no such GPU here (gpu-tune topology lists them)")
            bus = found[0].pci_bus_id
        elif ":" in gpu:
            bus = normalize_bus_id(gpu)
        else:
            raise InputError(f"--gpu {gpu!r}: expected a GPU index, a PCI bus id (0000:18:00.0) or 'all'")
    up = fs.read_optional("/proc/uptime")
    try:
        uptime = int(float(up.split()[0]) * 1_000_000) if up else None
    except (ValueError, IndexError):
        uptime = None
    gone = HealthState(fs).clear(bus, uptime_usec=uptime, why=f"gpu-tune set-healthy --gpu {gpu}")
    if g.output == "json":
        print_json({"cleared": gone, "gpu": gpu})
    else:
        console().print(f"cleared: {', '.join(gone)}" if gone else "nothing to clear: no fatal XID recorded in this boot"
                        + ("" if bus is None else f" for {bus}"))
    return 0
