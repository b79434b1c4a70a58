"""What the audit shape really needs: the audit, the agent and the probe's NUMA binding in a
podman container with exactly the security context of the rendered audit DaemonSet, against the
same in a privileged container.

    .venv/bin/python benchmarks/bench_capabilities.py [--image localhost/gpu-tune:cpu] [--no-probe]

The capability set, the read-only host mounts, ``allowPrivilegeEscalation`` and
``readOnlyRootFilesystem`` come from ``kubectl kustomize daemonset/overlays/audit``. The seccomp
profile is RuntimeDefault as containerd (1.6+) writes it for the NUMA calls that matter here:
podman's default profile with ``get_mempolicy``, ``mbind``, ``set_mempolicy`` and
``set_mempolicy_home_node`` allowed only with CAP_SYS_NICE (containerd PR 7167, Docker's rule).

Checks, each printed with its figure:

1. ``gpu-tune audit -o json`` gives the same document in the audit shape as privileged, with a
   ``containerd`` and an ``irqbalance`` process on the host (copies of ``sleep``, started here
   and ended by their PIDs) so that ``/proc/<pid>/limits`` and ``/proc/<pid>/comm`` of host
   processes are read.
2. ``gpu-tune run --numa-node 0`` (the probe's binder: ``numactl --membind``) works with the
   set, and fails without CAP_SYS_NICE; ``gpu-tune check`` reads the kernel log (``syslog(2)``)
   with the set, and reports it unreadable without CAP_SYSLOG (``kernel.dmesg_restrict=1``): the
   two capabilities the audit shape adds, and why.
3. The CPU probe passes in the audit shape (``--no-probe`` skips it: about a minute).
4. ``gpu-tune serve`` answers ``/readiness`` in the audit shape.
5. A write to ``/host/proc/sys`` and a remount read-write of ``/host/proc`` are refused.

Needs podman (see docs/security.md for the flags this machine needs) and the image. Exit 0 when
every check holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NICE_CALLS = ["get_mempolicy", "mbind", "set_mempolicy", "set_mempolicy_home_node"]
PODMAN = ["podman", "--cgroup-manager", "cgroupfs", "run", "--rm", "--runtime", "runc",
          "--ulimit", "nofile=20000:20000", "--ulimit", "nproc=4096:4096", "--network", "host"]


def audit_shape() -> tuple[dict, list[tuple[str, str, bool]]]:
    """(the container securityContext, [(host path, container path, read-only)]) of the audit DaemonSet."""
    kubectl = Path(sys.executable).with_name("kubectl")
    out = subprocess.run([str(kubectl if kubectl.exists() else "kubectl"), "kustomize",
                          str(REPO / "daemonset" / "overlays" / "audit")], capture_output=True, text=True, check=True)
    import yaml

    (ds,) = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    vols = {v["name"]: v for v in pod["volumes"]}
    mounts = [(vols[m["name"]]["hostPath"]["path"], m["mountPath"], bool(m.get("readOnly")))
              for m in c["volumeMounts"] if "hostPath" in vols[m["name"]]]
    return c["securityContext"], mounts


def seccomp_profile(path: Path) -> None:
    src = Path("/usr/share/containers/seccomp.json")
    doc = json.loads(src.read_text())
    for rule in doc["syscalls"]:
        if rule.get("action") == "SCMP_ACT_ALLOW" and rule.get("names"):
            rule["names"] = [n for n in rule["names"] if n not in NICE_CALLS]
    doc["syscalls"].append({"names": NICE_CALLS, "action": "SCMP_ACT_ALLOW", "args": [],
                            "includes": {"caps": ["CAP_SYS_NICE"]}, "excludes": {}})
    path.write_text(json.dumps(doc))


def shape_args(sc: dict, mounts, profile: Path, *, caps: list[str] | None = None) -> list[str]:
    assert sc.get("privileged") is not True, "the audit shape is privileged: nothing to measure"
    args = ["--cap-drop", "ALL"]
    for cap in sc["capabilities"].get("add", []) if caps is None else caps:
        args += ["--cap-add", cap]
    if sc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    if sc.get("readOnlyRootFilesystem"):
        args += ["--read-only", "--tmpfs", "/tmp"]
    args += ["--security-opt", f"seccomp={profile}"]
    for host, inside, ro in mounts:
        if Path(host).exists():
            args += ["-v", f"{host}:{inside}{':ro' if ro else ''}"]
    return args


def privileged_args(mounts) -> list[str]:
    args = ["--privileged", "--read-only", "--tmpfs", "/tmp"]
    for host, inside, ro in mounts:
        if Path(host).exists():
            args += ["-v", f"{host}:{inside}{':ro' if ro else ''}"]
    return args


def podman(args: list[str], image: str, cmd: list[str], *, entrypoint: str | None = None,
           timeout: float = 300) -> subprocess.CompletedProcess:
    ep = ["--entrypoint", entrypoint] if entrypoint else []
    return subprocess.run(PODMAN + args + ep + [image] + cmd, capture_output=True, text=True, timeout=timeout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image", default="localhost/gpu-tune:cpu")
    ap.add_argument("--no-probe", action="store_true")
    ap.add_argument("--port", type=int, default=19410)
    args = ap.parse_args()
    if not shutil.which("podman"):
        print("podman not found", file=sys.stderr)
        return 2
    sc, mounts = audit_shape()
    caps = sc["capabilities"].get("add", [])
    print(f"audit shape: capabilities drop {sc['capabilities'].get('drop')} add {caps}, "
          f"seccomp {sc.get('seccompProfile', {}).get('type')}, allowPrivilegeEscalation "
          f"{sc.get('allowPrivilegeEscalation')}, readOnlyRootFilesystem {sc.get('readOnlyRootFilesystem')}, "
          f"host mounts {', '.join(i + (':ro' if ro else ':rw') for _, i, ro in mounts)}")
    tmp = Path(tempfile.mkdtemp(prefix="gpu-tune-caps-"))
    profile = tmp / "seccomp-runtime-default.json"
    seccomp_profile(profile)
    shape = shape_args(sc, mounts, profile)
    ok = True

    # 1. the audit, with host processes whose /proc files are read
    fakes = []
    for name in ("containerd", "irqbalance"):
        exe = tmp / name
        shutil.copy("/bin/sleep", exe)
        fakes.append(subprocess.Popen([str(exe), "300"]))
    try:
        time.sleep(0.3)
        runs = {}
        for label, a in (("privileged", privileged_args(mounts)), ("audit shape", shape)):
            t0 = time.monotonic()
            p = podman(a, args.image, ["audit", "--root", "/host", "-o", "json"])
            runs[label] = (p, time.monotonic() - t0)
    finally:
        for f in fakes:
            f.kill()
            f.wait()
    docs = {k: json.loads(p.stdout) if p.stdout.strip() else None for k, (p, _) in runs.items()}
    same = docs["privileged"] is not None and docs["privileged"] == docs["audit shape"]
    rows = len((docs["privileged"] or {}).get("settings", []))
    read_proc = [s["id"] for s in (docs["audit shape"] or {}).get("settings", [])
                 if s["id"] == "limits.memlock" and s["status"] != "unsupported"
                 or s["id"] == "irq.affinity" and s["status"] == "conflict"]
    print(f"1. audit: {rows} rows; privileged exit {runs['privileged'][0].returncode} "
          f"({runs['privileged'][1]:.1f} s), audit shape exit {runs['audit shape'][0].returncode} "
          f"({runs['audit shape'][1]:.1f} s); documents identical: {same}; rows that read host "
          f"/proc/<pid>: {sorted(set(read_proc))}")
    if not same:
        ok = False
        for label, (p, _) in runs.items():
            print(f"   {label} stderr: {p.stderr.strip()[-300:]}")

    # 2. the probe's NUMA binding: with the set, and with the set less SYS_NICE
    bind = ["run", "--root", "/host", "--numa-node", "0", "--", "true"]
    with_set = podman(shape, args.image, bind)
    less = [c for c in caps if c != "SYS_NICE"]
    without = podman(shape_args(sc, mounts, profile, caps=less), args.image, bind)
    print(f"2. numactl --membind through `gpu-tune run --numa-node 0`: with {caps} exit {with_set.returncode}; "
          f"with {less} exit {without.returncode} ({(without.stderr.strip().splitlines() or [''])[-1][:80]})")
    ok &= with_set.returncode == 0 and ("SYS_NICE" not in caps or without.returncode != 0)

    # 2b. the kernel log (syslog(2)): with the set, and with the set less SYSLOG
    def kernel_log(a: list[str]) -> tuple[int, dict]:
        p = podman(a, args.image, ["check", "--root", "/host", "-o", "json"])
        try:
            doc = json.loads(p.stdout)
        except ValueError:
            return p.returncode, {"error": p.stderr.strip()[-200:]}
        return p.returncode, {c["name"]: c for c in doc["checks"]}
    rc, with_log = kernel_log(shape)
    less_log = [c for c in caps if c != "SYSLOG"]
    rc2, without_log = kernel_log(shape_args(sc, mounts, profile, caps=less_log))
    read = "gpu.kernel_log" not in with_log and "syslog(2)" in (with_log.get("gpu.xid") or {}).get("detail", "")
    refused = (without_log.get("gpu.kernel_log") or {}).get("detail", "")
    print(f"2b. the kernel log: with {caps}: {'read through syslog(2)' if read else with_log}; with {less_log}: "
          f"{refused[:120] or without_log}")
    ok &= read and ("SYSLOG" not in caps or "CAP_SYSLOG" in refused)

    # 3. the CPU probe
    if not args.no_probe:
        t0 = time.monotonic()
        p = podman(shape, args.image, ["probe", "--root", "/host", "--device", "cpu", "-o", "json"], timeout=600)
        took = time.monotonic() - t0
        try:
            res = json.loads(p.stdout)["results"][0]
            print(f"3. CPU probe in the audit shape: exit {p.returncode}, {res['status']}, accuracy "
                  f"{res['result']['accuracy']}, fingerprint {res['result']['fingerprint']}, {took:.0f} s")
            ok &= res["status"] == "passed"
        except (ValueError, KeyError, IndexError, TypeError):
            print(f"3. CPU probe in the audit shape: exit {p.returncode}: {p.stderr.strip()[-300:]}")
            ok = False

    # 4. the agent answers
    name = f"gpu-tune-caps-{time.time_ns()}"
    srv = subprocess.Popen(PODMAN + ["--name", name] + shape + [args.image, "serve", "--root", "/host", "--no-kube",
                                                                 "--host", "127.0.0.1", "--port", str(args.port),
                                                                 "--probe-device", "cpu"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    code, t0 = None, time.monotonic()
    try:
        while time.monotonic() - t0 < 60 and code is None:
            time.sleep(0.5)
            try:
                code = urllib.request.urlopen(f"http://127.0.0.1:{args.port}/healthz", timeout=2).status
            except urllib.error.HTTPError as exc:
                code = exc.code
            except OSError:
                pass
    finally:
        subprocess.run(["podman", "stop", "-t", "5", name], capture_output=True, timeout=60)
        srv.wait(timeout=60)
    print(f"4. serve in the audit shape: /healthz {code} after {time.monotonic() - t0:.1f} s")
    ok &= code == 200

    # 5. writes and remounts refused
    w = podman(shape, args.image, ["-c", "echo 60 > /host/proc/sys/vm/swappiness"], entrypoint="sh")
    m = podman(shape, args.image, ["-c", "mount -o remount,rw /host/proc"], entrypoint="sh")
    print(f"5. write /host/proc/sys/vm/swappiness: exit {w.returncode} ({w.stderr.strip()[-60:]}); "
          f"remount /host/proc rw: exit {m.returncode} ({m.stderr.strip()[-60:]})")
    ok &= w.returncode != 0 and m.returncode != 0
    shutil.rmtree(tmp, ignore_errors=True)
    print("all checks hold" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
