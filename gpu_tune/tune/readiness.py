"""A profile's ``readiness:`` section as data: what a healthy node has (``expect``), the gates that
were there before the operator's policy (``require_compliant``, ``require_probe``, ``taint``, ...)
and the operator's policy itself (docs/health.md "Your policy"):

- ``checks: {CHECK: fatal | warning | off}``: the severity each check runs with;
- ``xid: {N: ACTION}`` or ``{N: {action: ACTION, count: K, within: WINDOW}}``: what an XID weighs,
  or a repeat rule (the action once K bursts of that XID on one GPU fall within the window).

Checked here: the form of every key and value (a severity word, an XID in 1-65535, an action word,
``count`` 1..:data:`MAX_RULE_COUNT`, a window that parses, no key a rule does not know). Which check
names exist, and whether a rule fits the XID it is for, is the judge's to say
(:func:`gpu_tune.judge.policy.policy_of`): the check registry lives there. ``key: null`` leaves out
a key an included profile sets, as for sysctls.

- ``max_out_of_service``: a count (``5``) or a percentage (``10%``) of the nodes gpu-tune judges: the
  most it holds out of service at once (:class:`OutOfService`; the arithmetic and the race handling
  are :mod:`gpu_tune.judge.fleet_limit`'s); ``0`` reports only.

Each key of the section is one field with its own validator: a key added later (one more budget) is
one more field, refused the same way until it exists.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gpu_tune.tune.taint import TaintSpec, parse_profile_taint

SEVERITIES = ("fatal", "warning", "off")
# The actions of NVIDIA's XID catalog, least to most severe (gpu_tune/judge/checks/catalog.py reads
# its rows with these words): what a profile's XID policy may name.
XID_ACTIONS = ("ignore", "restart_app", "reset_gpu", "reboot", "inspect_hw")
XID_MIN, XID_MAX = 1, 65535
MAX_RULE_COUNT = 100  # bursts a rule may count: the state keeps this many per GPU and XID
MAX_WINDOW_S = 90 * 86400  # a window longer than a quarter is no repeat rule
CHECK_KEY_RE = re.compile(r"[a-z0-9_*]+(\.[a-z0-9_*]+)*")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION_RE = re.compile(r"(?:[0-9]{1,6}[smhd])+")
ACROSS = " across boots"
IB_PORT_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}(/[0-9]{1,10})?")  # the kernel numbers ports with a u32
MAX_NODES = 1_000_000  # a count of nodes past any fleet
_PERCENT_RE = re.compile(r"([0-9]{1,3})(?:\.([0-9]{1,2}))?%")
DEFAULT_OUT_OF_SERVICE = "10%"  # why: policies/_base.yaml, beside readiness.max_out_of_service


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Window(_Strict):
    """How far back a repeat rule counts: ``seconds`` of kernel time in this boot, the whole boot
    (``seconds`` None: ``within: boot``), or ``seconds`` of wall time over this boot and the ones
    before it (``across_boots``: ``within: 7d across boots``)."""

    seconds: int | None
    across_boots: bool = False

    def words(self) -> str:
        if self.seconds is None:
            return "this boot"
        return duration_words(self.seconds) + (" across boots" if self.across_boots else "")


def duration_words(seconds: int) -> str:
    """``86400`` -> ``24h``, ``5400`` -> ``1h30m``, ``90`` -> ``1m30s``."""
    if seconds % 86400 == 0 and seconds >= 7 * 86400:
        return f"{seconds // 86400}d"
    parts, left = [], seconds
    for unit, size in (("h", 3600), ("m", 60), ("s", 1)):
        if left >= size:
            parts.append(f"{left // size}{unit}")
            left %= size
    return "".join(parts) or "0s"


def parse_window(text: Any) -> Window:
    """``1h``, ``24h``, ``1h30m``, ``90s``, ``7d``; ``7d across boots``; ``boot``. ValueError
    saying what is wrong, in one line."""
    if isinstance(text, bool) or not isinstance(text, str):
        raise ValueError(f"within: {text!r} is not a window (write e.g. 1h, 24h, 7d across boots or boot)")
    t = " ".join(text.split())
    if t == "boot":
        return Window(seconds=None)
    across = t.endswith(ACROSS)
    body = t[: -len(ACROSS)] if across else t
    if not _DURATION_RE.fullmatch(body):
        raise ValueError(f"within: {text[:40]!r} does not parse (write a duration in s, m, h, d such as 90s, 1h30m, "
                         "24h, 7d; add ' across boots' to count the boots before this one; or 'boot')")
    seconds = sum(int(n) * _UNITS[u] for n, u in re.findall(r"([0-9]+)([smhd])", body))
    if not 1 <= seconds <= MAX_WINDOW_S:
        raise ValueError(f"within: {text[:40]!r}: a window is 1s to {MAX_WINDOW_S // 86400}d")
    return Window(seconds=seconds, across_boots=across)


class Repeat(_Strict):
    count: int = Field(ge=1, le=MAX_RULE_COUNT)
    within: Window

    def words(self) -> str:
        return f"{self.count} within {self.within.words()}"


class XidRule(_Strict):
    """One XID's policy: ``action`` for every record (``repeat`` None), or ``action`` once
    ``repeat.count`` bursts on one GPU fall within ``repeat.within``."""

    action: Literal["ignore", "restart_app", "reset_gpu", "reboot", "inspect_hw"]
    repeat: Repeat | None = None

    def words(self) -> str:
        return self.action if self.repeat is None else f"{self.action} after {self.repeat.words()}"


def xid_code(key: Any) -> int:
    """An XID policy's key: a number 1..65535 (YAML's ``45:`` or ``"45":``)."""
    code = key if isinstance(key, int) and not isinstance(key, bool) else None
    if isinstance(key, str) and key.strip().isdigit() and len(key.strip()) <= 6:
        code = int(key)
    if code is None or not XID_MIN <= code <= XID_MAX:
        raise ValueError(f"{str(key)[:20]!r} is not an XID (a number {XID_MIN}-{XID_MAX})")
    return code


def _action(code: int, value: Any) -> str:
    if not isinstance(value, str) or value not in XID_ACTIONS:
        raise ValueError(f"XID {code}: unknown action {str(value)[:40]!r} (one of {', '.join(XID_ACTIONS)})")
    return value


def parse_xid_rule(code: int, value: Any) -> XidRule:
    """``reset_gpu`` or ``{action: reset_gpu, count: 5, within: 1h}`` for XID ``code``."""
    if not isinstance(value, dict):
        return XidRule(action=_action(code, value))
    unknown = [k for k in value if k not in ("action", "count", "within")]
    if unknown:
        raise ValueError(f"XID {code}: unknown key {str(unknown[0])[:40]!r} (a repeat rule is {{action, count, "
                         "within}})")
    if "action" not in value:
        raise ValueError(f"XID {code}: a rule names its action")
    action = _action(code, value["action"])
    if "count" not in value and "within" not in value:
        return XidRule(action=action)
    if "count" not in value or "within" not in value:
        raise ValueError(f"XID {code}: a repeat rule has both count and within")
    count = value["count"]
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_RULE_COUNT:
        raise ValueError(f"XID {code}: count: {str(count)[:20]!r}: a repeat rule counts 1 to {MAX_RULE_COUNT} "
                         "bursts")
    try:
        window = parse_window(value["within"])
    except ValueError as exc:
        raise ValueError(f"XID {code}: {exc}") from None
    if action == "ignore":
        raise ValueError(f"XID {code}: a repeat rule's action ignore does nothing (write {code}: ignore to ignore "
                         "every record)")
    return XidRule(action=action, repeat=Repeat(count=count, within=window))


class OutOfService(_Strict):
    """``readiness.max_out_of_service``: ``count`` nodes, or ``hundredths`` of a percent of the
    nodes gpu-tune judges (``10%`` is 1000); exactly one is set. 0 (either way): report only."""

    count: int | None = Field(None, ge=0, le=MAX_NODES)
    hundredths: int | None = Field(None, ge=0, le=10_000)

    @property
    def report_only(self) -> bool:
        return not (self.count if self.count is not None else self.hundredths)

    def words(self) -> str:
        """``5``, ``10%``, ``2.5%``."""
        if self.count is not None:
            return str(self.count)
        whole, part = divmod(self.hundredths or 0, 100)
        return f"{whole}%" if not part else f"{whole}.{part:02d}".rstrip("0") + "%"


def parse_out_of_service(value: Any) -> OutOfService:
    """``5`` / ``"5"`` (nodes), ``10%`` / ``2.5%`` (of the nodes judged), ``0`` (report only).
    ValueError saying what is wrong, in one line."""
    if isinstance(value, OutOfService):
        return value
    text = value.strip() if isinstance(value, str) else None
    if isinstance(value, int) and not isinstance(value, bool):
        text = str(value)
    if text is not None and text.isascii() and text.isdigit() and len(text) <= 7 and int(text) <= MAX_NODES:
        return OutOfService(count=int(text))
    m = _PERCENT_RE.fullmatch(text or "")
    if m and int(m.group(1)) * 100 + int((m.group(2) or "0").ljust(2, "0")) <= 10_000:
        return OutOfService(hundredths=int(m.group(1)) * 100 + int((m.group(2) or "0").ljust(2, "0")))
    shown = "true (YAML reads on and yes so)" if value is True else repr(str(value)[:40])
    raise ValueError(f"{shown} is not a count of nodes (0 to {MAX_NODES:,}) or a percentage (0% to 100%, e.g. "
                     "10% or 2.5%); 0 reports only")


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
    # The operator's policy (docs/health.md "Your policy"): a check's severity, an XID's weight.
    checks: dict[str, Literal["fatal", "warning", "off"]] = Field(default_factory=dict)
    xid: dict[int, XidRule] = Field(default_factory=dict)
    # The blast-radius limit: the most nodes gpu-tune holds out of service at once (gpu_tune/judge/fleet_limit.py).
    max_out_of_service: OutOfService = Field(default_factory=lambda: parse_out_of_service(DEFAULT_OUT_OF_SERVICE))

    @field_validator("max_out_of_service", mode="before")
    @classmethod
    def _out_of_service(cls, v: Any) -> Any:
        # `max_out_of_service: null` leaves out what an included profile sets: the default
        return parse_out_of_service(DEFAULT_OUT_OF_SERVICE if v is None else v)

    @field_validator("taint", mode="before")
    @classmethod
    def _taint(cls, v: Any) -> Any:
        return parse_profile_taint(v)

    @field_validator("checks", mode="before")
    @classmethod
    def _checks(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v  # the type check names it
        out: dict[str, str] = {}
        for key, value in v.items():
            if not isinstance(key, str) or len(key) > 128 or not CHECK_KEY_RE.fullmatch(key):
                raise ValueError(f"{str(key)[:60]!r} is not a check name (e.g. gpu.inforom, probe.*.passed)")
            if value is None:  # `name: null` leaves out what an included profile sets
                continue
            if value is False:  # YAML reads a bare `off` (and `no`, `false`) as false
                value = "off"
            if isinstance(value, bool) or value not in SEVERITIES:
                shown = "true (YAML reads on and yes so)" if value is True else repr(str(value)[:40])
                raise ValueError(f"{key}: {shown} is not a severity (one of {', '.join(SEVERITIES)})")
            out[key] = value
        return out

    @field_validator("xid", mode="before")
    @classmethod
    def _xid(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        out: dict[int, XidRule] = {}
        for key, value in v.items():
            if isinstance(value, XidRule):
                out[xid_code(key)] = value
                continue
            code = xid_code(key)  # 45 and "45" are one XID: the later (the including file's) wins
            if value is None:  # `45: null` leaves out what an included profile sets
                out.pop(code, None)
                continue
            out[code] = parse_xid_rule(code, value)
        return out
