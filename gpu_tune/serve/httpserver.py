"""The agent's HTTP server: uvicorn with httptools, bounded against hostile clients.

uvicorn's httptools protocol has no limit on a request's size before its headers are complete
(httptools joins each header value with ``bytes +=``, uvicorn the URL) and no deadline for a
request to arrive: a client sending a 100 MB header value grows the process by hundreds of MB,
and a client sending one header line every few seconds holds a connection, and a descriptor,
for as long as it likes. :class:`GuardedHttpToolsProtocol` adds three bounds, all checked on
the event loop before any application code runs:

* **head size** (``MAX_HEAD_BYTES``, 16 KiB for the request line and every header together, as
  Node.js's default): the bytes are counted as they arrive and fed to the parser in slices, so
  the parser never holds more than the cap; past it the client gets ``431 Request Header Fields
  Too Large`` and the connection is closed. The agent's clients (kubelet probes, Prometheus,
  curl) send well under 1 KiB. A head that starts in the same read as the end of a previous
  pipelined request is counted from the next read on, so it is refused at twice the cap at most.
* **request deadline** (``REQUEST_TIMEOUT_S``, 5 s, within the 5-10 s usually given to Go's
  ``ReadHeaderTimeout``): from the moment a connection opens, or the first byte of a request on
  a kept-alive one, until the whole request (head and body) has arrived; checked a few times a
  second, so a connection goes at most 0.5 s after its deadline. A connection that is still
  sending gets ``408 Request Timeout`` and is closed; one that sent nothing is closed. Idle
  kept-alive connections are closed by uvicorn's own keep-alive timeout (5 s).
* **connections** (:func:`connection_limit`: at most 1,024, and 256 fewer than the process's
  descriptor limit, so the agent's own files, sockets and probe pipes always have descriptors):
  when the table is full, a new connection evicts the one that has waited longest for a request
  to arrive; only when every connection is in the middle of a request or a response is the new
  one answered ``503`` and closed. A client that sends its request in one packet is never the one waiting longest.
* **back-pressure** (a client that pipelines requests and never reads the answers): every
  client socket has a small receive buffer (``RECV_BUFFER``, 4 KiB asked, so one read returns
  about that much whichever event loop reads it: uvloop reads up to 256 KiB at a time, in which
  ten thousand small pipelined requests fit); requests are handed to the parser one head at a
  time, and once ``MAX_PIPELINED`` (2) wait behind the one being answered, the rest of what was
  read is held (one read at most) and the connection is not read from until an answer is
  complete. A connection's unsent answers are bounded by its transport's high-water mark
  (``WRITE_HIGH``, 16 KiB, then uvicorn waits before the next answer). A connection whose answers
  have not been read for ``SEND_TIMEOUT_S`` (10 s) is closed; all connections held back (their
  answers unread, or requests held) together keep at most ``BLOCKED_BUDGET`` (4 MiB of unsent
  answers and held requests): past it the one held back longest is closed. A full table evicts
  such a connection as it does a waiting one.

WebSockets are off (the agent has none).
"""

from __future__ import annotations

import logging
import resource
import socket
import time
from collections import deque
from typing import Any

from gpu_tune import partial_import

# uvicorn's own __init__ imports its command line (click) and supervisors (multiprocessing): the
# agent uses Config and Server (gpu_tune/partial_import.py), modules every uvicorn since 0.27 has.
# A uvicorn laid out otherwise is imported whole.
try:
    partial_import.install(("uvicorn",), {"uvicorn.Config": ("uvicorn.config", "Config"),
                                          "uvicorn.Server": ("uvicorn.server", "Server")})
except ImportError:
    pass
import uvicorn  # noqa: E402
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # noqa: E402

