"""What the Node should carry for a verdict and a topology: labels, annotations, condition, taint.

Pure: no Kubernetes client here (``gpu_tune/cluster/publisher.py`` diffs this against the live Node and writes).

Label keys (all under ``gpu-tune.io/``; values at most 63 characters of ``[A-Za-z0-9._-]``,
starting and ending with a letter or digit):

==============================  ==============================================================
``profile``                     the profile applied (``training``)
``ready``                       ``true`` / ``false``
``numa-nodes``                  number of NUMA nodes (omitted when the topology has none)
``gpu-count``                   number of GPUs seen (``0`` without GPUs)
``gpu-product``                 GPU model, sanitised (``NVIDIA-H100-80GB-HBM3``); ``mixed`` when
                                the GPUs differ
``gpu-numa-map``                which GPU sits on which NUMA node (format below)
``gpu-memory-mib``              smallest GPU memory in MiB
``gpu-compute-capability``      e.g. ``9.0`` (omitted when the GPUs differ)
``gpu-driver``                  NVIDIA driver version, e.g. ``570.124.06``
``cuda-driver``                 CUDA driver API version, e.g. ``12.8`` (when the topology says)
``nic-count``                   number of NICs in the topology document
==============================  ==============================================================

``gpu-numa-map`` format. GPUs in index order, grouped into runs of consecutive indices on the
same NUMA node, runs joined by ``_``; a run is ``FIRST-LAST.nNODE`` (or ``INDEX.nNODE`` for a
single GPU), an unknown node (``numa_node`` null or -1) is ``nx``:
``0-3.n0_4-7.n1``, ``0-7.nx``, ``0.n0_1.n1_2-3.n0``. When the run form would reach 63 characters
(GPUs alternating between nodes) the compact form is used instead: ``c`` followed by one
character per GPU in index order, the node id in base 36 (``0``-``9``, ``a``-``w`` for 10-32)
or ``x`` for unknown: ``c0101010101010101``. Regular expression for the run form:
``^(\\d+(-\\d+)?\\.n(\\d+|x))(_\\d+(-\\d+)?\\.n(\\d+|x))*$``.

Annotations: ``gpu-tune.io/topology`` (the topology document as compact JSON with sorted keys,
volatile readings such as free memory or temperatures left out so the value only changes when
the hardware does), ``gpu-tune.io/owned-labels`` (comma-separated label keys this agent
wrote; stale ones are removed on the next publish, others' labels are never touched) and
``gpu-tune.io/profile-digest`` (``sha256:`` and 16 hex digits of the profile as loaded, includes
merged: nodes running different policies under one profile name differ) and
``gpu-tune.io/summary`` (what ``gpu-tune fleet`` shows, compact JSON with sorted keys):

.. code-block:: json

    {"v": 1, "drift": 1225,
     "failing": [{"check": "tuning.compliant", "detail": "1225 setting(s) not compliant ..."}],
     "probe": {"0": {"status": "passed", "accuracy": 0.9812, "fingerprint": "3f2a9c1d",
                     "peer_group": "NVIDIA H100 80GB HBM3 | driver 580 | ..."}}}

``drift`` is the number of audit rows in drift, conflict or error (null before the first audit);
``failing`` the failing fatal readiness checks with their detail, the most urgent first (readings that move from pass to
pass, a GPU's utilization or temperature, are left out of it); ``warnings`` (only when some fail)
the names of the failing warning checks; ``weights`` (only when the profile sets some) each check
whose severity is not the catalog's, with the severity it runs with and the profile's key
(``"gpu.inforom": "off readiness.checks.gpu.inforom"``: the checks turned off are listed there too);
``probe`` one entry per probe target: its
status, the accuracy and fingerprint of the deterministic run and, for a GPU, ``datapath``: the
verdict on its host<->GPU and memory bandwidth (``ok``, ``below floor``, ``not judged`` without a
floor for the model, ``not measured``; the figures move from run to run and stay in the metrics
and ``/probe``); ``gain`` (only when the agent
measured it at its start) the node's ``gpu-tune gain`` verdict with the images/s ratio of its
median target and that ratio's 95 % interval, rounded to two decimals (``{"verdict": "gain",
"ratio": 1.05, "ci95": [1.02, 1.08]}``; no ratio when there is no interval): measured once per
start, so stable until re-measured. Only values that stay put on a steady node go in, so a steady
node makes no write, restarts included (with the gain measurement on, a restart re-measures it):
the probe's images/s vary from run to run on the same node (9.8k to 15k measured) and stay in the
metrics and ``/probe``. The value stays under :data:`MAX_SUMMARY_ANNOTATION`.

Condition ``GPUHostReady`` (status ``True``/``False``) and the taint the agent owns (``taint``:
``gpu-tune.io/not-ready:NoSchedule`` unless the profile's ``readiness.taint`` or ``--taint`` names
another, :mod:`gpu_tune.tune.taint`): ``taint_wanted`` is ``False`` when ready (remove it),
``True`` when not ready and the profile puts it back (add it), ``None`` when not ready and the
profile does not put it back (leave the node's taints as they are). In mode ``audit`` and
``revert`` it is always ``False``: the read-only agent never puts the taint on (whatever the
profile says), and takes it off should an enforcing agent or an older version have left it.
With taint handling off (``taint`` None, ``--taint off``) it is always ``None``: the condition
alone is published and another controller (the Node Readiness Controller) owns the taint.
A taint other than the default is recorded in the annotation ``gpu-tune.io/owned-taint``
(``KEY:EFFECT``), so that after a change of key the former one is still known as the agent's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from gpu_tune.judge.figures import identity as probe_identity
from gpu_tune.judge.figures import number as _number
from gpu_tune.judge.figures import result_of
from gpu_tune.judge.readiness import VOLATILE_READINGS
from gpu_tune.tune.taint import DEFAULT_EFFECT, DEFAULT_KEY, DEFAULT_TAINT, TaintSpec

PREFIX = "gpu-tune.io/"
FORBIDDEN_PREFIXES = ("nvidia.com/", "feature.node.kubernetes.io/")

LABEL_PROFILE = PREFIX + "profile"
LABEL_READY = PREFIX + "ready"
LABEL_NUMA_NODES = PREFIX + "numa-nodes"
LABEL_GPU_COUNT = PREFIX + "gpu-count"
LABEL_GPU_PRODUCT = PREFIX + "gpu-product"
LABEL_GPU_NUMA_MAP = PREFIX + "gpu-numa-map"
LABEL_GPU_MEMORY = PREFIX + "gpu-memory-mib"
LABEL_GPU_CC = PREFIX + "gpu-compute-capability"
LABEL_GPU_DRIVER = PREFIX + "gpu-driver"
LABEL_CUDA_DRIVER = PREFIX + "cuda-driver"
LABEL_NIC_COUNT = PREFIX + "nic-count"

ANNOTATION_TOPOLOGY = PREFIX + "topology"
ANNOTATION_OWNED = PREFIX + "owned-labels"
ANNOTATION_SUMMARY = PREFIX + "summary"
ANNOTATION_DIGEST = PREFIX + "profile-digest"
ANNOTATION_OWNED_TAINT = PREFIX + "owned-taint"  # KEY:EFFECT of a taint other than the default
SUMMARY_VERSION = 1

CONDITION_TYPE = "GPUHostReady"
TAINT_KEY = DEFAULT_KEY  # gpu-tune.io/not-ready
TAINT_EFFECT = DEFAULT_EFFECT

MAX_LABEL_VALUE = 63
MAX_CONDITION_MESSAGE = 1024
# Annotations of one object may hold 256 KiB in all; keep ours well under.
MAX_TOPOLOGY_ANNOTATION = 128 * 1024
MAX_SUMMARY_ANNOTATION = 16 * 1024
MAX_SUMMARY_DETAIL = 240  # characters of one failing check's detail
MAX_SUMMARY_FAILING = 24  # failing checks listed (the rest counted in "failing_more")
NONCOMPLIANT = ("drift", "conflict", "error")
# Readings in readiness details that move from one pass to the next (and their stable stand-in).
_VOLATILE_DETAIL = VOLATILE_READINGS

LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
REASON_RE = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
# Readings that change from one pass to the next: kept out of the topology annotation.
VOLATILE_KEY_RE = re.compile(
    r"(free|used|temperature|power|utili[sz]ation|throttle|xid|timestamp|_time$|^time$|since|"
    r"ecc_uncorrected|retired_pages|persistence_mode|error|"
    # GPUs drop their PCIe link speed when idle: the current link state moves with the load
    r"(^|_)current(_|$)|degraded)",
    re.IGNORECASE,
)

_BASE36 = "0123456789abcdefghijklmnopqrstuvw"  # 'x' is reserved for "unknown"


@dataclass(frozen=True)
class NodeWant:
    """The state the Node should be in. ``condition`` has keys type, status, reason, message."""

    labels: dict[str, str]
    annotations: dict[str, str]
    condition: dict[str, str]
    taint_wanted: bool | None
    # more conditions of the agent's: the hardware condition (type, status, reason, message) a
    # node auto-repair controller may watch (docs/health.md "Node auto-repair"); none by default
    more_conditions: tuple[dict[str, str], ...] = ()
    # the taint the agent owns; None: taint handling off (the condition only)
    taint: TaintSpec | None = DEFAULT_TAINT
    # the evidence bundles of this verdict's hardware findings (docs/health.md "Evidence"), named in
    # the transition's Event; ``evidence_new``: those written and not yet in an Event (an Event of
    # their own when the condition does not change)
    evidence: tuple[str, ...] = ()
    evidence_new: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        wanted = {True: "present", False: "absent", None: "unchanged"}[self.taint_wanted]
        return {
            "labels": dict(sorted(self.labels.items())),
            "annotations": dict(sorted(self.annotations.items())),
            "condition": dict(self.condition),
            **({"more_conditions": [dict(c) for c in self.more_conditions]} if self.more_conditions else {}),
            "taint": ({**self.taint.as_dict(), "wanted": wanted} if self.taint is not None
                      else {"managed": False, "wanted": wanted}),
        }


def sanitize_label_value(s: Any) -> str:
    """A valid label value from any text: other characters become ``-``, runs of ``-`` collapse,
    the ends are trimmed to a letter or digit, at most 63 characters. ``None`` gives ``""``."""
    if s is None:
        return ""
    text = re.sub(r"[^A-Za-z0-9._-]+", "-", str(s).strip())
    text = re.sub(r"-{2,}", "-", text)
    text = re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", text)
    if len(text) > MAX_LABEL_VALUE:
        text = re.sub(r"[^A-Za-z0-9]+$", "", text[:MAX_LABEL_VALUE])
    return text


def is_valid_label_value(s: str) -> bool:
    return len(s) <= MAX_LABEL_VALUE and bool(LABEL_VALUE_RE.fullmatch(s))


def _node_of(g: dict[str, Any]) -> int | None:
    n = g.get("numa_node")
    if isinstance(n, bool):
        return None
    if isinstance(n, str):
        n = n.strip()
        if not re.fullmatch(r"-?\d+", n):
            return None
        n = int(n)
    if isinstance(n, int) and n >= 0:
        return n
    return None


def _index_of(g: dict[str, Any], pos: int) -> int:
    i = g.get("index")
    if isinstance(i, int) and not isinstance(i, bool) and i >= 0:
        return i
    return pos


def gpu_numa_map(gpus: Iterable[dict[str, Any]]) -> str:
    """The ``gpu-numa-map`` label value (see the module docstring for the format); ``""`` for
    no GPUs. Each row needs ``index`` and ``numa_node`` (null/-1/missing: unknown)."""
    rows = sorted(((_index_of(g, pos), _node_of(g)) for pos, g in enumerate(gpus)), key=lambda r: r[0])
    if not rows:
        return ""
    runs: list[list[Any]] = []  # [first, last, node]
    for idx, node in rows:
        if runs and runs[-1][2] == node and runs[-1][1] + 1 == idx:
            runs[-1][1] = idx
        else:
            runs.append([idx, idx, node])
    parts = []
    for first, last, node in runs:
        span = str(first) if first == last else f"{first}-{last}"
        parts.append(f"{span}.n{'x' if node is None else node}")
    value = "_".join(parts)
    if len(value) < MAX_LABEL_VALUE:
        return value
    compact = "c" + "".join(
        "x" if node is None or node >= len(_BASE36) else _BASE36[node] for _, node in rows
    )
    # More than 62 GPUs cannot be told apart in one label; the topology annotation has them all.
    return compact[:MAX_LABEL_VALUE]


def _condition_reason(reason: str, ready: bool) -> str:
    """CamelCase reason as Kubernetes conditions use (``probe failed`` -> ``ProbeFailed``)."""
    reason = (reason or "").strip()
    if reason and REASON_RE.fullmatch(reason):
        return reason[:128]
    words = re.findall(r"[A-Za-z0-9]+", reason)
    camel = "".join(w[:1].upper() + w[1:] for w in words)
    camel = re.sub(r"^[^A-Za-z]+", "", camel)[:128]
    if camel:
        return camel
    return "AllChecksPassed" if ready else "ChecksFailed"


def _strip_volatile(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_volatile(v) for k, v in value.items()
                if not (isinstance(k, str) and VOLATILE_KEY_RE.search(k))}
    if isinstance(value, (list, tuple)):
        return [_strip_volatile(v) for v in value]
    return value


def topology_annotation(topology: dict[str, Any] | None) -> str:
    """Compact, key-sorted JSON of the topology without volatile readings. Should it pass
    128 KiB, the largest lists (IRQs first) are dropped and ``"truncated": true`` is set."""
    doc = _strip_volatile(dict(topology or {}))
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    if len(text) <= MAX_TOPOLOGY_ANNOTATION:
        return text
    doc["truncated"] = True
    for key in sorted((k for k, v in doc.items() if isinstance(v, (list, dict))),
                      key=lambda k: (k != "irqs", -len(json.dumps(doc[k], default=str)))):
        doc.pop(key)
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
        if len(text) <= MAX_TOPOLOGY_ANNOTATION:
            break
    return text


def _gpu_rows(gpus: list[dict[str, Any]] | None, topology: dict[str, Any]) -> list[dict[str, Any]]:
    """GpuInfo rows, with ``numa_node`` filled from the topology (matched by PCI bus id, else
    index) when the row lacks it: NVML does not say which NUMA node a GPU is on, sysfs does."""
    topo_gpus = [g for g in (topology.get("gpus") or []) if isinstance(g, dict)]
    if not gpus:
        return topo_gpus
    by_bus = {str(g.get("pci_bus_id", "")).lower(): g for g in topo_gpus if g.get("pci_bus_id")}
    by_index = {g.get("index"): g for g in topo_gpus if "index" in g}
    rows = []
    for g in gpus:
        if not isinstance(g, dict):
            continue
        row = dict(g)
        if _node_of(row) is None:
            t = by_bus.get(str(row.get("pci_bus_id", "")).lower()) or by_index.get(row.get("index"))
            if t is not None and "numa_node" in t:
                row["numa_node"] = t.get("numa_node")
        rows.append(row)
    return rows


def _put(labels: dict[str, str], key: str, value: Any) -> None:
    v = sanitize_label_value(value)
    if v:
        labels[key] = v


def stable_detail(detail: str) -> str:
    """A check's detail without the readings that move from pass to pass, at most
    :data:`MAX_SUMMARY_DETAIL` characters."""
    text = " ".join(str(detail or "").split())
    for pattern, repl in _VOLATILE_DETAIL:
        text = pattern.sub(repl, text)
    return text if len(text) <= MAX_SUMMARY_DETAIL else text[:MAX_SUMMARY_DETAIL - 1] + "…"


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)


def gain_summary(gain: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The node's gain in the summary: its verdict and, where every measured target has an
    interval, the images/s ratio and interval of its median target (two decimals)."""
    if not isinstance(gain, Mapping):
        return None
    out: dict[str, Any] = {"verdict": str(gain.get("verdict") or "error")}
    rows = []
    for t in gain.get("targets") or []:
        m = ((t.get("measures") or {}).get("images_per_second") or {}) if isinstance(t, Mapping) else {}
        ci = m.get("ci95")
        if _number(m.get("ratio")) is None or not isinstance(ci, (list, tuple)) or len(ci) != 2:
            return out
        rows.append((_number(m["ratio"]), _number(ci[0]), _number(ci[1])))
    if rows and all(None not in r for r in rows):
        r, lo, hi = sorted(rows)[(len(rows) - 1) // 2]  # the median target, with its own interval
        out["ratio"], out["ci95"] = round(r, 2), [round(lo, 2), round(hi, 2)]
    from gpu_tune.judge.gain.measure import family_verdicts

    fams = family_verdicts(gain)
    if fams:  # measured per setting family (profile gain.per_setting): each family's verdict
        out["families"] = dict(sorted(fams.items()))
    return out


def node_summary(*, audit: Mapping[str, Any] | None, checks: Iterable[Any] | None,
                 probes: Sequence[Mapping[str, Any]] | None, gain: Mapping[str, Any] | None = None,
                 off: Iterable[tuple[str, Any]] = ()) -> dict[str, Any]:
    """The ``gpu-tune.io/summary`` document (see the module docstring). ``checks`` are readiness
    checks (objects or mappings with name, ok, detail); ``probes`` probe verdicts as documents;
    ``off``: the checks the profile turns off, (name, weight)."""
    drift = None
    if isinstance(audit, Mapping):
        drift = sum(1 for r in audit.get("settings", []) or [] if _get(r, "status") in NONCOMPLIANT)
    checks = list(checks or [])
    from gpu_tune.judge.checks.base import CATEGORIES

    def urgency(c: Any) -> int:  # the most urgent first, as the condition names them (stable sort)
        cat = _get(c, "category")
        return CATEGORIES.index(cat) if cat in CATEGORIES else len(CATEGORIES)

    failing = [{"check": str(_get(c, "name")), "detail": stable_detail(_get(c, "detail") or "")}
               for c in sorted(checks, key=urgency) if not _get(c, "ok") and (_get(c, "severity") or "fatal") == "fatal"]
    doc: dict[str, Any] = {"v": SUMMARY_VERSION, "drift": drift, "failing": failing[:MAX_SUMMARY_FAILING]}
    if len(failing) > MAX_SUMMARY_FAILING:
        doc["failing_more"] = len(failing) - MAX_SUMMARY_FAILING
    # warnings by name only: their figures (a flap count, a slowdown's minutes) move with time
    warn = sorted({str(_get(c, "name")) for c in checks if not _get(c, "ok") and _get(c, "severity") == "warning"})
    if warn:
        doc["warnings"] = warn[:MAX_SUMMARY_FAILING]
    weights = {str(_get(c, "name")): f"{_get(c, 'severity')} {_get(c, 'policy_key')}" for c in checks
               if _get(c, "policy_key")}
    weights.update({name: f"off {w.key}" for name, w in off})
    if weights:
        doc["weights"] = dict(sorted(weights.items())[:MAX_SUMMARY_FAILING * 4])
    probe: dict[str, Any] = {}
    for p in probes or []:
        if not isinstance(p, Mapping):
            continue
        res = result_of(p)
        entry: dict[str, Any] = {"status": str(p.get("status") or "error")}
        acc = _number(res.get("accuracy"))
        if acc is not None:
            entry["accuracy"] = round(acc, 4)
        ident = probe_identity(res)
        if ident is not None:
            entry["fingerprint"], entry["peer_group"] = ident
        if isinstance(p.get("datapath"), str):  # the data path's verdict words, not its figures
            entry["datapath"] = p["datapath"]
        probe[str(p.get("gpu", "?"))] = entry
    doc["probe"] = probe
    g = gain_summary(gain)
    if g is not None:
        doc["gain"] = g
    return doc


def summary_annotation(summary: Mapping[str, Any]) -> str:
    """Compact, key-sorted JSON; should it pass the bound, the peer groups go, then details shrink."""
    doc = json.loads(json.dumps(summary, default=str))
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    if len(text.encode()) <= MAX_SUMMARY_ANNOTATION:
        return text
    doc["truncated"] = True
    for entry in (doc.get("probe") or {}).values():
        entry.pop("peer_group", None)
    for f in doc.get("failing") or []:
        f["detail"] = f["detail"][:60]
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    while len(text.encode()) > MAX_SUMMARY_ANNOTATION and doc.get("probe"):
        doc["probe"].pop(sorted(doc["probe"])[-1])
        doc["probe_more"] = doc.get("probe_more", 0) + 1
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text


def desired_node_state(
    *,
    profile: str,
    ready: bool,
    reason: str,
    message: str,
    topology: dict[str, Any] | None,
    gpus: list[dict[str, Any]] | None,
    driver_version: str | None,
    taint_when_not_ready: bool = True,
    checks: Iterable[Any] | None = None,
    audit: Mapping[str, Any] | None = None,
    probes: Sequence[Mapping[str, Any]] | None = None,
    mode: str = "enforce",
    gain: Mapping[str, Any] | None = None,
    hardware: tuple[str, bool, str, str] | None = None,
    off: Iterable[tuple[str, Any]] = (),
    digest: str = "",
    taint: TaintSpec | None = DEFAULT_TAINT,
) -> NodeWant:
    """The labels, annotations, ``GPUHostReady`` condition and taint wish for one verdict. The
    agent and ``gpu-tune label`` come here through :func:`gpu_tune.cluster.node_state.node_want`
    (and the mode through :func:`~gpu_tune.cluster.node_state.choose_mode`), never directly.

    ``topology`` is the ``gpu-tune topology -o json`` document (missing keys are tolerated);
    ``gpus`` are ``GpuInfo.as_dict()`` rows (the topology's ``gpus`` are used when empty).
    Keep ``message`` free of changing readings: a different message means a status write.
    ``checks`` (the verdict's checks, decided before publishing), ``audit`` (the audit document)
    and ``probes`` (probe verdict documents) make the ``gpu-tune.io/summary`` annotation.
    ``mode`` ``audit`` or ``revert``: the taint is never wanted (see the module docstring).
    ``hardware``: (condition type, ready, reason, message) of the hardware condition, or None.
    ``off`` (the checks the profile turns off) and ``digest`` (the profile's): the operator's policy
    as the Node shows it.
    ``taint``: the taint the agent owns, None for taint handling off (never wanted nor removed).
    """
    topology = topology if isinstance(topology, dict) else {}
    rows = _gpu_rows(gpus, topology)
    labels: dict[str, str] = {}
    _put(labels, LABEL_PROFILE, profile)
    labels[LABEL_READY] = "true" if ready else "false"
    numa = topology.get("numa_nodes")
    if isinstance(numa, list) and numa:
        labels[LABEL_NUMA_NODES] = str(len(numa))
    labels[LABEL_GPU_COUNT] = str(len(rows))
    if rows:
        names = {sanitize_label_value(g.get("name")) for g in rows} - {""}
        if len(names) == 1:
            labels[LABEL_GPU_PRODUCT] = names.pop()
        elif names:
            labels[LABEL_GPU_PRODUCT] = "mixed"
        _put(labels, LABEL_GPU_NUMA_MAP, gpu_numa_map(rows))
        mems = [g.get("memory_total_mib") for g in rows]
        mems = [m for m in mems if isinstance(m, int) and not isinstance(m, bool) and m > 0]
        if mems:
            labels[LABEL_GPU_MEMORY] = str(min(mems))
        ccs = {g.get("compute_capability") for g in rows} - {None, ""}
        if len(ccs) == 1:
            _put(labels, LABEL_GPU_CC, ccs.pop())
    _put(labels, LABEL_GPU_DRIVER, driver_version or topology.get("driver_version"))
    _put(labels, LABEL_CUDA_DRIVER, topology.get("cuda_driver_version"))
    nics = topology.get("nics")
    if isinstance(nics, list):
        labels[LABEL_NIC_COUNT] = str(len(nics))

    for key in labels:  # a programming error, not input: never write others' namespaces
        assert key.startswith(PREFIX) and not key.startswith(FORBIDDEN_PREFIXES), key

    annotations = {
        ANNOTATION_TOPOLOGY: topology_annotation(topology),
        ANNOTATION_OWNED: ",".join(sorted(labels)),
        ANNOTATION_SUMMARY: summary_annotation(node_summary(audit=audit, checks=checks, probes=probes, gain=gain,
                                                            off=off)),
    }
    if digest:
        annotations[ANNOTATION_DIGEST] = digest
    condition = {
        "type": CONDITION_TYPE,
        "status": "True" if ready else "False",
        "reason": _condition_reason(reason, ready),
        "message": (message or "").strip()[:MAX_CONDITION_MESSAGE],
    }
    if taint is None:
        wanted: bool | None = None
    elif ready or mode in ("audit", "revert"):
        wanted = False
    else:
        wanted = True if taint_when_not_ready else None
    more: tuple[dict[str, str], ...] = ()
    if hardware is not None:
        htype, hready, hreason, hmessage = hardware
        more = ({"type": htype, "status": "True" if hready else "False", "reason": _condition_reason(hreason, hready),
                 "message": (hmessage or "").strip()[:MAX_CONDITION_MESSAGE]},)
    return NodeWant(labels=labels, annotations=annotations, condition=condition, taint_wanted=wanted,
                    more_conditions=more, taint=taint)
