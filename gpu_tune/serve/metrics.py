"""Prometheus metrics (docs/monitoring.md): one custom collector over one immutable snapshot.

The collector reads the snapshot it is given (a callable returning the latest one); it defines
``describe()`` so registering it does not collect. Each snapshot renders its exposition once
(:func:`render_metrics`), so ``/metrics`` only returns bytes.

Cardinality. Settings are exported per setting, not per target: ``gpu_tune_setting_compliant{id}``
(1 when every target is ok or unsupported) and ``gpu_tune_setting_targets{id,status}`` (how many
targets are in each status; a status no target is in has no series). A 224-CPU node has about
1,000 targets (one per CPU for ``cpu.governor``, one per IRQ for ``irq.affinity``); one series
each would be ~1,250 series per node, ~1.25 M for a 1,000-node fleet. ``gpu-tune serve
--metrics-detail`` (the snapshot's ``metrics_detail``) adds what a node being debugged needs and a
fleet does not: the per-target series ``gpu_tune_setting_target_compliant{id,target}``, the loop's
``gpu_tune_collector_success`` / ``gpu_tune_collector_duration_seconds`` per stage (a failing
stage already fails a readiness check that names it), the launch-bound GPU busy ratio, the
remote-node bandwidth and the probe's phases. The default is 174 series on an 8-GPU, 224-CPU node.

Per-GPU series carry dcgm-exporter's label names (``gpu``, ``UUID``, ``pci_bus_id``,
``modelName``, ``Hostname``) plus ``numa_node``, with dcgm-exporter's value formats: ``gpu`` is
the index, ``pci_bus_id`` is NVML's form (``00000000:18:00.0``, 8-digit domain, upper-case hex)
and ``Hostname`` is the node name, so ``on(UUID)`` or ``on(gpu, Hostname)`` joins with DCGM.

Probe series come from each probe verdict's ``result`` (the workload's JSON): ``accuracy``;
``fingerprint`` and ``peer_group`` (an info series, only when the fingerprint is a non-empty
string); ``regimes.<regime>.images_per_second`` for the regimes ``launch_bound`` (small
batches: measures the host) and ``device_bound`` (measures the GPU), and ``.gpu_busy_fraction``
of the device-bound regime (where a healthy GPU is at least 90 % busy; the launch-bound one with
``--metrics-detail``). A
result without ``regimes`` (saved by an older probe) gives its ``train_images_per_second`` as
``regime="launch_bound"``. The GPU's data path: ``gpu_tune_probe_h2d_bytes_per_second`` and
``gpu_tune_probe_d2h_bytes_per_second`` with ``numa="local"`` (pinned host memory on the GPU's
own NUMA node, what the probe judges) and, with ``--metrics-detail``, ``numa="remote"`` (a remote
node's memory, where the machine has one); ``gpu_tune_probe_memory_bandwidth_bytes_per_second``
(device-to-device copies, read + write). With ``--metrics-detail`` also the seconds of each phase
of the probe (``gpu_tune_probe_phase_seconds{phase}``, a fixed list of phases).

Tuning gain (``gpu-tune gain``, measured once per agent start in enforce mode when the profile
sets ``gain.measure_on_start``): ``gpu_tune_tuning_gain_ratio{gpu,regime,measure}`` (tuned /
untuned) with ``gpu_tune_tuning_gain_ratio_lower`` and ``_upper`` (its 95 % interval), for the
measures ``images_per_second`` and ``jitter_p99_over_p50`` only: 6 series per GPU. A measure
without an interval (too few pairs) has no series: never a ratio without its bounds. The step
time percentiles are in ``GET /gain``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Iterator, Mapping, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gpu_tune import __version__
from gpu_tune.judge.figures import host_bandwidth, memory_bandwidth
from gpu_tune.judge.figures import identity as probe_identity
from gpu_tune.judge.figures import number as _num
from gpu_tune.judge.figures import result_of
from gpu_tune.judge.figures import throughput as probe_throughput



class Snapshot(Protocol):
    """What the exposition reads of a pass (a :class:`gpu_tune.serve.snapshot.Snapshot`, which
    renders its body with :func:`render_metrics`: the dependency runs that way only)."""

    node: str
    verdict: Any
    audit: Mapping[str, Any] | None
    topology: Mapping[str, Any] | None
    gpus: tuple[Mapping[str, Any], ...]
    probes: tuple[Mapping[str, Any], ...]
    probe_last_success: Mapping[str, float]
    collectors: tuple[Any, ...]
    metrics_detail: bool
    gain: Mapping[str, Any] | None
    host: Any  # gpu_tune.discover.health.HostHealth, or None
    history: Any  # gpu_tune.judge.checks.state.HealthView, or None

GPU_LABELS = ("gpu", "UUID", "pci_bus_id", "modelName", "Hostname", "numa_node")
# Statuses in the order their series are written (docs/monitoring.md); others follow by name.
STATUSES = ("ok", "drift", "conflict", "error", "unsupported")
NONCOMPLIANT = ("drift", "conflict", "error")
GAIN_MEASURES = ("images_per_second", "jitter_p99_over_p50")  # exported; all four are in GET /gain
# The probe's phases exported with --metrics-detail (the workload's timings, "<phase>_seconds").
PROBE_PHASES = ("process_start", "data_load", "tensorflow_import", "bandwidth", "bandwidth_wait", "device_setup",
                "launch_bound_compile", "launch_bound_window", "device_bound_compile", "device_bound_window",
                "inference", "correctness_train", "evaluate", "total")

FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "gpu_tune_build_info": ("gpu-tune build information (always 1)", ("version",)),
    "gpu_tune_ready": ("1 when the node passes every readiness check, else 0", ()),
    "gpu_tune_check_ok": ("1 when the readiness check passes, else 0", ("check",)),
    # the blast-radius limit, where this node's pass would take it out (docs/deploy.md)
    "gpu_tune_out_of_service_limit_reached": ("1 when readiness.max_out_of_service kept this not-ready node in "
                                              "service (reported, not taken out), 0 when it was taken out", ()),
    "gpu_tune_out_of_service_nodes": ("N: the nodes out of service by gpu-tune, as this node last counted", ()),
    "gpu_tune_out_of_service_judged_nodes": ("M: the nodes gpu-tune judges, as this node last counted", ()),
    "gpu_tune_out_of_service_allowed_nodes": ("L: the most nodes gpu-tune takes out at once (of M)", ()),
    "gpu_tune_check_severity_info": ("The severity each readiness check runs with (fatal, warning, or off: not "
                                     "evaluated) and where it came from (by: catalog, or the profile's key, "
                                     "readiness.checks.NAME); always 1", ("check", "severity", "by")),
    "gpu_tune_profile_info": ("The profile the agent runs and its digest (sha256 of the profile as loaded, "
                              "includes merged: nodes on different policies differ); always 1",
                              ("profile", "digest")),
    "gpu_tune_setting_compliant": ("1 when every target of the setting is ok or unsupported, else 0", ("id",)),
    "gpu_tune_setting_targets": ("Targets of the setting in each audit status (no series for a status without "
                                 "targets)", ("id", "status")),
    "gpu_tune_setting_target_compliant": ("1 when this target of the setting is ok or unsupported, else 0 "
                                          "(only with serve --metrics-detail)", ("id", "target")),
    "gpu_tune_probe_accuracy": ("Test accuracy of the latest MNIST probe", GPU_LABELS),
    "gpu_tune_probe_fingerprint_info": ("Fingerprint of the latest deterministic probe run (equal on healthy "
                                        "peers of the same peer_group); always 1",
                                        GPU_LABELS + ("fingerprint", "peer_group")),
    "gpu_tune_probe_train_images_per_second": ("Training throughput of the latest MNIST probe per regime "
                                               "(launch_bound: the host's share, device_bound: the GPU's)",
                                               GPU_LABELS + ("regime",)),
    "gpu_tune_probe_gpu_busy_ratio": ("Fraction of the training window the GPU was busy (0..1) per regime",
                                      GPU_LABELS + ("regime",)),
    "gpu_tune_probe_h2d_bytes_per_second": ("Host-to-GPU copy bandwidth of the latest probe: pinned host memory on "
                                            "the GPU's own NUMA node (numa=local) or on a remote one (numa=remote, "
                                            "only with serve --metrics-detail)", GPU_LABELS + ("numa",)),
    "gpu_tune_probe_d2h_bytes_per_second": ("GPU-to-host copy bandwidth of the latest probe: pinned host memory on "
                                            "the GPU's own NUMA node (numa=local) or on a remote one (numa=remote, "
                                            "only with serve --metrics-detail)", GPU_LABELS + ("numa",)),
    "gpu_tune_probe_memory_bandwidth_bytes_per_second": ("GPU memory bandwidth of the latest probe: device-to-device "
                                                         "copies, bytes read + bytes written", GPU_LABELS),
    "gpu_tune_probe_phase_seconds": ("Seconds of each phase of the latest probe (only with serve --metrics-detail)",
                                     GPU_LABELS + ("phase",)),
    "gpu_tune_probe_duration_seconds": ("Wall time of the latest MNIST probe", GPU_LABELS),
    "gpu_tune_probe_last_success_timestamp_seconds": ("Unix time the probe last passed", GPU_LABELS),
    "gpu_tune_gpu_numa_node": ("NUMA node the GPU is attached to (-1 when the firmware gives none)", GPU_LABELS),
    "gpu_tune_gpu_pcie_link_generation": ("PCIe link generation of the GPU", GPU_LABELS + ("kind",)),
    "gpu_tune_gpu_pcie_link_width": ("PCIe link width (lanes) of the GPU", GPU_LABELS + ("kind",)),
    "gpu_tune_tuning_gain_ratio": ("Tuned / untuned ratio of the measure in the probe's regime, measured by "
                                   "gpu-tune gain at the agent's start (images_per_second: above 1 is a gain; "
                                   "jitter_p99_over_p50: below 1 is a gain)", ("gpu", "regime", "measure")),
    "gpu_tune_tuning_gain_verdict": ("1 for the images/s verdict of gpu-tune gain measured at the agent's start: "
                                     "gain, loss, no significant difference or inconclusive (a loss is confirmed "
                                     "by the sign-flip test, not only by the interval)", ("gpu", "verdict")),
    "gpu_tune_tuning_gain_family_ratio": ("Images/s ratio of one setting family alone on top of untuned against "
                                          "untuned (gpu-tune gain --per-setting at the agent's start, profile "
                                          "gain.per_setting; the worst GPU), labelled with the family's verdict",
                                          ("family", "verdict")),
    "gpu_tune_tuning_gain_ratio_lower": ("Lower bound of the 95% interval of gpu_tune_tuning_gain_ratio",
                                         ("gpu", "regime", "measure")),
    "gpu_tune_tuning_gain_ratio_upper": ("Upper bound of the 95% interval of gpu_tune_tuning_gain_ratio",
                                         ("gpu", "regime", "measure")),
    "gpu_tune_gpu_check_failing": ("1 for each health check that fails on this GPU (no series while it passes: a "
                                   "healthy fleet costs none); severity fatal gates the node, warning never does",
                                   GPU_LABELS + ("check", "severity")),
    "gpu_tune_gpu_fatal_xid": ("1 for each fatal XID this GPU logged in this boot that nobody cleared (docs/health.md)",
                               GPU_LABELS + ("xid",)),
    "gpu_tune_gpu_nvlink_active_links": ("NVLinks of the GPU that are up", GPU_LABELS),
    "gpu_tune_gpu_nvlink_errors": ("NVLink error counters of the GPU summed over its links (reported, not "
                                   "judged; no series while 0)", GPU_LABELS + ("counter",)),
    "gpu_tune_gpu_pcie_replays": ("PCIe replay counter of the GPU since the driver loaded (no series while 0)",
                                  GPU_LABELS),
    "gpu_tune_gpu_pcie_aer_errors": ("PCIe AER errors the kernel counted on the GPU since boot (no series while 0)",
                                     GPU_LABELS + ("severity",)),
    "gpu_tune_gpu_remapped_rows": ("Rows the GPU remapped, correctable and uncorrectable (no series while 0)",
                                   GPU_LABELS + ("kind",)),
    "gpu_tune_infiniband_port_up": ("1 when the InfiniBand/RoCE port is ACTIVE and LinkUp, else 0 (rate_gbps: its "
                                    "rate as sysfs says)", ("device", "port", "link_layer", "rate_gbps")),
    "gpu_tune_collector_success": ("1 when the stage succeeded in its latest run, else 0 "
                                   "(only with serve --metrics-detail)", ("collector",)),
    "gpu_tune_collector_duration_seconds": ("Duration of the stage's latest run (only with serve --metrics-detail)",
                                            ("collector",)),
}


def nvml_bus_id(bus_id: str | None) -> str:
    """``0000:18:00.0`` -> ``00000000:18:00.0`` (the form NVML and dcgm-exporter print)."""
    if not bus_id:
        return ""
    s = str(bus_id).strip()
    parts = s.split(":")
    if len(parts) == 3:
        dom, bus, devfn = parts
        return f"{dom.upper().rjust(8, '0')[-8:]}:{bus.upper()}:{devfn.upper()}"
    if len(parts) == 2:
        return f"00000000:{parts[0].upper()}:{parts[1].upper()}"
    return s.upper()


def setting_rows(audit: Mapping[str, Any] | None) -> list[tuple[str, bool, dict[str, int]]]:
    """Per setting id, in audit order: (id, compliant, {status: targets}) with statuses in
    :data:`STATUSES` order and zero counts left out."""
    counts: dict[str, Counter[str]] = {}
    for s in (audit or {}).get("settings", []) or []:
        counts.setdefault(str(s.get("id")), Counter())[str(s.get("status"))] += 1
    out = []
    for sid, c in counts.items():
        ordered = {st: c[st] for st in STATUSES if c[st]}
        ordered.update({st: n for st, n in sorted(c.items()) if st not in ordered and n})
        out.append((sid, not any(c[st] for st in NONCOMPLIANT), ordered))
    return out


def gpu_rows(snapshot: "Snapshot") -> list[dict[str, Any]]:
    """One row per GPU, merging the topology (NUMA, PCIe from sysfs) with the backend's view."""
    by_index: dict[str, dict[str, Any]] = {}
    topo_gpus = (snapshot.topology or {}).get("gpus") or []
    for g in topo_gpus:
        if isinstance(g, Mapping) and g.get("index") is not None:
            by_index[str(g["index"])] = {"topo": g, "info": None}
    for g in snapshot.gpus:
        if isinstance(g, Mapping) and g.get("index") is not None:
            by_index.setdefault(str(g["index"]), {"topo": None, "info": None})["info"] = g
    rows = []
    for idx in sorted(by_index, key=lambda s: (len(s), s)):
        topo, info = by_index[idx]["topo"] or {}, by_index[idx]["info"] or {}
        numa = topo.get("numa_node")
        numa = numa if isinstance(numa, int) and not isinstance(numa, bool) else None
        pcie = topo.get("pcie") or {}

        def pick(tkey: str, ikey: str) -> float | None:
            v = _num(pcie.get(tkey))
            return v if v is not None else _num(info.get(ikey))

        rows.append({
            "labels": {
                "gpu": idx,
                "UUID": str(info.get("uuid") or topo.get("uuid") or ""),
                "pci_bus_id": nvml_bus_id(info.get("pci_bus_id") or topo.get("pci_bus_id")),
                "modelName": str(info.get("name") or topo.get("name") or ""),
                "Hostname": snapshot.node,
                "numa_node": "" if numa is None else str(numa),
            },
            "numa_node": numa,
            "gen_current": pick("gen_current", "pcie_link_gen_current"),
            # the link's top generation as gpu.pcie judges it: NVML's (device and system) first
            "gen_max": _num(info.get("pcie_link_gen_max")) if _num(info.get("pcie_link_gen_max")) is not None
            else _num(pcie.get("gen_max")),
            "width_current": pick("width_current", "pcie_link_width_current"),
            "width_max": pick("width_max", "pcie_link_width_max"),
        })
    return rows


