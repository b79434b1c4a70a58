"""Where the steps act (the real host on a GPU, fixture trees on a CPU) and what they read of it."""

from __future__ import annotations

import base64
import glob
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from .common import FIXTURE_RUN, FIXTURE_TUNE, REPO


# -- hosts: the real one on a GPU, fixture trees on a CPU -----------------------------------------
def host_for(ctx: dict[str, Any], kind: str) -> dict[str, Any]:
    """Where a step acts. ``kind``: "tune" (apply/revert) or "run" (probe, gain, serve).

    GPU: the real host, NVML. CPU: a fresh fixture tree in the work folder; "tune" has a GPU
    (the fixture backend, its JSON copied next to the tree since apply writes into it), "run"
    has none (the probe binds to CPUs that exist here)."""
    if ctx["device"] == "gpu":
        return {"root": "/", "args": ["--gpu-backend", "nvml"], "fixture": None, "real": True}
    sys.path.insert(0, str(REPO))
    from tests.fixtures import hostgen  # noqa: PLC0415 - the test fixtures, only in CPU mode

    scenario = FIXTURE_TUNE if kind == "tune" else FIXTURE_RUN
    base = Path(ctx["work"]) / f"host-{kind}-{int(time.time() * 1000) % 10**9}"
    root = hostgen.build(scenario, base / "root")
    if kind == "tune":
        fixture = base / "gpus.json"
        shutil.copyfile(REPO / "tests" / "fixtures" / "gpu" / f"{scenario}.json", fixture)
        return {"root": str(root), "args": ["--root", str(root), "--gpu-backend", "fixture", "--gpu-fixture",
                                            str(fixture)], "fixture": str(fixture), "real": False,
                "scenario": scenario}
    return {"root": str(root), "args": ["--root", str(root), "--gpu-backend", "none"], "fixture": None,
            "real": False, "scenario": scenario}


def nvml_facts() -> dict[str, Any]:
    try:
        import pynvml  # noqa: PLC0415 - nvidia-ml-py

        pynvml.nvmlInit()
    except Exception as exc:
        return {"status": "unavailable", "reason": f"{type(exc).__name__}: {exc}"}

    def s(v: Any) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)

    try:
        cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        out: dict[str, Any] = {"status": "ok", "driver": s(pynvml.nvmlSystemGetDriverVersion()),
                               "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}", "gpus": []}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            g: dict[str, Any] = {"index": i, "name": s(pynvml.nvmlDeviceGetName(h)), "uuid": s(pynvml.nvmlDeviceGetUUID(h)),
                                 "pci_bus_id": s(pynvml.nvmlDeviceGetPciInfo(h).busId),
                                 "memory_total_mib": pynvml.nvmlDeviceGetMemoryInfo(h).total // 2**20}
            for key, fn in (("persistence_mode", lambda: bool(pynvml.nvmlDeviceGetPersistenceMode(h))),
                            ("compute_capability", lambda: "%d.%d" % pynvml.nvmlDeviceGetCudaComputeCapability(h)),
                            ("temperature_c", lambda: pynvml.nvmlDeviceGetTemperature(h, 0)),
                            ("power_w", lambda: round(pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0, 1))):
                try:
                    g[key] = fn()
                except Exception as exc:  # one field NVML refuses is a fact, not a failure
                    g[key] = f"unavailable: {exc}"
            out["gpus"].append(g)
        return out
    except Exception as exc:
        return {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def persistence(host: dict[str, Any]) -> dict[str, bool | str]:
    """{GPU index: persistence mode} from NVML (real host) or the fixture JSON."""
    if host.get("fixture"):
        doc = json.loads(Path(host["fixture"]).read_text())
        return {str(g["index"]): bool(g.get("persistence_mode")) for g in doc.get("gpus", [])}
    facts = nvml_facts()
    if facts.get("status") != "ok":
        return {"nvml": facts.get("reason", "unavailable")}
    return {str(g["index"]): g.get("persistence_mode") for g in facts["gpus"]}


# -- snapshots for the byte-for-byte check ----------------------------------------------------------
REAL_GLOBS = ("proc/sys/vm/*", "proc/sys/kernel/*", "proc/sys/net/core/*", "proc/sys/net/ipv4/*",
              "sys/kernel/mm/transparent_hugepage/*", "sys/kernel/mm/transparent_hugepage/*/*",
              "sys/devices/system/cpu/cpu[0-9]*/cpufreq/scaling_governor",
              "sys/devices/system/cpu/cpu[0-9]*/cpuidle/state[0-9]*/disable",
              "proc/irq/[0-9]*/smp_affinity", "proc/irq/[0-9]*/smp_affinity_list",
              "etc/ld.so.preload", "etc/gpu-tune/*", "etc/gpu-tune/*/*")


def snapshot(root: str, whole_tree: bool) -> dict[str, bytes | None]:
    """{host path: bytes} of the files a tuning run may write (every file of a fixture tree)."""
    base = Path(root)
    out: dict[str, bytes | None] = {}
    paths: list[Path] = []
    if whole_tree:
        paths = [p for p in base.rglob("*") if not str(p.relative_to(base)).startswith("var/lib/gpu-tune")]
    else:
        for pattern in REAL_GLOBS:
            paths.extend(Path(p) for p in glob.glob(str(base / pattern)))
    for p in paths:
        if p.is_symlink() or not p.is_file():
            continue
        try:
            with open(p, "rb") as fh:
                data = fh.read(1 << 20)
        except OSError:
            continue
        out["/" + str(p.relative_to(base))] = data
    return out


def journal_files(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every file a journal records: {path, raw (bytes or None), absent}."""
    out = []
    for e in entries:
        items = [e] + [f for f in e.get("files") or [] if isinstance(f, dict)]
        for it in items:
            path = it.get("path")
            if not path:
                continue
            raw = it.get("raw")
            out.append({"id": e.get("id"), "target": e.get("target"), "path": path,
                        "raw": base64.b64decode(raw) if raw else None, "absent": bool(it.get("absent", False))})
    return out


def host_file(root: str, path: str) -> bytes | None:
    p = Path(root) / path.lstrip("/")
    try:
        with open(p, "rb") as fh:
            return fh.read(1 << 20)
    except OSError:
        return None


def audit_values(doc: dict[str, Any] | None) -> dict[str, Any]:
    return {f"{s['id']}@{s['target']}": s.get("current") for s in (doc or {}).get("settings", [])}


def audit_counts(doc: dict[str, Any] | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in (doc or {}).get("settings", []):
        out[s["status"]] = out.get(s["status"], 0) + 1
    return out
