"""``gpu-tune serve``: the agent."""


from typing import Annotated, Optional

import typer

from gpu_tune.cli.app import Device, Globals, Mode, ProfileOpt, TaintOpt, command, own_command_line
from gpu_tune.errors import GpuTuneError


@command("serve", help="The agent: reconcile loop, read-only HTTP on :9410, Prometheus, Kubernetes publishing.")
def serve_cmd(
    g: Globals,
    profile: ProfileOpt = "training",
    host: Annotated[str, typer.Option("--host", help="Listen address (the DaemonSet passes the node's address)")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Listen port")] = 9410,
    mode: Annotated[Mode, typer.Option("--mode", case_sensitive=False, help="audit: read only; enforce: re-apply drift; revert: restore the recorded originals, "
                                       "then stop enforcing (a Node label gpu-tune.io/mode=audit|revert overrides)")] = Mode.audit,
    interval: Annotated[float, typer.Option("--interval", min=1.0, metavar="S", help="Seconds between passes")] = 60.0,
    probe_interval: Annotated[Optional[float], typer.Option("--probe-interval", min=0.0, metavar="S",
                                                            help="Seconds between probes [default: the profile's]")] = None,
    no_kube: Annotated[bool, typer.Option("--no-kube", help="Do not talk to Kubernetes")] = False,
    kubeconfig: Annotated[Optional[str], typer.Option("--kubeconfig", envvar="KUBECONFIG", metavar="FILE")] = None,
    node: Annotated[Optional[str], typer.Option("--node", envvar="NODE_NAME", help="Node name [default: env NODE_NAME, else hostname]")] = None,
    revert_on_exit: Annotated[bool, typer.Option("--revert-on-exit", help="Restore originals on SIGTERM")] = False,
    metrics_detail: Annotated[bool, typer.Option(
        "--metrics-detail", help="Also export one series per setting target (per CPU, IRQ, GPU), the loop's "
                                  "per-stage success and duration, and the launch-bound GPU busy ratio: about "
                                  "1,500 more series on a 224-CPU, 8-GPU node; off by default")] = False,
    probe_device: Annotated[Device, typer.Option("--probe-device", case_sensitive=False, help="auto, gpu or cpu")] = Device.auto,
    probe_data: Annotated[Optional[str], typer.Option("--probe-data", metavar="PATH", help="MNIST data for the probe")] = None,
    hardware_condition: Annotated[Optional[str], typer.Option(
        "--hardware-condition", envvar="GPU_TUNE_HARDWARE_CONDITION", metavar="TYPE",
        help="Also keep this Node condition, False only on a fatal hardware fault (never on tuning or the probe): "
             "what a node auto-repair controller watches, e.g. AcceleratedHardwareReady [default: none]")] = None,
    taint: TaintOpt = None,
) -> int:
    options = dict(
        root=g.root, gpu_backend=g.gpu_backend, gpu_fixture=g.gpu_fixture, policy_dir=g.policy_dir,
        profile=profile, host=host, port=port, mode=mode.value, interval=interval,
        probe_interval=probe_interval, no_kube=no_kube, kubeconfig=kubeconfig, node=node,
        revert_on_exit=revert_on_exit, probe_device=probe_device.value, probe_data=probe_data,
        verbose=g.verbose, metrics_detail=metrics_detail, hardware_condition=hardware_condition or None,
        taint=taint or None,
    )
    if own_command_line():  # the agent leaves the command line behind (gpu_tune/serve/lean.py)
        from gpu_tune.serve.lean import handoff

        handoff(options)  # returns only where the process cannot be re-executed
    from gpu_tune.serve.options import ServeOptions
    from gpu_tune.serve.server import serve

    return serve(ServeOptions(**options))


@command("systemd-units", help="Where the systemd units of a bare-metal install are: gpu-tune.service (the agent, "
                               "audit mode unless /etc/default/gpu-tune says otherwise) and gpu-tune-apply.service "
                               "(apply at boot). Prints their paths, one a line: install -m 0644 "
                               "$(gpu-tune systemd-units) /etc/systemd/system/")
def systemd_units_cmd(g: Globals) -> int:
    from gpu_tune.cli.app import print_json
    from gpu_tune.systemd import folder, unit_files

    files = unit_files()
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise GpuTuneError(f"the installed package lacks its unit files: {', '.join(missing)}")
    if g.output == "json":
        print_json({"folder": str(folder()), "units": [{"name": f.name, "path": str(f)} for f in files]})
    else:
        print("\n".join(str(f) for f in files))
    return 0
