"""The agent's HTTP server under hostile clients: head-size cap, request deadline, connection cap,
default bind address, and which documentation paths exist. A real uvicorn (the agent's own
configuration, gpu_tune/serve/httpserver.py) serves the real app on 127.0.0.1 in a thread."""

from __future__ import annotations

import asyncio
import asyncio.selector_events
import http.client
import json
import re
import socket
import threading
import time
from pathlib import Path

import pytest

from gpu_tune.serve import httpserver
from gpu_tune.serve.app import create_app
from gpu_tune.serve.server import _bind
from gpu_tune.serve.snapshot import AgentState

REPO = Path(__file__).resolve().parents[1]


class Served:
    """uvicorn with :func:`gpu_tune.serve.httpserver.config` on an ephemeral loopback port, in a thread."""

    def __init__(self, **limits) -> None:
        import uvicorn

        state = AgentState("gpu-node-1", "training", interval=10, grace=5)
        self.sock = _bind("127.0.0.1", 0)  # the listening socket as `gpu-tune serve` makes it
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(httpserver.config(create_app(state), **limits))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "Served":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()

    def connect(self, timeout: float = 10.0) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)

    def get(self, path: str = "/readiness", timeout: float = 10.0) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_every_connection_sends_small_answers_at_once(loop):
    """TCP_NODELAY on each connection the agent accepts, with uvloop and with asyncio's own loop
    (where uvloop is not installed; asyncio sets it only on a socket that says it is TCP: ``_bind``
    makes it so): without it, each small answer on a kept-alive connection waits ~40 ms for the
    client's delayed ACK (Nagle). Read off the server's own sockets, not timed
    (benchmarks/bench_http.py's p99 < 10 ms at 8 connections is the figure it shows up in)."""
    with Served(loop=loop) as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        for _ in range(3):  # kept alive: three requests on one connection
            conn.request("GET", "/healthz")
            assert conn.getresponse().read()
        conns = list(srv.server.server_state.connections)
        assert conns, "no connection in the server's table"
        for proto in conns:
            sock = proto.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY), "TCP_NODELAY not set"
        conn.close()


def read_until_closed(s: socket.socket, limit: int = 1 << 20) -> bytes:
    """What the server sends until it closes (a reset after its reply counts as closed)."""
    out = b""
    try:
        while len(out) < limit:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    except ConnectionResetError:
        pass
    return out


# How long a test watches a connection that a missing bound would never close: far past every
# deadline here (1-2 s), so a busy machine that is late by seconds still passes, and a bound that
# does not hold still fails. How close to its deadline a connection goes is
# benchmarks/bench_http_limits.py's figure (a header line every 5 s: closed after 5.5 s).
NEVER = 30.0


def closed_within(s: socket.socket, seconds: float, trickle: bytes = b"") -> float | None:
    """Seconds until the server closes ``s`` (None if still open after ``seconds``); sends
    ``trickle`` once a second meanwhile, as a slow client would."""
    t0 = time.monotonic()
    s.settimeout(1.0)
    while time.monotonic() - t0 < seconds:
        try:
            if s.recv(65536) == b"":
                return time.monotonic() - t0
        except socket.timeout:
            pass
        except ConnectionResetError:
            return time.monotonic() - t0
        if trickle:
            try:
                s.sendall(trickle)
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - t0
    return None


# -- head size ---------------------------------------------------------------------------------
def test_oversized_header_is_431_and_the_agent_still_serves():
    with Served() as srv:
        with srv.connect() as s:
            s.sendall(b"GET /readiness HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (httpserver.MAX_HEAD_BYTES + 100)
                      + b"\r\n\r\n")
            reply = read_until_closed(s)
        assert reply.startswith(b"HTTP/1.1 431 "), reply[:200]
        assert b"connection: close" in reply.lower()
        assert srv.get("/readiness")[0] == 503  # still answering (no snapshot yet: 503)
        assert srv.get("/healthz")[0] == 200


def test_oversized_request_line_is_431():
    with Served() as srv:
        with srv.connect() as s:
            s.sendall(b"GET /" + b"a" * (httpserver.MAX_HEAD_BYTES + 10) + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_until_closed(s).startswith(b"HTTP/1.1 431 ")


def test_many_small_headers_count_together():
    """The cap is on the whole head, not on one header: 1,000 small headers pass no per-line limit."""
    with Served() as srv:
        with srv.connect() as s:
            head = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 20) for i in range(1000))
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")
            assert read_until_closed(s).startswith(b"HTTP/1.1 431 ")


