"""One skip policy (docs/cluster-tests.md, "When a test may skip"; tests/skips.py), held by reading
every file under tests/: a skip that does not go through tests/skips.py with a documented key
fails here, so no test can quietly skip under `make test` as root.

`python -m tests.test_skips` prints every skip the suite has, with its key.
"""

from __future__ import annotations

import ast
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import skips

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
DOC = REPO / "docs" / "cluster-tests.md"
SECTION = "## When a test may skip"

# pytest's and unittest's ways to skip (or to expect a failure, which hides one as well)
SKIPPING = {"skip", "skipif", "importorskip", "xfail", "SkipTest", "skipIf", "skipUnless", "expectedFailure"}
HELPER = {"missing", "condition", "skipif", "module"}
# The only places that may call pytest's skip directly: the policy itself, and the cluster
# harness's own rule (tests/realkube is made to be copied into another project alone).
DIRECT_OK = {("tests/skips.py", None), ("tests/realkube/plugin.py", "skip_or_fail")}


@dataclass(frozen=True)
class Site:
    path: str
    line: int
    key: str | None  # None: not through the policy
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.key or 'NOT THROUGH tests/skips.py'}] {self.text}"


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def scan(path: str, source: str) -> list[Site]:
    """Every skip in one file: through the policy (with its key) or not (key None)."""
    tree = ast.parse(source)
    parent: dict[ast.AST, ast.AST] = {}
    func_of: dict[ast.AST, str | None] = {}

    def walk(node: ast.AST, func: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            parent[child] = node
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            func_of[child] = inner
            walk(child, inner)

    walk(tree, None)
    lines = source.splitlines()
    helpers = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "tests.skips"
               for a in n.names}
    skips_module = {a.asname or "skips" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "tests"
                    for a in n.names if a.name == "skips"}
    skips_module |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
                     for a in n.names if a.name == "tests.skips"}
    out: list[Site] = []

    def expected(node: ast.AST) -> bool:
        """Inside ``with pytest.raises(...)``: a test of a skip, not a skip."""
        while node in parent:
            node = parent[node]
            if isinstance(node, ast.With) and any(
                    isinstance(i.context_expr, ast.Call) and isinstance(i.context_expr.func, ast.Attribute)
                    and i.context_expr.func.attr == "raises" for i in node.items):
                return True
        return False

    def site(node: ast.AST, key: str | None) -> None:
        if not expected(node):
            out.append(Site(path, node.lineno, key, lines[node.lineno - 1].strip()))

    def direct_ok(node: ast.AST) -> bool:
        return (path, None) in DIRECT_OK or (path, func_of.get(node)) in DIRECT_OK

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("pytest", "_pytest.outcomes", "unittest"):
            if any(a.name in SKIPPING for a in node.names) and not direct_ok(node):
                site(node, None)
        elif (isinstance(node, ast.Attribute) and node.attr in SKIPPING
              and _root_name(node) in ("pytest", "unittest", "_pytest")):
            up = parent.get(node)
            if isinstance(up, ast.Attribute) and up.attr == "Exception":
                continue  # pytest.skip.Exception: what a skip raises, named in a test of the policy
            if not direct_ok(node):
                site(node, None)
        elif isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            name = exc.attr if isinstance(exc, ast.Attribute) else getattr(exc, "id", "")
            if "Skip" in name and not direct_ok(node):
                site(node, None)
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            through = ((isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in skips_module
                        and f.attr in HELPER) or (isinstance(f, ast.Name) and f.id in helpers and f.id in HELPER))
            if through:
                if name == "module":
                    site(node, "tool")
                else:
                    arg = node.args[0] if node.args else None
                    ok = isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                    site(node, arg.value if ok else "<not a literal key>")
            elif name == "skip_or_fail":
                site(node, "cluster")
    return sorted(out, key=lambda s: s.line)


def inventory() -> list[Site]:
    out = []
    for p in sorted(TESTS.rglob("*.py")):
        if "__pycache__" in p.parts:
            continue
        out += scan(str(p.relative_to(REPO)), p.read_text())
    return out


def documented() -> tuple[set[str], set[str]]:
    """(piece keys, condition keys) from the document's two tables."""
    text = DOC.read_text()
    assert SECTION in text, f"{DOC}: no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    tables = re.split(r"\n\*\*", section)
    pieces = set(re.findall(r"^\| `([a-z0-9-]+)` \|", next(t for t in tables if t.startswith("A piece")), re.M))
    conditions = set(re.findall(r"^\| `([a-z0-9-]+)` \|", next(t for t in tables if t.startswith("A fact")), re.M))
    return pieces, conditions


