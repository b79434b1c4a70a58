"""The judging commands: ``probe`` (the MNIST probe per GPU) and ``gain`` (what the profile buys here)."""


import logging
import os
from typing import Annotated, Optional

import typer

from gpu_tune.cli.app import Device, Globals, ProfileOpt, command, console, gpu_backend, open_host, print_json, profile_of
from gpu_tune.errors import InputError
from gpu_tune.host.numbers import shown, uint_or_none

log = logging.getLogger("gpu_tune")


def _check_gpu_and_data(gpu: Optional[str], data: Optional[str]) -> None:
    """The probe's and the gain's --gpu and --data, checked before anything runs."""
    if gpu is not None and gpu != "all" and uint_or_none(gpu, max_digits=4) is None:
        raise InputError(f"--gpu {shown(gpu)}: expected a GPU index or 'all'")
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
    compile_cache: Annotated[Optional[bool], typer.Option(
        "--compile-cache/--no-compile-cache",
        help="Use the persistent XLA compilation cache in /var/lib/gpu-tune/xla-cache [default: the profile's "
             "probe.compile_cache]")] = None,
) -> int:
    from gpu_tune.judge import probe as probe_mod
    from gpu_tune.judge.probe.cache import cache_folder
    from gpu_tune.discover.topology import discover

    _check_gpu_and_data(gpu, data)
    prof = profile_of(g, profile)
    fs = open_host(g)
    backend = gpu_backend(g)
    topo = discover(fs, backend)
    targets = probe_mod.plan_targets(topo, prof, backend, gpu=gpu, device=device.value)
    baselines = probe_mod.load_baselines(g.policy_dir)
    policy = prof.probe if compile_cache is None else prof.probe.model_copy(update={"compile_cache": compile_cache})
    folder = None
    if policy.compile_cache:
        folder, why_not = cache_folder(fs)
        if why_not:
            log.warning("%s", why_not)
    verdicts = probe_mod.run_probes(targets, policy, baselines, data=data, timeout=timeout,
                                    device=device.value, previous=None, gpu_backend=backend, compile_cache=folder)
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
                       "tuned (or each setting family, or untuned vs untuned), pairs in a random order, intervals confirmed "
                       "by a sign-flip test. Exit 0 gain or no difference, 1 loss or inconclusive.")
def gain_cmd(
    g: Globals,
    profile: ProfileOpt = "training",
    gpu: Annotated[Optional[str], typer.Option("--gpu", metavar="N|all", help="GPU index or 'all' [default: all]")] = None,
    pairs: Annotated[Optional[int], typer.Option("--pairs", metavar="K",
                                                 help="Rounds: each arm once a round, in a random order (1..50) "
                                                      "[default: 6, 8 with --per-setting]")] = None,
    per_setting: Annotated[bool, typer.Option("--per-setting", help="Also measure each setting family alone on "
                                                                    "top of untuned, in the same rounds")] = False,
    null: Annotated[bool, typer.Option("--null", help="A/A calibration: both sides untuned, through the same "
                                                      "machinery (what the method says when nothing differs)")] = False,
    write_profile: Annotated[Optional[str], typer.Option(
        "--write-profile", metavar="FILE", help="With --per-setting: write a profile for this node that includes "
                                                "this one and leaves out every family that measured a LOSS")] = None,
    warmup: Annotated[int, typer.Option("--warmup", metavar="N", min=0, max=10,
                                        help="Runs before the first round, not counted")] = 1,
    seed: Annotated[Optional[int], typer.Option("--seed", metavar="N", min=0,
                                                help="Seed of the rounds' random order, to repeat one "
                                                     "[default: drawn; the JSON records it]")] = None,
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

    from gpu_tune.discover.topology import discover
    from gpu_tune.judge.gain import measure as gain_mod

    _check_gpu_and_data(gpu, data)
    if pairs is not None and not 1 <= pairs <= gain_mod.MAX_PAIRS:
        raise InputError(f"--pairs {pairs}: expected 1..{gain_mod.MAX_PAIRS}")
    if window is not None and not 0 < window <= 600:
        raise InputError(f"--window {window}: expected 0 < S <= 600")
    if per_setting and null:
        raise InputError("--per-setting and --null: give one (an A/A run has no settings to split)")
    out_path, out_name = _written_profile(write_profile, per_setting)
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
                                    per_setting=per_setting, null=null, warmup=warmup, seed=seed,
                                    progress=lambda m: log.info("gain: %s", m))
    finally:
        signal.signal(signal.SIGTERM, old)
    if out_path is not None:
        doc["written_profile"] = _write_profile(doc, prof, out_path, out_name)
    if g.output == "json":
        print_json(doc)
    else:
        from gpu_tune.views.gain import render_gain

        console().print(render_gain(doc))
        if out_path is not None:
            w = doc["written_profile"]
            left = ", ".join(w["left_out"]) or "nothing (no family measured a loss)"
            console().print(f"wrote profile {out_name} to {out_path}: left out {left}; use it with "
                            f"--policy-dir {out_path.parent} --profile {out_name}")
    return gain_mod.exit_code(doc)


def _written_profile(path: Optional[str], per_setting: bool):
    """``--write-profile FILE``, checked before anything runs: (path, profile name) or (None, None)."""
    if path is None:
        return None, None
    from pathlib import Path

    from gpu_tune.tune.profile import NAME_RE

    if not per_setting:
        raise InputError("--write-profile needs --per-setting (the profile leaves out families measured one by one)")
    p = Path(path)
    if p.suffix != ".yaml" or not NAME_RE.fullmatch(p.stem):
        raise InputError(f"--write-profile {path}: expected NAME.yaml, NAME matching {NAME_RE.pattern} "
                         "(the file name is the profile's name)")
    if not p.parent.is_dir():
        raise InputError(f"--write-profile {path}: no such folder {p.parent}")
    return p, p.stem


def _write_profile(doc, prof, path, name) -> dict:
    """Write the profile (temp file + rename) and load it back, so that what was written is known to
    be a valid profile before anyone uses it."""
    import os
    import socket
    import tempfile

    from gpu_tune.judge.gain.advice import profile_without_losses
    from gpu_tune.tune.policy import load_profile

    text, dropped = profile_without_losses(doc, prof, name, node=socket.gethostname())
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    load_profile(name, path.parent)
    return {"path": str(path), "name": name, "left_out": dropped}