def test_head_just_under_the_cap_is_answered():
    with Served() as srv:
        start = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: "
        end = b"\r\nConnection: close\r\n\r\n"
        head = start + b"p" * (httpserver.MAX_HEAD_BYTES - len(start) - len(end)) + end
        assert len(head) == httpserver.MAX_HEAD_BYTES
        with srv.connect() as s:
            for i in range(0, len(head), 1000):  # in many reads: the count runs across them
                s.sendall(head[i:i + 1000])
                time.sleep(0.001)
            assert read_until_closed(s).startswith(b"HTTP/1.1 200 ")


def test_keep_alive_requests_each_get_their_own_cap():
    """The count starts again with each request on a kept-alive connection."""
    with Served() as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        try:
            for _ in range(4):  # 4 x 12 KiB of headers on one connection: 48 KiB in all
                conn.request("GET", "/healthz", headers={"X-Pad": "p" * (12 * 1024)})
                r = conn.getresponse()
                r.read()
                assert r.status == 200
        finally:
            conn.close()


def test_pipelined_requests_pass():
    with Served() as srv:
        with srv.connect() as s:
            one = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
            s.sendall(one * 600 + b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert read_until_closed(s, limit=1 << 24).count(b"HTTP/1.1 200 ") == 601


@pytest.mark.slow
def test_a_100mb_header_does_not_grow_the_process():
    """Loose sanity bound; benchmarks/bench_http_limits.py measures the growth."""
    import psutil
    proc = psutil.Process()
    with Served() as srv:
        srv.get("/healthz")
        before = proc.memory_info().rss
        with srv.connect() as s:
            s.sendall(b"GET /readiness HTTP/1.1\r\nHost: x\r\nX-Big: ")
            chunk = b"a" * (1 << 20)
            sent = 0
            try:
                while sent < 100 << 20:
                    s.sendall(chunk)
                    sent += len(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass
        grown = proc.memory_info().rss - before
        assert grown < 50 << 20, f"RSS grew {grown / 2**20:.0f} MiB"
        assert srv.get("/healthz")[0] == 200


# -- deadline ----------------------------------------------------------------------------------
def test_slowloris_connection_is_closed_within_the_deadline():
    timeout = 1.0
    with Served(request_timeout=timeout) as srv:
        with srv.connect() as s:
            s.sendall(b"GET /readiness HTTP/1.1\r\nHost: x\r\n")
            s.settimeout(NEVER)
            reply = b""
            try:
                while True:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    reply += chunk
                    s.sendall(b"X-Slow: 1\r\n")
            except ConnectionResetError:
                pass
            except socket.timeout:
                pytest.fail(f"slow connection still open after {NEVER:g} s (its deadline: {timeout:g} s)")
        assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]


def test_trickling_headers_do_not_extend_the_deadline():
    """One header line a second: each line resets no timer; the whole head has one deadline."""
    timeout = 2.0
    with Served(request_timeout=timeout) as srv:
        with srv.connect() as s:
            s.sendall(b"GET /readiness HTTP/1.1\r\nHost: x\r\n")
            lived = closed_within(s, NEVER, trickle=b"X-Slow: 1\r\n")
        assert lived is not None, f"still open after {NEVER:g} s (its deadline: {timeout:g} s)"


def test_silent_connection_is_closed():
    timeout = 1.0
    with Served(request_timeout=timeout) as srv:
        with srv.connect() as s:
            assert closed_within(s, NEVER) is not None


def test_slow_body_is_cut_off():
    """The deadline covers the whole request: a body trickled after a complete head too."""
    timeout = 1.0
    with Served(request_timeout=timeout) as srv:
        with srv.connect() as s:
            s.sendall(b"POST /readiness HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
            assert closed_within(s, NEVER, trickle=b"x") is not None


def test_many_slow_connections_leave_readiness_answering():
    """200 half-sent requests at once: /readiness answers while every one of them is still open
    (it did not wait for their deadline: an order of events, not a time), then they all go, each
    with a 408 at its deadline."""
    timeout = 10.0
    with Served(request_timeout=timeout) as srv:
        slow = []
        try:
            for _ in range(200):
                s = srv.connect()
                s.sendall(b"GET /readiness HTTP/1.1\r\nHost: x\r\n")
                slow.append(s)
            assert srv.get("/readiness", timeout=3 * timeout)[0] == 503
            for s in slow:  # nothing sent to them yet, none closed: their deadline has not come
                s.setblocking(False)
                with pytest.raises(BlockingIOError):
                    s.recv(1)
            for s in slow:
                s.settimeout(3 * timeout)
                assert read_until_closed(s).startswith(b"HTTP/1.1 408 ")
        finally:
            for s in slow:
                s.close()


def test_full_table_evicts_the_longest_waiting_connection():
    """With the connection table full of silent clients, a new client is still answered."""
    with Served(max_connections=20, request_timeout=60) as srv:
        silent = []
        try:
            deadline = time.monotonic() + 20
            for i in range(20):  # one at a time, each accepted before the next: their age is their order
                silent.append(srv.connect())
                while len(srv.server.server_state.connections) < i + 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.005)
            assert srv.get("/healthz", timeout=5)[0] == 200
            # the oldest silent connection made room; the newest is still open
            assert closed_within(silent[0], NEVER) is not None
            assert closed_within(silent[-1], 0.2) is None
            time.sleep(0.2)
            assert srv.get("/readiness", timeout=5)[0] == 503
        finally:
            for s in silent:
                s.close()


def test_full_table_of_busy_connections_refuses_with_503():
    """A connection in the middle of a request is never evicted: the newcomer gets 503."""
    with Served(max_connections=1, request_timeout=60) as srv:
        with srv.connect() as busy:
            busy.sendall(b"POST /readiness HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
            assert busy.recv(65536).startswith(b"HTTP/1.1 405 ")  # answered; its body is still due
            with srv.connect() as late:
                assert read_until_closed(late).startswith(b"HTTP/1.1 503 ")
            busy.sendall(b"x" * 1000)
        time.sleep(0.2)
        assert srv.get("/healthz")[0] == 200


def test_connection_limit_leaves_descriptors_to_the_agent():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
        assert httpserver.connection_limit() == 1024 - httpserver.FD_RESERVE
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 100000), hard))
        assert httpserver.connection_limit() == min(httpserver.MAX_CONNECTIONS, min(hard, 100000) - 256)
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, hard))
        assert httpserver.connection_limit() == 8
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# -- bind address and documentation paths ----------------------------------------------------
def test_serve_listens_on_loopback_by_default():
    import inspect

    from gpu_tune.cli.serve import serve_cmd
    from gpu_tune.serve.options import ServeOptions

    assert ServeOptions().host == "127.0.0.1"
    default = inspect.signature(serve_cmd).parameters["host"].default
    assert default == "127.0.0.1"