class SnapshotCollector(Collector):
    """Collects the families of :data:`FAMILIES` from ``source()`` (None: only build info)."""

    def __init__(self, source: Callable[[], "Snapshot | None"]) -> None:
        self.source = source

    def describe(self) -> Iterator[GaugeMetricFamily]:
        for name, (doc, labels) in FAMILIES.items():
            yield GaugeMetricFamily(name, doc, labels=list(labels))

    def _fam(self, name: str) -> GaugeMetricFamily:
        doc, labels = FAMILIES[name]
        return GaugeMetricFamily(name, doc, labels=list(labels))

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self.source()
        build = self._fam("gpu_tune_build_info")
        build.add_metric([__version__], 1)
        yield build
        if snap is None:
            return
        ready = self._fam("gpu_tune_ready")
        ready.add_metric([], 1 if snap.verdict.ready else 0)
        yield ready

        checks = self._fam("gpu_tune_check_ok")
        for c in snap.verdict.checks:
            checks.add_metric([c.name], 1 if c.ok else 0)
        yield checks
        yield from policy_families(self, snap)
        o = snap.limit
        if o is not None:
            for name, value in (("limit_reached", 0 if o.taken else 1), ("nodes", o.out), ("judged_nodes", o.judged),
                                ("allowed_nodes", o.allowed)):
                fam = self._fam(f"gpu_tune_out_of_service_{name}")
                fam.add_metric([], value)
                yield fam

        compliant = self._fam("gpu_tune_setting_compliant")
        targets = self._fam("gpu_tune_setting_targets")
        for sid, ok, by_status in setting_rows(snap.audit):
            compliant.add_metric([sid], 1 if ok else 0)
            for status, n in by_status.items():
                targets.add_metric([sid, status], n)
        yield compliant
        yield targets
        if snap.metrics_detail:
            per_target = self._fam("gpu_tune_setting_target_compliant")
            for s in (snap.audit or {}).get("settings", []) or []:
                ok = s.get("status") not in NONCOMPLIANT
                per_target.add_metric([str(s.get("id")), str(s.get("target"))], 1 if ok else 0)
            yield per_target

        rows = gpu_rows(snap)
        labels_by_gpu = {r["labels"]["gpu"]: r["labels"] for r in rows}
        acc = self._fam("gpu_tune_probe_accuracy")
        ident = self._fam("gpu_tune_probe_fingerprint_info")
        ips = self._fam("gpu_tune_probe_train_images_per_second")
        busy = self._fam("gpu_tune_probe_gpu_busy_ratio")
        dur = self._fam("gpu_tune_probe_duration_seconds")
        last = self._fam("gpu_tune_probe_last_success_timestamp_seconds")
        h2d = self._fam("gpu_tune_probe_h2d_bytes_per_second")
        d2h = self._fam("gpu_tune_probe_d2h_bytes_per_second")
        mem = self._fam("gpu_tune_probe_memory_bandwidth_bytes_per_second")
        phases = self._fam("gpu_tune_probe_phase_seconds")
        for p in snap.probes:
            lv = self._probe_labels(snap, labels_by_gpu, str(p.get("gpu", "")))
            res = result_of(p)
            if _num(res.get("accuracy")) is not None:
                acc.add_metric(lv, _num(res["accuracy"]))
            fp = probe_identity(res)
            if fp is not None:
                ident.add_metric(lv + list(fp), 1)
            for regime, vals in probe_throughput(res).items():
                if "images_per_second" in vals:
                    ips.add_metric(lv + [regime], vals["images_per_second"])
                if "gpu_busy_fraction" in vals and (regime == "device_bound" or snap.metrics_detail):
                    busy.add_metric(lv + [regime], vals["gpu_busy_fraction"])
            if _num(p.get("duration_seconds")) is not None:
                dur.add_metric(lv, _num(p["duration_seconds"]))
            for (side, direction), v in host_bandwidth(res).items():
                if side == "local" or snap.metrics_detail:
                    (h2d if direction == "h2d" else d2h).add_metric(lv + [side], v)
            if memory_bandwidth(res) is not None:
                mem.add_metric(lv, memory_bandwidth(res))
            timings = res.get("timings") if isinstance(res.get("timings"), Mapping) else {}
            for phase in PROBE_PHASES if snap.metrics_detail else ():
                if _num(timings.get(f"{phase}_seconds")) is not None:
                    phases.add_metric(lv + [phase], _num(timings[f"{phase}_seconds"]))
        for gpu, ts in sorted(snap.probe_last_success.items()):
            last.add_metric(self._probe_labels(snap, labels_by_gpu, gpu), float(ts))
        yield from (acc, ident, ips, busy, h2d, d2h, mem, dur, last)
        if snap.metrics_detail:
            yield phases

        numa = self._fam("gpu_tune_gpu_numa_node")
        gen = self._fam("gpu_tune_gpu_pcie_link_generation")
        width = self._fam("gpu_tune_gpu_pcie_link_width")
        for r in rows:
            lv = [r["labels"][k] for k in GPU_LABELS]
            numa.add_metric(lv, -1 if r["numa_node"] is None else r["numa_node"])
            for kind in ("current", "max"):
                if r[f"gen_{kind}"] is not None:
                    gen.add_metric(lv + [kind], r[f"gen_{kind}"])
                if r[f"width_{kind}"] is not None:
                    width.add_metric(lv + [kind], r[f"width_{kind}"])
        yield numa
        yield gen
        yield width

        yield from health_families(self, snap, rows)

        ratio = self._fam("gpu_tune_tuning_gain_ratio")
        lower = self._fam("gpu_tune_tuning_gain_ratio_lower")
        upper = self._fam("gpu_tune_tuning_gain_ratio_upper")
        gain = snap.gain if isinstance(snap.gain, Mapping) else {}
        regime = str(gain.get("regime") or "launch_bound")
        for t in gain.get("targets") or []:
            if not isinstance(t, Mapping):
                continue
            for measure in GAIN_MEASURES:
                m = (t.get("measures") or {}).get(measure) or {}
                r, ci = _num(m.get("ratio")), m.get("ci95")
                if r is None or not isinstance(ci, (list, tuple)) or len(ci) != 2:
                    continue
                lo, hi = _num(ci[0]), _num(ci[1])
                if lo is None or hi is None:
                    continue
                lv = [str(t.get("gpu", "")), regime, measure]
                ratio.add_metric(lv, r)
                lower.add_metric(lv, lo)
                upper.add_metric(lv, hi)
        verdict = self._fam("gpu_tune_tuning_gain_verdict")
        for t in gain.get("targets") or []:
            if isinstance(t, Mapping) and t.get("verdict"):
                verdict.add_metric([str(t.get("gpu", "")), str(t["verdict"])], 1)
        if gain:  # no gain families at all on an agent that does not measure it
            yield ratio
            yield lower
            yield upper
            yield verdict
        fams = _family_rows(gain)
        if fams:  # one series per setting family, only when the agent measures them
            fam = self._fam("gpu_tune_tuning_gain_family_ratio")
            for name, (verdict, r) in fams.items():
                fam.add_metric([name, verdict], r)
            yield fam

        if snap.metrics_detail:
            ok = self._fam("gpu_tune_collector_success")
            took = self._fam("gpu_tune_collector_duration_seconds")
            for c in snap.collectors:
                ok.add_metric([c.name], 1 if c.success else 0)
                took.add_metric([c.name], c.duration)
            yield ok
            yield took

    @staticmethod
    def _probe_labels(snap: "Snapshot", labels_by_gpu: dict[str, dict[str, str]], gpu: str) -> list[str]:
        lab = labels_by_gpu.get(gpu)
        if lab is None:  # the CPU run, or a GPU the backend no longer lists
            lab = {"gpu": gpu, "UUID": "", "pci_bus_id": "", "modelName": "", "Hostname": snap.node,
                   "numa_node": ""}
        return [lab[k] for k in GPU_LABELS]


