"""What every command writes to stderr: log lines with the control characters of what they quote
escaped, and one line for an error. Shared by the command line (:mod:`gpu_tune.cli.app`) and the
agent's own process (:mod:`gpu_tune.serve.lean`), which does not import the command line."""

from __future__ import annotations

import logging
import sys

from gpu_tune.views.text import printable

LOG_FORMAT = "gpu-tune: %(levelname)s: %(message)s"
MAX_ERROR = 1000  # characters of an error's text: not a whole file, whatever the input echoed back held


class TerminalFormatter(logging.Formatter):
    """Log lines with the control characters of what they quote escaped (a host file's text
    must not drive the terminal)."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record))


def setup_logging(verbose: bool) -> None:
    """Log to stderr at WARNING (DEBUG with ``verbose``), once per process."""
    if logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(TerminalFormatter(LOG_FORMAT))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, handlers=[handler])


def error_line(exc: BaseException, *, unexpected: bool = False) -> str:
    """``gpu-tune: error: ...``: one line, no control character of the input in it (shown escaped:
    ``\\n``, ``\\x1b``), at most :data:`MAX_ERROR` characters of the error's own text."""
    msg = str(exc) or type(exc).__name__
    if len(msg) > MAX_ERROR:
        msg = msg[:MAX_ERROR] + "..."
    msg = printable(msg, one_line=True)
    if unexpected:
        msg = f"unexpected error: {type(exc).__name__}: {msg} (run with -v for the traceback)"
    return f"gpu-tune: error: {msg}"


def report_error(exc: BaseException, verbose: bool, *, unexpected: bool = False) -> None:
    """The traceback with ``verbose``, then :func:`error_line`, on stderr."""
    if verbose:
        import traceback

        traceback.print_exception(exc, file=sys.stderr)
    print(error_line(exc, unexpected=unexpected), file=sys.stderr)
