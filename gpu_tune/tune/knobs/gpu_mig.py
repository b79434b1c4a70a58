"""``gpu.mig_mode`` per GPU (target = GPU index): MIG (Multi-Instance GPU) mode as NVML reports it.

The profile may require MIG on (``gpu.mig_mode: true``, inference nodes serving many small
models from isolated slices) or off (``false``, whole GPUs for training); unset, nothing is
checked. Read-only, by choice: changing MIG mode needs the GPU idle and then a GPU reset (or a
reboot) before it takes effect, and the slices themselves are laid out by the GPU Operator's MIG
manager (the ``nvidia.com/mig.config`` node label), which gpu-tune never writes. A mismatch is
``drift`` with the remedy. A mode that will change at the next reset (NVML's *pending* mode) is
named in the detail. A GPU without MIG (not an A100/A30/H100/H200/B200-class part):
``unsupported``.
"""

from __future__ import annotations

from gpu_tune.tune.model import Setting
from gpu_tune.tune.knobs.base import Context, Knob, gpus_or_reason, on_off


_word = on_off


def remedy(index: int, want_on: bool) -> str:
    flag, layout = ("1", "e.g. all-1g.10gb") if want_on else ("0", "all-disabled")
    return (f"nvidia-smi -i {index} -mig {flag} with no process on the GPU, then reset it "
            f"(nvidia-smi -r -i {index}) or reboot; with the GPU Operator's MIG manager label the node "
            f"nvidia.com/mig.config={layout}")


class GpuMigKnob(Knob):
    family = "mig"
    error_id = "gpu.mig_mode"
    ids = ("gpu.mig_mode",)
    writable = False
    files = ("NVML: nvmlDeviceGetMigMode (current, pending)",)

    def wanted(self, profile) -> bool:
        return profile.gpu.mig_mode is not None

    def read(self, ctx: Context) -> list[Setting]:
        want = bool(ctx.profile.gpu.mig_mode)
        desired = _word(want) or "off"
        infos, reason = gpus_or_reason(ctx, "gpu.mig_mode", desired)
        if reason:
            return reason
        rows = []
        for info in infos:
            target = str(info.index)
            if info.error:
                rows.append(Setting("gpu.mig_mode", target, None, desired, "error", info.error))
                continue
            current = _word(getattr(info, "mig_mode", None))
            pending = _word(getattr(info, "mig_mode_pending", None))
            if current is None:
                rows.append(Setting("gpu.mig_mode", target, None, desired, "unsupported",
                                    f"{info.name or 'this GPU'} has no MIG"))
                continue
            change = pending is not None and pending != current
            if current == desired:
                note = f"pending {pending} after the next GPU reset" if change else ""
                rows.append(Setting("gpu.mig_mode", target, current, desired, "ok", note))
            elif change and pending == desired:
                rows.append(Setting("gpu.mig_mode", target, current, desired, "drift",
                                    f"set to {pending}, pending: reset the GPU (nvidia-smi -r -i {info.index}) "
                                    "or reboot for it to take effect"))
            else:
                rows.append(Setting("gpu.mig_mode", target, current, desired, "drift", remedy(info.index, want)))
        return rows
