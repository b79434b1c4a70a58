"""Everything a test cluster leaves on the machine, recorded before it is made, and removed.

A :class:`Ledger` is one JSON file per run under :func:`ledger_root` naming what the run made:
processes (pid and start time, so a reused pid is never killed), cgroup folders, mount
points under its own folders, a network namespace, files and folders, and the host's kernel
settings as they were. Each entry is written *before* the thing is made, so a run killed at any
point leaves a record. :meth:`Ledger.clean` undoes all of it, in order, tolerating what is
already gone; :func:`janitor` does the same for the ledgers of runs whose process is dead (a
run killed with SIGKILL, a machine that lost power), at the start of the next run.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterable

CGROUP_ROOT = Path("/sys/fs/cgroup")


def ledger_root() -> Path:
    if os.geteuid() == 0:
        return Path("/run/gpu-tune-realkube")
    return Path(os.path.expanduser("~")) / ".cache" / "gpu-tune" / "kube" / "run"


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def alive(pid: int, started: str | None) -> bool:
    """The process ``pid`` (started at ``started``) runs: not gone, not a zombie, not a reused pid."""
    now = start_time(pid)
    return now is not None and (started is None or now == started) and not _zombie(pid)


def kill_tree(pid: int, started: str | None, *, grace: float = 10.0) -> None:
    """TERM the process group led by ``pid`` (if it is still the same process), then KILL."""
    if not alive(pid, started):
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        except PermissionError:
            os.kill(pid, sig)
        t0 = time.monotonic()
        while time.monotonic() - t0 < wait:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = 0
            if done or not alive(pid, started) or _zombie(pid):
                return
            time.sleep(0.05)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def cgroup_mounts(mountinfo: str | None = None) -> dict[Path, str]:
    """Every cgroup hierarchy mounted under ``/sys/fs/cgroup``: its root folder and its type
    (``cgroup`` for v1, ``cgroup2``), read from ``/proc/self/mountinfo`` (or ``mountinfo``, its
    text). cgroup v1: one per controller mount (``cpu``, ``memory``, ``pids``, ``name=systemd``
    ...); hybrid: those and the v2 tree (``/sys/fs/cgroup/unified``); v2 alone: ``/sys/fs/cgroup``
    itself. (Listing the folders under ``/sys/fs/cgroup`` instead would, on v2, take its child
    cgroups for hierarchies.)"""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return {}
    base = str(CGROUP_ROOT)
    found: dict[Path, str] = {}
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields = head.split()
        if not sep or len(fields) < 5 or not tail.split():
            continue
        fstype = tail.split()[0]
        root, mount_point = fields[3], fields[4].replace("\\040", " ")
        # a bind of a sub-cgroup (root other than /) is not a hierarchy's root
        if fstype in ("cgroup", "cgroup2") and root == "/" and \
                (mount_point == base or mount_point.startswith(base + "/")):
            found[Path(mount_point)] = fstype
    return dict(sorted(found.items()))


def cgroup_roots(mountinfo: str | None = None) -> list[Path]:
    """The root folders of :func:`cgroup_mounts`."""
    return list(cgroup_mounts(mountinfo))


def cgroup_layout(mountinfo: str | None = None) -> str:
    """``v1``, ``hybrid`` (v1 controllers and a v2 tree beside them), ``v2`` or ``none``."""
    kinds = set(cgroup_mounts(mountinfo).values())
    if kinds == {"cgroup", "cgroup2"}:
        return "hybrid"
    return "v2" if kinds == {"cgroup2"} else ("v1" if kinds else "none")


def cgroup_dirs(rel: str, roots: list[Path] | None = None) -> list[Path]:
    """``rel`` (a cgroup path such as ``gtk-123``) under every mounted hierarchy, where it exists."""
    return [d for d in ((r / rel.strip("/")) for r in (cgroup_roots() if roots is None else roots)) if d.is_dir()]


def make_cgroup(rel: str, roots: list[Path] | None = None) -> list[Path]:
    """Create the cgroup ``rel`` in every mounted hierarchy (v1: each controller's; v2: the one
    tree, where the kubelet enables the controllers it needs below it); returns the folders."""
    made = []
    for r in (cgroup_roots() if roots is None else roots):
        if (r / "cgroup.procs").exists():
            d = r / rel.strip("/")
            d.mkdir(exist_ok=True)
            made.append(d)
    return made


def folders_under(d: Path) -> list[Path]:
    """``d`` and every folder below it, as they are while the walk passes: a folder that another
    process removes meanwhile (the kubelet and containerd tear down a pod's cgroups while a test
    ends) is passed over, never an error. (``Path.rglob`` raises FileNotFoundError when a folder it
    listed is gone by the time it looks inside; ``os.walk`` hands that error to ``onerror``,
    which it ignores by default.)"""
    return [Path(top) for top, _, _ in os.walk(d)]


def files_under(d: Path) -> list[Path]:
    """Every file below ``d`` (symbolic links included, not followed), as :func:`folders_under`
    finds them: what vanishes while it walks is passed over."""
    out = []
    for top, dirs, names in os.walk(d):
        out += [Path(top, n) for n in names]
        out += [Path(top, n) for n in dirs if os.path.islink(os.path.join(top, n))]  # not walked into
    return out


def cgroup_pids(rel: str, roots: list[Path] | None = None) -> set[int]:
    """Every process in the cgroup ``rel`` and below it, in any hierarchy (a child cgroup removed
    while it is read is passed over: its processes are gone with it)."""
    pids: set[int] = set()
    for d in cgroup_dirs(rel, roots):
        for folder in folders_under(d):
            try:
                pids.update(int(x) for x in (folder / "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                pass
    return pids


def kill_cgroup(rel: str, timeout: float = 20.0, roots: list[Path] | None = None) -> None:
    """KILL every process in the cgroup ``rel`` (every hierarchy, every level) until none is
    left, then remove its folders deepest first. On v2, ``cgroup.kill`` first (Linux 5.14+)."""
    roots = cgroup_roots() if roots is None else roots
    for d in cgroup_dirs(rel, roots):
        kill = d / "cgroup.kill"
        if kill.exists():
            try:
                kill.write_text("1")
            except OSError:
                pass
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        pids = cgroup_pids(rel, roots)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    for d in cgroup_dirs(rel, roots):
        rmdir_tree(d)


def rmdir_tree(d: Path) -> None:
    """Remove the empty folders of a cgroup tree, deepest first; a folder the kubelet or containerd
    removes meanwhile (listed, gone before it is read) is passed over."""
    for top, dirs, _ in os.walk(d, topdown=False):
        for name in dirs:
            _rmdir(Path(top, name))
    _rmdir(d)


def _rmdir(d: Path) -> None:
    for _ in range(10):
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)


def kill_matching(netns_inodes: Iterable[int], marks: Iterable[str], timeout: float = 10.0) -> None:
    """KILL every process in one of the network namespaces ``netns_inodes`` or whose command line
    holds one of ``marks``, until none is left."""
    nets = {f"net:[{i}]" for i in netns_inodes}
    marks = [m.encode() for m in marks if m]
    if not nets and not marks:
        return
    me = os.getpid()
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        found = []
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) == me:
                continue
            try:
                hit = nets and os.readlink(f"/proc/{d}/ns/net") in nets
                if not hit and marks:
                    cmd = Path(f"/proc/{d}/cmdline").read_bytes()
                    hit = any(m in cmd for m in marks)
            except OSError:
                continue
            if hit:
                found.append(int(d))
        if not found:
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def mounts_under(prefixes: Iterable[str]) -> list[str]:
    """Mount points at or below any of ``prefixes``, deepest first."""
    prefixes = [p.rstrip("/") for p in prefixes if p]
    found = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        mp = line.split()[4].replace("\\040", " ")
        if any(mp == p or mp.startswith(p + "/") for p in prefixes):
            found.append(mp)
    return sorted(set(found), key=lambda m: -m.count("/"))


def unmount_under(prefixes: Iterable[str]) -> None:
    prefixes = list(prefixes)
    for _ in range(5):
        mps = mounts_under(prefixes)
        if not mps:
            return
        for mp in mps:
            subprocess.run(["umount", "-l", mp], capture_output=True)


def delete_netns(name: str) -> None:
    if name and os.path.exists(f"/run/netns/{name}"):
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def write_back(path: str, data: bytes) -> str | None:
    """Write a kernel file back as it read (THP's ``[choice]`` as the bare word)."""
    m = re.search(rb"\[([^\]]+)\]", data)
    value = m.group(1) if m and "transparent_hugepage" in path else data
    try:
        with open(path, "wb") as fh:
            fh.write(value)
    except OSError as exc:
        return f"{path}: {exc}"
    return None


def restore_files(saved: dict[str, str | None]) -> list[str]:
    """Put back files saved as base64 (None: the file did not exist: remove it)."""
    failed = []
    for path, b64 in saved.items():
        try:
            if b64 is None:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                elif os.path.lexists(path):
                    os.unlink(path)
                continue
            data = base64.b64decode(b64)
            try:
                with open(path, "rb") as fh:
                    if fh.read() == data:
                        continue
            except OSError:
                pass
            if path.startswith(("/proc/", "/sys/")):
                err = write_back(path, data)
                if err:
                    failed.append(err)
            else:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                Path(path).write_bytes(data)
        except OSError as exc:
            failed.append(f"{path}: {exc}")
    return failed


class Ledger:
    """What one run made. ``note(kind, value)`` before making it; ``clean()`` at the end."""

    def __init__(self, name: str, root: Path | None = None) -> None:
        self.root = root or ledger_root()
        self.root.mkdir(parents=True, exist_ok=True)
        self.path = self.root / f"{name}.json"
        self.doc: dict[str, Any] = {"owner": os.getpid(), "owner_started": start_time(os.getpid()),
                                    "boot_id": boot_id(), "procs": [], "cgroups": [], "mount_roots": [],
                                    "netns": [], "paths": [], "host_files": {}, "result_prefixes": [],
                                    "keep_dirs": [], "netns_inodes": [], "cmdline_marks": []}
        self._save()

    @classmethod
    def load(cls, path: Path) -> "Ledger":
        self = cls.__new__(cls)
        self.root, self.path = path.parent, path
        self.doc = json.loads(path.read_text())
        return self

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc))
        os.replace(tmp, self.path)

    def note(self, kind: str, value: Any) -> None:
        if value not in self.doc[kind]:
            self.doc[kind].append(value)
            self._save()

    def note_proc(self, pid: int, what: str) -> None:
        self.note("procs", {"pid": pid, "started": start_time(pid), "what": what})

    def save_host_files(self, paths: Iterable[str]) -> None:
        """Record the bytes of ``paths`` (None where absent) unless recorded already."""
        saved = self.doc["host_files"]
        for p in paths:
            if p in saved:
                continue
            try:
                with open(p, "rb") as fh:
                    saved[p] = base64.b64encode(fh.read()).decode()
            except FileNotFoundError:
                saved[p] = None
            except OSError:
                continue  # write-only or unreadable: nothing to put back
        self._save()

    def owner_alive(self) -> bool:
        return self.doc.get("boot_id") == boot_id() and alive(self.doc["owner"], self.doc.get("owner_started"))

    def clean(self) -> list[str]:
        """Undo everything recorded, last made first; returns what could not be undone."""
        problems: list[str] = []
        same_boot = self.doc.get("boot_id") == boot_id()
        if same_boot:
            for p in reversed(self.doc["procs"]):
                kill_tree(p["pid"], p.get("started"), grace=p.get("grace", 10.0))
            for cg in self.doc["cgroups"]:
                kill_cgroup(cg)
            # what daemonized out of the process groups (containerd's shims): by the network
            # namespace it was started in, or by a mark in its command line
            kill_matching(self.doc.get("netns_inodes", []), self.doc.get("cmdline_marks", []))
        unmount_under(self.doc["mount_roots"])
        for ns in self.doc["netns"]:
            delete_netns(ns)
        for prefix in self.doc["result_prefixes"]:
            folder, stem = os.path.split(prefix)
            if os.path.isdir(folder):
                for f in os.listdir(folder):
                    if f.startswith(stem):
                        try:
                            os.unlink(os.path.join(folder, f))
                        except OSError:
                            pass
        for path in reversed(self.doc["paths"]):
            if os.path.isdir(path) and not os.path.islink(path):
                if mounts_under([path]):
                    problems.append(f"{path}: still has mounts, not removed")
                    continue
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.lexists(path):
                try:
                    os.unlink(path)
                except OSError as exc:
                    problems.append(f"{path}: {exc}")
        saved = self.doc["host_files"]
        for d in self.doc.get("keep_dirs", []):  # folders that were there: remove what was added
            found = folders_under(Path(d))[1:] + files_under(Path(d)) if os.path.isdir(d) else []
            for p in sorted(found, key=lambda p: -len(p.parts)):
                if p.is_dir() and not p.is_symlink():
                    if not any(k.startswith(str(p) + "/") for k in saved):
                        shutil.rmtree(p, ignore_errors=True)
                elif str(p) not in saved:
                    p.unlink(missing_ok=True)
        problems += restore_files(saved)
        if not problems:
            self.path.unlink(missing_ok=True)
        else:
            self._save()
        return problems


def janitor(root: Path | None = None) -> list[str]:
    """Clean the leftovers of every earlier run whose process is gone; returns a line for each."""
    root = root or ledger_root()
    done = []
    if not root.is_dir():
        return done
    for path in sorted(root.glob("*.json")):
        try:
            ledger = Ledger.load(path)
        except (OSError, ValueError):
            continue
        if ledger.owner_alive():
            continue
        problems = ledger.clean()
        done.append(f"{path.name}: cleaned" + (f" ({'; '.join(problems)})" if problems else ""))
    return done
