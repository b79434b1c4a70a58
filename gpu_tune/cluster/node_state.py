"""What the Node carries, decided in one place for the agent (``gpu-tune serve``) and for
``gpu-tune label``, so the two cannot disagree.

:func:`choose_mode` decides the mode of a pass from the run's own mode (``--mode``) and the
Node's ``gpu-tune.io/mode`` label, read at the start of the pass. The label may only make a run
write *less* to the host (:data:`HOST_WRITES`: ``audit`` writes nothing, ``revert`` writes back the
recorded originals, ``enforce`` writes the profile); a label asking for more is not obeyed. A
label asking for ``revert`` from a run that never writes the host (an audit agent, a read-only
pod, ``gpu-tune label``) is still *judged*: the verdict says what is still to revert and who can
do it, and says ``Reverted`` only once every original is back.

:func:`node_want` turns a verdict into the :class:`~gpu_tune.cluster.labels.NodeWant` (labels,
annotations, the ``GPUHostReady`` condition, the taint) for the pass's mode: ``audit`` and
``revert`` never put the taint on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from gpu_tune.cluster.labels import NodeWant, desired_node_state

# How much of the host each mode writes, least first.
HOST_WRITES = {"audit": 0, "revert": 1, "enforce": 2}
MODES = tuple(HOST_WRITES)
# Modes a Node's gpu-tune.io/mode label may ask for (``enforce`` never: a label cannot make a
# read-only run write).
NODE_MODES = ("audit", "revert")


@dataclass(frozen=True)
class ModeChoice:
    """The mode of one pass. ``mode``: what the pass does to the host (and the taint rule);
    ``judged``: what the verdict judges (``revert`` whenever a revert is asked for, even by a run
    that cannot write); ``note``: why either differs from the run's own mode (None: it does not)."""

    mode: str
    judged: str
    note: str | None = None

    @property
    def revert_read_only(self) -> bool:
        """A revert is asked for and this run never writes the host: it can only say what is left."""
        return self.judged == "revert" and self.mode != "revert"


def choose_mode(own: str, requested: str | None, *, who: str = "this agent") -> ModeChoice:
    """The pass's mode: ``own`` (``--mode``) unless the Node's label ``requested`` asks for one
    that writes less. ``who`` names the run in the note (``this agent``, ``gpu-tune label``)."""
    if own not in HOST_WRITES:
        raise ValueError(f"mode {own!r}: expected one of {', '.join(MODES)}")
    if not requested:
        return ModeChoice(own, own)
    if requested not in NODE_MODES:
        return ModeChoice(own, own, f"the Node's gpu-tune.io/mode={requested} is ignored: it may only be one of "
                                    f"{', '.join(NODE_MODES)}; keeping mode {own}")
    if HOST_WRITES[requested] <= HOST_WRITES[own]:
        return ModeChoice(requested, requested,
                          f"mode {requested}: asked for by the Node's gpu-tune.io/mode label (own mode {own})")
    # revert asked of a run that never writes the host
    return ModeChoice(own, "revert", f"the Node's gpu-tune.io/mode=revert is not carried out: {who} runs in mode "
                                     f"{own} and never writes the host; it reports what is still to revert")


def node_want(v: Any, *, profile: Any, mode: str, topology: Mapping[str, Any] | None,
              gpus: Sequence[Mapping[str, Any]] | None, driver_version: str | None,
              cuda_driver_version: str | None = None, audit: Mapping[str, Any] | None = None,
              probes: Sequence[Mapping[str, Any]] | None = None, gain: Mapping[str, Any] | None = None,
              hardware_condition: str | None = None, taint: Any = None) -> NodeWant:
    """What the Node should carry for the verdict ``v`` (a :class:`~gpu_tune.judge.readiness.Verdict`)
    of a pass in ``mode`` (:attr:`ModeChoice.mode`) for ``profile`` (a loaded profile: its name and
    ``readiness.taint``). ``cuda_driver_version`` fills the topology's when it has none.
    ``hardware_condition``: the type of the hardware-only condition to keep (docs/health.md "Node
    auto-repair"), None for none. ``taint``: the run's :class:`~gpu_tune.tune.taint.TaintPlan`
    (:func:`taint_plan`); None: the profile's ``readiness.taint`` alone."""
    from gpu_tune.tune.taint import resolve

    topo = dict(topology or {})
    if topo.get("cuda_driver_version") is None:
        topo["cuda_driver_version"] = cuda_driver_version
    readiness = getattr(profile, "readiness", None)
    plan = taint if taint is not None else resolve(getattr(readiness, "taint", True), None)
    return desired_node_state(profile=getattr(profile, "name", str(profile)), ready=v.ready, reason=v.reason(),
                              message=v.message(), topology=topo, gpus=list(gpus or []),
                              driver_version=driver_version,
                              taint_when_not_ready=plan.put_back, taint=plan.spec,
                              checks=v.checks, audit=audit, probes=probes, mode=mode, gain=gain,
                              hardware=hardware(hardware_condition, v), off=getattr(v, "off", ()),
                              digest=getattr(getattr(v, "policy", None), "digest", ""))


def taint_plan(profile: Any, option: str | None, where: str = "--taint") -> Any:
    """The run's :class:`~gpu_tune.tune.taint.TaintPlan` from the profile's ``readiness.taint`` and
    the ``--taint`` option (``GPU_TUNE_TAINT``); InputError naming the option when it does not parse."""
    from gpu_tune.errors import InputError
    from gpu_tune.tune.taint import resolve

    try:
        return resolve(getattr(getattr(profile, "readiness", None), "taint", True), option)
    except ValueError as exc:
        raise InputError(f"{where} {option!r}: {exc}") from None


def hardware(ctype: str | None, v: Any) -> tuple[str, bool, str, str] | None:
    """(type, ready, reason, message) of the hardware condition for the verdict ``v``, or None."""
    if not ctype:
        return None
    hw = v.hardware()
    return ctype, hw.ready, hw.reason(), hw.message()
