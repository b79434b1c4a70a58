"""The readiness verdict: one pure function from the latest facts to a list of named checks.

Checks (names are stable; they are the ``check`` label of ``gpu_tune_check_ok``):

- ``tuning.compliant``   the audit (or enforce) report has no ``drift``/``conflict``/``error`` row;
- ``gpu.backend``        the GPU backend answered (only listed when it raised);
- ``gpu.<index>.healthy`` per GPU: present (answers), persistence mode on (when the profile asks for
  it), no uncorrected volatile ECC error, no page retirement pending, no fatal XID, PCIe link at
  its maximum width, and at its maximum generation while the GPU is busy (utilization at least
  :data:`BUSY_UTILIZATION_PERCENT`; idle GPUs lower the generation to save power, which the
  passing check's detail notes), not slowed down for thermal reasons and not above
  ``readiness.max_temperature_c``;
- ``gpu.driver_cuda``    the CUDA version the NVIDIA driver supports is at least the one the
  probe's TensorFlow was built for (listed when the node has NVIDIA GPUs; a CPU-only or missing
  TensorFlow, or a version that cannot be read, is ok with the reason in the detail);
- ``gpu.allocatable``    the Node's ``status.capacity["nvidia.com/gpu"]`` (read by the publisher)
  is at least the GPUs the host has, MIG-enabled ones left out as the device plugin's ``mixed``
  strategy does (listed when the node has GPUs; without Kubernetes, or without the device
  plugin's resource, ok with the reason, unless ``readiness.require_device_plugin``);
- ``gpu.visible``        listed when the agent sees no GPU while the Node says it has some
  (``feature.node.kubernetes.io/pci-10de.present=true``, ``nvidia.com/gpu.present=true`` or
  device-plugin capacity ``nvidia.com/gpu`` above 0): never ok, the detail names the likely causes;
- ``tuning.reverted``    in mode ``revert`` instead of ``tuning.compliant``: never ok (the node is
  not tuned, on purpose), the detail says what the revert restored or could not; the reason is
  ``Reverted`` only once every original is back (else ``RevertPending`` or ``RevertFailed``);
- ``topology.published`` topology discovered and the node labels/condition written (or Kubernetes
  publishing switched off);
- ``probe.<gpu>.passed`` per probe target (``probe.cpu.passed`` for the CPU run), or ``probe.ran``
  when no result exists yet or the probe stage itself failed.

The node is ready when every check is ok. ``readiness.require_compliant: false`` and
``readiness.require_probe: false`` keep those checks listed but ok, with the finding in the detail.

The ``GPUHostReady`` condition a not-ready node gets (:meth:`Verdict.reason`, :meth:`Verdict.message`)
names the most urgent failing check (:data:`URGENCY`), not the first listed: a GPU node on which the
agent sees no GPU says ``GpusNotVisible`` even while its sysctls drift too. The message leads with
that check's figures ("gpu.allocatable: 7 of 8 GPUs offered by the device plugin") and then names the
other failing checks, short enough for ``kubectl describe node`` and stable from pass to pass (no
reading that moves every pass, so a steady node is not rewritten).

Fatal XIDs (:data:`FATAL_XIDS`) are the ones NVIDIA documents as needing a GPU reset, a node
reboot or a hardware check before the GPU can be trusted again:
48 double-bit ECC error, 63 ECC page retirement / row remap recorded, 64 ECC page retirement /
row remap failure, 74 NVLink error, 79 GPU has fallen off the bus, 92 high single-bit ECC rate,
94 contained ECC error, 95 uncontained ECC error, 119 GSP RPC timeout, 120 GSP error.
Application-caused XIDs (13, 31, 43, 45 ...) are left out: they say a job failed, not the GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

FATAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}

NONCOMPLIANT = ("drift", "conflict", "error")
MAX_LISTED = 5  # rows named in one detail before "and N more"
# At or above this utilization a PCIe link below its top generation is a fault; below it the
# GPU may have lowered the link to save power (ASPM / dynamic link speed), as idle GPUs do.
BUSY_UTILIZATION_PERCENT = 50  # the same threshold as the PCIe alert rule


# Condition reasons of checks that are not about one GPU's health.
CHECK_REASONS = {"gpu.driver_cuda": "DriverTooOldForCuda", "gpu.allocatable": "DevicePluginMissingGpus",
                 "gpu.visible": "GpusNotVisible", "tuning.reverted": "Reverted", "probe.ran": "ProbePending",
                 "gpu.backend": "GpuBackendFailed"}
# Which failing check the condition's reason names, most urgent first ("*": any one part). A
# revert is a person's deliberate choice and is named as such; then a GPU node whose GPUs the
# agent cannot see or query at all, a GPU that is unhealthy, a driver too old for the probe, GPUs
# the device plugin does not offer, a probe that failed on a GPU, and only then host settings
# that drift, a probe that has not run yet, and a failed publish.
URGENCY = ("tuning.reverted", "gpu.visible", "gpu.backend", "gpu.*.healthy", "gpu.driver_cuda", "gpu.allocatable",
           "probe.*.passed", "tuning.compliant", "probe.ran", "topology.published")
MAX_MESSAGE = 512  # characters of the condition's message (kubectl describe node shows it whole)
MAX_HEADLINE = 300  # characters of the leading check's figures in it
# Readings that move from one pass to the next, and their stable stand-ins: kept out of what is
# written to the Node (the condition's message, the summary annotation), so a steady node is not
# rewritten every pass.
VOLATILE_READINGS = (
    (re.compile(r" at \d+(\.\d+)?% utilization"), " under load"),
    (re.compile(r"temperature \d+(\.\d+)? C above"), "temperature above"),
)


def without_readings(text: str) -> str:
    for pattern, repl in VOLATILE_READINGS:
        text = pattern.sub(repl, text)
    return text


def _urgency(name: str) -> int:
    parts = name.split(".")
    for i, pattern in enumerate(URGENCY):
        want = pattern.split(".")
        if len(want) == len(parts) and all(w in ("*", p) for w, p in zip(want, parts)):
            return i
    return len(URGENCY)


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str = ""
    # the figures of a failing check in a few words, for the condition's message (default: the
    # detail up to its first remedy); not part of /readiness
    summary: str = field(default="", compare=False)
    # the condition's reason when this check is the most urgent (default: :data:`CHECK_REASONS`)
    reason: str = field(default="", compare=False)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}

    def headline(self) -> str:
        text = self.summary or _first_clause(self.detail)
        text = without_readings(text)
        return text if len(text) <= MAX_HEADLINE else text[:MAX_HEADLINE - 1] + "…"


def _first_clause(detail: str) -> str:
    """A detail without its remedy: up to the first "; " (and a trailing ": do this")."""
    head = detail.split("; ", 1)[0]
    for marker in (": run ", ": restart ", ": drain ", ": cordon ", ": check ", ": reseat ", ": upgrade ",
                   ": deploy ", ": see ", ": install "):
        if marker in head:
            head = head.split(marker, 1)[0]
    return head.strip()


@dataclass(frozen=True)
class Verdict:
    ready: bool
    checks: tuple[Check, ...] = field(default_factory=tuple)

    @property
    def failed(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.ok)

    def most_urgent(self) -> Check | None:
        """The failing check the condition names (:data:`URGENCY`; ties: the first listed)."""
        failed = self.failed
        if not failed:
            return None
        return min(failed, key=lambda c: _urgency(c.name))

    def reason(self) -> str:
        """A CamelCase reason for a Kubernetes condition: the most urgent failing check's."""
        if self.ready:
            return "AllChecksPassed"
        top = self.most_urgent()
        if top is not None and top.reason:
            return top.reason
        first = top.name if top else "unknown"
        if first in CHECK_REASONS:
            return CHECK_REASONS[first]
        head = first.split(".")[0]
        return {"tuning": "TuningNotCompliant", "gpu": "GpuUnhealthy", "topology": "NotPublished",
                "probe": "ProbeFailed"}.get(head, "NotReady")

    def message(self) -> str:
        """One line for the condition: the most urgent failing check with its figures, then the
        names of the others. Stable from pass to pass (no reading that moves every pass)."""
        if self.ready:
            return f"all {len(self.checks)} checks passed"
        top = self.most_urgent()
        assert top is not None
        text = f"{top.name}: {top.headline()}".rstrip(": ")
        others = [c.name for c in self.failed if c is not top]
        if others:
            text += "; also failing: " + ", ".join(others)
        return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 1] + "…"

    def as_dict(self) -> dict[str, Any]:
        return {"ready": self.ready, "checks": [c.as_dict() for c in self.checks]}


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _listed(items: Sequence[str]) -> str:
    head = list(items[:MAX_LISTED])
    more = len(items) - len(head)
    return "; ".join(head) + (f"; and {more} more" if more > 0 else "")


