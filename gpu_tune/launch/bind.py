"""Bind this process to CPUs and a NUMA node's memory, then exec a command (numactl's job, for
hosts without numactl): ``python -m gpu_tune.launch.bind --cpus 0-55 [--node 0] -- CMD ARGS...``.

CPU affinity through ``os.sched_setaffinity``; memory through the ``set_mempolicy(MPOL_BIND)``
system call (ctypes, no libnuma needed). Both survive ``execvp``. A failure prints one line on
stderr and exits 2 (bad input) or 127 (command not found), like numactl.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform
import sys

MPOL_BIND = 2
# set_mempolicy syscall numbers by machine
SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237, "ppc64le": 261, "s390x": 270, "riscv64": 237}


def set_membind(node: int) -> None:
    """Bind every future allocation of this process (and what it execs) to ``node``."""
    nr = SYS_SET_MEMPOLICY.get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, f"set_mempolicy: unknown syscall number on {platform.machine()}")
    bits = ctypes.sizeof(ctypes.c_ulong) * 8
    words = node // bits + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // bits] = 1 << (node % bits)
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.syscall.restype = ctypes.c_long
    rc = libc.syscall(ctypes.c_long(nr), ctypes.c_int(MPOL_BIND), mask, ctypes.c_ulong(words * bits + 1))
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"set_mempolicy(MPOL_BIND, node {node}): {os.strerror(e)}")


def main(argv: list[str] | None = None) -> int:
    from gpu_tune.host.parse import ParseError, parse_cpulist

    args = list(sys.argv[1:] if argv is None else argv)
    cpus_text: str | None = None
    node: int | None = None
    cmd: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            cmd = args[i + 1:]
            break
        if a in ("--cpus", "--node") and i + 1 < len(args):
            if a == "--cpus":
                cpus_text = args[i + 1]
            else:
                if not args[i + 1].isdigit():
                    print(f"gpu_tune.launch.bind: --node {args[i + 1]!r}: expected a node number", file=sys.stderr)
                    return 2
                node = int(args[i + 1])
            i += 2
            continue
        print(f"gpu_tune.launch.bind: unexpected argument {a!r} (usage: --cpus LIST [--node K] -- CMD ...)", file=sys.stderr)
        return 2
    if not cmd:
        print("gpu_tune.launch.bind: no command given after --", file=sys.stderr)
        return 2
    try:
        if cpus_text:
            try:
                cpus = parse_cpulist(cpus_text)
            except (ParseError, ValueError) as exc:
                print(f"gpu_tune.launch.bind: --cpus {cpus_text!r}: {exc}", file=sys.stderr)
                return 2
            os.sched_setaffinity(0, cpus)
        if node is not None:
            set_membind(node)
    except OSError as exc:
        print(f"gpu_tune.launch.bind: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        os.execvp(cmd[0], cmd)
    except FileNotFoundError:
        print(f"gpu_tune.launch.bind: {cmd[0]}: command not found", file=sys.stderr)
        return 127
    except OSError as exc:
        print(f"gpu_tune.launch.bind: {cmd[0]}: {exc.strerror or exc}", file=sys.stderr)
        return 126
    return 0  # pragma: no cover - execvp does not return


if __name__ == "__main__":
    sys.exit(main())
