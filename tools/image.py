"""Build the gpu-tune image with podman and print what it costs a node to pull.

    python tools/image.py [--flavour cpu|gpu] [--tag TAG] [--python-image IMAGE]
                          [--no-sizes] [--code-change] [--no-cache]

Prints the build time, the image's size unpacked and compressed (each layer gzip -6, as a
registry stores it), the layer table and, with --code-change, the layers and bytes a node pulls
again after a change to the agent's code only (the tree is copied, one agent file touched, the
image built again with the layer cache, and the two images' layer digests compared).

The podman flags are the ones a machine without a Docker engine and with hybrid cgroups needs
(--cgroup-manager cgroupfs, --runtime runc, ulimits a non-CAP_SYS_RESOURCE machine allows); the
build machine's CA bundle and /etc/pip.conf are mounted into the build only when present there,
never copied into the image. Without --python-image: python:3.11-slim-bookworm if podman has it,
else, where mmdebstrap is installed, an equivalent Debian bookworm base built locally
(localhost/debian-py:bookworm-slim), else python:3.11-slim-bookworm pulled from its registry.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BASE = "python:3.11-slim-bookworm"
LOCAL_BASE = "localhost/debian-py:bookworm-slim"
# What python:3.11-slim-bookworm leaves out, left out here too: documentation, manual pages and
# translations (dpkg's path-exclude, kept in the image so later apt-get installs skip them too),
# and apt's package lists.
SLIM_DPKG = ["path-exclude=/usr/share/doc/*", "path-include=/usr/share/doc/*/copyright",
             "path-exclude=/usr/share/man/*", "path-exclude=/usr/share/info/*",
             "path-exclude=/usr/share/locale/*", "path-include=/usr/share/locale/locale.alias",
             "path-exclude=/usr/share/lintian/*"]
# What the build context holds (the .dockerignore allow-list): copied for --code-change.
CONTEXT = ["Dockerfile", ".dockerignore", "pyproject.toml", "README.md", "gpu_tune",
           "policies", "requirements", "data"]
PODMAN = ["podman", "--cgroup-manager", "cgroupfs"]
LIMITS = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=4096:4096"]
HOST_FILES = ["/etc/ssl/certs/ca-certificates.crt", "/etc/pip.conf"]


def runtime_flags() -> list[str]:
    return ["--runtime", "runc"] if shutil.which("runc") else []


def run_flags() -> list[str]:
    """Flags for `podman run` on this kind of machine (the test uses the same)."""
    return runtime_flags() + LIMITS


def podman(*args: str, check: bool = True, capture: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([*PODMAN, *args], check=check, text=True,
                          stdout=subprocess.PIPE if capture else None,
                          stderr=subprocess.PIPE if capture else None)


def image_exists(ref: str) -> bool:
    return podman("image", "exists", ref, check=False).returncode == 0


def mmdebstrap_import(tag: str, suite: str, include: list[str], *, mirrors: list[str] = (),
                      options: list[str] = (), log=sys.stderr) -> float:
    """A Debian rootfs made with mmdebstrap (minbase, the slim dpkg excludes, apt's lists left out)
    and imported into podman as ``tag``; returns the seconds taken. ``options``: more mmdebstrap
    arguments (``--aptopt``, ``--customize-hook``); ``mirrors``: sources lines (default: the suite's)."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-tune-base-") as tmp:
        tar = os.path.join(tmp, "base.tar")
        print(f"building {tag} with mmdebstrap (Debian {suite}: {', '.join(include)})", file=log)
        # merged-usr: /usr merged by mmdebstrap itself, as in python:3.11-slim, instead of
        # Debian's usrmerge package (which pulls Perl, ~50 MB, into the image)
        hooks = [f"--hook-dir={d}" for d in ("/usr/share/mmdebstrap/hooks/merged-usr",) if os.path.isdir(d)
                 and not mirrors]
        subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", *hooks,
                        *[f"--dpkgopt={o}" for o in SLIM_DPKG], "--include=" + ",".join(include), *options,
                        "--customize-hook=rm -rf \"$1\"/var/lib/apt/lists/* \"$1\"/var/cache/apt/*.bin",
                        suite, tar, *mirrors], check=True)
        podman("import", tar, tag)
    return time.monotonic() - t0


def local_base(log=sys.stderr) -> str:
    """localhost/debian-py:bookworm-slim, made with mmdebstrap if podman does not have it yet."""
    if not image_exists(LOCAL_BASE):
        mmdebstrap_import(LOCAL_BASE, "bookworm", ["python3", "python3-venv", "ca-certificates", "python-is-python3"],
                          log=log)
    return LOCAL_BASE


def choose_base(explicit: str | None) -> str:
    if explicit:
        return explicit
    if image_exists(DEFAULT_BASE) or image_exists("docker.io/library/" + DEFAULT_BASE):
        return DEFAULT_BASE
    if shutil.which("mmdebstrap"):
        return local_base()
    return DEFAULT_BASE