# -- tuning -----------------------------------------------------------------------------------
def tuning_check(audit: Mapping[str, Any] | None, *, required: bool = True, error: str | None = None,
                 mode: str = "audit") -> Check:
    name = "tuning.compliant"
    if error:
        return Check(name, not required, f"{mode} failed: {error}; see the agent log and run "
                                          f"`gpu-tune audit` on the node")
    if audit is None:
        return Check(name, not required, "no audit has completed yet")
    bad = [s for s in audit.get("settings", []) if s.get("status") in NONCOMPLIANT]
    if not bad:
        n = len(audit.get("settings", []))
        return Check(name, True, f"{n} settings compliant with profile {audit.get('profile', '?')}")
    parts = []
    for s in bad:
        what = f"{s.get('id')}[{s.get('target')}] {s.get('status')}"
        if s.get("status") == "drift":
            desired = str(s.get("desired"))
            # a bound or a budget ("≥ 1048576", "≤ 10 µs") reads as what is wanted, not a value
            rel = "wants" if desired[:1] in ("≥", "≤") else "!="
            what += f": {s.get('current')!s} {rel} {desired}"
        elif s.get("detail"):
            what += f": {s.get('detail')}"
        parts.append(what)
    fix = "run `gpu-tune apply`" if mode == "audit" else "see the rows' detail"
    detail = f"{len(bad)} setting(s) not compliant ({fix}): {_listed(parts)}"
    if not required:
        return Check(name, True, "ignored (readiness.require_compliant is false): " + detail)
    shown = [p.split(": ", 1)[0] + (f" {p.split(': ', 1)[1]}" if ": " in p and "drift" in p else "")
             for p in parts[:3]]
    summary = f"{len(bad)} setting(s) not compliant: " + "; ".join(shown) + (
        f"; and {len(parts) - 3} more" if len(parts) > 3 else "")
    return Check(name, False, detail, summary)


