"""Text from outside never drives the terminal: control characters in host files, profiles and
error lines are shown escaped (``\\x1b``) in tables and error lines; JSON output stays exact."""

from __future__ import annotations

import json

import pytest

from gpu_tune.views.text import markup_safe, printable
from tests.conftest import run_cli

PAYLOAD = "\x1b]0;owned\x07\x1b[2J"


def test_printable_escapes_controls_and_keeps_text():
    assert printable("60" + PAYLOAD) == "60\\x1b]0;owned\\x07\\x1b[2J"
    assert printable("a\tb\nc") == "a\tb\nc"
    assert printable("a\tb\nc\r", one_line=True) == "a\\tb\\nc\\r"
    assert printable("abc\u202edef \ud800 \x9b") == "abc\\u202edef \\ud800 \\x9b"
    assert printable("NVIDIA H100 80GB HBM3 — ≥ 1048576 µs") == "NVIDIA H100 80GB HBM3 — ≥ 1048576 µs"
    assert markup_safe("[red]x[/]") == "\\[red]x\\[/]"


@pytest.mark.parametrize("color", [False, True])
def test_a_control_sequence_in_a_host_file_is_escaped_in_the_table(make_host, color):
    root = make_host("small-2cpu")
    (root / "proc/sys/vm/swappiness").write_text("60" + PAYLOAD + "\n")
    env = {"FORCE_COLOR": "1", "TERM": "xterm-256color"} if color else {"NO_COLOR": "1", "TERM": "dumb"}
    p = run_cli("audit", "--root", str(root), "--gpu-backend", "none", env=env, timeout=60)
    assert p.returncode == 1, p.stderr
    assert PAYLOAD not in p.stdout and "\x07" not in p.stdout
    assert "60\\x1b]0;owned\\x07\\x1b[2J" in p.stdout  # COLUMNS=200: on one line
    if not color:
        assert "\x1b" not in p.stdout


def test_json_output_keeps_the_text_exact(make_host):
    root = make_host("small-2cpu")
    (root / "proc/sys/vm/swappiness").write_text("60" + PAYLOAD + "\n")
    p = run_cli("audit", "--root", str(root), "--gpu-backend", "none", "-o", "json", timeout=60)
    row = next(s for s in json.loads(p.stdout)["settings"] if s["id"] == "sysctl.vm.swappiness")
    assert PAYLOAD in row["current"]
    assert "\x1b" not in p.stdout  # JSON escapes it: \u001b


def test_error_lines_escape_what_they_quote(tmp_path):
    pol = tmp_path / "pol"
    pol.mkdir()
    (pol / "x.yaml").write_text('name: x\nsummary: "s"\nthp: {enabled: "' + PAYLOAD.replace("\x1b", "\\e").replace("\x07", "\\a") + '"}\n')
    p = run_cli("audit", "--root", "/", "--gpu-backend", "none", "--policy-dir", str(pol), "--profile", "x", timeout=60)
    assert p.returncode == 2
    assert "\x1b" not in p.stderr and "\x07" not in p.stderr
    assert "\\x1b" in p.stderr and len([ln for ln in p.stderr.splitlines() if ln]) == 1
    p = run_cli("audit", "--gpu-backend", "none", "--profile", "x" + PAYLOAD, timeout=60)
    assert p.returncode == 2 and "\x1b" not in p.stderr and "\x07" not in p.stderr, p.stderr
    p = run_cli("audit", "--gpu-backend", PAYLOAD, timeout=60)  # click's own usage error
    assert p.returncode == 2 and "\x1b" not in p.stderr and "\x07" not in p.stderr, p.stderr


def test_a_gpu_name_with_a_control_character_is_bad_input(tmp_path, make_host):
    root = make_host("small-2cpu")
    f = tmp_path / "gpus.json"
    f.write_text(json.dumps({"gpus": [{"index": 0, "uuid": "GPU-1", "name": "H100" + PAYLOAD,
                                       "pci_bus_id": "0000:18:00.0"}]}))
    p = run_cli("topology", "--root", str(root), "--gpu-backend", "fixture", "--gpu-fixture", str(f), timeout=60)
    assert p.returncode == 2 and "gpus[0].name" in p.stderr and "\x1b" not in p.stderr, p.stderr
