"""What NVML itself says must happen to a GPU before it is used again.

- ``gpu.recovery`` (fatal): NVML's recovery action (field 230, ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``)
  is not ``none`` (reset the GPU, reboot the node, drain peer-to-peer traffic, drain and reset), or
  an NVML call answered ``NVMLError_ResetRequired``. Passes again by itself once NVML says
  ``none`` (after the reset or reboot).
- ``gpu.inforom`` (warning): ``nvmlDeviceValidateInforom`` says the InfoROM is corrupted (the
  GPU's configuration and error records can no longer be trusted; update or RMA).
"""

from __future__ import annotations

from gpu_tune.judge.checks.base import WARNING, Check, Facts, Family, gpu_label, listed, per_gpu

ACTION_TEXT = {
    "reset": "reset the GPU (nvidia-smi -r, or the GPU Operator's reset)",
    "reboot": "reboot the node",
    "drain_p2p": "stop peer-to-peer (NVLink) work on it, then reset the GPU",
    "drain_and_reset": "drain the node's work from it, then reset the GPU",
    "recover_imex_domain": "recover the IMEX domain, then reset the GPU",
}


class Recovery(Family):
    name = "recovery"
    category = "recovery"
    source = "NVML"
    reads = ("nvmlDeviceGetFieldValues(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230); NVMLError_ResetRequired "
             "from any call; nvmlDeviceValidateInforom")
    thresholds = "recovery action none; no ResetRequired; InfoROM valid (warning)"
    remedy = "drain the node and do what NVML asks: reset the GPU or reboot"
    checks = ("gpu.recovery", "gpu.inforom")

    def evaluate(self, facts: Facts) -> list[Check]:
        gpus = list(facts.gpus)
        if not gpus:
            return []
        out = []
        bad: dict[int, str] = {}
        reported = False
        for g in gpus:
            if g.reset_required or g.error_kind == "reset_required":
                bad[g.index] = f"{gpu_label(g)}: NVML answers \"GPU requires reset\": drain the node and reset the GPU"
                reported = True
            elif g.recovery_action is not None:
                reported = True
                if g.recovery_action != "none":
                    what = ACTION_TEXT.get(g.recovery_action, f"act on {g.recovery_action}")
                    bad[g.index] = f"{gpu_label(g)}: NVML recovery action {g.recovery_action}: drain the node and {what}"
            elif g.reset_required is False:
                reported = True
        if reported or bad:
            if bad:
                texts = [bad[i] for i in sorted(bad)]
                out.append(self.check("gpu.recovery", False, listed(texts),
                                      listed([t.split(": drain")[0] for t in texts], 3), gpus=per_gpu(gpus, bad)))
            elif any(g.recovery_action is not None for g in gpus):
                out.append(self.check("gpu.recovery", True, "NVML asks no recovery action of any GPU",
                                      gpus=per_gpu(gpus, bad)))
            else:
                out.append(self.check("gpu.recovery", True, "no GPU requires a reset (NVML reports no recovery "
                                      "action here)", gpus=per_gpu(gpus, bad)))
        corrupted = {g.index: f"{gpu_label(g)}: InfoROM corrupted" for g in gpus if g.inforom_valid is False}
        if any(g.inforom_valid is not None for g in gpus):
            if corrupted:
                texts = [corrupted[i] for i in sorted(corrupted)]
                out.append(self.check("gpu.inforom", False, listed(texts) + ": the GPU's stored configuration and "
                                      "error records cannot be trusted: update the InfoROM or have the GPU replaced",
                                      listed(texts, 3), severity=WARNING, gpus=per_gpu(gpus, corrupted)))
            else:
                out.append(self.check("gpu.inforom", True, "InfoROM valid on every GPU that reports it",
                                      severity=WARNING, gpus=per_gpu(gpus, corrupted)))
        return out
