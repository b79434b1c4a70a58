"""NVLink and the NVSwitch fabric.

- ``gpu.nvlink`` (fatal): each GPU has at least the expected number of active NVLinks (the GPU
  model's ``expect.nvlink_active_per_gpu`` in ``policies/baselines.yaml``, e.g. 18 on an H100 SXM,
  or the profile's ``readiness.expect.nvlink_active_per_gpu`` for a SKU that ships fewer), and
  peer-to-peer over NVLink works between every pair of GPUs that have NVLinks. Without an
  expectation the count is reported, not judged. Error counters (CRC, replay, recovery) are
  metrics only: links that are up with errors do not fail jobs.
  A GPU with MIG enabled is not judged on its links (NVML reports the NVLinks of a MIG-enabled
  GPU as down: DCGM's health watch carries the same exception), nor one whose link state could
  not be read (``gpu.readings`` names it); a check that judged no GPU says so.
- ``gpu.fabric`` (fatal): on an NVSwitch system, the fabric manager registered each GPU
  (``nvmlDeviceGetGpuFabricInfoV``: state ``completed``, status ``success``) and the fabric is
  healthy: no field of the v2 ``healthMask`` says degraded bandwidth, route recovery in progress,
  an unhealthy route, access-timeout recovery in progress or an incorrect configuration, and the
  v3 ``healthSummary`` is not unhealthy or limited capacity (GPUd judges the same fields). A GPU
  that is not part of a fabric lists nothing.
"""

from __future__ import annotations

from gpu_tune.judge.checks.base import Check, Facts, Family, answering, gpu_label, listed, per_gpu


