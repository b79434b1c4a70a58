"""The agent as a systemd service on a bare-metal GPU node (docs/systemd.md): the unit files shipped
in this folder, and where they are (``gpu-tune systemd-units``).

- ``gpu-tune.service``: ``gpu-tune serve --no-kube``, the agent, in audit mode unless
  ``/etc/default/gpu-tune`` says ``GPU_TUNE_MODE=enforce`` (as the DaemonSet audits unless an
  overlay enforces);
- ``gpu-tune-apply.service``: ``gpu-tune apply`` once at boot, before the agent, the schedulers'
  daemons (slurmd, the kubelet) and the jobs (tuned's role).

Both run as root, in systemd's sandbox: the whole file system read-only but the state folder
(``/var/lib/gpu-tune``) and ``/etc/gpu-tune``; ``/proc`` and ``/sys`` writable (the settings are
kernel files); only the capabilities they use.
"""

from __future__ import annotations

from pathlib import Path

UNITS = ("gpu-tune.service", "gpu-tune-apply.service")


def folder() -> Path:
    return Path(__file__).resolve().parent


def unit_files() -> list[Path]:
    """The shipped unit files, in :data:`UNITS` order."""
    return [folder() / name for name in UNITS]
