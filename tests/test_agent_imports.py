"""What the agent keeps resident: after its first pass, ``gpu-tune serve`` (the real command, in
a process of its own) has not imported what it does not use. The memory figures themselves are
benchmarks/bench_rss.py's: these tests hold on any machine.

- the command line (typer, rich, gpu_tune.cli): ``serve`` re-executes itself as the agent alone
  (gpu_tune/serve/lean.py);
- FastAPI and the OpenTelemetry its import brings: the app is Starlette's, FastAPI makes
  /openapi.json when it is asked for (gpu_tune/serve/app.py);
- of the kubernetes client, the generated API classes and models, the dynamic client, watch,
  stream, leader election and the informers (gpu_tune/cluster/kube_client.py);
- the probe's TensorFlow and NumPy (they run in the probe's own process), pydantic.v1.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

# What no agent may have imported after its first pass (gpu_tune.cli itself is the entry point).
NEVER = ("typer", "rich", "gpu_tune.cli.", "fastapi", "opentelemetry", "pydantic.v1", "tensorflow", "numpy",
         "keras", "pynvml", "kubernetes.dynamic", "kubernetes.watch", "kubernetes.stream",
         "kubernetes.leaderelection", "kubernetes.informer", "kubernetes.client.api.", "kubernetes.client.models.",
         "kubernetes.utils.create_from_yaml", "jsonschema", "websocket")
# What the in-cluster configuration does not need either: the kubeconfig loader and its OAuth.
NOT_IN_CLUSTER = ("kubernetes.config.kube_config", "requests", "oauthlib", "requests_oauthlib")
# uvicorn's command line and supervisors (gpu_tune/serve/httpserver.py loads Config and Server alone).
NOT_UVICORN = ("click", "uvicorn.main", "uvicorn.supervisors", "uvicorn._subprocess")
# importlib.metadata whole, imported for pydantic's plugins and urllib3's h2 check (gpu_tune/serve/lean.py).
NOT_METADATA = ("importlib.metadata._adapters", "importlib.metadata._meta", "zipfile", "csv")

# Runs the real command line in this process (as the console script does) and, after the first
# pass the agent published, writes sys.modules to OUT and ends the agent as systemd would (SIGTERM).
DRIVER = """
import json, os, signal, sys, threading
out = sys.argv.pop(1)
from gpu_tune.cli import main  # first, as the console script: the entry point the agent starts at
from gpu_tune.serve import snapshot
first = threading.Event()
publish = snapshot.AgentState.publish
def published(self, snap):
    publish(self, snap)
    first.set()
snapshot.AgentState.publish = published
def report():
    first.wait()
    with open(out + ".part", "w") as f:
        json.dump({"pid": os.getpid(), "modules": sorted(sys.modules)}, f)
    os.replace(out + ".part", out)
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=report, daemon=True).start()
sys.argv[0] = "gpu-tune"
main()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _heavy(modules: list[str], prefixes: tuple[str, ...]) -> list[str]:
    """The modules under ``prefixes``: a package and its modules, or (a prefix ending in ".")
    only the modules beneath it."""
    return sorted(m for m in modules for p in prefixes
                  if (m.startswith(p) if p.endswith(".") else (m == p or m.startswith(p + "."))))


def agent_modules(tmp_path: Path, root: Path, *where: str) -> dict:
    """sys.modules of ``gpu-tune serve`` after its first published pass, and its PID."""
    driver, out = tmp_path / "driver.py", tmp_path / "modules.json"
    driver.write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_TUNE_")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen([sys.executable, str(driver), str(out), "--root", str(root), "--gpu-backend", "none",
                             "serve", "--host", "127.0.0.1", "--port", str(_free_port()), "--mode", "audit",
                             "--probe-interval", "0", "--interval", "600", *where],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert out.exists(), f"the agent never published a pass (exit {proc.returncode}): {err[-2000:]}"
    assert proc.returncode == 0, err[-2000:]
    doc = json.loads(out.read_text())
    doc["agent_pid"] = proc.pid
    return doc


def test_agent_without_kubernetes_keeps_only_what_it_uses(tmp_path, make_host):
    doc = agent_modules(tmp_path, make_host("small-2cpu"), "--no-kube")
    assert doc["pid"] == doc["agent_pid"], "the agent is the process that was started (exec, not a child)"
    assert _heavy(doc["modules"], NEVER + NOT_UVICORN + NOT_METADATA + ("multiprocessing",)) == []
    assert not any(m == "kubernetes" or m.startswith("kubernetes.") for m in doc["modules"])
    assert "gpu_tune.serve.lean" in doc["modules"] and "starlette.applications" in doc["modules"]


