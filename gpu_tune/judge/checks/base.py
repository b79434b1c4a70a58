"""What every readiness check is made of: :class:`Check` (one finding, published), the
:class:`Family` a check belongs to (what it reads, its severity, thresholds and remedy: the
registry in :mod:`gpu_tune.judge.checks` lists them), and :class:`Facts`, everything a pass knows
that the families judge.

Severity: ``fatal`` checks gate the node (not ready, the startup taint stays); ``warning`` checks
are reported and published, never gating. Category: which kind of fault a check is about; the
condition's reason names the most urgent fatal failure by :data:`CATEGORIES` (a lost GPU before a
fatal XID, before memory, the fabric, the network, PCIe, the device plugin, thermals, the driver,
the probe, and only then tuning).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from gpu_tune.gpu.base import GpuInfo

FATAL = "fatal"
WARNING = "warning"

# Most urgent first (docs/health.md "Urgency"). "health": the health readings could not be taken
# (gpu.health): right after a lost GPU, as it may hide any fault below it; not the hardware's own.
CATEGORIES = ("presence", "health", "recovery", "memory", "fabric", "network", "pcie", "device_plugin", "thermal",
              "driver", "probe", "tuning", "pending", "publish")
# The categories that are the hardware's own (what a node auto-repair controller acts on: the
# hardware condition, docs/health.md "Node auto-repair").
HARDWARE = frozenset({"presence", "recovery", "memory", "fabric", "network", "pcie", "thermal"})

MAX_LISTED = 5  # findings named in one detail before "and N more"


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str = ""
    # the figures of a failing check in a few words, for the condition's message (default: the
    # detail up to its first remedy); not part of /readiness
    summary: str = field(default="", compare=False)
    severity: str = FATAL
    category: str = field(default="", compare=False)
    # per-GPU results of a family that judges each GPU: (GPU index, ok), for the metrics
    gpus: tuple[tuple[str, bool], ...] = field(default=(), compare=False)
    # the condition's reason when this check is the most urgent (default: the check name's, in
    # gpu_tune.judge.readiness.REASONS)
    reason: str = field(default="", compare=False)
    # where the severity came from (gpu_tune.judge.policy): "catalog" (the family's own), or the
    # profile's key in words; ``policy_key`` the key alone ("readiness.checks.gpu.inforom"), "" for
    # the catalog
    severity_from: str = field(default="catalog", compare=False)
    policy_key: str = field(default="", compare=False)

    @property
    def gating(self) -> bool:
        return self.severity == FATAL

    def weighed(self, severity: str, by: str, key: str) -> "Check":
        """This check with the severity the operator's policy gives it, and where that came from."""
        return replace(self, severity=severity, severity_from=by, policy_key=key)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "severity": self.severity, "severity_from": self.severity_from,
                "detail": self.detail}


@dataclass(frozen=True)
class Expect:
    """What a healthy node of this kind has (``policies/baselines.yaml`` per GPU model, a profile's
    ``readiness.expect`` over it); None: not judged."""

    gpus: int | None = None
    nvlink_active_per_gpu: int | None = None
    ib_ports: int | tuple[str, ...] | None = None
    ib_rate_gbps: float | None = None
    # the GPU model's compute ports (policies/baselines.yaml): at least ib_default_ports of the
    # expected ports at ib_default_rate_gbps; used where the profile sets no ib_rate_gbps
    ib_default_rate_gbps: float | None = None
    ib_default_ports: int | None = None
    ib_default_source: str = ""
    source: str = ""  # where the figures come from, for details


@dataclass(frozen=True)
class Facts:
    """Everything one pass knows, as the families read it. ``gpus`` None: the GPU backend was
    not read; ``host`` None: the host's health files were not read (then the families that need
    them list nothing)."""

    profile: Any
    audit: Mapping[str, Any] | None = None
    gpus: tuple[GpuInfo, ...] = ()
    topology: Mapping[str, Any] | None = None
    probes: Sequence[Mapping[str, Any]] | None = None
    publish: Any = None  # the PublishResult of this pass (None before publishing)
    node_facts: Any = None  # the Node as last read (this pass's publish, or an earlier read)
    errors: Mapping[str, str] = field(default_factory=dict)
    mode: str = "audit"
    pending_publish: bool = False
    revert: Mapping[str, Any] | None = None
    host: Any = None  # gpu_tune.discover.health.HostHealth
    history: Any = None  # gpu_tune.judge.checks.state.HealthView
    expect: Expect = field(default_factory=Expect)
    policy: Any = None  # gpu_tune.judge.policy.Policy: the operator's weights (the xid family words XIDs by it)

    @property
    def readiness(self) -> Any:
        return getattr(self.profile, "readiness", None)


class Family:
    """One family of checks: subclasses set the class attributes and :meth:`evaluate`.

    ``source`` and ``reads`` say where the readings come from; ``severity`` is the family's
    (a family may list a second, warning check next to its fatal one: ``warning_names``);
    ``thresholds`` and ``remedy`` are what docs/health.md and ``gpu-tune check`` print."""

    name: str = ""
    category: str = ""
    severity: str = FATAL
    source: str = ""
    reads: str = ""
    thresholds: str = ""
    remedy: str = ""
    checks: tuple[str, ...] = ()  # the check names this family lists

    def evaluate(self, facts: Facts) -> list[Check]:  # pragma: no cover - abstract
        raise NotImplementedError

    def check(self, name: str, ok: bool, detail: str, summary: str = "", *, severity: str | None = None,
              gpus: Sequence[tuple[str, bool]] = (), reason: str = "") -> Check:
        return Check(name, ok, detail, summary, severity or self.severity, self.category, tuple(gpus), reason)


def listed(items: Sequence[str], limit: int = MAX_LISTED) -> str:
    head = list(items[:limit])
    more = len(items) - len(head)
    return "; ".join(head) + (f"; and {more} more" if more > 0 else "")


def gpu_label(g: GpuInfo) -> str:
    return f"GPU {g.index} ({g.pci_bus_id})" if g.pci_bus_id else f"GPU {g.index}"


def answering(gpus: Sequence[GpuInfo]) -> list[GpuInfo]:
    """GPUs that answered NVML (a lost one, or one that needs a reset, reads nothing else)."""
    return [g for g in gpus if not g.error]


def per_gpu(gpus: Sequence[GpuInfo], bad: Mapping[int, Any]) -> tuple[tuple[str, bool], ...]:
    return tuple((str(g.index), g.index not in bad) for g in sorted(gpus, key=lambda g: g.index))
