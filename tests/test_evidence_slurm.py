"""Evidence named in the Slurm line (docs/health.md "Evidence"): ``gpu-tune check --slurm`` on a real
Slurm (tests/realslurm) and the 8-GPU fixture host with a fault: its stderr line and ``-o json``
name the bundle, a read-only state folder is a note in that line and the drain goes on, and
``--dry-run`` keeps no evidence."""

from __future__ import annotations

import json

import pytest

from tests.evidence_kit import FOLDER, bundles
from tests.healthkit import policies  # noqa: F401 (fixtures)
from tests.realslurm.cluster import NODE
from tests.slurmkit import check, dgx_tree, gpu_json, host, said  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow


def test_the_slurm_line_names_the_bundle_and_a_dry_run_keeps_none(slurm, host, tmp_path, policies):
    lost = gpu_json(tmp_path, drop=5)  # NVML lists 7 of the bus's 8
    r = check(slurm, host, lost, policies, "--dry-run")
    assert r.returncode == 1 and "evidence" not in json.loads(r.stdout) and not (host / FOLDER).exists()

    r = check(slurm, host, lost, policies)
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    [b] = doc["evidence"]["bundles"]
    line = said(r)
    assert line.startswith(f"gpu-tune: slurm node {NODE} (command): not ready; drained"), line
    assert line.endswith(f"; evidence: {b['path']} (written now; nvidia-bug-report.sh: not run: --root {host} is not "
                         "the machine this runs on (its boot id differs))"), line
    assert b["findings"] == ["gpu.count"] and bundles(host) == [b["name"]]
    assert f"evidence: {b['path']}" in doc["slurm"]["notes"][-1]

    r = check(slurm, host, lost, policies)  # the next pass: named, not written again
    assert said(r).endswith(f"; evidence: {b['path']}") and bundles(host) == [b["name"]]


def test_a_read_only_state_folder_is_a_note_in_the_slurm_line_and_the_drain_goes_on(slurm, host, tmp_path, policies):
    r = check(slurm, host, gpu_json(tmp_path, drop=5), policies, read_only=True)
    assert r.returncode == 1
    line = said(r)
    assert "not ready; drained" in line and "; evidence: evidence of gpu.count: " in line and "EROFS" in line, line
    assert "DRAIN" in slurm.node()["State"]