def test_serve_help_shows_loopback_default():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "gpu_tune", "serve", "--help"], capture_output=True, text=True,
                         cwd=REPO, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"}, timeout=60)
    assert out.returncode == 0, out.stderr
    host = out.stdout[out.stdout.index("--host"):out.stdout.index("--port")]
    assert "default: 127.0.0.1" in host and "0.0.0.0" not in out.stdout


def test_only_the_schema_is_served_and_it_lists_only_the_api():
    """/openapi.json is served, lists what is served and is documented; /docs and /redoc are
    neither served nor advertised."""
    with Served() as srv:
        code, body = srv.get("/openapi.json")
        assert code == 200
        paths = set(json.loads(body)["paths"])
        assert {"/readiness", "/healthz", "/audit", "/topology", "/probe", "/metrics"} <= paths
        for path in paths:  # the schema lists only what is served
            assert srv.get(path)[0] != 404, path
        for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
            assert srv.get(path)[0] == 404, path
    docs = {p: p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]}
    assert any("/openapi.json" in text for text in docs.values())
    assert "no interactive documentation pages" in docs[REPO / "docs" / "security.md"]
    for p, text in docs.items():  # no address of the agent with /docs or /redoc to open
        assert not re.search(r"(?:9410|localhost|127\.0\.0\.1|node-ip>)[^\s`]*/(?:docs|redoc)\b", text), p


# -- back-pressure: clients that pipeline and do not read the answers -------------------------------
PIPELINED = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


