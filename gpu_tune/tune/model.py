"""Plain data passed between the stages: audit rows and reports (the JSON documents of docs/cli.md)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

Status = Literal["ok", "drift", "unsupported", "conflict", "error"]
NONCOMPLIANT: frozenset[str] = frozenset({"drift", "conflict", "error"})


@dataclass(frozen=True)
class Setting:
    """One (id, target) as read from the host, with what the profile wants.

    ``path`` is the host file the knob writes (kernel-style path), when it writes one;
    ``handle`` is knob-private data the knob needs to apply or restore (never serialised
    to the user).
    """

    id: str
    target: str
    current: str | None
    desired: str
    status: Status
    detail: str = ""
    path: str | None = None
    handle: Any = None
    changed: bool | None = None

    def with_(self, **kw) -> "Setting":
        return replace(self, **kw)

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": self.id,
            "target": self.target,
            "current": self.current,
            "desired": self.desired,
            "status": self.status,
            "detail": self.detail,
        }
        if self.changed is not None:
            d["changed"] = self.changed
        return d


@dataclass(frozen=True)
class Report:
    profile: str
    settings: tuple[Setting, ...] = field(default_factory=tuple)

    @property
    def compliant(self) -> bool:
        return not any(s.status in NONCOMPLIANT for s in self.settings)

    def as_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "compliant": self.compliant,
            "settings": [s.as_dict() for s in self.settings],
        }
