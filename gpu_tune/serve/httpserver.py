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

WebSockets are off (the agent has none).
"""

from __future__ import annotations

import logging
import resource
import time
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

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
    """uvicorn's httptools protocol with a head-size cap, a request deadline and a connection cap.

    The limits are class attributes; :func:`protocol_class` makes a subclass with others. The
    deadlines are checked by one timer per server that sweeps its connections a few times a
    second while it has any (a timer per request would cost every request an allocation)."""

    max_head_bytes: int = MAX_HEAD_BYTES
    request_timeout: float = REQUEST_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # waiting for (the rest of) a request line and headers
        self._head_bytes = 0
        self._deadline_at: float | None = None  # loop time by which the request must be in
        self._idle_since = 0.0
        self._refused = False
        self._linger_left = 0

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

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        full = len(self.connections) >= self.max_connections
        super().connection_made(transport)
        now = self.loop.time()
        self._idle_since = now
        self._deadline_at = now + self.request_timeout
        self._ensure_sweeper()
        if full:
            victim = min((c for c in self.connections if c is not self and isinstance(c, GuardedHttpToolsProtocol)
                          and c._waiting() and not c.transport.is_closing()),
                         key=lambda c: c._idle_since, default=None)
            if victim is None:
                COUNTS.add("connections refused (table full)")
                self._refuse(503, "Service Unavailable", "too many connections")
                return
            COUNTS.add("waiting connections evicted")
            victim._deadline_at = None
            victim.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            if self._deadline_at is None:  # the first bytes of a request on a kept-alive connection
                self._deadline_at = self.loop.time() + self.request_timeout
            n = self._head_bytes + len(data)
            if n <= self.max_head_bytes and not self._refused:  # the common case: a whole small request
                self._head_bytes = n
                super().data_received(data)
                return
        elif len(data) <= self.max_head_bytes:
            super().data_received(data)
            return
        self._data_received_in_pieces(data)

    def _data_received_in_pieces(self, data: bytes) -> None:
        if self._refused:
            self._linger_left -= len(data)
            if self._linger_left <= 0:
                self.transport.close()
            return
        view = memoryview(data)
        while view:
            if self._in_head:
                room = self.max_head_bytes - self._head_bytes
                if room <= 0:
                    COUNTS.add("oversized request heads refused")
                    self._refuse(431, "Request Header Fields Too Large",
                                 f"request line and headers exceed {self.max_head_bytes} bytes")
                    return
                piece = view[:room]
                self._head_bytes += len(piece)
            else:
                piece = view[:self.max_head_bytes]
            view = view[len(piece):]
            super().data_received(piece)  # type: ignore[arg-type]
            if self.transport.is_closing():
                return

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


def _sweep(state: Any, loop: Any, interval: float) -> None:
    """Close the connections of one server whose request is past its deadline; runs again in
    ``interval`` while the server has connections."""
    now = loop.time()
    for conn in list(state.connections):
        at = getattr(conn, "_deadline_at", None)
        if at is not None and now >= at:
            conn._timed_out()
    state._gpu_tune_sweeper = loop.call_later(interval, _sweep, state, loop, interval) if state.connections else None


def protocol_class(*, max_head_bytes: int = MAX_HEAD_BYTES, request_timeout: float = REQUEST_TIMEOUT_S,
                   max_connections: int | None = None) -> type[GuardedHttpToolsProtocol]:
    """A :class:`GuardedHttpToolsProtocol` with these limits (``max_connections`` None:
    :func:`connection_limit`)."""
    limits = dict(max_head_bytes=int(max_head_bytes), request_timeout=float(request_timeout),
                  max_connections=int(max_connections if max_connections is not None else connection_limit()))
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), limits)


def config(app: Any, *, max_head_bytes: int = MAX_HEAD_BYTES, request_timeout: float = REQUEST_TIMEOUT_S,
           max_connections: int | None = None, **uvicorn_options: Any) -> uvicorn.Config:
    """The uvicorn configuration the agent serves with (the limits: see :func:`protocol_class`;
    ``uvicorn_options``, e.g. ``host`` and ``port``, go to :class:`uvicorn.Config`)."""
    options: dict[str, Any] = dict(ws="none", log_level="warning", access_log=False, lifespan="off",
                                   timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=5)
    options.update(uvicorn_options)
    http = protocol_class(max_head_bytes=max_head_bytes, request_timeout=request_timeout,
                          max_connections=max_connections)
    return uvicorn.Config(app, http=http, **options)