# -- GPUs -------------------------------------------------------------------------------------
def _is_thermal(reason: str) -> bool:
    r = reason.lower()
    return "thermal" in r or r in ("hw_slowdown", "hwslowdown")


def _below(cur: Any, top: Any) -> bool:
    return isinstance(cur, int) and isinstance(top, int) and cur < top


def pcie_link(gpu: Any, pcie: Mapping[str, Any] | None = None) -> tuple[Any, Any, Any, Any]:
    """(gen current, gen max, width current, width max): the topology's sysfs reading where it
    has one, else the GPU backend's."""
    def pick(topo_key: str, gpu_key: str) -> Any:
        v = _get(pcie, topo_key) if pcie else None
        return v if v is not None else _get(gpu, gpu_key)

    return (pick("gen_current", "pcie_link_gen_current"), pick("gen_max", "pcie_link_gen_max"),
            pick("width_current", "pcie_link_width_current"), pick("width_max", "pcie_link_width_max"))


def is_busy(gpu: Any) -> bool:
    """Whether the GPU is loaded enough that its PCIe link must run at its top generation."""
    util = _get(gpu, "utilization_percent")
    return isinstance(util, (int, float)) and not isinstance(util, bool) and util >= BUSY_UTILIZATION_PERCENT


def gpu_notes(gpu: Any, pcie: Mapping[str, Any] | None = None) -> list[str]:
    """Facts about a GPU that are not problems, for a passing check's detail."""
    if _get(gpu, "error"):
        return []
    gen_cur, gen_max, w_cur, w_max = pcie_link(gpu, pcie)
    if _below(gen_cur, gen_max) and not _below(w_cur, w_max) and not is_busy(gpu):
        util = _get(gpu, "utilization_percent")
        load = f"idle ({util:g}% utilization)" if isinstance(util, (int, float)) else "utilization unknown"
        return [f"PCIe link at Gen{gen_cur} of Gen{gen_max} while {load}: GPUs lower the link "
                f"generation to save power; judged only under load"]
    return []


