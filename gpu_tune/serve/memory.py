"""The agent's C heap between passes: glibc's allocator asked to keep less of what a pass freed.

A pass (discover, audit, health) runs its stages in worker threads and makes many short-lived
objects on a big node (224 CPUs, ~1,000 IRQs, ~1,500 settings). glibc gives threads that allocate
arenas of their own (up to 8 per CPU), and keeps what is freed in each for reuse: on the 224-CPU
fixture about 1 MiB of the agent's resident memory was free heap kept that way
(benchmarks/bench_rss.py). So the agent

* :func:`limit_arenas`: at most :data:`ARENAS` arenas (``mallopt(M_ARENA_MAX)``), asked before its
  threads start: a handful of threads, a few allocations each per pass, no contention to speak of;
* :func:`release`: after each pass, ``malloc_trim(0)``: the free pages of every arena go back to
  the kernel (about a millisecond).

Where the C library is not glibc both do nothing (nothing else changes).
"""

from __future__ import annotations

import ctypes
import logging

ARENAS = 2
M_ARENA_MAX = -8  # glibc's malloc.h

log = logging.getLogger("gpu_tune")
_libc: ctypes.CDLL | None = None


def _glibc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(None)
            libc.malloc_trim, libc.mallopt  # noqa: B018 - glibc's, absent elsewhere
        except (OSError, AttributeError):
            return None
        _libc = libc
    return _libc


def limit_arenas(arenas: int = ARENAS) -> bool:
    """At most ``arenas`` malloc arenas for the threads to come; False where that cannot be asked."""
    libc = _glibc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(M_ARENA_MAX, int(arenas)))
    log.debug("malloc arenas limited to %d: %s", arenas, "done" if ok else "refused")
    return ok


def release() -> None:
    """Hand the heap's free pages back to the kernel (glibc; nothing elsewhere)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