# -- the suite as it is ----------------------------------------------------------------------------
def test_every_skip_goes_through_the_policy_with_a_documented_key():
    pieces, conditions = documented()
    sites = inventory()
    print("\n".join(map(str, sites)))
    assert len(sites) >= 30, sites  # the scan sees the suite's skips (it once found 40)
    stray = [s for s in sites if s.key is None]
    unknown = [s for s in sites if s.key is not None and s.key not in pieces | conditions]
    assert not stray, "skip through tests/skips.py (docs/cluster-tests.md):\n" + "\n".join(map(str, stray))
    assert not unknown, f"not on the list in {DOC.relative_to(REPO)}:\n" + "\n".join(map(str, unknown))
    pieces_used = {s.key for s in sites if s.path != "tests/test_skips.py" and s.key in pieces}
    used = {s.key for s in sites if s.path != "tests/test_skips.py"}
    assert (pieces | conditions) - used == set(), f"listed but never used: {(pieces | conditions) - used}"
    assert pieces == set(skips.PIECES) == pieces_used


def test_reachable_under_make_test_as_root():
    """What can still skip under `make test` as root on Linux: the cluster where its binaries
    are not beside the clone, and the facts of the machine. Every tool and the image fail."""
    pieces, conditions = documented()
    reachable = sorted({s.key for s in inventory() if s.key in conditions - {"not-root"} | {"cluster"}})
    print("\n".join(reachable))
    assert "tool" not in reachable and "image" not in reachable and "cluster" in reachable


# -- the scan itself -------------------------------------------------------------------------------
STRAYS = {
    "plain skip": "import pytest\ndef test_a():\n    pytest.skip('flaky')\n",
    "skipif mark": "import pytest\n@pytest.mark.skipif(True, reason='x')\ndef test_a():\n    pass\n",
    "skip mark": "import pytest\npytestmark = pytest.mark.skip\n",
    "xfail": "import pytest\n@pytest.mark.xfail\ndef test_a():\n    assert 0\n",
    "importorskip": "import pytest\nnp = pytest.importorskip('numpy')\n",
    "param marks": "import pytest\nP = [pytest.param(1, marks=pytest.mark.skipif(True, reason='x'))]\n",
    "from-import": "from pytest import skip\n",
    "unittest": "import unittest\n@unittest.skipIf(True, 'x')\ndef test_a():\n    pass\n",
    "raise": "from _pytest.outcomes import Skipped\ndef test_a():\n    raise Skipped('x')\n",
}


@pytest.mark.parametrize("src", STRAYS.values(), ids=STRAYS.keys())
def test_the_scan_finds_a_stray_skip(src):
    assert [s.key for s in scan("tests/test_x.py", src)][:1] == [None]


def test_the_scan_reads_the_policys_keys():
    src = ("from tests import skips\nfrom tests.skips import condition\nKEY = 'no-numa'\n"
           "M = skips.skipif('no-openat2', True, 'x')\ndef test_a():\n    skips.missing('tool', 'x')\n"
           "    condition('numa-node-1', 'x')\n    skips.condition(KEY, 'x')\n    skips.module('celpy', 'x')\n"
           "    skip_or_fail('x')\n    with pytest.raises(pytest.skip.Exception):\n        pass\n")
    assert [s.key for s in scan("tests/test_x.py", src)] == ["no-openat2", "tool", "numa-node-1", "<not a literal key>",
                                                             "tool", "cluster"]
    # what a test of the policy expects to raise is not a skip; the same call outside is one
    tested = "def test_a():\n    with pytest.raises(pytest.skip.Exception):\n        pytest.skip('x')\n"
    assert scan("tests/test_x.py", tested) == []
    assert len(scan("tests/test_x.py", tested.replace("with pytest.raises", "with open"))) == 1
    # the policy's own module and the cluster harness's rule may skip directly, nothing else there
    assert scan("tests/skips.py", STRAYS["plain skip"]) == []
    plugin = "import pytest\ndef skip_or_fail(m):\n    pytest.skip(m)\ndef other():\n    pytest.skip('x')\n"
    assert [s.line for s in scan("tests/realkube/plugin.py", plugin)] == [5]


# -- the policy's behaviour ------------------------------------------------------------------------
ENV = ("GPU_TUNE_REQUIRE_ALL", "CI", "GPU_TUNE_ALLOW_MISSING_TOOLS", "GPU_TUNE_REQUIRE_CLUSTER")
FAILS, SKIPS = pytest.fail.Exception, pytest.skip.Exception