def gpu_problems(gpu: Any, *, want_persistence: bool = False,
                 max_temperature_c: float | None = None, pcie: Mapping[str, Any] | None = None) -> list[str]:
    """What is wrong with one GPU, each as a sentence a person can act on (empty: healthy)."""
    idx = _get(gpu, "index")
    err = _get(gpu, "error")
    if err:
        kind = _get(gpu, "error_kind") or "error"
        if kind == "lost":
            return [f"GPU {idx} is lost ({err}): cordon and drain the node, check dmesg for Xid 79, "
                    f"then reset the GPU or reboot"]
        return [f"GPU {idx} does not answer ({kind}: {err}): check the driver with nvidia-smi"]
    out: list[str] = []
    if want_persistence and _get(gpu, "persistence_mode") is False:
        out.append("persistence mode is off: run `gpu-tune apply` or start nvidia-persistenced")
    ecc = _get(gpu, "ecc_uncorrected_volatile")
    if isinstance(ecc, int) and ecc > 0:
        out.append(f"{ecc} uncorrected ECC error(s) since the driver loaded: drain and reset the GPU")
    if _get(gpu, "retired_pages_pending"):
        out.append("a page retirement is pending: drain the node and reset the GPU to complete it")
    xids = [int(x) for x in (_get(gpu, "xid_events") or ()) if int(x) in FATAL_XIDS]
    if xids:
        desc = ", ".join(f"{x} ({FATAL_XIDS[x]})" for x in sorted(set(xids)))
        out.append(f"fatal XID {desc}: drain the node, reset the GPU, and check the hardware if it recurs")
    gen_cur, gen_max, w_cur, w_max = pcie_link(gpu, pcie)
    link = []
    narrow = _below(w_cur, w_max)
    if _below(gen_cur, gen_max) and (narrow or is_busy(gpu)):
        link.append(f"Gen{gen_cur} of Gen{gen_max}"
                    + ("" if narrow else f" at {_get(gpu, 'utilization_percent'):g}% utilization"))
    if narrow:
        link.append(f"x{w_cur} of x{w_max}")
    if link:
        out.append(f"PCIe link trained down ({', '.join(link)}): reseat the card or check the riser/slot")
    thermal = [r for r in (_get(gpu, "clock_throttle_reasons") or ()) if _is_thermal(str(r))]
    if thermal:
        out.append(f"clocks slowed for thermal reasons ({', '.join(map(str, thermal))}): check cooling and airflow")
    temp = _get(gpu, "temperature_c")
    if max_temperature_c is not None and isinstance(temp, (int, float)) and temp > max_temperature_c:
        out.append(f"temperature {temp:g} C above {max_temperature_c:g} C: check cooling and airflow")
    return out


def gpu_checks(gpus: Iterable[Any], *, want_persistence: bool = False,
               max_temperature_c: float | None = None, topology: Mapping[str, Any] | None = None,
               error: str | None = None) -> list[Check]:
    if error:
        return [Check("gpu.backend", False, f"GPU backend failed: {error}; check the driver with nvidia-smi")]
    pcie_by_bus: dict[str, Any] = {}
    for g in (topology or {}).get("gpus", []) or []:
        if isinstance(g, Mapping) and g.get("pci_bus_id"):
            pcie_by_bus[str(g["pci_bus_id"]).lower()] = g.get("pcie")
    out = []
    for g in sorted(gpus, key=lambda g: _get(g, "index", 0)):
        idx = _get(g, "index")
        pcie = pcie_by_bus.get(str(_get(g, "pci_bus_id") or "").lower())
        problems = gpu_problems(g, want_persistence=want_persistence,
                                max_temperature_c=max_temperature_c, pcie=pcie)
        label = f"GPU {idx} {_get(g, 'name') or ''} {_get(g, 'pci_bus_id') or ''}".replace("  ", " ").strip()
        if problems:
            summary = f"GPU {idx}: " + "; ".join(_first_clause(p) for p in problems)
            out.append(Check(f"gpu.{idx}.healthy", False, "; ".join(problems), summary))
        else:
            notes = gpu_notes(g, pcie)
            out.append(Check(f"gpu.{idx}.healthy", True, f"{label} healthy" + "".join(f"; {n}" for n in notes)))
    return out


