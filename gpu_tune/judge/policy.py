"""The operator's policy (docs/health.md "Your policy"): how much each finding weighs on this node,
decided once, in one place, between the readings and the verdict. The families
(:mod:`gpu_tune.judge.checks`) report what they saw with the catalog's severity; :func:`policy_of`
reads the profile's ``readiness.checks`` and ``readiness.xid``, checks them whole (a check name
that no family lists, with the closest one named; a repeat rule for an XID that is fatal at its
first record), and :meth:`Policy.weigh` gives each check the severity it runs with and where that
came from: ``catalog`` (the family's own, docs/health.md "The checks") or the profile's key in
words (``profile training: readiness.checks.gpu.inforom``, and the included file that set it).

What a key of ``readiness.checks`` names, most precise first:

- a check's name (``gpu.inforom``, ``slurm.gres``; ``probe.3.passed``, ``probe.cpu.passed``: one
  probe target);
- ``probe.*.passed``: every probe target (the only pattern: the probe's names are the only ones
  that vary);
- a family's name (``network``, ``xid``, ``thermal``, ...: every check of that family, the table
  in docs/health.md).

``off``: not evaluated (a family whose every check is off is not run) and said once in the
verdict. What each XID weighs is :class:`~gpu_tune.judge.checks.xid_policy.XidPolicy`'s, built here.
The profile's ``readiness.max_out_of_service`` rides along (:attr:`Policy.limit`): a decision about
the fleet, not the node, which the schedulers' adapters ask :mod:`gpu_tune.judge.fleet_limit` about.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from gpu_tune.errors import InputError
from gpu_tune.judge.checks import REGISTRY, Check
from gpu_tune.judge.checks.catalog import catalog
from gpu_tune.judge.checks.xid_policy import CATALOG, XidPolicy
from gpu_tune.tune.readiness import DEFAULT_OUT_OF_SERVICE, OutOfService, parse_out_of_service

BY_CATALOG = "catalog"
OFF = "off"
PROBE_PATTERN = "probe.*.passed"
PROBE_ONE = re.compile(r"probe\.([0-9]{1,4}|cpu)\.passed")
# Checks that are no family's: what a scheduler's adapter adds (gpu_tune/slurm/gres.py), by family.
SCHEDULER_CHECKS = {"slurm": ("slurm.gres",)}


def _declared() -> dict[str, str]:
    """Every check name a family lists (the probe's per-target name as its pattern) -> its family."""
    out: dict[str, str] = {}
    for fam in REGISTRY:
        for name in fam.checks:
            out[PROBE_PATTERN if name == "probe.<gpu>.passed" else name] = fam.name
    for fam_name, names in SCHEDULER_CHECKS.items():
        out.update({n: fam_name for n in names})
    return out


DECLARED = _declared()
FAMILIES = frozenset(DECLARED.values())


@dataclass(frozen=True)
class Weight:
    """The severity a check runs with, and where it came from: ``by`` in words, ``key`` the
    profile's key (``readiness.checks.gpu.inforom``; "" for the catalog)."""

    severity: str
    by: str = BY_CATALOG
    key: str = ""


@dataclass(frozen=True)
class Policy:
    profile: str = ""
    digest: str = ""  # sha256 of the profile as loaded (includes merged): nodes on different policies differ
    rules: Mapping[str, Weight] = field(default_factory=dict)  # readiness.checks key -> weight
    xid: XidPolicy = CATALOG
    # readiness.max_out_of_service: the most nodes gpu-tune holds out of service at once
    limit: OutOfService = field(default_factory=lambda: parse_out_of_service(DEFAULT_OUT_OF_SERVICE))

    def weight(self, name: str, default: str) -> Weight:
        """The weight of the check ``name`` whose family gives it ``default``."""
        probe = PROBE_ONE.fullmatch(name)
        family = DECLARED.get(PROBE_PATTERN if probe else name)
        for key in (name, PROBE_PATTERN if probe else None, family):
            if key is not None and key in self.rules:
                return self.rules[key]
        return Weight(default)

    def all_off(self, family: Any) -> bool:
        """Every check of ``family`` is off: it is not run at all."""
        return bool(family.checks) and all(self.weight(n.replace("<gpu>", "*"), family.severity).severity == OFF
                                           for n in family.checks)

    def off(self) -> tuple[tuple[str, Weight], ...]:
        """The checks the profile turns off, each once: a family's listed names and the probe
        targets the profile names one by one."""
        names = [n for n in DECLARED if DECLARED[n] not in SCHEDULER_CHECKS]
        names += [k for k in self.rules if PROBE_ONE.fullmatch(k)]
        return tuple((n, w) for n in names if (w := self.weight(n, "")).severity == OFF)

    def weigh(self, checks: Iterable[Check]) -> list[Check]:
        """``checks`` with the severity each runs with and where it came from; the ones turned off
        left out (:meth:`off` says them)."""
        out = []
        for c in checks:
            w = self.weight(c.name, c.severity)
            if w.severity == OFF:
                continue
            out.append(c.weighed(w.severity, w.by, w.key) if w.key else c)
        return out

    def overrides(self) -> dict[str, str]:
        """Each key of readiness.checks with its severity and origin, in words: what the Node's
        summary carries for the fleet view."""
        return {k: f"{w.severity} by {w.by}" for k, w in sorted(self.rules.items())}


def digest_of(profile: Any) -> str:
    doc = profile.model_dump(mode="json") if hasattr(profile, "model_dump") else {}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def policy_of(profile: Any) -> Policy:
    """The policy of a loaded profile (made once per profile object); the catalog's alone for an
    object without a readiness section. Raises :class:`InputError` (exit 2, one line naming the
    file and the key) for a check name no family lists or a repeat rule that cannot apply."""
    readiness = getattr(profile, "readiness", None)
    cached = getattr(profile, "_policy", None)
    if isinstance(cached, tuple) and cached[0] is readiness:  # a copy with another readiness section is made anew
        return cached[1]
    if readiness is None or not hasattr(profile, "model_dump"):
        return Policy(profile=str(getattr(profile, "name", "") or ""))
    made = _build(profile, readiness)
    try:
        profile._policy = (readiness, made)
    except (AttributeError, TypeError, ValueError):  # pragma: no cover - a profile that keeps nothing
        pass
    return made


def _where(profile: Any, key: str) -> tuple[str, str]:
    """(the file to name in an error, " (in FILE)" when an included file set the key)."""
    source = getattr(profile, "_source", "") or f"profile {getattr(profile, 'name', '?')}"
    origin = (getattr(profile, "_origins", None) or {}).get(key, "")
    own = source.rsplit("/", 1)[-1]
    return source, (f" (in {origin})" if origin and origin != own else "")


def _build(profile: Any, readiness: Any) -> Policy:
    name = str(profile.name)
    rules: dict[str, Weight] = {}
    for key, severity in (readiness.checks or {}).items():
        source, inc = _where(profile, f"checks.{key}")
        if not (key in DECLARED or key in FAMILIES or PROBE_ONE.fullmatch(key)):
            known = sorted(set(DECLARED) | FAMILIES)
            import difflib  # only for a misspelt name: the agent does not keep it resident

            close = difflib.get_close_matches(key, known, n=1, cutoff=0.0)
            hint = f" (the closest: {close[0]})" if close else ""
            raise InputError(f"{source}: readiness.checks.{key}{inc}: no such check{hint}; `gpu-tune check -o json` "
                             "lists the checks, docs/health.md the families")
        rules[key] = Weight(severity, f"profile {name}: readiness.checks.{key}{inc}", f"readiness.checks.{key}")
    by: dict[int, str] = {}
    files: dict[int, str] = {}
    cat = catalog()
    for code, rule in (readiness.xid or {}).items():
        source, inc = _where(profile, f"xid.{code}")
        files[code] = inc[len(" (in "):-1] if inc else ""
        entry = cat.xid(code)
        if rule.repeat is not None and entry is not None and entry.fatal:
            raise InputError(f"{source}: readiness.xid.{code}{inc}: XID {code} is fatal at its first record (catalog: "
                             f"{entry.action}): a repeat rule is for an XID that is not (the same fatal XID in 3 "
                             f"boots already escalates to inspect_hw); to change its action write {code}: ACTION")
        by[code] = f"profile {name}: readiness.xid.{code}{inc}"
    return Policy(profile=name, digest=digest_of(profile), rules=rules,
                  xid=XidPolicy(dict(readiness.xid or {}), by, name, files),
                  limit=getattr(readiness, "max_out_of_service", None) or Policy().limit)
