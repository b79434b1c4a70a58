"""What NVML itself says must happen to a GPU before it is used again.

- ``gpu.recovery`` (fatal): NVML's recovery action (field 230, ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``,
  ``nvmlDeviceGpuRecoveryAction_t``) asks for a GPU reset (1), a node reboot (2), drain and reset
  (4), an IMEX domain recovery (5), a reset of the GPU's PCIe bus (6) or a system reboot (7), or an
  NVML call answered ``NVMLError_ResetRequired``. Passes again by itself once NVML says ``none``
  (after the reset or reboot).
- ``gpu.recovery_p2p`` (warning): the recovery action is ``DRAIN_P2P`` (3). NVIDIA's documentation:
  terminate the processes that conduct peer-to-peer traffic and disable UVM persistence mode, then
  query the field again, which then answers one of the other actions; DCGM's health watch reports
  it as a warning, not a failure. The agent reads the field again every pass, and gates on what it
  says next.
- ``gpu.inforom`` (warning): ``nvmlDeviceValidateInforom`` says the InfoROM is corrupted (the
  GPU's configuration and error records can no longer be trusted; update or RMA).
"""

from __future__ import annotations

from gpu_tune.judge.checks.base import WARNING, Check, Facts, Family, gpu_label, listed, per_gpu

# nvmlDeviceGpuRecoveryAction_t, in NVIDIA's words (docs/health.md has the sources)
ACTION_TEXT = {
    "reset": "terminate its processes and reset the GPU (nvidia-smi -r -i N, or the GPU Operator's reset)",
    "reboot": "reboot the node (the fault may have left the operating system inconsistent)",
    "drain_and_reset": "schedule no new work on it, then reset the GPU once its work has drained",
    "recover_imex_domain": "recover the node's IMEX domain (nvidia-imex), then read the recovery action again",
    "bus_reset": "reset the GPU's PCIe bus (a secondary bus reset of its slot, which nvidia-smi -r does not do; "
                 "reboot the node where the platform cannot)",
    "system_reboot": "reboot the system",
}
DRAIN_P2P_TEXT = ("terminate the processes that conduct peer-to-peer traffic on it and disable UVM persistence mode, "
                  "then NVML's recovery action is read again (every pass of the agent) and gates on what it says next")


class Recovery(Family):
    name = "recovery"
    category = "recovery"
    source = "NVML"
    reads = ("nvmlDeviceGetFieldValues(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230); NVMLError_ResetRequired "
             "from any call; nvmlDeviceValidateInforom")
    thresholds = ("recovery action none (drain_p2p: warning); no ResetRequired; InfoROM valid (warning)")
    remedy = "drain the node and do what NVML asks: reset the GPU or reboot"
    checks = ("gpu.recovery", "gpu.recovery_p2p", "gpu.inforom")

    def evaluate(self, facts: Facts) -> list[Check]:
        gpus = list(facts.gpus)
        if not gpus:
            return []
        out = []
        bad: dict[int, str] = {}
        p2p: dict[int, str] = {}
        reported = False
        for g in gpus:
            if g.reset_required or g.error_kind == "reset_required":
                bad[g.index] = f"{gpu_label(g)}: NVML answers \"GPU requires reset\": drain the node and reset the GPU"
                reported = True
            elif g.recovery_action is not None:
                reported = True
                if g.recovery_action == "drain_p2p":
                    p2p[g.index] = f"{gpu_label(g)}: NVML recovery action drain_p2p"
                elif g.recovery_action != "none":
                    what = ACTION_TEXT.get(g.recovery_action, f"act on {g.recovery_action}")
                    bad[g.index] = f"{gpu_label(g)}: NVML recovery action {g.recovery_action}: drain the node and {what}"
            elif g.reset_required is False:
                reported = True
        if reported or bad:
            if bad:
                texts = [bad[i] for i in sorted(bad)]
                out.append(self.check("gpu.recovery", False, listed(texts),
                                      listed([t.split(": drain")[0] for t in texts], 3), gpus=per_gpu(gpus, bad)))
            elif p2p:
                out.append(self.check("gpu.recovery", True, f"NVML asks no reset or reboot of any GPU (drain_p2p on "
                                      f"{len(p2p)}: gpu.recovery_p2p)", gpus=per_gpu(gpus, bad)))
            elif any(g.recovery_action is not None for g in gpus):
                out.append(self.check("gpu.recovery", True, "NVML asks no recovery action of any GPU",
                                      gpus=per_gpu(gpus, bad)))
            else:
                out.append(self.check("gpu.recovery", True, "no GPU requires a reset (NVML reports no recovery "
                                      "action here)", gpus=per_gpu(gpus, bad)))
        if p2p:
            texts = [p2p[i] for i in sorted(p2p)]
            out.append(self.check("gpu.recovery_p2p", False, listed(texts) + f": {DRAIN_P2P_TEXT}", listed(texts, 3),
                                  severity=WARNING, gpus=per_gpu(gpus, p2p)))
        unread = [g.index for g in gpus if "recovery_action" in dict(g.unread or ())]
        if unread and out and out[0].name == "gpu.recovery" and out[0].ok:
            out[0] = self.check("gpu.recovery", True, out[0].detail + f"; not read on GPU {', '.join(map(str, unread))} "
                                "(see gpu.readings)", gpus=out[0].gpus)
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