def test_agent_publishing_to_a_real_api_server_keeps_only_what_it_uses(tmp_path, make_host, api):
    from tests.realkube.testapi import write_kubeconfig

    api.add_node("imports-n1")
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url)
    doc = agent_modules(tmp_path, make_host("small-2cpu"), "--kubeconfig", str(kubeconfig), "--node", "imports-n1")
    assert _heavy(doc["modules"], NEVER + NOT_UVICORN) == []
    assert "kubernetes.client.api_client" in doc["modules"]
    assert api.node("imports-n1")["metadata"].get("labels"), "the pass was published to the Node"


def _run(code: str) -> dict:
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


def test_in_cluster_client_needs_neither_the_kubeconfig_loader_nor_the_rest_of_the_package():
    modules = _run("import json, sys\n"
                   "from gpu_tune.serve.lean import defer_package_metadata\n"
                   "defer_package_metadata()\n"
                   "from gpu_tune.cluster.kube_client import modules\n"
                   "client, config = modules()\n"
                   "api = client.ApiClient(client.Configuration())\n"
                   "config.load_incluster_config, config.ConfigException\n"
                   "from kubernetes.client.exceptions import ApiException\n"
                   "print(json.dumps(sorted(sys.modules)))\n")
    assert _heavy(modules, NEVER + NOT_IN_CLUSTER + NOT_METADATA) == []


def test_the_rest_of_the_kubernetes_package_loads_on_first_use():
    doc = _run("import json\n"
               "from gpu_tune.cluster.kube_client import modules\n"
               "client, config = modules()\n"
               "import kubernetes\n"
               "from kubernetes import watch, utils\n"
               "from kubernetes.client import CoreV1Api, V1Node\n"
               "print(json.dumps({'version': kubernetes.__version__, 'api': CoreV1Api.__name__,\n"
               "  'model': client.models.V1Node.__name__, 'same': V1Node is client.models.V1Node,\n"
               "  'watch': watch.Watch.__name__, 'quantity': int(utils.parse_quantity('1Ki')),\n"
               "  'kubeconfig': config.load_kube_config.__name__, 'missing': hasattr(client, 'NoSuchThing')}))\n")
    assert doc == {"version": doc["version"], "api": "CoreV1Api", "model": "V1Node", "same": True, "watch": "Watch",
                   "quantity": 1024, "kubeconfig": "load_kube_config", "missing": False}
    assert doc["version"]


def test_uvicorn_loaded_part_by_part_and_the_rest_on_first_use():
    doc = _run("import json, sys\n"
               "from gpu_tune.serve import httpserver\n"
               "import uvicorn\n"
               "before = sorted(m for m in sys.modules if m == 'click' or m.startswith('uvicorn.'))\n"
               "config = uvicorn.Config(lambda *a: None, port=1)\n"
               "from uvicorn.config import Config\n"
               "from uvicorn.server import Server\n"
               "same = uvicorn.Config is Config and uvicorn.Server is Server\n"
               "run = uvicorn.run\n"  # a name only uvicorn's __init__ sets: it runs now, whole
               "print(json.dumps({'before': before, 'same': same, 'run': run.__module__,\n"
               "  'click': 'click' in sys.modules, 'version': uvicorn.__version__}))\n")
    assert "click" not in doc["before"] and "uvicorn.main" not in doc["before"], doc["before"]
    assert "uvicorn.config" in doc["before"] and "uvicorn.server" in doc["before"]
    assert doc["same"] and doc["run"] == "uvicorn.main" and doc["click"]
    assert doc["version"]


