"""Error types that map to the CLI's exit codes (docs/cli.md, "Exit codes")."""

from __future__ import annotations


class GpuTuneError(Exception):
    """Base class. ``exit_code`` is what the CLI returns when this escapes a command."""

    exit_code = 3


class InputError(GpuTuneError):
    """Bad input: unknown profile, malformed policy, bad flag value, unreadable fixture.

    The message is one line naming what is wrong and where. Exit code 2.
    """

    exit_code = 2


class HostError(GpuTuneError):
    """A host file could not be read or written (reported per row, not fatal).

    ``errno`` carries the OS error number when there is one (EIO from a kernel-managed IRQ,
    EINVAL from a governor the driver lacks, EROFS from a read-only disk).
    """

    exit_code = 3

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class NotAFile(HostError):
    """A host file refused for what it is (a FIFO, a device, a socket, a file with another
    name) or for its size: never read whole, never written. Reported like any unreadable file,
    but never taken for a missing one."""


class LockBusy(GpuTuneError):
    """Another gpu-tune process holds the apply/revert lock."""

    exit_code = 1


class UnsupportedWrite(HostError):
    """The kernel refused a write that it never accepts for this target (e.g. EIO on a
    kernel-managed IRQ): the row is ``unsupported``, not a failure of the run."""


class CommandNotRunnable(GpuTuneError):
    """``gpu-tune run``: the command cannot be started. Exit codes follow env(1) and the shells:
    127 when it is not found, 126 when it is found but cannot be executed."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code
