"""The host's tuning: a preference of the profile, never a fault of the hardware.

- ``tuning.compliant``: the audit (or enforce) report has no ``drift``/``conflict``/``error`` row
  (GPU persistence mode among them: ``gpu.persistence_mode`` is a setting, not a GPU's health);
  ``readiness.require_compliant: false`` keeps it listed but ok, with the finding in the detail.
- ``tuning.reverted``: in mode ``revert`` instead: never ok (the node is taken back on purpose);
  the detail says what the revert restored or could not; the reason is ``Reverted`` only once
  every original is back (else ``RevertPending`` or ``RevertFailed``).
"""

from __future__ import annotations

from typing import Any, Mapping

from gpu_tune.judge.checks.base import Check, Facts, Family, listed

NONCOMPLIANT = ("drift", "conflict", "error")


def tuning_check(audit: Mapping[str, Any] | None, *, required: bool = True, error: str | None = None,
                 mode: str = "audit") -> Check:
    name = "tuning.compliant"
    fam = Tuning()
    if error:
        return fam.check(name, not required, f"{mode} failed: {error}; see the agent log and run "
                                             f"`gpu-tune audit` on the node")
    if audit is None:
        return fam.check(name, not required, "no audit has completed yet")
    bad = [s for s in audit.get("settings", []) if s.get("status") in NONCOMPLIANT]
    if not bad:
        n = len(audit.get("settings", []))
        return fam.check(name, True, f"{n} settings compliant with profile {audit.get('profile', '?')}")
    parts = []
    for s in bad:
        what = f"{s.get('id')}[{s.get('target')}] {s.get('status')}"
        if s.get("status") == "drift":
            desired = str(s.get("desired"))
            # a bound or a budget ("≥ 1048576", "≤ 10 µs") reads as what is wanted, not a value
            rel = "wants" if desired[:1] in ("≥", "≤") else "!="
            what += f": {s.get('current')!s} {rel} {desired}"
        elif s.get("detail"):
            what += f": {s.get('detail')}"
        parts.append(what)
    fix = "run `gpu-tune apply`" if mode == "audit" else "see the rows' detail"
    detail = f"{len(bad)} setting(s) not compliant ({fix}): {listed(parts)}"
    if not required:
        return fam.check(name, True, "ignored (readiness.require_compliant is false): " + detail)
    shown = [p.split(": ", 1)[0] + (f" {p.split(': ', 1)[1]}" if ": " in p and "drift" in p else "")
             for p in parts[:3]]
    summary = f"{len(bad)} setting(s) not compliant: " + "; ".join(shown) + (
        f"; and {len(parts) - 3} more" if len(parts) > 3 else "")
    return fam.check(name, False, detail, summary)


def _short(value: Any, most: int = 40) -> str:
    text = str(value)
    return text if len(text) <= most else text[:most - 1] + "…"


def _first3(items: list[str]) -> str:
    return "; ".join(items[:3]) + (f"; and {len(items) - 3} more" if len(items) > 3 else "")


def reverted_check(revert: Mapping[str, Any] | None, *, error: str | None = None) -> Check:
    """Mode ``revert``: the node is taken back to its recorded originals and not enforced. Reason
    ``Reverted`` only once every original is back; ``RevertPending`` while some are still to
    restore (with who can do it, when this run never writes the host: ``revert["read_only"]``,
    ``revert["by"]`` names the run); ``RevertFailed`` when restoring some failed."""
    name = "tuning.reverted"
    fam = Tuning()
    if error:
        return fam.check(name, False, f"revert failed: {error}; see the agent log", reason="RevertFailed")
    if revert is None:
        return fam.check(name, False, "mode revert: the revert has not run yet", reason="RevertPending")
    left = [r for r in revert.get("settings", []) if r.get("status") != "ok"]
    if left and revert.get("read_only"):
        rows = [f"{r.get('id')}[{r.get('target')}] {_short(r.get('current'))}, original {_short(r.get('desired'))}"
                for r in left]
        figures = (f"mode revert asked for, but {revert.get('by') or 'this run never writes the host'}: "
                   f"{len(left)} original(s) still to restore")
        return fam.check(name, False, f"{figures} ({listed(rows)}): an agent in mode enforce or revert on this node "
                                      f"restores them (with this label on), or run `gpu-tune revert` on the node",
                         f"{figures} ({_first3(rows)})", reason="RevertPending")
    if left:
        failed = [f"{r.get('id')}[{r.get('target')}]: {r.get('detail')}" for r in left]
        figures = f"mode revert: {len(left)} original(s) could not be restored"
        return fam.check(name, False, f"{figures} (kept in the journal, tried again each pass, or run `gpu-tune "
                                      f"revert` on the node once the cause is fixed): {listed(failed)}",
                         f"{figures}: {_first3(failed)}", reason="RevertFailed")
    return fam.check(name, False, "mode revert: the recorded originals are restored and nothing is enforced; "
                                  "the node is left as it was before gpu-tune", reason="Reverted")


class Tuning(Family):
    name = "tuning"
    category = "tuning"
    source = "the audit of the profile's settings (gpu-tune audit)"
    reads = "sysctls, THP, CPU governor and idle states, GPU persistence mode, IRQ affinity, the allocator preload"
    thresholds = "every setting ok or unsupported (readiness.require_compliant)"
    remedy = "gpu-tune apply (or the enforce-mode DaemonSet)"
    checks = ("tuning.compliant", "tuning.reverted")

    def evaluate(self, facts: Facts) -> list[Check]:
        if facts.mode == "revert":
            return [reverted_check(facts.revert, error=facts.errors.get("revert"))]
        rp = facts.readiness
        return [tuning_check(facts.audit, required=getattr(rp, "require_compliant", True),
                             error=facts.errors.get("audit") or facts.errors.get("enforce"), mode=facts.mode)]