MAX_HEAD_BYTES = 16 * 1024
REQUEST_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 1024
FD_RESERVE = 256
KEEP_ALIVE_S = 5
# After a 431 the response is followed by FIN and up to this much more input is read and dropped
# for up to LINGER_S, so that a client still sending sees the 431 rather than a reset (nginx's
# lingering close); then the connection is closed whatever the client does.
LINGER_BYTES = 256 * 1024
LINGER_S = 1.0
# Back-pressure: a client socket's receive buffer (what one read can return; the kernel doubles
# it for its own bookkeeping), how many requests may wait behind the one being answered, how much
# unsent output a connection keeps before uvicorn waits, how long answers may go unread, and what
# all connections held back may keep together.
RECV_BUFFER = 4 * 1024
MAX_PIPELINED = 2
# Connections answered from requests they pipelined, at once (the others wait their turn).
PIPELINE_TURNS = 16
WRITE_HIGH = 16 * 1024
SEND_TIMEOUT_S = 10.0
BLOCKED_BUDGET = 4 * 1024 * 1024
_HEAD_END = b"\r\n\r\n"
# Once this many connections were open at once and most have gone, free memory is handed back.
TRIM_AFTER = 64


def small_receive_buffer(sock: socket.socket) -> None:
    """Give ``sock`` (a listening socket: the connections it accepts inherit it) the receive
    buffer of :data:`RECV_BUFFER`; best effort."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUFFER)
    except OSError:  # pragma: no cover - every TCP socket takes it
        pass

log = logging.getLogger("gpu_tune.http")


def connection_limit(max_connections: int = MAX_CONNECTIONS, reserve: int = FD_RESERVE) -> int:
    """How many client connections to hold at once: ``max_connections``, and ``reserve`` fewer
    than the soft ``RLIMIT_NOFILE`` (at least 8)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(8, min(max_connections, soft - reserve))