def _guarded(srv: Served) -> list:
    return [c for c in list(srv.server.server_state.connections)
            if isinstance(c, httpserver.GuardedHttpToolsProtocol)]


def _write_without_reading(s: socket.socket, data: bytes, seconds: float) -> tuple[int, bool]:
    """Write as much of ``data`` (repeated) as the server takes within ``seconds``; never read.
    Returns (bytes sent, whether the server closed the connection meanwhile)."""
    s.setblocking(False)
    sent, end = 0, time.monotonic() + seconds
    view = memoryview(data)
    while time.monotonic() < end:
        try:
            sent += s.send(view[sent % len(data):])
        except BlockingIOError:
            time.sleep(0.01)
        except OSError:
            return sent, True
    return sent, False


def test_pipelined_requests_all_answered_in_order():
    paths = ["/healthz", "/readiness", "/nope", "/healthz"] * 200
    with Served() as srv, srv.connect() as s:
        s.sendall(b"".join(f"GET {p} HTTP/1.1\r\nHost: x\r\n\r\n".encode() for p in paths))
        s.settimeout(10)
        got = b""
        while got.count(b"HTTP/1.1 ") < len(paths):
            chunk = s.recv(1 << 20)
            assert chunk, f"closed after {got.count(b'HTTP/1.1 ')} answers"
            got += chunk
        codes = [int(line.split()[1]) for line in re.findall(rb"HTTP/1\.1 \d+", got)]
        assert codes == [{"/healthz": 200, "/readiness": 503, "/nope": 404}[p] for p in paths]


def test_a_client_that_never_reads_holds_a_bounded_queue():
    """20,000 pipelined requests, no answer read: the server parses at most a few ahead of the
    one it answers, holds at most one read of the rest, and stops reading that connection."""
    with Served(send_timeout=60) as srv, srv.connect() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sent = []
        writer = threading.Thread(target=lambda: sent.append(_write_without_reading(s, PIPELINED * 20_000, 3.0)[0]))
        writer.start()
        worst_pipeline = worst_held = 0
        while writer.is_alive():
            for c in _guarded(srv):
                worst_pipeline = max(worst_pipeline, len(c.pipeline))
                worst_held = max(worst_held, len(c._held) - c._held_pos)
            time.sleep(0.01)
        writer.join()
        assert worst_pipeline <= httpserver.MAX_PIPELINED
        # one read of the event loop's transport (256 KiB), plus at most one more that arrived
        # before the pause took effect; far less than the client managed to send
        one_read = asyncio.selector_events._SelectorSocketTransport.max_size
        assert worst_held <= 2 * one_read, (worst_held, sent)
        print(f"held at most {worst_held} bytes of {sent[0]} sent")
        assert srv.get("/healthz", timeout=5)[0] == 200


def test_answers_unread_past_the_send_timeout_close_the_connection():
    with Served(send_timeout=1.0) as srv, srv.connect() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        big = b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n" * 2000  # answers of a few KB each
        # the send timeout is 1 s; a server that never closes it leaves it writable for the whole minute
        _, closed = _write_without_reading(s, big, 60.0)
        assert closed, "still writable after 60 s: the server never closed the connection"
        assert not _guarded(srv) or all(c.transport.is_closing() for c in _guarded(srv))


def test_connections_held_back_keep_within_their_budget(monkeypatch):
    """30 clients that never read, a budget of 64 KiB: those held back longest are closed, and
    the rest keep no more than the budget (checked at each sweep)."""
    sweeps = []
    real = httpserver._sweep

    def sweep(*args):
        real(*args)
        sweeps.append(1)
    monkeypatch.setattr(httpserver, "_sweep", sweep)  # looked up by name each time one is scheduled
    with Served(send_timeout=60, blocked_budget=64 * 1024) as srv:
        socks = [srv.connect() for _ in range(30)]
        try:
            writers = [threading.Thread(target=_write_without_reading, args=(s, PIPELINED * 2000, 2.0))
                       for s in socks]
            for w in writers:
                w.start()
            for w in writers:
                w.join()
            done, deadline = len(sweeps), time.monotonic() + 60
            while len(sweeps) < done + 2:  # two whole sweeps since the last byte was written
                assert time.monotonic() < deadline, "the server stopped sweeping its connections"
                time.sleep(0.05)
            kept = sum(c._kept_bytes() for c in _guarded(srv) if c._blocked_since() is not None)
            assert kept <= 64 * 1024
            assert srv.get("/healthz", timeout=5)[0] == 200
        finally:
            for s in socks:
                s.close()


