"""NVIDIA's XID catalog as data (``xid_catalog.yaml`` beside this module, with its source and
version): what each XID means and what NVIDIA says to do about it.

Actions, least to most severe: ``ignore`` (informational), ``restart_app`` (the application or
its inputs: a job failed, not the GPU), ``reset_gpu`` (the GPU must be reset before it is
trusted), ``reboot`` (the node must be rebooted), ``inspect_hw`` (the hardware must be checked:
reseat, swap, RMA). The last three are fatal: they keep the node not ready until it reboots or an
operator clears them after a GPU reset (docs/health.md). An XID the catalog does not know, or
marks unused on every GPU generation it covers, is reported as a warning that names it
(``gpu.xid_unknown``), never gating: :func:`sighting_rank` tells the kernel log reader so.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from gpu_tune.discover.xids import FATAL, NOTED, OTHER

ACTIONS = ("ignore", "restart_app", "reset_gpu", "reboot", "inspect_hw")
FATAL_ACTIONS = frozenset({"reset_gpu", "reboot", "inspect_hw"})
ACTION_WORDS = {
    "ignore": "informational",
    "restart_app": "restart the application",
    "reset_gpu": "drain the node and reset the GPU",
    "reboot": "drain the node and reboot it",
    "inspect_hw": "drain the node and inspect the hardware (reseat, swap, RMA)",
}
CATALOG_FILE = Path(__file__).with_name("xid_catalog.yaml")


NVLINK5 = frozenset(range(144, 151))  # decoded per line: the line says Fatal or Nonfatal


@dataclass(frozen=True)
class XidEntry:
    code: int
    name: str
    action: str
    category: str = ""
    applies_to: tuple[str, ...] | None = None  # None: the catalog does not say (SXids)

    @property
    def unused(self) -> bool:
        """Marked unused on every GPU generation the catalog covers (A100, H100, B100, GB200)."""
        return self.applies_to is not None and not self.applies_to

    @property
    def fatal(self) -> bool:
        return self.action in FATAL_ACTIONS and not self.unused

    def fatal_for(self, message: str) -> bool:
        """Whether this record is fatal: NVLink5 XIDs (144-150) in the extended form say it
        themselves (``... RLW_SRC_TRACK Nonfatal XC1 i0 Link 03 ...``)."""
        if self.code in NVLINK5:
            words = message.split()
            if "Nonfatal" in words or "Non-fatal" in words:
                return False
            if "Fatal" in words:
                return not self.unused
        return self.fatal


@dataclass(frozen=True)
class Catalog:
    source: str
    version: str
    xids: dict[int, XidEntry]
    sxids: dict[int, XidEntry]

    def xid(self, code: int) -> XidEntry | None:
        return self.xids.get(code)

    def sxid(self, code: int) -> XidEntry | None:
        return self.sxids.get(code)


def _entries(items: Any, where: str, key: str) -> dict[int, XidEntry]:
    out: dict[int, XidEntry] = {}
    for i, item in enumerate(items or []):
        try:
            code = int(item[key])
            action = str(item["action"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{CATALOG_FILE.name}: {where}[{i}]: {exc}") from None
        if action not in ACTIONS:
            raise ValueError(f"{CATALOG_FILE.name}: {where}[{i}]: action {action!r} is not one of {', '.join(ACTIONS)}")
        if code in out:
            raise ValueError(f"{CATALOG_FILE.name}: {where}[{i}]: XID {code} is listed twice")
        applies = item.get("applies_to")
        out[code] = XidEntry(code, str(item.get("name") or ""), action,
                             str(item.get("category") or item.get("class") or ""),
                             tuple(applies) if isinstance(applies, list) else None)
    return out


@lru_cache(maxsize=1)
def catalog() -> Catalog:
    """The shipped catalog (read once per process)."""
    from gpu_tune.strict import yaml_load

    doc = yaml_load(CATALOG_FILE.read_text(encoding="utf-8")) or {}
    return Catalog(source=str(doc.get("source") or ""), version=str(doc.get("version") or ""),
                   xids=_entries(doc.get("xids"), "xids", "xid"), sxids=_entries(doc.get("sxids"), "sxids", "sxid"))


def sighting_rank(kind: str, code: int, message: str, severity_word: str | None) -> int:
    """How much one kernel log record matters, for the reader's bounds and for which record of a
    sighting speaks for it: FATAL (the catalog's action gates, or an SXid says ``Fatal``), NOTED
    (a code the catalog does not know, or marks unused: named in a warning), OTHER. Called for
    every record: only NVLink5 XIDs look at the text."""
    if kind == "xid" and code in NVLINK5:
        entry = catalog().xid(code)
        if entry is None:
            return NOTED
        return FATAL if entry.fatal_for(message) else NOTED if entry.unused else OTHER
    if kind == "sxid" and severity_word == "Fatal":
        return FATAL
    return (_RANKS or _ranks()).get((kind, code), NOTED)


_RANKS: dict[tuple[str, int], int] = {}


def _ranks() -> dict[tuple[str, int], int]:
    cat = catalog()
    _RANKS.update({("xid", c): FATAL if e.fatal else NOTED if e.unused else OTHER for c, e in cat.xids.items()})
    _RANKS.update({("sxid", c): FATAL if e.fatal else OTHER for c, e in cat.sxids.items()})
    return _RANKS
