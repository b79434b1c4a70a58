"""Probe baselines (``policies/baselines.yaml``): what a healthy node of each GPU model measures.

Per GPU model (matched by NVML name, else PCI device id) and optionally for CPU runs:

- ``launch_bound`` / ``device_bound``: training images/s of a healthy node in each throughput
  regime (``train_images_per_second``, at ``batch_size``). A probe fails a regime below
  ``probe.throughput_fraction`` of it. The 0.1.0 form (``train_images_per_second`` and
  ``batch_size`` at the top of an entry) is read as the launch-bound regime.
- ``measured: false``: the figures are targets no healthy node has measured yet: reported
  against, never a gate.
- ``fingerprints``: the result fingerprint healthy peers compute, per peer group (the probe's
  ``peer_group``: device model, driver major version, TensorFlow, probe version and data). A probe
  in a pinned peer group with another fingerprint fails.
- ``host_bandwidth.floor_gb_per_second``: the least host->GPU and GPU->host bandwidth (pinned
  copies from the GPU's own NUMA node) a healthy GPU of the model measures; below it in either
  direction the probe fails.
- ``memory_bandwidth.baseline_gb_per_second``: the model's device-to-device copy bandwidth (read +
  write); below ``fraction`` (0.75, DCGM's rule) of it the probe fails.
  A model without these figures is measured and reported, not judged.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gpu_tune.errors import InputError
from gpu_tune.tune.policy import default_policy_dir, read_yaml
from gpu_tune.judge.figures import REGIMES  # one list for the judge, the metrics and the node summary

REGIME_WORDS = {"launch_bound": "launch-bound", "device_bound": "device-bound"}
FINGERPRINT_RE = re.compile(r"^[0-9a-f]{16}$")


def normalize_pci_device(dev: str | int | None) -> str | None:
    """``0x2330`` / ``2330`` / ``10de:2330`` / 0x2330 -> ``0x2330``; None when unusable."""
    if dev is None:
        return None
    if isinstance(dev, int):
        return f"0x{dev:04x}"
    s = str(dev).strip().lower()
    if ":" in s:
        s = s.rsplit(":", 1)[1]
    s = s[2:] if s.startswith("0x") else s
    try:
        return f"0x{int(s, 16):04x}"
    except ValueError:
        return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class RegimeBaseline(_Strict):
    train_images_per_second: float = Field(gt=0)
    batch_size: int | None = Field(None, ge=1)
    # None: as the entry's ``measured``. A regime measured on a healthy node but not yet under
    # load (the launch-bound one depends on the host's CPUs) may stay reported, not judged.
    measured: bool | None = None


class FingerprintPin(_Strict):
    peer_group: str = Field(min_length=1)
    fingerprint: str
    source: str = ""

    @field_validator("fingerprint")
    @classmethod
    def _hex(cls, v: str) -> str:
        v = str(v).strip().lower()
        if not FINGERPRINT_RE.fullmatch(v):
            raise ValueError(f"{v!r} is not a probe fingerprint (16 hex digits, as `gpu-tune probe -o json` prints)")
        return v


class HealthExpect(_Strict):
    """What a healthy node with this GPU model has (docs/health.md); a profile's
    ``readiness.expect`` overrides it."""

    gpus: int | None = Field(None, ge=0, le=1024)  # GPUs per node (an HGX board: 8)
    nvlink_active_per_gpu: int | None = Field(None, ge=0, le=64)
    # nvswitch: only where the GPUs are part of an NVSwitch fabric (an HGX/DGX baseboard), so a
    # cloud VM with one GPU of the model, or a PCIe server, is not judged by the baseboard's figures;
    # any: wherever the model is found
    applies_to: Literal["nvswitch", "any"] = "nvswitch"
    # the node's compute InfiniBand ports: at least ib_ports_at_rate of them at ib_rate_gbps
    # (GPUd's "at least N ports at R Gb/s"); judged where a profile sets no ib_rate_gbps
    ib_rate_gbps: float | None = Field(None, gt=0, le=100_000)
    ib_ports_at_rate: int | None = Field(None, ge=1, le=256)
    source: str = ""


class HostBandwidth(_Strict):
    """Host<->GPU floor, GB/s (1e9 bytes/s), both directions."""

    floor_gb_per_second: float = Field(gt=0)
    source: str = ""


class MemoryBandwidth(_Strict):
    """The GPU's memory bandwidth baseline, GB/s, and the share of it a healthy GPU reaches."""

    baseline_gb_per_second: float = Field(gt=0)
    fraction: float = Field(0.75, gt=0, le=1)  # DCGM's memory-bandwidth rule: 0.75 x the SKU's figure
    source: str = ""

    @property
    def floor_gb_per_second(self) -> float:
        return self.fraction * self.baseline_gb_per_second


