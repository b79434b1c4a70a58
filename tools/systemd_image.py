"""The images that boot a real systemd for the units' tests (tests/test_systemd_live.py) and
benchmarks/bench_systemd.py: Debian 12 (systemd 252) and Debian 11 (systemd 247, standing for the
older systemd of Ubuntu 22.04 (249) and RHEL 8 (239)), each with systemd as PID 1 and a Python 3.11.

    python tools/systemd_image.py [--no-cache] [--image debian12|debian11 ...]

Prints each image's build time (or that the cache had it), its size and its systemd version.

Each image is made by mmdebstrap (tools/image.py) and tagged with a content key, a hash of how it
is made: the same key is the same image, and a build happens only when the recipe changes (a new
tag; the older tags of that image are removed). Debian 11 has no Python 3.10 or newer of its own:
its image takes bookworm's python3.11 packages (and the C library they need) beside bullseye's
systemd 247, as RHEL 8 has `dnf install python3.11` and Ubuntu 22.04 its python3.10 beside their
older systemd; the thing under test is the systemd.

What the tests must not let a privileged container do to the machine is masked in the image: the
units that write the host's kernel settings, modules, devices or disks (systemd-sysctl,
systemd-modules-load, udev, binfmt, pstore, the random seed), the gettys, and every timer (apt, fstrim,
e2scrub).

The wheels gpu-tune depends on are downloaded once into a folder keyed by pyproject.toml's
dependencies (:func:`wheelhouse`): the tests install from it with ``--no-index``, as an air-gapped
fleet does (docs/systemd.md), into a copy of a venv that already holds them (:func:`seeded_venv`).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPO_NAME = "localhost/gpu-tune-systemd"
# Bumped by hand when something the key does not see changes (mmdebstrap's own behaviour).
RECIPE_VERSION = "1"
MASKED = [
    "systemd-sysctl.service", "systemd-modules-load.service", "systemd-binfmt.service",
    "proc-sys-fs-binfmt_misc.automount", "proc-sys-fs-binfmt_misc.mount",
    "systemd-udevd.service", "systemd-udevd-control.socket", "systemd-udevd-kernel.socket",
    "systemd-udev-trigger.service", "systemd-udev-settle.service", "systemd-hwdb-update.service",
    "systemd-pstore.service", "systemd-random-seed.service", "systemd-timesyncd.service",
    "getty@.service", "serial-getty@.service", "console-getty.service", "container-getty@.service", "getty.target",
    "systemd-firstboot.service", "systemd-remount-fs.service", "sys-kernel-config.mount",
    "sys-kernel-debug.mount", "sys-kernel-tracing.mount", "sys-fs-fuse-connections.mount",
    "e2scrub_reap.service", "fstrim.service",
]
# Masked in a customize hook: the names above, then every timer the packages brought.
MASK_HOOK = ("cd \"$1\"/etc/systemd/system && for u in " + " ".join(MASKED) + "; do ln -sf /dev/null $u; done; "
             "for t in \"$1\"/lib/systemd/system/*.timer \"$1\"/usr/lib/systemd/system/*.timer; do "
             "[ -e \"$t\" ] && ln -sf /dev/null \"$(basename \"$t\")\"; done; true")
DEB = "http://deb.debian.org/debian"


@dataclass(frozen=True)
class Spec:
    name: str
    suite: str
    systemd: str  # the major version the image must have
    include: list[str]
    mirrors: list[str] = field(default_factory=list)
    options: list[str] = field(default_factory=list)

    def args(self) -> dict:
        return {"suite": self.suite, "include": self.include, "mirrors": self.mirrors,
                "options": [*self.options, f"--customize-hook={MASK_HOOK}"]}

    def key(self) -> str:
        doc = json.dumps({"recipe": RECIPE_VERSION, **self.args()}, sort_keys=True)
        return hashlib.sha256(doc.encode()).hexdigest()[:12]

    def tag(self) -> str:
        return f"{REPO_NAME}:{self.name}-{self.key()}"


# libjemalloc2: the profiles preload it (allocator.preload), as docs/systemd.md installs it first
BASE = ["systemd", "systemd-sysv", "dbus", "ca-certificates", "libjemalloc2"]
SPECS = {
    "debian12": Spec("debian12", "bookworm", "252", [*BASE, "python3", "python3-venv"]),
    "debian11": Spec("debian11", "bullseye", "247", BASE,
                     mirrors=[f"deb {DEB} bullseye main", f"deb {DEB} bookworm main"],
                     options=["--aptopt=APT::Default-Release \"bullseye\"",
                              "--aptopt=APT::Install-Recommends \"false\"",
                              "--customize-hook=chroot \"$1\" apt-get install -y -qq -t bookworm python3.11-venv >/dev/null"]),
}


_spec = importlib.util.spec_from_file_location("gpu_tune_tools_image", ROOT / "tools" / "image.py")
ti = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))  # tools/image.py, beside this file
if not hasattr(ti, "podman"):
    _spec.loader.exec_module(ti)


def ensure(spec: Spec, *, no_cache: bool = False, log=sys.stderr) -> tuple[str, float | None]:
    """The image's tag, built if podman does not have it; and the seconds the build took (None:
    the cache had it)."""
    tag = spec.tag()
    if ti.image_exists(tag) and not no_cache:
        return tag, None
    if no_cache:
        ti.podman("rmi", "-f", tag, check=False)
    took = ti.mmdebstrap_import(tag, spec.suite, spec.include, mirrors=spec.mirrors,
                                options=spec.args()["options"], log=log)
    for old in stale_tags(spec):
        ti.podman("rmi", "-f", old, check=False)
    return tag, took


def stale_tags(spec: Spec) -> list[str]:
    out = ti.podman("images", "--format", "{{.Repository}}:{{.Tag}}", REPO_NAME, check=False).stdout.split()
    return [t for t in out if t.startswith(f"{REPO_NAME}:{spec.name}-") and t != spec.tag()]


def size_bytes(tag: str) -> int:
    return int(json.loads(ti.podman("image", "inspect", tag).stdout)[0]["Size"])


def _dependencies() -> list[str]:
    import tomllib

    return list(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])


WHEEL_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpu-tune" / "systemd-wheels"


def wheelhouse(log=sys.stderr) -> tuple[Path, float | None]:
    """A folder with a wheel of every dependency of gpu-tune (no extras) for CPython 3.11 on
    x86_64 Linux, downloaded once per dependency list; and the seconds the download took (None:
    cached)."""
    deps = _dependencies()
    key = hashlib.sha256(json.dumps(["cp311", *deps]).encode()).hexdigest()[:12]
    folder = WHEEL_CACHE / key
    if (folder / ".complete").is_file():
        return folder, None
    t0 = time.monotonic()
    tmp = folder.with_name(key + ".part")
    subprocess.run(["rm", "-rf", str(tmp)], check=True)
    tmp.mkdir(parents=True)
    print(f"downloading the wheels of gpu-tune's dependencies into {folder}", file=log)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version", "3.11",
                        "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64",
                        "--platform", "manylinux_2_17_x86_64", "--implementation", "cp", "-d", str(tmp), *deps],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"pip download failed (exit {r.returncode}): {r.stderr[-2000:]}")
    (tmp / ".complete").write_text("")
    subprocess.run(["rm", "-rf", str(folder)], check=True)
    os.replace(tmp, folder)
    return folder, time.monotonic() - t0


VENV_CACHE = WHEEL_CACHE.with_name("systemd-venv")
VENV = "/opt/gpu-tune"


def seeded_venv(wheels: Path, log=sys.stderr) -> tuple[Path, float | None]:
    """A venv at /opt/gpu-tune holding gpu-tune's dependencies (not gpu-tune), made by the install
    lines of docs/systemd.md (``python3 -m venv``, ``pip install`` from ``wheels``) in the Debian 12
    image, kept in a folder keyed by the wheels and the image: the tests copy it in before they run
    those lines, so that their ``pip install`` has only gpu-tune itself to install (about 30 s of
    installing and byte-compiling the dependencies saved per image). Both images have bookworm's
    Python 3.11 at /usr/bin/python3, so one serves both. Returns the folder and the seconds spent
    making it (None: cached)."""
    spec = SPECS["debian12"]
    key = hashlib.sha256(json.dumps([wheels.name, spec.key(), VENV]).encode()).hexdigest()[:12]
    folder = VENV_CACHE / key
    if (folder / "pyvenv.cfg").is_file() and (folder.parent / f"{key}.complete").is_file():
        return folder, None
    tag, _ = ensure(spec, log=log)
    t0 = time.monotonic()
    subprocess.run(["rm", "-rf", str(folder)], check=True)
    folder.mkdir(parents=True)
    deps = " ".join("'" + d.replace("'", "'\\''") + "'" for d in _dependencies())
    print(f"making the dependencies' venv in {folder}", file=log)
    r = ti.podman("run", "--rm", *ti.run_flags(), "--network", "none", "-e", "PIP_DISABLE_PIP_VERSION_CHECK=1",
                  "-v", f"{wheels}:/wheels:ro", "-v", f"{folder}:{VENV}", tag, "sh", "-ec",
                  f"python3 -m venv {VENV} && {VENV}/bin/pip install -q --no-index --find-links /wheels {deps}",
                  check=False)
    if r.returncode != 0:
        raise RuntimeError(f"the dependencies' venv failed (exit {r.returncode}): {r.stderr[-2000:]}")
    for old in VENV_CACHE.iterdir():
        if old.name != key and not old.name.startswith(key):
            subprocess.run(["rm", "-rf", str(old)], check=False)
    (folder.parent / f"{key}.complete").write_text("")
    return folder, time.monotonic() - t0


def prepare(log=sys.stderr) -> dict[str, float | None]:
    """Every image, the wheels and the dependencies' venv, what is missing made side by side (the
    downloads and dpkg's unpacking overlap): the seconds each took (None: cached)."""
    from concurrent.futures import ThreadPoolExecutor

    def d12_and_venv() -> tuple[float | None, float | None]:
        _, built = ensure(SPECS["debian12"], log=log)
        return built, seeded_venv(wheels.result()[0], log=log)[1]

    with ThreadPoolExecutor(3) as pool:
        wheels = pool.submit(wheelhouse, log)
        d11 = pool.submit(ensure, SPECS["debian11"], log=log)
        d12 = pool.submit(d12_and_venv)
        built12, venv = d12.result()
        return {"debian12": built12, "debian11": d11.result()[1], "wheels": wheels.result()[1], "venv": venv}


def project_wheel(dest: Path) -> Path:
    """This checkout as a wheel (what `pip install gpu-tune` installs), in ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), str(ROOT)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"pip wheel failed (exit {r.returncode}): {r.stderr[-2000:]}")
    (whl,) = dest.glob("gpu_tune-*.whl")
    return whl


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image", action="append", choices=sorted(SPECS), help="default: both")
    ap.add_argument("--no-cache", action="store_true", help="build again (the cold build time)")
    a = ap.parse_args(argv)
    for name in a.image or list(SPECS):
        spec = SPECS[name]
        tag, took = ensure(spec, no_cache=a.no_cache)
        version = ti.podman("run", "--rm", *ti.run_flags(), tag, "systemctl", "--version").stdout.split()[1]
        print(f"{name}: {tag}: {'built in %.0f s' % took if took is not None else 'cached'}; "
              f"{size_bytes(tag) / 1e6:.0f} MB; systemd {version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