def test_package_metadata_whole_on_first_use_and_no_pydantic_plugins():
    doc = _run("import json, os, sys\n"
               "from gpu_tune.serve.lean import defer_package_metadata\n"
               "defer_package_metadata()\n"
               "import gpu_tune.tune.profile\n"
               "import gpu_tune.judge.checks.state_file\n"
               "before = 'zipfile' in sys.modules\n"
               "from importlib.metadata import entry_points, version, PackageNotFoundError\n"
               "import pydantic\n"
               "try:\n"
               "    version('no-such-package-here')\n"
               "    missing = False\n"
               "except PackageNotFoundError:\n"
               "    missing = True\n"
               "print(json.dumps({'before': before, 'after': 'zipfile' in sys.modules,\n"
               "  'scripts': sorted(e.name for e in entry_points(group='console_scripts') if e.name == 'gpu-tune'),\n"
               "  'version': version('pydantic') == pydantic.VERSION, 'missing': missing,\n"
               "  'plugins': os.environ.get('PYDANTIC_DISABLE_PLUGINS')}))\n")
    assert doc == {"before": False, "after": True, "scripts": ["gpu-tune"], "version": True, "missing": True,
                   "plugins": "__all__"}


def test_a_users_pydantic_plugin_setting_is_kept():
    p = subprocess.run([sys.executable, "-c", "import os\n"
                        "from gpu_tune.serve.lean import defer_package_metadata\n"
                        "defer_package_metadata()\n"
                        "print(os.environ['PYDANTIC_DISABLE_PLUGINS'])\n"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO), "PYDANTIC_DISABLE_PLUGINS": "logfire"})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "logfire"


def test_partial_import_of_a_package_that_is_not_installed_leaves_nothing():
    doc = _run("import json, sys\n"
               "from gpu_tune import partial_import\n"
               "try:\n"
               "    partial_import.install(('no_such_package_here',), {'no_such_package_here.X': ('no_such_package_here.x', 'X')})\n"
               "    err = None\n"
               "except ImportError as exc:\n"
               "    err = str(exc)\n"
               "try:\n"  # installed, but a named module is missing: rolled back whole
               "    partial_import.install(('yaml',), {'yaml.Nope': ('yaml.no_such_module', 'Nope')})\n"
               "    err2 = None\n"
               "except ImportError as exc:\n"
               "    err2 = type(exc).__name__\n"
               "left = sorted(m for m in sys.modules if m.startswith(('no_such_package_here', 'yaml')))\n"
               "import yaml\n"
               "print(json.dumps({'err': err, 'err2': err2, 'left': left, 'yaml': yaml.safe_load('a: 1')}))\n")
    assert doc["err"] and "no_such_package_here" in doc["err"]
    assert doc["err2"] == "ModuleNotFoundError" and doc["left"] == [] and doc["yaml"] == {"a": 1}


def _fake_packages(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_a_uvicorn_without_the_named_modules_is_imported_whole(tmp_path):
    """A uvicorn laid out otherwise (no uvicorn/config.py or server.py: the names in its __init__)
    is imported whole: the agent's HTTP server still gets its Config and Server."""
    fake = _fake_packages(tmp_path, {
        "uvicorn/__init__.py": "WHOLE = True\nclass Config:\n    pass\nclass Server:\n    pass\n",
        "uvicorn/protocols/__init__.py": "", "uvicorn/protocols/http/__init__.py": "",
        "uvicorn/protocols/http/httptools_impl.py": "class HttpToolsProtocol:\n    pass\n"})
    p = subprocess.run([sys.executable, "-c", "import json\nfrom gpu_tune.serve import httpserver\nimport uvicorn\n"
                        "print(json.dumps([uvicorn.__file__, uvicorn.WHOLE, uvicorn.Config.__module__]))\n"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": f"{fake}:{REPO}"})
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout) == [str(fake / "uvicorn" / "__init__.py"), True, "uvicorn"]


def test_a_kubernetes_client_without_the_named_modules_is_imported_whole(tmp_path):
    fake = _fake_packages(tmp_path, {
        "kubernetes/__init__.py": "", "kubernetes/utils/__init__.py": "", "kubernetes/client/models/__init__.py": "",
        "kubernetes/client/__init__.py": "WHOLE = True\nclass ApiClient:\n    pass\nclass Configuration:\n    pass\n",
        "kubernetes/config/__init__.py": "class ConfigException(Exception):\n    pass\n"
                                         "def load_incluster_config():\n    pass\n"})
    p = subprocess.run([sys.executable, "-c", "import json\nfrom gpu_tune.cluster.kube_client import modules\n"
                        "client, config = modules()\n"
                        "print(json.dumps([client.WHOLE, client.ApiClient.__module__, config.ConfigException.__name__]))\n"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": f"{fake}:{REPO}"})
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout) == [True, "kubernetes.client", "ConfigException"]
