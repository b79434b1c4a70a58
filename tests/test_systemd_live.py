"""The units under a real systemd: two images booting systemd as PID 1 in a privileged podman
container (tools/systemd_image.py), Debian 12 (systemd 252) and Debian 11 (systemd 247, standing
for Ubuntu 22.04's 249 and RHEL 8's 239), gpu-tune installed by the lines docs/systemd.md gives
(run as written there, the package spec aside: this checkout's wheel, its dependencies from a
local wheel folder, and no extras, which is the case the probe must explain).

Privileged, because systemd applies ProtectSystem= and DeviceAllow= only there (unprivileged it
drops them and nothing real is tested). Such a container shares this machine's /proc/sys and
/sys: the apply unit writes this machine's kernel settings. They are snapshot before the container
starts and put back after it is gone, whatever the tests did (tests/hostsnap.py), and the image
masks its own units that would write the host (tools/systemd_image.py). Its network is its own
(--network none: loopback only), so the agent's 127.0.0.1:9410 is the container's.

Needs root, podman and mmdebstrap (`make test` installs them); a cold run builds the two images
(about 2 minutes each) and downloads the dependencies' wheels once; later runs reuse both.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from tests import hostsnap, skips
from tests.sdbox import TOOL, URL, boot_installed, sdi

pytestmark = pytest.mark.slow

UNITS = ("gpu-tune.service", "gpu-tune-apply.service")
FIGURES: dict[str, dict[str, float]] = {}


def need_tools() -> None:
    if os.geteuid() != 0:
        skips.condition("not-root", "not root: the systemd tests boot privileged containers that write kernel settings")
    for tool in ("podman", "mmdebstrap"):
        if shutil.which(tool) is None:
            skips.missing("image", f"{tool} is not installed (make test installs it when run as root)")
    info = sdi.ti.podman("info", check=False)
    if info.returncode != 0:
        skips.missing("image", "podman cannot run here: " + (info.stderr.strip().splitlines() or ["?"])[-1])


@pytest.fixture(scope="module", params=sorted(sdi.SPECS, reverse=True))
def box(request):
    need_tools()
    if not FIGURES:  # the first image: both images, the wheels and the venv made side by side if missing
        FIGURES["prepare"] = {k: v for k, v in sdi.prepare().items() if v is not None}
    FIGURES[request.param] = {}
    with boot_installed(sdi.SPECS[request.param], FIGURES[request.param]) as b:
        yield b


def test_the_documented_install_runs_both_units(box):
    for unit in UNITS:
        s = box.show(unit, "ActiveState", "UnitFileState", "Result", "FragmentPath")
        assert s["UnitFileState"] == "enabled" and s["FragmentPath"] == f"/etc/systemd/system/{unit}", s
    assert box.show("gpu-tune.service", "ActiveState")["ActiveState"] == "active"
    health = box.get("/healthz")
    assert health.get("status") == 200, f"enabled and started, yet not listening: {health}"
    # the install is the package alone: the probe's extras (TensorFlow, NumPy) are not there
    assert box.run("/opt/gpu-tune/bin/python", "-c", "import numpy", check=False).returncode != 0


def test_started_means_listening_stop_is_clean_and_kill9_restarts(box):
    """Type=notify: `systemctl start` returns once the port is bound, so the first request after it
    is answered (Type=exec returned a second before). Then stop and kill -9, each timed."""
    stop = box.tool("stop", "gpu-tune")
    assert stop["rc"] == 0 and stop["ActiveState"] == "inactive" and stop["Result"] == "success", stop
    start = box.tool("start", "gpu-tune", URL + "/healthz")
    assert start["rc"] == 0 and start["first_get"].get("status") == 200, \
        f"systemctl start returned before the agent listened: {start}"
    killed = box.tool("kill9", "gpu-tune", URL + "/healthz")
    assert int(killed["NRestarts"]) >= 1 and killed["MainPID"] != str(killed["old_pid"]), killed
    FIGURES[box.spec.name].update(start_to_healthz_s=start["healthz_s"], stop_s=stop["stop_s"],
                                  restart_after_kill9_s=killed["restart_s"])
    print(f"{box.spec.name}: start -> /healthz 200 {start['healthz_s']:.2f} s, stop {stop['stop_s']:.2f} s, "
          f"restart after kill -9 {killed['restart_s']:.1f} s (RestartSec=10s)")


@pytest.mark.parametrize("unit", UNITS)
def test_gpu_device_nodes_and_kmsg_open_inside_the_units_sandbox(box, unit):
    """ProtectClock=yes meant DeviceAllow=char-rtc on systemd < 252: /dev/nvidia* and /dev/kmsg were
    refused (EPERM) inside both units, so NVML saw no GPU. Opened by an ExecStartPre of the unit
    itself (a drop-in), so in exactly its sandbox. The GPU nodes have no driver here: ENXIO is
    an allowed open. /dev/kmsg is opened for writing (read needs CAP_SYSLOG where
    kernel.dmesg_restrict=1, which the apply unit rightly lacks) and, by the agent, for reading."""
    out = f"/var/lib/gpu-tune/devices-{unit}.json"
    dropin = f"/run/systemd/system/{unit}.d/devices.conf"
    box.write(dropin, f"[Service]\nExecStartPre=/usr/bin/python3 {TOOL} devices {out}\n")
    try:
        box.run("systemctl", "daemon-reload")
        box.run("systemctl", "restart", unit)
        got = json.loads(box.run("cat", out).stdout)
    finally:
        box.run("rm", "-rf", os.path.dirname(dropin), out)
        box.run("systemctl", "daemon-reload")
    for path in ("/dev/nvidia0", "/dev/nvidiactl"):
        assert got[path]["r"] in ("ENXIO", "open"), f"{box.spec.name} {unit}: {path}: {got[path]} (the sandbox refuses it)"
    assert got["/dev/kmsg"]["w"] == "open", f"{box.spec.name} {unit}: /dev/kmsg: {got['/dev/kmsg']}"
    if unit == "gpu-tune.service":
        assert got["/dev/kmsg"]["r"] == "open", f"{box.spec.name}: the agent cannot read the kernel log: {got}"


def test_enforce_reports_the_refused_write_in_audit_and_journal(box):
    """kernel.numa_balancing needs CAP_SYS_ADMIN, which gpu-tune.service does not have: in enforce
    mode /audit and the journal give the kernel's refusal, in the passes after the refused try too
    (they said "held back by the enforce rate limit ... next re-apply allowed in 300s")."""
    with open("/proc/sys/kernel/numa_balancing", "w") as fh:  # drift: the profile wants 0
        fh.write("1")
    box.configure("GPU_TUNE_MODE=enforce\nGPU_TUNE_INTERVAL=1\n")
    try:
        box.run("systemctl", "restart", "gpu-tune")

        def row():  # a pass after the one that tried: its detail says when the next try is
            doc = box.get("/audit")
            if doc.get("status") != 200:
                return None
            rows = [r for r in json.loads(doc["body"])["settings"] if r["id"] == "sysctl.kernel.numa_balancing"]
            return rows[0] if rows and "next" in rows[0]["detail"] else None

        r = box.until("a pass after the refused re-apply", row)
        assert r["status"] == "error" and "Operation not permitted" in r["detail"] and "rate limit" not in r["detail"], r
        lines = [ln for ln in box.journal("gpu-tune.service") if "numa_balancing" in ln]
        assert lines and "Operation not permitted" in lines[0], box.journal("gpu-tune.service")[-20:]
    finally:
        box.configure(None)
        box.run("systemctl", "restart", "gpu-tune")
        box.run("gpu-tune", "revert", check=False)


def test_the_probe_without_its_extras_says_which_to_install(box):
    box.configure("GPU_TUNE_ARGS=--probe-device cpu\n")
    try:
        box.run("systemctl", "restart", "gpu-tune")
        probe = box.until("a probe verdict", lambda: (lambda d: d if d.get("status") == 200 and
                                                      json.loads(d["body"]) else None)(box.get("/probe")))
        ready = json.loads(box.get("/readiness")["body"])
        want = "install `gpu-tune[gpu]` (GPU) or `gpu-tune[probe]` (CPU)"
        hits = [c for c in ready["checks"] if want in c["detail"]]
        assert hits and "\n" not in hits[0]["detail"] and "ModuleNotFoundError" not in json.dumps(ready), \
            (ready, probe)
        assert [ln for ln in box.journal("gpu-tune.service") if want in ln], box.journal("gpu-tune.service")[-20:]
    finally:
        box.configure(None)
        box.run("systemctl", "restart", "gpu-tune")


def _apply_lines_cover(lines: list[str], doc: dict) -> None:
    table = [ln for ln in lines if re.search("[│┃━─┏┗]", ln)]
    assert not table, f"a table in the journal: {lines[:20]}"
    for r in doc["settings"]:
        assert any(r["id"] in ln and r["status"] in ln for ln in lines), (r, lines)


def test_boot_applies_before_the_agent_and_revert_mode_applies_nothing(box):
    box.run("gpu-tune", "revert")
    untuned = hostsnap.snapshot()
    try:
        box.reboot()  # the apply unit at boot (audit mode: the profile applied), then the agent
        apply_unit = box.show("gpu-tune-apply.service", "ExecMainExitTimestampMonotonic", "ExecMainStatus", "Result")
        agent = box.show("gpu-tune.service", "ExecMainStartTimestampMonotonic", "ActiveState")
        assert int(apply_unit["ExecMainExitTimestampMonotonic"]) <= int(agent["ExecMainStartTimestampMonotonic"]), \
            (apply_unit, agent)
        assert hostsnap.snapshot_diff(untuned), "the apply unit changed nothing at boot"
        lines = box.journal("gpu-tune-apply.service")
        audit = json.loads(box.run("gpu-tune", "audit", "-o", "json", check=False).stdout)
        _apply_lines_cover(lines, audit)
        assert len(lines) <= len({(r["id"], r["status"]) for r in audit["settings"]}) * 2 + 4, lines
        FIGURES[box.spec.name]["apply_journal_lines"] = len(lines)
        FIGURES[box.spec.name]["apply_rows"] = len(audit["settings"])
        print(f"{box.spec.name}: apply at boot: {len(lines)} journal lines for {len(audit['settings'])} rows")
        box.run("gpu-tune", "revert")
        left = hostsnap.snapshot_diff(untuned)
        assert left == {}, f"not restored byte for byte: {left}"

        box.configure("GPU_TUNE_MODE=revert\n")
        box.reboot()  # revert mode: the apply unit applies nothing
        assert hostsnap.snapshot_diff(untuned) == {}, "GPU_TUNE_MODE=revert, and the apply unit applied at boot"
        lines = box.journal("gpu-tune-apply.service")
        assert any("nothing applied" in ln for ln in lines), lines
        assert box.show("gpu-tune-apply.service", "Result")["Result"] == "success"
    finally:
        box.configure(None)
        box.run("gpu-tune", "revert", check=False)


@pytest.mark.parametrize("bad", ["mode", "port"])
def test_a_bad_setting_fails_the_unit_instead_of_restarting_forever(box, bad):
    """GPU_TUNE_MODE=audits, or a port in use: exit 2, and the unit is `failed` at once (it restarted
    every 10 s for ever, never reaching the start limit)."""
    blocker = "gpu-tune-test-port"
    if bad == "mode":
        box.configure("GPU_TUNE_MODE=audits\n")
    else:
        box.run("systemctl", "stop", "gpu-tune")
        box.run("systemd-run", f"--unit={blocker}", "python3", TOOL, "listen", "9410")
        box.until("the port taken", lambda: box.tool("connect", "9410")["listening"])
    try:
        box.run("systemctl", "restart", "gpu-tune", check=False)
        s = box.tool("wait", "gpu-tune", "failed", "auto-restart")
        assert s["ActiveState"] == "failed" and s["NRestarts"] == "0" and s["ExecMainStatus"] == "2", s
        words = "--mode" if bad == "mode" else "cannot listen"
        assert any(words in ln for ln in box.journal("gpu-tune.service")), box.journal("gpu-tune.service")
        if bad == "mode":  # the apply unit takes the same mode: refused, not applied
            r = box.run("systemctl", "restart", "gpu-tune-apply", check=False)
            a = box.show("gpu-tune-apply.service", "Result", "ExecMainStatus")
            assert r.returncode != 0 and a["ExecMainStatus"] == "2", a
    finally:
        box.run("systemctl", "stop", blocker, check=False)
        box.configure(None)
        box.run("systemctl", "restart", "gpu-tune")
        box.run("gpu-tune", "revert", check=False)


def test_the_apply_unit_and_tuned_never_run_together(box):
    """tuned changes the same settings: starting one stops the other (Conflicts=, as tuned declares
    against the power daemons), and the apply unit runs after tuned when both are asked for."""
    box.write("/etc/systemd/system/tuned.service",
              "[Unit]\nDescription=Dynamic System Tuning Daemon (a stand-in)\n[Service]\nExecStart=/bin/sleep infinity\n")
    try:
        box.run("systemctl", "daemon-reload")
        assert "tuned.service" in box.show("gpu-tune-apply.service", "After")["After"].split()
        box.run("systemctl", "stop", "gpu-tune-apply")
        box.run("systemctl", "start", "tuned")
        box.run("systemctl", "start", "gpu-tune-apply", check=False)
        assert box.show("tuned.service", "ActiveState")["ActiveState"] == "inactive", "tuned still runs beside the apply"
        box.run("systemctl", "start", "tuned")
        assert box.show("gpu-tune-apply.service", "ActiveState")["ActiveState"] == "inactive"
    finally:
        box.run("systemctl", "stop", "tuned", check=False)
        box.run("rm", "-f", "/etc/systemd/system/tuned.service")
        box.run("systemctl", "daemon-reload")
        box.run("gpu-tune", "revert", check=False)


def test_no_unit_waits_for_the_network(box):
    """The agent listens on loopback by default: nothing waits for network-online.target."""
    for unit in UNITS:
        s = box.show(unit, "After", "Wants", "Requires")
        assert "network-online.target" not in " ".join(s.values()), (unit, s)


def test_figures(box):
    """The closing figures of this image (printed; -s shows them), and what a cold run made."""
    print(f"{box.spec.name}: " + ", ".join(f"{k} {v:.2f}" for k, v in FIGURES[box.spec.name].items()))
    if FIGURES.get("prepare"):
        print("made for these tests (s): " + ", ".join(f"{k} {v:.0f}" for k, v in FIGURES["prepare"].items()))