class _Counts:
    """What the guards did, logged at most once a minute (an attack must not flood the log)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.last = time.monotonic()

    def add(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1
        now = time.monotonic()
        if now - self.last >= 60.0:
            log.warning("HTTP guards in the last %.0f s: %s", now - self.last,
                        ", ".join(f"{n} {k}" for k, n in sorted(self.counts.items())))
            self.counts.clear()
            self.last = now


COUNTS = _Counts()


def _response(status: int, phrase: str, text: str) -> bytes:
    body = (text + "\n").encode()
    return (f"HTTP/1.1 {status} {phrase}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a head-size cap, a request deadline, a connection cap
    and back-pressure on clients that do not read their answers.

    The limits are class attributes; :func:`protocol_class` makes a subclass with others. The
    deadlines are checked by one timer per server that sweeps its connections a few times a
    second while it has any (a timer per request would cost every request an allocation)."""

    max_head_bytes: int = MAX_HEAD_BYTES
    request_timeout: float = REQUEST_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    max_pipelined: int = MAX_PIPELINED
    pipeline_turns: int = PIPELINE_TURNS
    write_high: int = WRITE_HIGH
    send_timeout: float = SEND_TIMEOUT_S
    blocked_budget: int = BLOCKED_BUDGET

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # waiting for (the rest of) a request line and headers
        self._head_bytes = 0
        self._deadline_at: float | None = None  # loop time by which the request must be in
        self._idle_since = 0.0
        self._refused = False
        self._linger_left = 0
        self._held = b""  # requests read but not yet parsed (from _held_pos on): answers are pending
        self._held_pos = 0
        self._held_since: float | None = None
        self._queued = False  # waiting for its turn (in _Turns.waiting)
        self._stalled_since: float | None = None  # since when the client has not read its answers

    # -- the deadline ------------------------------------------------------------------------
    def _sweep_interval(self) -> float:
        return min(0.5, self.request_timeout / 4)

    def _ensure_sweeper(self) -> None:
        st = self.server_state
        if getattr(st, "_gpu_tune_sweeper", None) is None:
            st._gpu_tune_sweeper = self.loop.call_later(self._sweep_interval(), _sweep, st, self.loop,  # type: ignore[attr-defined]
                                                        self._sweep_interval())

    def _timed_out(self) -> None:
        self._deadline_at = None
        if self.transport is None or self.transport.is_closing():
            return
        if self._refused:  # the lingering close after a refusal is over
            self.transport.close()
            return
        COUNTS.add("requests timed out")
        if self._in_head and self._head_bytes > 0:
            self.transport.write(_response(408, "Request Timeout",
                                           f"request not received whole within {self.request_timeout:g} s"))
        self.transport.close()

    # -- refusing ----------------------------------------------------------------------------
    def _refuse(self, status: int, phrase: str, text: str) -> None:
        self._refused = True
        self.transport.write(_response(status, phrase, text))
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self._linger_left = LINGER_BYTES
            self._deadline_at = self.loop.time() + LINGER_S
        else:  # pragma: no cover - TCP transports can
            self.transport.close()

    def _waiting(self) -> bool:
        """Whether this connection is only waiting for a request (nothing to answer)."""
        return (self._in_head and not self._refused
                and (self.cycle is None or self.cycle.response_complete))

    def _blocked_since(self) -> float | None:
        """Since when this connection has been held back: its client not reading its answers,
        or requests of it held until they are; None otherwise."""
        times = [t for t in (self._stalled_since, self._held_since) if t is not None]
        return min(times) if times else None

    def _idle_for(self) -> float | None:
        """Since when this connection has been of no use to a client that reads its answers
        (waiting for a request, or held back); None while it is being served."""
        blocked = self._blocked_since()
        if blocked is not None:
            return blocked
        return self._idle_since if self._waiting() else None

    def _kept_bytes(self) -> int:
        """What this connection keeps in memory: requests held, answers not yet sent."""
        t = self.transport
        out = t.get_write_buffer_size() if t is not None and not t.is_closing() else 0
        return len(self._held) - self._held_pos + out

    def _set_blocked(self, blocked: bool) -> None:
        table = _blocked(self.server_state)
        if blocked:
            table[self] = None  # the sweep keeps them within their budget
        elif self._blocked_since() is None:
            table.pop(self, None)

    def _drop(self, why: str) -> None:
        """Close at once, unsent answers dropped (a client that does not read them would hold a
        graceful close open for ever)."""
        COUNTS.add(why)
        self._deadline_at = None
        _blocked(self.server_state).pop(self, None)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        full = len(self.connections) >= self.max_connections
        super().connection_made(transport)
        transport.set_write_buffer_limits(high=self.write_high)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) > 2 * RECV_BUFFER:
            small_receive_buffer(sock)  # a listener made elsewhere: bound its connections' reads here
        now = self.loop.time()
        self._idle_since = now
        self._deadline_at = now + self.request_timeout
        self._ensure_sweeper()
        if full:
            idle = [(since, c) for c in self.connections if c is not self and isinstance(c, GuardedHttpToolsProtocol)
                    and not c.transport.is_closing() and (since := c._idle_for()) is not None]
            if not idle:
                COUNTS.add("connections refused (table full)")
                self._refuse(503, "Service Unavailable", "too many connections")
                return
            victim = min(idle, key=lambda x: x[0])[1]
            if victim._blocked_since() is not None:
                victim._drop("held-back connections evicted (table full)")
            else:
                COUNTS.add("waiting connections evicted")
                victim._deadline_at = None
                victim.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        _blocked(self.server_state).pop(self, None)
        self._held, self._held_pos = b"", 0
        turns = _turns(self.server_state)
        if self._queued:
            self._queued = False
            turns.waiting.remove(self)
        if self in turns.serving:
            turns.serving.discard(self)
            turns.dispatch(self.pipeline_turns)
        super().connection_lost(exc)
        self.pipeline.clear()  # requests never started; freed now rather than by the cycle collector

    # -- reading: requests parsed while their answers can be written -------------------------------
    def data_received(self, data: bytes) -> None:
        if self._refused:
            self._linger_left -= len(data)
            if self._linger_left <= 0:
                self.transport.close()
            return
        if self._held:  # answers pending: keep it behind what is held (reading is paused)
            self._held = self._held[self._held_pos:] + data
            self._held_pos = 0
            self.flow.pause_reading()
            return
        if (self._in_head and self._head_bytes + len(data) <= self.max_head_bytes and not self.pipeline
                and data.find(_HEAD_END) in (-1, len(data) - 4)):
            # the common case: (part of) one request; nothing waits behind an answer
            if self._deadline_at is None:  # the first bytes of a request on a kept-alive connection
                self._deadline_at = self.loop.time() + self.request_timeout
            self._head_bytes += len(data)
            super().data_received(data)
            return
        self._feed(data, 0)

    def _feed(self, data: bytes, pos: int, queued: int | None = None) -> None:
        """Hand ``data[pos:]`` to the parser one request head at a time, at most
        ``max_head_bytes`` per piece; once ``queued`` (``max_pipelined``) requests wait behind
        the one being answered, hold the rest and stop reading until it is this connection's turn
        (:class:`_Turns`)."""
        view = memoryview(data)
        end_all = len(data)
        most = self.max_pipelined if queued is None else queued
        while pos < end_all:
            if self.transport.is_closing():
                return
            if len(self.pipeline) >= most:
                if pos > len(data) // 2:  # keep what is left, not the whole read
                    data, pos = data[pos:], 0
                self._held, self._held_pos = data, pos
                self.flow.pause_reading()
                if self._held_since is None:
                    self._held_since = self.loop.time()
                    self._set_blocked(True)
                return
            if self._in_head:
                if self._deadline_at is None:
                    self._deadline_at = self.loop.time() + self.request_timeout
                room = self.max_head_bytes - self._head_bytes
                if room <= 0:
                    COUNTS.add("oversized request heads refused")
                    self._refuse(431, "Request Header Fields Too Large",
                                 f"request line and headers exceed {self.max_head_bytes} bytes")
                    return
            else:
                room = self.max_head_bytes
            limit = min(end_all, pos + room)
            i = data.find(_HEAD_END, pos, limit)
            end = i + len(_HEAD_END) if i >= 0 else limit
            if self._in_head:
                self._head_bytes += end - pos
            piece = view[pos:end]
            pos = end
            super().data_received(piece)  # type: ignore[arg-type]

    def _answering(self) -> bool:
        """Whether a request parsed on this connection is still being answered (or waits to be)."""
        return bool(self.pipeline) or (self.cycle is not None and not self.cycle.response_complete)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # starts the next parsed request, resumes reading
        if self.transport.is_closing():
            return
        if self._held:
            self.flow.pause_reading()  # nothing more is read while requests are held
        if self._answering():
            return
        turns = _turns(self.server_state)
        turns.serving.discard(self)
        if self._held and not self._queued:  # a client that pipelines: its next request waits for its turn
            self._queued = True
            turns.waiting.append(self)
        turns.dispatch(self.pipeline_turns)

    def _take_turn(self) -> None:
        """Parse this connection's next held request (and one more at most), now that it is
        its turn; reading resumes once nothing is held."""
        held, pos = self._held, self._held_pos
        self._held, self._held_pos = b"", 0
        self._feed(held, pos, queued=1)
        if not self._held:
            self._held_since = None
            self._set_blocked(False)
            self.flow.resume_reading()

    def shutdown(self) -> None:
        """The server is stopping (SIGTERM): a connection held back goes at once (a graceful
        close would wait for a client that does not read); the others as uvicorn closes them."""
        if self._blocked_since() is not None:
            self._drop("held-back connections closed (shutdown)")
            return
        super().shutdown()

    # -- writing: answers the client does not read -------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        self._stalled_since = self.loop.time()
        self._set_blocked(True)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stalled_since = None
        self._set_blocked(False)

    def _check(self, now: float) -> None:
        """The sweep's look at this connection: its request deadline, its unread answers."""
        at = self._deadline_at
        if at is not None and now >= at:
            self._timed_out()
        since = self._stalled_since
        if since is not None and now >= since + self.send_timeout:
            self._drop("connections closed: answers unread")

    # -- parser callbacks --------------------------------------------------------------------
    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._deadline_at = None
        self._in_head = True
        self._head_bytes = 0
        self._idle_since = self.loop.time()
        super().on_message_complete()


