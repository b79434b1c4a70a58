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
        return installed
    return package.parent / "policies"  # a source checkout or an editable install


def _decode_error(path: Path, exc: UnicodeDecodeError) -> InputError:
    return InputError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})")


def read_yaml(path: Path, what: str = "policy file") -> Any:
    """Read one YAML document as bad input should be read: a file that is not UTF-8, not YAML,
    nested deeper than :data:`MAX_DEPTH` or too deep for the parser is one :class:`InputError`
    naming the file. Returns None for a file with no document."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: no such {what}") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, expected a {what}") from None
    except UnicodeDecodeError as exc:
        raise _decode_error(path, exc) from None
    except OSError as exc:
        raise InputError(f"{path}: {exc.strerror}") from None
    if not text.strip():
        return None
    try:
        data = yaml.safe_load(text)
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


def _resolve(path: Path, policy_dir: Path, stack: tuple[Path, ...]) -> dict[str, Any]:
    if path in stack:
        chain = " -> ".join(p.name for p in (*stack, path))
        raise InputError(f"{stack[0]}: include cycle: {chain}")
    data = _yaml_load(path)
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
    for name in includes:
        if not isinstance(name, str) or "/" in name or name.startswith(".") or not name.endswith(".yaml"):
            raise InputError(f"{path}: include: {name!r} must be a .yaml file name in {policy_dir}")
        included = _resolve(_include_path(path, name, policy_dir), policy_dir, (*stack, path))
        included.pop("name", None)  # a profile is named by its own file, not by what it includes
        merged = _merge(merged, included)
    return _merge(merged, data)


def _include_path(path: Path, name: str, policy_dir: Path) -> Path:
    """Where ``include: name`` is read from: the policy folder, else the shipped profiles (so a
    profile written for one node, in a folder of its own, can include ``training.yaml``), as tuned
    looks in /etc/tuned before /usr/lib/tuned."""
    own = policy_dir / name
    if own.exists():
        return own
    shipped = shipped_policy_dir() / name
    if shipped.exists():
        return shipped
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


def load_profile(name: str, policy_dir: str | os.PathLike[str] | None = None) -> Profile:
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
    data = _resolve(path, pdir, ())
    data.setdefault("name", name)
    if data["name"] != name:
        raise InputError(f"{path}: name: {data['name']!r} does not match the file name {name!r}")
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise InputError(f"{path}: {_one_line(exc)}") from None


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
    return [load_profile(n, policy_dir) for n in list_profile_names(policy_dir)]
