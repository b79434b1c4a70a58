"""Bad input of every kind: exit 2, one line on stderr naming what and where, no traceback, and
the host tree, the profiles and the GPU fixture byte for byte as they were.

A table of hand-made cases (profiles, GPU fixtures, journals, roots, CPU lists, numbers) runs
through the CLI's own ``main()`` in this process; a handful also run as the real process; and
hypothesis mutates profiles, fixtures, journals and CPU lists within a bounded number of examples.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_tune.cli import main
from gpu_tune.errors import InputError
from gpu_tune.host.parse import MAX_CPU, ParseError, parse_cpulist, parse_cpumask
from tests import skips
from tests.conftest import GPU_FIXTURES, REPO, run_cli

POLICIES = REPO / "policies"
JOURNAL = "var/lib/gpu-tune/journal.json"
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def tree_digest(*roots: Path) -> str:
    """One hash over every file's bytes and mode, every folder and every link under ``roots``."""
    h = hashlib.sha256()
    for root in roots:
        if root.is_file():
            h.update(root.read_bytes())
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(dirnames + filenames):
                p = os.path.join(dirpath, name)
                st_ = os.lstat(p)
                h.update(f"{os.path.relpath(p, root)}\0{st_.st_mode:o}\0".encode())
                if os.path.islink(p):
                    h.update(os.readlink(p).encode())
                elif name in filenames and not stat.S_ISREG(st_.st_mode):
                    h.update(f"{st_.st_size}\0{st_.st_rdev}".encode())  # a FIFO or a device: never opened
                elif name in filenames:
                    with open(p, "rb") as fh:
                        h.update(fh.read())
    return h.hexdigest()


class World:
    """A host tree, a copy of the shipped profiles and a copy of a GPU fixture, in tmp_path."""

    def __init__(self, tmp_path: Path, root: Path) -> None:
        self.tmp = tmp_path
        self.root = root
        self.pol = tmp_path / "pol"
        shutil.copytree(POLICIES, self.pol)
        self.fixture = tmp_path / "gpus.json"
        self.fixture.write_text((GPU_FIXTURES / "dgx-8gpu.json").read_text())

    def profile(self, text: str | bytes) -> list[str]:
        p = self.pol / "x.yaml"
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        return ["--policy-dir", str(self.pol), "--profile", "x", "--gpu-backend", "none"]

    def gpus(self, text: str | bytes) -> list[str]:
        self.fixture.write_bytes(text if isinstance(text, bytes) else text.encode())
        return ["--policy-dir", str(self.pol), "--gpu-backend", "fixture", "--gpu-fixture", str(self.fixture)]

    def gpu0(self, **changes) -> list[str]:
        doc = json.loads((GPU_FIXTURES / "dgx-8gpu.json").read_text())
        doc["gpus"][0].update(changes)
        return self.gpus(json.dumps(doc))

    def journal(self, doc) -> list[str]:
        j = self.root / JOURNAL
        j.parent.mkdir(parents=True, exist_ok=True)
        j.write_text(doc if isinstance(doc, str) else json.dumps(doc))
        return ["--policy-dir", str(self.pol), "--gpu-backend", "none"]

    def host_file(self, host_path: str, text: str) -> None:
        """Plant a file on the host tree (before the digest is taken)."""
        p = self.root / host_path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    def digest(self) -> str:
        return tree_digest(self.root, self.pol, self.fixture)


