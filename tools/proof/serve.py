"""The agent's step: ``gpu-tune serve --no-kube`` on a free loopback port."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from .common import read_text, say, tail, vm_status
from .hosts import host_for
from .runner import Runner, _killpg


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int | None, bytes]:
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        c.request("GET", path)
        resp = c.getresponse()
        body = resp.read()
        c.close()
        return resp.status, body
    except (OSError, http.client.HTTPException):
        return None, b""


SERVE_PATHS = ("/readiness", "/healthz", "/metrics", "/probe", "/audit", "/topology")


def step_serve(ctx: dict[str, Any], r: Runner) -> dict[str, Any]:
    host = host_for(ctx, "run")
    port = free_port()
    argv = list(ctx["gpu_tune"]) + ["serve", "--no-kube", "--host", "127.0.0.1", "--port", str(port), "--interval", "5",
                                    "--probe-device", ctx["device"]] + host["args"]
    if ctx.get("data"):
        argv += ["--probe-data", ctx["data"]]
    log_path = Path(ctx["work"]) / f"serve-{port}.log"
    say(f"    $ gpu-tune serve --no-kube --port {port} --probe-device {ctx['device']} {' '.join(host['args'])}")
    data: dict[str, Any] = {"host": host["root"], "port": port, "backend": host["args"][host["args"].index("--gpu-backend") + 1],
                            "requests": {}, "rss_mib": {}}
    reasons: list[str] = []
    with open(log_path, "wb") as logf:
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, env=r.env,
                                cwd=r.cwd, start_new_session=True)
        try:
            first = None
            while time.monotonic() - t0 < 90 and proc.poll() is None:
                code, _ = http_get(port, "/readiness", timeout=2)
                if code is not None:
                    first = (code, round(time.monotonic() - t0, 2))
                    break
                time.sleep(0.1)
            if first is None:
                reasons.append(f"no answer on /readiness within 90 s (exit {proc.poll()}): {tail(read_text(log_path), 4)}")
                return {"status": "failed", "reason": "; ".join(reasons), "data": data}
            data["first_readiness"] = {"status": first[0], "seconds": first[1]}
            data["rss_mib"]["first_answer"] = vm_status(proc.pid)
            # /audit and /topology answer 503 until the agent's first pass has completed (the
            # first /readiness answer comes before it): wait for that pass before the burst
            while time.monotonic() - t0 < 90 and proc.poll() is None:
                if http_get(port, "/audit", timeout=2)[0] == 200:
                    data["first_pass_seconds"] = round(time.monotonic() - t0, 2)
                    break
                time.sleep(0.1)
            counts: dict[str, int] = {}
            errors = 0
            n = int(ctx["serve_requests"])
            t1 = time.monotonic()
            for i in range(n):
                path = SERVE_PATHS[i % len(SERVE_PATHS)]
                code, _ = http_get(port, path)
                key = f"{path} {code}"
                counts[key] = counts.get(key, 0) + 1
                if code is None or (code >= 500 and not (code == 503 and path in ("/readiness", "/probe"))):
                    errors += 1
            took = time.monotonic() - t1
            data["requests"] = {"count": n, "seconds": round(took, 2), "per_second": round(n / took, 1),
                                "by_path_status": counts, "errors": errors}
            data["rss_mib"][f"after_{n}_requests"] = vm_status(proc.pid)
            if errors:
                reasons.append(f"{errors} of {n} requests failed or answered 5xx")
            wait = float(ctx["serve_probe_wait"])
            probed = None
            t2 = time.monotonic()
            while wait > 0 and time.monotonic() - t2 < wait and proc.poll() is None and r.left() > 30:
                code, body = http_get(port, "/probe")
                try:
                    verdicts = json.loads(body) if code == 200 else []
                except ValueError:
                    verdicts = []
                if isinstance(verdicts, list) and verdicts:  # an empty list until the first probe ends
                    probed = round(time.monotonic() - t0, 2)
                    data["probe"] = [{"gpu": v.get("gpu"), "status": v.get("status"), "reasons": v.get("reasons")}
                                     for v in verdicts if isinstance(v, dict)]
                    break
                time.sleep(1.0)
            if probed is not None:
                data["first_probe_seconds"] = probed
                for i in range(100):
                    http_get(port, SERVE_PATHS[i % len(SERVE_PATHS)])
                code, body = http_get(port, "/readiness")
                data["readiness_after_probe"] = {"status": code, "body": _json_or_text(body)}
                data["rss_mib"]["after_first_probe_and_100_more"] = vm_status(proc.pid)
            else:
                data["first_probe_seconds"] = None
                data["note"] = f"the first probe had not finished after {wait:g} s (not waited for longer)"
        finally:
            t3 = time.monotonic()
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                rc = None
                _killpg(proc.pid)
                proc.wait()
            _killpg(proc.pid)
            data["sigterm"] = {"exit_code": rc, "seconds_to_exit": round(time.monotonic() - t3, 2)}
    data["log_tail"] = tail(read_text(log_path), 8)
    if data["sigterm"]["exit_code"] != 0:
        reasons.append(f"SIGTERM: exit {data['sigterm']['exit_code']}")
    rss = data["rss_mib"]
    summary = (f"first /readiness answer {data['first_readiness']['status']} after {data['first_readiness']['seconds']} s "
               f"(backend {data['backend']}); RSS " + ", ".join(f"{v.get('VmRSS')} MiB {k.replace('_', ' ')}" for k, v in rss.items())
               + f"; {data['requests'].get('count')} requests at {data['requests'].get('per_second')}/s, "
               f"{data['requests'].get('errors')} failed; first probe "
               + (f"after {data['first_probe_seconds']} s" if data.get("first_probe_seconds") else "not waited for")
               + f"; SIGTERM -> exit {data['sigterm']['exit_code']} in {data['sigterm']['seconds_to_exit']} s")
    return {"status": "failed" if reasons else "passed", "reason": "; ".join(reasons), "summary": summary, "data": data}


def _json_or_text(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return body[:500].decode("utf-8", "replace")
