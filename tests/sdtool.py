"""Run INSIDE the systemd test images (tests/test_systemd_live.py, benchmarks/bench_systemd.py) with
their own python3, standard library only: each subcommand prints one JSON document.

    sdtool.py get URL                     one GET: {"status", "body"} or {"error"}
    sdtool.py start UNIT URL              systemctl start, then GET URL at once (no retry), then the
                                          seconds until it answers 200
    sdtool.py stop UNIT                   systemctl stop, timed
    sdtool.py kill9 UNIT URL              SIGKILL the unit's main process; the seconds until systemd
                                          has started it again and URL answers 200
    sdtool.py wait UNIT STATE...          until the unit's ActiveState/SubState is one of STATE
    sdtool.py devices OUT                 open /dev/nvidia0, /dev/nvidiactl, /dev/kmsg for reading and
                                          for writing; what each gave (open, or the errno's name),
                                          written to OUT as JSON
    sdtool.py connect PORT                whether something listens on 127.0.0.1:PORT
    sdtool.py listen PORT                 hold 127.0.0.1:PORT (a port in use)

Waits are for a condition, each with a deadline (a hung unit fails the test, never hangs it).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

DEVICES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/kmsg")
DEADLINE_S = 120.0


def get(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return {"status": r.status, "body": r.read().decode()}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "body": exc.read().decode()}
    except OSError as exc:
        return {"error": str(getattr(exc, "reason", exc))}


def show(unit: str, *props: str) -> dict:
    out = subprocess.run(["systemctl", "show", unit, *(f"--property={p}" for p in props)],
                         capture_output=True, text=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def until(what: str, fn) -> float:
    t0 = time.monotonic()
    while True:
        got = fn()
        if got:
            return time.monotonic() - t0
        if time.monotonic() - t0 > DEADLINE_S:
            raise SystemExit(json.dumps({"error": f"{what}: not within {DEADLINE_S:.0f} s"}))
        time.sleep(0.02)


def main(argv: list[str]) -> dict:
    cmd, args = argv[0], argv[1:]
    if cmd == "get":
        return get(args[0])
    if cmd == "start":
        unit, url = args
        t0 = time.monotonic()
        r = subprocess.run(["systemctl", "start", unit], capture_output=True, text=True)
        started = time.monotonic() - t0
        first = get(url)
        if r.returncode != 0:
            return {"rc": r.returncode, "stderr": r.stderr, "first_get": first}
        healthy = until(f"{url} 200", lambda: get(url).get("status") == 200)
        return {"rc": 0, "start_s": started, "first_get": first, "healthz_s": started + healthy}
    if cmd == "stop":
        t0 = time.monotonic()
        r = subprocess.run(["systemctl", "stop", args[0]], capture_output=True, text=True)
        return {"rc": r.returncode, "stop_s": time.monotonic() - t0, **show(args[0], "ActiveState", "Result")}
    if cmd == "kill9":
        unit, url = args
        pid = int(show(unit, "MainPID")["MainPID"])
        os.kill(pid, 9)
        t0 = time.monotonic()
        until("a new main process", lambda: show(unit, "MainPID", "ActiveState")["MainPID"] not in ("0", str(pid))
              and show(unit, "ActiveState")["ActiveState"] == "active")
        until(f"{url} 200", lambda: get(url).get("status") == 200)
        return {"old_pid": pid, "restart_s": time.monotonic() - t0, **show(unit, "MainPID", "NRestarts")}
    if cmd == "wait":
        unit, states = args[0], set(args[1:])
        until(f"{unit} in {sorted(states)}", lambda: {show(unit, "ActiveState")["ActiveState"],
                                                      show(unit, "SubState")["SubState"]} & states)
        return show(unit, "ActiveState", "SubState", "Result", "NRestarts", "ExecMainStatus")
    if cmd == "devices":
        got: dict[str, dict[str, str]] = {}
        for path in DEVICES:
            got[path] = {}
            for mode, flag in (("r", os.O_RDONLY), ("w", os.O_WRONLY)):
                try:
                    os.close(os.open(path, flag | os.O_NONBLOCK))
                    got[path][mode] = "open"
                except OSError as exc:
                    got[path][mode] = errno.errorcode.get(exc.errno, str(exc.errno))
        with open(args[0], "w") as fh:
            json.dump(got, fh)
        return got
    if cmd == "connect":
        with socket.socket() as s:
            return {"listening": s.connect_ex(("127.0.0.1", int(args[0]))) == 0}
    if cmd == "listen":
        s = socket.socket()
        s.bind(("127.0.0.1", int(args[0])))
        s.listen(1)
        while True:
            time.sleep(3600)
    raise SystemExit(f"sdtool.py: unknown command {cmd!r}")


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
