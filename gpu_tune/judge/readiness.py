"""The readiness verdict: the registry of check families (:mod:`gpu_tune.judge.checks`) walked over
one pass's facts, and what the node's condition says about it.

Every check has a name (stable: the ``check`` label of ``gpu_tune_check_ok``), ``ok``, a
severity and a detail. The node is ready when every ``fatal`` check is ok; a failing ``warning``
check is reported and published, never gating. docs/health.md lists every check with what it
reads, its threshold, its severity and its source.

The ``GPUHostReady`` condition a not-ready node gets (:meth:`Verdict.reason`,
:meth:`Verdict.message`) names the most urgent failing fatal check, by category
(:data:`~gpu_tune.judge.checks.base.CATEGORIES`): a lost or missing GPU, then a fatal XID or a
reset NVML asks for, memory, the NVLink fabric, the network, PCIe, the device plugin's count,
thermal and power, the driver, the probe, and only then tuning (a preference, never more urgent
than a missing GPU), a probe that has not run yet and publishing. The message leads with that
check's figures and names the other failing fatal checks, short enough for ``kubectl describe
node`` and stable from pass to pass (no reading that moves every pass, so a steady node is not
rewritten). :meth:`Verdict.hardware` is the same judgement over the hardware's own categories
only: the condition a node auto-repair controller may act on (docs/health.md).

The severity each check runs with is the operator's policy's (:mod:`gpu_tune.judge.policy`): one
step between the families and the verdict. A check whose severity the profile set names the key in
its headline (``[readiness.checks.gpu.inforom]``), so the condition, its Events and a Slurm drain
reason say whose decision it was; the checks the profile turns off are said once (:attr:`Verdict.off`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from gpu_tune.gpu.base import GpuInfo
from gpu_tune.judge.checks import CATEGORIES, HARDWARE, REGISTRY, Check, Expect, Facts
from gpu_tune.judge.checks.pcie import BUSY_UTILIZATION_PERCENT
from gpu_tune.judge.checks.tuning import reverted_check, tuning_check
from gpu_tune.judge.policy import Policy, policy_of

__all__ = ["BUSY_UTILIZATION_PERCENT", "Check", "REASONS", "Verdict", "VOLATILE_READINGS", "reverted_check",
           "tuning_check", "verdict", "without_readings"]

MAX_MESSAGE = 512  # characters of the condition's message (kubectl describe node shows it whole)
MAX_HEADLINE = 300  # characters of the leading check's figures in it

# The condition's reason per failing check (by name; "*" matches one part).
REASONS = (
    ("gpu.backend", "GpuBackendFailed"), ("gpu.visible", "GpusNotVisible"), ("gpu.present", "GpuLost"),
    ("gpu.count", "GpuMissing"), ("gpu.xid", "FatalXid"), ("gpu.recovery", "GpuResetRequired"),
    ("gpu.memory", "GpuMemoryErrors"), ("gpu.nvlink", "NvlinkDown"), ("gpu.fabric", "FabricNotReady"),
    ("nvswitch.sxid", "NvswitchFatalError"), ("network.infiniband", "InfinibandPortDown"),
    ("gpu.pcie", "PcieDegraded"), ("gpu.allocatable", "DevicePluginMissingGpus"), ("gpu.thermal", "GpuSlowedDown"),
    ("gpu.driver_cuda", "DriverTooOldForCuda"), ("probe.ran", "ProbePending"), ("probe.*.passed", "ProbeFailed"),
    ("tuning.reverted", "Reverted"), ("tuning.compliant", "TuningNotCompliant"),
    ("topology.published", "NotPublished"),
    # warnings by default: their reason where a profile makes them fatal (readiness.checks)
    ("gpu.readings", "GpuReadingsFailed"), ("gpu.health_state", "HealthStateNotKept"),
    ("gpu.kernel_log", "KernelLogNotRead"), ("gpu.xid_unknown", "UnknownXid"), ("gpu.xid_recurring", "RecurringXid"),
    ("gpu.recovery_p2p", "GpuP2pDrainAsked"), ("gpu.inforom", "InforomInvalid"),
    ("network.link_flaps", "InfinibandLinkFlaps"), ("gpu.pcie_errors", "PcieErrors"),
    ("gpu.clocks", "GpuClocksSlowed"),
)
# Readings that move from one pass to the next, and their stable stand-ins: kept out of what is
# written to the Node (the condition's message, the summary annotation), so a steady node is not
# rewritten every pass.
VOLATILE_READINGS = (
    (re.compile(r" at \d+(\.\d+)?% utilization"), " under load"),
    (re.compile(r"temperature \d+(\.\d+)? C above"), "temperature above"),
)


def without_readings(text: str) -> str:
    for pattern, repl in VOLATILE_READINGS:
        text = pattern.sub(repl, text)
    return text


def _matches(pattern: str, name: str) -> bool:
    want, parts = pattern.split("."), name.split(".")
    return len(want) == len(parts) and all(w in ("*", p) for w, p in zip(want, parts))


def _rank(c: Check) -> int:
    return CATEGORIES.index(c.category) if c.category in CATEGORIES else len(CATEGORIES)


def _first_clause(detail: str) -> str:
    """A detail without its remedy: up to the first "; " (and a trailing ": do this")."""
    head = detail.split("; ", 1)[0]
    for marker in (": run ", ": restart ", ": drain ", ": cordon ", ": check ", ": reseat ", ": upgrade ",
                   ": deploy ", ": see ", ": install "):
        if marker in head:
            head = head.split(marker, 1)[0]
    return head.strip()


def headline(c: Check) -> str:
    """A failing check's figures in a few words; ``[readiness.checks.NAME]`` first when the profile set
    its severity (the condition, its Events and a Slurm drain reason name whose decision it was)."""
    text = without_readings(c.summary or _first_clause(c.detail))
    if c.policy_key:
        text = f"[{c.policy_key}] {text}"
    return text if len(text) <= MAX_HEADLINE else text[:MAX_HEADLINE - 1] + "…"


@dataclass(frozen=True)
class Verdict:
    ready: bool
    checks: tuple[Check, ...] = field(default_factory=tuple)
    # the checks the profile turns off: (name, gpu_tune.judge.policy.Weight), said once
    off: tuple[tuple[str, Any], ...] = ()
    policy: Policy | None = None  # what the checks were weighed by (None: the catalog alone)

    def plus(self, check: Check) -> "Verdict":
        """This verdict with one more check (a scheduler's: slurm.gres), weighed by the same policy."""
        pol = self.policy or Policy()
        w = pol.weight(check.name, check.severity)
        if w.severity == "off":
            return Verdict(self.ready, self.checks, self.off + ((check.name, w),), self.policy)
        checks = self.checks + tuple(pol.weigh([check]))
        return Verdict(all(c.ok for c in checks if c.gating), checks, self.off, self.policy)

    def off_words(self) -> str:
        """``gpu.inforom off by profile training: readiness.checks.gpu.inforom; ...`` ("" when none)."""
        return "; ".join(f"{name} off by {w.by}" for name, w in self.off)

    @property
    def failed(self) -> tuple[Check, ...]:
        """The failing checks that gate the node (fatal)."""
        return tuple(c for c in self.checks if not c.ok and c.gating)

    @property
    def warnings(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.ok and not c.gating)

    def most_urgent(self) -> Check | None:
        """The failing fatal check the condition names (its category's urgency; ties: listed first)."""
        failed = self.failed
        return min(failed, key=_rank) if failed else None

    def reason(self) -> str:
        """A CamelCase reason for a Kubernetes condition: the most urgent failing check's."""
        if self.ready:
            return "AllChecksPassed"
        top = self.most_urgent()
        if top is None:
            return "NotReady"
        if top.reason:  # a check that says its own reason (tuning.reverted: Reverted, RevertPending, RevertFailed)
            return top.reason
        return next((r for p, r in REASONS if _matches(p, top.name)), "NotReady")

    def message(self) -> str:
        """One line for the condition: the most urgent failing check with its figures, then the
        names of the others. Stable from pass to pass (no reading that moves every pass)."""
        if self.ready:
            n = len([c for c in self.checks if c.gating])
            off = f"; off by profile {self.policy.profile}: {', '.join(n for n, _ in self.off)}" \
                if self.off and self.policy is not None else ""
            text = f"all {n} checks passed{off}"
            return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 1] + "…"
        top = self.most_urgent()
        assert top is not None
        text = f"{top.name}: {headline(top)}".rstrip(": ")
        others = [c.name for c in sorted(self.failed, key=_rank) if c is not top]
        if others:
            text += "; also failing: " + ", ".join(others)
        return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 1] + "…"

    def hardware(self) -> "Verdict":
        """The verdict over the hardware's own checks (lost GPUs, XIDs, memory, fabric, network,
        PCIe, thermals): what a node auto-repair controller may act on."""
        hw = tuple(c for c in self.checks if c.category in HARDWARE)
        return Verdict(all(c.ok for c in hw if c.gating), hw, policy=self.policy)

    def policy_doc(self) -> dict[str, Any]:
        """What /readiness and ``gpu-tune check -o json`` say of the policy: the profile's digest and
        the checks it turns off, each with where that came from."""
        return {"profile_digest": self.policy.digest if self.policy is not None else "",
                "off": [{"name": name, "severity_from": w.by} for name, w in self.off]}

    def as_dict(self) -> dict[str, Any]:
        return {"ready": self.ready, "reason": self.reason(), "message": self.message(),
                "checks": [c.as_dict() for c in self.checks], **self.policy_doc()}


