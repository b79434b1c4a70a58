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
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import skips

UNITS = ("gpu-tune.service", "gpu-tune-apply.service")
REPO_DIR = Path(__file__).resolve().parents[1]
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
    assert a["Type"] == ["oneshot"] and a["ExecStart"] == ["/usr/local/bin/gpu-tune apply --agent-mode ${GPU_TUNE_MODE}"]
    assert "gpu-tune.service" in a["Before"][0].split() and a["CapabilityBoundingSet"] == ["CAP_SYS_ADMIN"]
    assert a["Environment"] == ["GPU_TUNE_MODE=audit"] and a["EnvironmentFile"] == ["-/etc/default/gpu-tune"]


def test_what_a_system_service_owes_its_administrator(units):
    """The unit files' side of docs/systemd.md (each also run under a real systemd in
    tests/test_systemd_live.py): no ProtectClock (systemd < 252 turns it into a device allow-list
    without the GPUs), started = listening (Type=notify), a bad setting fails instead of restarting
    for ever, no wait for the network, and never beside tuned."""
    s, a = settings(units["gpu-tune.service"]), settings(units["gpu-tune-apply.service"])
    for unit in (s, a):
        assert "ProtectClock" not in unit and "DeviceAllow" not in unit and "DevicePolicy" not in unit
        assert not any("network-online.target" in v for k in ("After", "Wants", "Requires") for v in unit.get(k, []))
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"]
    assert s["Restart"] == ["on-failure"] and s["RestartPreventExitStatus"] == ["2"]
    assert s["StartLimitBurst"] == ["10"] and s["StartLimitIntervalSec"] == ["5min"]
    assert a["Conflicts"] == ["tuned.service"] and "tuned.service" in a["After"][0].split()


def _journal_run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """gpu-tune with its stdout a pipe that JOURNAL_STREAM names, as systemd runs a unit."""
    cmd = 'JOURNAL_STREAM=$(stat -L -c %d:%i /proc/$$/fd/1) exec "$0" -m gpu_tune "$@"'
    return subprocess.run(["sh", "-c", cmd, sys.executable, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO_DIR), "COLUMNS": "80", **(env or {})})


def test_apply_writes_one_plain_line_a_setting_to_the_journal(make_host, gpu_fixture, tmp_path):
    """A rich table at 80 columns was 158 journal lines for 17 rows, with a 3-character detail
    column. Where stdout is the journal: one line per setting (group), naming its status, targets,
    values and detail, and the summary last; a terminal or a pipe keeps the table."""
    root = make_host("two-socket-224")
    fix = gpu_fixture("dgx-8gpu")
    args = ("apply", "--root", str(root), "--gpu-backend", "fixture", "--gpu-fixture", str(fix))
    r = _journal_run(*args)
    assert r.returncode in (0, 1), r.stderr
    lines = r.stdout.splitlines()
    doc = json.loads(_journal_run("audit", "--root", str(root), "--gpu-backend", "fixture", "--gpu-fixture",
                                  str(fix), "-o", "json").stdout)
    assert not [ln for ln in lines if re.search("[│┃━─┏┗]", ln)], lines[:10]
    for row in doc["settings"]:
        assert any(row["id"] in ln and ln.split()[0].rstrip(",") == row["status"] for ln in lines), (row, lines)
    assert lines[-1].startswith("apply: profile training on ") and "changed" in lines[-1], lines[-1]
    assert len(lines) < 60, f"{len(lines)} lines"
    print(f"apply's journal: {len(lines)} lines for {len(doc['settings'])} rows")
    piped = subprocess.run([sys.executable, "-m", "gpu_tune", *args], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(REPO_DIR), "COLUMNS": "80"})
    assert "━" in piped.stdout or "─" in piped.stdout, "without the journal the table stays"


def test_apply_in_revert_mode_applies_nothing_and_restores(make_host, gpu_fixture):
    """GPU_TUNE_MODE=revert reaches the apply unit as --agent-mode revert: nothing applied at boot,
    the recorded originals restored (the agent in revert mode does the same a second later)."""
    from tests.conftest import run_cli, snapshot_tree

    root = make_host("two-socket-224")
    fix = gpu_fixture("dgx-8gpu")
    g = ("--root", str(root), "--gpu-backend", "fixture", "--gpu-fixture", str(fix))
    untuned = snapshot_tree(root)
    assert run_cli("apply", *g).returncode in (0, 1)
    assert snapshot_tree(root) != untuned
    r = run_cli("apply", "--agent-mode", "revert", *g)
    assert r.returncode == 0 and "nothing applied" in r.stderr, r.stdout + r.stderr
    assert snapshot_tree(root) == untuned
    r = run_cli("apply", "--agent-mode", "revert", *g)  # at the next boot: nothing to restore, nothing applied
    assert r.returncode == 0 and snapshot_tree(root) == untuned
    bad = run_cli("apply", "--agent-mode", "audits", *g)
    assert bad.returncode == 2 and "--agent-mode" in bad.stderr and snapshot_tree(root) == untuned


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


@pytest.mark.parametrize("abstract", [False, True])
def test_serve_tells_systemd_ready_once_it_listens_and_stopping_on_sigterm(tmp_path, abstract):
    """sd_notify's protocol as systemd speaks it (a datagram socket named by NOTIFY_SOCKET, a path
    or an abstract name): READY=1 comes when the port already accepts connections, STOPPING=1 on
    SIGTERM. Without NOTIFY_SOCKET the agent runs as before (every other serve test)."""
    import signal
    import socket

    from tests.fixtures import hostgen

    root = hostgen.build("small-2cpu", tmp_path / "host")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"gpu-tune-test-notify-{os.getpid()}" if abstract else str(tmp_path / "notify")
    sock.bind("\0" + name if abstract else name)
    sock.settimeout(120)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_TUNE_")}
    env.update(PYTHONPATH=str(REPO_DIR), NOTIFY_SOCKET=("@" + name) if abstract else name)
    proc = subprocess.Popen([sys.executable, "-m", "gpu_tune", "--root", str(root), "--gpu-backend", "none", "serve",
                             "--no-kube", "--port", str(port), "--probe-device", "cpu", "--interval", "60"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        ready = sock.recv(4096).decode()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # connected: listening when it said READY=1
        proc.send_signal(signal.SIGTERM)
        stopping = sock.recv(4096).decode()
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close()
    assert ready.splitlines()[0] == "READY=1" and f"STATUS=serving on 127.0.0.1:{port}" in ready, ready
    assert stopping == "STOPPING=1" and rc == 0, (stopping, rc, proc.stderr.read()[-2000:])