def health_families(col: "SnapshotCollector", snap: "Snapshot", rows: list[dict[str, Any]]) -> Iterator[GaugeMetricFamily]:
    """The health checks per GPU and the readings they judge (docs/health.md), bounded: one series per
    check failing on a GPU, per fatal XID recorded, and per error counter that is not zero (NVLink
    errors, PCIe replays, AER errors, remapped rows): none of them on a healthy node; the active
    NVLinks per GPU that reports NVLink and one series per InfiniBand port."""
    labels = {r["labels"]["gpu"]: [r["labels"][k] for k in GPU_LABELS] for r in rows}
    by_bus = {str(r["labels"]["pci_bus_id"]).lower(): r["labels"]["gpu"] for r in rows}
    failing = col._fam("gpu_tune_gpu_check_failing")
    for c in snap.verdict.checks:
        for gpu, good in getattr(c, "gpus", ()) or ():
            if gpu in labels and not good:
                failing.add_metric(labels[gpu] + [c.name, c.severity], 1)
    yield failing
    active = col._fam("gpu_tune_gpu_nvlink_active_links")
    errs = col._fam("gpu_tune_gpu_nvlink_errors")
    replays = col._fam("gpu_tune_gpu_pcie_replays")
    remap = col._fam("gpu_tune_gpu_remapped_rows")
    for g in snap.gpus:
        lv = labels.get(str(g.get("index")))
        if lv is None:
            continue
        links = g.get("nvlink")
        if isinstance(links, list):
            active.add_metric(lv, sum(1 for link in links if isinstance(link, Mapping) and link.get("active")))
            for counter in ("crc", "replay", "recovery"):
                vals = [_num(link.get(f"{counter}_errors")) for link in links if isinstance(link, Mapping)]
                total = sum(v for v in vals if v is not None)
                if total:
                    errs.add_metric(lv + [counter], total)
        if _num(g.get("pcie_replay_count")):
            replays.add_metric(lv, _num(g["pcie_replay_count"]))
        rr = g.get("remapped_rows")
        if isinstance(rr, Mapping):
            for kind in ("correctable", "uncorrectable"):
                if _num(rr.get(kind)):
                    remap.add_metric(lv + [kind], _num(rr[kind]))
    yield from (active, errs, replays, remap)
    aer = col._fam("gpu_tune_gpu_pcie_aer_errors")
    for bus, counts in getattr(snap.host, "aer", ()) or ():
        gpu = by_bus.get(nvml_bus_id(bus).lower())
        if gpu is None:
            continue
        for sev in ("correctable", "nonfatal", "fatal"):
            v = getattr(counts, sev, None)
            if v:
                aer.add_metric(labels[gpu] + [sev], v)
    yield aer
    xid = col._fam("gpu_tune_gpu_fatal_xid")
    bus_prefix = {k.rsplit(".", 1)[0]: v for k, v in by_bus.items()}
    for r in getattr(snap.history, "records", ()) or ():
        if r.kind != "xid":
            continue
        gpu = bus_prefix.get(nvml_bus_id(r.bus + ".0").lower().rsplit(".", 1)[0])
        if gpu is not None:
            xid.add_metric(labels[gpu] + [str(r.code)], 1)
    yield xid
    up = col._fam("gpu_tune_infiniband_port_up")
    for p in getattr(snap.host, "ib_ports", ()) or ():
        up.add_metric([p.device, str(p.port), p.link_layer or "", "" if p.rate_gbps is None else f"{p.rate_gbps:g}"],
                      1 if p.up else 0)
    yield up