def _gpu_infos(gpus: Iterable[Any] | None) -> tuple[GpuInfo, ...]:
    out = []
    for g in gpus or ():
        out.append(g if isinstance(g, GpuInfo) else GpuInfo.from_dict(g))
    return tuple(sorted(out, key=lambda g: g.index))


def verdict(
    *,
    profile: Any,
    audit: Mapping[str, Any] | None,
    gpus: Iterable[Any] | None,
    topology: Mapping[str, Any] | None = None,
    probes: Sequence[Mapping[str, Any]] | None = (),
    publish: Any = None,
    errors: Mapping[str, str] | None = None,
    mode: str = "audit",
    last_publish: Any = None,
    pending_publish: bool = False,
    revert: Mapping[str, Any] | None = None,
    host: Any = None,
    history: Any = None,
    expect: Expect | None = None,
) -> Verdict:
    """Judge the node: every family of :data:`~gpu_tune.judge.checks.REGISTRY` over this pass's
    facts. ``errors`` maps a stage name (discover, audit, enforce, gpus, probe, publish, revert) to
    the reason it failed this pass. ``publish`` None leaves the publish check out (used to decide
    what to publish before publishing); ``gpu.allocatable`` then judges the Node as
    ``last_publish`` (the previous pass, or a read before the first publish) read it;
    ``pending_publish`` lists the publish check as ok (the verdict about to be published).
    ``probes`` None leaves the probe out (``gpu-tune check`` without ``--probe``). ``host`` (a
    :class:`~gpu_tune.discover.health.HostHealth`), ``history`` (a
    :class:`~gpu_tune.judge.checks.state.HealthView`) and ``expect`` feed the health families; without
    them those families judge what the GPU backend alone says. The one verdict of the agent
    (``serve``), ``gpu-tune label`` and ``gpu-tune check``. The profile's policy
    (:func:`~gpu_tune.judge.policy.policy_of`) weighs what the families report; a family whose
    every check it turns off is not run."""
    pol = policy_of(profile)
    facts = Facts(profile=profile, audit=audit, gpus=_gpu_infos(gpus), topology=topology, probes=probes,
                  publish=publish, node_facts=publish if publish is not None else last_publish,
                  errors=dict(errors or {}), mode=mode, pending_publish=pending_publish, revert=revert,
                  host=host, history=history, expect=expect or Expect(), policy=pol)
    checks: list[Check] = []
    for family in REGISTRY:
        if not pol.all_off(family):
            checks += family.evaluate(facts)
    checks = pol.weigh(checks)
    return Verdict(all(c.ok for c in checks if c.gating), tuple(checks), pol.off(), pol)
