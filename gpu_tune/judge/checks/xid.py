"""XIDs and SXids from the kernel log since boot, judged by NVIDIA's XID catalog.

- ``gpu.xid`` (fatal): a GPU logged an XID whose catalog action is reset the GPU, reboot or
  inspect the hardware, in this boot, and nobody cleared it after a GPU reset. Read from the
  kernel log (all of it since boot at the first pass, then what is new) and from NVML's events;
  remembered in the agent's state folder, so an XID logged before the agent started, or while
  it restarted, is judged as well. The same fatal XID in a third boot says "inspect the hardware".
- ``nvswitch.sxid`` (fatal): an NVSwitch logged a fatal SXid in this boot.
- ``gpu.kernel_log`` (warning): the kernel log cannot be read, or one read did not reach its end
  within its time bound (listed only then): XIDs logged while the agent does not run are not seen.
- ``gpu.xid_unknown`` (warning): a GPU logged an XID the catalog does not know (or marks unused on
  every generation it covers), named, never gating (listed only then); an XID the profile has a
  rule for is the profile's, never unknown.
- ``gpu.xid_recurring`` (warning): a repeat rule of the profile whose action is ``restart_app``
  applies: the GPU keeps failing jobs (listed only then).

What each XID weighs is the operator's policy over the catalog
(:mod:`~gpu_tune.judge.checks.xid_policy`): a weight that is not the catalog's says whose it is.

Only the kernel's own records count (gpu_tune.discover.xids): what was ignored, skipped or not
kept is said in ``gpu.xid``'s detail, so that a forgery or a flood is visible.
"""

from __future__ import annotations

from gpu_tune.discover.xids import MAX_FATAL_BUSES, MAX_FATAL_PER_BUS, MAX_SIGHTINGS, KernelLogStatus, XidSighting
from gpu_tune.judge.checks.base import WARNING, Check, Facts, Family, listed
from gpu_tune.judge.checks.catalog import ACTION_WORDS, catalog
from gpu_tune.judge.checks.state import ESCALATE_BOOTS, XidRecord
from gpu_tune.judge.checks.xid_policy import CATALOG

CLEAR_HINT = ("after the GPU is reset, `gpu-tune set-healthy --gpu {gpu}` on the node (or the Node label "
              "gpu-tune.io/set-healthy=<any new value>) clears it; a reboot clears it too")


def _when(r: XidRecord | XidSighting) -> str:
    if r.first_usec is not None:
        return f"first {r.first_usec / 1e6:.1f} s after boot"
    return f"from {getattr(r, 'source', 'the kernel log')}"


def _n(n: int, one: str, many: str) -> str:
    return f"{n:,} {one if n == 1 else many}"


def log_words(log: KernelLogStatus | None) -> str:
    """What reading the kernel log ignored, skipped or did not keep, in words ("" when nothing)."""
    if log is None:
        return ""
    parts = []
    if log.foreign:
        parts.append(_n(log.foreign, "record", "records") + " naming an XID not written by the kernel ignored "
                     "(facility not 0: written from user space)")
    if log.embedded:
        parts.append(_n(log.embedded, "XID text", "XID texts") + " inside other records ignored (not the driver's "
                     "record form)")
    if log.malformed:
        parts.append(_n(log.malformed, "malformed XID record", "malformed XID records"))
    if log.dropped_fatal:
        parts.append(_n(log.dropped_fatal, "fatal sighting", "fatal sightings") + f" not kept (beyond "
                     f"{MAX_FATAL_PER_BUS} codes per address or {MAX_FATAL_BUSES} addresses)")
    if log.dropped:
        parts.append(_n(log.dropped, "non-fatal sighting", "non-fatal sightings") + f" not kept (beyond "
                     f"{MAX_SIGHTINGS:,})")
    if log.skipped or log.skipped_bytes:
        older = [x for x in (_n(log.skipped, "line", "lines") if log.skipped else "",
                             f"{log.skipped_bytes:,} bytes" if log.skipped_bytes else "") if x]
        parts.append(" and ".join(older) + " older than the newest read were not read")
    if log.lost:
        parts.append(_n(log.lost, "record", "records") + " overwritten before they were read")
    return "; ".join(parts)


