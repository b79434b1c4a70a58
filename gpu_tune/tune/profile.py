"""A profile as data: every setting family's wanted values, validated where they enter.

Pydantic models, strict (an unknown key is an error naming it); bounds (``{min: N}``,
``{max: N}``) for limits that must never be lowered. Loaded from YAML by
:func:`gpu_tune.tune.policy.load_profile`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpu_tune.host.parse import ParseError, parse_cpulist
from gpu_tune.tune.taint import TaintSpec, parse_profile_taint
from gpu_tune.tune.paths import ALLOCATOR_WRITES, ENV_DIR, LD_SO_PRELOAD, clean_path, path_matches

NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
# Patterns are matched whole (``fullmatch``): ``$`` would let a trailing newline through.
SYSCTL_KEY_RE = re.compile(r"[a-z0-9_]+(\.[A-Za-z0-9_-]+)+")
# sysctl values the kernel reads as integers fit in 64 bits (signed or unsigned).
SYSCTL_INT_MIN, SYSCTL_INT_MAX = -(2**63), 2**64 - 1

# Known sysctl ranges (inclusive). A key not listed is still accepted if it is well formed.
SYSCTL_RANGES: dict[str, tuple[int, int]] = {
    "vm.swappiness": (0, 200),
    "vm.zone_reclaim_mode": (0, 7),
    "vm.dirty_ratio": (0, 100),
    "vm.dirty_background_ratio": (0, 100),
    "vm.dirty_expire_centisecs": (0, 2**31 - 1),
    "vm.dirty_writeback_centisecs": (0, 2**31 - 1),
    "vm.overcommit_memory": (0, 2),
    "vm.max_map_count": (65530, 2**31 - 1),
    "vm.min_free_kbytes": (0, 2**31 - 1),
    "vm.stat_interval": (1, 3600),
    "kernel.numa_balancing": (0, 3),
    "kernel.sched_autogroup_enabled": (0, 1),
    "kernel.nmi_watchdog": (0, 1),
    "kernel.watchdog": (0, 1),
}

# A number the kernel's sysctl parser (base 0) would read as octal: ``017`` is 15.
_LEADING_ZERO_WORD = re.compile(r"[-+]?0[0-9]+")

# RLIM_INFINITY as the kernel keeps it: the value of "unlimited" in a limit bound.
UNLIMITED = 2**64 - 1
_SIZE_RE = re.compile(r"([0-9]+)\s*([kmgt]?)(i?b)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
BOUND_KEYS = ("min", "max")
_BOUND_HINT = "a bound is {min: N} (at least), {max: N} (at most) or both"

GOVERNORS = ("performance", "schedutil", "ondemand", "conservative", "powersave", "userspace")
THP_ENABLED = ("always", "madvise", "never")
THP_DEFRAG = ("always", "defer", "defer+madvise", "madvise", "never")
MALLOC_CONF_RE = re.compile(r"[a-z_]+:[A-Za-z0-9_.+-]+(,[a-z_]+:[A-Za-z0-9_.+-]+)*")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def format_limit(value: int) -> str:
    return "unlimited" if value >= UNLIMITED else str(value)


class Bound(_Strict):
    """A numeric setting that is a floor and/or a ceiling, not an exact value.

    Written ``{min: N}`` (at least N), ``{max: N}`` (at most N) or both. A current value that
    satisfies it is ``ok`` and is never moved; one outside it is set to the nearest end.
    """

    min: int | None = None
    max: int | None = None

    def describe(self) -> str:
        """``≥ 1048576``, ``≤ 200``, ``≥ 10, ≤ 200``."""
        parts = []
        if self.min is not None:
            parts.append(f"≥ {format_limit(self.min)}")
        if self.max is not None:
            parts.append(f"≤ {format_limit(self.max)}")
        return ", ".join(parts)

    def judge(self, value: int) -> tuple[bool, str, int | None]:
        """(satisfied, the comparison in words, the value to set when not satisfied)."""
        v = format_limit(value)
        if self.min is not None and value < self.min:
            return False, f"{v} < {format_limit(self.min)}", self.min
        if self.max is not None and value > self.max:
            return False, f"{v} > {format_limit(self.max)}", self.max
        held = []
        if self.min is not None:
            held.append(f"{v} ≥ {format_limit(self.min)}")
        if self.max is not None:
            held.append(f"{v} ≤ {format_limit(self.max)}")
        return True, " and ".join(held), None


def parse_size(text: Any) -> int:
    """``unlimited``, ``65536``, ``64K``, ``8MiB``, ``1g`` -> bytes (powers of 1024)."""
    if isinstance(text, bool):
        raise ValueError(f"expected a size, got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"expected a size, got {text!r}")
        if text > UNLIMITED:
            raise ValueError(f"{text} bytes is more than a limit can hold (2**64-1); write unlimited")
        return text
    t = str(text).strip()
    if t.lower() in ("unlimited", "infinity"):
        return UNLIMITED
    m = _SIZE_RE.fullmatch(t)
    if not m or len(m.group(1)) > 40:
        if m:
            raise ValueError(f"{t[:24]}...: more than a limit can hold (2**64-1 bytes); write unlimited")
        raise ValueError(f"expected a size in bytes, with K/M/G/T, or unlimited, got {text!r}")
    size = int(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    if size > UNLIMITED:
        raise ValueError(f"{t} is more than a limit can hold (2**64-1 bytes); write unlimited")
    return size


def parse_bound(key: str, raw: Any, *, sizes: bool = False, lo: int | None = None,
                hi: int | None = None) -> Bound:
    """``{min: N, max: M}`` -> :class:`Bound`, or ValueError naming ``key`` (one line; ``key``
    may be empty when the caller's location already names the setting)."""
    at = f"{key}: " if key else ""
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{at}expected {{min: N}} or {{max: N}}, got {raw!r} ({_BOUND_HINT})")
    unknown = [k for k in raw if k not in BOUND_KEYS]
    if unknown:
        raise ValueError(f"{at}unknown key {unknown[0]!r} ({_BOUND_HINT})")
    vals: dict[str, int] = {}
    for k, v in raw.items():
        where = f"{key}.{k}" if key else k
        if sizes:
            try:
                vals[k] = parse_size(v)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
        elif isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{where}: expected an integer, got {v!r}")
        elif not SYSCTL_INT_MIN <= v <= SYSCTL_INT_MAX:
            raise ValueError(f"{where}: {v} does not fit in 64 bits")
        else:
            vals[k] = v
        if lo is not None and hi is not None and not lo <= vals[k] <= hi:
            raise ValueError(f"{where}: {vals[k]} is out of range {lo}..{hi}")
    if "min" in vals and "max" in vals and vals["min"] > vals["max"]:
        raise ValueError(f"{at}min {vals['min']} is greater than max {vals['max']}")
    return Bound(**vals)


class ThpPolicy(_Strict):
    enabled: Literal["always", "madvise", "never"] | None = None
    defrag: Literal["always", "defer", "defer+madvise", "madvise", "never"] | None = None


class CstatesPolicy(_Strict):
    # Idle states whose exit latency exceeds this many microseconds are disabled per CPU.
    max_latency_us: int = Field(ge=0, le=10_000_000)


class CpuPolicy(_Strict):
    # Fallback order: the first governor the driver offers is the one wanted.
    governor: list[Literal["performance", "schedutil", "ondemand", "conservative", "powersave", "userspace"]] | None = None
    cstates: CstatesPolicy | None = None

    @field_validator("governor", mode="before")
    @classmethod
    def _one_or_list(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [g.strip() for g in v.split("|") if g.strip()]
        return v


class GpuPolicy(_Strict):
    persistence_mode: bool | None = None
    # nvidia-persistenced owns persistence mode on recent drivers: "report" (conflict row
    # when it is not running and mode is off) or "ignore" (set it through NVML regardless).
    persistenced: Literal["prefer", "ignore"] = "prefer"
    # MIG wanted on (true) or off (false) on every GPU; null: not checked. Read-only.
    mig_mode: bool | None = None
    # nvidia_peermem loaded when an RDMA NIC shares a NUMA node with a GPU. Read-only.
    gpudirect_rdma: bool = False
    # nvidia_fs (GPUDirect Storage) loaded. Read-only.
    gds: bool = False


class IrqPolicy(_Strict):
    affinity: Literal["numa-local", "off"] = "off"
    devices: list[Literal["gpu", "nic"]] = Field(default_factory=lambda: ["gpu", "nic"])
    # irqbalance rewrites affinities every 10 s: "conflict" reports it, "ignore" writes anyway.
    irqbalance: Literal["conflict", "ignore"] = "conflict"
    exclude_cpus: str = ""

    @field_validator("exclude_cpus")
    @classmethod
    def _cpulist(cls, v: str) -> str:
        try:
            parse_cpulist(v)
        except (ParseError, ValueError) as exc:
            raise ValueError(f"not a CPU list: {v[:60]!r}: {exc} (expected e.g. '0-1,64-65')") from None
        return v


class AllocatorPolicy(_Strict):
    preload: Literal["jemalloc", "none"] = "none"
    malloc_conf: str = ""
    env_file: str = "/etc/gpu-tune/allocator.env"
    # Host-wide /etc/ld.so.preload affects every process on the host: only when asked.
    ld_so_preload: bool = False

    @field_validator("malloc_conf")
    @classmethod
    def _conf(cls, v: str) -> str:
        if v and not MALLOC_CONF_RE.fullmatch(v):
            raise ValueError(f"not a MALLOC_CONF string: {v!r} (expected key:value,key:value)")
        return v

    @field_validator("env_file")
    @classmethod
    def _abs(cls, v: str) -> str:
        if not clean_path(v) or "\n" in v:
            raise ValueError(f"must be an absolute host path without '.' or '..': {v[:200]!r}")
        if v == LD_SO_PRELOAD or not any(path_matches(p, v) for p in ALLOCATOR_WRITES):
            raise ValueError(f"{v[:200]!r}: the allocator's file lies in {ENV_DIR}/ (gpu-tune's own folder on the host)")
        return v


class LimitsPolicy(_Strict):
    # RLIMIT_MEMLOCK of the container runtime (containers inherit it): {min: SIZE|unlimited}.
    memlock: Bound | None = None

    @field_validator("memlock", mode="before")
    @classmethod
    def _memlock(cls, v: Any) -> Any:
        if v is None or isinstance(v, Bound):
            return v
        if not isinstance(v, dict):
            raise ValueError(f"a limit is a floor: write {{min: {v}}} (or {{min: unlimited}}), got {v!r}")
        b = parse_bound("", v, sizes=True)
        if b.max is not None:
            raise ValueError("only a floor {min: SIZE} is checked; a ceiling would lower what pinned buffers need")
        return b


class ProbePolicy(_Strict):
    # Test accuracy after the fixed amount of work below (never after a time box).
    accuracy_min: float = Field(0.9, ge=0.0, le=1.0)
    # Each throughput regime must reach this fraction of the GPU model's measured baseline.
    throughput_fraction: float = Field(0.5, gt=0.0, le=1.0)
    retries: int = Field(2, ge=0, le=5)
    timeout_s: float = Field(300.0, gt=0, le=3600)
    interval_s: float = Field(3600.0, ge=0)
    require_jemalloc: bool = False
    require_numa_binding: bool = True
    skip_busy_gpus: bool = True
    # The correctness run: this many float32 steps of this batch in a seeded order (fixed work).
    train_steps: int = Field(80, ge=1, le=100_000)
    train_batch_size: int = Field(64, ge=1, le=65536)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    # The throughput windows: launch-bound at batch_size, device-bound at device_batch_size
    # (None: 4096 on a GPU, 1024 on a CPU), each timed for window_seconds (None: 2 s GPU, 1 s CPU).
    batch_size: int = Field(256, ge=1, le=65536)
    device_batch_size: int | None = Field(None, ge=1, le=262144)
    window_seconds: float | None = Field(None, gt=0, le=600)
    # A GPU's data path: host<->GPU bandwidth (pinned copies of this many MiB, from the GPU's NUMA
    # node and from a remote one) and its memory bandwidth, judged against the model's floors.
    bandwidth: bool = True
    bandwidth_size_mib: int = Field(256, ge=16, le=4096)
    # The persistent XLA compilation cache in the agent's state folder (/var/lib/gpu-tune/xla-cache):
    # a probe after the first compiles nothing.
    compile_cache: bool = True

    @model_validator(mode="before")
    @classmethod
    def _replaced(cls, data: Any) -> Any:
        if isinstance(data, dict) and "train_seconds" in data:
            raise ValueError("train_seconds was replaced: the probe now trains a fixed amount of work "
                             "(train_steps, train_batch_size) and times throughput in its own windows "
                             "(window_seconds)")
        return data


class GainPolicy(_Strict):
    # Measure the profile's gain (``gpu-tune gain``) on the agent's first pass in enforce mode,
    # before the node is marked ready. Off by default: it costs 2 x pairs probe processes (about a
    # minute on a GPU node, several on a small CPU host) on every agent start, and reverts the
    # profile for the untuned runs while it measures.
    measure_on_start: bool = False
    # Rounds (None: 6, the fewest whose sign-flip test can confirm a verdict; 8 per setting).
    pairs: int | None = Field(None, ge=1, le=50)
    # Also measure each setting family alone (gpu-tune gain --per-setting) and publish one series and
    # one summary verdict per family.
    per_setting: bool = False
    # Timed seconds of each run's launch-bound window (None: the probe's window).
    window_seconds: float | None = Field(None, gt=0, le=600)


IB_PORT_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}(/[0-9]{1,3})?")


class ExpectPolicy(_Strict):
    """What a healthy node of this profile has, over the GPU model's figures in
    ``policies/baselines.yaml`` (docs/health.md)."""

    gpus: int | None = Field(None, ge=0, le=1024)
    nvlink_active_per_gpu: int | None = Field(None, ge=0, le=64)
    # a number (at least that many ports up) or the ports by name: "mlx5_0" (every port) or "mlx5_0/1"
    ib_ports: int | list[str] | None = None
    ib_rate_gbps: float | None = Field(None, gt=0, le=100_000)

    @field_validator("ib_ports", mode="before")
    @classmethod
    def _ports(cls, v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError("expected a number of ports or a list of port names, got a boolean")
        if isinstance(v, int) and not 0 <= v <= 256:
            raise ValueError(f"{v} is out of range 0..256")
        if isinstance(v, list):
            for name in v:
                if not isinstance(name, str) or not IB_PORT_RE.fullmatch(name):
                    raise ValueError(f"{name!r} is not an InfiniBand port (expected mlx5_0 or mlx5_0/1)")
        return v


class ReadinessPolicy(_Strict):
    expect: ExpectPolicy = Field(default_factory=ExpectPolicy)
    require_compliant: bool = True
    require_probe: bool = True
    # put the startup taint back when readiness is lost (true/false), or the taint to own:
    # {key, value?, effect} (gpu_tune/tune/taint.py)
    taint: bool | TaintSpec = True
    max_temperature_c: float = Field(87.0, gt=0, le=120)
    # A node without nvidia.com/gpu capacity (no device plugin) fails gpu.allocatable only if true.
    require_device_plugin: bool = False

    @field_validator("taint", mode="before")
    @classmethod
    def _taint(cls, v: Any) -> Any:
        return parse_profile_taint(v)


class LaunchPolicy(_Strict):
    # Jobs started by `gpu-tune run` (and the probe) are bound to their GPU's NUMA node: CPUs and
    # memory. false: started unbound (a node where binding measured a loss: `gpu-tune gain
    # --per-setting`).
    numa_binding: bool = True


class Profile(_Strict):
    name: str
    summary: str = ""
    sysctl: dict[str, int | str | Bound] = Field(default_factory=dict)
    thp: ThpPolicy = Field(default_factory=ThpPolicy)
    cpu: CpuPolicy = Field(default_factory=CpuPolicy)
    gpu: GpuPolicy = Field(default_factory=GpuPolicy)
    irq: IrqPolicy = Field(default_factory=IrqPolicy)
    allocator: AllocatorPolicy = Field(default_factory=AllocatorPolicy)
    limits: LimitsPolicy = Field(default_factory=LimitsPolicy)
    probe: ProbePolicy = Field(default_factory=ProbePolicy)
    readiness: ReadinessPolicy = Field(default_factory=ReadinessPolicy)
    gain: GainPolicy = Field(default_factory=GainPolicy)
    launch: LaunchPolicy = Field(default_factory=LaunchPolicy)

    @field_validator("sysctl", mode="before")
    @classmethod
    def _sysctl(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v  # the type check names it
        out: dict[str, Any] = {}
        for key, value in v.items():
            if not isinstance(key, str) or not SYSCTL_KEY_RE.fullmatch(key):
                raise ValueError(f"{key!r} is not a sysctl key (expected e.g. vm.swappiness)")
            if value is None:  # `key: null` leaves out a key an included profile sets
                continue
            lo, hi = SYSCTL_RANGES.get(key, (None, None))
            if isinstance(value, (dict, Bound)):
                out[key] = value if isinstance(value, Bound) else parse_bound(key, value, lo=lo, hi=hi)
                continue
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise ValueError(f"{key}: expected a number, a string or a bound, got {value!r}")
            if isinstance(value, str) and value.strip()[:1] in ("<", ">", "=", "≥", "≤"):
                raise ValueError(f"{key}: {value!r}: write a bound as {{min: N}} or {{max: N}}")
            if isinstance(value, str) and any(c in value for c in "\n\r\0"):
                raise ValueError(f"{key}: {value!r}: a sysctl value is one line")
            zero = next((w for w in str(value).split() if _LEADING_ZERO_WORD.fullmatch(w)), None) \
                if isinstance(value, str) else None
            if zero is not None:
                raise ValueError(f"{key}: {zero!r}: a leading zero makes the kernel read an octal number; "
                                 "write it without the zero")
            if isinstance(value, int) and not SYSCTL_INT_MIN <= value <= SYSCTL_INT_MAX:
                raise ValueError(f"{key}: {value} does not fit in 64 bits")
            if lo is not None and hi is not None:
                if not isinstance(value, int):
                    raise ValueError(f"{key}: expected an integer, got {value!r}")
                if not lo <= value <= hi:
                    raise ValueError(f"{key}: {value} is out of range {lo}..{hi}")
            out[key] = value
        return out

    @model_validator(mode="after")
    def _name(self) -> "Profile":
        if not NAME_RE.fullmatch(self.name):
            raise ValueError(f"name {self.name!r} must match {NAME_RE.pattern}")
        return self
