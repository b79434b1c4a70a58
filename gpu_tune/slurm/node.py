"""A Slurm node as ``scontrol -o show node`` prints it: pure parsers, no process started here.

The one-line form (``-o``) is ``Key=Value`` pairs separated by spaces; a few values hold spaces
themselves (``OS=Linux 6.1.0 #1 SMP ...``, ``Reason=...``), so a line is split only where one
of the keys Slurm prints begins (:data:`KEYS`, from ``slurm_sprint_node_table`` in Slurm's
``src/api/node_info.c``, 20.11 to 24.05). ``Reason`` ends with `` [user@time]``, who set it and
when; :class:`SlurmNode` keeps the three apart.

``Gres`` lists generic resources, comma-separated: ``gpu:8``, ``gpu:h100:8(S:0-1)``,
``gpu:a100:4(S:0),gpu:v100:2(S:1),nic:1``, ``(null)``; :func:`gres_count` adds up one name's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Every key slurm_sprint_node_table prints (any version from 20.11 on); a value runs up to the next.
KEYS = (
    "NodeName", "Arch", "CpuBind", "CoresPerSocket", "CPUAlloc", "CPUEfctv", "CPUTot", "CPULoad",
    "AvailableFeatures", "ActiveFeatures", "Gres", "GresDrain", "GresUsed", "NodeAddr", "NodeHostName",
    "BcastAddr", "Port", "Version", "OS", "RealMemory", "AllocMem", "FreeMem", "Sockets", "Boards",
    "CoreSpecCount", "CPUSpecList", "MemSpecLimit", "State", "ThreadsPerCore", "TmpDisk", "Weight", "Owner",
    "MCS_label", "NextState", "Partitions", "BootTime", "SlurmdStartTime", "LastBusyTime", "ResumeAfterTime",
    "CfgTRES", "AllocTRES", "CapWatts", "CurrentWatts", "AveWatts", "ExtSensorsJoules", "ExtSensorsWatts",
    "ExtSensorsTemp", "LowestJoules", "ConsumedJoules", "Reason", "Comment", "Extra", "InstanceId",
    "InstanceType", "Topology",
)
_KEY_AT = re.compile(r"(?:^|(?<=\s))(" + "|".join(KEYS) + r")=")
_SET_BY = re.compile(r"\s\[([^\[\]@\s]*)@([^\[\]\s]*)\]$")
_GRES_ITEM = re.compile(r"^(?P<name>[A-Za-z0-9_-]+)(?::(?P<rest>[^(]*))?(?:\(.*\))?$")
_COUNT = re.compile(r"([0-9]+)([KMGkmg]?)")  # ASCII digits: int() would read '٨' as 8
_TYPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # h100, a100_80gb, tesla-v100, 3g.40gb (a MIG type)
# A node's state as scontrol prints it: IDLE, IDLE+DRAIN, DOWN+DRAIN+NOT_RESPONDING, MIXED+DRAIN+COMPLETING
_STATE = re.compile(r"[A-Z][A-Z0-9_]*(?:\+[A-Z][A-Z0-9_]*)*[*~#!%$@^-]?", re.I | re.A)
_MULT = {"": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3}

# Node state flags that mean the node is out of service by someone's (or Slurm's) decision.
OUT_OF_SERVICE = frozenset({"DOWN", "FAIL", "FAILING", "ERROR", "FUTURE", "MAINTENANCE", "REBOOT_ISSUED",
                            "REBOOT_REQUESTED", "POWERED_DOWN", "POWERING_DOWN", "POWER_DOWN"})


class NodeLineError(ValueError):
    """A line that is not ``scontrol -o show node`` output."""


@dataclass(frozen=True)
class SlurmNode:
    name: str
    state: str  # as printed: IDLE, IDLE+DRAIN, MIXED+DRAIN, DOWN+NOT_RESPONDING, ...
    reason: str = ""  # without " [user@time]"
    reason_by: str = ""
    reason_at: str = ""
    hostname: str = ""
    addr: str = ""
    gres: str = ""
    partitions: tuple[str, ...] = ()

    @property
    def flags(self) -> frozenset[str]:
        """The base state and its flags, upper case (``IDLE+DRAIN`` -> {IDLE, DRAIN}); a trailing
        ``*`` (not responding) or ``~`` (powered down) of sinfo's short names is not part of it."""
        return frozenset(p.strip().upper() for p in self.state.split("+") if p.strip())

    @property
    def drain(self) -> bool:
        """Drain set: DRAINING while jobs run on it, DRAINED once they ended."""
        return bool({"DRAIN", "DRAINED", "DRAINING"} & self.flags)

    @property
    def out_of_service(self) -> list[str]:
        """States other than a drain that keep it out of service (down, failed, ...)."""
        return sorted(self.flags & OUT_OF_SERVICE)

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "state": self.state, "reason": self.reason, "reason_by": self.reason_by,
                "reason_at": self.reason_at, "hostname": self.hostname, "addr": self.addr, "gres": self.gres,
                "partitions": list(self.partitions)}


