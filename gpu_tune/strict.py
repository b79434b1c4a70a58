"""Reading YAML and JSON documents strictly, for every file the project reads (profiles and
their includes, baselines, GPU fixtures, the journal, the probe's saved verdicts).

Both parsers take a key given twice silently (the last one wins): ``{vm.swappiness: 0,
vm.swappiness: 100}`` would apply 100 without a word. Here a repeated key is
:class:`DuplicateKey`, naming the key and the lines of both. YAML through a PyYAML
``SafeLoader`` subclass (merge keys ``<<`` keep their meaning: an explicit key overrides a
merged one); JSON through ``object_pairs_hook``, and then, only when a key was repeated, one scan
of the text with the ``json`` module's own string reader to find both lines.

:func:`check_text` refuses text that cannot be encoded (a lone surrogate from a ``\\ud800``
escape): it would pass every check and fail much later, when printed or sent.
"""

from __future__ import annotations

import json
import re
from typing import Any


class DuplicateKey(ValueError):
    """A mapping gives ``key`` twice: first on line ``first``, again on line ``second`` (1-based;
    0 where a line cannot be told)."""

    def __init__(self, key: Any, first: int, second: int) -> None:
        self.key, self.first, self.second = key, first, second
        lines = f" (lines {first} and {second})" if first and second else ""
        super().__init__(f"key {key!r} given twice{lines}")


class BadNumber(ValueError):
    """A YAML number that would be read as something other than it looks (``017``: octal 15;
    ``1:30``: base 60, 90) or that cannot be read at all (more than :data:`MAX_INT_DIGITS`
    digits); ``line`` is 1-based."""

    def __init__(self, message: str, line: int) -> None:
        self.line = line
        super().__init__(message)


class BadText(ValueError):
    """A string that cannot be encoded as UTF-8; ``where`` names it (``gpus[0].name``)."""

    def __init__(self, where: str, text: str) -> None:
        self.where = where
        shown = text[:40].encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
        super().__init__(f"{where or 'a key'}: {shown!r} is not valid Unicode text (a lone surrogate)")


# -- YAML -------------------------------------------------------------------------------------
_LOADER: Any = None
_MERGE_TAG = "tag:yaml.org,2002:merge"
_INT_TAG = "tag:yaml.org,2002:int"
# Python reads no decimal integer longer than this (``sys.get_int_max_str_digits()``'s default):
# a longer one is refused by name instead of escaping as Python's ValueError.
MAX_INT_DIGITS = 4300
# YAML 1.1 reads ``017`` as octal 15 (``0o17`` is a string there): a leading zero on a number
# that looks decimal is refused, not read as something else.
_LEADING_ZERO = re.compile(r"[-+]?0[0-9_]+")
_MAX_INT_BITS = 14_000  # 2**14000 has 4,215 decimal digits


def _loader() -> Any:
    global _LOADER
    if _LOADER is None:
        import yaml

        class UniqueKeyLoader(yaml.SafeLoader):
            """``SafeLoader`` that refuses a key given twice in one mapping."""

            def _check_unique(self, node: Any) -> None:
                checked = self.__dict__.setdefault("_unique_checked", set())
                if id(node) in checked or not isinstance(node, yaml.MappingNode):
                    return
                checked.add(id(node))
                seen: dict[Any, int] = {}
                for key_node, _ in node.value:
                    if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                        continue  # a merge, or a complex key (the constructor refuses it)
                    key = self.construct_object(key_node)
                    try:
                        first = seen.get(key)
                    except TypeError:
                        continue
                    line = key_node.start_mark.line + 1
                    if first is not None:
                        raise DuplicateKey(key, first, line)
                    seen[key] = line

            # flatten_mapping rewrites a node's pairs with the merged ones: check it before
            def flatten_mapping(self, node: Any) -> None:
                self._check_unique(node)
                super().flatten_mapping(node)

            def construct_mapping(self, node: Any, deep: bool = False) -> Any:
                self._check_unique(node)
                return super().construct_mapping(node, deep=deep)

            def construct_yaml_int(self, node: Any) -> Any:
                text = str(self.construct_scalar(node))
                line = node.start_mark.line + 1
                shown = text if len(text) <= 24 else f"{text[:12]}...{text[-4:]}"
                body = text.lstrip("+-").replace("_", "")
                if _LEADING_ZERO.fullmatch(text):
                    as_octal = f" ({int(text.replace('_', ''), 8)})" if len(body) <= 24 and "8" not in body \
                        and "9" not in body else ""
                    raise BadNumber(f"{shown}: a leading zero makes YAML read an octal number{as_octal}; "
                                    "write it without the zero, or quote it if it is text", line)
                if ":" in text:
                    raise BadNumber(f"{shown}: YAML reads numbers separated by ':' in base 60; "
                                    "quote it if it is text", line)
                if len(body) > MAX_INT_DIGITS and not body.startswith(("0x", "0b")):
                    raise BadNumber(f"{shown}: a number of {len(body)} digits: more than the "
                                    f"{MAX_INT_DIGITS} a number may have", line)
                try:
                    value = super().construct_yaml_int(node)
                except ValueError:
                    raise BadNumber(f"{shown}: not a number", line) from None
                if value.bit_length() > _MAX_INT_BITS:  # 0x... or 0b...: as many decimal digits
                    raise BadNumber(f"{shown}: a number of more than {MAX_INT_DIGITS} digits", line)
                return value

        UniqueKeyLoader.add_constructor(_INT_TAG, UniqueKeyLoader.construct_yaml_int)
        _LOADER = UniqueKeyLoader
    return _LOADER