@pytest.fixture
def world(tmp_path, make_host, monkeypatch):
    for k in ("GPU_TUNE_ROOT", "GPU_TUNE_PROFILE", "GPU_TUNE_POLICY_DIR", "GPU_TUNE_GPU_BACKEND",
              "GPU_TUNE_GPU_FIXTURE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    return World(tmp_path, make_host("small-2cpu"))


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    else:  # pragma: no cover - main always exits
        code = 0
    out, err = capsys.readouterr()
    return code, out, err


def assert_bad_input(code: int, err: str, *expect: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, f"exit {code}, stderr: {err[:2000]}"
    assert "Traceback" not in err
    assert len(lines) == 1, err[:2000]
    assert lines[0].startswith("gpu-tune: error: ") and len(lines[0]) < 1100, lines[0][:1200]
    for e in expect:
        assert e in lines[0], lines[0]
    return lines[0]


def nested_yaml(depth: int) -> str:
    return "name: x\nsysctl: " + "[" * depth + "]" * depth + "\n"


def nested_json(depth: int) -> str:
    return '{"gpus": [{"index": 0, "uuid": "u", "name": "n", "pci_bus_id": "0000:18:00.0", "x": ' \
           + "[" * depth + "]" * depth + "}]}"


def alias_bomb() -> str:
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + "\nsummary: *a8\n"


def _two_gpus(uuid="GPU-a", uuid2="GPU-b", bus="0000:18:00.0", bus2="0000:9a:00.0") -> str:
    g = {"name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559}
    return json.dumps({"gpus": [{**g, "index": 0, "uuid": uuid, "pci_bus_id": bus},
                                {**g, "index": 1, "uuid": uuid2, "pci_bus_id": bus2}]})


def _include_chain(pol: Path, n: int) -> str:
    """A profile whose includes run through ``n`` files, each including the next."""
    for i in range(n):
        (pol / f"_c{i}.yaml").write_text(f"include: _c{i + 1}.yaml\n" if i + 1 < n else "summary: end\n")
    return "name: x\ninclude: _c0.yaml\n"


def entry(**kw):
    return {"id": "sysctl.vm.swappiness", "target": "host", "family": "sysctl", "path": "/proc/sys/vm/swappiness",
            "value": "60", "seq": 1, **kw}


# (name, command, how to make the bad input -> extra argv, what the error line must contain)
Case = tuple[str, str, Callable[[World], list[str]], tuple[str, ...]]
CASES: list[Case] = [
    # profiles
    ("profile-not-utf8", "apply", lambda w: w.profile(b"name: x\nsummary: \"\xff\xfe\"\n"), ("x.yaml", "not UTF-8")),
    ("profile-latin1-key", "apply", lambda w: w.profile(b"name: x\nsysctl: {vm.swappiness\xe9: 1}\n"), ("not UTF-8",)),
    ("yaml-20000-deep", "apply", lambda w: w.profile(nested_yaml(20000)), ("x.yaml", "nested too deep")),
    ("yaml-block-1400-deep", "apply",
     lambda w: w.profile("name: x\nsysctl:\n" + "".join(" " * i + "k:\n" for i in range(1, 1400))), ("nested too deep",)),
    ("yaml-40-deep", "apply", lambda w: w.profile(nested_yaml(40)), ("nested too deep",)),
    ("yaml-alias-bomb", "apply", lambda w: w.profile(alias_bomb()), ("x.yaml", "too large")),
    ("profile-empty", "apply", lambda w: w.profile(""), ("x.yaml", "empty")),
    ("profile-whitespace", "apply", lambda w: w.profile("  \n\t\n\n"), ("x.yaml", "empty")),
    ("profile-comments-only", "apply", lambda w: w.profile("# nothing here\n"), ("x.yaml", "empty")),
    ("exclude-cpus-huge", "apply", lambda w: w.profile("name: x\nirq: {exclude_cpus: '0-4000000000'}\n"),
     ("irq.exclude_cpus", "8191")),
    ("exclude-cpus-8192", "apply", lambda w: w.profile("name: x\nirq: {exclude_cpus: '8192'}\n"), ("irq.exclude_cpus", "8191")),
    ("exclude-cpus-zero-stride", "apply", lambda w: w.profile("name: x\nirq: {exclude_cpus: '0-15:0'}\n"), ("irq.exclude_cpus",)),
    ("exclude-cpus-huge-stride", "apply", lambda w: w.profile("name: x\nirq: {exclude_cpus: '0-15:99999999999'}\n"),
     ("irq.exclude_cpus",)),
    ("exclude-cpus-unicode-digit", "apply", lambda w: w.profile("name: x\nirq: {exclude_cpus: '\u0663'}\n"), ("irq.exclude_cpus",)),
    ("sysctl-key-newline", "apply", lambda w: w.profile('name: x\nsysctl: {"vm.swappiness\\n": 10}\n'), ("sysctl", "not a sysctl key")),
    ("sysctl-value-newline", "apply", lambda w: w.profile('name: x\nsysctl: {vm.foo: "1\\n2"}\n'), ("vm.foo", "one line")),
    ("sysctl-int-huge", "apply", lambda w: w.profile("name: x\nsysctl: {vm.foo: 100000000000000000000000}\n"), ("vm.foo", "64 bits")),
    ("sysctl-bound-huge", "apply", lambda w: w.profile("name: x\nsysctl: {vm.foo: {min: 99999999999999999999999}}\n"),
     ("vm.foo.min", "64 bits")),
    ("interval-inf", "apply", lambda w: w.profile("name: x\nprobe: {interval_s: .inf}\n"), ("probe.interval_s", "finite")),
    ("accuracy-nan", "apply", lambda w: w.profile("name: x\nprobe: {accuracy_min: .nan}\n"), ("probe.accuracy_min", "finite")),
    ("temperature-minus-inf", "apply", lambda w: w.profile("name: x\nreadiness: {max_temperature_c: -.inf}\n"),
     ("readiness.max_temperature_c",)),
    ("memlock-overflow", "apply", lambda w: w.profile("name: x\nlimits: {memlock: {min: 99999999999999999999999T}}\n"),
     ("limits.memlock", "unlimited")),
    ("memlock-int-overflow", "apply", lambda w: w.profile(f"name: x\nlimits: {{memlock: {{min: {2**64}}}}}\n"), ("limits.memlock",)),
    ("malloc-conf-newline", "apply", lambda w: w.profile('name: x\nallocator: {malloc_conf: "background_thread:true\\n"}\n'),
     ("allocator.malloc_conf",)),
    ("profile-name-newline", "apply", lambda w: w.profile('name: "x\\n"\n'), ("name",)),
    # YAML numbers that read as something else, or cannot be read at all
    ("yaml-int-5000-digits", "apply", lambda w: w.profile("name: x\nsysctl:\n  vm.foo: " + "9" * 5000 + "\n"),
     ("x.yaml:3", "5000 digits")),
    ("yaml-key-5000-digits", "audit", lambda w: w.profile("name: x\n? " + "1" * 5000 + "\n: 1\n"), ("x.yaml:2", "digits")),
    ("yaml-hex-20000-bits", "apply", lambda w: w.profile("name: x\nsysctl: {vm.foo: 0x" + "f" * 5000 + "}\n"),
     ("x.yaml:2", "digits")),
    ("sysctl-leading-zero-quoted", "apply", lambda w: w.profile("name: x\nsysctl: {net.ipv4.tcp_rmem: '4096 087380 6291456'}\n"),
     ("net.ipv4.tcp_rmem", "087380", "octal")),
    ("include-int-5000-digits", "apply", lambda w: ((w.pol / "_y.yaml").write_text("summary: " + "7" * 4301 + "\n"),
                                                    w.profile("name: x\ninclude: _y.yaml\n"))[1],
     ("_y.yaml:1", "4301 digits")),
    ("baselines-int-5000-digits", "probe", lambda w: ((w.pol / "baselines.yaml").write_text(
        "cpu:\n  train_images_per_second: " + "1" * 5000 + "\n"),
        ["--policy-dir", str(w.pol), "--gpu-backend", "none", "--device", "cpu", "--timeout", "5"])[1],
     ("baselines.yaml:2", "digits")),
    ("sysctl-leading-zero", "apply", lambda w: w.profile("name: x\nsysctl:\n  vm.swappiness: 017\n"),
     ("x.yaml:3", "017", "leading zero", "octal")),
    ("sysctl-leading-zero-negative", "apply", lambda w: w.profile("name: x\nsysctl: {vm.foo: -010}\n"),
     ("x.yaml:2", "-010", "leading zero")),
    ("sysctl-leading-zero-bound", "apply", lambda w: w.profile("name: x\nsysctl: {vm.swappiness: {max: 0100}}\n"),
     ("0100", "leading zero")),
    ("sysctl-sexagesimal", "apply", lambda w: w.profile("name: x\nsysctl:\n  vm.swappiness: 1:30\n"),
     ("x.yaml:3", "1:30", "base 60")),
    ("baselines-leading-zero", "probe", lambda w: ((w.pol / "baselines.yaml").write_text(
        "cpu: {train_images_per_second: 0100}\n"),
        ["--policy-dir", str(w.pol), "--gpu-backend", "none", "--device", "cpu", "--timeout", "5"])[1],
     ("baselines.yaml:1", "0100", "leading zero")),
    ("allocator-env-file-outside-its-folder", "apply",
     lambda w: w.profile("name: x\nallocator: {preload: jemalloc, env_file: /etc/profile.d/x.sh}\n"),
     ("allocator.env_file", "/etc/gpu-tune/")),
    ("baselines-not-utf8", "probe", lambda w: ((w.pol / "baselines.yaml").write_bytes(b"gpus: \xff\n"),
                                               ["--policy-dir", str(w.pol), "--gpu-backend", "none", "--device", "cpu",
                                                "--timeout", "5"])[1], ("baselines.yaml", "not UTF-8")),
    ("baselines-inf", "probe", lambda w: ((w.pol / "baselines.yaml").write_text(
        "cpu: {train_images_per_second: .inf}\n"), ["--policy-dir", str(w.pol), "--gpu-backend", "none", "--device", "cpu",
                                                    "--timeout", "5"])[1], ("baselines.yaml",)),
    ("profile-key-twice", "apply", lambda w: w.profile("name: x\nsysctl:\n  vm.swappiness: 0\n  vm.swappiness: 100\n"),
     ("x.yaml:4", "'vm.swappiness' given twice (lines 3 and 4)")),
    ("profile-key-twice-flow", "audit", lambda w: w.profile("name: x\nsysctl: {vm.swappiness: 0, vm.swappiness: 100}\n"),
     ("x.yaml:2", "'vm.swappiness' given twice")),
    ("profile-two-sysctl-blocks", "audit", lambda w: w.profile(
        "name: x\nsysctl:\n  vm.swappiness: 0\nthp: {enabled: always}\nsysctl:\n  vm.dirty_ratio: 20\n"),
     ("x.yaml:5", "'sysctl' given twice (lines 2 and 5)")),
    ("include-key-twice", "apply", lambda w: ((w.pol / "_y.yaml").write_text("thp:\n  enabled: never\n  enabled: always\n"),
                                              w.profile("name: x\ninclude: _y.yaml\n"))[1],
     ("_y.yaml:3", "'enabled' given twice (lines 2 and 3)")),
    ("baselines-key-twice", "probe", lambda w: ((w.pol / "baselines.yaml").write_text(
        "cpu: {train_images_per_second: 10}\ncpu: {train_images_per_second: 20}\n"),
        ["--policy-dir", str(w.pol), "--gpu-backend", "none", "--device", "cpu", "--timeout", "5"])[1],
     ("baselines.yaml:2", "'cpu' given twice (lines 1 and 2)")),
    ("include-nul", "apply", lambda w: w.profile('name: x\ninclude: "_base\\0.yaml"\n'), ("x.yaml", "include", "\\x00")),
    ("include-newline", "apply", lambda w: w.profile('name: x\ninclude: "_base\\n.yaml"\n'), ("x.yaml", "include")),
    ("include-name-too-long", "apply", lambda w: w.profile(f"name: x\ninclude: {'a' * 300}.yaml\n"), ("x.yaml", "include")),
    ("include-too-many-files", "apply", lambda w: w.profile(_include_chain(w.pol, 70)), ("includes more than 64 files",)),
    ("profile-lone-surrogate", "apply", lambda w: w.profile('name: x\nsummary: "\\ud800"\n'),
     ("x.yaml", "summary", "lone surrogate")),
    ("policy-file-fifo", "apply", lambda w: (os.mkfifo(w.pol / "_f.yaml"), w.profile("name: x\ninclude: _f.yaml\n"))[1],
     ("_f.yaml", "FIFO")),
    # GPU fixtures
    ("gpu-fixture-two-gpus-lists", "apply", lambda w: w.gpus('{"gpus": [],\n "driver_version": "570.1",\n "gpus": []}'),
     ("gpus.json:3", "'gpus' given twice (lines 1 and 3)")),
    ("gpu-key-twice", "apply", lambda w: w.gpus('{"gpus": [{"index": 0, "uuid": "u", "name": "n",\n'
                                                '"pci_bus_id": "0000:18:00.0",\n"index": 1}]}'),
     ("gpus.json:3", "'index' given twice (lines 1 and 3)")),
    ("gpu-uuid-twice", "apply", lambda w: w.gpus(_two_gpus(uuid="GPU-a", uuid2="gpu-A")), ("gpus[1].uuid", "gpus[0]")),
    ("gpu-bus-id-twice", "apply", lambda w: w.gpus(_two_gpus(bus="0000:18:00.0", bus2="18:00.0")),
     ("gpus[1].pci_bus_id", "gpus[0]")),
    ("gpu-name-lone-surrogate", "topology", lambda w: w.gpu0(name="H100\ud800"), ("gpus.json", "gpus[0].name", "surrogate")),
    ("gpu-fixture-fifo", "apply", lambda w: (w.fixture.unlink(), os.mkfifo(w.fixture),
                                             ["--gpu-backend", "fixture", "--gpu-fixture", str(w.fixture)])[2],
     ("gpus.json", "FIFO")),
    ("json-100000-deep", "apply", lambda w: w.gpus(nested_json(100_000)), ("gpus.json", "nested too deep")),
    ("json-40-deep", "apply", lambda w: w.gpus(nested_json(40)), ("nested too deep",)),
    ("json-not-utf8", "apply", lambda w: w.gpus(b'{"gpus": [], "x": "\xff"}'), ("not UTF-8",)),
    ("json-nan", "apply", lambda w: w.gpus('{"gpus": [{"index": 0, "uuid": "u", "name": "n", '
                                           '"pci_bus_id": "0000:18:00.0", "power_w": NaN}]}'), ("finite",)),
    ("json-1e400", "apply", lambda w: w.gpus('{"gpus": [{"index": 0, "uuid": "u", "name": "n", '
                                             '"pci_bus_id": "0000:18:00.0", "temperature_c": 1e400}]}'), ("finite",)),
    ("gpu-memory-negative", "apply", lambda w: w.gpu0(memory_total_mib=-1), ("gpus[0].memory_total_mib",)),
    ("gpu-memory-zero", "apply", lambda w: w.gpu0(memory_total_mib=0), ("gpus[0].memory_total_mib",)),
    ("gpu-memory-huge", "apply", lambda w: w.gpu0(memory_total_mib=10**15), ("gpus[0].memory_total_mib",)),
    ("gpu-memory-used-over-total", "apply", lambda w: w.gpu0(memory_used_mib=90000), ("gpus[0].memory_used_mib",)),
    ("pcie-gen-huge", "apply", lambda w: w.gpu0(pcie_link_gen_max=10**40), ("gpus[0].pcie_link_gen_max", "1..7")),
    ("pcie-gen-negative", "apply", lambda w: w.gpu0(pcie_link_gen_current=-3), ("gpus[0].pcie_link_gen_current",)),
    ("pcie-gen-8", "apply", lambda w: w.gpu0(pcie_link_gen_max=8), ("pcie_link_gen_max",)),
    ("pcie-width-3", "apply", lambda w: w.gpu0(pcie_link_width_current=3), ("pcie_link_width_current",)),
    ("pcie-width-64", "apply", lambda w: w.gpu0(pcie_link_width_max=64), ("pcie_link_width_max",)),
    ("gpu-index-huge", "apply", lambda w: w.gpu0(index=10**30), ("gpus[0].index", "0..1023")),
    ("gpu-index-1024", "apply", lambda w: w.gpu0(index=1024), ("gpus[0].index",)),
    ("gpu-temperature-500", "apply", lambda w: w.gpu0(temperature_c=500), ("temperature_c",)),
    ("gpu-temperature-negative", "apply", lambda w: w.gpu0(temperature_c=-10), ("temperature_c",)),
    ("gpu-power-negative", "apply", lambda w: w.gpu0(power_w=-1), ("power_w",)),
    ("gpu-utilization-101", "apply", lambda w: w.gpu0(utilization_percent=101), ("utilization_percent",)),
    ("gpu-cpu-affinity-huge", "apply", lambda w: w.gpu0(cpu_affinity="0-4000000000"), ("gpus[0].cpu_affinity", "8191")),
    ("gpu-cpu-affinity-8192", "apply", lambda w: w.gpu0(cpu_affinity="8192"), ("cpu_affinity",)),
    ("gpu-process-pid-huge", "apply", lambda w: w.gpu0(processes=[10**20]), ("processes",)),
    ("gpu-bus-id-newline", "apply", lambda w: w.gpu0(pci_bus_id="0000:18:00.0\n"), ("pci_bus_id",)),
    ("gpu-compute-capability", "apply", lambda w: w.gpu0(compute_capability="9.0\n"), ("compute_capability",)),
    # journals
    ("journal-seq-string", "revert", lambda w: w.journal({"format": 1, "entries": [entry(seq="x")]}),
     ("journal.json", "entry 0", "seq")),
    ("journal-seq-string-apply", "apply", lambda w: w.journal({"format": 1, "entries": [entry(seq="x")]}),
     ("journal.json", "entry 0", "seq")),
    ("journal-seq-bool", "revert", lambda w: w.journal({"entries": [entry(), entry(target="t2", seq=True)]}), ("entry 1", "seq")),
    ("journal-seq-negative", "revert", lambda w: w.journal({"entries": [entry(seq=-1)]}), ("seq",)),
    ("journal-seq-float", "revert", lambda w: w.journal({"entries": [entry(seq=1.5)]}), ("seq",)),
    ("journal-raw-not-base64", "revert", lambda w: w.journal({"entries": [entry(raw="%%%")]}), ("raw",)),
    ("journal-ncpus-huge", "revert", lambda w: w.journal({"entries": [entry(family="irq", ncpus=10**12)]}), ("ncpus",)),
    ("journal-value-object", "revert", lambda w: w.journal({"entries": [entry(value={"a": 1})]}), ("value",)),
    ("journal-path-relative", "revert", lambda w: w.journal({"entries": [entry(path="proc/sys/vm/swappiness")]}), ("path",)),
    ("journal-entries-not-list", "revert", lambda w: w.journal({"entries": {}}), ("journal.json",)),
    ("journal-not-object", "revert", lambda w: w.journal("[1, 2]"), ("journal.json",)),
    ("journal-entry-not-object", "revert", lambda w: w.journal({"entries": [1]}), ("entry 0",)),
    ("journal-deep", "revert", lambda w: w.journal('{"entries": ' + "[" * 100_000 + "]" * 100_000 + "}"),
     ("journal.json", "nested too deep")),
    ("journal-key-twice", "revert", lambda w: w.journal('{"format": 1,\n "entries": [],\n "entries": []}'),
     ("journal.json:3 under", "'entries' given twice (lines 2 and 3)")),
    ("journal-entry-key-twice", "apply", lambda w: w.journal(
        '{"entries": [{"id": "sysctl.vm.swappiness", "target": "host", "family": "sysctl", "value": "60",\n'
        '"seq": 1, "value": "0"}]}'), ("journal.json:2 under", "'value' given twice (lines 1 and 2)")),
    ("journal-fifo", "revert", lambda w: (w.journal("{}"), (w.root / JOURNAL).unlink(), os.mkfifo(w.root / JOURNAL),
                                          ["--gpu-backend", "none"])[3], ("journal.json", "FIFO")),
    ("journal-sparse-2gb", "revert", lambda w: (w.journal("{}"), os.truncate(w.root / JOURNAL, 2 << 30),
                                                ["--gpu-backend", "none"])[2], ("journal.json", "larger than 64 MiB")),
    ("probe-state-key-twice", "label", lambda w: (w.journal("{}"), (w.root / JOURNAL).unlink(),
                                                  (w.root / "var/lib/gpu-tune/probe.json").write_text(
                                                      '{"profile": "training",\n"results": [],\n"results": []}'),
                                                  ["--gpu-backend", "none", "--dry-run", "--kubeconfig",
                                                   str(w.tmp / "no-kubeconfig")])[3],
     ("probe.json:3 under", "'results' given twice (lines 2 and 3)")),
    ("journal-missing-family", "apply", lambda w: w.journal({"entries": [{"id": "a", "target": "b"}]}), ("family",)),
    # a journal names only what its family writes: nothing else is believed, nothing is touched
    ("journal-path-dotdot", "revert", lambda w: w.journal({"entries": [entry(path="/proc/sys/../../etc/passwd")]}),
     ("journal.json", "entry 0", "'..'")),
    ("journal-path-dotdot-apply", "apply", lambda w: w.journal({"entries": [entry(path="/proc/sys/vm/../../../etc/x")]}),
     ("journal.json", "entry 0", "'..'")),
    ("journal-sysctl-writes-etc-passwd", "revert", lambda w: (w.host_file("/etc/passwd", "root:x:0:0::/root:/bin/bash\n"),
        w.journal({"entries": [entry(), entry(target="t2", seq=2, path="/etc/passwd",
                                              raw="cm9vdDp4OjA6MDo6L3Jvb3Q6L2Jpbi9zaAo=")]}))[1],
     ("journal.json", "entry 1", "sysctl.vm.swappiness[t2]", "/etc/passwd", "/proc/sys/")),
    ("journal-sysctl-writes-etc-passwd-apply", "apply", lambda w: w.journal({"entries": [entry(path="/etc/passwd")]}),
     ("entry 0", "/etc/passwd")),
    ("journal-allocator-removes-etc", "revert", lambda w: w.journal({"entries": [
        {"id": "allocator.preload", "target": "host", "family": "allocator", "path": "/etc/gpu-tune/allocator.env",
         "value": "absent", "raw": None, "absent": True, "created_dirs": ["/etc"], "seq": 1}]}),
     ("entry 0", "created_dirs", "'/etc'")),
    ("journal-allocator-deletes-a-file", "revert", lambda w: (w.host_file("/etc/hostname", "node-1\n"), w.journal(
        {"entries": [{"id": "allocator.preload", "target": "host", "family": "allocator", "path": "/etc/hostname",
                      "value": "absent", "raw": None, "absent": True, "created_dirs": [], "seq": 1}]}))[1],
     ("entry 0", "/etc/hostname", "allocator")),
    ("journal-irq-writes-sysctl", "revert", lambda w: w.journal({"entries": [
        entry(id="irq.affinity", target="120", family="irq", path="/proc/sys/vm/swappiness")]}),
     ("entry 0", "irq", "/proc/sys/vm/swappiness")),
    ("journal-cstates-file-elsewhere", "revert", lambda w: w.journal({"entries": [
        {"id": "cpu.cstates", "target": "cpu0", "family": "cstates", "value": "C6",
         "files": [{"path": "/etc/shadow", "value": "0", "raw": "MAo="}], "seq": 1}]}),
     ("entry 0", "files", "/etc/shadow")),
    ("journal-gpu-names-a-path", "revert", lambda w: w.journal({"entries": [
        {"id": "gpu.persistence_mode", "target": "0", "family": "gpu", "index": 0, "value": "off",
         "path": "/etc/passwd", "seq": 1}]}),
     ("entry 0", "gpu", "/etc/passwd")),
    ("journal-read-only-family", "revert", lambda w: w.journal({"entries": [
        {"id": "limits.memlock", "target": "containerd", "family": "limits", "value": "8388608",
         "path": "/proc/1/limits", "seq": 1}]}),
     ("entry 0", "limits")),
    ("journal-sysctl-without-path", "revert", lambda w: w.journal({"entries": [
        {"id": "sysctl.vm.swappiness", "target": "host", "family": "sysctl", "value": "60", "seq": 1}]}),
     ("entry 0", "path")),
    # roots and flags
    ("root-a-file", "apply", lambda w: ["--root", str(w.root / "proc/cmdline"), "--gpu-backend", "none"], ("not a directory",)),
    ("root-missing", "apply", lambda w: ["--root", str(w.tmp / "nope"), "--gpu-backend", "none"], ("no such directory",)),
    # (an unusable --host / --data makes a regression fail at once instead of serving or training)
    ("serve-interval-inf", "serve", lambda w: ["--no-kube", "--interval", "inf", "--gpu-backend", "none",
                                               "--host", "256.0.0.0"], ("--interval", "finite")),
    ("serve-probe-interval-nan", "serve", lambda w: ["--no-kube", "--probe-interval", "nan", "--gpu-backend", "none",
                                                     "--host", "256.0.0.0"], ("--probe-interval",)),
    ("probe-timeout-inf", "probe", lambda w: ["--timeout", "inf", "--gpu-backend", "none", "--data", "/nonexistent"],
     ("--timeout", "finite")),
    ("fleet-stale-after-nan", "fleet", lambda w: ["--stale-after", "nan"], ("--stale-after",)),
    ("profile-arg-newline", "apply", lambda w: ["--profile", "training\n", "--gpu-backend", "none"], ("profile",)),
]


@pytest.mark.parametrize("name,cmd,make,expect", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_line_and_changes_nothing(world, capsys, name, cmd, make, expect):
    extra = make(world)
    argv = [cmd, *extra] if "--root" in extra else [cmd, "--root", str(world.root), *extra]
    before = world.digest()
    t0 = time.process_time()
    code, _, err = run_main(argv, capsys)
    assert_bad_input(code, err, *expect)
    assert world.digest() == before
    # nothing expanded a huge CPU list or recursed for long: this process's own CPU seconds, which
    # other processes on a busy machine do not add to (minutes of work if it did, not a wall clock)
    assert time.process_time() - t0 < 30


@pytest.mark.parametrize("var", ["GPU_TUNE_FAILPOINT_WRITE_DELAY", "GPU_TUNE_LOCK_TIMEOUT"])
@pytest.mark.parametrize("value", ["-1", "nan", "inf", "1e308", "soon"])
def test_timing_variables_take_only_valid_seconds(world, capsys, monkeypatch, var, value):
    """Checked before the lock is taken or the journal written (a negative sleep was exit 3
    after the journal was on disk)."""
    monkeypatch.setenv(var, value)
    before = world.digest()
    code, _, err = run_main(["apply", "--root", str(world.root), "--gpu-backend", "none"], capsys)
    assert_bad_input(code, err, var, "seconds")
    assert world.digest() == before
    assert not (world.root / JOURNAL).exists()


def test_shared_includes_are_read_once(world, monkeypatch):
    """25 files, each including the next one twice: 2^24 paths through the graph, 25 reads."""
    from gpu_tune.tune import policy

    for i in range(25):
        nxt = f"include: [_s{i + 1}.yaml, _s{i + 1}.yaml]\n" if i < 24 else "sysctl: {vm.swappiness: 10}\n"
        (world.pol / f"_s{i}.yaml").write_text(nxt + f"summary: level {i}\n")
    (world.pol / "x.yaml").write_text("name: x\ninclude: _s0.yaml\n")
    reads = []
    real = policy._yaml_load
    monkeypatch.setattr(policy, "_yaml_load", lambda p: (reads.append(p.name), real(p))[1])
    prof = policy.load_profile("x", world.pol)
    assert prof.summary == "level 0" and prof.sysctl["vm.swappiness"] == 10
    assert sorted(reads) == sorted(["x.yaml"] + [f"_s{i}.yaml" for i in range(25)])


@pytest.mark.parametrize("how", ["flag-before", "flag-after", "env"])
def test_an_empty_root_never_means_the_working_directory(world, capsys, monkeypatch, how):
    """Run from inside a host tree, as a script with an unset variable would: nothing is tuned.
    (Where a regression would fall back to / rather than the working directory, the command is
    the read-only audit, so a broken build fails this test without touching the machine.)"""
    monkeypatch.chdir(world.root)
    args = ["--policy-dir", str(world.pol), "--gpu-backend", "none"]
    if how == "flag-before":
        argv = ["--root", "", "audit", *args]
    elif how == "flag-after":
        argv = ["apply", "--root", "", *args]
    else:
        monkeypatch.setenv("GPU_TUNE_ROOT", "")
        argv = ["audit", *args]
    before = world.digest()
    code, _, err = run_main(argv, capsys)
    assert_bad_input(code, err, "--root ''")
    assert world.digest() == before and not (world.root / "var").exists()


def test_an_explicit_root_wins_over_an_empty_variable(world, capsys, monkeypatch):
    monkeypatch.setenv("GPU_TUNE_ROOT", "")
    code, _, err = run_main(["audit", "--root", str(world.root), "--policy-dir", str(world.pol),
                             "--gpu-backend", "none", "-o", "json"], capsys)
    assert code in (0, 1) and not err.strip()


# -- the real process, for the cases that used to end in a traceback ------------------------------
def _whole(world, argv: list[str], *expect: str, env: dict | None = None, cwd: Path | None = None):
    before = world.digest()
    if cwd is not None:
        p = _run_in(cwd, argv, env)
    else:
        p = run_cli(*argv, env=env)
    assert_bad_input(p.returncode, p.stderr, *expect)
    assert world.digest() == before
    return p


def _run_in(cwd: Path, argv: list[str], env: dict | None):
    import subprocess
    import sys

    full = {k: v for k, v in os.environ.items() if not k.startswith("GPU_TUNE_")}
    full.update({"PYTHONPATH": str(REPO), **(env or {})})
    return subprocess.run([sys.executable, "-m", "gpu_tune", *argv], capture_output=True, text=True,
                          env=full, cwd=cwd, timeout=120)


@pytest.mark.slow
def test_the_real_process_on_the_worst_inputs(world):
    r = str(world.root)
    _whole(world, ["apply", "--root", r, *world.profile(b"name: x\nsummary: \"\xff\"\n")], "not UTF-8")
    _whole(world, ["apply", "--root", r, *world.profile(nested_yaml(20000))], "nested too deep")
    world.profile("name: x\n")
    _whole(world, ["apply", "--root", r, *world.gpus(nested_json(100_000))], "nested too deep")
    world.gpu0()
    _whole(world, ["revert", "--root", r, *world.journal({"entries": [entry(seq="x")]})], "entry 0", "seq")
    shutil.rmtree(world.root / "var")
    _whole(world, ["apply", "--root", "", "--gpu-backend", "none"], "--root ''", cwd=world.root)
    _whole(world, ["audit", "--gpu-backend", "none"], "--root ''", env={"GPU_TUNE_ROOT": ""}, cwd=world.root)
    assert not (world.root / "var").exists()


@pytest.mark.slow
def test_a_root_or_policy_dir_that_cannot_be_read(world, tmp_path):
    """PermissionError on --root or --policy-dir is bad input. As root, drop the capabilities that bypass modes."""
    import subprocess
    import sys

    locked = tmp_path / "locked"
    shutil.copytree(world.root, locked, symlinks=True)
    os.chmod(locked, 0o000)
    os.chmod(world.pol, 0o000)
    try:
        prefix = []
        if os.geteuid() == 0:
            setpriv = shutil.which("setpriv")
            if not setpriv:
                skips.missing("tool", "running as root without setpriv (util-linux): cannot lose CAP_DAC_OVERRIDE")
            drop = "-dac_override,-dac_read_search"
            prefix = [setpriv, f"--bounding-set={drop}", f"--inh-caps={drop}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_TUNE_")}
        for args, where in ((["--root", str(locked)], str(locked)),
                            (["--root", str(world.root), "--policy-dir", str(world.pol)], str(world.pol))):
            cmd = [*prefix, sys.executable, "-m", "gpu_tune", "audit", *args, "--gpu-backend", "none"]
            p = subprocess.run(cmd, capture_output=True, text=True, env={**env, "PYTHONPATH": str(REPO)}, timeout=120)
            assert_bad_input(p.returncode, p.stderr, where, "Permission denied")
    finally:
        os.chmod(locked, 0o755)
        os.chmod(world.pol, 0o755)


# -- host files: a huge CPU list is a row, never an allocation ----------------------------------------
@pytest.mark.parametrize("where", ["cpu-online", "node-cpulist", "smp_affinity_list", "local_cpulist"])
def test_a_huge_cpu_list_in_a_host_file_is_a_row_not_an_allocation(make_host, tmp_path, capsys, monkeypatch, where):
    import resource

    root = make_host("link-degraded")
    files = {
        "cpu-online": root / "sys/devices/system/cpu/online",
        "node-cpulist": root / "sys/devices/system/node/node0/cpulist",
        "smp_affinity_list": root / "proc/irq" / next(root.glob("sys/devices/**/msi_irqs/*")).name / "smp_affinity_list",
        "local_cpulist": next(root.glob("sys/devices/pci*/**/local_cpulist")),
    }
    target = files[where]
    target.write_text("0-4000000000\n")
    monkeypatch.delenv("GPU_TUNE_ROOT", raising=False)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.process_time()
    code, out, err = run_main(["audit", "--root", str(root), "--gpu-backend", "fixture", "--gpu-fixture",
                               str(GPU_FIXTURES / "link-degraded.json"), "-o", "json"], capsys)
    assert code in (0, 1) and "Traceback" not in err, err
    assert time.process_time() - t0 < 60  # CPU seconds of this process: 4e9 CPUs were never walked
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 200 * 1024  # kB: no 3 GB set
    doc = json.loads(out)
    if where == "smp_affinity_list":
        irq = target.parent.name
        row = next(s for s in doc["settings"] if s["id"] == "irq.affinity" and s["target"] == irq)
        assert row["status"] == "error" and "0-4000000000" in row["detail"]


def test_cpu_lists_are_bounded_by_the_kernels_limit():
    assert MAX_CPU == 8191
    assert parse_cpulist("8191") == frozenset({8191})
    assert len(parse_cpulist("0-8191")) == 8192
    for bad in ("8192", "0-8192", "0-4000000000", "4000000000-4000000001", "0-15:0", "0-1:99999999999999",
                "1" * 5000, "\u0663", "-1", "0--1", "a-b"):
        t0 = time.process_time()
        with pytest.raises(ParseError):
            parse_cpulist(bad)
        assert time.process_time() - t0 < 2, bad  # CPU seconds: refused before anything was expanded
    assert parse_cpumask("1" + "0" * 2047) == frozenset({8188})
    with pytest.raises(ParseError):
        parse_cpumask("1" + "0" * 2048)  # bit 8192
    assert parse_cpumask("00000000," * 400 + "00000001") == frozenset({0})  # leading zero groups are fine


# -- fuzzing: bounded, deterministic --------------------------------------------------------------
_cpu_item = st.one_of(
    st.integers(0, 10**12).map(str),
    st.tuples(st.integers(0, 10**12), st.integers(0, 10**12)).map(lambda t: f"{t[0]}-{t[1]}"),
    st.tuples(st.integers(0, 9000), st.integers(0, 9000), st.integers(-1, 10**9)).map(lambda t: f"{t[0]}-{t[1]}:{t[2]}"),
    st.text(alphabet="0123456789-:,/ x\n", max_size=12),
)


@settings(FUZZ, max_examples=300)
@given(st.lists(_cpu_item, max_size=6).map(",".join))
def test_fuzz_cpu_lists_parse_or_raise_parse_error_quickly(text):
    t0 = time.process_time()  # this process's CPU seconds: a busy machine does not add to them
    try:
        cpus = parse_cpulist(text)
    except ParseError:
        pass
    else:
        assert all(0 <= c <= MAX_CPU for c in cpus)
    assert time.process_time() - t0 < 2


_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=12), st.sampled_from(["0-4000000000", "vm.swappiness\n", ".inf", "99999999999T"]))
_value = st.recursive(_scalar, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                      st.dictionaries(st.text(max_size=6), kids, max_size=3)),
                      max_leaves=8)