class Baseline(_Strict):
    names: list[str] = Field(default_factory=list)
    expect: HealthExpect | None = None
    pci_device_ids: list[str] = Field(default_factory=list)
    launch_bound: RegimeBaseline | None = None
    device_bound: RegimeBaseline | None = None
    source: str = ""
    # False for a target that no healthy node has measured yet: reported against, never failed
    # on (an unmeasured number must not take a fleet's nodes out of service).
    measured: bool = True
    fingerprints: list[FingerprintPin] = Field(default_factory=list)
    host_bandwidth: HostBandwidth | None = None
    memory_bandwidth: MemoryBandwidth | None = None

    @model_validator(mode="before")
    @classmethod
    def _legacy(cls, data: Any) -> Any:
        # 0.1.0 entries: one training figure at the top, the launch-bound regime's.
        if isinstance(data, dict) and ("train_images_per_second" in data or "batch_size" in data):
            data = dict(data)
            if "launch_bound" in data:
                raise ValueError("give either launch_bound: or the older train_images_per_second:, not both")
            legacy = {"train_images_per_second": data.pop("train_images_per_second", None),
                      "batch_size": data.pop("batch_size", None)}
            data["launch_bound"] = {k: v for k, v in legacy.items() if v is not None}
        return data

    @field_validator("pci_device_ids")
    @classmethod
    def _ids(cls, v: list[str]) -> list[str]:
        out = []
        for d in v:
            n = normalize_pci_device(d)
            if n is None:
                raise ValueError(f"{d!r} is not a PCI device id (expected e.g. '0x2330')")
            out.append(n)
        return out

    def regime(self, name: str) -> RegimeBaseline | None:
        return getattr(self, name, None)

    def pinned(self, peer_group: str | None) -> FingerprintPin | None:
        if not peer_group:
            return None
        return next((p for p in self.fingerprints if p.peer_group == peer_group), None)


class Baselines(_Strict):
    """Healthy-node figures per GPU model (and optionally for CPU runs)."""

    gpus: list[Baseline] = Field(default_factory=list)
    cpu: Baseline | None = None
    path: str = ""

    def for_gpu(self, name: str | None, pci_device_id: str | None) -> Baseline | None:
        want = (name or "").strip().lower()
        dev = normalize_pci_device(pci_device_id)
        if want:
            for b in self.gpus:
                if any(want == n.strip().lower() for n in b.names):
                    return b
        if dev:
            for b in self.gpus:
                if dev in b.pci_device_ids:
                    return b
        return None


def load_baselines(policy_dir: str | os.PathLike[str] | None = None) -> Baselines:
    """Read ``<policy_dir>/baselines.yaml``; a missing file means no baselines (all unknown)."""
    pdir = Path(policy_dir) if policy_dir else default_policy_dir()
    path = pdir / "baselines.yaml"
    if not path.exists():
        return Baselines(path=str(path))
    data = read_yaml(path, "baselines file")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a mapping with 'gpus:' (and optionally 'cpu:')")
    data.pop("version", None)
    try:
        return Baselines.model_validate({**data, "path": str(path)})
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        raise InputError(f"{path}: {loc}: {msg}") from None
