#!/usr/bin/env python3
"""The agent's HTTP server under hostile clients, and what its bounds cost.

    .venv/bin/python benchmarks/bench_http_limits.py [--duration 5] [--repeat 2] [--json]

Starts, each in its own process on 127.0.0.1 with a 1,024-descriptor limit (a common container
default): the agent's API as ``gpu-tune serve`` serves it (``gpu_tune/serve/httpserver.py``), the same app
under uvicorn's plain httptools protocol (how it was served before the bounds), and a bare
FastAPI handler returning fixed bytes under uvicorn's defaults. Then:

1. two connections at once each send a request whose one header value is 100 MB: the server's
   RSS before, at its peak during, and 2 s after, and what each client got back;
2. one connection sends a header line every 5 s: how long it stays open;
3. 1,100 connections each send half a request and stay (more than the descriptors left): how
   fast ``/readiness`` answers while they are open;
4. ``wrk`` at 8 connections on ``/readiness``, on the bare handler and on the unbounded server,
   the three at once (so the neighbours' load falls on each alike), in rounds; the median ratio;
5. (the agent only) 8, 200, then 1,100 connections each send ``GET /healthz`` requests back to back
   for 15 s and never read an answer, while a fresh connection asks for ``/healthz`` every 0.5 s;
   then they close: the server's RSS before, at its peak, and 5 s after the close (an attack
   that takes the server past 2.5 GB is stopped there: the machine is shared).

Targets: RSS grows < 5 MB during (1); the slow connection is closed within 10 s (deadline 5 s);
``/readiness`` answers during (3); (4) >= 100 % of the bare handler; during (5) RSS grows
< 20 MB, ``/healthz`` answers every time, and RSS is back within 10 MB of where it started.
``--only pipeline`` (or any comma-separated sections) runs a part.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_http import free_port, parse_wrk, serve_agent, serve_bare, wait_up  # noqa: E402

SERVER_NOFILE = 1024
ATTACK_BYTES = 100 * 1024 * 1024
SLOW_CAP_S = 30.0


def start(argv: list[str]) -> subprocess.Popen:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (SERVER_NOFILE, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    out = subprocess.PIPE if "--serve-agent" in argv or "--serve-plain" in argv else subprocess.DEVNULL
    return subprocess.Popen(argv, stdout=out, stderr=subprocess.DEVNULL, text=True, cwd=REPO,
                            start_new_session=True, preexec_fn=limit)


def rss_mb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 1e6


# -- 1. the 100 MB header --------------------------------------------------------------------
def big_header(port: int, result: dict, key: int) -> None:
    sent, reply = 0, b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
            s.sendall(b"GET /readiness HTTP/1.1\r\nHost: x\r\nX-Big: ")
            chunk = b"a" * (1 << 20)
            try:
                while sent < ATTACK_BYTES:
                    s.sendall(chunk)
                    sent += len(chunk)
                s.sendall(b"\r\nConnection: close\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
            s.settimeout(60)
            try:
                while True:
                    data = s.recv(65536)
                    if not data:
                        break
                    reply += data
            except (ConnectionResetError, socket.timeout):
                pass
    except OSError as exc:
        reply = f"error {exc}".encode()
    line = reply.split(b"\r\n", 1)[0].decode(errors="replace") if reply else "closed, no reply"
    result[key] = {"sent_mb": round(sent / 1e6, 1), "reply": line}


def header_attack(pid: int, port: int) -> dict:
    before = rss_mb(pid)
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                peak[0] = max(peak[0], rss_mb(pid))
            except Exception:
                pass
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    clients: dict = {}
    t0 = time.monotonic()
    threads = [threading.Thread(target=big_header, args=(port, clients, i)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    took = time.monotonic() - t0
    time.sleep(2.0)
    done.set()
    sampler.join()
    after = rss_mb(pid)
    return {"rss_before_mb": round(before, 1), "rss_peak_mb": round(peak[0], 1), "rss_after_2s_mb": round(after, 1),
            "growth_mb": round(peak[0] - before, 1), "seconds": round(took, 2), "clients": [clients[0], clients[1]]}


# -- 2. one header line every 5 s ------------------------------------------------------------
def slowloris(port: int, every: float = 5.0, cap: float = SLOW_CAP_S) -> float | None:
    """Seconds the connection stayed open (None: still open at ``cap``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /readiness HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        next_line = t0 + every
        s.settimeout(0.05)
        while time.monotonic() - t0 < cap:
            try:
                if s.recv(65536) == b"":
                    return time.monotonic() - t0
            except socket.timeout:
                pass
            except ConnectionResetError:
                return time.monotonic() - t0
            if time.monotonic() >= next_line:
                try:
                    s.sendall(b"X-Slow: 1\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    return time.monotonic() - t0
                next_line += every
        return None


# -- 4. throughput ----------------------------------------------------------------------------
def wrk_cpu(url: str, pid: int, duration: float, connections: int = 8) -> dict[str, float]:
    """wrk's figures plus the server's CPU time per request (user + system): on a shared machine
    the CPU cost moves far less with the neighbours' load than requests per second do."""
    import psutil

    proc = psutil.Process(pid)
    c0 = proc.cpu_times()
    res = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{duration:g}s", "--latency", "--timeout", "5s", url],
                         capture_output=True, text=True, timeout=duration + 30)
    c1 = proc.cpu_times()
    if res.returncode != 0:
        raise SystemExit(f"wrk failed: {res.stderr.strip()}")
    out = parse_wrk(res.stdout)
    m = re.search(r"(\d+) requests in", res.stdout)
    n = int(m.group(1)) if m else 0
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    out["requests"] = n
    out["cpu_us_per_request"] = round(cpu / n * 1e6, 1) if n else float("nan")
    return out


# -- 3. more half-requests than descriptors --------------------------------------------------
def get_ms(port: int, path: str = "/readiness", timeout: float = 3.0) -> tuple[int | str, float]:
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            r.read()
            code: int | str = r.status
    except urllib.error.HTTPError as e:
        code = e.code
    except OSError as exc:
        code = type(exc).__name__
    return code, (time.perf_counter() - t0) * 1000.0


def crowd(port: int, count: int, pid: int | None = None) -> dict:
    socks = []
    refused = 0
    before = rss_mb(pid) if pid else None
    during = None
    try:
        for _ in range(count):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=3)
                s.sendall(b"GET /readiness HTTP/1.1\r\nHost: x\r\n")
                socks.append(s)
            except OSError:
                refused += 1
        time.sleep(0.5)
        probes = [get_ms(port) for _ in range(10)]
        during = rss_mb(pid) if pid else None
    finally:
        for s in socks:
            s.close()
    after = None
    if pid:
        time.sleep(5.0)
        after = rss_mb(pid)
    answered = [ms for code, ms in probes if code in (200, 503)]
    return {"opened": len(socks), "connect_failed": refused, "readiness_answered": f"{len(answered)}/{len(probes)}",
            "rss_before_mb": before and round(before, 1), "rss_open_mb": during and round(during, 1),
            "rss_5s_after_close_mb": after and round(after, 1),
            "readiness_median_ms": round(statistics.median(answered), 2) if answered else None,
            "failures": sorted({str(code) for code, _ in probes if code not in (200, 503)})}


