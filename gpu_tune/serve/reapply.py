"""Enforce mode's re-apply of drift, at most once per ``min_interval`` per setting
(:class:`ReapplyLimit`), and what each drifted row then says.

A drifted setting is re-applied when its last try is ``min_interval`` old or older. The limit is on
tries, whether the write worked or not: a setting another owner keeps changing is not fought every
pass, and one the kernel refuses (``kernel.numa_balancing`` without ``CAP_SYS_ADMIN``) is not tried
and logged every pass. Between tries a row says why it is still not as wanted: the refusal of its
last try (status ``error``, the kernel's own words), or, when that try worked and the setting
drifted again since, that the rate limit holds it back. Each refused try is one warning in the log
(the journal of ``gpu-tune.service``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from gpu_tune.tune.knobs import fixable

log = logging.getLogger("gpu_tune")

Key = tuple[str, str]


def _key(row: dict[str, Any]) -> Key:
    return str(row.get("id")), str(row.get("target"))


class ReapplyLimit:
    def __init__(self, min_interval: float) -> None:
        self.min_interval = float(min_interval)
        self.tried: dict[Key, float] = {}  # (id, target) -> when its last re-apply was tried
        self.refused: dict[Key, str] = {}  # (id, target) -> why its last try did not take

    def run(self, before: dict[str, Any], now: float, enforce: Callable[[set[Key]], dict[str, Any]],
            reason_of: Callable[[Exception], str]) -> dict[str, Any]:
        """``before``: this pass's audit document; ``enforce(keys)`` re-applies those keys and gives the
        apply document. Returns the document the agent publishes."""
        drifted = [_key(s) for s in before.get("settings", []) if s.get("status") == "drift"
                   and fixable(str(s.get("id")))]  # read-only checks (limits.memlock, gpu.mig_mode) never are
        due = {k for k in drifted if now - self.tried.get(k, float("-inf")) >= self.min_interval}
        held = set(drifted) - due
        if not due:
            return self._explain(before, held, now)
        for k in due:
            self.tried[k] = now
        try:
            doc = enforce(due)
        except Exception as exc:
            reason = reason_of(exc)
            rows = [{**s, "status": "error", "changed": False, "detail": f"not re-applied: {reason}"}
                    if _key(s) in due and s.get("status") == "drift" else s for s in before.get("settings", [])]
            doc = {**before, "compliant": False, "settings": rows}
        for s in doc.get("settings", []):
            k = _key(s)
            if k not in due:
                continue
            if s.get("status") == "error":
                self.refused[k] = str(s.get("detail") or "the write failed")
                log.warning("enforce: %s (%s) not re-applied: %s; next try in %.0fs", k[0], k[1], self.refused[k],
                            self.min_interval)
            else:
                self.refused.pop(k, None)
        return self._explain(doc, held, now)

    def _explain(self, doc: dict[str, Any], held: set[Key], now: float) -> dict[str, Any]:
        """Rows held back say why: the refusal of their last try, else the rate limit."""
        rows = []
        for s in doc.get("settings", []):
            k = _key(s)
            if s.get("status") == "drift" and k in held:
                ago = now - self.tried[k]
                left = f"next try in {self.min_interval - ago:.0f}s"
                if k in self.refused:
                    s = {**s, "status": "error", "detail": f"{self.refused[k]} (re-apply tried {ago:.0f}s ago; {left})"}
                else:
                    s = {**s, "detail": f"held back by the enforce rate limit: re-applied {ago:.0f}s ago, "
                                        f"next re-apply allowed in {self.min_interval - ago:.0f}s"}
            rows.append(s)
        if any(s.get("status") == "error" for s in rows):
            doc = {**doc, "compliant": False}
        return {**doc, "settings": rows}
