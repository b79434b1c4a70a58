"""The host paths gpu-tune may write, as rules both the profile model and the knobs read (so the
profile model never imports a knob): plain absolute paths, patterns over them, and gpu-tune's own
folder on the host."""

from __future__ import annotations

from fnmatch import fnmatchcase

ENV_DIR = "/etc/gpu-tune"  # gpu-tune's own folder on the host (the allocator's environment file)
LD_SO_PRELOAD = "/etc/ld.so.preload"
ALLOCATOR_WRITES = (f"{ENV_DIR}/**", LD_SO_PRELOAD)  # the only files the allocator knob writes


def clean_path(path: object) -> bool:
    """An absolute path written plainly: no empty, ``.`` or ``..`` component, no NUL."""
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        return False
    return all(part not in ("", ".", "..") for part in path[1:].split("/"))


def path_matches(pattern: str, path: str) -> bool:
    """Whether the absolute ``path`` is one that ``pattern`` names: component by component,
    ``*``, ``?`` and ``[...]`` within one component (:func:`fnmatch.fnmatchcase`), ``**`` for one
    or more components. A path that is not :func:`clean_path` matches nothing."""
    if not clean_path(path):
        return False
    want, have = pattern.strip("/").split("/"), path.strip("/").split("/")

    def match(i: int, j: int) -> bool:
        if i == len(want):
            return j == len(have)
        if want[i] == "**":
            return any(match(i + 1, k) for k in range(j + 1, len(have) + 1))
        return j < len(have) and fnmatchcase(have[j], want[i]) and match(i + 1, j + 1)

    return match(0, 0)
