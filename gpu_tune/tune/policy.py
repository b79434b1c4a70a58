"""Profiles: load ``policies/<name>.yaml``, resolve ``include:``, validate every value.

A profile file may include others (``include: _base.yaml`` or a list); included files are merged
first, in order, and the including file wins key by key (mappings merge, other values replace).
Files whose names start with ``_`` are include-only; ``baselines.yaml`` holds probe baselines.
Any problem is an :class:`InputError` naming the file and the key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gpu_tune.errors import InputError
from gpu_tune.host.parse import nesting
from gpu_tune.tune.profile import NAME_RE, Profile

# A profile deeper than this is not a profile (the schema's deepest value is 3 levels down).
MAX_DEPTH = 32
MAX_VALUES = 100_000
# A profile is a few KB; baselines with many pinned fingerprints some tens of KB.
MAX_FILE_BYTES = 1 << 20
# A profile's include graph: the shipped profiles use 2 files; 25 files that each include the
# next twice are 25 files and 48 includes, read once each.
MAX_INCLUDE_FILES = 64
MAX_INCLUDE_EDGES = 1024
NOT_PROFILES = {"baselines"}

# -- loading ----------------------------------------------------------------------------------
def default_policy_dir() -> Path:
    env = os.environ.get("GPU_TUNE_POLICY_DIR")
    if env:
        return Path(env)
    return shipped_policy_dir()


def shipped_policy_dir() -> Path:
    """The profiles that come with gpu-tune (the package's, or the checkout's ``policies/``)."""
    package = Path(__file__).resolve().parents[1]  # gpu_tune/
    installed = package / "policies"  # installed from a wheel: package data
    if (installed / "training.yaml").exists():
        return installed.resolve()  # a checkout's gpu_tune/policies is a link to its policies/
    return package.parent / "policies"  # a source checkout or an editable install


def _decode_error(path: Path, exc: UnicodeDecodeError) -> InputError:
    return InputError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})")


def read_yaml(path: Path, what: str = "policy file") -> Any:
    """Read one YAML document as bad input should be read: a file that is not a regular file,
    larger than :data:`MAX_FILE_BYTES`, not UTF-8, not YAML, with a key given twice or a number
    that reads as something else than it looks (``017``) or has too many digits, nested
    deeper than :data:`MAX_DEPTH` or too deep for the parser, or holding text that cannot be
    encoded, is one :class:`InputError` naming the file. Returns None for a file with no document."""
    import yaml

    from gpu_tune.host.files import read_local_file
    from gpu_tune.strict import BadNumber, BadText, DuplicateKey, check_text, yaml_load

    try:
        text = read_local_file(path, MAX_FILE_BYTES, what).decode("utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: no such {what}") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, expected a {what}") from None
    except UnicodeDecodeError as exc:
        raise _decode_error(path, exc) from None
    except OSError as exc:
        raise InputError(f"{path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # a NUL byte in the path
        raise InputError(f"{path!s:.200}: not a file name: {exc}") from None
    if not text.strip():
        return None
    try:
        data = yaml_load(text)
    except DuplicateKey as exc:
        raise InputError(f"{path}:{exc.second}: {exc}: a key is given once") from None
    except BadNumber as exc:
        raise InputError(f"{path}:{exc.line}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"{path}{where}: malformed YAML: {problem}") from None
    except RecursionError:
        raise InputError(f"{path}: nested too deep to be a {what} (at most {MAX_DEPTH} levels)") from None
    depth, nodes = nesting(data, MAX_DEPTH, MAX_VALUES)
    if depth > MAX_DEPTH:
        raise InputError(f"{path}: nested too deep to be a {what} (at most {MAX_DEPTH} levels)")
    if nodes > MAX_VALUES:
        raise InputError(f"{path}: more than {MAX_VALUES:,} values (counting what aliases repeat): "
                         f"too large to be a {what}")
    try:
        check_text(data)
    except BadText as exc:
        raise InputError(f"{path}: {exc}") from None
    return data


def _yaml_load(path: Path) -> Any:
    data = read_yaml(path)
    if data is None:
        # An empty (or comments-only) file is a mistake, not a profile that changes nothing.
        raise InputError(f"{path}: empty policy file: expected a mapping of settings")
    if not isinstance(data, dict):
        raise InputError(f"{path}: a policy must be a mapping, got {type(data).__name__}")
    return data


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


class _Parsed:
    """The policy files read in one run (``gpu-tune profiles``, or the agent loading every
    profile), each parsed once: 10,000 profiles that include ``training.yaml`` parse it once,
    not 10,000 times. What it hands out is a fresh top-level mapping (callers pop ``include``);
    nested values are shared and never changed in place (:func:`_merge` builds new mappings)."""

    def __init__(self) -> None:
        self._data: dict[Path, dict[str, Any]] = {}

    def load(self, path: Path) -> dict[str, Any]:
        if path not in self._data:
            self._data[path] = _yaml_load(path)
        return dict(self._data[path])


class _Includes:
    """One profile's include graph, each file read and resolved once (a file included along many
    paths is merged from the one result: linear in the number of files), and bounded: at most
    :data:`MAX_INCLUDE_FILES` files and :data:`MAX_INCLUDE_EDGES` includes."""

    def __init__(self, policy_dir: Path, parsed: _Parsed | None = None) -> None:
        self.policy_dir = policy_dir
        self.parsed = parsed or _Parsed()
        self.done: dict[Path, dict[str, Any]] = {}
        self.origins: dict[Path, dict[str, str]] = {}  # per file: policy key -> the file that set it
        self.files = 0
        self.edges = 0

    def resolve(self, path: Path, stack: tuple[Path, ...] = ()) -> dict[str, Any]:
        if path in stack:
            chain = " -> ".join(p.name for p in (*stack, path))
            raise InputError(f"{stack[0]}: include cycle: {chain}")
        if path in self.done:
            return self.done[path]
        self.files += 1
        if self.files > MAX_INCLUDE_FILES:
            raise InputError(f"{stack[0] if stack else path}: includes more than {MAX_INCLUDE_FILES} files: "
                             "too large to be a profile")
        data = self.parsed.load(path)
        inc = data.pop("include", None)
        if inc is None:
            includes: list[Any] = []
        elif isinstance(inc, str):
            includes = [inc]
        elif isinstance(inc, list):
            includes = inc
        else:
            raise InputError(f"{path}: include: expected a file name or a list of them")
        merged: dict[str, Any] = {}
        origins: dict[str, str] = {}
        for name in includes:
            self.edges += 1
            if self.edges > MAX_INCLUDE_EDGES:
                raise InputError(f"{stack[0] if stack else path}: more than {MAX_INCLUDE_EDGES} includes in all: "
                                 "too large to be a profile")
            _check_include_name(path, name, self.policy_dir)
            inc_path = _include_path(path, name, self.policy_dir)
            included = dict(self.resolve(inc_path, (*stack, path)))
            included.pop("name", None)  # a profile is named by its own file, not by what it includes
            merged = _merge(merged, included)
            origins.update(self.origins[inc_path])
        out = _merge(merged, data)
        origins.update(_policy_keys(data, path.name))
        self.done[path] = out
        self.origins[path] = origins
        return out


def _policy_keys(data: dict[str, Any], name: str) -> dict[str, str]:
    """The operator's policy keys one file sets (``checks.gpu.inforom``, ``xid.45``), each with the
    file's name: where the verdict says a weight came from."""
    readiness = data.get("readiness")
    out: dict[str, str] = {}
    if not isinstance(readiness, dict):
        return out
    for section in ("checks", "xid"):
        keys = readiness.get(section)
        if isinstance(keys, dict):
            for k in keys:
                key = str(k).strip()
                out[f"{section}.{int(key) if section == 'xid' and key.isdigit() and len(key) <= 6 else key}"] = name
    return out


