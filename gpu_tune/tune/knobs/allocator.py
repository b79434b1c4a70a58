"""``allocator.preload``: jemalloc for the host's workloads, written to ``allocator.env``.

With ``allocator.preload: jemalloc`` the knob finds ``libjemalloc.so.2`` in the host's library
folders (under ``--root``) and keeps ``allocator.env_file`` (default ``/etc/gpu-tune/allocator.env``, always in ``/etc/gpu-tune``)
holding ``LD_PRELOAD=<host path>`` and ``MALLOC_CONF=<allocator.malloc_conf>``; a systemd unit
or a container entrypoint sources it. With ``allocator.ld_so_preload: true`` it also keeps the
library listed in the host-wide ``/etc/ld.so.preload`` (row target ``ld.so.preload``).

Two path worlds: the path written into these files is a :data:`HostPath` (as the host's own
processes see it, without the ``--root`` prefix). The library that ``gpu-tune run`` or the probe
preloads into a process started from here is a different thing, found in this process's own
filesystem (:func:`gpu_tune.launch.runner.find_local_jemalloc`).

Files that did not exist are journalled as absent, so revert deletes them; otherwise their
previous bytes come back exactly.
"""

from __future__ import annotations

from typing import Any, NewType

from gpu_tune.errors import HostError
from gpu_tune.tune.model import Setting
from gpu_tune.tune.knobs.base import Context, Knob, decode_raw, encode_raw, path_matches
from gpu_tune.tune.paths import ALLOCATOR_WRITES, ENV_DIR, LD_SO_PRELOAD

# A path as the host's processes see it (no --root prefix). Never opened from this process
# directly: HostFS maps it under the root.
HostPath = NewType("HostPath", str)

JEMALLOC_SONAME = "libjemalloc.so.2"
HOST_LIB_DIRS: tuple[str, ...] = (
    "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu", "/usr/lib64", "/lib64", "/usr/lib", "/lib", "/usr/local/lib",
    "/usr/local/lib64",
)
# gpu-tune's own folder on the host: ``allocator.env_file`` lies in it (the DaemonSet mounts it
# writable; the rest of /etc is read-only there).
def jemalloc_missing(where: str) -> str:
    """The one sentence for a missing jemalloc, said the same way by the audit (the host's
    library folders) and the probe (the folders of the process that runs it)."""
    return (f"jemalloc is not installed {where}: apt-get install libjemalloc2 (Debian/Ubuntu) or "
            "dnf install jemalloc (RHEL/Fedora)")


INSTALL_HINT = jemalloc_missing("on the host")


def find_host_jemalloc(fs) -> HostPath | None:
    """``libjemalloc.so.2`` in the host's library folders (under ``fs.root``), as a host path."""
    for d in HOST_LIB_DIRS:
        p = f"{d}/{JEMALLOC_SONAME}"
        if fs.exists(p) and not fs.is_dir(p):
            return HostPath(p)
    return None


