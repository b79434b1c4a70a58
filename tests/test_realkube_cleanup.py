"""The cluster harness leaves nothing behind: a run killed outright is cleaned by the next run's
janitor, and a run stopped with SIGTERM cleans up itself (tests/realkube/cleanup.py)."""

from __future__ import annotations

import json
import os
import signal
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests import skips
from tests.realkube.binaries import Missing, binaries, tool
from tests.realkube.cleanup import Ledger, alive, janitor

REPO = Path(__file__).resolve().parents[1]

START = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    from tests.realkube.cleanup import Ledger
    from tests.realkube.controlplane import ControlPlane
    led = Ledger("victim", Path({root!r}))
    cp = ControlPlane(Path({work!r}), led).start()
    print(json.dumps([(p.pid, p.started) for p in cp.procs]), flush=True)
    {then}
""")


@pytest.fixture()
def need_binaries():
    try:
        binaries(("kube-apiserver",))
        tool("etcd", "etcd-server")
    except Missing as exc:
        skips.missing("cluster", str(exc))


def _start(tmp_path: Path, then: str) -> tuple[subprocess.Popen, list]:
    code = START.format(repo=str(REPO), root=str(tmp_path / "ledgers"), work=str(tmp_path / "cp"), then=then)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, proc.stderr.read()[-2000:]
    return proc, json.loads(line)


def test_a_run_killed_outright_is_cleaned_by_the_next_runs_janitor(tmp_path, need_binaries):
    proc, procs = _start(tmp_path, "time.sleep(600)")
    assert procs and all(alive(pid, started) for pid, started in procs)
    proc.kill()  # SIGKILL: no teardown, no atexit
    proc.wait(10)
    assert all(alive(pid, started) for pid, started in procs)  # orphans, still serving
    (ledger,) = (tmp_path / "ledgers").glob("*.json")
    assert not Ledger.load(ledger).owner_alive()
    done = janitor(tmp_path / "ledgers")
    assert len(done) == 1 and done[0].endswith("cleaned"), done
    assert not any(alive(pid, started) for pid, started in procs)
    assert list((tmp_path / "ledgers").glob("*.json")) == []


def test_the_janitor_leaves_a_live_run_alone(tmp_path, need_binaries):
    proc, procs = _start(tmp_path, "time.sleep(600)")
    try:
        assert janitor(tmp_path / "ledgers") == []
        assert all(alive(pid, started) for pid, started in procs)
    finally:
        proc.kill()
        proc.wait(10)
        janitor(tmp_path / "ledgers")
    assert not any(alive(pid, started) for pid, started in procs)


def test_sigterm_to_a_pytest_run_cleans_up(tmp_path, need_binaries):
    """SIGTERM (CI cancelling a job) becomes KeyboardInterrupt, so the fixtures' teardown runs."""
    test = tmp_path / "test_victim.py"
    test.write_text(textwrap.dedent("""
        import json, time
        def test_hold(control_plane):
            print("PIDS " + json.dumps([(p.pid, p.started) for p in control_plane.procs]), flush=True)
            time.sleep(600)
    """))
    # SIGUSR1: every thread's stack, for the message of a child that does not end
    (tmp_path / "conftest.py").write_text("import faulthandler, signal\n"
                                          "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
                                          "from tests.realkube.plugin import control_plane  # noqa: F401\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "KUBE_CACHE_DIR": os.environ.get("KUBE_CACHE_DIR", "")}
    if not env["KUBE_CACHE_DIR"]:
        env.pop("KUBE_CACHE_DIR")
    # SIGTERM as a CI runner sends it: whatever this run inherited (an ignored SIGTERM is kept
    # across exec), the child starts with the default action, as a job's shell would give it
    # its own --basetemp: at its end pytest would otherwise delete the oldest numbered temp folders
    # under /tmp/pytest-of-<user> (earlier runs' nodes, gigabytes), minutes past SIGTERM on a busy disk
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                             f"--basetemp={tmp_path / 'child-tmp'}", str(test)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    procs = None
    seen: list[str] = []
    try:
        t0 = time.monotonic()
        while procs is None and time.monotonic() - t0 < 120:
            line = proc.stdout.readline()
            seen.append(line)
            if line.startswith("PIDS "):
                procs = json.loads(line[5:])
            elif not line and proc.poll() is not None:
                break
        assert procs, f"the control plane did not start in the child run: {''.join(seen)[-2000:]}"
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=300)  # the teardown stops etcd and kube-apiserver; slow on a busy machine
        except subprocess.TimeoutExpired:
            status = Path(f"/proc/{proc.pid}/status").read_text() if proc.poll() is None else ""
            sigs = " ".join(ln for ln in status.splitlines() if ln.startswith(("State", "SigIgn", "SigCgt", "SigBlk")))
            if proc.poll() is None:
                proc.send_signal(signal.SIGUSR1)
                time.sleep(2)
                os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            pytest.fail(f"the child run did not end within 300 s of SIGTERM ({sigs}); it printed: {''.join(seen)[-1500:]}"
                        f"\n... then: {out[-6000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        for pid, started in procs or []:
            if alive(pid, started):
                os.kill(pid, signal.SIGKILL)
    assert not any(alive(pid, started) for pid, started in procs), out[-2000:]


@pytest.mark.parametrize("env,fails", [({}, False), ({"CI": "true"}, True), ({"GPU_TUNE_REQUIRE_CLUSTER": "1"}, True),
                                       ({"GPU_TUNE_REQUIRE_CLUSTER": ""}, False)])
def test_a_missing_piece_skips_unless_the_cluster_tests_are_required(monkeypatch, env, fails):
    """make test as root with the binaries beside the clone (CI) sets GPU_TUNE_REQUIRE_CLUSTER=1:
    then a missing binary or package fails the test instead of skipping it."""
    from tests.realkube.plugin import skip_or_fail

    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("GPU_TUNE_REQUIRE_CLUSTER", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(pytest.fail.Exception if fails else pytest.skip.Exception, match="kube-apiserver"):
        skip_or_fail("kube-apiserver v1.36.2 is not here")


def test_make_test_requires_the_cluster_tests_as_root_with_the_binaries_beside_the_clone():
    text = (REPO / "Makefile").read_text()
    assert "REQUIRE_CLUSTER := $(shell [ -d ../shared/kube ] && [ \"$$(id -u)\" = 0 ] && echo 1)" in text
    assert "GPU_TUNE_REQUIRE_CLUSTER=$(REQUIRE_CLUSTER) $(BIN)/pytest -q " in text


# -- cgroup v1, hybrid and v2: where the harness makes, reads and removes a node's cgroup ----------------
V1 = """\
25 30 0:23 / /sys rw,nosuid - sysfs sysfs rw
31 25 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
"""
HYBRID = V1 + "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
V2 = """\
25 30 0:23 / /sys rw,nosuid - sysfs sysfs rw
30 25 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate
90 30 0:26 /kubepods /mnt/elsewhere rw - cgroup2 cgroup2 rw
91 30 0:26 /some/slice /sys/fs/cgroup/bound rw - cgroup2 cgroup2 rw
"""


@pytest.mark.parametrize("text,layout,roots", [
    (V1, "v1", ["cpu,cpuacct", "memory", "pids", "systemd"]),
    (HYBRID, "hybrid", ["cpu,cpuacct", "memory", "pids", "systemd", "unified"]),
    (V2, "v2", [""]),  # the one tree; a bound sub-cgroup or a mount elsewhere is no hierarchy
    ("", "none", []),
])
def test_the_cgroup_hierarchies_of_each_layout(text, layout, roots):
    from tests.realkube.cleanup import cgroup_layout, cgroup_roots

    assert cgroup_layout(text) == layout
    assert cgroup_roots(text) == [Path("/sys/fs/cgroup") / r if r else Path("/sys/fs/cgroup") for r in roots]


def _fake_tree(root: Path, children: tuple[str, ...] = ()) -> Path:
    for d in (root, *(root / c for c in children)):
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup.procs").write_text("")
    return root


def test_a_nodes_cgroup_on_v2_is_made_in_the_one_tree_not_in_its_child_cgroups(tmp_path):
    """On v2 the folders under /sys/fs/cgroup are cgroups, not hierarchies: the node's cgroup goes
    beside them, once."""
    from tests.realkube.cleanup import cgroup_dirs, cgroup_pids, make_cgroup

    root = _fake_tree(tmp_path / "cgroup", ("system.slice", "user.slice"))
    assert make_cgroup("gtk-7", [root]) == [root / "gtk-7"]
    assert not (root / "system.slice" / "gtk-7").exists() and not (root / "user.slice" / "gtk-7").exists()
    _fake_tree(root / "gtk-7" / "kubepods" / "pod1")
    (root / "gtk-7" / "kubepods" / "pod1" / "cgroup.procs").write_text("4242\n4243\n")
    (root / "system.slice" / "cgroup.procs").write_text("1\n")
    assert cgroup_dirs("gtk-7", [root]) == [root / "gtk-7"]
    assert cgroup_pids("gtk-7", [root]) == {4242, 4243}


def test_a_nodes_cgroup_on_v1_is_made_in_every_hierarchy(tmp_path):
    from tests.realkube.cleanup import cgroup_dirs, cgroup_pids, make_cgroup

    roots = [_fake_tree(tmp_path / h) for h in ("memory", "pids", "unified")]
    assert make_cgroup("gtk-7", roots) == [r / "gtk-7" for r in roots]
    (roots[1] / "gtk-7" / "cgroup.procs").write_text("99\n")
    assert cgroup_dirs("gtk-7", roots) == [r / "gtk-7" for r in roots]
    assert cgroup_pids("gtk-7", roots) == {99}


def test_a_cgroup_folder_removed_while_the_tree_is_read_is_passed_over(tmp_path, monkeypatch):
    """The kubelet removes a pod's cgroup while the node's cgroup tree is taken down: listed, then
    gone before it is read. The rest is still removed, and nothing raises."""
    from tests.realkube import cleanup

    root = tmp_path / "cg"
    for sub in ("a/x", "b/y/z"):
        (root / sub).mkdir(parents=True)
    real = os.scandir

    def scandir(path):
        if not isinstance(path, int) and Path(path).name == "y":  # listed in b; removed before it is read
            monkeypatch.undo()
            shutil.rmtree(path)
        return real(path)
    monkeypatch.setattr(cleanup.os, "scandir", scandir)
    cleanup.rmdir_tree(root)
    assert not root.exists()


def test_a_cgroup_folder_removed_while_its_processes_are_listed_is_passed_over(tmp_path, monkeypatch):
    """The teardown that failed on a cgroup v1 machine: containerd removes a container's cgroup
    (listed in its pod's folder, gone before it is looked into) while ``cgroup_pids`` reads the
    node's tree. The processes of the folders still there are found; nothing raises."""
    from tests.realkube.cleanup import cgroup_pids

    root = _fake_tree(tmp_path / "cpuacct")
    pod = _fake_tree(root / "gtk-7" / "kubepods" / "burstable" / "pod1", ("c1", "c2", "c3"))
    for i, c in enumerate(("c1", "c2", "c3")):
        (pod / c / "cgroup.procs").write_text(f"{100 + i}\n")
    real, removed = Path.read_text, []

    def read_text(self, *a, **kw):  # reading the first container's processes: containerd takes
        if self.parent.parent == pod and not removed:  # another one away meanwhile
            removed.append(next(c for c in sorted(pod.iterdir()) if c.is_dir() and c != self.parent))
            shutil.rmtree(removed[0])
        return real(self, *a, **kw)

    monkeypatch.setattr(Path, "read_text", read_text)
    pids = cgroup_pids("gtk-7", [root])
    assert removed and pids == {100, 101, 102} - {100 + int(removed[0].name[1]) - 1}, (removed, pids)


def test_a_file_or_folder_removed_while_a_kept_folder_is_cleaned_is_passed_over(tmp_path, monkeypatch):
    """A host folder that was there before the run (``keep_dirs``): what the run added is removed,
    what was there is kept, and an entry gone while the folder is walked is no error."""
    from tests.realkube import cleanup

    kept = tmp_path / "var-lib-gpu-tune"
    (kept / "old").mkdir(parents=True)
    (kept / "old" / "keep.json").write_text("{}")
    led = Ledger("keep", tmp_path / "ledgers")
    led.save_host_files(str(p) for p in cleanup.files_under(kept))
    led.note("keep_dirs", str(kept))
    for sub in ("new/a", "new/b", "gone/c"):
        (kept / sub).mkdir(parents=True)
        (kept / sub / "f").write_text("x")
    (kept / "link").symlink_to(kept / "new")
    real = os.scandir

    def scandir(path):
        if not isinstance(path, int) and Path(path).name == "gone":  # listed, then removed before it is read
            monkeypatch.undo()
            shutil.rmtree(path)
        return real(path)
    monkeypatch.setattr(cleanup.os, "scandir", scandir)
    assert led.clean() == []
    assert sorted(str(p.relative_to(kept)) for p in kept.rglob("*")) == ["old", "old/keep.json"]