def _resolve(path: Path, policy_dir: Path, stack: tuple[Path, ...] = (),
             parsed: _Parsed | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """(the profile's merged mapping, the file each of its policy keys came from)."""
    inc = _Includes(policy_dir, parsed)
    return dict(inc.resolve(path, stack)), inc.origins[path]


def _check_include_name(path: Path, name: Any, policy_dir: Path) -> None:
    """An include names a ``.yaml`` file in the policy folder: no folder, no hidden file, no
    control character (a NUL byte included), at most 255 bytes."""
    ok = (isinstance(name, str) and "/" not in name and not name.startswith(".") and name.endswith(".yaml")
          and name.isprintable() and len(name.encode("utf-8", "surrogatepass")) <= 255)
    if ok:
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            ok = False
    if not ok:
        shown = repr(name)[:120]
        raise InputError(f"{path}: include: {shown} must be a .yaml file name in {policy_dir}")


def _include_path(path: Path, name: str, policy_dir: Path) -> Path:
    """Where ``include: name`` is read from: the policy folder, else the shipped profiles (so a
    profile written for one node, in a folder of its own, can include ``training.yaml``), as tuned
    looks in /etc/tuned before /usr/lib/tuned."""
    for folder in (policy_dir, None):  # the shipped folder is resolved (a realpath) only when it is needed
        candidate = (folder or shipped_policy_dir()) / name
        try:
            if candidate.exists():
                return candidate
        except (OSError, ValueError) as exc:
            raise InputError(f"{path}: include: {name!r}: {getattr(exc, 'strerror', None) or exc}") from None
    raise InputError(f"{path}: include: {name!r}: no such policy file in {policy_dir} or among the shipped profiles")


def _one_line(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith("function-after"))
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "literal_error":
            msg = f"{err.get('input')!r} is not allowed ({msg.split('Input should be ', 1)[-1]})"
        if len(msg) > 200:  # an input echoed back whole could be a whole file
            msg = msg[:200] + "..."
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def check_name(name: str) -> None:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise InputError(f"profile {name!r}: names are lower-case letters, digits, '-' and '_' (no '/' or '..')")


def load_profile(name: str, policy_dir: str | os.PathLike[str] | None = None, *,
                 _parsed: _Parsed | None = None) -> Profile:
    """The profile ``name`` of ``policy_dir`` (default: :func:`default_policy_dir`), its
    includes merged and every value checked; :class:`InputError` naming the file otherwise."""
    check_name(name)
    pdir = Path(policy_dir) if policy_dir else default_policy_dir()
    if not pdir.is_dir():
        raise InputError(f"--policy-dir {pdir}: no such directory")
    path = pdir / f"{name}.yaml"
    try:
        is_file = path.is_file()
    except OSError as exc:  # a folder the user cannot search
        raise InputError(f"--policy-dir {pdir}: {exc.strerror or exc}") from None
    if name.startswith("_") or name in NOT_PROFILES or not is_file:
        known = ", ".join(list_profile_names(pdir)) or "none"
        raise InputError(f"unknown profile {name!r} in {pdir} (known: {known})")
    data, origins = _resolve(path, pdir, (), _parsed)
    data.setdefault("name", name)
    if data["name"] != name:
        raise InputError(f"{path}: name: {data['name']!r} does not match the file name {name!r}")
    try:
        prof = Profile.model_validate(data)
    except ValidationError as exc:
        raise InputError(f"{path}: {_one_line(exc)}") from None
    prof._source, prof._origins = str(path), origins
    return prof


def list_profile_names(policy_dir: str | os.PathLike[str] | None = None) -> list[str]:
    pdir = Path(policy_dir) if policy_dir else default_policy_dir()
    if not pdir.is_dir():
        return []
    return sorted(
        p.stem for p in pdir.glob("*.yaml")
        if not p.name.startswith("_") and p.stem not in NOT_PROFILES and NAME_RE.fullmatch(p.stem)
        and p.is_file()  # a directory or a dangling/looping link is not a profile
    )


def load_all(policy_dir: str | os.PathLike[str] | None = None) -> list[Profile]:
    pdir = Path(policy_dir) if policy_dir else default_policy_dir()
    if not pdir.is_dir():
        raise InputError(f"--policy-dir {pdir}: no such directory")
    parsed = _Parsed()  # an included file shared by many profiles is parsed once
    return [load_profile(n, policy_dir, _parsed=parsed) for n in list_profile_names(policy_dir)]
