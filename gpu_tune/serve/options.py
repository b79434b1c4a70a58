"""``gpu-tune serve``'s options, checked before anything starts."""

from __future__ import annotations

from dataclasses import dataclass

from gpu_tune.cluster.node_state import NODE_MODES  # noqa: F401 - the modes a Node's label may ask for
from gpu_tune.errors import InputError

import re

MODES = ("audit", "enforce", "revert")
# Condition types the agent never writes: its own readiness condition and the kubelet's.
RESERVED_CONDITIONS = ("GPUHostReady", "Ready", "MemoryPressure", "DiskPressure", "PIDPressure", "NetworkUnavailable")
CONDITION_TYPE_RE = re.compile(r"[A-Z][A-Za-z0-9]{0,62}")


@dataclass
class ServeOptions:
    root: str = "/"
    gpu_backend: str = "auto"
    gpu_fixture: str | None = None
    policy_dir: str | None = None
    profile: str = "training"
    host: str = "127.0.0.1"  # the DaemonSet passes the node's address
    port: int = 9410
    mode: str = "audit"
    interval: float = 60.0
    probe_interval: float | None = None  # None: the profile's probe.interval_s
    no_kube: bool = False
    kubeconfig: str | None = None
    node: str | None = None
    revert_on_exit: bool = False
    metrics_detail: bool = False  # per-target, per-stage and launch-bound busy series (~1,500 more on a big node)
    probe_device: str = "auto"
    probe_data: str | None = None
    verbose: bool = False
    enforce_min_interval: float = 300.0
    jitter: float = 0.1
    # a second Node condition, False only on a fatal hardware fault, for node auto-repair
    # (docs/health.md); None: not written
    hardware_condition: str | None = None
    # the startup taint the agent owns (KEY[=VALUE]:EFFECT, or "off"); None: the profile's readiness.taint
    taint: str | None = None

    def validate(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"--mode {self.mode!r}: expected one of {', '.join(MODES)}")
        if not self.interval > 0:
            raise InputError(f"--interval {self.interval}: must be greater than 0")
        if self.probe_interval is not None and self.probe_interval < 0:
            raise InputError(f"--probe-interval {self.probe_interval}: must be 0 or more")
        if not 0 <= int(self.port) <= 65535:
            raise InputError(f"--port {self.port}: must be within 0..65535")
        if self.probe_device not in ("auto", "gpu", "cpu"):
            raise InputError(f"--probe-device {self.probe_device!r}: expected auto, gpu or cpu")
        if not 0 <= self.jitter < 1:
            raise InputError(f"jitter {self.jitter}: must be within 0..1")
        hc = self.hardware_condition
        if hc is not None and (not CONDITION_TYPE_RE.fullmatch(hc) or hc in RESERVED_CONDITIONS):
            raise InputError(f"--hardware-condition {hc!r}: expected a condition type in CamelCase (e.g. "
                             f"AcceleratedHardwareReady), not one of {', '.join(RESERVED_CONDITIONS)}")
        if self.taint is not None:
            from gpu_tune.tune.taint import parse_option

            try:
                parse_option(self.taint)
            except ValueError as exc:
                raise InputError(f"--taint {self.taint!r}: {exc}") from None
