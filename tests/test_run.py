"""``gpu-tune run``: binding choice, the bind prefix (numactl and gpu_tune.launch.bind), the workload's
environment, and real children that report their own CPU affinity, memory policy and libraries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpu_tune.launch import runner
from gpu_tune.errors import InputError
from gpu_tune.gpu import select_backend
from gpu_tune.host.fs import HostFS
from gpu_tune.tune.profile import Profile
from gpu_tune.tune.policy import load_profile
from gpu_tune.launch.runner import Binding, bind_prefix, binding_for, workload_env
from gpu_tune.discover.topology import discover
from tests import skips
from tests.fixtures import hostgen, pcigen

REPO = Path(__file__).resolve().parents[1]
JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
HAVE_NUMA = Path("/proc/self/numa_maps").exists()

# What a bound child prints about itself.
PRINTER = textwrap.dedent("""
    import json, os
    status = dict(l.split(":\\t", 1) for l in open("/proc/self/status").read().splitlines() if ":\\t" in l)
    policy = None
    try:
        first = open("/proc/self/numa_maps").readline().split()
        policy = first[1] if len(first) > 1 else None
    except OSError:
        pass
    maps = open("/proc/self/maps").read()
    print(json.dumps({"cpus": status["Cpus_allowed_list"].strip(), "mems": status["Mems_allowed_list"].strip(),
                      "policy": policy, "jemalloc": "libjemalloc" in maps,
                      "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "malloc_conf": os.environ.get("MALLOC_CONF")}))
""")


@pytest.fixture(scope="module")
def dgx_topo(tmp_path_factory):
    root = pcigen.build_shared("dgx-8gpu", tmp_path_factory)
    return discover(HostFS(root), select_backend("fixture", str(pcigen.GPU_JSON_DIR / "dgx-8gpu.json")))


def test_binding_for_gpu_and_node(dgx_topo):
    b = binding_for(dgx_topo, gpu=5)
    assert b.numa_node == 1 and b.gpu_index == 5 and b.gpu_uuid == dgx_topo.gpu(5).gpu_uuid
    assert b.cpus == dgx_topo.node(1).cpus and b.warnings == ()
    n = binding_for(dgx_topo, numa_node=0)
    assert (n.numa_node, n.gpu_index, n.cpus) == (0, None, dgx_topo.node(0).cpus)
    with pytest.raises(InputError, match=r"--gpu 8: no such GPU \(known: 0, 1, 2, 3, 4, 5, 6, 7\)"):
        binding_for(dgx_topo, gpu=8)
    with pytest.raises(InputError, match=r"--numa-node 2: no such NUMA node \(known: 0, 1\)"):
        binding_for(dgx_topo, numa_node=2)
    with pytest.raises(InputError, match="exclusive"):
        binding_for(dgx_topo, gpu=0, numa_node=0)


def test_binding_for_gpu_with_unknown_node(make_host, gpu_fixture, monkeypatch):
    root = make_host("gpu-numa-unknown")
    topo = discover(HostFS(root), select_backend("fixture", str(gpu_fixture("gpu-numa-unknown"))))
    b = binding_for(topo, gpu=1)
    assert b.numa_node is None and b.cpus == topo.cpus_online and b.gpu_index == 1
    assert len(b.warnings) == 1 and "NUMA node unknown" in b.warnings[0]
    assert binding_for(topo, gpu=0).numa_node == 1  # derived from local_cpulist
    monkeypatch.setattr(runner.shutil, "which", lambda name: "/usr/bin/numactl")
    assert bind_prefix(b) == ["/usr/bin/numactl", "--physcpubind=0-15", "--"]  # CPUs only, no membind


def test_bind_prefix_numactl_and_fallback(monkeypatch):
    b = Binding(1, frozenset({56, 57, 58, 168}), 4, "GPU-x")
    monkeypatch.setattr(runner.shutil, "which", lambda name: "/usr/bin/numactl" if name == "numactl" else None)
    assert bind_prefix(b) == ["/usr/bin/numactl", "--physcpubind=56-58,168", "--membind=1", "--"]
    monkeypatch.setattr(runner.shutil, "which", lambda name: None)
    assert bind_prefix(b) == [sys.executable, "-m", "gpu_tune.launch.bind", "--cpus", "56-58,168", "--node", "1", "--"]
    assert bind_prefix(Binding(None, frozenset(), None, None)) == []


def test_workload_env(monkeypatch):
    p = load_profile("training")
    b = Binding(0, frozenset({0}), 3, "GPU-abc")
    env = workload_env(b, p, {"PATH": "/bin", "LD_PRELOAD": "/opt/x.so"})
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-abc" and env["PATH"] == "/bin"
    if os.path.exists(JEMALLOC):
        assert env["LD_PRELOAD"] == f"{JEMALLOC}:/opt/x.so" and env.warnings == ()
        assert env["MALLOC_CONF"] == p.allocator.malloc_conf
    assert workload_env(Binding(0, frozenset({0}), 3, None), p, {})["CUDA_VISIBLE_DEVICES"] == "3"
    # jemalloc absent in this process's filesystem: no LD_PRELOAD, a warning
    monkeypatch.setattr(runner, "LOCAL_LIB_DIRS", ("/nonexistent",))
    monkeypatch.setattr(runner.find_local_jemalloc, "__defaults__", (("/nonexistent",),))
    env = workload_env(b, p, {"PATH": "/bin"})
    assert "LD_PRELOAD" not in env and "MALLOC_CONF" not in env
    assert len(env.warnings) == 1 and "libjemalloc2" in env.warnings[0]
    # no preload asked: nothing set
    env = workload_env(Binding(0, frozenset(), None, None), Profile(name="x"), {})
    assert dict(env) == {}


def _run_child(binding_py: str, *, fallback: bool) -> dict:
    """exec_run in a child process; the grandchild (the workload) prints its own state."""
    script = textwrap.dedent(f"""
        import sys
        from gpu_tune.launch import runner
        from gpu_tune.launch.runner import Binding
        from gpu_tune.tune.policy import load_profile
        if {fallback!r}:
            runner.shutil.which = lambda name: None
        runner.exec_run({binding_py}, load_profile("training"), [sys.executable, "-c", {PRINTER!r}])
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60,
                          cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@skips.skipif("no-numa", not HAVE_NUMA, "kernel without NUMA support")
@pytest.mark.parametrize("fallback", [False, True], ids=["numactl", "gpu_tune.launch.bind"])
def test_child_is_bound(fallback):
    if not fallback and not runner.shutil.which("numactl"):
        skips.missing("tool", "numactl is not installed (make tools)")
    out = _run_child('Binding(0, frozenset({0}), 2, "GPU-test")', fallback=fallback)
    assert out["cpus"] == "0"
    assert out["mems"] == "0"
    assert out["policy"] == "bind:0"
    assert out["cuda"] == "GPU-test"
    assert out["jemalloc"] is os.path.exists(JEMALLOC)
    if os.path.exists(JEMALLOC):
        assert out["malloc_conf"] == load_profile("training").allocator.malloc_conf


def test_unbound_child_has_default_policy():
    """The control: without a binding the same printer reports the default policy."""
    out = _run_child("Binding(None, frozenset(), None, None)", fallback=True)
    assert out["policy"] in (None, "default") and out["cuda"] is None


@skips.skipif("no-numa", not HAVE_NUMA, "kernel without NUMA support")
def test_cli_run_numa_node_0(cli):
    proc = cli("run", "--numa-node", "0", "--", sys.executable, "-c", PRINTER)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    node0 = discover(HostFS("/"), None).node(0).cpus
    from gpu_tune.host.parse import parse_cpulist

    assert parse_cpulist(out["cpus"]) == node0 & frozenset(os.sched_getaffinity(0))
    assert out["policy"] == "bind:0" and out["mems"] == "0"
    proc = cli("run", "--numa-node", "7", "--", "true")
    assert proc.returncode == 2 and "--numa-node 7: no such NUMA node" in proc.stderr


def test_agent_bind_errors():
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def run(*args):
        return subprocess.run([sys.executable, "-m", "gpu_tune.launch.bind", *args], capture_output=True, text=True,
                              env=env, timeout=30, cwd=str(REPO))

    p = run("--cpus", "0")
    assert p.returncode == 2 and "no command" in p.stderr
    p = run("--cpus", "x-y", "--", "true")
    assert p.returncode == 2 and "--cpus 'x-y'" in p.stderr
    p = run("--cpus", "0", "--", "/nonexistent/cmd")
    assert p.returncode == 127 and "command not found" in p.stderr
    p = run("--cpus", "0", "--", sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))")
    assert p.returncode == 0 and p.stdout.strip() == "[0]"


def test_exec_run_rejects_empty_and_foreign_cpus():
    p = load_profile("training")
    with pytest.raises(InputError, match="no command"):
        runner.exec_run(Binding(0, frozenset({0}), None, None), p, [])
    with pytest.raises(InputError, match="may be used by this process"):
        runner.exec_run(Binding(0, frozenset({100000}), None, None), p, ["true"])


def test_run_exit_codes_follow_env_for_a_missing_command(make_host, cli):
    root = make_host("small-2cpu")
    for args in (["--", "no-such-command-xyz"], ["--numa-node", "0", "--", "no-such-command-xyz"]):
        p = cli("run", "--root", str(root), *args)
        assert p.returncode == 127, (args, p.stderr)
        assert "no-such-command-xyz: command not found" in p.stderr and "Traceback" not in p.stderr
    p = cli("run", "--root", str(root), "--numa-node", "0", "--", str(root))  # a directory
    assert p.returncode == 126 and "not executable" in p.stderr
    p = cli("run", "--root", str(root), "--numa-node", "0", "--", "sh", "-c", "exit 7")
    assert p.returncode == 7  # CMD's own exit code


def test_a_callers_malloc_conf_is_merged_with_the_profiles_and_said(monkeypatch):
    """The caller's MALLOC_CONF is not dropped for the profile's: the two are merged, option by
    option, the caller's value winning where both set one, and each option it overrides is
    said in a warning."""
    monkeypatch.setattr(runner, "find_local_jemalloc", lambda *a: "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    p = load_profile("training")  # background_thread:true,dirty_decay_ms:10000,muzzy_decay_ms:30000
    b = Binding(0, frozenset({0}), None, None)
    env = workload_env(b, p, {"MALLOC_CONF": "narenas:8,dirty_decay_ms:0"})
    assert env["MALLOC_CONF"] == "background_thread:true,dirty_decay_ms:0,muzzy_decay_ms:30000,narenas:8"
    assert env.warnings == ("MALLOC_CONF: dirty_decay_ms:0 from the environment is kept over the profile's "
                            "dirty_decay_ms:10000 (the other options are merged)",)
    # options it only adds are merged without a word; the same value is no override
    env = workload_env(b, p, {"MALLOC_CONF": "narenas:8,background_thread:true"})
    assert env["MALLOC_CONF"] == f"{p.allocator.malloc_conf},narenas:8" and env.warnings == ()
    assert workload_env(b, p, {"MALLOC_CONF": ""})["MALLOC_CONF"] == p.allocator.malloc_conf
    # a profile without malloc_conf leaves the caller's as it is
    plain = Profile(name="x", allocator={"preload": "jemalloc"})
    assert workload_env(b, plain, {"MALLOC_CONF": "narenas:2"})["MALLOC_CONF"] == "narenas:2"


def test_gpu_tune_run_says_which_malloc_conf_options_of_the_caller_it_keeps(tmp_path):
    root = hostgen.build("small-2cpu", tmp_path / "h")
    env = {**os.environ, "PYTHONPATH": str(REPO), "MALLOC_CONF": "dirty_decay_ms:5"}
    proc = subprocess.run([sys.executable, "-m", "gpu_tune", "run", "--root", str(root), "--numa-node", "0", "--",
                           sys.executable, "-c", "import os; print(os.environ.get('MALLOC_CONF'))"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert os.path.exists(JEMALLOC), "libjemalloc2 is one of the test tools (make tools)"
    assert proc.stdout.strip() == "background_thread:true,dirty_decay_ms:5,muzzy_decay_ms:30000"
    assert "MALLOC_CONF: dirty_decay_ms:5 from the environment is kept over the profile's dirty_decay_ms:10000" \
        in proc.stderr