class NvLinkFamily(Family):
    name = "nvlink"
    category = "fabric"
    source = "NVML"
    reads = ("nvmlDeviceGetNvLinkState per link, nvmlDeviceGetNvLinkErrorCounter (metrics), "
             "nvmlDeviceGetP2PStatus(NVML_P2P_CAPS_INDEX_NVLINK) per pair, nvmlDeviceGetGpuFabricInfoV")
    thresholds = ("active links >= expect.nvlink_active_per_gpu (H100/H200 SXM 18, A100 SXM 12; MIG-enabled GPUs "
                  "not judged); P2P over NVLink OK between every pair; fabric state completed with status success, "
                  "no healthMask fault, healthSummary not unhealthy or limited capacity")
    remedy = ("drain the node; reset the GPUs (nvidia-smi -r) and restart nvidia-fabricmanager; a link that stays "
              "down after a reboot: inspect the baseboard / NVSwitch tray")
    checks = ("gpu.nvlink", "gpu.fabric")

    def evaluate(self, facts: Facts) -> list[Check]:
        gpus = answering(facts.gpus)
        out = []
        nvlink = self._links(facts, gpus)
        if nvlink is not None:
            out.append(nvlink)
        fabric = self._fabric(gpus)
        if fabric is not None:
            out.append(fabric)
        return out

    def _links(self, facts: Facts, gpus) -> Check | None:
        want = facts.expect.nvlink_active_per_gpu
        reporting = [g for g in gpus if g.nvlink is not None]
        if not reporting and not want:
            return None
        if not gpus:
            return self.check("gpu.nvlink", True, "not judged: no GPU answered NVML (gpu.present names them)")
        bad: dict[int, list[str]] = {}
        counts = []
        unjudged: list[str] = []
        mig = []
        for g in gpus:
            if g.mig_mode:
                # NVML reports the links of a MIG-enabled GPU as down (DCGM's health watch treats
                # them as disabled for the same reason): neither links nor P2P are judged
                mig.append(str(g.index))
                continue
            if g.nvlink is None:
                why = dict(g.unread or ()).get("nvlink")
                if why:
                    unjudged.append(f"GPU {g.index} ({why})")
                elif want:
                    bad.setdefault(g.index, []).append(f"reports no NVLink, {want} expected")
                continue
            active = sum(1 for link in g.nvlink if link.active)
            counts.append(active)
            if want and active < want:
                down = [str(link.link) for link in g.nvlink if not link.active]
                bad.setdefault(g.index, []).append(
                    f"{active} of {want} NVLinks active" + (f" (down: {', '.join(down[:18])})" if down else ""))
            if want and g.nvlink_p2p:
                failed = [peer for peer, ok in g.nvlink_p2p if not ok]
                if failed:
                    bad.setdefault(g.index, []).append(f"no P2P over NVLink to {', '.join(failed[:8])}")
        per = per_gpu(gpus, bad)
        notes = ""
        if mig:
            notes += (f"; GPU {', '.join(mig)}: MIG enabled, links not judged (NVML reports the NVLinks of a "
                      "MIG-enabled GPU as down)")
        if unjudged:
            notes += f"; not judged: {listed(unjudged, 3)}"
        if bad:
            by_index = {g.index: g for g in gpus}
            texts = [f"{gpu_label(by_index[i])}: {'; '.join(p)}" for i, p in sorted(bad.items())]
            where = f" ({facts.expect.source})" if facts.expect.source else ""
            return self.check("gpu.nvlink", False, listed(texts) + f"{where}: drain the node, reset the GPUs and "
                              "restart nvidia-fabricmanager; a link down after a reboot: inspect the hardware" + notes,
                              listed([f"GPU {i}: {'; '.join(p)}" for i, p in sorted(bad.items())], 3), gpus=per)
        if not counts:
            return self.check("gpu.nvlink", True, f"not judged: no GPU's NVLinks could be judged{notes}", gpus=per)
        spread = f"{min(counts)}" if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"
        judged = f"{len(counts)} GPU(s): " if len(counts) != len(gpus) else ""
        p2p = [g for g in gpus if g.nvlink_p2p]
        p2p_text = "P2P over NVLink OK" if p2p else "P2P over NVLink not read"
        if want:
            return self.check("gpu.nvlink", True, f"{judged}{spread} NVLinks active per GPU ({want} expected); "
                              f"{p2p_text}{notes}", gpus=per)
        return self.check("gpu.nvlink", True, f"{judged}{spread} NVLinks active per GPU; not judged: no expected count "
                          f"for this GPU model (readiness.expect.nvlink_active_per_gpu){notes}", gpus=per)

    def _fabric(self, gpus) -> Check | None:
        in_fabric = [g for g in gpus if g.fabric is not None]
        if not in_fabric:
            return None
        bad = {}
        for g in in_fabric:
            f = g.fabric
            problems = []
            if f.state != "completed":
                problems.append(f"fabric registration {f.state.replace('_', ' ')}")
            elif f.status != "success":
                problems.append(f"fabric registration failed ({f.status})")
            if f.health:
                problems.append("fabric health: " + ", ".join(h.replace("_", " ").replace(":", ": ") for h in f.health))
            if f.summary in ("unhealthy", "limited_capacity"):
                problems.append(f"fabric health summary {f.summary.replace('_', ' ')}")
            if problems:
                bad[g.index] = f"{gpu_label(g)}: {'; '.join(problems)}"
        per = per_gpu(in_fabric, bad)
        if bad:
            texts = [bad[i] for i in sorted(bad)]
            return self.check("gpu.fabric", False, listed(texts) + ": check nvidia-fabricmanager on the node "
                              "(systemctl status nvidia-fabricmanager, its log); restart it, reset the GPUs; "
                              "degraded bandwidth or an unhealthy route that stays: inspect the NVSwitch trays",
                              listed(texts, 3), gpus=per)
        healthy = sum(1 for g in in_fabric if g.fabric.summary == "healthy")
        extra = f", {healthy} report a healthy fabric" if healthy else ""
        return self.check("gpu.fabric", True, f"{len(in_fabric)} GPU(s) registered with the NVSwitch fabric{extra}",
                          gpus=per)
