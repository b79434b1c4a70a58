"""The operator's policy told to a real Slurm (tests/realslurm), on the 8-GPU fixture host: ``gpu-tune
check --slurm`` drains by ``readiness.checks`` and ``readiness.xid`` (the drain reason names the
profile's key), a check turned off or an XID ignored keeps a failing node in service; and ``--dry-run``
reads the node, decides, prints the decision and the reason it would write, and leaves Slurm and the
tree under --root as they were (``scontrol show node`` and a listing of --root compared whole)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.healthkit import XID79, dgx_tree, host  # noqa: F401 (fixtures)
from tests.healthkit import gpu_json as fixture_json
from tests.healthkit import profiles_folder as policies
from tests.realslurm.cluster import NODE
from tests.test_operator_policy import IB0, MIN, xid_line

pytestmark = pytest.mark.slow

# what moves on an idle node from one `scontrol show node` to the next, whatever gpu-tune does
VOLATILE = ("CPULoad", "FreeMem", "CurrentWatts", "AveWatts", "LowestJoules", "ConsumedJoules", "ExtSensorsJoules",
            "ExtSensorsWatts", "ExtSensorsTemp")


def slurm_check(slurm, host: Path, fixture: Path, folder: Path, profile: str, *extra: str):
    return run_cli("check", "--slurm", "--slurm-node", NODE, "--root", str(host), "--gpu-backend", "fixture",
                   "--gpu-fixture", str(fixture), "--policy-dir", str(folder), "--profile", profile, *extra,
                   env={"SLURM_CONF": str(slurm.conf)}, timeout=120)


def drained(slurm) -> str | None:
    n = slurm.node()
    return n["Reason"] if "DRAIN" in n.get("State", "") else None


def test_checks_drain_by_the_profile_and_a_check_off_keeps_the_node_in_service(slurm, host, tmp_path):
    (host / IB0 / "state").write_text("1: DOWN\n")
    f = fixture_json(tmp_path, lambda d: d["gpus"][2].update(inforom_valid=False))
    folder = policies(tmp_path, plain="", noib="  checks:\n    network.infiniband: off\n",
                      strict="  checks:\n    gpu.inforom: fatal\n    network.infiniband: off\n")
    r = slurm_check(slurm, host, f, folder, "plain")
    assert r.returncode == 1 and (drained(slurm) or "").startswith("gpu-tune: InfinibandPortDown"), r.stderr

    for _ in range(2):  # a failing node made to pass: resumed on its second ready pass
        r = slurm_check(slurm, host, f, folder, "noib")
        assert r.returncode == 0, r.stderr
    assert drained(slurm) is None, slurm.node()  # resumed

    r = slurm_check(slurm, host, f, folder, "strict")  # a passing node made to fail
    assert r.returncode == 1, r.stderr
    reason = drained(slurm)
    assert reason is not None and reason.startswith("gpu-tune: InforomInvalid [readiness.checks.gpu.inforom] GPU 2"), \
        reason
    assert slurm.sinfo_reasons() == {NODE: reason}
    assert "gpu.inforom (fatal by profile strict: readiness.checks.gpu.inforom)" in r.stdout


def test_xids_drain_by_the_profile_and_an_ignored_one_keeps_the_node_in_service(slurm, host, tmp_path):
    f = fixture_json(tmp_path)
    folder = policies(tmp_path, plain="", gate45="  xid:\n    45: reset_gpu\n", quiet="  xid:\n    79: ignore\n")
    with open(host / "dev/kmsg", "a") as log:
        log.write(xid_line(100, 30 * MIN, 3, 45))
    assert slurm_check(slurm, host, f, folder, "plain").returncode == 0 and drained(slurm) is None
    r = slurm_check(slurm, host, f, folder, "gate45")  # a passing node made to fail
    assert r.returncode == 1, r.stderr
    assert (drained(slurm) or "").startswith("gpu-tune: FatalXid fatal GPU 3: XID 45 [readiness.xid.45]"), slurm.node()

    with open(host / "dev/kmsg", "a") as log:
        log.write(XID79.format(seq=101, usec=31 * MIN))
    assert slurm_check(slurm, host, f, folder, "plain").returncode == 1
    assert "XID 79" in (drained(slurm) or "")
    for _ in range(2):  # a failing node made to pass
        assert slurm_check(slurm, host, f, folder, "quiet").returncode == 0
    assert drained(slurm) is None, slurm.node()  # resumed


def listing(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``: its type, mode, size, modification time and, for a file, a hash
    of its bytes (the tool's state folder included)."""
    out: dict[str, tuple] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(folder) / name
            st = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else ""
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return out


def shown(slurm) -> dict[str, str]:
    return {k: v for k, v in slurm.node().items() if k not in VOLATILE}


def test_a_dry_run_decides_and_says_but_writes_nothing_to_slurm_or_under_the_root(slurm, host, tmp_path):
    f = fixture_json(tmp_path)
    folder = policies(tmp_path, plain="", gate45="  xid:\n    45: reset_gpu\n")
    assert slurm_check(slurm, host, f, folder, "plain").returncode == 0  # the state folder, as a real pass leaves it
    with open(host / "dev/kmsg", "a") as log:
        log.write(xid_line(100, 30 * MIN, 3, 45))
    before_node, before_tree = shown(slurm), listing(host)
    assert before_node["State"] == "IDLE" and "var/lib/gpu-tune/health.json" in before_tree

    # rolling a new policy out: what would it do?
    r = slurm_check(slurm, host, f, folder, "gate45", "--dry-run")
    assert r.returncode == 1, r.stderr
    want = "gpu-tune: FatalXid fatal GPU 3: XID 45 [readiness.xid.45]"
    assert f"dry run: would drain {NODE} with Reason='{want}" in r.stdout, r.stdout
    line = r.stderr.strip().splitlines()
    assert len(line) == 1 and line[0].startswith(f"gpu-tune: dry run, nothing written: slurm node {NODE} (command): "
                                                 f"not ready; drained: '{want}"), r.stderr
    j = slurm_check(slurm, host, f, folder, "gate45", "--dry-run", "-o", "json")
    doc = json.loads(j.stdout)
    assert (doc["slurm"]["dry_run"], doc["slurm"]["action"], doc["slurm"]["done"]) == (True, "drain", False)
    assert doc["slurm"]["reason"].startswith(want)
    assert shown(slurm) == before_node and listing(host) == before_tree  # Slurm and the tree untouched

    r = slurm_check(slurm, host, f, folder, "plain", "--dry-run")  # a ready node: nothing to write
    assert r.returncode == 0 and "dry run: would write nothing to Slurm (none)" in r.stdout, r.stdout
    assert shown(slurm) == before_node and listing(host) == before_tree

    r = slurm_check(slurm, host, f, folder, "gate45")  # the same, for real
    assert r.returncode == 1 and (drained(slurm) or "").startswith(want)
    assert listing(host) != before_tree


def test_dry_run_needs_slurm(tmp_path):
    r = run_cli("check", "--dry-run", "--root", str(tmp_path))
    assert r.returncode == 2 and r.stderr.strip() == "gpu-tune: error: --dry-run needs --slurm (gpu-tune check alone " \
                                                      "tells no scheduler anything)"
