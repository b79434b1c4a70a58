"""The startup taint gpu-tune owns on a Kubernetes Node: which one, read from the profile's
``readiness.taint`` or the agent's ``--taint`` (``GPU_TUNE_TAINT``, set by the chart). Pure.

Written three ways:

- the profile: ``true`` (the default taint, put back when readiness is lost), ``false`` (the
  default taint, removed when ready, never put back), or the taint to own,
  ``{key, value?, effect}``;
- the agent's option, as ``kubectl taint`` writes one: ``KEY[=VALUE]:EFFECT``, or ``off``: gpu-tune
  neither puts a taint on nor takes one off and publishes the ``GPUHostReady`` condition only
  (the Node Readiness Controller, or another controller, owns the taint; docs/deploy.md).

A taint is known by its key and effect (the API server keeps one taint per key and effect);
the value is what gpu-tune writes when it puts the taint on. Keys another component owns are
refused (the kubelet's and the node controllers' ``node.kubernetes.io/``, NVIDIA's, NFD's), and
so is ``NoExecute``: it would evict every running pod each time readiness is lost.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

DEFAULT_KEY = "gpu-tune.io/not-ready"
DEFAULT_EFFECT = "NoSchedule"
EFFECTS = ("NoSchedule", "PreferNoSchedule")
OFF = "off"
_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?"
_DNS_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
KEY_RE = re.compile(rf"(?:(?P<prefix>{_DNS_LABEL}(?:\.{_DNS_LABEL})*)/)?(?P<name>{_NAME})")
VALUE_RE = re.compile(rf"(?:{_NAME})?")
# Prefixes whose taints belong to another component: the kubelet and node controllers, NVIDIA's
# GPU Operator and device plugin, Node Feature Discovery; and the core's own kubernetes.io / k8s.io
# (their subdomains, such as startup-taint.cluster-autoscaler.kubernetes.io/ and readiness.k8s.io/,
# are meant for taints like this one).
FOREIGN_PREFIXES = ("node.kubernetes.io/", "node.cloudprovider.kubernetes.io/", "node-role.kubernetes.io/",
                    "nvidia.com/", "feature.node.kubernetes.io/", "kubernetes.io/", "k8s.io/")


@dataclass(frozen=True)
class TaintSpec:
    """One taint: ``key`` and ``effect`` name it, ``value`` is written with it (may be empty)."""

    key: str = DEFAULT_KEY
    effect: str = DEFAULT_EFFECT
    value: str = ""

    @property
    def ident(self) -> str:
        """``KEY:EFFECT``: how the Node's taint list, the owned-taint record and the admission
        policy name it."""
        return f"{self.key}:{self.effect}"

    def as_taint(self) -> dict[str, str]:
        """The taint as the Node's ``spec.taints`` holds it."""
        return {"key": self.key, **({"value": self.value} if self.value else {}), "effect": self.effect}

    def matches(self, taint: Any) -> bool:
        return isinstance(taint, dict) and taint.get("key") == self.key and taint.get("effect") == self.effect

    def as_option(self) -> str:
        """``KEY[=VALUE]:EFFECT`` (``--taint``, ``GPU_TUNE_TAINT``)."""
        return f"{self.key}{'=' + self.value if self.value else ''}:{self.effect}"

    def as_dict(self) -> dict[str, str]:
        return {"key": self.key, "value": self.value, "effect": self.effect}


DEFAULT_TAINT = TaintSpec()


def check_key(key: Any) -> str:
    """The taint key, or ValueError saying what is wrong with it."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"key: expected a taint key such as {DEFAULT_KEY}, got {key!r}")
    m = KEY_RE.fullmatch(key)
    if m is None or len(m["name"]) > 63 or len(m["prefix"] or "") > 253:
        raise ValueError(f"key {key[:80]!r}: not a taint key (an optional DNS prefix and '/', then at most 63 "
                         "letters, digits, '-', '_' or '.', starting and ending with a letter or digit)")
    foreign = next((p for p in FOREIGN_PREFIXES if key.startswith(p)), None)
    if foreign:
        raise ValueError(f"key {key!r}: {foreign} taints belong to another component; use gpu-tune.io/, "
                         "startup-taint.cluster-autoscaler.kubernetes.io/ or readiness.k8s.io/")
    return key


def check_effect(effect: Any) -> str:
    if effect == "NoExecute":
        raise ValueError("effect NoExecute: it would evict every running pod whenever readiness is lost; "
                         "use NoSchedule or PreferNoSchedule")
    if effect not in EFFECTS:
        raise ValueError(f"effect {effect!r}: expected one of {', '.join(EFFECTS)}")
    return str(effect)


def check_value(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > 63 or not VALUE_RE.fullmatch(value):
        raise ValueError(f"value {str(value)[:80]!r}: at most 63 letters, digits, '-', '_' or '.', starting and "
                         "ending with a letter or digit")
    return value


def parse_profile_taint(raw: Any) -> bool | TaintSpec:
    """The profile's ``readiness.taint``: ``true``/``false``, or ``{key, value?, effect}`` -> a
    :class:`TaintSpec`. ValueError (one line) otherwise."""
    if isinstance(raw, (bool, TaintSpec)):
        return raw
    if not isinstance(raw, dict):
        raise ValueError(f"expected true, false or {{key, value, effect}}, got {str(raw)[:80]!r}")
    unknown = sorted(str(k) for k in raw if k not in ("key", "value", "effect"))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} (a taint is {{key, value, effect}})")
    if "effect" not in raw:
        raise ValueError(f"effect: missing (one of {', '.join(EFFECTS)})")
    return TaintSpec(key=check_key(raw.get("key")), effect=check_effect(raw["effect"]),
                     value=check_value(raw.get("value")))


def parse_option(text: str) -> TaintSpec | None:
    """``KEY[=VALUE]:EFFECT`` -> a :class:`TaintSpec`; ``off`` -> None (no taint handling).
    ValueError (one line) otherwise."""
    text = (text or "").strip()
    if text == OFF:
        return None
    head, sep, effect = text.rpartition(":")
    if not sep:
        raise ValueError(f"{text[:80]!r}: expected KEY[=VALUE]:EFFECT (e.g. {DEFAULT_TAINT.as_option()}) or {OFF}")
    key, _, value = head.partition("=")
    return TaintSpec(key=check_key(key), effect=check_effect(effect), value=check_value(value))


@dataclass(frozen=True)
class TaintPlan:
    """What the agent does with the taint: ``spec`` the taint it owns (None: taint handling off,
    condition only) and whether it puts it back when readiness is lost (``put_back``)."""

    spec: TaintSpec | None = DEFAULT_TAINT
    put_back: bool = True
    note: str | None = None  # why the option's taint replaced the profile's (logged once)


def resolve(profile_taint: Any, option: str | None) -> TaintPlan:
    """The taint plan of a run: the profile's ``readiness.taint`` and the agent's ``--taint``
    (which wins: the deployment's admission policy and tolerations are made for it).
    ValueError for an option that does not parse."""
    put_back = profile_taint is not False
    from_profile = profile_taint if isinstance(profile_taint, TaintSpec) else DEFAULT_TAINT
    if option is None or not option.strip():
        return TaintPlan(from_profile, put_back)
    spec = parse_option(option)
    note = None
    if isinstance(profile_taint, TaintSpec) and (spec is None or spec.ident != profile_taint.ident):
        note = (f"the profile's readiness.taint {profile_taint.ident} is replaced by --taint "
                f"{spec.as_option() if spec else OFF} (the deployment's setting)")
    return TaintPlan(spec, put_back, note)
