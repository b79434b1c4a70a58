"""The systemd units of a bare-metal install (gpu_tune/systemd, docs/systemd.md): where
``gpu-tune systemd-units`` says they are, accepted by ``systemd-analyze verify`` (no warning at all),
sandboxed to an exposure level ``systemd-analyze security`` rates at most 3.5, and running what
the CLI accepts.

``systemd-analyze`` runs with ``--root``: a folder holding this machine's own unit files (for
``multi-user.target`` and the rest), the units under ``etc/systemd/system`` and an executable at
``/usr/local/bin/gpu-tune``, the path the units start, so that nothing is installed on this machine.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests import skips

UNITS = ("gpu-tune.service", "gpu-tune-apply.service")
SYSTEM_UNITS = (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))


def analyze() -> str:
    path = shutil.which("systemd-analyze")
    if not path:
        skips.missing("tool", "systemd-analyze is not installed (Debian package systemd; `make tools` installs it "
                              "as root)")
    return path


@pytest.fixture(scope="module")
def units(tmp_path_factory) -> dict[str, Path]:
    from tests.conftest import run_cli

    r = run_cli("systemd-units", "-o", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    listed = {u["name"]: Path(u["path"]) for u in doc["units"]}
    assert list(listed) == list(UNITS) and all(p.is_file() and p.parent == Path(doc["folder"]) for p in listed.values())
    table = run_cli("systemd-units")
    assert table.returncode == 0 and table.stdout.split() == [str(listed[u]) for u in UNITS]
    return listed


@pytest.fixture
def root(tmp_path, units) -> Path:
    """A --root for systemd-analyze: this machine's unit files, ours, and /usr/local/bin/gpu-tune."""
    analyze()
    src = next((d for d in SYSTEM_UNITS if (d / "multi-user.target").exists()), None)
    if src is None:
        skips.missing("tool", "no systemd unit files (multi-user.target) under /usr/lib/systemd/system: install "
                              "the systemd package")
    r = tmp_path / "root"
    shutil.copytree(src, r / "usr/lib/systemd/system", symlinks=True)
    (r / "etc/systemd/system").mkdir(parents=True)
    for name, path in units.items():
        shutil.copy(path, r / "etc/systemd/system" / name)
    exe = r / "usr/local/bin/gpu-tune"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\nexec python3 -m gpu_tune \"$@\"\n")
    exe.chmod(0o755)
    return r


def verify(root: Path, *names: str) -> subprocess.CompletedProcess:
    return subprocess.run([analyze(), "verify", "--man=no", f"--root={root}",
                           *(f"/etc/systemd/system/{n}" for n in names)], capture_output=True, text=True, timeout=60)


def test_systemd_analyze_verify_accepts_the_units_without_a_word(root):
    r = verify(root, *UNITS)
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r.stdout + r.stderr


@pytest.mark.parametrize("edit,words", [
    (("\nProtectSystem=strict\n", "\nProtectSystem=stric\n"), "Failed to parse protect system value"),
    (("\nCapabilityBoundingSet=CAP_SYS_NICE", "\nCapabilityBoundingSett=CAP_SYS_NICE"), "Unknown key"),
    (("\nExecStart=/usr/local/bin/gpu-tune serve", "\nExecStart=/usr/local/bin/gpu-tun serve"), "is not executable"),
])
def test_verify_would_catch_a_broken_unit(root, edit, words):
    """The check above can fail: one slip in a unit and systemd-analyze says so."""
    f = root / "etc/systemd/system/gpu-tune.service"
    assert edit[0] in f.read_text()
    f.write_text(f.read_text().replace(*edit, 1))
    r = verify(root, "gpu-tune.service")
    assert words in r.stdout + r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize("name", UNITS)
def test_the_sandbox_holds(root, name):
    """systemd's own rating of the sandbox: at most 3.5 of 10 (a root service without one: 9.6)."""
    r = subprocess.run([analyze(), "security", "--offline=true", "--threshold=35", f"--root={root}",
                        f"/etc/systemd/system/{name}"], capture_output=True, text=True, timeout=60)
    level = re.search(r"Overall exposure level for \S+: ([\d.]+)", r.stdout)
    assert level, r.stdout + r.stderr
    print(f"{name}: exposure {level.group(1)}")
    assert r.returncode == 0 and float(level.group(1)) <= 3.5, r.stdout[-3000:]


def settings(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            k, v = line.split("=", 1)
            out.setdefault(k, []).append(v)
    return out


def test_the_agent_audits_by_default_and_keeps_to_its_folders(units):
    s = settings(units["gpu-tune.service"])
    assert "GPU_TUNE_MODE=audit" in s["Environment"][0].split()
    assert s["EnvironmentFile"] == ["-/etc/default/gpu-tune"]
    start = s["ExecStart"][0].split()
    assert start[:3] == ["/usr/local/bin/gpu-tune", "serve", "--no-kube"] and "--mode" in start
    assert s["ProtectSystem"] == ["strict"] and s["ReadWritePaths"] == ["/var/lib/gpu-tune /etc/gpu-tune"]
    assert s["CapabilityBoundingSet"] == ["CAP_SYS_NICE CAP_SYSLOG"] and s["NoNewPrivileges"] == ["yes"]
    for off in ("ProtectKernelTunables", "ProtectKernelLogs", "PrivateDevices", "MemoryDenyWriteExecute"):
        assert off not in s, off  # the settings are kernel files, the XIDs are in the kernel log, NVML needs /dev
    a = settings(units["gpu-tune-apply.service"])
    assert a["Type"] == ["oneshot"] and a["ExecStart"] == ["/usr/local/bin/gpu-tune apply"]
    assert "gpu-tune.service" in a["Before"][0].split() and a["CapabilityBoundingSet"] == ["CAP_SYS_ADMIN"]


def test_the_command_lines_are_ones_the_cli_accepts(units, tmp_path):
    """The serve line with the defaults expanded parses (asked for --help after it: nothing starts)."""
    from tests.conftest import run_cli

    s = settings(units["gpu-tune.service"])
    env = dict(kv.split("=", 1) for kv in s["Environment"][0].split())
    line = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), ""), s["ExecStart"][0]).split()
    r = run_cli(*line[1:], "--help")
    assert r.returncode == 0 and "Usage: gpu-tune serve" in r.stdout, r.stderr
    bad = run_cli(*[w if w != "audit" else "audits" for w in line[1:]])
    assert bad.returncode == 2 and "--mode" in bad.stderr
