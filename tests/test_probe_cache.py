"""The compilation cache holds code the probe runs: only the agent's own is used.

The checker and the remover (``gpu_tune.workload.cache_guard``) and the agent's upkeep
(``gpu_tune.judge.probe.cache.upkeep``) are tested directly and fast: a FIFO, a socket, a
symbolic link (a key folder, an entry, the cache folder itself), another user's file, a
group-writable one, a folder 1,500 deep, too many entries. Then one real probe run per fault
(TensorFlow on the CPU with the GPU's XLA path, as tests/test_workload.py does): each completes,
with the fault set aside and said in the notes, nothing written outside the state folder and
nothing loaded from where a link points.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from pathlib import Path

import pytest

from gpu_tune.judge import probe
from gpu_tune.judge.probe.cache import KEY_TRASH, MAX_TOP, TRASH, Upkeep, cache_folder, upkeep
from gpu_tune.judge.probe.plan import ProbeTarget
from gpu_tune.tune.profile import ProbePolicy
from gpu_tune.workload import cache_guard as guard
from gpu_tune.workload.compile_cache import own_folder
from tests import skips

ROOT = Path(__file__).resolve().parent.parent
ENTRY = "xla_compile_cache__1__2__XLA_GPU_JIT.pb"


@pytest.fixture(autouse=True)
def _remove_deep_trees(tmp_path):
    """Remove what each test made: pytest's own clean-up recurses and cannot take 1,500 levels."""
    yield
    fd = guard.open_dir(tmp_path)
    try:
        for name in os.listdir(fd):
            guard.remove(fd, name, budget=1 << 20)
    finally:
        os.close(fd)


def _cache(tmp_path: Path) -> Path:
    base = tmp_path / "state" / "xla-cache"
    base.mkdir(parents=True)
    return base


def _key(base: Path, name: str = "tf2.21.0-cpu-drivernone-00000000") -> Path:
    d = base / name
    d.mkdir(mode=0o755)
    (d / ENTRY).write_bytes(b"x" * 100)
    return d


def _deep(top: Path, depth: int) -> None:
    """``top/d/d/.../d`` ``depth`` folders deep, made one level at a time (no path is too long)."""
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    finally:
        os.close(fd)


def _walk(d: Path) -> guard.Walk:
    fd = guard.open_dir(d)
    try:
        return guard.walk(fd, str(d))
    finally:
        os.close(fd)


def _tree(p: Path) -> dict[str, tuple[int, float]]:
    """Every path below ``p`` with its size and mtime, links not followed."""
    out = {}
    for dirpath, dirs, files in os.walk(p):
        for n in dirs + files:
            st = os.lstat(os.path.join(dirpath, n))
            out[os.path.relpath(os.path.join(dirpath, n), p)] = (st.st_size, st.st_mtime)
    return out


# -- the checker ----------------------------------------------------------------------------------
def test_a_key_folder_of_regular_files_is_sound_and_counted(tmp_path):
    k = _key(_cache(tmp_path))
    (k / "sub").mkdir()
    (k / "sub" / "more.pb").write_bytes(b"y" * 50)
    assert _walk(k) == guard.Walk(None, 2, 150)


@pytest.mark.parametrize("make, word", [
    (lambda p: os.mkfifo(p), "is a FIFO"),
    (lambda p: os.mknod(p, stat.S_IFSOCK | 0o600), "is a socket"),
    (lambda p: p.symlink_to("/etc/passwd"), "is a symbolic link"),
    (lambda p: p.symlink_to("."), "is a symbolic link"),
])
def test_anything_but_a_regular_file_or_a_folder_is_a_fault(tmp_path, make, word):
    k = _key(_cache(tmp_path))
    make(k / "odd.pb")
    w = _walk(k)
    assert w.fault == f"{k}/odd.pb {word}, not a regular file or a folder"


def test_a_file_writable_by_others_or_of_another_user_is_a_fault(tmp_path):
    k = _key(_cache(tmp_path))
    (k / ENTRY).chmod(0o664)
    assert _walk(k).fault == f"{k}/{ENTRY} is writable by its group or by others (mode 0664)"
    (k / ENTRY).chmod(0o644)
    assert _walk(k).fault is None
    if os.geteuid() != 0:
        skips.condition("not-root", "chown to another user needs root")
    os.chown(k / ENTRY, 4242, -1)
    assert _walk(k).fault == f"{k}/{ENTRY} belongs to uid 4242, not to this process' uid 0"