def driver_cuda_check(topology: Mapping[str, Any] | None, gpus: Sequence[Any] = ()) -> Check | None:
    """The driver's CUDA version (NVML) against the CUDA version the probe's TensorFlow was built
    for (``topology["probe_runtime"]``). Not listed on a node without NVIDIA GPUs."""
    from gpu_tune.gpu.cuda import cuda_major_minor

    name = "gpu.driver_cuda"
    topo = topology or {}
    driver = topo.get("cuda_driver_version")
    if "probe_runtime" not in topo or (driver is None and not gpus and not topo.get("gpus")):
        return None  # no facts (no topology yet), or no NVIDIA GPU
    rt = topo.get("probe_runtime") or {}
    fw = rt.get("framework") or "tensorflow"
    if not rt.get("found"):
        return Check(name, True, f"not compared: the probe's {fw} is not installed"
                                 + (f" (driver supports CUDA {driver})" if driver else ""))
    if rt.get("error"):
        return Check(name, True, f"not compared: the probe's {fw} build is unknown ({rt['error']})")
    if not rt.get("is_cuda_build"):
        return Check(name, True, f"not compared: the probe's {fw} is a CPU-only build (it cannot use the "
                                 f"GPUs; install a CUDA build, e.g. tensorflow[and-cuda])"
                                 + (f"; driver supports CUDA {driver}" if driver else ""))
    built = rt.get("cuda_version")
    have, need = cuda_major_minor(driver), cuda_major_minor(built)
    if driver is None:
        return Check(name, True, f"not compared: the driver's CUDA version is unknown (the probe's {fw} "
                                 f"was built for CUDA {built})")
    if have is None or need is None:
        return Check(name, True, f"not compared: cannot read CUDA versions (driver {driver!r}, {fw} {built!r})")
    if have < need:
        return Check(name, False, f"the NVIDIA driver supports CUDA {driver}, older than CUDA {built} the probe's "
                                  f"{fw} was built for: upgrade the driver to one that supports CUDA "
                                  f"{need[0]}.{need[1]} or newer, or use a {fw} built for CUDA {driver} or older")
    return Check(name, True, f"the driver supports CUDA {driver}, the probe's {fw} was built for CUDA {built}")


def allocatable_check(gpus: Sequence[Any], publish: Any, *, required: bool = False) -> Check | None:
    """``status.capacity["nvidia.com/gpu"]`` of this Node (from the publisher's read) against the
    GPUs the host has, MIG-enabled GPUs left out (the device plugin offers those as
    ``nvidia.com/mig-*`` devices). Not listed without GPUs or before anything was published."""
    name = "gpu.allocatable"
    gpus = list(gpus or [])
    if not gpus or publish is None or _get(publish, "node_read") is None:
        return None  # no GPUs, or nothing published (read) yet
    mig = sorted(_get(g, "index") for g in gpus if _get(g, "mig_mode") is True)
    expected = len(gpus) - len(mig)
    host = f"{len(gpus)} GPU(s) on the host" + (f", {len(mig)} of them in MIG mode (GPU {', '.join(map(str, mig))})"
                                                  if mig else "")
    if not _get(publish, "node_read", False):
        why = str(_get(publish, "detail", "") or "")
        if why.startswith("kubernetes publishing off"):
            return Check(name, True, f"not checked: {why}")
        return Check(name, True, "not checked: the Node could not be read (see topology.published)")
    cap = _get(publish, "gpu_capacity")
    alloc = _get(publish, "gpu_allocatable")
    if cap is None:
        detail = f"the Node has no nvidia.com/gpu capacity: no NVIDIA device plugin runs on it ({host})"
        if required:
            return Check(name, False, detail + ": deploy the device plugin (the GPU Operator), "
                                               "readiness.require_device_plugin is true")
        return Check(name, True, detail + "; not required (readiness.require_device_plugin is false)")
    notes = []
    if isinstance(alloc, int) and alloc < cap:
        notes.append(f"allocatable {alloc}: the device plugin marks {cap - alloc} unhealthy")
    if cap < expected:
        figures = f"{cap} of {expected} GPUs offered by the device plugin (nvidia.com/gpu {cap}; {host})"
        return Check(name, False, f"{figures}: restart the device plugin pod on this node, then check its log "
                                  "and nvidia-smi" + "".join(f"; {n}" for n in notes),
                     figures + "".join(f"; {n}" for n in notes))
    if cap > expected:
        notes.append("more than the GPUs: time-slicing replicas or MIG devices counted as nvidia.com/gpu")
    return Check(name, True, f"nvidia.com/gpu {cap} for {expected} GPU(s) ({host})" + "".join(f"; {n}" for n in notes))