class _Turns:
    """One server's connections that pipeline: those answered now (at most ``PIPELINE_TURNS``)
    and those waiting for their turn, first come first served. A client that sends request after
    request without reading the answers then shares the event loop with at most a few others,
    and a client that sends one request at a time (a probe, a scraper) is answered at once."""

    def __init__(self) -> None:
        self.serving: set = set()
        self.waiting: deque = deque()

    def dispatch(self, turns: int) -> None:
        while self.waiting and len(self.serving) < turns:
            conn = self.waiting.popleft()
            conn._queued = False
            if conn.transport is None or conn.transport.is_closing() or not conn._held or conn._answering():
                continue
            self.serving.add(conn)
            conn._take_turn()
            if not conn._answering():  # what was held was not a whole request: no turn needed
                self.serving.discard(conn)


def _turns(state: Any) -> _Turns:
    t = getattr(state, "_gpu_tune_turns", None)
    if t is None:
        t = state._gpu_tune_turns = _Turns()
    return t


def _blocked(state: Any) -> dict:
    """One server's held-back connections (answers unread, or requests held), oldest first."""
    d = getattr(state, "_gpu_tune_blocked", None)
    if d is None:
        d = state._gpu_tune_blocked = {}
    return d


def _keep_within_budget(state: Any, budget: int) -> None:
    """Close the connections held back longest until those left keep ``budget`` bytes at most."""
    blocked = _blocked(state)
    total = sum(c._kept_bytes() for c in blocked)
    while total > budget and blocked:
        victim = next(iter(blocked))
        total -= victim._kept_bytes()
        victim._drop("held-back connections closed (memory budget)")


