#!/usr/bin/env python3
"""What each NVML call of gpu-tune answers on this machine, with and without privileges.

    python3 tools/nvml_privileges.py [--shapes root,audit,nocaps,nobody] [--out FILE.json]
                                     [--run -- COMMAND ...]

For every call in ``gpu_tune.gpu.nvml_calls.CALLS`` (the NVML calls the agent makes), on every
GPU, in one child process per privilege shape:

- ``root``: as started (run it as root);
- ``audit``: root with the audit DaemonSet's capabilities only (every capability dropped but
  CAP_SYS_NICE and CAP_SYSLOG: the bounding set is cut before exec, so the child has no other);
- ``nocaps``: root with no capability at all;
- ``nobody``: uid/gid 65534, no groups, no capability.

It prints one table (call, what nvml.h says it needs, the answer under each shape: ``ok``, or the
NVML return code's name) and, with ``--out``, the same as JSON. ``nvmlDeviceSetPersistenceMode``
is called with the mode the GPU already has, so nothing changes. With ``--run -- CMD ...`` it also
runs CMD under each shape and keeps its exit code, stdout and stderr (``gpu-tune check -o json``).
Exit 0 when every shape ran; 2 on a bad argument.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SHAPES = ("root", "audit", "nocaps", "nobody")
CAP_SYS_NICE, CAP_SYSLOG = 23, 34
PR_CAPBSET_DROP = 24
NOBODY = 65534


def _cap_last() -> int:
    try:
        return int(Path("/proc/sys/kernel/cap_last_cap").read_text().strip())
    except (OSError, ValueError):
        return 40


def drop_to(shape: str) -> None:
    """In the child, before exec: leave only what ``shape`` allows."""
    if shape == "root":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    keep = {CAP_SYS_NICE, CAP_SYSLOG} if shape == "audit" else set()
    for cap in range(_cap_last() + 1):
        if cap not in keep and libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            if err != 22:  # EINVAL: no such capability on this kernel
                raise OSError(err, f"prctl(PR_CAPBSET_DROP, {cap})")
    if shape == "nobody":
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)


def cap_eff() -> str:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return line.split()[1]
    return "?"


def _call(nv: Any, binding: str, h: Any, peer: Any) -> Any:
    """One call as the backend makes it (the arguments the agent passes)."""
    fn = getattr(nv, binding)
    if binding in ("nvmlDeviceGetTemperature",):
        return fn(h, nv.NVML_TEMPERATURE_GPU)
    if binding == "nvmlDeviceGetTotalEccErrors":
        return fn(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
    if binding == "nvmlDeviceGetMemoryErrorCounter":
        return fn(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC, nv.NVML_MEMORY_LOCATION_SRAM)
    if binding == "nvmlDeviceGetSramEccErrorStatus":
        st = nv.c_nvmlEccSramErrorStatus_v1_t()
        fn(h, ctypes.byref(st))
        return {"volatileUncParity": st.volatileUncParity, "volatileUncSecDed": st.volatileUncSecDed,
                "bThresholdExceeded": st.bThresholdExceeded}
    if binding in ("nvmlDeviceGetClockInfo", "nvmlDeviceGetMaxClockInfo"):
        return fn(h, nv.NVML_CLOCK_SM)
    if binding == "nvmlDeviceGetFieldValues":
        v = fn(h, [nv.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])[0]
        return {"nvmlReturn": int(v.nvmlReturn), "valueType": int(v.valueType), "uiVal": int(v.value.uiVal)}
    if binding == "nvmlDeviceGetNvLinkState":
        return fn(h, 0)
    if binding == "nvmlDeviceGetNvLinkErrorCounter":
        return fn(h, 0, nv.NVML_NVLINK_ERROR_DL_CRC_FLIT)
    if binding == "nvmlDeviceGetP2PStatus":
        if peer is None:
            return "no peer GPU"
        return fn(h, peer, nv.NVML_P2P_CAPS_INDEX_NVLINK)
    if binding in ("nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetGpuFabricInfo"):
        info = (nv.c_nvmlGpuFabricInfo_v3_t if binding.endswith("V") else nv.c_nvmlGpuFabricInfo_t)()
        fn(h, ctypes.byref(info))
        return {"state": int(info.state), "status": int(info.status),
                "healthMask": int(getattr(info, "healthMask", 0))}
    if binding == "nvmlDeviceSetPersistenceMode":
        return fn(h, nv.nvmlDeviceGetPersistenceMode(h))  # the mode it has: nothing changes
    if binding == "nvmlDeviceGetCpuAffinity":
        return [hex(int(x)) for x in fn(h, 4)]
    if binding == "nvmlDeviceGetComputeRunningProcesses":
        return len(fn(h))
    if binding == "nvmlDeviceRegisterEvents":
        es = nv.nvmlEventSetCreate()
        try:
            return fn(h, nv.nvmlEventTypeXidCriticalError, es)
        finally:
            nv.nvmlEventSetFree(es)
    return fn(h)


def _plain(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, (str, int, float, bool, type(None), dict, list)):
        return v
    if isinstance(v, tuple):
        return list(v)
    fields = getattr(v, "_fields_", None)
    if fields:
        return {f[0]: _plain(getattr(v, f[0])) for f in fields if not f[0].startswith("_")}
    return repr(v)


def child() -> int:
    import pynvml as nv

    from gpu_tune.gpu.nvml_calls import CALLS
    from gpu_tune.gpu.nvml_read import error_text

    out: dict[str, Any] = {"uid": os.getuid(), "cap_eff": cap_eff(), "calls": {}}
    try:
        nv.nvmlInit()
    except nv.NVMLError as exc:
        out["init"] = error_text(exc)
        print(json.dumps(out))
        return 0
    out["init"] = "ok"
    n = nv.nvmlDeviceGetCount()
    handles = []
    for i in range(n):
        try:
            handles.append(nv.nvmlDeviceGetHandleByIndex(i))
        except nv.NVMLError as exc:
            handles.append(None)
            out.setdefault("handles", {})[i] = error_text(exc)
    skip = {"nvmlInit", "nvmlShutdown", "nvmlErrorString", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex",
            "nvmlEventSetCreate", "nvmlEventSetWait", "nvmlEventSetFree"}
    system = {"nvmlSystemGetDriverVersion", "nvmlSystemGetCudaDriverVersion"}
    for call in CALLS:
        if call.binding in skip:
            continue
        per: dict[str, Any] = {}
        targets = [("system", None)] if call.binding in system else list(enumerate(handles))
        for i, h in targets:
            if call.binding not in system and h is None:
                per[str(i)] = {"answer": "no handle"}
                continue
            peer = next((p for j, p in enumerate(handles) if j != i and p is not None), None)
            try:
                got = nv.__dict__[call.binding]() if call.binding in system else _call(nv, call.binding, h, peer)
                per[str(i)] = {"answer": "ok", "value": _plain(got)}
            except nv.NVMLError as exc:
                per[str(i)] = {"answer": error_text(exc)}
            except Exception as exc:  # noqa: BLE001 - recorded, the table goes on
                per[str(i)] = {"answer": f"{type(exc).__name__}: {exc}"}
        out["calls"][call.binding] = per
    nv.nvmlShutdown()
    print(json.dumps(out))
    return 0


def run_as(shape: str, argv: list[str], timeout: float = 120.0) -> dict[str, Any]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, preexec_fn=lambda: drop_to(shape))
    except subprocess.TimeoutExpired:
        return {"rc": None, "stdout": "", "stderr": f"timed out after {timeout:.0f} s"}
    except OSError as exc:
        return {"rc": None, "stdout": "", "stderr": str(exc)}
    return {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr[-4000:]}


def summary(answers: dict[str, Any]) -> str:
    got = sorted({v.get("answer", "?") for v in answers.values()})
    short = [a.split(" (NVML_ERROR_")[-1].rstrip(")") if "NVML_ERROR_" in a else a for a in got]
    return "/".join(short) if short else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out", help="write the whole result as JSON here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    run_cmd: list[str] = []
    if "--run" in argv:
        at = argv.index("--run")
        run_cmd = [x for x in argv[at + 1:]]
        run_cmd = run_cmd[1:] if run_cmd[:1] == ["--"] else run_cmd
        argv = argv[:at]
        if not run_cmd:
            print("nvml_privileges: --run: give the command after it (--run -- gpu-tune check -o json)", file=sys.stderr)
            return 2
    a = ap.parse_args(argv)
    if a.child:
        return child()
    shapes = [s for s in a.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        print(f"nvml_privileges: --shapes: unknown shape {bad[0]!r} (one of {', '.join(SHAPES)})", file=sys.stderr)
        return 2
    if os.geteuid() != 0 and shapes != ["root"]:
        print("nvml_privileges: run as root to compare privilege shapes (or --shapes root)", file=sys.stderr)
        return 2
    from gpu_tune.gpu.nvml_calls import CALLS

    result: dict[str, Any] = {"shapes": {}, "runs": {}}
    for shape in shapes:
        r = run_as(shape, [sys.executable, str(Path(__file__).resolve()), "--child"])
        try:
            result["shapes"][shape] = json.loads(r["stdout"].strip().splitlines()[-1])
        except (ValueError, IndexError):
            result["shapes"][shape] = {"error": f"rc {r['rc']}: {r['stderr'][-600:]}"}
        if run_cmd:
            result["runs"][shape] = run_as(shape, run_cmd)
    privilege = {c.binding: c.privilege for c in CALLS}
    cols = [s for s in shapes]
    print("| call | nvml.h | " + " | ".join(cols) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in cols) + " |")
    for s in cols:
        d = result["shapes"][s]
        if "error" in d or d.get("init") != "ok":
            print(f"| (init) | | {s}: {d.get('error') or d.get('init')} |")
    names = []
    for s in cols:
        for k in (result["shapes"][s].get("calls") or {}):
            if k not in names:
                names.append(k)
    for name in names:
        row = [summary((result["shapes"][s].get("calls") or {}).get(name, {})) for s in cols]
        print(f"| `{name}` | {privilege.get(name, '?')} | " + " | ".join(row) + " |")
    for s in cols:
        d = result["shapes"][s]
        print(f"{s}: uid {d.get('uid')}, CapEff {d.get('cap_eff')}", file=sys.stderr)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
