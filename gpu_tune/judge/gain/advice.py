"""A profile for this node from a ``gpu-tune gain --per-setting`` document
(``--write-profile FILE``): the measured profile, ``include:``d, with every setting family that
measured a LOSS here left out, each with a comment quoting its figure. Pure: text in, text out.

How each family is left out, in the profile's own words (an ``include:``d profile is merged key by
key, so the new file switches off what the included one sets):

==========  ================================================================================
sysctl      each of the profile's keys ``null`` (a null key is left out)
thp         ``thp: {enabled: null, defrag: null}``
cpu         ``cpu: {governor: null, cstates: null}``
gpu         ``gpu: {persistence_mode: null}``
irq         ``irq: {affinity: "off"}``
numa        ``launch: {numa_binding: false}`` and ``probe: {require_numa_binding: false}``
allocator   ``allocator: {preload: none}`` and ``probe: {require_jemalloc: false}``
==========  ================================================================================
"""

from __future__ import annotations

import json
from typing import Any

from gpu_tune.judge.gain.measure import FAMILY_WORDS, family_verdicts
from gpu_tune.judge.gain.stats import LOSS


def _overrides(family: str, profile: Any) -> dict[str, Any]:
    if family == "sysctl":
        return {"sysctl": {k: None for k in sorted(profile.sysctl)}}
    if family == "thp":
        return {"thp": {"enabled": None, "defrag": None}}
    if family == "cpu":
        return {"cpu": {"governor": None, "cstates": None}}
    if family == "gpu":
        return {"gpu": {"persistence_mode": None}}
    if family == "irq":
        return {"irq": {"affinity": "off"}}
    if family == "numa":
        return {"launch": {"numa_binding": False}, "probe": {"require_numa_binding": False}}
    if family == "allocator":
        return {"allocator": {"preload": "none"}, "probe": {"require_jemalloc": False}}
    raise ValueError(f"unknown setting family {family!r}")


def _merge(into: dict[str, Any], over: dict[str, Any]) -> None:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def _figure(doc: dict[str, Any], family: str) -> str:
    parts = []
    for t in doc.get("targets", []):
        a = (t.get("families") or {}).get(family)
        if not a:
            continue
        m = a["measures"]["images_per_second"]
        who = "CPU" if t["gpu"] == "cpu" else f"GPU {t['gpu']}"
        parts.append(f"{who} {a['verdict'].upper() if a['verdict'] == LOSS else a['verdict']} {m['change']}")
    return "; ".join(parts)


def _yaml_value(v: Any) -> str:
    # JSON scalars are YAML scalars: null, true/false, numbers, double-quoted strings
    return json.dumps(v)


def _yaml_block(d: dict[str, Any], indent: int = 0) -> list[str]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out.append(" " * indent + f"{k}:")
            out += _yaml_block(v, indent + 2)
        else:
            out.append(" " * indent + f"{k}: {_yaml_value(v)}")
    return out


def profile_without_losses(doc: dict[str, Any], profile: Any, name: str, *, node: str = "") -> tuple[str, list[str]]:
    """(the YAML text of profile ``name``, the families left out)."""
    if doc.get("mode") != "per-setting":
        raise ValueError("a profile is written from a --per-setting measurement")
    verdicts = family_verdicts(doc)
    dropped = [f for f, v in verdicts.items() if v == LOSS]
    level = f"{float(doc.get('confidence') or 0.95) * 100:.3g}%"
    head = [
        f"# Written by `gpu-tune gain --per-setting --write-profile` from profile {profile.name}"
        + (f" on node {node}" if node else "") + f", {doc.get('measured_at', '')}:",
        f"# {doc.get('pairs')} rounds of the probe's launch-bound regime, each setting family alone on top of",
        f"# untuned, simultaneous {level} intervals (docs/gain.md). Families that measured a LOSS here",
        "# are left out below; the others stay as the included profile sets them:",
    ]
    for fam, v in verdicts.items():
        head.append(f"#   {fam:<9} {v.upper() if v == LOSS else v:<26} {_figure(doc, fam)}")
    for s in doc.get("skipped_families") or []:
        head.append(f"#   {s['family']:<9} not measured: {s['why']}")
    body: dict[str, Any] = {}
    why: dict[str, list[str]] = {}
    for fam in dropped:
        over = _overrides(fam, profile)
        _merge(body, over)
        for key in over:
            why.setdefault(key, []).append(f"{fam} ({FAMILY_WORDS.get(fam, fam)}) left out: {_figure(doc, fam)}")
    lines = head + ["", f"include: {profile.name}.yaml", f"name: {name}"]
    summary = (f"{profile.name} without " + ", ".join(FAMILY_WORDS.get(f, f) for f in dropped) if dropped else
               f"{profile.name}: no family measured a loss on this node")
    lines.append(f"summary: {_yaml_value(summary)}")
    for key, value in body.items():  # one block per top-level key: a key given twice is an error
        lines += [""] + [f"# {w}" for w in why[key]] + _yaml_block({key: value})
    return "\n".join(lines) + "\n", dropped