GPU_VISIBILITY_CAUSES = (
    "the pod does not run with the NVIDIA container runtime (runtimeClassName: nvidia, or the "
    "runtime's default), NVIDIA_VISIBLE_DEVICES is not 'all' in the pod, the NVIDIA driver is "
    "not installed or not loaded on the host (nvidia-smi on the node), the GPU backend is off "
    "(--gpu-backend none), or the device plugin's capacity is stale")


def gpu_visible_check(gpus: Sequence[Any], facts: Any) -> Check | None:
    """Not ready when the Node says it has NVIDIA GPUs (``facts.gpu_expected``: NFD or GPU
    Operator labels, device-plugin capacity) and the agent sees none. Not listed otherwise."""
    if list(gpus or []) or facts is None:
        return None
    why = list(_get(facts, "gpu_expected") or ())
    if not why:
        return None
    figures = f"the Node says it has NVIDIA GPUs ({', '.join(why)}) but the agent sees none"
    return Check("gpu.visible", False, f"{figures}; likely causes: {GPU_VISIBILITY_CAUSES}", figures)


def _short(value: Any, most: int = 40) -> str:
    text = str(value)
    return text if len(text) <= most else text[:most - 1] + "…"


def _first3(items: Sequence[str]) -> str:
    return "; ".join(items[:3]) + (f"; and {len(items) - 3} more" if len(items) > 3 else "")


def reverted_check(revert: Mapping[str, Any] | None, *, error: str | None = None) -> Check:
    """Mode ``revert``: the node is taken back to its recorded originals and not enforced. Reason
    ``Reverted`` only once every original is back; ``RevertPending`` while some are still to
    restore (with who can do it, when this run never writes the host: ``revert["read_only"]``,
    ``revert["by"]`` names the run); ``RevertFailed`` when restoring some failed."""
    name = "tuning.reverted"
    if error:
        return Check(name, False, f"revert failed: {error}; see the agent log", reason="RevertFailed")
    if revert is None:
        return Check(name, False, "mode revert: the revert has not run yet", reason="RevertPending")
    left = [r for r in revert.get("settings", []) if r.get("status") != "ok"]
    if left and revert.get("read_only"):
        rows = [f"{r.get('id')}[{r.get('target')}] {_short(r.get('current'))}, original {_short(r.get('desired'))}"
                for r in left]
        figures = (f"mode revert asked for, but {revert.get('by') or 'this run never writes the host'}: "
                   f"{len(left)} original(s) still to restore")
        return Check(name, False, f"{figures} ({_listed(rows)}): an agent in mode enforce or revert on this node "
                                  f"restores them (with this label on), or run `gpu-tune revert` on the node",
                     f"{figures} ({_first3(rows)})", reason="RevertPending")
    if left:
        failed = [f"{r.get('id')}[{r.get('target')}]: {r.get('detail')}" for r in left]
        figures = f"mode revert: {len(left)} original(s) could not be restored"
        return Check(name, False, f"{figures} (kept in the journal, tried again each pass, or run `gpu-tune "
                                  f"revert` on the node once the cause is fixed): {_listed(failed)}",
                     f"{figures}: {_first3(failed)}", reason="RevertFailed")
    return Check(name, False, "mode revert: the recorded originals are restored and nothing is enforced; "
                              "the node is left as it was before gpu-tune")


# -- topology / publish -----------------------------------------------------------------------
def publish_check(*, topology_error: str | None = None, publish: Any = None,
                  publish_error: str | None = None, pending: bool = False) -> Check | None:
    """``publish`` is a PublishResult (``ok``, ``detail``, ``writes``) or None before publishing;
    ``pending``: the verdict being published (the check is listed, ok, so the condition names
    the same checks as ``/readiness``)."""
    name = "topology.published"
    if topology_error:
        return Check(name, False, f"topology discovery failed: {topology_error}")
    if publish_error:
        return Check(name, False, f"publishing to Kubernetes failed: {publish_error}")
    if publish is None:
        return Check(name, True, "publishing") if pending else None
    ok = bool(_get(publish, "ok", False))
    detail = str(_get(publish, "detail", "") or "")
    if ok:
        return Check(name, True, detail or "topology published")
    return Check(name, False, detail or "publishing to Kubernetes failed")