def split_line(line: str) -> dict[str, str]:
    """``Key=Value`` pairs of one ``scontrol -o show node`` line. A value ends where the next key
    begins, the spaces before that key not part of it; its own leading spaces are kept (a reason
    `` gpu-tune: x`` is not ``gpu-tune: x``)."""
    text = line.strip()
    marks = list(_KEY_AT.finditer(text))
    if not marks or marks[0].group(1) != "NodeName" or marks[0].start() != 0:
        raise NodeLineError(f"not a line of `scontrol -o show node`: {text[:80]!r}")
    out: dict[str, str] = {}
    for m, nxt in zip(marks, marks[1:] + [None]):
        end = nxt.start() if nxt is not None else len(text)
        out.setdefault(m.group(1), text[m.end():end].rstrip())
    return out


def parse_node(line: str) -> SlurmNode:
    """One node. A line without a name, or without a ``State=`` this module can read, is refused
    (:class:`NodeLineError`): a node whose state is not known is never taken as in service."""
    kv = split_line(line)
    name, state = kv["NodeName"].strip(), kv.get("State")
    if not name:
        raise NodeLineError(f"a line of `scontrol -o show node` without a NodeName: {line.strip()[:80]!r}")
    if state is None or not _STATE.fullmatch(state):
        what = "without State=" if state is None else f"with State={state[:40]!r}, not a node state"
        raise NodeLineError(f"node {name[:80]!r}: a line of `scontrol -o show node` {what}: its state is not known")
    reason, by, at = kv.get("Reason", ""), "", ""
    m = _SET_BY.search(reason)
    if m:
        reason, by, at = reason[:m.start()].rstrip(), m.group(1), m.group(2)
    return SlurmNode(name=name, state=state, reason=reason, reason_by=by, reason_at=at,
                     hostname=kv.get("NodeHostName", "").strip(), addr=kv.get("NodeAddr", "").strip(),
                     gres=kv.get("Gres", "").strip(),
                     partitions=tuple(p for p in kv.get("Partitions", "").strip().split(",") if p and p != "(null)"))


def parse_nodes(text: str) -> list[SlurmNode]:
    """Every node of ``scontrol -o show node`` (one per line; blank lines and Slurm's
    "No nodes in the system" passed over)."""
    out = []
    for line in text.splitlines():
        if line.strip() and not line.startswith("No nodes"):
            out.append(parse_node(line))
    return out


def gres_count(gres: str, name: str = "gpu") -> int | None:
    """How many of ``name`` a ``Gres=`` value offers (every type added up), or None when it lists
    none. Raises ValueError for an entry that is not ``name[:type][:count][(...)]``."""
    total: int | None = None
    depth, item, items = 0, "", []
    for ch in gres.strip():  # split at the commas outside parentheses: gpu:2(S:0,1),nic:1
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            items.append(item)
            item = ""
        else:
            item += ch
    items.append(item)
    for raw in (i.strip() for i in items):
        if not raw or raw == "(null)":
            continue
        m = _GRES_ITEM.match(raw)
        if not m:
            raise ValueError(f"Gres entry {raw!r}: expected NAME[:TYPE][:COUNT]")
        if m.group("name") != name:
            continue
        parts = [p for p in (m.group("rest") or "").split(":") if p and p != "no_consume"]
        count = 1
        found = _COUNT.fullmatch(parts[-1]) if parts else None
        if found:
            count = int(found.group(1)) * _MULT[found.group(2).lower()]
            parts = parts[:-1]
        if len(parts) > 1 or (parts and not _TYPE.fullmatch(parts[0])):
            raise ValueError(f"Gres entry {raw!r}: expected NAME[:TYPE][:COUNT], the count in ASCII digits "
                             f"(not {parts[-1]!r})")
        total = (total or 0) + count
    return total