# -- 5. pipelined requests whose answers are never read ---------------------------------------
PIPELINE_RSS_CAP_MB = 2500.0  # the attack stops here: the machine is shared


def liveness_probe() -> dict:
    """The DaemonSet's liveness probe on ``/healthz`` (daemonset/base/daemonset.yaml): what a
    kubelet counts as a failed probe (``timeoutSeconds``) and when it restarts the agent
    (``failureThreshold`` failures in a row, one every ``periodSeconds``)."""
    import yaml

    doc = yaml.safe_load((REPO / "daemonset/base/daemonset.yaml").read_text())
    for c in doc["spec"]["template"]["spec"]["containers"]:
        probe = c.get("livenessProbe") or {}
        if probe.get("httpGet", {}).get("path") == "/healthz":
            return probe
    raise SystemExit("daemonset/base/daemonset.yaml: no liveness probe on /healthz")


def busy_loops(n: int) -> list[subprocess.Popen]:
    """``n`` processes spinning on a CPU each: the node's own work, which the agent shares its CPUs with."""
    return [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(n)]


def slow_streak(probes: list[tuple[int | str, float]], timeout_s: float) -> int:
    """The longest run of probes in a row that a kubelet would count as failed (not 200 within
    ``timeout_s``)."""
    longest = run = 0
    for code, ms in probes:
        run = run + 1 if code != 200 or ms > timeout_s * 1000.0 else 0
        longest = max(longest, run)
    return longest


