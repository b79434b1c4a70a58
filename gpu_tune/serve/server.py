"""``gpu-tune serve``: the loop (:class:`~gpu_tune.serve.agent.Agent`) and uvicorn in one process,
until SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import signal
import socket
import sys
from typing import Callable

from gpu_tune import __version__
from gpu_tune.errors import InputError
from gpu_tune.serve.agent import Agent
from gpu_tune.serve.memory import limit_arenas
from gpu_tune.serve.options import ServeOptions
from gpu_tune.serve.sdnotify import notify
from gpu_tune.serve.stages import Stages, error_reason, default_stages

log = logging.getLogger("gpu_tune")


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
    from gpu_tune.serve import httpserver  # before uvicorn: it loads uvicorn's parts (gpu_tune/partial_import.py)

    import uvicorn
    from gpu_tune.serve.app import create_app

    options.validate()
    limit_arenas()  # before the loop's threads start (gpu_tune/serve/memory.py)
    stages = stages or default_stages(options)
    pp = getattr(stages.profile, "probe", None)
    hold = (float(getattr(pp, "timeout_s", 300.0)) * (int(getattr(pp, "retries", 0)) + 1) + 60.0) if pp else 900.0
    gp = getattr(stages.profile, "gain", None)
    if stages.gain is not None and options.mode == "enforce" and gp is not None:
        from gpu_tune.judge.gain.measure import FAMILIES  # only where the gain is measured

        arms = 2 + (len(FAMILIES) if getattr(gp, "per_setting", False) else 0)
        rounds = int(gp.pairs or 8)
        hold += (arms * rounds + 1) * float(getattr(pp, "timeout_s", 300.0))  # the gain runs before the probe
    from gpu_tune.judge.checks.probe import Probe
    from gpu_tune.judge.policy import policy_of

    probe_on = not policy_of(stages.profile).all_off(Probe())  # every probe check off: the probe is not run
    agent = Agent(stages, mode=options.mode, interval=options.interval,
                  enforce_min_interval=options.enforce_min_interval, jitter=options.jitter,
                  first_publish_max_wait=hold, metrics_detail=options.metrics_detail, probe_enabled=probe_on)
    app = create_app(agent.state)
    sock = _bind(options.host, int(options.port))
    httpserver.small_receive_buffer(sock)  # the connections it accepts read a few KiB at a time
    config = httpserver.config(app)
    server = uvicorn.Server(config)

    from gpu_tune.judge.probe.run import stop_all

    def on_signal(signum, frame):  # uvicorn re-raises the signal it caught after shutting down
        notify("STOPPING=1")
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
    notify(f"READY=1\nSTATUS=serving on {host}:{port}")  # Type=notify: started = listening (docs/systemd.md)
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
            log.warning("--revert-on-exit failed: %s", error_reason(exc))
            rc = 1
    if stages.close is not None:
        try:
            stages.close()
        except Exception:
            pass
    return rc