def build(context: Path, flavour: str, tag: str, base: str, log_path: Path,
          no_cache: bool = False) -> float:
    """Build; the output goes to log_path. Returns the seconds taken; raises with the log's tail."""
    cmd = [*PODMAN, "build", *runtime_flags(), *LIMITS, "--layers"]
    for f in HOST_FILES:
        if os.path.isfile(f):
            cmd += ["-v", f"{f}:{f}:ro"]
    if no_cache:
        cmd.append("--no-cache")
    cmd += ["--build-arg", f"PYTHON_IMAGE={base}", "--build-arg", f"FLAVOUR={flavour}",
            "-t", tag, str(context)]
    t0 = time.monotonic()
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    took = time.monotonic() - t0
    if rc != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-30:]
        raise RuntimeError(f"podman build failed (exit {rc}); {log_path} ends:\n" + "\n".join(tail))
    return took


def final_stage_steps(dockerfile: Path) -> list[str]:
    """The last stage's layer-making instructions (RUN, COPY, ADD), each on one line."""
    logical, cur = [], ""
    for line in dockerfile.read_text().splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if cur and line.lstrip().startswith("#"):
            continue
        cur += " " + line.strip().rstrip("\\")
        if not line.rstrip().endswith("\\"):
            logical.append(" ".join(cur.split()))
            cur = ""
    steps: list[str] = []
    for ins in logical:
        word = ins.split(" ", 1)[0].upper()
        if word == "FROM":
            steps = []
        elif word in ("RUN", "COPY", "ADD"):
            steps.append(ins.replace("--mount=type=bind,from=agent,source=/wheel,target=/wheel ", ""))
    return steps


def layers(tag: str, base: str | None = None) -> list[dict]:
    """The image's layers, bottom first: diff digest, unpacked bytes, the step that made it."""
    info = json.loads(podman("image", "inspect", tag).stdout)[0]
    diff_ids = info["RootFS"]["Layers"]
    named: dict[int, str] = {}
    if base is not None and image_exists(base):
        n_base = len(json.loads(podman("image", "inspect", base).stdout)[0]["RootFS"]["Layers"])
        steps = final_stage_steps(ROOT / "Dockerfile")
        if n_base + len(steps) == len(diff_ids):
            named = {i: "base image " + base for i in range(n_base)}
            named.update({n_base + k: step for k, step in enumerate(steps)})
    hist = [h for h in json.loads(podman("history", "--format", "json", "--no-trunc", tag).stdout)]
    hist = [h for h in reversed(hist) if h.get("size", 0) or h.get("Size", 0)]
    rows = []
    for i, digest in enumerate(diff_ids):
        h = hist[i] if i < len(hist) and len(hist) == len(diff_ids) else {}
        created = (h.get("createdBy") or h.get("CreatedBy") or "").replace("\n", " ")
        created = created.split("#(nop) ")[-1].strip()
        rows.append({"index": i, "digest": digest, "size": int(h.get("size", h.get("Size", 0)) or 0),
                     "step": named.get(i, " ".join(created.split()))[:72]})
    return rows


SIZE_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpu-tune" / "layer-gzip6.json"


def _gzip_size(blob: str) -> int:
    """gzip -6 bytes of a file (pigz, gzip's parallel twin, where installed: the same deflate
    level, on every core)."""
    tool = ["pigz", "-6", "-c"] if shutil.which("pigz") else ["gzip", "-6", "-c"]
    gz = subprocess.Popen([*tool, blob], stdout=subprocess.PIPE)
    n = 0
    while chunk := gz.stdout.read(1 << 20):
        n += len(chunk)
    gz.wait()
    return n


def compressed_sizes(tag: str, want: set[str] | None = None) -> dict[str, int]:
    """gzip -6 size of each layer tar (or only those in want), keyed by diff digest.

    A layer's diff digest is the SHA-256 of its uncompressed tar, so its gzip -6 size never
    changes: sizes are kept in :data:`SIZE_CACHE`, and only layers not measured before are saved
    and compressed (a code-only change measures one small layer)."""
    try:
        cache = json.loads(SIZE_CACHE.read_text())
    except (OSError, ValueError):
        cache = {}
    ids = json.loads(podman("image", "inspect", tag).stdout)[0]["RootFS"]["Layers"]
    wanted = [d for d in ids if want is None or d in want]
    out = {d: int(cache[d]) for d in wanted if isinstance(cache.get(d), int)}
    if len(out) == len(wanted):
        return out
    with tempfile.TemporaryDirectory(prefix="gpu-tune-save-", dir=os.environ.get("TMPDIR")) as tmp:
        d = os.path.join(tmp, "img")
        podman("save", "--format", "docker-dir", "-o", d, tag)
        manifest = json.loads(Path(d, "manifest.json").read_text())
        config = json.loads(Path(d, manifest["config"]["digest"].split(":")[1]).read_text())
        for layer, diff_id in zip(manifest["layers"], config["rootfs"]["diff_ids"]):
            if diff_id not in wanted or diff_id in out:
                continue
            blob = os.path.join(d, layer["digest"].split(":")[1])
            with open(blob, "rb") as fh:
                magic = fh.read(2)
            out[diff_id] = os.path.getsize(blob) if magic == b"\x1f\x8b" else _gzip_size(blob)
    cache.update(out)
    try:
        SIZE_CACHE.parent.mkdir(parents=True, exist_ok=True)
        tmp_path = SIZE_CACHE.with_suffix(".tmp")
        tmp_path.write_text(json.dumps(cache, indent=0, sort_keys=True))
        os.replace(tmp_path, SIZE_CACHE)
    except OSError:
        pass
    return out