def parse_env_file(text: str) -> dict[str, str]:
    """``KEY=value`` lines (``export`` and quotes allowed, ``#`` comments skipped)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        if line.startswith("export "):
            line = line[len("export "):].strip()
        k, v = line.split("=", 1)
        v = v.strip()
        if len(v) >= 2 and v[0] == v[-1] and v[0] in "\"'":
            v = v[1:-1]
        out[k.strip()] = v
    return out


def _summary(env: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in env.items()) or "empty"


def env_content(lib: HostPath, malloc_conf: str) -> tuple[dict[str, str], bytes]:
    env = {"LD_PRELOAD": str(lib)}
    if malloc_conf:
        env["MALLOC_CONF"] = malloc_conf
    text = "# written by gpu-tune (allocator.preload); source it in the workload's environment\n"
    text += "".join(f"{k}={v}\n" for k, v in env.items())
    return env, text.encode()


class AllocatorKnob(Knob):
    family = "allocator"
    error_id = "allocator.preload"
    ids = ("allocator.preload",)
    files = tuple(f"{d}/{JEMALLOC_SONAME}" for d in HOST_LIB_DIRS) + (f"{ENV_DIR}/allocator.env", LD_SO_PRELOAD)
    writes = ALLOCATOR_WRITES
    creates = (ENV_DIR, f"{ENV_DIR}/**")

    def wanted(self, profile) -> bool:
        return profile.allocator.preload == "jemalloc"

    def read(self, ctx: Context) -> list[Setting]:
        pol = ctx.profile.allocator
        path = pol.env_file
        lib = find_host_jemalloc(ctx.fs)
        rows: list[Setting] = []
        if lib is None:
            # The profile asks for a library the host lacks: not a knob the host does without
            # ("unsupported") but a host that cannot be brought to the profile until it is
            # installed, as the probe (probe.require_jemalloc) says in the same words.
            rows.append(Setting("allocator.preload", "host", self._current(ctx, path)[0], "jemalloc",
                                "error", INSTALL_HINT, path))
            if pol.ld_so_preload:
                rows.append(Setting("allocator.preload", "ld.so.preload", None, "jemalloc", "error",
                                    INSTALL_HINT, LD_SO_PRELOAD))
            return rows
        want_env, data = env_content(lib, pol.malloc_conf)
        current, cur_env, err = self._current(ctx, path)
        if err:
            rows.append(Setting("allocator.preload", "host", None, _summary(want_env), "error", err, path))
        else:
            status = "ok" if cur_env == want_env else "drift"
            rows.append(Setting("allocator.preload", "host", current, _summary(want_env), status,
                                f"library {lib}", path, {"content": data}))
        if pol.ld_so_preload:
            rows.append(self._ld_so_preload_row(ctx, lib))
        return rows

    def _current(self, ctx: Context, path: str) -> tuple[str | None, dict[str, str] | None, str]:
        if not ctx.fs.exists(path):
            return "absent", None, ""
        try:
            env = parse_env_file(ctx.fs.read_text(path))
        except HostError as exc:
            return None, None, str(exc)
        return _summary(env), env, ""

    def current_value(self, ctx: Context, entry: dict[str, Any]) -> str | None:
        path = entry.get("path")
        if not path:
            return None
        if entry.get("target") == "ld.so.preload":
            return super().current_value(ctx, entry) if ctx.fs.exists(path) else "absent"
        return self._current(ctx, path)[0]

    def _ld_so_preload_row(self, ctx: Context, lib: HostPath) -> Setting:
        path = LD_SO_PRELOAD
        if ctx.fs.exists(path):
            try:
                text = ctx.fs.read_text(path)
            except HostError as exc:
                return Setting("allocator.preload", "ld.so.preload", None, str(lib), "error", str(exc), path)
            entries = [w for line in text.splitlines() if not line.strip().startswith("#")
                       for w in line.replace(":", " ").split()]
            current = " ".join(entries) or "empty"
        else:
            text, entries, current = "", [], "absent"
        if str(lib) in entries:
            return Setting("allocator.preload", "ld.so.preload", current, str(lib), "ok",
                           "host-wide: every process on the host preloads it", path)
        new = (text if not text or text.endswith("\n") else text + "\n") + f"{lib}\n"
        return Setting("allocator.preload", "ld.so.preload", current, str(lib), "drift",
                       "host-wide: every process on the host preloads it", path, {"content": new.encode()})

    # -- writing: regular files, created or replaced crash-safely -----------------------------
    def snapshot(self, ctx: Context, row: Setting) -> dict[str, Any]:
        if row.path is None:
            raise HostError(f"{row.id}[{row.target}]: nothing to record")
        if not ctx.fs.exists(row.path):
            # folders apply will create (e.g. /etc/gpu-tune), so revert removes them again: only
            # its own (a folder above them, missing from a bare test root, stays once made)
            made, parent = [], row.path.rsplit("/", 1)[0]
            while parent and parent != "/" and not ctx.fs.exists(parent):
                if any(path_matches(p, parent) for p in self.creates):
                    made.append(parent)
                parent = parent.rsplit("/", 1)[0]
            return {"path": row.path, "value": "absent", "raw": None, "absent": True, "created_dirs": made}
        raw = ctx.fs.read_bytes(row.path)
        return {"path": row.path, "value": row.current, "raw": encode_raw(raw), "absent": False}

    def apply(self, ctx: Context, row: Setting) -> None:
        content = (row.handle or {}).get("content")
        if row.path is None or content is None:
            raise HostError(f"{row.id}[{row.target}]: nothing to write ({row.detail or row.status})")
        ctx.fs.write_file_atomic(row.path, content)

    def restore(self, ctx: Context, entry: dict[str, Any]) -> None:
        path = entry["path"]
        if entry.get("absent"):
            ctx.fs.remove(path)
            for d in entry.get("created_dirs") or []:  # deepest first
                ctx.fs.rmdir_if_empty(d)
            return
        raw = decode_raw(entry.get("raw"))
        if raw is None:
            raise HostError(f"{path}: journal entry holds no original bytes")
        ctx.fs.write_file_atomic(path, raw)
