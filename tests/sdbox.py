"""A container booting systemd as PID 1 from one of tools/systemd_image.py's images, with gpu-tune
installed by docs/systemd.md's lines (:func:`boot_installed`): what tests/test_systemd_live.py and
benchmarks/bench_systemd.py drive through ``podman exec`` and tests/sdtool.py.

The container is privileged (systemd applies ProtectSystem= and DeviceAllow= only there) and so
shares this machine's /proc/sys and /sys: :func:`boot_installed` snapshots the kernel settings
gpu-tune writes before it starts the container and, on the way out, removes the container and puts
back whatever differs (tests/hostsnap.py), whatever happened in between. Run it under the lock of
this machine (``flock /tmp/gpu-tune-cluster.lock``), as every test that writes its settings.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import subprocess

from tests import hostsnap

ROOT = Path(__file__).resolve().parent.parent
TOOL = "/usr/local/lib/gpu-tune-test/sdtool.py"
URL = "http://127.0.0.1:9410"


def _systemd_image():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_tune_tools_systemd_image", ROOT / "tools" / "systemd_image.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


sdi = _systemd_image()


def install_lines(package: str) -> list[str]:
    """docs/systemd.md's install block, from ``PYTHON=`` to ``enable --now``, as root, with
    ``package`` in place of ``'gpu-tune[gpu]'``."""
    text = (ROOT / "docs" / "systemd.md").read_text()
    block = text.split("## Install", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    lines = [ln.split("  #", 1)[0].strip() for ln in block.splitlines() if ln.strip()]
    first = next(i for i, ln in enumerate(lines) if ln.startswith("PYTHON="))
    last = next(i for i, ln in enumerate(lines) if "enable --now" in ln)
    out = [ln.removeprefix("sudo ").replace(" sudo ", " ") for ln in lines[first:last + 1]]
    assert sum("'gpu-tune[gpu]'" in ln for ln in out) == 1, out
    return [ln.replace("'gpu-tune[gpu]'", package) for ln in out]


class Box:
    """One container booting systemd."""

    def __init__(self, name: str, spec) -> None:
        self.name, self.spec = name, spec

    def run(self, *argv: str, check: bool = True, timeout: float = 300, input: str | None = None):
        r = subprocess.run([*sdi.ti.PODMAN, "exec", "-i", "-e", "PIP_DISABLE_PIP_VERSION_CHECK=1", self.name, *argv],
                           capture_output=True, text=True, timeout=timeout, input=input)
        if check and r.returncode != 0:
            raise AssertionError(f"{self.spec.name}: {' '.join(argv)[:300]} exited {r.returncode}:\n"
                                 f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        return r

    def sh(self, script: str, check: bool = True, timeout: float = 300):
        return self.run("sh", "-ec", script, check=check, timeout=timeout)

    def tool(self, *args: str) -> dict:
        r = self.run("python3", TOOL, *args, check=False)
        assert r.stdout.strip(), f"sdtool {args}: {r.stderr[-2000:]}"
        return json.loads(r.stdout.strip().splitlines()[-1])

    def write(self, path: str, text: str) -> None:
        self.run("sh", "-c", f"mkdir -p \"$(dirname {path})\" && cat > {path}", input=text)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.run("systemctl", "show", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str) -> list[str]:
        """The unit's lines since its last start (its latest invocation)."""
        inv = self.show(unit, "InvocationID")["InvocationID"]
        return self.run("journalctl", "--no-pager", "-o", "cat", f"_SYSTEMD_INVOCATION_ID={inv}").stdout.splitlines()

    def get(self, path: str) -> dict:
        return self.tool("get", URL + path)

    def configure(self, text: str | None) -> None:
        """/etc/default/gpu-tune (None: removed), and every unit's failed state cleared."""
        if text is None:
            self.run("rm", "-f", "/etc/default/gpu-tune")
        else:
            self.write("/etc/default/gpu-tune", text)
        self.run("systemctl", "reset-failed", check=False)

    def until(self, what: str, fn, deadline_s: float = 180.0):
        t0 = time.monotonic()
        while True:
            got = fn()
            if got:
                return got
            assert time.monotonic() - t0 < deadline_s, f"{self.spec.name}: {what}: not within {deadline_s:.0f} s"
            time.sleep(0.2)

    def boot(self) -> float:
        """Wait until systemd has booted (the condition: `is-system-running --wait` answers), then
        make the GPU device nodes (major 195: no driver here, so an allowed open is ENXIO)."""
        t0 = time.monotonic()
        seen: list[str] = []

        def answered() -> str | None:
            # "offline" is also what systemctl prints before PID 1 has made /run/systemd/system (sd_booted()
            # false: a `podman exec` can come that early), and "unknown" while the bus is not up: not yet answers.
            seen.append(self.run("systemctl", "is-system-running", "--wait", check=False).stdout.strip())
            return seen[-1] if seen[-1] not in ("", "offline", "unknown") else None

        try:
            state = self.until("systemd answering", answered)
        except AssertionError as e:
            raise AssertionError(f"{e}; the last answers: {seen[-5:]}") from None
        took = time.monotonic() - t0
        assert state in ("running", "degraded"), state
        failed = self.run("systemctl", "--failed", "--no-legend", "--plain").stdout.split()
        assert not [u for u in failed if u.endswith((".service", ".mount", ".socket")) and not u.startswith("gpu-tune")], \
            f"{self.spec.name}: units failed at boot: {failed}"
        self.sh("[ -e /dev/nvidiactl ] || mknod -m 666 /dev/nvidiactl c 195 255; "
                "[ -e /dev/nvidia0 ] || mknod -m 666 /dev/nvidia0 c 195 0")
        return took

    def reboot(self) -> float:
        sdi.ti.podman("restart", "-t", "30", self.name)
        return self.boot()


