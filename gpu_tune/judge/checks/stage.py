"""Whether the health checks could judge this pass, and what they could not keep.

- ``gpu.health`` (fatal, listed only then): the health readings (kernel log, InfiniBand, AER, the
  PCIe link files, the state file) could not be taken this pass: the stage raised or did not
  return in time. Fails closed: a node whose health cannot be judged is not ready, so a crash
  can never read as ``AllChecksPassed`` over a fatal XID, a port down or a fatal AER error.
  Its category is not the hardware's: the hardware condition a node auto-repair controller acts
  on is not turned False by the agent's own failure (docs/health.md "Node auto-repair").
- ``gpu.health_state`` (warning): the state file was not this tool's (set aside, a new one
  started), could not be written (what this process saw is kept in memory: the detail names it),
  the boot cannot be known (nothing is cleared, nothing forgotten), or a host file the health
  readings need (``/proc/uptime``) holds what the kernel never writes.
"""

from __future__ import annotations

from gpu_tune.judge.checks.base import WARNING, Check, Facts, Family, listed


class HealthStage(Family):
    name = "health"
    category = "health"
    source = "the agent's health stage; /var/lib/gpu-tune/health.json"
    reads = "whether the kernel log, InfiniBand, AER and PCIe link files were read; the state file"
    thresholds = "the stage ran and returned this pass (fatal); the state file read and written (warning)"
    remedy = "see the agent's log (-v); a state file set aside is kept as health.json.bad"
    checks = ("gpu.health", "gpu.health_state")

    def evaluate(self, facts: Facts) -> list[Check]:
        out: list[Check] = []
        failed = facts.errors.get("health")
        if failed:
            stale = " (the figures of the other checks are the last pass's that read them)" if facts.host is not None \
                else ""
            out.append(self.check(
                "gpu.health", False, f"the health readings could not be taken this pass: {failed}: fatal XIDs, "
                "InfiniBand ports, AER errors and PCIe links are not judged, so the node is not ready until they "
                f"are{stale}; see the agent's log", f"not judged: {failed}", reason="HealthNotJudged"))
        view = facts.history
        notes = []
        for text in (getattr(view, "state_error", None), getattr(view, "boot_note", None)):
            if text:
                notes.append(text)
        save_error = getattr(view, "save_error", None)
        if save_error:
            unsaved = tuple(getattr(view, "unsaved", ()) or ())
            kept = (f"{listed(list(unsaved), 3)} could not be saved: kept in this process's memory for the rest of "
                    "the boot (a restart forgets it unless the kernel log still holds it)") if unsaved else \
                "what changed could not be saved"
            notes.append(f"{save_error}: {kept}")
        notes += list(getattr(facts.host, "errors", ()) or ())
        if notes:
            out.append(self.check("gpu.health_state", False, "; ".join(notes), listed(notes, 2), severity=WARNING))
        return out
