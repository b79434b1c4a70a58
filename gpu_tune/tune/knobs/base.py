"""The knob interface. One module per setting family; each knob declares its id, the kernel files
it touches and its value checks in one place, and offers four separate steps:

- ``read(ctx)``      -> rows (current vs desired, status), read-only;
- ``snapshot(ctx, row)`` -> what the journal must keep to restore the original (read-only);
- ``apply(ctx, row)``  -> write ``row.desired`` (raises HostError/GpuError);
- ``restore(ctx, entry)`` -> put a journalled original back.

Verification is a fresh ``read``. Deciding what to change is :func:`gpu_tune.tune.engine.plan` (pure).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from gpu_tune.errors import HostError
from gpu_tune.tune.model import Setting
from gpu_tune.tune.paths import path_matches

if TYPE_CHECKING:  # pragma: no cover
    from gpu_tune.gpu.base import GpuBackend
    from gpu_tune.host.fs import HostFS
    from gpu_tune.tune.profile import Profile
    from gpu_tune.discover.model import Topology


@dataclass
class Context:
    """What a knob may look at: the host, the profile, the GPUs and (lazily) the topology."""

    fs: "HostFS"
    profile: "Profile"
    gpu: "GpuBackend | None" = None
    _topology: Any = field(default=None, repr=False)
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    def topology(self) -> "Topology":
        if self._topology is None:
            from gpu_tune.discover.topology import discover

            self._topology = discover(self.fs, self.gpu)
        return self._topology

    def gpu_infos(self):
        """GPU states from the backend, read once per context."""
        if "gpus" not in self._cache:
            self._cache["gpus"] = list(self.gpu.gpus()) if self.gpu is not None else []
        return self._cache["gpus"]

    def cached(self, key: str, fn):
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]


def on_off(flag: bool | None) -> str | None:
    return None if flag is None else ("on" if flag else "off")


def gpus_or_reason(ctx: Context, sid: str, desired: str, *, fresh: bool = False) -> tuple[list[Any], list[Setting]]:
    """The GPUs a per-GPU knob judges, or else the one row (target ``-``) that says why there
    are none: no backend or driver (``unsupported``), the backend failing (``error``).
    ``fresh`` reads the backend again (a verify after apply must see the new state)."""
    backend = ctx.gpu
    if backend is None or backend.name == "none":
        return [], [Setting(sid, "-", None, desired, "unsupported", "no NVIDIA GPU/driver")]
    try:
        infos = list(backend.gpus()) if fresh else ctx.gpu_infos()
    except Exception as exc:  # a backend failure is a row, not a crash
        return [], [Setting(sid, "-", None, desired, "error", f"GPU backend: {exc}")]
    if not infos:
        return [], [Setting(sid, "-", None, desired, "unsupported", "no NVIDIA GPU/driver")]
    return infos, []


def process_table(ctx: Context) -> dict[str, tuple[int, ...]]:
    """``comm`` -> pids (ascending) of every process under ``/proc``, read once per context."""

    def load() -> dict[str, tuple[int, ...]]:
        out: dict[str, list[int]] = {}
        for pid in ctx.fs.pids():
            comm = ctx.fs.read_optional(f"/proc/{pid}/comm")
            if comm:
                out.setdefault(comm, []).append(pid)
        return {k: tuple(sorted(v)) for k, v in out.items()}

    return ctx.cached("process_table", load)




def encode_raw(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def decode_raw(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


class Knob:
    """Base class for file-backed knobs; GPU/NVML knobs override snapshot/apply/restore."""

    family: ClassVar[str] = ""
    # The kernel files (patterns) this knob reads or writes, for documentation and review.
    files: ClassVar[tuple[str, ...]] = ()
    # The setting id of the row reported when the whole family cannot be read.
    error_id: ClassVar[str] = ""
    # The setting ids this knob reports (its rows and journal entries are routed back to it).
    ids: ClassVar[tuple[str, ...]] = ()
    # False for a check that only reads: ``apply`` never plans its rows (a ``drift`` row then
    # carries the remedy in its detail, for a person or another owner to act on).
    writable: ClassVar[bool] = True
    # The files this knob writes (patterns of :func:`path_matches`), and so the only ones a
    # journal entry of its family may name: revert refuses a journal that names any other.
    writes: ClassVar[tuple[str, ...]] = ()
    # The folders it may create for them (an absent original's ``created_dirs``, removed again
    # by revert when empty).
    creates: ClassVar[tuple[str, ...]] = ()

    def entry_problem(self, entry: dict[str, Any]) -> str:
        """What in a journal entry of this family is not something this knob writes ('' when
        nothing): a journal is only ever written by this tool, so a path it would not write
        means the file was made or changed by someone else, and is not believed. The entry's
        fields are already well formed (:func:`gpu_tune.tune.journal.Journal.load`).
        This default is for a knob that journals one file (``path``)."""
        if not self.writable:
            return f"family {self.family!r} only reads: gpu-tune never records an original for it"
        if "files" in entry:
            return f"files: family {self.family!r} records one path, not a list of files"
        path = entry.get("path")
        if path is None:
            return f"path: family {self.family!r} records the file it wrote; none is given"
        problem = self.path_problem("path", path)
        if problem:
            return problem
        for d in entry.get("created_dirs") or []:
            if not any(path_matches(p, d) for p in self.creates) or not path.startswith(d + "/"):
                where = f"folders in {', '.join(self.creates)}" if self.creates else "no folder"
                return (f"created_dirs: {d!r}: family {self.family!r} creates {where}, and only "
                        f"above the file it writes ({path!r})")[:300]
        return ""

    def path_problem(self, key: str, path: str) -> str:
        """Why ``path`` (the entry's ``key``) is not a file this knob writes; '' when it is."""
        if any(path_matches(p, path) for p in self.writes):
            return ""
        where = ", ".join(self.writes) or "no file"
        return f"{key}: {path!r}: family {self.family!r} writes {where}, and nothing else"[:300]

    def owns(self, setting_id: str) -> bool:
        """Does this knob report ``setting_id``?"""
        return setting_id in self.ids or setting_id == self.error_id

    def wanted(self, profile: "Profile") -> bool:
        """Does the profile ask for anything from this knob?"""
        raise NotImplementedError

    def read(self, ctx: Context) -> list[Setting]:
        raise NotImplementedError

    # The value written into the kernel file for ``desired`` (bare word, number...).
    def value_to_write(self, row: Setting) -> str:
        return row.desired

    def planned(self, row: Setting) -> str:
        """What ``apply`` would set a drift row to, in words (for ``apply --dry-run``)."""
        return row.desired

    def snapshot(self, ctx: Context, row: Setting) -> dict[str, Any]:
        """The original of ``row`` as a journal record (JSON-serialisable)."""
        if row.path is None:
            raise HostError(f"{row.id}[{row.target}]: nothing to record")
        raw = ctx.fs.read_bytes(row.path)
        return {"path": row.path, "value": row.current, "raw": encode_raw(raw)}

    def apply(self, ctx: Context, row: Setting) -> None:
        if row.path is None:
            raise HostError(f"{row.id}[{row.target}]: no file to write")
        ctx.fs.write_text(row.path, self.value_to_write(row))

    def current_value(self, ctx: Context, entry: dict[str, Any]) -> str | None:
        """What a journalled target holds now (shown by revert next to the original)."""
        from gpu_tune.host.parse import parse_bracketed

        path = entry.get("path")
        text = ctx.fs.read_optional(path) if path else None
        if text is None:
            return None
        choice = parse_bracketed(text)
        return choice.active if choice.active is not None else " ".join(text.split())

    def unchanged(self, ctx: Context, entry: dict[str, Any]) -> bool:
        """True when every file of a journal entry still holds exactly the recorded original
        (its bytes, or its absence): the tool's write never happened, nothing to restore.
        False when that cannot be told (no recorded bytes, e.g. an NVML setting)."""
        files = entry.get("files") if isinstance(entry.get("files"), list) else [entry]
        if not files:
            return False
        for f in files:
            path = f.get("path")
            if not path:
                return False
            if f.get("absent"):  # and so must the folders made for it
                if any(ctx.fs.exists(p) for p in [path, *(f.get("created_dirs") or [])]):
                    return False
                continue
            try:
                raw = decode_raw(f.get("raw"))
                if raw is None or ctx.fs.read_bytes(path) != raw:
                    return False
            except (HostError, ValueError):
                return False
        return True

    def restore_value(self, entry: dict[str, Any]) -> str:
        """The value to write back into a kernel file for a journal entry."""
        return str(entry["value"])

    def restore(self, ctx: Context, entry: dict[str, Any]) -> None:
        """Write the original back. Kernel files take the bare value; a regular file (a
        fixture, a config file) gets its original bytes back exactly."""
        restore_file(ctx, entry["path"], entry.get("raw"), self.restore_value(entry))


def restore_file(ctx: Context, path: str, raw_b64: str | None, value: str) -> None:
    """Put one journalled file back: the bare ``value`` into a kernel file, the exact original
    bytes into a regular one."""
    raw = decode_raw(raw_b64)
    if raw is not None and not ctx.fs.is_kernel_file(path):
        ctx.fs.write_bytes_exact(path, raw)
    else:
        ctx.fs.write_text(path, value)