_PROFILE_KEYS = ["summary", "sysctl", "sysctl.vm.swappiness", "sysctl.vm.foo", "thp.enabled", "cpu.governor",
                 "cpu.cstates.max_latency_us", "irq.exclude_cpus", "irq.devices", "allocator.malloc_conf",
                 "allocator.env_file", "limits.memlock", "limits.memlock.min", "probe.interval_s", "probe.timeout_s",
                 "probe.accuracy_min", "readiness.max_temperature_c", "include", "gpu.persistence_mode"]


def _set(doc: dict, dotted: str, value) -> None:
    head, _, rest = dotted.partition(".")
    if head == "sysctl" and rest:
        doc.setdefault("sysctl", {})[rest] = value
        return
    if not rest:
        doc[head] = value
        return
    if not isinstance(doc.get(head), dict):
        doc[head] = {}
    _set(doc[head], rest, value)


def _mutated_profile(mutations) -> str:
    import yaml

    doc: dict = {"name": "x", "include": "_base.yaml"}
    for key, value in mutations:
        _set(doc, key, value)
    return yaml.safe_dump(doc, allow_unicode=True)


_mutations = st.lists(st.tuples(st.sampled_from(_PROFILE_KEYS), _value), min_size=1, max_size=3)


@settings(FUZZ, max_examples=150)
@given(_mutations)
def test_fuzz_mutated_profiles_load_or_are_one_line_of_bad_input(tmp_path_factory, mutations):
    from gpu_tune.tune.policy import load_profile

    d = tmp_path_factory.mktemp("pol")
    shutil.copy(POLICIES / "_base.yaml", d)
    (d / "x.yaml").write_text(_mutated_profile(mutations))
    try:
        load_profile("x", d)
    except InputError as exc:
        assert str(d / "x.yaml") in str(exc) or "_base.yaml" in str(exc)