def pipeline_attack(pid: int, port: int, count: int, seconds: float = 15.0, path: str = "/healthz") -> dict:
    """``count`` connections each send ``GET path`` requests back to back as fast as the server
    takes them and never read an answer, for ``seconds``; meanwhile a fresh connection asks for
    ``/healthz`` every 0.5 s. Then every attacking connection is closed. RSS before, at its peak,
    and 5 s after the close."""
    import selectors

    req = f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode() * 512
    before = rss_mb(pid)
    peak = [before]
    stop = threading.Event()
    capped = [False]

    def sample() -> None:
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], rss_mb(pid))
            except Exception:
                pass
            if peak[0] > PIPELINE_RSS_CAP_MB:
                capped[0] = True
                stop.set()
            time.sleep(0.05)

    # the prober is a process of its own: in this one it would wait for the sending loop's GIL
    live = liveness_probe()
    prober = subprocess.Popen([sys.executable, __file__, "--probe-healthz", str(port), str(seconds),
                               str(live["timeoutSeconds"])], stdout=subprocess.PIPE, text=True, cwd=REPO)

    socks: list[socket.socket] = []
    failed = 0
    sel = selectors.DefaultSelector()
    for _ in range(count):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=3)
        except OSError:
            failed += 1
            continue
        s.setblocking(False)
        socks.append(s)
        sel.register(s, selectors.EVENT_WRITE)
    threads = [threading.Thread(target=sample, daemon=True)]
    for t in threads:
        t.start()
    sent = 0
    t0 = time.monotonic()
    try:
        while not stop.is_set() and time.monotonic() - t0 < seconds:
            for key, _ in sel.select(timeout=0.1):
                try:
                    sent += key.fileobj.send(req)
                except BlockingIOError:
                    pass
                except OSError:
                    sel.unregister(key.fileobj)
    finally:
        took = time.monotonic() - t0
        stop.set()
        for t in threads:
            t.join(5)
        if capped[0]:
            prober.terminate()
        out, _ = prober.communicate(timeout=seconds + 30)
        probes = [tuple(x) for x in json.loads(out or "[]")]
        sel.close()
        for s in socks:
            s.close()
    time.sleep(5.0)
    after = rss_mb(pid)
    answered = [ms for code, ms in probes if code == 200]
    timeout_s = float(live["timeoutSeconds"])
    slow = [ms for code, ms in probes if code != 200 or ms > timeout_s * 1000.0]
    return {"connections": len(socks), "connect_failed": failed, "seconds": round(took, 1),
            "requests_sent": sent // (len(req) // 512), "rss_before_mb": round(before, 1),
            "rss_peak_mb": round(peak[0], 1), "growth_mb": round(peak[0] - before, 1),
            "rss_5s_after_close_mb": round(after, 1), "left_after_close_mb": round(after - before, 1),
            "stopped_at_rss_cap": capped[0],
            "healthz_answered": f"{len(answered)}/{len(probes)}",
            "healthz_median_ms": round(statistics.median(answered), 2) if answered else None,
            "healthz_p95_ms": round(sorted(answered)[int(0.95 * (len(answered) - 1))], 1) if answered else None,
            "healthz_max_ms": round(max(answered), 1) if answered else None,
            "liveness_timeout_s": timeout_s, "liveness_failure_threshold": live["failureThreshold"],
            "healthz_past_liveness_timeout": len(slow),
            "healthz_longest_failing_streak": slow_streak(probes, timeout_s),
            "healthz_failures": sorted({str(code) for code, _ in probes if code != 200})}