def test_the_walk_is_bounded_in_depth_and_entries_and_never_recurses(tmp_path):
    """1,500 folders deep: one loop turn per level looked at, stopped at the bound; Python's
    recursion limit (1,000) never comes near."""
    base = _cache(tmp_path)
    _deep(base / "deep", 1500)
    wide = _key(base, "wide")
    for i in range(guard.MAX_ENTRIES):
        (wide / f"{i}.pb").touch(mode=0o644)
    t0 = time.process_time()  # this process's CPU seconds (system calls included): no busy neighbour adds to them
    w = _walk(base / "deep")
    assert w.fault == f"{base}/deep has folders more than {guard.MAX_DEPTH} deep ({base}/deep/d/d/d/d/d)"
    assert _walk(wide).fault == f"{wide} holds more than {guard.MAX_ENTRIES} entries"
    assert time.process_time() - t0 < 5


def test_remove_never_follows_a_link_and_resumes_past_its_budget(tmp_path):
    base = _cache(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("precious")
    _deep(base / "deep", 1500)
    (base / "deep" / "link").symlink_to(outside)
    (base / "deep" / "d" / "abs").symlink_to(outside / "keep")
    os.mkfifo(base / "deep" / "d" / "fifo")
    fd = guard.open_dir(base)
    try:
        first = guard.remove(fd, "deep", budget=1000)
        assert not first.done and first.removed == 1000 and first.error is None
        rest = guard.remove(fd, "deep", budget=10_000)
        assert rest.done and rest.error is None and first.removed + rest.removed == 1500 + 5
    finally:
        os.close(fd)
    assert not (base / "deep").exists() and (outside / "keep").read_text() == "precious"


# -- the agent's upkeep ----------------------------------------------------------------------------
def test_a_fifo_in_a_key_folder_sets_that_folder_aside_and_it_is_gone(tmp_path):
    base = _cache(tmp_path)
    bad, good = _key(base, "bad"), _key(base, "good")
    os.mkfifo(bad / "xla_compile_cache__3__4__XLA_GPU_JIT.pb")
    u = upkeep(str(base))
    assert u.folder == str(base) and sorted(os.listdir(base)) == ["good"]
    (note,) = u.notes
    assert note == (f"compilation cache: {bad}/xla_compile_cache__3__4__XLA_GPU_JIT.pb is a FIFO, not a regular "
                    f"file or a folder; {bad} set aside (removed by this and later runs): the probe compiles afresh")
    assert upkeep(str(base)).notes == [] and (good / ENTRY).exists()  # once: not every run


def test_a_symlinked_key_folder_is_set_aside_never_followed(tmp_path):
    base = _cache(tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / ENTRY).write_bytes(b"someone else's executable")
    before = _tree(outside)
    (base / "tf2.21.0-cpu-drivernone-00000000").symlink_to(outside)
    u = upkeep(str(base))
    assert u.folder == str(base) and os.listdir(base) == []
    assert "tf2.21.0-cpu-drivernone-00000000 is a symbolic link, not a folder" in u.notes[0]
    assert _tree(outside) == before


@pytest.mark.parametrize("make", [
    lambda p: p.symlink_to(p.parent.parent / "elsewhere"),
    lambda p: os.mkfifo(p),
    lambda p: (p.mkdir(), p.chmod(0o777)),
])
def test_a_cache_folder_not_its_own_is_set_aside_and_made_afresh(tmp_path, make):
    base = tmp_path / "state" / "xla-cache"
    base.parent.mkdir()
    (tmp_path / "elsewhere").mkdir()
    make(base)
    u = upkeep(str(base))
    assert u.folder == str(base) and base.is_dir() and not base.is_symlink()
    assert stat.S_IMODE(base.stat().st_mode) & 0o077 == 0
    assert u.notes[0].startswith(f"compilation cache: {base} is ") and "made afresh" in u.notes[0]
    assert sorted(os.listdir(base.parent)) == [".xla-cache.lock", "xla-cache"]  # the old one removed at once
    assert os.listdir(tmp_path / "elsewhere") == []


def test_a_folder_1500_deep_is_set_aside_and_removed_without_recursion(tmp_path):
    base = _cache(tmp_path)
    _deep(base / "tf2.21.0-cpu-drivernone-00000000", 1500)
    t0 = time.process_time()
    u = upkeep(str(base))
    assert time.process_time() - t0 < 10  # CPU seconds of this process: no recursion, no re-walk
    assert u.folder == str(base) and os.listdir(base) == []
    assert "folders more than 4 deep" in u.notes[0]


def test_what_the_budget_leaves_is_removed_by_the_next_runs(tmp_path):
    base = _cache(tmp_path)
    _deep(base / "k", 1500)
    u = upkeep(str(base), budget=600)
    assert u.folder == str(base) and [n for n in os.listdir(base) if n.startswith(KEY_TRASH)]
    upkeep(str(base), budget=600)
    assert upkeep(str(base), budget=600).notes == [] and os.listdir(base) == []


def test_too_many_entries_set_the_whole_cache_aside(tmp_path):
    base = _cache(tmp_path)
    for i in range(MAX_TOP + 1):
        (base / f"k{i}").mkdir()
    u = upkeep(str(base))
    assert u.folder == str(base) and os.listdir(base) == []
    assert f"{base} holds more than {MAX_TOP} entries" in u.notes[0]
    assert not [n for n in os.listdir(base.parent) if n.startswith(TRASH)]


def test_a_lock_file_that_is_not_a_file_is_set_aside_too(tmp_path):
    base = _cache(tmp_path)
    os.mkfifo(base.parent / ".xla-cache.lock")
    u = upkeep(str(base))
    assert u.folder == str(base)
    assert u.notes[0].startswith(f"compilation cache: {base.parent}/.xla-cache.lock is a FIFO")
    assert stat.S_ISREG((base.parent / ".xla-cache.lock").lstat().st_mode) and upkeep(str(base)).notes == []


def test_a_cache_that_cannot_be_made_sound_is_not_used_and_says_why(tmp_path):
    import fcntl

    base = _cache(tmp_path)
    assert upkeep(str(tmp_path / "gone" / "xla-cache")) == Upkeep(
        None, [f"compilation cache not used: {tmp_path}/gone: No such file or directory"], [])
    fd = os.open(base.parent / ".xla-cache.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another gpu-tune, stuck in its upkeep
        u = upkeep(str(base), lock_wait_s=0.2)
    finally:
        os.close(fd)
    assert u == Upkeep(None, [f"compilation cache not used: {base.parent}/.xla-cache.lock: held by another "
                              "process for 0.2 s"], [])


def test_an_earlier_versions_lock_is_removed_quietly(tmp_path):
    base = _cache(tmp_path)
    (base / ".lock").write_text("")
    _key(base)
    u = upkeep(str(base))
    assert u.notes == [] and os.listdir(base) == ["tf2.21.0-cpu-drivernone-00000000"]


def test_a_fifo_for_the_cache_folder_no_longer_turns_the_cache_off_for_good(tmp_path):
    from gpu_tune.host.fs import HostFS

    root = tmp_path / "r"
    for d in ("proc", "sys", "var/lib/gpu-tune"):
        (root / d).mkdir(parents=True)
    os.mkfifo(root / "var/lib/gpu-tune/xla-cache")
    folder, why = cache_folder(HostFS(root))
    assert why is None and folder == str(root / "var/lib/gpu-tune/xla-cache")
    u = upkeep(folder)
    assert u.folder == folder and "is a FIFO, not a folder" in u.notes[0] and Path(folder).is_dir()


# -- the workload's own check ------------------------------------------------------------------------
def test_the_workload_refuses_a_key_folder_that_is_not_its_own(tmp_path):
    base = _cache(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (base / "link").symlink_to(outside)
    assert own_folder(base, "link") == f"{base}/link is a symbolic link, not a folder"
    os.mkfifo(base / "fifo")
    assert own_folder(base, "fifo") == f"{base}/fifo is a FIFO, not a folder"
    os.mkfifo(_key(base, "k") / "e.pb")
    assert own_folder(base, "k") == f"{base}/k/e.pb is a FIFO, not a regular file or a folder"
    assert os.listdir(outside) == []
    old = os.umask(0o002)  # a umask that lets the group write
    try:
        assert own_folder(base, "fresh") is None and stat.S_IMODE((base / "fresh").stat().st_mode) == 0o700
        assert os.umask(0o002) == 0o022  # what TensorFlow writes next passes the agent's check
    finally:
        os.umask(old)


# -- real probe runs -------------------------------------------------------------------------------
FAST = ProbePolicy(window_seconds=0.2)
XLA_ON = ("--xla", "on", "--infer-seconds", "0.05")  # the GPU's XLA path on the CPU: the cache is used


def _probe(state: Path, timeout: float = 900):  # a hang guard: a busy machine's probe takes minutes at worst
    t = ProbeTarget("cpu", None, None, None, prefix=[], env={}, expected_cpus=None, expected_node=None, device="cpu")
    (v,) = probe.run_probes([t], FAST, probe.Baselines(), data=None, timeout=timeout, device="cpu", previous=None,
                            extra_args=XLA_ON, compile_cache=str(state / "xla-cache"))
    return v


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A cache one real probe filled: its key folder and entries are what TensorFlow looks for."""
    skips.module("mlxtend", "pip install mlxtend (test extra)")
    state = tmp_path_factory.mktemp("warm") / "state"
    state.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KERAS_HOME", str(state.parent / "no-keras"))  # the shipped subset
        v = _probe(state)
    assert v.status == "passed" and v.result["compile_cache"]["status"] == "cold", (v.reasons, v.stderr_tail)
    return state


@pytest.fixture
def copy(warm, tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "no-keras"))
    state = tmp_path / "state"
    shutil.copytree(warm, state, symlinks=True)
    key = next(p for p in (state / "xla-cache").iterdir() if p.is_dir())
    return state, key


@pytest.mark.slow
def test_a_real_probe_with_a_fifo_entry_completes(copy):
    """Before: TensorFlow opened the FIFO and waited for a writer until the timeout, every run."""
    state, key = copy
    entry = sorted(key.glob("*.pb"))[0]
    entry.unlink()
    os.mkfifo(entry)
    v = _probe(state)  # (before: it waited for a writer until this timeout)
    assert v.status == "passed", (v.status, v.reasons)
    assert v.result["compile_cache"]["status"] == "cold"
    assert any(f"{entry} is a FIFO" in n and "set aside" in n for n in v.notes), v.notes
    assert not any(stat.S_ISFIFO(os.lstat(p).st_mode) for p in key.iterdir())


@pytest.mark.slow
def test_a_real_probe_with_a_symlinked_key_folder_writes_and_loads_nothing_there(copy, tmp_path):
    """Before: the workload wrote its test file and TensorFlow its entries through the link, and
    loaded the executables found there."""
    state, key = copy
    outside = tmp_path / "outside"
    shutil.copytree(key, outside)  # executables someone else left for the probe to run
    os.utime(outside, (1, 1))
    before = _tree(outside), outside.stat().st_mtime
    shutil.rmtree(key)
    key.symlink_to(outside)
    v = _probe(state)
    assert v.status == "passed", (v.status, v.reasons)
    cc = v.result["compile_cache"]
    assert cc["status"] == "cold" and cc["entries_before"] == 0  # nothing loaded from there
    assert any(f"{key} is a symbolic link" in n for n in v.notes), v.notes
    assert (_tree(outside), outside.stat().st_mtime) == before and key.is_dir() and not key.is_symlink()


@pytest.mark.slow
def test_gpu_tune_probe_with_a_folder_1500_deep_in_the_cache_completes_and_runs_again(make_host, tmp_path):
    """Before: RecursionError in the size walk: exit 3, and again on every later run."""
    from .conftest import run_cli

    root = make_host("small-2cpu")
    policies = tmp_path / "policies"
    shutil.copytree(ROOT / "policies", policies)
    (policies / "quick.yaml").write_text("include: training.yaml\nallocator: {preload: none}\n"
                                         "probe: {require_jemalloc: false, window_seconds: 0.2}\n")
    cache = root / "var/lib/gpu-tune/xla-cache"
    cache.mkdir(parents=True)
    _deep(cache / "tf2.21.0-cpu-drivernone-00000000", 1500)
    for attempt in (1, 2):
        p = run_cli("probe", "--profile", "quick", "--policy-dir", str(policies), "--device", "cpu", "--root", str(root),
                    "--gpu-backend", "none", "-o", "json", "--timeout", "150",
                    env={"KERAS_HOME": str(tmp_path / "no-keras")}, timeout=900)
        assert p.returncode == 0, p.stderr[-2000:]
        (v,) = json.loads(p.stdout)["results"]
        assert v["status"] == "passed", v["reasons"]
        deep_notes = [n for n in v["notes"] if "folders more than 4 deep" in n]
        assert len(deep_notes) == (1 if attempt == 1 else 0), v["notes"]
    assert os.listdir(cache) == []
