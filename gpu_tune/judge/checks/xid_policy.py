"""What each XID weighs on this node: NVIDIA's catalog (:mod:`~gpu_tune.judge.checks.catalog`) under
the profile's ``readiness.xid`` (docs/health.md "Your policy"), asked in one place by the kernel
log's reader (what to keep), the health state (what to remember as fatal, which bursts to count) and
the xid checks (what to say). Built by :func:`gpu_tune.judge.policy.policy_of`; :data:`CATALOG` is
the catalog alone.

- ``N: ACTION`` replaces the catalog's action for every record of XID N (a fatal action gates the
  node as a fatal XID of the catalog does; ``ignore`` or ``restart_app`` never gates);
- ``N: {action, count, within}`` (a repeat rule) leaves each record as the catalog weighs it and
  applies ``action`` once ``count`` bursts of XID N on one GPU fall within the window: a fatal
  action is then remembered as a fatal XID (until a reboot or ``gpu-tune set-healthy``),
  ``restart_app`` is a warning (``gpu.xid_recurring``) while the last burst that completed the count
  lies within the window. A repeat rule is for an XID that is not fatal at its first record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from gpu_tune.discover.xids import FATAL, OTHER
from gpu_tune.judge.checks.catalog import FATAL_ACTIONS, catalog, sighting_rank


@dataclass(frozen=True)
class XidPolicy:
    """``rules``: XID -> :class:`~gpu_tune.tune.readiness.XidRule`; ``by``: XID -> where its rule
    comes from, in words (``profile training: readiness.xid.45``); ``profile``: whose rules they are;
    ``files``: XID -> the included file that set its rule ("" for the profile's own)."""

    rules: Mapping[int, Any] = field(default_factory=dict)
    by: Mapping[int, str] = field(default_factory=dict)
    profile: str = ""
    files: Mapping[int, str] = field(default_factory=dict)

    def plain(self, code: int) -> Any:
        r = self.rules.get(code)
        return r if r is not None and r.repeat is None else None

    def repeat(self, code: int) -> Any:
        r = self.rules.get(code)
        return r if r is not None and r.repeat is not None else None

    @property
    def repeats(self) -> dict[int, Any]:
        return {c: r for c, r in self.rules.items() if r.repeat is not None}

    def action(self, code: int) -> str | None:
        """The action every record of XID ``code`` is weighed with (None: nobody knows it)."""
        rule = self.plain(code)
        if rule is not None:
            return rule.action
        entry = catalog().xid(code)
        return entry.action if entry is not None and not entry.unused else None

    def source(self, code: int) -> str:
        """Where XID ``code``'s weight comes from: "" for the catalog, else the rule's words."""
        return self.by.get(code, "") if code in self.rules else ""

    def fatal_for(self, kind: str, code: int, message: str = "", severity_word: str | None = None) -> bool:
        """Whether one record keeps the node not ready (before any repeat rule)."""
        if kind == "sxid":
            entry = catalog().sxid(code)
            return entry.fatal_for(message) if entry is not None else severity_word == "Fatal"
        rule = self.plain(code)
        if rule is not None:
            return rule.action in FATAL_ACTIONS
        entry = catalog().xid(code)
        return entry.fatal_for(message) if entry is not None else False

    def rank(self, kind: str, code: int, message: str, severity_word: str | None) -> int:
        """How much one record matters to the kernel log's reader (gpu_tune.discover.xids): an XID
        the profile names is never an unknown one to name in a warning."""
        if kind == "xid" and code in self.rules:
            return FATAL if self.fatal_for(kind, code, message, severity_word) else OTHER
        return sighting_rank(kind, code, message, severity_word)

    def timed(self, kind: str, code: int) -> bool:
        """Whether the reader keeps the bursts of this XID (a repeat rule counts them)."""
        return kind == "xid" and self.repeat(code) is not None

    def unknown_rules(self) -> list[int]:
        """The XIDs the profile has a rule for and the catalog does not know (a newer driver's)."""
        cat = catalog()
        return sorted(c for c in self.rules if cat.xid(c) is None)

    def words(self) -> str:
        """The profile's XID rules in a few words, equal rules together: ``profile training's
        readiness.xid: 13, 31, 43, 45 restart_app after 5 within 24h (in _base.yaml)`` ("" when none);
        a rule for an XID the catalog does not know says so."""
        if not self.rules:
            return ""
        groups: dict[tuple[str, str], list[int]] = {}
        for code in sorted(self.rules):
            groups.setdefault((self.rules[code].words(), self.files.get(code, "")), []).append(code)
        unknown = set(self.unknown_rules())
        parts = []
        for (words, where), codes in groups.items():
            new = [c for c in codes if c in unknown]
            note = f"; XID {', '.join(map(str, new))} not in the catalog {catalog().version}: judged by this rule " \
                   "alone" if new else ""
            parts.append(f"{', '.join(map(str, codes))} {words}" + (f" (in {where}{note})" if where else
                                                                     f" ({note[2:]})" if note else ""))
        return f"profile {self.profile}'s readiness.xid: " + "; ".join(parts)


CATALOG = XidPolicy()
