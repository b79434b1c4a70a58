#!/usr/bin/env python3
"""Where the agent's memory goes: resident memory of ``gpu-tune serve`` per import, per cache and
in total, without Kubernetes and with the kubernetes client publishing to a real API server.

    .venv/bin/python benchmarks/bench_rss.py [--hosts small-2cpu,dgx-8gpu] [--kube off|on|both]
        [--requests 20000] [--passes 3] [--interval 2] [--runs 3] [--ref REV] [--json]

The agent is the real command line (``gpu-tune serve --mode enforce --probe-device cpu``) on a
fresh copy of each fixture host (``small-2cpu``; ``dgx-8gpu``: 224 CPUs, ~1,000 IRQs, 8 GPUs from
the fixture GPU backend, what a GPU node looks like), run from a copy of this tree with its
bytecode compiled, as the image and a pip install run it (a tree without ``.pyc`` files compiles
every module at each start: about 2 MiB more). ``--kube on``: publishing to a kube-apiserver the
test harness starts (tests/realkube) through ``--kubeconfig``, the kubernetes client loaded.

For each host and mode it prints the RSS (RssAnon + RssFile of ``/proc/PID/status``, MiB) when
first ready, after half of ``--requests`` and after all of them (``/readiness`` and ``/metrics``
alternately, one keep-alive client), and after ``--passes`` more passes; the peak of these is what
the targets judge. Then, from the agent itself (benchmarks/_rss_agent.py, a thread answering on
stdin: it and its module cost about 0.1 MiB, the same on both sides of a comparison):

* **imports**: each top-level package the agent imported, in the order it finished importing
  them, with the anonymous and file-backed memory its modules took (benchmarks/_rss_imports.py
  replays the agent's imports in a fresh interpreter with a meter around each module), for the
  first host without Kubernetes; then what the kubernetes client adds, and what a GPU node's NVML
  backend would add (``pynvml``; the driver's library needs a GPU);
* **caches**: what the agent keeps after the requests and passes (snapshot bodies and documents,
  the loop's documents, the stages' state, the FastAPI app, uvicorn), per host;
* **allocators**: CPython's small-object arenas (in use, free) and glibc's heap (in use, free but
  kept), and the RSS after ``malloc_trim(0)``.

``--ref REV``: the same runs of another revision (``git archive``, compiled the same way),
interleaved with this tree's, so a change is measured before and after in one run.

``--runs N`` (default 3): each agent N times, the trees and hosts interleaved; every figure is the
median of its N runs (the report: the last run's). With Kubernetes the agent here reads a
kubeconfig; in a cluster (the DaemonSet) it reads its service account and does not import the
kubeconfig loader (``requests``, ``oauthlib``): that figure is printed as the measured peak less
what those imports cost (measured module by module, as above).

Targets: peak RSS < 50 MiB on every host, with and without Kubernetes; growth from half of the
requests to all of them < 1 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _util import REPO
from bench_agent import free_port, hammer

HERE = Path(__file__).resolve().parent
GPU_FIXTURE = REPO / "tests" / "fixtures" / "gpu" / "dgx-8gpu.json"
LIMIT = 50.0  # MiB, with and without Kubernetes
# What the agent imports only to read a kubeconfig (kubernetes.config.kube_config and its OAuth
# helpers): in a cluster (the DaemonSet) it reads its service account instead and imports none of
# it (gpu_tune/cluster/kube_client.py; tests/test_agent_imports.py checks the same).
IN_CLUSTER_CODE = ("import json, sys\n"
                   "from gpu_tune.cluster.kube_client import modules\n"
                   "client, config = modules()\n"
                   "client.ApiClient(client.Configuration())\n"
                   "config.load_incluster_config, config.ConfigException\n"
                   "from kubernetes.client.exceptions import ApiException\n"
                   "print(json.dumps(sorted(sys.modules)))\n")
# What must not be in an agent that does not talk to Kubernetes (tests/test_agent_imports.py checks
# the same in the real process).
HEAVY = ("kubernetes", "urllib3", "opentelemetry", "tensorflow", "typer", "rich", "pynvml", "pydantic.v1")


# -- the trees measured -------------------------------------------------------------------------
def compiled_copy(src: Path | None, ref: str | None, dest: Path) -> Path:
    """``gpu_tune`` and ``policies`` of this tree (``src``) or of revision ``ref``, compiled."""
    dest.mkdir(parents=True)
    if ref is not None:
        arc = subprocess.run(["git", "-C", str(REPO), "archive", ref, "gpu_tune", "policies"], capture_output=True)
        if arc.returncode != 0:
            raise SystemExit(f"--ref {ref}: {arc.stderr.decode().strip()[:300]}")
        subprocess.run(["tar", "-x", "-C", str(dest)], input=arc.stdout, check=True)
    else:
        for name in ("gpu_tune", "policies"):
            shutil.copytree(src / name, dest / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j0", str(dest / "gpu_tune")], check=True)
    return dest


# -- one agent ----------------------------------------------------------------------------------
def status_kib(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("RssAnon", "RssFile", "Threads"):
                out[key] = int(line.split()[1])
    return out


def mib(kib: float) -> float:
    return round(kib / 1024, 2)


class Agent:
    """``gpu-tune serve`` under benchmarks/_rss_agent.py, from ``tree``."""

    def __init__(self, tree: Path, host_root: Path, work: Path, extra: list[str], where: list[str],
                 interval: float, node: str) -> None:
        self.work = work
        self.port = free_port()
        argv = [sys.executable, str(HERE / "_rss_agent.py"), "--root", str(host_root), *extra, "serve",
                "--host", "127.0.0.1", "--port", str(self.port), "--mode", "enforce", "--probe-device", "cpu",
                "--interval", f"{interval:g}", "--node", node, *where]
        env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
        env["PYTHONPATH"] = str(tree)
        self.log = open(work / f"agent-{self.port}.log", "w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(argv, cwd=work, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stderr=self.log, env=env, start_new_session=True, text=True)

    def wait_ready(self, timeout: float = 150.0) -> float:
        import http.client

        last = ""
        while time.monotonic() - self.t0 < timeout and self.proc.poll() is None:
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/readiness")
                r = c.getresponse()
                body = r.read()
                c.close()
                if r.status == 200:
                    return time.monotonic() - self.t0
                last = body.decode(errors="replace")
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        log = (self.work / f"agent-{self.port}.log").read_text()[-1500:]
        raise SystemExit(f"the agent was never ready; last /readiness: {last[:600]}\nits log ends:\n{log}")

    def rss(self) -> dict[str, int]:
        return status_kib(self.proc.pid)

    def ask(self, what: str) -> dict:
        """``report``: the agent's report (benchmarks/_rss_agent.py); ``trim``: malloc_trim(0)."""
        path = self.work / f"{what}-{self.port}.json"
        self.proc.stdin.write(f"{what} {path}\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                return json.loads(path.read_text())
            except (FileNotFoundError, ValueError):
                time.sleep(0.2)
        raise SystemExit("the agent's report thread did not answer within 60 s")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def measure(tree: Path, tree_name: str, host: str, kube, a, work: Path, report: bool) -> dict:
    from tests.fixtures import hostgen

    run_dir = Path(tempfile.mkdtemp(prefix=f"rss-{host}-", dir=work))
    root = hostgen.build(host, run_dir / "host")
    extra = ["--gpu-backend", "none"]
    if host == "dgx-8gpu":
        fixture = run_dir / "dgx-8gpu.json"
        shutil.copy(GPU_FIXTURE, fixture)
        extra = ["--gpu-backend", "fixture", "--gpu-fixture", str(fixture)]
    node = f"rss-{host}-{''.join(c for c in run_dir.name.lower() if c.isalnum())[-6:]}"  # a valid Node name
    if kube is not None:
        kube.add_node(node)
        where = ["--kubeconfig", str(kube.cp.kubeconfig)]
    else:
        where = ["--no-kube"]
    agent = Agent(tree, root, run_dir, extra, where, a.interval, node)
    doc: dict = {"tree": tree_name, "host": host, "kubernetes": "on" if kube is not None else "off"}
    try:
        doc["time_to_ready_s"] = round(agent.wait_ready(), 1)
        time.sleep(1.0)  # the probe process reaped
        samples = {"ready": agent.rss()}
        hammer(agent.port, a.requests // 2)
        samples[f"{a.requests // 2} requests"] = agent.rss()
        hammer(agent.port, a.requests - a.requests // 2)
        samples[f"{a.requests} requests"] = agent.rss()
        time.sleep((a.passes + 0.5) * a.interval * 1.15)
        samples[f"+{a.passes} passes"] = agent.rss()
        doc["rss_mib"] = {k: mib(v["RssAnon"] + v["RssFile"]) for k, v in samples.items()}
        doc["anon_mib"] = {k: mib(v["RssAnon"]) for k, v in samples.items()}
        doc["file_mib"] = {k: mib(v["RssFile"]) for k, v in samples.items()}
        doc["threads"] = samples[f"+{a.passes} passes"]["Threads"]
        doc["peak_mib"] = max(doc["rss_mib"].values())
        half, full = samples[f"{a.requests // 2} requests"], samples[f"{a.requests} requests"]
        doc["growth_requests_mib"] = mib(full["RssAnon"] + full["RssFile"] - half["RssAnon"] - half["RssFile"])
        if report:
            agent.ask("trim")
            after = agent.rss()
            doc["after_malloc_trim_mib"] = mib(after["RssAnon"] + after["RssFile"])
            rep = agent.ask("report")
            doc["report"] = {k: rep[k] for k in ("modules", "caches", "malloc", "pymalloc", "threads", "gc_objects")}
    finally:
        doc["exit_code_on_sigterm"] = agent.stop()
    return doc


def median_run(rs: list[dict]) -> dict:
    """The runs of one agent as one: each figure the median of the runs' (the report: the last's)."""
    from statistics import median

    out = dict(rs[-1])
    out["runs"] = len(rs)
    for key in ("rss_mib", "anon_mib", "file_mib"):
        out[key] = {k: round(median(r[key][k] for r in rs), 2) for k in rs[0][key]}
    for key in ("peak_mib", "growth_requests_mib", "time_to_ready_s"):
        out[key] = round(median(r[key] for r in rs), 2)
    out["peak_mib_each"] = [r["peak_mib"] for r in rs]
    out["exit_code_on_sigterm"] = max((r["exit_code_on_sigterm"] or 0) for r in rs) if all(
        r["exit_code_on_sigterm"] is not None for r in rs) else None
    return out


def in_cluster_modules(tree: Path) -> list[str]:
    """sys.modules of ``tree``'s kubernetes client set up as in a cluster (IN_CLUSTER_CODE)."""
    p = subprocess.run([sys.executable, "-c", IN_CLUSTER_CODE], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(tree)})
    return json.loads(p.stdout) if p.returncode == 0 else []


class Kube:
    """A real kube-apiserver for the runs that publish (tests/realkube)."""

    def __init__(self, work: Path) -> None:
        from tests.realkube.cleanup import Ledger, ledger_root
        from tests.realkube.controlplane import ControlPlane
        from tests.realkube.testapi import RealAPI

        self.led = Ledger(f"bench-rss-{os.getpid()}", ledger_root())
        self.cp = ControlPlane(work / "cp", self.led).start(timeout=120)
        self.api = RealAPI(self.cp)

    def add_node(self, name: str) -> None:
        self.api.add_node(name)

    def close(self) -> None:
        try:
            self.api.proxy.stop()
        except Exception:  # noqa: BLE001 - best effort
            pass
        self.cp.stop()
        self.led.clean()


# -- per import ---------------------------------------------------------------------------------
def import_costs(tree: Path, modules: list[str], work: Path) -> dict:
    path = work / f"modules-{len(list(work.iterdir()))}.json"
    path.write_text(json.dumps({"modules": modules}))
    env = {**os.environ, "PYTHONPATH": str(tree)}
    p = subprocess.run([sys.executable, str(HERE / "_rss_imports.py"), str(path)], capture_output=True, text=True,
                       env=env, cwd=work, timeout=300)
    if p.returncode != 0:
        raise SystemExit(f"_rss_imports.py failed: {p.stderr[-1500:]}")
    return json.loads(p.stdout)


def package_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "gpu_tune" and len(parts) > 1:
        return ".".join(parts[:2])
    if module.startswith("pydantic.v1"):
        return "pydantic.v1"
    if module.startswith("fastapi.telemetry"):
        return "fastapi.telemetry"
    return parts[0].lstrip("_") or parts[0]


def by_package(rows: list[list]) -> list[dict]:
    """Per top-level package (gpu_tune per subpackage; a C module counted with its Python one),
    in the order each first finished importing."""
    out: dict[str, dict] = {}
    for name, anon, file in rows:
        pkg = package_of(name)
        d = out.setdefault(pkg, {"package": pkg, "anon_kib": 0, "file_kib": 0, "modules": 0})
        d["anon_kib"] += anon
        d["file_kib"] += file
        d["modules"] += 1
    return list(out.values())


def print_imports(title: str, pkgs: list[dict], shown_kib: int = 150) -> None:
    print(f"\n== {title}")
    print(f"  {'package':<34} {'anon KiB':>9} {'file KiB':>9} {'modules':>8} {'running total MiB':>18}")
    total = small_a = small_f = small_n = 0
    for d in pkgs:
        total += d["anon_kib"] + d["file_kib"]
        if d["anon_kib"] + d["file_kib"] < shown_kib:
            small_a, small_f, small_n = small_a + d["anon_kib"], small_f + d["file_kib"], small_n + 1
            continue
        print(f"  {d['package']:<34} {d['anon_kib']:>9} {d['file_kib']:>9} {d['modules']:>8} {total / 1024:>18.2f}")
    if small_n:
        print(f"  {f'{small_n} smaller packages':<34} {small_a:>9} {small_f:>9}")
    a = sum(d["anon_kib"] for d in pkgs)
    f = sum(d["file_kib"] for d in pkgs)
    print(f"  {'all imports':<34} {a:>9} {f:>9} {sum(d['modules'] for d in pkgs):>8} {(a + f) / 1024:>18.2f}")


# -- output -------------------------------------------------------------------------------------
def print_totals(runs: list[dict]) -> None:
    print("\n== totals: RSS (anonymous + file-backed), MiB, medians of the runs")
    keys = list(runs[0]["rss_mib"])
    head = "".join(f"{k:>15}" for k in keys)
    print(f"  {'host':<11} {'kubernetes':<10} {'tree':<12}{head}{'peak (anon+file)':>22}{'ready s':>9}  peak of each run")
    for r in runs:
        cells = "".join(f"{r['rss_mib'][k]:>15.2f}" for k in keys)
        peak_key = max(r["rss_mib"], key=lambda k: r["rss_mib"][k])
        split = f"{r['peak_mib']:.2f} ({r['anon_mib'][peak_key]:.1f}+{r['file_mib'][peak_key]:.1f})"
        each = "/".join(f"{x:.1f}" for x in r.get("peak_mib_each", []))
        print(f"  {r['host']:<11} {r['kubernetes']:<10} {r['tree']:<12}{cells}{split:>22}{r['time_to_ready_s']:>9}"
              f"  {each}")


def print_report(r: dict) -> None:
    rep = r["report"]
    print(f"\n== the agent's own data after the requests and passes ({r['host']}, kubernetes {r['kubernetes']}), "
          f"KiB (objects reachable from each, each counted once)")
    for row in rep["caches"]:
        if row["bytes"] >= 1024:
            print(f"  {row['name']:<70} {row['bytes'] / 1024:>8.0f} ({row['objects']} objects)")
    print(f"  {'all of the above':<70} {sum(x['bytes'] for x in rep['caches']) / 1024:>8.0f}")
    pm, ma = rep.get("pymalloc") or {}, rep.get("malloc") or {}
    print(f"  allocators (after malloc_trim): CPython small objects {pm.get('in_use', 0) / 2**20:.1f} MiB in use, "
          f"{(pm.get('free_in_pools', 0) + pm.get('unused_pools', 0)) / 2**20:.1f} MiB free in "
          f"{pm.get('arenas', 0)} arenas; glibc {ma.get('in_use', 0) / 2**20:.1f} MiB in use, "
          f"{ma.get('free_kept', 0) / 2**20:.1f} MiB free but kept; {len(rep['threads'])} threads, "
          f"{rep['gc_objects']} objects tracked by gc")
    print(f"  after malloc_trim(0): {r['after_malloc_trim_mib']:.2f} MiB "
          f"(was {r['rss_mib'][list(r['rss_mib'])[-1]]:.2f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", default="small-2cpu,dgx-8gpu", help="fixture hosts, comma-separated")
    ap.add_argument("--kube", choices=("off", "on", "both"), default="both")
    ap.add_argument("--requests", type=int, default=20000, help="requests in all (default 20000)")
    ap.add_argument("--passes", type=int, default=3, help="passes after the requests (default 3)")
    ap.add_argument("--interval", type=float, default=2.0, help="agent --interval (default 2)")
    ap.add_argument("--runs", type=int, default=3, help="runs of each agent, interleaved; medians (default 3)")
    ap.add_argument("--ref", help="also measure this revision (git archive), interleaved with this tree")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    hosts = [h.strip() for h in a.hosts.split(",") if h.strip()]
    modes = {"off": [False], "on": [True], "both": [False, True]}[a.kube]

    sys.path.insert(0, str(REPO))
    work = Path(tempfile.mkdtemp(prefix="gpu-tune-bench-rss-"))
    trees = {}
    if a.ref:
        trees[a.ref] = compiled_copy(None, a.ref, work / "ref")
    trees["this tree"] = compiled_copy(REPO, None, work / "this")
    kube = Kube(work) if True in modes else None
    every: dict[tuple[str, str, bool], list[dict]] = {}
    try:
        for i in range(a.runs):
            for want_kube in modes:
                for host in hosts:
                    for name, tree in trees.items():
                        print(f"-- run {i + 1}/{a.runs}: {host}, kubernetes {'on' if want_kube else 'off'}, {name}",
                              file=sys.stderr, flush=True)
                        every.setdefault((name, host, want_kube), []).append(
                            measure(tree, name, host, kube if want_kube else None, a, work,
                                    report=name == "this tree" and i == a.runs - 1))
    finally:
        if kube is not None:
            kube.close()
    runs = [median_run(rs) for rs in every.values()]

    this = [r for r in runs if r["tree"] == "this tree"]
    first = next(r for r in this if r["kubernetes"] == "off") if any(r["kubernetes"] == "off" for r in this) else this[0]
    base_modules = first["report"]["modules"]
    imports = import_costs(trees["this tree"], base_modules + ["pynvml", "gpu_tune.gpu.nvml"], work)
    rows = imports["modules"]
    nvml_from = next((i for i, row in enumerate(rows) if row[0] in ("pynvml", "gpu_tune.gpu.nvml")), len(rows))
    agent_pkgs = by_package([row for row in rows[:nvml_from] if row[0] in set(base_modules)])
    gpu_pkgs = by_package(rows[nvml_from:])
    kube_pkgs: list[dict] = []
    with_kube = [r for r in this if r["kubernetes"] == "on"]
    if with_kube and first["kubernetes"] == "off":
        extra = [m for m in with_kube[0]["report"]["modules"] if m not in set(base_modules)]
        kube_imports = import_costs(trees["this tree"], base_modules + extra, work)
        kube_pkgs = by_package([row for row in kube_imports["modules"] if row[0] in set(extra)])
        cluster_set = set(in_cluster_modules(trees["this tree"]))
        if cluster_set:
            kubeconfig_only = [row for row in kube_imports["modules"] if row[0] in set(extra) - cluster_set]
            kubeconfig_kib = sum(row[1] + row[2] for row in kubeconfig_only)
            for r in with_kube:
                r["kubeconfig_loader_mib"] = mib(kubeconfig_kib)
                r["in_cluster_estimate_mib"] = round(r["peak_mib"] - kubeconfig_kib / 1024, 2)
    heavy = {r["host"] + "/" + r["kubernetes"]: sorted({h for h in HEAVY for m in r["report"]["modules"]
                                                       if m == h or m.startswith(h + ".")}) for r in this}

    checks: dict[str, bool] = {}
    for r in this:
        tag = f"{'with Kubernetes' if r['kubernetes'] == 'on' else '--no-kube'} on {r['host']}"
        checks[f"{tag}: peak RSS {r['peak_mib']:.2f} MiB (median of {r['runs']}) < {LIMIT:g} MiB"] = r["peak_mib"] < LIMIT
        checks[f"{tag}: growth over the last {a.requests - a.requests // 2} requests "
               f"{r['growth_requests_mib']:.2f} MiB < 1 MiB"] = r["growth_requests_mib"] < 1.0
        checks[f"{tag}: SIGTERM exits 0"] = r["exit_code_on_sigterm"] == 0

    if a.json:
        print(json.dumps({"runs": runs, "imports": agent_pkgs, "kubernetes_imports": kube_pkgs,
                          "gpu_node_imports": gpu_pkgs, "heavy_modules": heavy, "checks": checks}, indent=1))
    else:
        print_totals(runs)
        if a.ref:
            print("\n== change (this tree - " + a.ref + "), MiB at the peak")
            for r in this:
                old = next(o for o in runs if o["tree"] == a.ref and o["host"] == r["host"]
                           and o["kubernetes"] == r["kubernetes"])
                print(f"  {r['host']:<11} kubernetes {r['kubernetes']:<4} {r['peak_mib'] - old['peak_mib']:+7.2f} "
                      f"(anon {max(r['anon_mib'].values()) - max(old['anon_mib'].values()):+.2f}, "
                      f"file {max(r['file_mib'].values()) - max(old['file_mib'].values()):+.2f})")
        print_imports(f"imports, in the order the agent finished them ({first['host']}, kubernetes "
                      f"{first['kubernetes']}; interpreter and site before them: "
                      f"{mib(sum(imports['start'])):.1f} MiB in the measuring process)", agent_pkgs)
        if kube_pkgs:
            print_imports("what the kubernetes client adds (kubernetes on)", kube_pkgs, shown_kib=50)
        if gpu_pkgs:
            print_imports("what a GPU node's NVML backend adds (gpu_tune.gpu.nvml; libnvidia-ml.so needs a GPU)",
                          gpu_pkgs, shown_kib=0)
        for r in this:
            print_report(r)
        print("\n== heavy modules loaded: " + "; ".join(f"{k}: {', '.join(v) or 'none'}" for k, v in heavy.items()))
        for r in this:
            if "in_cluster_estimate_mib" in r:
                ok = r["in_cluster_estimate_mib"] < LIMIT
                print(f"   with Kubernetes on {r['host']}, in a cluster (the service account: the kubeconfig loader's "
                      f"{r['kubeconfig_loader_mib']:.2f} MiB of imports not made): about "
                      f"{r['in_cluster_estimate_mib']:.2f} MiB, {'' if ok else 'not '}under {LIMIT:g} MiB")
        for k, ok in checks.items():
            print(f"{'PASS' if ok else 'FAIL'}  {k}")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