@settings(FUZZ, max_examples=12)
@given(_mutations)
def test_fuzz_mutated_profiles_exit_0_1_or_2_and_change_nothing(world, capsys, mutations):
    argv = ["audit", "--root", str(world.root), *world.profile(_mutated_profile(mutations)), "-o", "json"]
    before = world.digest()
    code, _, err = run_main(argv, capsys)
    assert code in (0, 1, 2), err
    if code == 2:
        assert_bad_input(code, err)
    assert world.digest() == before


_GPU_KEYS = ["index", "uuid", "pci_bus_id", "memory_total_mib", "memory_used_mib", "pcie_link_gen_current",
             "pcie_link_gen_max", "pcie_link_width_current", "pcie_link_width_max", "temperature_c", "power_w",
             "utilization_percent", "cpu_affinity", "processes", "xid_events", "clock_throttle_reasons", "lost",
             "mig_mode", "compute_capability", "ecc_uncorrected_volatile"]


@settings(FUZZ, max_examples=150)
@given(st.lists(st.tuples(st.sampled_from(_GPU_KEYS), _value), min_size=1, max_size=3))
def test_fuzz_mutated_gpu_fixtures_load_or_are_bad_input(tmp_path_factory, mutations):
    from gpu_tune.gpu.fixture import FixtureBackend

    doc = json.loads((GPU_FIXTURES / "dgx-8gpu.json").read_text())
    for key, value in mutations:
        doc["gpus"][0][key] = value
    p = tmp_path_factory.mktemp("fx") / "g.json"
    try:
        p.write_text(json.dumps(doc))
    except ValueError:
        return  # an integer json cannot write
    try:
        gpus = FixtureBackend(p).gpus()
    except InputError as exc:
        assert "\n" not in str(exc) and str(p) in str(exc)
    else:
        for g in gpus:
            assert 0 <= g.index <= 1023


_ENTRY_KEYS = ["id", "target", "family", "seq", "path", "value", "raw", "ncpus", "index", "files", "created_dirs",
               "absent"]


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(_ENTRY_KEYS), _value), min_size=1, max_size=3))
def test_fuzz_mutated_journals_revert_or_are_bad_input(world, capsys, mutations):
    e = entry(raw=None)
    for key, value in mutations:
        e[key] = value
    try:
        argv = ["revert", "--root", str(world.root), *world.journal({"format": 1, "entries": [e]}), "-o", "json"]
    except ValueError:
        return
    before = world.digest()
    code, _, err = run_main(argv, capsys)
    assert code in (0, 1, 2), err
    if code == 2:
        assert_bad_input(code, err, "journal.json")
        assert world.digest() == before
    (world.root / JOURNAL).unlink(missing_ok=True)
