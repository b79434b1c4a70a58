"""The repository's own text says what the code does, and cites documents it has.

- No file cites the public interface by a section number of a document that is not in the
  repository: each cites the docs/ page that describes that interface, and the page exists.
- The HTTP server's docstring gives each bound with the value its constant has.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import gpu_tune.serve.httpserver as httpserver

REPO = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".benchmarks", ".gpu-payload"}
TEXT = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".json", ".tpl", ".sh", ".in", ".cfg"}
# a section of a contract document that is not in the repository, or that document's file name
# (the word spelled in two halves, so that this file does not match itself)
OUTSIDE = re.compile("CONTR" + r"ACT(?:\s*§|\.md)")
DOC_CITE = re.compile(r"\bdocs/([A-Za-z0-9_-]+\.md)")
UNITS = {"KiB": 1024, "MiB": 1024 * 1024, "s": 1, None: 1}
# ``NAME``, 16 KiB / ``NAME`` (10 s) / ``NAME`` (2)
BOUND = re.compile(r"``([A-Z][A-Z0-9_]+)``,? \(?(\d[\d,]*(?:\.\d+)?)(?: (KiB|MiB|s)\b)?")


def repo_text_files() -> list[Path]:
    out = []
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for name in files:
            p = Path(folder, name)
            if (p.suffix in TEXT or name in ("Makefile", "Dockerfile", "run")) and not p.is_symlink():
                out.append(p)
    return out


def test_no_file_cites_a_document_the_repository_does_not_have():
    files = repo_text_files()
    assert len(files) > 100 and REPO / "gpu_tune" / "serve" / "app.py" in files
    cites = [f"{p.relative_to(REPO)}:{n}: {line.strip()}" for p in files
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if OUTSIDE.search(line)]
    assert not cites, "cite the docs/ page that describes it instead:\n" + "\n".join(cites)


def test_every_docs_page_a_module_cites_exists():
    cited = {(str(p.relative_to(REPO)), m.group(1)) for p in (REPO / "gpu_tune").rglob("*.py")
             for m in DOC_CITE.finditer(p.read_text())}
    assert len(cited) >= 10
    missing = sorted(f"{where}: docs/{page}" for where, page in cited if not (REPO / "docs" / page).is_file())
    assert not missing, missing


def test_the_http_servers_docstring_gives_the_bounds_the_code_has():
    found = {}
    for name, number, unit in BOUND.findall(httpserver.__doc__):
        value = float(number.replace(",", "")) * UNITS[unit or None]
        found[name] = (value, getattr(httpserver, name))
    assert {"MAX_HEAD_BYTES", "REQUEST_TIMEOUT_S", "RECV_BUFFER", "MAX_PIPELINED", "WRITE_HIGH", "SEND_TIMEOUT_S",
            "BLOCKED_BUDGET"} <= set(found), found
    wrong = {name: f"docstring {said:g}, code {has}" for name, (said, has) in found.items() if said != has}
    assert not wrong, wrong
