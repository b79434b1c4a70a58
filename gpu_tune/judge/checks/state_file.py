"""The health state file, ``<root>/var/lib/gpu-tune/health.json``: what it may hold, read strictly.

The file is the tool's own: written by :class:`~gpu_tune.judge.checks.state.HealthState` only,
crash-safely, under a lock. A file the tool cannot have written is never judged by, whatever is
wrong with it (not JSON, a key given twice, ``NaN``, a number of 5,000 digits, a key of the wrong
type, a list of the wrong items, a record that names another key than its own, more entries than
the tool keeps, too large, not a regular file): it is renamed aside to ``health.json.bad`` (one
kept, the newest), the reason is reported, and a new file is started. Every field is checked by
the pydantic models below in strict mode (no ``"5"`` for 5, no ``true`` for 1), within the bounds
the tool itself keeps, so nothing later meets a value of a type it does not expect.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from gpu_tune.errors import HostError, NotAFile

HEALTH_STATE = "/var/lib/gpu-tune/health.json"
HEALTH_LOCK = "/var/lib/gpu-tune/.health.lock"
ASIDE = "health.json.bad"  # the name a file the tool did not write is renamed to (same folder)
STATE_CAP = 4 << 20
MAX_RECORDS = 512  # fatal (S)XID records kept per boot
MAX_BOOTS = 8  # boots remembered per fatal XID
MAX_HISTORY = 512
MAX_CLEARS = 1024  # clear marks (one per GPU address, and "*")
MAX_BASELINES = 4096  # NVML event counts (GPU address x XID code)
MAX_TOKENS = 16  # values of the Node's set-healthy label acted on
MAX_WORDS = 4  # the latest clears, in words
MAX_USEC = 2**63 - 1
MAX_EPOCH = 1e11  # seconds since 1970: the year 5138
MAX_CODE = 10**10 - 1  # the kernel log reader takes at most 10 digits
MAX_COUNT = 2**53
MAX_REPEAT_KEYS = 128  # GPU address x XID pairs whose bursts a repeat rule counts
MAX_REPEAT_BURSTS = 100  # bursts kept per pair, the newest (a rule counts at most 100)
MAX_MARKS = 256  # hardware findings of this boot whose evidence bundle is written (gpu_tune.judge.evidence)
BUNDLE_RE = r"^[0-9]{8}T[0-9]{6}\.[0-9]{3}Z-[A-Za-z0-9._-]{1,80}$"  # an evidence bundle's name (UTC, ms)

Usec = Annotated[int, Field(ge=0, le=MAX_USEC)]
Epoch = Annotated[float, Field(ge=0, le=MAX_EPOCH)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Key = Annotated[str, StringConstraints(min_length=1, max_length=128)]


REPEAT_KEY_RE = re.compile(r"xid/[0-9a-f:.]{1,64}/[0-9]{1,10}")


def _text(n: int) -> Any:
    return Annotated[str, StringConstraints(max_length=n)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class Record(_Strict):
    kind: Literal["xid", "sxid"]
    bus: Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[0-9a-f:.]+$")]
    code: Annotated[int, Field(ge=0, le=MAX_CODE)]
    count: Count
    first_seen: Epoch
    first_usec: Usec | None
    last_usec: Usec | None
    message: _text(240)  # type: ignore[valid-type]
    source: Literal["kernel log", "NVML events", "repeat rule"] = "kernel log"


class Burst(_Strict):
    """One burst of an XID a repeat rule counts: its boot, first and last kernel time, and the wall
    time of its start (the boot's start plus its kernel time)."""

    boot: _text(64)  # type: ignore[valid-type]
    s: Usec
    e: Usec
    at: Epoch


class Clear(_Strict):
    usec: Usec
    epoch: Epoch


class Baseline(_Strict):
    n: Count
    at: Epoch


class Mark(_Strict):
    """A hardware finding of this boot whose evidence is kept: the bundle it went into, and when."""

    bundle: Annotated[str, StringConstraints(min_length=1, max_length=100, pattern=BUNDLE_RE)]
    at: Epoch


class StateDoc(_Strict):
    version: Annotated[int, Field(ge=1, le=1)]  # strict: true is not 1
    boot_id: _text(64) | None = None  # type: ignore[valid-type]
    boot_started: Epoch | None = None  # wall time of this boot's start (now less /proc/uptime), seconds
    records: Annotated[dict[Key, Record], Field(max_length=MAX_RECORDS)] = {}
    cleared: Annotated[dict[Key, Clear], Field(max_length=MAX_CLEARS)] = {}
    history: Annotated[dict[Key, Annotated[list[_text(64)], Field(max_length=MAX_BOOTS)]],  # type: ignore[valid-type]
                       Field(max_length=MAX_HISTORY)] = {}
    nvml_baseline: Annotated[dict[Key, Baseline], Field(max_length=MAX_BASELINES)] = {}
    applied_tokens: Annotated[list[_text(256)], Field(max_length=MAX_TOKENS)] = []  # type: ignore[valid-type]
    cleared_words: Annotated[list[_text(4096)], Field(max_length=MAX_WORDS)] = []  # type: ignore[valid-type]
    repeats: Annotated[dict[Key, Annotated[list[Burst], Field(max_length=MAX_REPEAT_BURSTS)]],
                       Field(max_length=MAX_REPEAT_KEYS)] = {}
    # written only when it holds something (a file without it is the same to every version)
    evidence: Annotated[dict[Key, Mark], Field(max_length=MAX_MARKS)] = {}

    @model_validator(mode="after")
    def _keys_are_their_records(self) -> "StateDoc":
        for key, r in self.records.items():
            if key != f"{r.kind}/{bus_key(r.bus)}/{r.code}":
                raise ValueError(f"records: the key {key[:40]!r} is not its record's ({r.kind}, {r.bus}, {r.code})")
        for key in self.repeats:
            if not REPEAT_KEY_RE.fullmatch(key):
                raise ValueError(f"repeats: the key {key[:40]!r} is not xid/ADDRESS/CODE")
        return self


def bus_key(bus: str) -> str:
    """An XID names ``0000:1b:00`` (no function); GPUs are ``0000:1b:00.0``: compare without it."""
    b = bus.lower()
    return b.rsplit(".", 1)[0] if b.count(":") == 2 and "." in b.rsplit(":", 1)[1] else b


def empty(boot_id: str | None) -> dict[str, Any]:
    return {"version": 1, "boot_id": boot_id, "boot_started": None, "records": {}, "cleared": {}, "history": {},
            "nvml_baseline": {}, "applied_tokens": [], "cleared_words": [], "repeats": {}}


def _plain(text: str) -> str:
    """Keys from the file, in a message: printable ASCII, the rest escaped (``\\x1b``)."""
    return "".join(c if c.isascii() and c.isprintable() else ascii(c)[1:-1] for c in text)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def parse(text: str) -> dict[str, Any]:
    """The state document in ``text`` as plain data, every field checked; ValueError saying what
    is wrong (in one line, at most 200 characters) for anything the tool cannot have written."""
    from gpu_tune.strict import check_text, json_loads

    try:
        raw = json_loads(text, parse_constant=_no_constant)
        check_text(raw)
        doc = StateDoc.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "the document"
        raise ValueError(f"{_plain(where[:80])}: {_plain(first.get('msg', 'invalid')[:100])}") from None
    except RecursionError:
        raise ValueError("nested too deep") from None
    return doc.model_dump(mode="python")


def load(fs: Any, *, read_only: bool = False) -> tuple[dict[str, Any], str | None]:
    """(the state document, None), or (a new one, why the file on disk was not used): a file the
    tool cannot have written is set aside first (renamed to :data:`ASIDE`), unless ``read_only``
    (``gpu-tune check --slurm --dry-run`` writes nothing under the root: it is left as it is)."""
    aside = (lambda fs, why: f"{HEALTH_STATE}: {why}; not used, and left as it is (nothing is written here)") \
        if read_only else set_aside
    try:
        text = fs.read_text(HEALTH_STATE, limit=STATE_CAP)
    except NotAFile as exc:
        return empty(None), aside(fs, _why(exc))
    except HostError as exc:
        if getattr(exc, "errno", None) in (2, 20):  # ENOENT, ENOTDIR: none yet
            return empty(None), None
        return empty(None), aside(fs, _why(exc))
    if not text.strip():
        return empty(None), None
    try:
        return parse(text), None
    except (ValueError, UnicodeError) as exc:
        first = str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__
        return empty(None), aside(fs, f"not written by gpu-tune ({_plain(first[:200])})")


def _why(exc: Exception) -> str:
    text = str(exc)
    return text[len(HEALTH_STATE) + 2:] if text.startswith(HEALTH_STATE + ": ") else text


def set_aside(fs: Any, why: str) -> str:
    """Rename the state file aside (:data:`ASIDE`); what happened, in words."""
    try:
        fs.set_aside(HEALTH_STATE, ASIDE)
    except HostError as exc:
        return f"{HEALTH_STATE}: {why}; it could not be set aside ({_why(exc)}); a new one is started"
    return f"{HEALTH_STATE}: {why}; set aside as {ASIDE}, a new one is started"


def dump(doc: dict[str, Any]) -> bytes:
    if "evidence" in doc and not doc["evidence"]:  # none kept: the file is as an earlier version writes it
        doc = {k: v for k, v in doc.items() if k != "evidence"}
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
