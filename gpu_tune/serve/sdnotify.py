"""systemd's readiness protocol (``sd_notify(3)``) without libsystemd: ``gpu-tune.service`` is
``Type=notify``, so ``systemctl start gpu-tune`` returns once the agent says ``READY=1``, after its
port is bound. Without systemd (no ``NOTIFY_SOCKET``: a terminal, the DaemonSet, a test) nothing is
sent and nothing fails.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("gpu_tune")


def notify(state: str, environ: dict[str, str] | None = None) -> bool:
    """Send ``state`` (``READY=1``, ``STOPPING=1``, ``STATUS=...``) to systemd's notify socket, if
    the service manager gave one; True when it was sent. A socket that cannot be reached is one
    warning, never a failure of the agent."""
    env = os.environ if environ is None else environ
    where = env.get("NOTIFY_SOCKET", "")
    if not where or where[0] not in "/@":  # unset, or a vsock address (a VM's manager): not ours
        return False
    address = "\0" + where[1:] if where[0] == "@" else where  # "@...": the abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(address)
            s.sendall(state.encode())
    except OSError as exc:
        log.warning("could not tell systemd %s through NOTIFY_SOCKET %s: %s", state.split("=")[0], where,
                    exc.strerror or exc)
        return False
    return True
