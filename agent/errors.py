"""Error types that map to the CLI's exit codes (CONTRACT §3)."""

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
    """A host file could not be read or written (reported per row, not fatal)."""

    exit_code = 3


class LockBusy(GpuTuneError):
    """Another gpu-tune process holds the apply/revert lock."""

    exit_code = 1


class UnsupportedWrite(HostError):
    """The kernel refused a write that it never accepts for this target (e.g. EIO on a
    kernel-managed IRQ): the row is ``unsupported``, not a failure of the run."""
