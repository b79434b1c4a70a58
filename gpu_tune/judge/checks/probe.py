"""The MNIST probe's verdicts: ``probe.<gpu>.passed`` per probe target (``probe.cpu.passed`` for
the CPU run), or ``probe.ran`` while no result exists yet or the probe stage itself failed.
``readiness.require_probe: false`` keeps them listed but ok, with the finding in the detail."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from gpu_tune.judge.checks.base import Check, Facts, Family
from gpu_tune.judge.figures import host_bandwidth

HINTS = {"timeout": "the probe ran past its timeout: check the GPU for hangs and load",
         "crashed": "the probe process crashed: see the agent log",
         "skipped": "the probe was skipped"}


class Probe(Family):
    name = "probe"
    category = "probe"
    source = "the MNIST probe (gpu-tune probe), one process per GPU, NUMA-pinned"
    reads = "accuracy after fixed work, throughput per regime against baselines, the result fingerprint"
    thresholds = "policies/baselines.yaml and the profile's probe: section (docs/probe.md)"
    remedy = "see the probe's reasons; docs/probe.md"
    checks = ("probe.<gpu>.passed", "probe.ran")

    def evaluate(self, facts: Facts) -> list[Check]:
        if facts.probes is None and not facts.errors.get("probe"):
            return []  # not judged here (gpu-tune check without --probe)
        required = getattr(facts.readiness, "require_probe", True)
        return self.checks_of(facts.probes or (), required=required, error=facts.errors.get("probe"))

    def checks_of(self, probes: Sequence[Mapping[str, Any]], *, required: bool = True,
                  error: str | None = None) -> list[Check]:
        def gate(c: Check) -> Check:
            if c.ok or required:
                return c
            return Check(c.name, True, f"ignored (readiness.require_probe is false): {c.detail}",
                         severity=c.severity, category=c.category)

        pending = Check("probe.ran", False, "", category="pending")
        if error:
            return [gate(Check(pending.name, False, f"probe run failed: {error}", category="pending"))]
        if not probes:
            return [gate(Check(pending.name, False, "the probe has not completed yet", category="pending"))]
        out = []
        for p in probes:
            gpu = str(p.get("gpu", "?"))
            status = p.get("status", "error")
            reasons = "; ".join(str(r) for r in (p.get("reasons") or []))
            if p.get("passed"):
                res = p.get("result") or {}
                acc, ips = res.get("accuracy"), res.get("train_images_per_second")
                bits = []
                if isinstance(acc, (int, float)):
                    bits.append(f"accuracy {acc:.3f}")
                if isinstance(ips, (int, float)):
                    bits.append(f"{ips:.0f} images/s")
                bw = host_bandwidth(res) if isinstance(res, Mapping) else {}
                if ("local", "h2d") in bw and ("local", "d2h") in bw:
                    bits.append(f"host<->GPU {bw[('local', 'h2d')] / 1e9:.1f}/{bw[('local', 'd2h')] / 1e9:.1f} GB/s")
                detail = "passed" + (f" ({', '.join(bits)})" if bits else "")
                if status == "skipped":  # a busy GPU's previous verdict stands, or a MIG GPU not probed
                    detail = "skipped" + (f": {reasons}" if reasons else "") + (f"; previous run {detail}" if bits else "")
                out.append(self.check(f"probe.{gpu}.passed", True, detail))
            else:
                hint = HINTS.get(status, "")
                figures = f"{status}" + (f": {reasons}" if reasons else "")
                detail = figures + (f" ({hint})" if hint else "")
                out.append(gate(self.check(f"probe.{gpu}.passed", False, detail, figures)))
        return out
