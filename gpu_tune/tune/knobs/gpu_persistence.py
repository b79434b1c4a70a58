"""``gpu.persistence_mode`` per GPU (target = GPU index) through the GPU backend (NVML).

Without a GPU/driver: one ``unsupported`` row (target ``-``). A lost GPU: an ``error`` row.
On recent drivers ``nvidia-persistenced`` is the preferred owner of persistence mode: with
``gpu.persistenced: prefer`` and the daemon running (``/proc/[pid]/comm`` is ``nvidia-persiste``,
the kernel cuts comm to 15 characters) the knob only reports: ``ok`` when the mode is what the
profile wants, else ``conflict`` with a hint, and it never writes. Otherwise the mode is set
through NVML; the original is journalled and restored like every other knob.
"""

from __future__ import annotations

from typing import Any

from gpu_tune.errors import HostError
from gpu_tune.tune.model import Setting
from gpu_tune.tune.knobs.base import Context, Knob, gpus_or_reason, on_off
from gpu_tune.tune.knobs.irq_affinity import running_comms

PERSISTENCED_COMMS = frozenset({"nvidia-persiste", "nvidia-persistenced"})


_word = on_off


class GpuPersistenceKnob(Knob):
    family = "gpu"
    error_id = "gpu.persistence_mode"
    ids = ("gpu.persistence_mode",)
    files = ("NVML: nvmlDeviceGetPersistenceMode / nvmlDeviceSetPersistenceMode", "/proc/[pid]/comm")
    writes = ()  # through NVML, never a file

    def entry_problem(self, entry: dict[str, Any]) -> str:
        """A persistence-mode entry names its GPU (``index``, ``uuid``) and no file at all."""
        for key in ("path", "files", "created_dirs"):
            if entry.get(key):
                return f"{key}: {entry[key]!r}: family 'gpu' sets persistence mode through NVML and writes no file"[:300]
        if "index" not in entry:
            return "index: family 'gpu' records the GPU it changed; none is given"
        if entry.get("value") not in ("on", "off"):
            return f"value: expected 'on' or 'off', got {entry.get('value')!r}"[:160]
        return ""

    def wanted(self, profile) -> bool:
        return profile.gpu.persistence_mode is not None

    def read(self, ctx: Context) -> list[Setting]:
        desired = _word(ctx.profile.gpu.persistence_mode) or "on"
        # fresh: a verify after apply must see the new mode
        infos, reason = gpus_or_reason(ctx, "gpu.persistence_mode", desired, fresh=True)
        if reason:
            return reason
        daemon = (ctx.profile.gpu.persistenced == "prefer"
                  and bool(PERSISTENCED_COMMS & running_comms(ctx)))
        rows = []
        for info in infos:
            target = str(info.index)
            if info.error:
                rows.append(Setting("gpu.persistence_mode", target, None, desired, "error", info.error))
                continue
            current = _word(info.persistence_mode)
            if current is None:
                rows.append(Setting("gpu.persistence_mode", target, None, desired, "unsupported",
                                    "the driver does not report persistence mode for this GPU"))
                continue
            handle = {"index": info.index, "uuid": info.uuid}
            if daemon:
                if current == desired:
                    rows.append(Setting("gpu.persistence_mode", target, current, desired, "ok",
                                        "managed by nvidia-persistenced", None, handle))
                else:
                    hint = ("nvidia-persistenced is running and owns persistence mode: restart it with "
                            "--persistence-mode" if desired == "on" else
                            "nvidia-persistenced is running and keeps persistence mode on: stop it")
                    rows.append(Setting("gpu.persistence_mode", target, current, desired, "conflict",
                                        hint + " (or set gpu.persistenced: ignore)", None, handle))
                continue
            status = "ok" if current == desired else "drift"
            rows.append(Setting("gpu.persistence_mode", target, current, desired, status, "", None, handle))
        return rows

    def snapshot(self, ctx: Context, row: Setting) -> dict[str, Any]:
        if row.current not in ("on", "off"):
            raise HostError(f"gpu.persistence_mode[{row.target}]: original mode unknown, nothing to record")
        handle = row.handle or {}
        return {"index": int(row.target), "uuid": handle.get("uuid"), "value": row.current}

    def apply(self, ctx: Context, row: Setting) -> None:
        if ctx.gpu is None:
            raise HostError(f"gpu.persistence_mode[{row.target}]: no GPU backend")
        ctx.gpu.set_persistence_mode(int(row.target), row.desired == "on")

    def current_value(self, ctx: Context, entry: dict[str, Any]) -> str | None:
        if ctx.gpu is None:
            return None
        for g in ctx.gpu_infos():
            if (entry.get("uuid") and g.uuid == entry.get("uuid")) or (not entry.get("uuid") and g.index == entry.get("index")):
                return _word(g.persistence_mode)
        return None

    def restore(self, ctx: Context, entry: dict[str, Any]) -> None:
        if ctx.gpu is None:
            raise HostError(f"gpu.persistence_mode[{entry.get('index')}]: no GPU backend")
        index = int(entry["index"])
        uuid = entry.get("uuid")
        if uuid:  # indices may change across reboots; the UUID does not
            for info in ctx.gpu.gpus():
                if info.uuid == uuid:
                    index = info.index
                    break
        ctx.gpu.set_persistence_mode(index, entry["value"] == "on")
