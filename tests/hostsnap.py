"""This machine's kernel settings that gpu-tune writes, snapshot and put back: the image tests
and the systemd tests run privileged containers that share the machine's /proc/sys and /sys, and
put back whatever differs afterwards, whatever happened in between."""

from __future__ import annotations

import glob
import os
import re

KERNEL_FILES = ["/proc/sys/kernel/numa_balancing", "/proc/sys/vm/*",
                "/sys/kernel/mm/transparent_hugepage/*",
                "/sys/devices/system/cpu/cpu*/cpufreq/scaling_governor",
                "/sys/devices/system/cpu/cpu*/cpuidle/state*/disable",
                "/proc/irq/*/smp_affinity"]


def snapshot() -> dict[str, bytes]:
    snap = {}
    for pattern in KERNEL_FILES:
        for p in glob.glob(pattern):
            if not os.path.isfile(p):
                continue
            try:
                with open(p, "rb") as fh:
                    snap[p] = fh.read()
            except OSError:
                pass  # write-only (drop_caches) or not readable here
    return snap


def restore(snap: dict[str, bytes]) -> list[str]:
    """Write back every file that differs from the snapshot; return what could not be."""
    failed = []
    for p, data in snapshot_diff(snap).items():
        try:
            with open(p, "wb") as fh:
                fh.write(_writable_form(p, snap[p]))
        except OSError as exc:
            failed.append(f"{p}: {exc}")
    return failed


def _writable_form(path: str, data: bytes) -> bytes:
    m = re.search(rb"\[([^\]]+)\]", data)  # THP files show the choice in brackets
    return m.group(1) if "transparent_hugepage" in path and m else data


def snapshot_diff(snap: dict[str, bytes]) -> dict[str, tuple[bytes, bytes]]:
    now = snapshot()
    return {p: (snap[p], now.get(p)) for p in snap if now.get(p) != snap[p]}