def yaml_load(text: str) -> Any:
    """One YAML document, as ``yaml.safe_load`` reads it, but a repeated key raises
    :class:`DuplicateKey`, a number that reads as something else than it looks (``017``,
    ``1:30``) or has too many digits :class:`BadNumber` (and parse errors raise
    ``yaml.YAMLError`` as usual)."""
    import yaml

    return yaml.load(text, Loader=_loader())  # noqa: S506 - a SafeLoader subclass


# -- JSON -------------------------------------------------------------------------------------
class _Repeated(Exception):
    pass


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Repeated(k)
        out[k] = v
    return out


_JSON_MARK = re.compile(r'["{}\[\],:]')


def duplicate_json_key(text: str) -> DuplicateKey | None:
    """The first key given twice in one object of ``text`` (valid JSON up to there), with the
    lines of both: the ``json`` module's own string reader (escapes and all) over the text."""
    from json.decoder import scanstring

    stack: list[dict[str, int] | None] = []  # an object's keys -> line, or None for an array
    expect_key = False
    line, counted = 1, 0
    m = _JSON_MARK.search(text)
    while m is not None:
        i = m.start()
        c = text[i]
        if c == '"':
            try:
                s, end = scanstring(text, i + 1, False)
            except ValueError:
                return None
            if expect_key and stack and stack[-1] is not None:
                line += text.count("\n", counted, i)
                counted = i
                keys = stack[-1]
                if s in keys:
                    return DuplicateKey(s, keys[s], line)
                keys[s] = line
                expect_key = False
            m = _JSON_MARK.search(text, end)
            continue
        if c == "{":
            stack.append({})
            expect_key = True
        elif c == "[":
            stack.append(None)
            expect_key = False
        elif c in "}]":
            if stack:
                stack.pop()
            expect_key = False
        elif c == ",":
            expect_key = bool(stack) and stack[-1] is not None
        else:  # ':'
            expect_key = False
        m = _JSON_MARK.search(text, i + 1)
    return None


def json_loads(text: str, **kw: Any) -> Any:
    """``json.loads(text, **kw)``, but a key given twice in one object raises
    :class:`DuplicateKey` with the lines of both."""
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs, **kw)
    except _Repeated as exc:
        found = duplicate_json_key(text)
        raise (found or DuplicateKey(exc.args[0], 0, 0)) from None


# -- text -------------------------------------------------------------------------------------
def check_text(doc: Any, where: str = "") -> None:
    """Raise :class:`BadText` for the first string (key or value) in ``doc`` that cannot be
    encoded as UTF-8. ``doc`` is plain data (dicts, lists, scalars), already bounded in size."""
    todo: list[tuple[str, Any]] = [(where, doc)]
    while todo:
        at, v = todo.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    raise BadText(at, v) from None
        elif isinstance(v, dict):
            for k, x in v.items():
                name = f"{at}.{k}" if at and isinstance(k, str) else (str(k) if not at else f"{at}[{k!r}]")
                if isinstance(k, str):
                    todo.append((at, k))
                todo.append((name, x))
        elif isinstance(v, (list, tuple)):
            todo.extend((f"{at}[{i}]", x) for i, x in enumerate(v))