def _give_back_memory() -> None:
    """Hand the C allocator's free pages back to the system: glibc keeps what a burst of
    connections allocated and freed (fragmented, so its own trimming of the heap's top does not
    reach it), and the process would stay that large after the clients are gone."""
    import gc

    gc.collect()  # the connections' objects (each protocol and its requests refer to each other)
    try:
        from gpu_tune.host.resolve import libc

        libc().malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _sweep(state: Any, loop: Any, interval: float) -> None:
    """Close the connections of one server past a deadline (the request's, or their answers
    unread too long), keep the held-back ones within their budget, give memory back after a
    crowd has gone; runs again in ``interval`` while the server has connections."""
    now = loop.time()
    budget = None
    for conn in list(state.connections):
        if isinstance(conn, GuardedHttpToolsProtocol):
            conn._check(now)
            budget = conn.blocked_budget
    if budget is not None:
        _keep_within_budget(state, budget)
    crowd = max(getattr(state, "_gpu_tune_crowd", 0), len(state.connections))
    if crowd >= TRIM_AFTER and len(state.connections) <= crowd // 8:
        _give_back_memory()
        crowd = len(state.connections)
    state._gpu_tune_crowd = crowd
    state._gpu_tune_sweeper = loop.call_later(interval, _sweep, state, loop, interval) if state.connections else None


def protocol_class(*, max_head_bytes: int = MAX_HEAD_BYTES, request_timeout: float = REQUEST_TIMEOUT_S,
                   max_connections: int | None = None, max_pipelined: int = MAX_PIPELINED,
                   write_high: int = WRITE_HIGH, send_timeout: float = SEND_TIMEOUT_S,
                   blocked_budget: int = BLOCKED_BUDGET) -> type[GuardedHttpToolsProtocol]:
    """A :class:`GuardedHttpToolsProtocol` with these limits (``max_connections`` None:
    :func:`connection_limit`)."""
    limits = dict(max_head_bytes=int(max_head_bytes), request_timeout=float(request_timeout),
                  max_connections=int(max_connections if max_connections is not None else connection_limit()),
                  max_pipelined=max(1, int(max_pipelined)), write_high=int(write_high),
                  send_timeout=float(send_timeout), blocked_budget=int(blocked_budget))
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), limits)


def config(app: Any, *, max_head_bytes: int = MAX_HEAD_BYTES, request_timeout: float = REQUEST_TIMEOUT_S,
           max_connections: int | None = None, max_pipelined: int = MAX_PIPELINED, write_high: int = WRITE_HIGH,
           send_timeout: float = SEND_TIMEOUT_S, blocked_budget: int = BLOCKED_BUDGET,
           **uvicorn_options: Any) -> uvicorn.Config:
    """The uvicorn configuration the agent serves with (the limits: see :func:`protocol_class`;
    ``uvicorn_options``, e.g. ``host`` and ``port``, go to :class:`uvicorn.Config`)."""
    options: dict[str, Any] = dict(ws="none", log_level="warning", access_log=False, lifespan="off",
                                   timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=5)
    options.update(uvicorn_options)
    http = protocol_class(max_head_bytes=max_head_bytes, request_timeout=request_timeout,
                          max_connections=max_connections, max_pipelined=max_pipelined, write_high=write_high,
                          send_timeout=send_timeout, blocked_budget=blocked_budget)
    return uvicorn.Config(app, http=http, **options)
