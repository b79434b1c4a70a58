"""The judging commands: ``probe`` (the MNIST probe per GPU) and ``gain`` (what the profile buys here)."""


import logging
import os
from typing import Annotated, Optional

import typer

from gpu_tune.cli.app import Device, Globals, ProfileOpt, command, console, gpu_backend, open_host, print_json, profile_of
from gpu_tune.errors import InputError

log = logging.getLogger("gpu_tune")


def _check_gpu_and_data(gpu: Optional[str], data: Optional[str]) -> None:
    """The probe's and the gain's --gpu and --data, checked before anything runs."""
    if gpu is not None and gpu != "all" and not gpu.isdigit():
        raise InputError(f"--gpu {gpu!r}: expected a GPU index or 'all'")
    if data is not None and not os.path.exists(data):
        raise InputError(f"--data {data}: no such file or folder")


@command("probe", help="Run the MNIST probe per GPU (or on the CPU), NUMA-pinned. Exit 0 passed, 1 failed.")
def probe_cmd(
    g: Globals,
    profile: ProfileOpt = "training",
    gpu: Annotated[Optional[str], typer.Option("--gpu", metavar="N|all", help="GPU index or 'all'")] = None,
    device: Annotated[Device, typer.Option("--device", case_sensitive=False, help="auto, gpu or cpu")] = Device.auto,
    data: Annotated[Optional[str], typer.Option("--data", metavar="PATH", help="MNIST .npz or IDX folder")] = None,
    timeout: Annotated[Optional[float], typer.Option("--timeout", metavar="S", min=1.0, help="Hard timeout per probe, seconds")] = None,
) -> int:
    from gpu_tune.judge import probe as probe_mod
    from gpu_tune.discover.topology import discover

    _check_gpu_and_data(gpu, data)
    prof = profile_of(g, profile)
    fs = open_host(g)
    backend = gpu_backend(g)
    topo = discover(fs, backend)
    targets = probe_mod.plan_targets(topo, prof, backend, gpu=gpu, device=device.value)
    baselines = probe_mod.load_baselines(g.policy_dir)
    verdicts = probe_mod.run_probes(targets, prof.probe, baselines, data=data, timeout=timeout,
                                    device=device.value, previous=None, gpu_backend=backend)
    passed = bool(verdicts) and all(v.passed for v in verdicts)
    from gpu_tune.judge.probe.saved import save_probe_results

    err = save_probe_results(fs, prof.name, [v.as_dict() for v in verdicts])
    if err:
        log.warning("probe results not saved for `gpu-tune label`: %s", err)
    if g.output == "json":
        print_json({"profile": prof.name, "passed": passed, "results": [v.as_dict() for v in verdicts]})
    else:
        from gpu_tune.views.probe import render_probe_table

        console().print(render_probe_table(verdicts))
    return 0 if passed else 1


@command("gain", help="Measure what the profile gains (or loses) here: the probe's launch-bound regime untuned vs "
                       "tuned, interleaved pairs, 95% interval. Exit 0 gain or no difference, 1 loss or inconclusive.")
def gain_cmd(
    g: Globals,
    profile: ProfileOpt = "training",
    gpu: Annotated[Optional[str], typer.Option("--gpu", metavar="N|all", help="GPU index or 'all' [default: all]")] = None,
    pairs: Annotated[int, typer.Option("--pairs", metavar="K", help="Untuned/tuned pairs, run A/B/B/A… (1..50)")] = 3,
    keep: Annotated[bool, typer.Option("--keep", help="Leave the host tuned afterwards (default: as found)")] = False,
    force: Annotated[bool, typer.Option("--force", help="Compare even when a GPU is busy with other work")] = False,
    window: Annotated[Optional[float], typer.Option("--window", metavar="S",
                                                    help="Timed seconds of each run's launch-bound window "
                                                         "[default: the profile's probe window]")] = None,
    data: Annotated[Optional[str], typer.Option("--data", metavar="PATH", help="MNIST .npz or IDX folder")] = None,
    timeout: Annotated[Optional[float], typer.Option("--timeout", metavar="S", min=1.0,
                                                     help="Hard timeout per run, seconds [default: the profile's]")] = None,
) -> int:
    import signal

    from gpu_tune.judge.gain import measure as gain_mod
    from gpu_tune.discover.topology import discover

    _check_gpu_and_data(gpu, data)
    if not 1 <= pairs <= gain_mod.MAX_PAIRS:
        raise InputError(f"--pairs {pairs}: expected 1..{gain_mod.MAX_PAIRS}")
    if window is not None and not 0 < window <= 600:
        raise InputError(f"--window {window}: expected 0 < S <= 600")
    prof = profile_of(g, profile)
    fs = open_host(g)
    backend = gpu_backend(g)
    topo = discover(fs, backend)

    def on_term(signum, frame):  # leave the host as found on SIGTERM too (SIGKILL: `gpu-tune revert`)
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        doc = gain_mod.measure_gain(fs=fs, profile=prof, backend=backend, topology=topo, gpu=gpu, pairs=pairs,
                                    keep=keep, force=force, data=data, window=window, timeout=timeout,
                                    progress=lambda m: log.info("gain: %s", m))
    finally:
        signal.signal(signal.SIGTERM, old)
    if g.output == "json":
        print_json(doc)
    else:
        console().print(gain_mod.render_gain(doc))
    return gain_mod.exit_code(doc)
