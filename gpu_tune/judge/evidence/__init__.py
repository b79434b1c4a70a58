"""Evidence kept at the moment a hardware fault is first seen, before anyone reboots it away
(docs/health.md "Evidence"): one bounded bundle per fault under ``<root>/var/lib/gpu-tune/evidence/``,
written by :class:`~gpu_tune.judge.evidence.keeper.EvidenceKeeper` beside the health state whose
record says what was first seen (``health.json``'s ``evidence`` marks).

This module is all a healthy pass imports: what a finding worth evidence is (:func:`wanted`, over
the verdict alone) and the bounds from the environment (:func:`settings_from_env`). The rest
(:mod:`.findings`, :mod:`.bundle`, :mod:`.keeper`, :mod:`.bugreport`) is imported when a fault
appears, so the agent's memory does not grow with it on a healthy node.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

from gpu_tune.errors import InputError
from gpu_tune.judge.checks.base import HARDWARE

FOLDER = "/var/lib/gpu-tune/evidence"
# A failing fatal check of a hardware category (base.HARDWARE) keeps evidence, but for these: the
# network's (an InfiniBand port's evidence is the cable's and the switch's, and its files are the
# check's detail) and gpu.visible (the container's view of the GPUs, not the hardware).
NOT_EVIDENCE_CATEGORIES = frozenset({"network"})
NOT_EVIDENCE_CHECKS = frozenset({"gpu.visible"})

ENV_KEEP = "GPU_TUNE_EVIDENCE_KEEP"
ENV_MAX_BYTES = "GPU_TUNE_EVIDENCE_MAX_BYTES"
ENV_BUNDLE_BYTES = "GPU_TUNE_EVIDENCE_BUNDLE_BYTES"
ENV_TIMEOUT = "GPU_TUNE_EVIDENCE_BUG_REPORT_TIMEOUT"
_SIZE_RE = re.compile(r"([0-9]{1,12})(Ki|Mi|Gi)?")
_UNITS = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
MIN_BUNDLE_BYTES = 64 << 10


@dataclass(frozen=True)
class Settings:
    """The bounds: the newest ``keep`` bundles and at most ``max_bytes`` in all (the oldest removed
    first; 0 bundles: no evidence is kept), each bundle at most ``bundle_bytes`` (what is cut says
    so), and ``nvidia-bug-report.sh`` stopped after ``bug_report_timeout`` seconds (0: not run)."""

    keep: int = 16
    max_bytes: int = 512 << 20
    bundle_bytes: int = 64 << 20
    bug_report_timeout: float = 300.0

    def as_dict(self) -> dict[str, Any]:
        return {"keep": self.keep, "max_bytes": self.max_bytes, "bundle_bytes": self.bundle_bytes,
                "bug_report_timeout_s": self.bug_report_timeout}


def _size(name: str, text: str) -> int:
    m = _SIZE_RE.fullmatch(text.strip())
    if m is None:
        raise InputError(f"{name}={text[:40]!r}: expected a size in bytes (a whole number, or with Ki, Mi or Gi)")
    return int(m.group(1)) * _UNITS[m.group(2)]


def settings_from_env(env: Mapping[str, str] | None = None) -> Settings:
    """The bounds from the environment (:data:`ENV_KEEP` and the others), checked before anything
    runs: a bad value is :class:`~gpu_tune.errors.InputError` (exit 2), one line naming it."""
    env = os.environ if env is None else env
    d = Settings()
    keep, max_bytes, bundle, timeout = d.keep, d.max_bytes, d.bundle_bytes, d.bug_report_timeout
    if env.get(ENV_KEEP, "").strip():
        text = env[ENV_KEEP].strip()
        if not (text.isascii() and text.isdigit() and len(text) <= 4 and int(text) <= 1024):
            raise InputError(f"{ENV_KEEP}={text[:40]!r}: expected a number of bundles from 0 (none kept) to 1024")
        keep = int(text)
    if env.get(ENV_MAX_BYTES, "").strip():
        max_bytes = _size(ENV_MAX_BYTES, env[ENV_MAX_BYTES])
    if env.get(ENV_BUNDLE_BYTES, "").strip():
        bundle = _size(ENV_BUNDLE_BYTES, env[ENV_BUNDLE_BYTES])
    if env.get(ENV_TIMEOUT, "").strip():
        text = env[ENV_TIMEOUT].strip()
        if not (text.isascii() and text.isdigit() and len(text) <= 5 and int(text) <= 3600):
            raise InputError(f"{ENV_TIMEOUT}={text[:40]!r}: expected whole seconds from 0 (never run) to 3600")
        timeout = float(text)
    if bundle < MIN_BUNDLE_BYTES:
        raise InputError(f"{ENV_BUNDLE_BYTES}={bundle}: at least {MIN_BUNDLE_BYTES} bytes (64Ki) for one bundle")
    if max_bytes < bundle:
        raise InputError(f"{ENV_MAX_BYTES}={max_bytes}: less than one bundle ({ENV_BUNDLE_BYTES}={bundle})")
    return Settings(keep, max_bytes, bundle, timeout)


def is_evidence(check: Any) -> bool:
    """Whether a failing check keeps evidence: fatal (as the profile weighs it), of a hardware
    category, not one of :data:`NOT_EVIDENCE_CATEGORIES` or :data:`NOT_EVIDENCE_CHECKS`."""
    return (not check.ok and check.gating and check.category in HARDWARE
            and check.category not in NOT_EVIDENCE_CATEGORIES and check.name not in NOT_EVIDENCE_CHECKS)


def wanted(verdict: Any) -> bool:
    """Whether this verdict holds a finding that keeps evidence (cheap: the checks alone)."""
    return any(is_evidence(c) for c in verdict.checks)