class Xid(Family):
    name = "xid"
    category = "recovery"
    source = "kernel log (/dev/kmsg, or syslog(2)), NVML XID events; state in /var/lib/gpu-tune/health.json"
    reads = ("NVRM: Xid (PCI:BDF): N lines and nvidia-nvswitch SXid lines since boot, attributed by PCI "
             "address; the boot id")
    thresholds = ("an XID whose catalog action (xid_catalog.yaml) is reset_gpu, reboot or inspect_hw; a fatal "
                  f"SXid; the same fatal XID in {ESCALATE_BOOTS} boots: inspect_hw")
    remedy = "drain the node; reset the GPU or reboot as the catalog says; then `gpu-tune set-healthy`"
    checks = ("gpu.xid", "nvswitch.sxid", "gpu.kernel_log", "gpu.xid_unknown", "gpu.xid_recurring")

    def evaluate(self, facts: Facts) -> list[Check]:
        view = facts.history
        host = facts.host
        records = list(view.records) if view is not None else _from_events(facts)
        out: list[Check] = []
        log = getattr(host, "kernel_log", None)
        if log is not None and log.error:
            out.append(self.check("gpu.kernel_log", False, f"{log.error}: XIDs logged while the agent does not run "
                                  "are not seen (docs/security.md: the audit pod needs CAP_SYSLOG)",
                                  log.error, severity=WARNING))
        elif log is not None and log.incomplete:
            why = "; ".join(log.notes) or "the read stopped before the log's end"
            out.append(self.check("gpu.kernel_log", False, f"{log.source}: not read to its end ({why}): the newest "
                                  "records are judged at the next pass", "kernel log not read to its end",
                                  severity=WARNING))
        xids = [r for r in records if r.kind == "xid"]
        if host is not None or xids or facts.gpus:
            out.append(self._gpu_xids(facts, xids, log))
        noted = list(getattr(host, "noted", ()) or ())
        if noted:
            out.append(self._unknown(facts, noted))
        recurring = tuple(getattr(view, "recurring", ()) or ())
        if recurring:
            out.append(self._recurring(facts, recurring))
        sxids = [r for r in records if r.kind == "sxid"]
        if sxids:
            cat = catalog()
            texts = [f"{r.bus}: SXid {r.code} {(cat.sxid(r.code).name if cat.sxid(r.code) else r.message)[:80]} "
                     f"(x{r.count}, {_when(r)})" for r in sxids]
            out.append(Check("nvswitch.sxid", False, listed(texts) + ": drain the node and reset the NVSwitch fabric "
                             "(reboot); inspect the switch if it recurs", "fatal SXid " + listed(texts, 2),
                             category="fabric"))
        return out

    def _gpu_xids(self, facts: Facts, xids: list[XidRecord], log) -> Check:
        cat = catalog()
        by_bus = {g.pci_bus_id.lower().rsplit(".", 1)[0]: g for g in facts.gpus if g.pci_bus_id}
        bad: dict[int, list[str]] = {}
        texts, short = [], []
        for r in sorted(xids, key=lambda r: (r.bus, r.code)):
            g = by_bus.get(r.bus.rsplit(".", 1)[0])
            who = f"GPU {g.index} ({g.pci_bus_id})" if g else f"PCI {r.bus} (no GPU there now)"
            entry = cat.xid(r.code)
            name = entry.name if entry else (f"(not in the catalog {cat.version})" if r.source == "repeat rule"
                                             else r.message[:80])
            action = "inspect_hw" if r.escalated else r.action
            again = f", seen in {r.boots} boots" if r.boots > 1 else ""
            seen = r.message if r.source == "repeat rule" else f"x{r.count}"
            by = f" (by {r.by})" if r.by else ""
            texts.append(f"{who}: XID {r.code} {name} ({seen}, {_when(r)}{again}): {ACTION_WORDS[action]}{by}; "
                         + CLEAR_HINT.format(gpu=g.index if g else "all"))
            short.append(f"{'GPU ' + str(g.index) if g else r.bus}: XID {r.code}"
                         + (f" [readiness.xid.{r.code}]" if r.by else "") + f" ({name})")
            if g is not None:
                bad.setdefault(g.index, []).append(str(r.code))
        per = tuple((str(g.index), g.index not in bad) for g in facts.gpus)
        words = log_words(log)
        rules = _policy_words(facts)
        if texts:
            return self.check("gpu.xid", False, listed(texts) + (f" (kernel log: {words})" if words else "") + rules,
                              "fatal " + listed(short, 3), gpus=per)
        where = f"kernel log: {log.source}" if log is not None and not log.error and log.source else (
            "the kernel log is not readable: NVML events only" if log is not None else "NVML events")
        cleared = f"; cleared: {view_cleared(facts)}" if view_cleared(facts) else ""
        return self.check("gpu.xid", True, f"no fatal XID in this boot ({where}; catalog {cat.version}"
                          f"{'; ' + words if words else ''}){cleared}{rules}", gpus=per)

    def _recurring(self, facts: Facts, recurring: tuple) -> Check:
        """Repeat rules whose action is restart_app and holds: the GPU keeps failing jobs."""
        cat = catalog()
        by_bus = {g.pci_bus_id.lower().rsplit(".", 1)[0]: g for g in facts.gpus if g.pci_bus_id}
        texts, short, bad = [], [], set()
        for r in sorted(recurring, key=lambda r: (r.firing.bus, r.firing.code)):
            f = r.firing
            g = by_bus.get(f.bus)
            who = f"GPU {g.index} ({g.pci_bus_id})" if g else f"PCI {f.bus} (no GPU there now)"
            entry = cat.xid(f.code)
            earlier = f", {f.earlier_boots} of them in earlier boots" if f.earlier_boots else ""
            texts.append(f"{who}: XID {f.code} {entry.name if entry else '(not in the catalog)'}: {f.bursts} bursts "
                         f"(the last {f.last_usec / 1e6:.1f} s after boot{earlier}): {r.rule}"
                         + (f" (by {r.by})" if r.by else ""))
            short.append(f"{'GPU ' + str(g.index) if g else f.bus}: XID {f.code} x{f.bursts}"
                         + (f" [readiness.xid.{f.code}]" if r.by else ""))
            if g is not None:
                bad.add(g.index)
        return self.check("gpu.xid_recurring", False, listed(texts) + ": the GPU keeps failing jobs: watch it; drain "
                          "it and reset the GPU if it goes on", "recurring " + listed(short, 3), severity=WARNING,
                          gpus=tuple((str(g.index), g.index not in bad) for g in facts.gpus))

    def _unknown(self, facts: Facts, noted: list[XidSighting]) -> Check:
        """XIDs (and SXids) the catalog does not know or marks unused: named, never gating."""
        cat = catalog()
        by_bus = {g.pci_bus_id.lower().rsplit(".", 1)[0]: g for g in facts.gpus if g.pci_bus_id}
        texts, short = [], []
        for s in sorted(noted, key=lambda s: (s.kind, s.bus, s.code)):
            g = by_bus.get(s.bus.rsplit(".", 1)[0]) if s.kind == "xid" else None
            who = f"GPU {g.index} ({g.pci_bus_id})" if g else f"PCI {s.bus}"
            word = "XID" if s.kind == "xid" else "SXid"
            entry = cat.xid(s.code) if s.kind == "xid" else cat.sxid(s.code)
            why = (f"marked unused on every GPU generation the catalog covers ({entry.name})" if entry is not None
                   else f"not in the catalog ({cat.version})")
            texts.append(f"{who}: {word} {s.code} {why} (x{s.count}, {_when(s)}): {s.message[:80]!r}")
            short.append(f"{'GPU ' + str(g.index) if g else s.bus}: {word} {s.code}")
        return self.check("gpu.xid_unknown", False, listed(texts) + ": not judged, never gating; look the code up in "
                          f"NVIDIA's XID catalog ({cat.source}) and the driver's release notes",
                          "unknown " + listed(short, 3), severity=WARNING)