@pytest.fixture
def env(monkeypatch):
    for k in ENV:
        monkeypatch.delenv(k, raising=False)

    def _set(**kw: str) -> None:
        for k, v in kw.items():
            monkeypatch.setenv(k, v)

    return _set


@pytest.mark.parametrize("piece,setting,outcome", [
    ("tool", {}, FAILS),
    ("tool", {"GPU_TUNE_ALLOW_MISSING_TOOLS": "1"}, SKIPS),
    ("tool", {"GPU_TUNE_ALLOW_MISSING_TOOLS": "1", "GPU_TUNE_REQUIRE_ALL": "1"}, FAILS),
    ("tool", {"GPU_TUNE_ALLOW_MISSING_TOOLS": "1", "CI": "true"}, FAILS),
    ("image", {}, SKIPS),
    ("image", {"GPU_TUNE_ALLOW_MISSING_TOOLS": "1"}, SKIPS),
    ("image", {"GPU_TUNE_REQUIRE_ALL": "1"}, FAILS),
    ("image", {"CI": "true"}, FAILS),
    ("cluster", {}, SKIPS),
    ("cluster", {"GPU_TUNE_REQUIRE_ALL": "1"}, SKIPS),  # the binaries are not what make installs
    ("cluster", {"GPU_TUNE_REQUIRE_CLUSTER": "1"}, FAILS),
    ("cluster", {"CI": "true"}, FAILS),
])
def test_a_missing_piece_fails_or_skips_by_the_policy(env, piece, setting, outcome):
    env(**setting)
    assert skips.required(piece) is (outcome is FAILS)
    with pytest.raises(outcome, match="the-piece is not here"):
        skips.missing(piece, "the-piece is not here")


def test_a_missing_module_is_a_missing_tool(env):
    assert skips.module("json", "stdlib").dumps(1) == "1"
    with pytest.raises(FAILS, match="no_such_module_here is not importable.*pip install it"):
        skips.module("no_such_module_here", "pip install it")
    env(GPU_TUNE_ALLOW_MISSING_TOOLS="1")
    with pytest.raises(SKIPS, match="no_such_module_here"):
        skips.module("no_such_module_here", "pip install it")


@pytest.mark.parametrize("setting", [{}, {"GPU_TUNE_REQUIRE_ALL": "1"}, {"CI": "true"}])
def test_a_fact_of_the_machine_is_always_a_skip_that_names_its_key(env, setting):
    env(**setting)
    with pytest.raises(SKIPS, match=r"no openat2 here \[no-openat2\]"):
        skips.condition("no-openat2", "no openat2 here")
    mark = skips.skipif("no-numa", True, "no NUMA")
    assert mark.mark.name == "skipif" and mark.mark.kwargs["reason"] == "no NUMA [no-numa]"


def test_the_image_tests_fail_without_podman_under_make_test_as_root(env, monkeypatch, tmp_path):
    """test_image.py's (and test_image_gpu.py's) gate with podman off PATH, as root."""
    from tests import test_image

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(test_image.os, "geteuid", lambda: 0)
    assert shutil.which("podman") is None
    with pytest.raises(SKIPS, match="podman is not installed"):
        test_image.need_podman()
    env(GPU_TUNE_REQUIRE_ALL="1")
    with pytest.raises(FAILS, match="podman is not installed"):
        test_image.need_podman()
    monkeypatch.setattr(test_image.os, "geteuid", lambda: 1000)
    with pytest.raises(SKIPS, match=r"not root.*\[not-root\]"):
        test_image.need_podman()


def test_make_test_requires_every_piece_it_installs():
    make = (REPO / "Makefile").read_text()
    (recipe,) = re.findall(r"^test:.*\n\t(.*)$", make, re.M)
    assert re.search(r"(^| )GPU_TUNE_REQUIRE_ALL=1 ", recipe), recipe
    assert re.search(r"\$\(BIN\)/pytest -q( -n \$\(TEST_WORKERS\))?$", recipe), recipe
    ci = [ln for ln in (REPO / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert ci[-1].strip() == "make test", ci


if __name__ == "__main__":
    _pieces, _conditions = documented()
    for s in inventory():
        where = ("fails under make test" if s.key in ("tool", "image") else
                 "may skip under make test as root" if s.key in _conditions - {"not-root"} | {"cluster"} else
                 "skips only when not root" if s.key == "not-root" else "NOT ALLOWED")
        print(f"{s}  -> {where}")