# -- probe ------------------------------------------------------------------------------------
def probe_checks(probes: Sequence[Mapping[str, Any]] | None, *, required: bool = True,
                 error: str | None = None) -> list[Check]:
    def gate(c: Check) -> Check:
        if c.ok or required:
            return c
        return Check(c.name, True, f"ignored (readiness.require_probe is false): {c.detail}")

    if error:
        return [gate(Check("probe.ran", False, f"probe run failed: {error}"))]
    if not probes:
        return [gate(Check("probe.ran", False, "the probe has not completed yet"))]
    out = []
    for p in probes:
        gpu = str(p.get("gpu", "?"))
        status = p.get("status", "error")
        reasons = "; ".join(str(r) for r in (p.get("reasons") or []))
        if p.get("passed"):
            res = p.get("result") or {}
            acc, ips = res.get("accuracy"), res.get("train_images_per_second")
            bits = []
            if isinstance(acc, (int, float)):
                bits.append(f"accuracy {acc:.3f}")
            if isinstance(ips, (int, float)):
                bits.append(f"{ips:.0f} images/s")
            detail = "passed" + (f" ({', '.join(bits)})" if bits else "")
            if status == "skipped":  # a busy GPU's previous verdict stands, or a MIG GPU not probed
                detail = "skipped" + (f": {reasons}" if reasons else "") + (f"; previous run {detail}" if bits else "")
            out.append(Check(f"probe.{gpu}.passed", True, detail))
        else:
            hint = {"timeout": "the probe ran past its timeout: check the GPU for hangs and load",
                    "crashed": "the probe process crashed: see the agent log",
                    "skipped": "the probe was skipped"}.get(status, "")
            figures = f"{status}" + (f": {reasons}" if reasons else "")
            detail = figures + (f" ({hint})" if hint else "")
            out.append(gate(Check(f"probe.{gpu}.passed", False, detail, figures)))
    return out


# -- the verdict ------------------------------------------------------------------------------
def verdict(
    *,
    profile: Any,
    audit: Mapping[str, Any] | None,
    gpus: Iterable[Any] | None,
    topology: Mapping[str, Any] | None = None,
    probes: Sequence[Mapping[str, Any]] | None = None,
    publish: Any = None,
    errors: Mapping[str, str] | None = None,
    mode: str = "audit",
    last_publish: Any = None,
    pending_publish: bool = False,
    revert: Mapping[str, Any] | None = None,
) -> Verdict:
    """Judge the node. ``errors`` maps a stage name (discover, audit, enforce, gpus, probe,
    publish) to the reason it failed this pass. ``publish`` None leaves the publish check out
    (used to decide what to publish before publishing); ``gpu.allocatable`` then judges the
    Node as ``last_publish`` (the previous pass, or a read before the first publish) read it;
    ``pending_publish`` lists the publish check as ok (the verdict about to be published).
    ``mode`` ``revert`` judges ``revert`` (what the revert restored) instead of the audit.
    The one verdict of the agent (``serve``) and of ``gpu-tune label``."""
    errors = dict(errors or {})
    rp = getattr(profile, "readiness", None)
    require_compliant = getattr(rp, "require_compliant", True)
    require_probe = getattr(rp, "require_probe", True)
    max_temp = getattr(rp, "max_temperature_c", None)
    want_persistence = bool(getattr(getattr(profile, "gpu", None), "persistence_mode", False))

    if mode == "revert":
        checks: list[Check] = [reverted_check(revert, error=errors.get("revert"))]
    else:
        checks = [tuning_check(audit, required=require_compliant,
                               error=errors.get("audit") or errors.get("enforce"), mode=mode)]
    checks += gpu_checks(gpus or [], want_persistence=want_persistence, max_temperature_c=max_temp,
                         topology=topology, error=errors.get("gpus"))
    facts = publish if publish is not None else last_publish
    if not errors.get("gpus"):
        extra = [gpu_visible_check(list(gpus or []), facts), driver_cuda_check(topology, list(gpus or [])),
                 allocatable_check(gpus or [], facts,
                                   required=bool(getattr(rp, "require_device_plugin", False)))]
        checks += [c for c in extra if c is not None]
    pub = publish_check(topology_error=errors.get("discover"), publish=publish,
                        publish_error=errors.get("publish"), pending=pending_publish)
    if pub is not None:
        checks.append(pub)
    checks += probe_checks(probes, required=require_probe, error=errors.get("probe"))
    return Verdict(all(c.ok for c in checks), tuple(checks))