def _policy_words(facts: Facts) -> str:
    """The profile's XID rules, said whenever it has some (a rule for an XID the catalog does not
    know, a newer driver's, says so)."""
    words = getattr(facts.policy, "xid", CATALOG).words()
    return f"; {words}" if words else ""


def _from_events(facts: Facts) -> list[XidRecord]:
    """Without remembered state (a caller that keeps none): the fatal XIDs among the GPU backend's
    own events, judged as they are."""
    cat = catalog()
    policy = getattr(facts.policy, "xid", CATALOG)
    out = []
    for g in facts.gpus:
        counts: dict[int, int] = {}
        for code in g.xid_events:
            counts[int(code)] = counts.get(int(code), 0) + 1
        for code, n in sorted(counts.items()):
            entry = cat.xid(code)
            if policy.fatal_for("xid", code) and g.pci_bus_id:
                out.append(XidRecord("xid", g.pci_bus_id.lower().rsplit(".", 1)[0], code, n, 0.0, None, None,
                                     entry.name if entry else f"XID {code}", 1, "NVML events",
                                     policy.action(code) or "reset_gpu", policy.source(code)))
    return out


def view_cleared(facts: Facts) -> str:
    words = getattr(facts.history, "cleared", ()) or ()
    return words[-1] if words else ""