def _family_rows(gain: Mapping[str, Any]) -> dict[str, tuple[str, float]]:
    """family -> (verdict, images/s ratio) of its worst target, from a --per-setting document."""
    out: dict[str, tuple[str, float]] = {}
    if not gain:
        return out
    from gpu_tune.judge.gain.measure import family_verdicts  # only where the gain was measured

    verdicts = family_verdicts(gain)
    for t in gain.get("targets") or []:
        for name, a in ((t.get("families") or {}) if isinstance(t, Mapping) else {}).items():
            r = _num(((a.get("measures") or {}).get("images_per_second") or {}).get("ratio"))
            if r is None:
                continue
            if name not in out or r < out[name][1]:
                out[name] = (str(verdicts.get(name, "inconclusive")), r)
    return out


def policy_families(col: "SnapshotCollector", snap: "Snapshot") -> Iterator[GaugeMetricFamily]:
    """The severity each check ran with and where it came from (the checks turned off too), and
    the profile's digest (docs/health.md "Your policy")."""
    sev = col._fam("gpu_tune_check_severity_info")
    for c in snap.verdict.checks:
        sev.add_metric([c.name, c.severity, c.policy_key or "catalog"], 1)
    for name, w in snap.verdict.off:
        sev.add_metric([name, w.severity, w.key or "catalog"], 1)
    yield sev
    pol = snap.verdict.policy
    prof = col._fam("gpu_tune_profile_info")
    if pol is not None:
        prof.add_metric([snap.profile, pol.digest], 1)
    yield prof


def make_registry(source: Callable[[], "Snapshot | None"]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(SnapshotCollector(source))
    return registry


def render_metrics(snapshot: "Snapshot | None") -> bytes:
    """The text exposition of one snapshot (rendered once per snapshot)."""
    return generate_latest(make_registry(lambda: snapshot))