def test_a_full_table_of_clients_that_do_not_read_makes_room_for_a_probe():
    with Served(max_connections=8, send_timeout=60, request_timeout=60) as srv:
        socks = [srv.connect() for _ in range(8)]
        try:
            writers = [threading.Thread(target=_write_without_reading, args=(s, PIPELINED * 2000, 1.5))
                       for s in socks]
            for w in writers:
                w.start()
            for w in writers:
                w.join()
            assert srv.get("/healthz", timeout=5)[0] == 200
        finally:
            for s in socks:
                s.close()


ATTACKER = r"""
import selectors, socket, sys
port, count = int(sys.argv[1]), int(sys.argv[2])
req = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 512
sel = selectors.DefaultSelector()
sel.register(sys.stdin, selectors.EVENT_READ)  # the attack goes on until the test closes this

def connect():
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.setblocking(False)
    sel.register(s, selectors.EVENT_WRITE)

for _ in range(count):
    connect()
print("connected", flush=True)
while True:
    for key, _ in sel.select(0.1):
        if key.fileobj is sys.stdin:
            raise SystemExit(0)
        try:
            key.fileobj.send(req)
        except BlockingIOError:
            pass
        except OSError:  # the server closed it (its answers went unread): another takes its place
            sel.unregister(key.fileobj)
            key.fileobj.close()
            connect()
"""


SERVER = r"""
import socket, sys
sys.path.insert(0, {repo!r})
import uvicorn
from gpu_tune.serve import httpserver
from gpu_tune.serve.app import create_app
from gpu_tune.serve.server import _bind
from gpu_tune.serve.snapshot import AgentState
sock = _bind("127.0.0.1", 0)
httpserver.small_receive_buffer(sock)
print(sock.getsockname()[1], flush=True)
uvicorn.Server(httpserver.config(create_app(AgentState("gpu-node-1", "training", interval=10)))).run(sockets=[sock])
"""


def liveness_probe() -> dict:
    """The DaemonSet's liveness probe on ``/healthz`` (daemonset/base/daemonset.yaml)."""
    import yaml

    doc = yaml.safe_load((REPO / "daemonset/base/daemonset.yaml").read_text())
    (agent,) = [c for c in doc["spec"]["template"]["spec"]["containers"] if c["livenessProbe"]["httpGet"]["path"] == "/healthz"]
    return agent["livenessProbe"]


def test_healthz_answers_while_many_clients_pipeline_and_never_read():
    """200 connections write pipelined requests and read nothing, for as long as the probes take
    (a connection the server closes is opened again): each of 5 probes, one request on a fresh
    connection as a kubelet sends it, is answered 200 while the attack goes on, before the kubelet
    would restart the agent (the liveness probe's period times its failure threshold). The server
    and the clients each run in a process of their own, as the agent and its attackers do.

    How fast it answers is a figure, not a bound here: on a busy machine (the suite's workers and
    two busy loops on 2 CPUs) the first answer took 4.2 s while the 200 connections' first burst
    was read. ``benchmarks/bench_http_limits.py --only pipeline --busy 2`` measures the answers
    against the probe's ``timeoutSeconds`` with every CPU busy (docs/security.md)."""
    import subprocess
    import sys

    probe = liveness_probe()
    window = probe["periodSeconds"] * probe["failureThreshold"]
    server = subprocess.Popen([sys.executable, "-c", SERVER.format(repo=str(REPO))], stdout=subprocess.PIPE, text=True)
    attack = None
    try:
        port = int(server.stdout.readline())  # printed once the socket listens: connections queue from here
        attack = subprocess.Popen([sys.executable, "-c", ATTACKER, str(port), "200"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert attack.stdout.readline().strip() == "connected"
        answers = []
        for _ in range(5):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=window)
            try:
                conn.request("GET", "/healthz")
                answers.append(conn.getresponse().status)
            finally:
                conn.close()
        assert attack.poll() is None, "the attack ended before the probes did"
        assert answers == [200] * 5, answers
    finally:
        for p in (attack, server):
            if p is not None:
                p.kill()
                p.wait()