SECTIONS = ("header", "slowloris", "crowd", "pipeline", "wrk")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per wrk run (default 5)")
    ap.add_argument("--repeat", type=int, default=3, help="wrk rounds, median kept (default 3)")
    ap.add_argument("--crowd", type=int, default=1100, help="half-requests held open in step 3, and pipelining "
                                                          "connections in step 5 (default 1100)")
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma-separated sections to run (default all: {','.join(SECTIONS)})")
    ap.add_argument("--pipelined", default="8,200,1100",
                    help="connection counts of step 5, one after another on the same server (default 8,200,1100)")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--serve-agent", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--serve-plain", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--serve-bare", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--busy", type=int, default=0,
                    help="processes spinning on a CPU each while the sections run (default 0; --busy 2 on 2 CPUs: "
                         "a node whose CPUs are all busy)")
    ap.add_argument("--probe-healthz", nargs=3, type=float, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.probe_healthz:  # GET /healthz every 0.5 s for the given seconds, each with the kubelet's timeout
        port, seconds, timeout_s = int(a.probe_healthz[0]), a.probe_healthz[1], a.probe_healthz[2]
        got, end = [], time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                got.append(get_ms(port, "/healthz", timeout=timeout_s))
                time.sleep(0.5)
        finally:
            print(json.dumps(got), flush=True)
        return 0
    if a.serve_agent:
        serve_agent(a.serve_agent, guarded=True)
        return 0
    if a.serve_plain:
        serve_agent(a.serve_plain, guarded=False)
        return 0
    if a.serve_bare:
        serve_bare(a.serve_bare)
        return 0
    only = {x.strip() for x in a.only.split(",") if x.strip()}
    unknown = only - set(SECTIONS)
    if unknown:
        raise SystemExit(f"--only: unknown sections {', '.join(sorted(unknown))} (known: {', '.join(SECTIONS)})")

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = a.crowd + 256
    if soft < want and (hard == resource.RLIM_INFINITY or hard >= want):
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    # the unbounded server and the bare handler only where a section compares with them
    names = ["agent"] + (["plain"] if only & {"header", "slowloris", "crowd", "wrk"} else []) + \
        (["bare"] if "wrk" in only else [])
    ports = {n: free_port() for n in names}
    flags = {"agent": "--serve-agent", "plain": "--serve-plain", "bare": "--serve-bare"}
    procs = {n: start([sys.executable, __file__, flags[n], str(ports[n])]) for n in names}
    served = [n for n in ("agent", "plain") if n in procs]
    doc: dict = {"cpus": os.cpu_count(), "server_nofile": SERVER_NOFILE}
    checks: dict[str, bool] = {}
    ratios: list[float] = []
    ratios_plain: list[float] = []
    runs: dict[str, dict[str, float]] = {}
    doc["busy_loops"] = a.busy
    busy = busy_loops(a.busy)
    try:
        for name in served:
            procs[name].stdout.readline()
        for name, port in ports.items():
            wait_up(f"http://127.0.0.1:{port}/{'fixed' if name == 'bare' else 'healthz'}")
        for name in served:  # a few requests first so the baseline RSS is warm
            for _ in range(50):
                get_ms(ports[name])

        if "header" in only:
            doc["header_100mb_x2"] = {n: header_attack(procs[n].pid, ports[n]) for n in served}
            doc["readiness_after_attack"] = {n: get_ms(ports[n])[0] for n in served}
            checks["RSS grows < 5 MB under two 100 MB headers"] = doc["header_100mb_x2"]["agent"]["growth_mb"] < 5

        if "slowloris" in only:
            slow: dict = {}
            threads = [threading.Thread(target=lambda n=n: slow.__setitem__(n, slowloris(ports[n]))) for n in served]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            doc["slowloris_line_every_5s_open_s"] = {n: (round(v, 2) if v is not None else f"> {SLOW_CAP_S:g}")
                                                     for n, v in slow.items()}
            checks["slow connection closed within 10 s (deadline 5 s)"] = slow["agent"] is not None and slow["agent"] < 10

        if "crowd" in only:
            doc["half_requests"] = {n: crowd(ports[n], a.crowd, procs[n].pid) for n in served}
            checks["/readiness answers with 1,100 half-requests open"] = \
                doc["half_requests"]["agent"]["readiness_answered"] == "10/10"
            time.sleep(6.0)  # let the agent's deadline clear what is left

        if "pipeline" in only:
            # the agent only: uvicorn's plain protocol has no bound here (see docs/security.md)
            doc["pipelined_unread"] = {}
            for count in [int(x) for x in a.pipelined.split(",") if x.strip()]:
                r = pipeline_attack(procs["agent"].pid, ports["agent"], count)
                doc["pipelined_unread"][str(count)] = r
                n = r["healthz_answered"].split("/")
                checks[f"pipelining on {count} connections: RSS grows < 20 MB"] = \
                    r["growth_mb"] < 20 and not r["stopped_at_rss_cap"]
                checks[f"pipelining on {count} connections: /healthz answers throughout"] = n[0] == n[1] != "0"
                checks[f"pipelining on {count} connections: never {r['liveness_failure_threshold']} /healthz in a row "
                       f"past the liveness probe's {r['liveness_timeout_s']:g} s (the kubelet would restart the agent)"] = \
                    r["healthz_longest_failing_streak"] < r["liveness_failure_threshold"]
                # (not to the byte: the allocator keeps some partly used arenas)
                checks[f"pipelining on {count} connections: RSS back within 10 MB after the close"] = \
                    r["left_after_close_mb"] < 10
                time.sleep(6.0)

        if "wrk" in only:
            plan = [("agent /readiness c8", f"http://127.0.0.1:{ports['agent']}/readiness", procs["agent"].pid),
                    ("bare FastAPI c8", f"http://127.0.0.1:{ports['bare']}/fixed", procs["bare"].pid),
                    ("plain uvicorn agent /readiness c8", f"http://127.0.0.1:{ports['plain']}/readiness",
                     procs["plain"].pid)]
            for _, url, pid in plan:
                wrk_cpu(url, pid, 1)
            # The three run at the same time, each round: under the same neighbours' load, each server
            # gets its fair share of the CPUs, so the ratio of their req/s is the ratio of their costs
            # (one after another, the load of a shared machine moves between runs by more than that).
            rounds: list[dict[str, dict[str, float]]] = []
            for _ in range(a.repeat):
                got: dict[str, dict[str, float]] = {}
                threads = [threading.Thread(target=lambda n=n, u=u, p=p: got.__setitem__(n, wrk_cpu(u, p, a.duration)))
                           for n, u, p in plan]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                rounds.append(got)
            for name, _, _ in plan:  # the median round of each
                rs = sorted((r[name] for r in rounds), key=lambda r: r.get("rps", 0))
                runs[name] = rs[len(rs) // 2]
            ratios = [r["agent /readiness c8"]["rps"] / r["bare FastAPI c8"]["rps"] for r in rounds]
            ratios_plain = [r["agent /readiness c8"]["rps"] / r["plain uvicorn agent /readiness c8"]["rps"]
                            for r in rounds]
            doc["wrk"] = runs
            doc["readiness_vs_bare_c8_per_round"] = [round(x, 3) for x in ratios]
            doc["readiness_vs_bare_c8"] = round(statistics.median(ratios), 3)
            doc["readiness_vs_plain_c8"] = round(statistics.median(ratios_plain), 3)
            checks["/readiness req/s at c8 >= 100% of bare FastAPI"] = statistics.median(ratios) >= 1.0
    finally:
        for p in busy:
            p.kill()
            p.wait()
        for p in procs.values():
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)

    doc["checks"] = checks
    if a.json:
        print(json.dumps(doc, indent=1))
        return 0 if all(checks.values()) else 1
    print(f"{os.cpu_count()} CPUs; servers limited to {SERVER_NOFILE} descriptors; agent = gpu-tune serve's server, "
          f"plain = the same app on uvicorn's plain httptools protocol")
    if "header" in only:
        print("two connections, one 100 MB header value each:")
        for n, r in doc["header_100mb_x2"].items():
            print(f"  {n:6} RSS {r['rss_before_mb']:.1f} MB before, {r['rss_peak_mb']:.1f} peak (+{r['growth_mb']:.1f}), "
                  f"{r['rss_after_2s_mb']:.1f} 2 s after; {r['seconds']:.1f} s; clients sent "
                  f"{', '.join(str(c['sent_mb']) for c in r['clients'])} MB and got: "
                  f"{'; '.join(c['reply'] for c in r['clients'])}; /readiness then: {doc['readiness_after_attack'][n]}")
    if "slowloris" in only:
        print("one header line every 5 s, connection open for: "
              + ", ".join(f"{n} {v} s" for n, v in doc["slowloris_line_every_5s_open_s"].items()))
    if "crowd" in only:
        print(f"{a.crowd} half-sent requests held open, then 10 GET /readiness:")
        for n, r in doc["half_requests"].items():
            print(f"  {n:6} opened {r['opened']} (connect failed {r['connect_failed']}); /readiness answered "
                  f"{r['readiness_answered']}, median {r['readiness_median_ms']} ms; failures {r['failures'] or 'none'}; "
                  f"RSS {r['rss_before_mb']} MB before, {r['rss_open_mb']} while open, {r['rss_5s_after_close_mb']} "
                  "5 s after the close")
    if "pipeline" in only:
        print("pipelined GET /healthz, answers never read, then closed (agent):")
        for n, r in doc["pipelined_unread"].items():
            print(f"  {n:>5} connections ({r['connections']} opened), {r['seconds']} s, {r['requests_sent']:,} "
                  f"requests written (into the clients' socket buffers): RSS {r['rss_before_mb']:.1f} MB before, {r['rss_peak_mb']:.1f} peak "
                  f"(+{r['growth_mb']:.1f}){' (attack stopped at the cap)' if r['stopped_at_rss_cap'] else ''}, "
                  f"{r['rss_5s_after_close_mb']:.1f} 5 s after the close; /healthz answered {r['healthz_answered']}, "
                  f"median {r['healthz_median_ms']} ms, p95 {r['healthz_p95_ms']} ms, max {r['healthz_max_ms']} ms; "
                  f"failures {r['healthz_failures'] or 'none'}; past the liveness probe's {r['liveness_timeout_s']:g} s: "
                  f"{r['healthz_past_liveness_timeout']} (longest streak {r['healthz_longest_failing_streak']}, the "
                  f"kubelet restarts at {r['liveness_failure_threshold']})")
    if "wrk" in only:
        print(f"wrk, 8 connections each, the three at once, {a.duration:g} s, {a.repeat} rounds (the median round):")
        print(f"  {'run':36} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>10} {'server CPU us/req':>18}")
        for name, r in runs.items():
            print(f"  {name:36} {r.get('p50_ms', float('nan')):8.2f} {r.get('p99_ms', float('nan')):8.2f} "
                  f"{r.get('rps', 0):10.0f} {r.get('cpu_us_per_request', float('nan')):18.1f}")
        print(f"/readiness throughput at c8: {statistics.median(ratios):.0%} of bare FastAPI (median of rounds: "
              f"{', '.join(f'{x:.0%}' for x in ratios)}), {statistics.median(ratios_plain):.0%} of the unbounded server")
    for k, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {k}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
