"""Where the Kubernetes server binaries come from, and the cache they are unpacked into.

``KUBE_BIN_DIR`` names a folder holding either the plain binaries (``kube-apiserver``,
``kube-controller-manager``, ``kube-scheduler``, ``kubelet``, as the ``kubernetes/server/bin``
folder of the official ``kubernetes-server-linux-amd64.tar.gz``) or zstd-compressed ones
(``kube-apiserver.zst`` ...) with a ``SHA256SUMS`` of the uncompressed files. Default: the
``shared/kube`` folder beside the clone (``<repo>/../shared/kube``) when it exists.

Compressed binaries are unpacked once into ``~/.cache/gpu-tune/kube/<version>/`` (override:
``KUBE_CACHE_DIR``), checked against ``SHA256SUMS``, and reused while their sums match: the
source folder may be read-only.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

VERSION = "v1.36.2"
COMPONENTS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet")
REPO = Path(__file__).resolve().parents[2]
DOWNLOAD = (f"https://dl.k8s.io/{VERSION}/kubernetes-server-linux-amd64.tar.gz "
            "(the official server release; its kubernetes/server/bin/ holds the four binaries)")


class Missing(RuntimeError):
    """The binaries (or a tool the harness needs) are not here; the message says how to get them."""


def source_dir() -> Path | None:
    env = os.environ.get("KUBE_BIN_DIR")
    if env:
        return Path(env)
    default = REPO.parent / "shared" / "kube"
    return default if default.is_dir() else None


def cache_dir() -> Path:
    base = os.environ.get("KUBE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "gpu-tune", "kube")
    return Path(base) / VERSION


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _sums(folder: Path) -> dict[str, str]:
    f = folder / "SHA256SUMS"
    if not f.is_file():
        return {}
    out = {}
    for line in f.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            out[parts[1].lstrip("*")] = parts[0]
    return out


def _missing(what: str) -> Missing:
    where = f"KUBE_BIN_DIR={os.environ['KUBE_BIN_DIR']}" if os.environ.get("KUBE_BIN_DIR") else \
        f"KUBE_BIN_DIR is unset and {REPO.parent / 'shared' / 'kube'} does not exist"
    return Missing(f"Kubernetes {VERSION} server binaries not found ({what}; {where}): download {DOWNLOAD}, "
                   f"unpack it and set KUBE_BIN_DIR to its kubernetes/server/bin folder")


def binaries(components: tuple[str, ...] = COMPONENTS) -> dict[str, Path]:
    """Executable paths of ``components``; raises :class:`Missing` saying what to download."""
    src = source_dir()
    if src is None or not src.is_dir():
        raise _missing("no folder")
    sums = _sums(src)
    out: dict[str, Path] = {}
    for name in components:
        plain, packed = src / name, src / f"{name}.zst"
        if plain.is_file() and os.access(plain, os.X_OK):
            out[name] = plain
        elif packed.is_file():
            out[name] = _unpacked(packed, name, sums.get(name))
        else:
            raise _missing(f"no {name} or {name}.zst in {src}")
    return out


def _unpacked(packed: Path, name: str, want: str | None) -> Path:
    target = cache_dir() / name
    if target.is_file() and (want is None or _sha256(target) == want):
        return target
    if shutil.which("zstd") is None:
        raise Missing(f"{packed} is zstd-compressed and zstd is not installed (apt-get install zstd)")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{name}-")
    os.close(fd)
    try:
        subprocess.run(["zstd", "-q", "-f", "-d", "-o", tmp, str(packed)], check=True, capture_output=True)
        got = _sha256(Path(tmp))
        if want is not None and got != want:
            raise Missing(f"{packed}: unpacked sha256 {got} is not SHA256SUMS' {want}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic: a concurrent run never sees half a binary
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def pause_image_tar() -> Path | None:
    """A docker-archive of the pod sandbox image (``pause-*.tar``) beside the binaries, if any."""
    src = source_dir()
    if src is None:
        return None
    found = sorted(src.glob("pause-*.tar"))
    return found[-1] if found else None


def tool(name: str, package: str) -> str:
    path = shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.path.exists(p)), None)
    if not path:
        raise Missing(f"{name} is not installed (Debian package {package}; `make test` installs it when root)")
    return path