def code_change(tag: str, flavour: str, base: str, log_dir: Path) -> dict:
    """Build the image again from a copy of the context with one agent file touched: the layers a
    node pulls again after a code-only release, and their sizes."""
    with tempfile.TemporaryDirectory(prefix="gpu-tune-ctx-") as tmp:
        ctx = Path(tmp)
        copy_context(ctx)
        with open(ctx / "gpu_tune" / "__init__.py", "a") as fh:
            fh.write(f"\n# code-only change {time.time_ns()}\n")
        tag2 = tag + "-codechange"
        took = build(ctx, flavour, tag2, base, log_dir / f"gpu-tune-image-{flavour}-2.log")
    try:
        rows = layers(tag2, base)
        old = {r["digest"] for r in layers(tag, base)}
        new = [r for r in rows if r["digest"] not in old]
        comp = compressed_sizes(tag2, want={r["digest"] for r in new})
    finally:
        podman("rmi", tag2, check=False)
    return {"seconds": took, "layers": len(rows), "pulled": new, "compressed": comp,
            "unpacked_bytes": sum(r["size"] for r in new), "compressed_bytes": sum(comp.values())}


def mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n < 1e9 else f"{n / 1e9:,.2f} GB"


def print_table(rows: list[dict], comp: dict[str, int], out=sys.stdout) -> None:
    print(f"{'#':>2}  {'unpacked':>11}  {'gzip -6':>11}  layer (step)", file=out)
    for r in rows:
        print(f"{r['index']:>2}  {mb(r['size']):>11}  {mb(comp.get(r['digest'], 0)):>11}  {r['step']}", file=out)


def copy_context(dst: Path) -> None:
    for name in CONTEXT:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif src.exists():
            shutil.copy2(src, dst / name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flavour", choices=["cpu", "gpu"], default="gpu")
    ap.add_argument("--tag", default=None, help="default localhost/gpu-tune:0.1.0-FLAVOUR")
    ap.add_argument("--python-image", default=os.environ.get("PYTHON_IMAGE") or None)
    ap.add_argument("--no-cache", action="store_true", help="build every layer again (cold build time)")
    ap.add_argument("--no-sizes", action="store_true", help="build only")
    ap.add_argument("--code-change", action="store_true",
                    help="also measure what a change to the agent's code only re-pulls")
    ap.add_argument("--log-dir", default=None)
    a = ap.parse_args(argv)
    if shutil.which("podman") is None:
        print("image: podman is not installed (apt-get install podman buildah runc mmdebstrap)",
              file=sys.stderr)
        return 2
    tag = a.tag or f"localhost/gpu-tune:0.1.0-{a.flavour}"
    log_dir = Path(a.log_dir or tempfile.gettempdir())
    base = choose_base(a.python_image)
    print(f"base image: {base}; flavour: {a.flavour}; tag: {tag}")
    log = log_dir / f"gpu-tune-image-{a.flavour}.log"
    took = build(ROOT, a.flavour, tag, base, log, no_cache=a.no_cache)
    print(f"build: {took:.0f} s{' (no cache)' if a.no_cache else ''}; log {log}")
    if a.no_sizes:
        return 0
    rows = layers(tag, base)
    comp = compressed_sizes(tag)
    unpacked = sum(r["size"] for r in rows)
    print(f"size: {mb(unpacked)} unpacked, {mb(sum(comp.values()))} compressed "
          f"(sum of layers, gzip -6), {len(rows)} layers")
    print_table(rows, comp)
    if a.code_change:
        cc = code_change(tag, a.flavour, base, log_dir)
        print(f"code-only change: rebuilt in {cc['seconds']:.0f} s; {cc['layers'] - len(cc['pulled'])} of "
              f"{cc['layers']} layers unchanged; a node pulls {len(cc['pulled'])} layer(s) again: "
              f"{mb(cc['unpacked_bytes'])} unpacked, {mb(cc['compressed_bytes'])} compressed")
        print_table(cc["pulled"], cc["compressed"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
