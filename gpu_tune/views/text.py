"""Text from outside (host files, profiles, GPU names, the API server), made safe for a terminal.

A sysctl file holding ``\\x1b]0;owned\\x07`` or ``\\x1b[2J`` must not retitle or clear the
terminal of whoever runs ``gpu-tune audit``; a right-to-left override must not reorder a line.
:func:`printable` shows such characters escaped (``\\x1b``, ``\\u202e``) and keeps everything
else, :func:`markup_safe` also escapes rich's markup brackets for strings that rich parses.
JSON output is never passed through here: ``json.dumps`` writes every string exactly (escaped
by JSON's own rules).
"""

from __future__ import annotations

import re

# C0 controls but tab and newline, DEL, C1 controls, the bidirectional formatting characters,
# and lone surrogates (which cannot even be encoded for the terminal).
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
# the same, newline and tab included: for one-line fields (error lines, table titles)
_UNSAFE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    if c in _NAMED:
        return _NAMED[c]
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}"


def printable(text: object, *, one_line: bool = False) -> str:
    """``text`` with terminal control characters escaped (newlines and tabs kept, unless
    ``one_line``)."""
    s = text if isinstance(text, str) else str(text)
    return (_UNSAFE_LINE if one_line else _UNSAFE).sub(_escape, s)


def markup_safe(text: object, *, one_line: bool = False) -> str:
    """:func:`printable`, and rich's markup brackets escaped: for data inside a string that
    rich reads as markup (titles, ``add_row`` strings, ``console.print`` lines)."""
    from rich.markup import escape

    return escape(printable(text, one_line=one_line))