@contextlib.contextmanager
def boot_installed(spec, figures: dict[str, float]) -> Iterator[Box]:
    """Boot ``spec``'s image (built first where podman lacks it) and install gpu-tune the documented
    way (into a copy of :func:`~tools.systemd_image.seeded_venv`, which the same lines made with the
    dependencies alone); ``figures`` gets the build, boot and install seconds. On the way out: the container
    removed, this machine's settings put back (an AssertionError names what could not be)."""
    tag, built = sdi.ensure(spec)
    wheels, _ = sdi.wheelhouse()
    seed, _ = sdi.seeded_venv(wheels)
    with tempfile.TemporaryDirectory(prefix="gpu-tune-dist-") as dist:
        whl = sdi.project_wheel(Path(dist))
        os.chmod(dist, 0o755)
        before = hostsnap.snapshot()
        assert any("swappiness" in p for p in before), "no kernel settings to snapshot: nothing would be tested"
        b = Box(f"gpu-tune-systemd-{spec.name}-{os.getpid()}", spec)
        sdi.ti.podman("rm", "-f", "-t", "0", b.name, check=False)
        try:
            sdi.ti.podman("run", "-d", "--name", b.name, *sdi.ti.run_flags(), "--privileged", "--systemd=always",
                          "--network", "none", "-v", f"{wheels}:/wheels:ro", "-v", f"{dist}:/dist:ro", "-v", f"{seed}:/seed:ro",
                          "-v", f"{ROOT / 'tests' / 'sdtool.py'}:{TOOL}:ro", tag, "/sbin/init")
            figures.update(boot_s=b.boot(), **({"image_build_s": built} if built is not None else {}))
            version = b.run("systemctl", "--version").stdout.split()[1]
            assert version == spec.systemd, f"{spec.name}: systemd {version}, expected {spec.systemd}"
            t0 = time.monotonic()
            b.run("cp", "-a", "/seed/.", sdi.VENV)  # the dependencies already there: pip installs gpu-tune alone
            b.sh("\n".join(install_lines(f"--no-index --find-links /wheels /dist/{whl.name}")), timeout=600)
            figures["install_s"] = time.monotonic() - t0
            yield b
        finally:
            sdi.ti.podman("rm", "-f", "-t", "10", b.name, check=False)
            failed = hostsnap.restore(before)
            assert not failed, f"could not put back this machine's settings: {failed}"
