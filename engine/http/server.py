"""pdfleet's HTTP/1.1 server: an ``asyncio.Protocol`` on uvloop, parsed by httptools.

Both servers that face clients serve through it: the gateway (``pdfleet
gateway``, its route table) and the engine (``pdfleet serve``, its FastAPI
app), under the same limits (:class:`RequestLimits`, engine/contracts/http_limits.py).

uvicorn's protocol and its ASGI cycle (a scope dict, a message dict per
``receive`` and ``send``, a task per disconnect watch) were about a quarter
of a core per request at a few thousand requests per second
(docs/gateway.md has the profiles), so this server runs a route table
(``asgi.RouteTable``) itself: httptools (a C parser) calls back into
:class:`HttpProtocol`, which builds one :class:`Cycle` per request, and the
cycle *is* the handler's request (its path, a plain dict of its headers, its
body). A handler's answer is written straight to the transport: a
pre-encoded status line, the response's raw headers and its body in one
write; a stream (the gateway's relay, ``gateway/relay.py``) chunk by chunk,
waiting only while the transport has paused writing. Any other ASGI app (the
engine's FastAPI app), and a route table wrapped in middleware (tracing), is
served through ``scope``/``receive``/``send`` provided by the same cycle, and
its ``lifespan`` is run as ASGI servers do (``asgi.Lifespan``).

What the server does (docs/gateway.md, "Throughput"; docs/serving.md, "Limits"):

* keep-alive (75 s idle) and pipelining: a request that arrives while the
  one before it is answered waits, reading paused, and is answered after it;
* ``Content-Length`` and chunked bodies (the body's size and time limits are
  the handler's: ``limits.read_body`` and ``limits.receive_body``), ``Expect:
  100-continue`` answered when the handler first reads the body;
* a deadline on each request head (``header_timeout``, from the connection's
  opening or the first byte of a kept-alive connection's next request) and a
  bound on its size (``max_head_bytes``, 431), a bound on the size of one
  chunk of a chunked body (``max_chunk_bytes``, 413: announced or counted),
  a malformed request a 400; every refusal in OpenAI's error shape
  (engine/contracts/errors.py), with a lingering close;
* a client that goes away cancels its handler (``watch_disconnect``, a
  callback from ``connection_lost``: no task per request), or, under ASGI,
  gets ``http.disconnect`` from ``receive``;
* a graceful stop on SIGTERM/SIGINT (or ``stop_threadsafe``): no new
  connections, idle ones closed, running requests given ``graceful_timeout``
  seconds (a second signal ends them at once), then the app's lifespan ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import http
import logging
import signal
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from typing import Any
from urllib.parse import unquote

import httptools

from ..contracts.errors import ErrorBody
from ..contracts.http_limits import RequestLimits
from .asgi import Lifespan
from .limits import LINGER_BYTES, LINGER_SECONDS

logger = logging.getLogger("pdfleet.http")

# Seconds an idle kept-alive connection stays open (above the 60 s idle
# timeout of common load balancers, as uvicorn's was set here).
KEEPALIVE_TIMEOUT = 75.0
# Seconds running requests get to finish after SIGTERM before they are cancelled.
GRACEFUL_TIMEOUT = 5.0
# Request body bytes buffered (not yet read by the handler) before reading pauses.
HIGH_WATER = 64 * 1024
BACKLOG = 4096
_REQUEST_TASK = "pdfleet-http-request"
"""The name of each request's task."""

STATUS_LINES = {
    status.value: b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode())
    for status in http.HTTPStatus
    if 100 <= status.value < 600
}
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
CHUNKED = b"transfer-encoding: chunked\r\n"
LAST_CHUNK = b"0\r\n\r\n"
CRLF = b"\r\n"
CLOSE = b"connection: close\r\n"
DISCONNECT = {"type": "http.disconnect"}
# Bytes of the previous read kept while a chunked body arrives: a chunk-size
# line (16 hex digits and a short extension) that spans two reads is read whole.
CHUNK_LINE_TAIL = 256


def status_line(status: int) -> bytes:
    line = STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d \r\n" % status


class _Clock:
    """The ``date`` header, formatted once a second (not per answer)."""

    __slots__ = ("_header", "_second")

    def __init__(self) -> None:
        self._second = 0
        self._header = b""

    def header(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._header = b"date: %s\r\n" % formatdate(now, usegmt=True).encode()
        return self._header


_clock = _Clock()


class _HeadTooLarge(Exception):
    """A request head past its bound (raised inside the parser's callbacks)."""


def error_head(status: int, body: bytes, *headers: bytes) -> bytes:
    """A whole JSON error answer that closes the connection."""
    return b"".join(
        [
            status_line(status),
            b"content-type: application/json\r\nconnection: close\r\n",
            *headers,
            b"content-length: %d\r\n\r\n" % len(body),
            body,
        ]
    )


class Cycle:
    """One request: what its handler reads (``path``, ``headers``, the body
    through ``receive`` or ``ready_body``) and how its answer goes out.

    ``headers`` has lower-case names and a repeated header's first value. The
    ASGI ``scope`` is built only when asked for (the tracing middleware)."""

    __slots__ = (
        "_body",
        "_body_size",
        "_handed",
        "_on_disconnect",
        "_proto",
        "_raw_headers",
        "_scope",
        "_sized",
        "_start",
        "_waiter",
        "complete",
        "continue_wanted",
        "disconnected",
        "headers",
        "keep_alive",
        "method",
        "path",
        "query",
        "response_complete",
        "response_started",
        "task",
    )

    def __init__(
        self,
        proto: HttpProtocol,
        method: str,
        path: str,
        query: bytes,
        headers: dict[str, str],
        raw_headers: list[tuple[bytes, bytes]] | None,
        keep_alive: bool,
    ) -> None:
        self._proto = proto
        self.method, self.path, self.query = method, path, query
        self.headers = headers
        self._raw_headers = raw_headers
        self._scope: dict[str, Any] | None = None
        self.keep_alive = keep_alive
        expect = headers.get("expect")
        self.continue_wanted = expect is not None and expect.lower() == "100-continue"
        self._body: list[bytes] = []
        self._body_size = 0
        self._handed = False
        """The whole body went to the handler."""
        self._start: tuple[int, Any] | None = None
        """The ASGI path's ``http.response.start`` (status, headers), until the body comes."""
        self._sized = False
        """The ASGI path's answer has a Content-Length (its parts are written as is)."""
        self.complete = False
        """The whole body has arrived."""
        self._waiter: asyncio.Future[None] | None = None
        self.disconnected = False
        self._on_disconnect: Callable[[], None] | None = None
        self.response_started = False
        self.response_complete = False
        self.task: asyncio.Task[None] | None = None

    # -- what the parser feeds -----------------------------------------------------

    def _feed(self, data: bytes) -> None:
        if self.response_complete:
            return  # answered already (a refused body): the rest is dropped
        self._body.append(data)
        self._body_size += len(data)
        if self._body_size > HIGH_WATER:
            self._proto.pause_reading()
        if self._waiter is not None:  # (``_wake`` only when a reader waits)
            self._wake()

    def _ended(self) -> None:
        self.complete = True
        if self._waiter is not None:
            self._wake()

    def _lost(self) -> None:
        self.disconnected = True
        self._wake()
        callback, self._on_disconnect = self._on_disconnect, None
        if callback is not None:
            callback()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            # One future for every reader: under ASGI a response may wait on
            # ``receive`` (a disconnect) while the handler does too.
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # -- the request, as a handler reads it ----------------------------------------

    @property
    def receive(self) -> Callable[[], Awaitable[dict[str, Any]]]:
        return self._receive

    def ready_body(self) -> bytes | None:
        """The whole body when it has all arrived and none of it was read (the
        usual case: one call, no message); else None (read it with ``receive``)."""
        if not self.complete or self.continue_wanted or self._handed:
            return None
        self._handed = True
        body = self._body
        self._body = []
        self._body_size = 0
        return body[0] if len(body) == 1 else b"".join(body)

    async def _receive(self) -> dict[str, Any]:
        """ASGI ``receive``: the body's chunks, then (once the answer is out or
        the client has gone) ``http.disconnect``."""
        if self.continue_wanted:
            self.continue_wanted = False
            if not self.response_started and not self.disconnected:
                self._proto.write(CONTINUE)
        while True:
            if self.disconnected or self.response_complete:
                return DISCONNECT
            if not self._handed and (self._body or self.complete):
                body = self._body
                chunk = body[0] if len(body) == 1 else b"".join(body)
                more = not self.complete
                self._handed = not more
                self._body = []
                self._body_size = 0
                self._proto.body_read(self)
                return {"type": "http.request", "body": chunk, "more_body": more}
            waiter = self._waiter
            if waiter is None:
                waiter = self._waiter = asyncio.get_running_loop().create_future()
            # A reader cancelled while waiting (Starlette's is_disconnected polls
            # so) leaves the future to the others.
            await asyncio.shield(waiter)

    def watch_disconnect(self, callback: Callable[[], None]) -> bool:
        """Call ``callback`` (once) when the client goes away; replaces an earlier one."""
        if self.disconnected:
            callback()
        else:
            self._on_disconnect = callback
        return True

    @property
    def client(self) -> tuple[str, int] | None:
        """The client's (host, port), without building the scope."""
        return self._proto.client_address

    @property
    def scope(self) -> dict[str, Any]:
        if self._scope is None:
            proto = self._proto
            raw = self._raw_headers
            if raw is None:
                raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
            self._scope = {
                "type": "http",
                "asgi": {"version": "3.0", "spec_version": "2.3"},
                "http_version": "1.1",
                "method": self.method,
                "scheme": "http",
                "path": self.path,
                "raw_path": self.path.encode("latin-1"),
                "query_string": self.query,
                "root_path": "",
                "headers": raw,
                "server": proto.server_address,
                "client": proto.client_address,
                "state": {},
            }
        return self._scope

    # -- the answer ----------------------------------------------------------------

    def _head(self, status: int, raw_headers: Any, chunked: bool) -> list[bytes]:
        parts = [STATUS_LINES.get(status) or status_line(status), _clock.header()]
        said_close = False
        for name, value in raw_headers:
            if name == b"connection" and value.lower() == b"close":
                said_close = True
            parts += (name, b": ", value, b"\r\n")
        if chunked:
            parts.append(CHUNKED)
        if said_close or not self.keep_alive or self._proto.server.stopping:
            self.keep_alive = False
            if not said_close:
                parts.append(CLOSE)
        return parts

    def respond(self, status: int, raw_headers: Any, body: bytes) -> None:
        """The whole answer in one write (``raw_headers`` holds its content-length)."""
        if self.response_started:
            raise RuntimeError("the answer was already started")
        self.response_started = True
        parts = self._head(status, raw_headers, False)
        parts.append(b"\r\n")
        if self.method != "HEAD":
            parts.append(body)
        self._proto.write(b"".join(parts))
        self._done()

    def start_stream(self, status: int, raw_headers: Any) -> None:
        """The head of a chunked answer; ``write`` each chunk, then ``end_stream``."""
        if self.response_started:
            raise RuntimeError("the answer was already started")
        self.response_started = True
        parts = self._head(status, raw_headers, True)
        parts.append(b"\r\n")
        self._proto.write_soon(b"".join(parts))

    def write(self, chunk: bytes) -> Awaitable[None] | None:
        """One chunk; an awaitable while the client reads slower than the
        stream comes (the transport paused writing), else None."""
        if chunk and not self.disconnected:
            self._proto.write_chunk(chunk)
        if self._proto.write_paused and not self.disconnected:
            return self._proto.drain()
        return None

    def end_stream(self) -> None:
        self._proto.write_soon(LAST_CHUNK)
        self._done()

    def _done(self) -> None:
        self.response_complete = True
        if self._waiter is not None:
            self._wake()

    async def send(self, message: dict[str, Any]) -> None:
        """ASGI ``send`` (the tracing middleware's path and other responses)."""
        kind = message["type"]
        if kind == "http.response.start":
            status, headers = message["status"], _lower(message.get("headers", ()))
            if status in (204, 304) or any(name == b"content-length" for name, _ in headers):
                # Written with the body, in one write (204 and 304 have none).
                self._start = (status, headers)
            else:
                # A stream: its head goes out now (at the end of this turn of the
                # loop, with what follows in it), not with its first chunk, which
                # may be far off (an engine's first token behind a queue).
                self.start_stream(status, headers)
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if self._start is not None:
            (status, headers), self._start = self._start, None
            if not more:
                self.respond(status, headers, body)
                return
            # A known length sent in parts: written as they come, not chunked.
            self.response_started = True
            self._proto.write(b"".join([*self._head(status, headers, False), b"\r\n"]))
            self._sized = True
        if self._sized:
            self._proto.write(body)
            if not more:
                self._done()
            return
        wait = self.write(body)
        if wait is not None:
            await wait
        if not more:
            self.end_stream()


def _lower(headers: Any) -> list[tuple[bytes, bytes]]:
    return [(bytes(n).lower(), bytes(v)) for n, v in headers]


class HttpProtocol(asyncio.Protocol):
    """One client connection: parses requests and runs one at a time, in order."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.server_address: tuple[str, int] | None = None
        self.client_address: tuple[str, int] | None = None
        self.cycle: Cycle | None = None
        """The request being answered."""
        self.parsing: Cycle | None = None
        """The request whose body the parser is reading."""
        self.pipeline: deque[Cycle] = deque()
        self.write_paused = False
        self._pending: list[bytes] | None = None
        """What ``write_soon`` holds until the end of this turn of the loop."""
        self._drain: asyncio.Future[None] | None = None
        self._reading_paused = False
        # The head of the request being parsed.
        self._url = b""
        self._headers: dict[str, str] = {}
        self._raw_headers: list[tuple[bytes, bytes]] | None = None if server._direct else []
        self._head_bytes = 0
        self._in_head = True
        """No complete request head yet on this connection (or since the last answer)."""
        self._buffered = 0
        """Bytes received while the head is incomplete (held by the parser)."""
        self.head_since: float | None = None
        """Loop time the current head began (None: no head under way)."""
        self.idle_since: float | None = None
        """Loop time the connection went idle after an answer (None: not idle)."""
        self._discarding = False
        self._discarded = 0
        """Bytes dropped while lingering (``_close``)."""
        self._too_large = False
        # A chunked body being received: the chunk under way (announced size
        # read back from the wire, since the parser streams chunks and never
        # says it) and the end of the previous read, where its size line may begin.
        self._chunked = False
        """A chunked body was being read in this read: check it when the read is parsed."""
        self._chunked_body = False
        """The body being parsed is chunked."""
        self._chunk_open = False
        """Between a chunk's size line and its end."""
        self._chunk_begun = False
        """A chunk's size line ended in the read being parsed."""
        self._chunk_got = 0
        """Body bytes of the open chunk received so far."""
        self._chunk_over = 0
        """A chunk past ``max_chunk_bytes`` (its size), to refuse after the read."""
        self._chunk_tail = b""

    # -- asyncio callbacks -----------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server_address = _address(transport.get_extra_info("sockname"))
        self.client_address = _address(transport.get_extra_info("peername"))
        self.server.connections.add(self)
        self.head_since = self.loop.time()

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            self._discarded += len(data)
            if self._discarded > LINGER_BYTES and self.transport is not None:
                self.transport.close()
            return
        self.idle_since = None
        if self._in_head and self.head_since is None:
            self.head_since = self.loop.time()  # a kept-alive connection's next request
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # no upgrades (WebSocket, h2c): the request is served as HTTP/1.1
        except httptools.HttpParserError:
            if self._too_large:
                self._refuse_head()
            else:
                self._refuse(ErrorBody("invalid HTTP/1.1 request", 400))
            return
        if self._chunked:
            self._check_chunk(data)
        # A head still incomplete: count what httptools buffers of it.
        if self._in_head and not self._discarding and self.transport is not None:
            self._buffered += len(data)
            if self._buffered > self.server.max_head_bytes:
                self._refuse_head()

    def _check_chunk(self, data: bytes) -> None:
        """After a read of a chunked body: refuse (413) a chunk whose size line
        announced more than ``max_chunk_bytes``, without waiting for its bytes.

        The open chunk's bytes so far are the read's last ``_chunk_got`` bytes
        (nothing of the framing follows them yet), so its size line is the line
        just before them: hex digits, an optional ``;extension``, CRLF."""
        limit = self.server.limits.max_chunk_bytes
        if self._chunk_begun and self._chunk_open and not self._chunk_over:
            wire = self._chunk_tail + data
            end = len(wire) - self._chunk_got - 2  # where the size line's CRLF begins
            start = wire.rfind(b"\n", 0, max(end, 0)) + 1
            if end > 0 and start > 0 and wire[end : end + 2] == b"\r\n":
                digits = wire[start:end].split(b";", 1)[0].strip()
                try:
                    announced = int(digits, 16)
                except ValueError:  # not what the parser read: leave it to the other bounds
                    announced = 0
                if announced > limit:
                    self._chunk_over = announced
        self._chunk_begun = False
        self._chunked = self._chunked_body  # (a whole chunked body may have come in this read)
        if self._chunk_over:
            self._refuse(
                ErrorBody(
                    f"a body chunk of {self._chunk_over} bytes exceeds this server's limit of "
                    f"{limit} bytes (--max-chunk-bytes)",
                    413,
                )
            )
            return
        self._chunk_tail = data[-CHUNK_LINE_TAIL:] if self._chunked_body else b""

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.head_since = self.idle_since = None
        if self.cycle is not None:
            self.cycle._lost()
        for cycle in self.pipeline:
            cycle._lost()
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self.transport = None

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # -- httptools callbacks -----------------------------------------------------------

    # (No ``on_message_begin``: a call per request for what ``on_headers_complete``
    # does, once the head it read went into its request: a fresh head.)

    def on_url(self, url: bytes) -> None:
        self._head_bytes += len(url)
        if self._head_bytes > self.server.max_head_bytes:
            self._too_large = True
            raise _HeadTooLarge  # httptools makes it a parse error: _refuse_head
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.parsing is not None:
            # A chunked body's trailer fields (after its head went into its
            # request): dropped, never the next request's head.
            return
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > self.server.max_head_bytes:
            self._too_large = True
            raise _HeadTooLarge
        name = name.lower()
        key = name.decode("latin-1")
        if key not in self._headers:
            self._headers[key] = value.decode("latin-1")
        if self._raw_headers is not None:
            self._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._buffered = 0
        self.head_since = None
        if "transfer-encoding" in self._headers:  # (the parser takes no coding but chunked last)
            self._chunked = self._chunked_body = True
            self._chunk_tail = b""
        url = self._url
        path, _, query = url.partition(b"?")
        if path.find(b"%") >= 0:  # (find: ``in`` first tries the bytes as an int)
            text = unquote(path.decode("latin-1"))
        else:
            text = path.decode("latin-1")
        cycle = Cycle(
            self,
            self.parser.get_method().decode("latin-1"),
            text,
            query,
            self._headers,
            self._raw_headers,
            self.parser.should_keep_alive(),
        )
        self._head_bytes = 0  # the next request's head
        self._url = b""
        self._headers = {}
        self._raw_headers = None if self.server._direct else []
        self.parsing = cycle
        if self.cycle is None:
            self._run(cycle)
        else:  # pipelined: answered after the one before it; read no further meanwhile
            self.pipeline.append(cycle)
            self.pause_reading()

    def on_body(self, body: bytes) -> None:
        if self._chunk_open:
            self._chunk_got += len(body)
        if self.parsing is not None:
            self.parsing._feed(body)

    def on_chunk_header(self) -> None:
        self._chunk_open = self._chunk_begun = True
        self._chunk_got = 0

    def on_chunk_complete(self) -> None:
        if self._chunk_got > self.server.limits.max_chunk_bytes:
            self._chunk_over = self._chunk_got  # refused once the read is parsed
        self._chunk_open = False

    def on_message_complete(self) -> None:
        self._chunked_body = self._chunk_open = False
        if self.parsing is not None:
            self.parsing._ended()
            self.parsing = None

    # -- running requests --------------------------------------------------------------

    def _run(self, cycle: Cycle) -> None:
        self.cycle = cycle
        # (A named Task, as create_task makes it without a task factory: an
        # unnamed one formats its "Task-N" name.)
        cycle.task = asyncio.Task(self.server.handle(cycle), loop=self.loop, name=_REQUEST_TASK)

    def finished(self, cycle: Cycle) -> None:
        """After ``cycle``'s handler returned (its answer written, or not)."""
        if self.cycle is not cycle:
            return
        self.cycle = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if not cycle.response_complete or not cycle.keep_alive or self.server.stopping:
            self._close(lingering=not cycle.complete)
            return
        if self.pipeline:
            self._run(self.pipeline.popleft())
            self.resume_reading()
            return
        self._in_head = True
        self.resume_reading()
        self.idle_since = self.loop.time()

    @property
    def idle(self) -> bool:
        return self.cycle is None and not self.pipeline

    # -- writing and flow control -------------------------------------------------------

    def write(self, data: bytes) -> None:
        pending = self._pending
        if pending is not None:  # what a stream wrote this turn of the loop goes first
            pending.append(data)
            data = b"".join(pending)
            self._pending = None
        transport = self.transport
        if transport is not None and not self._discarding and not transport.is_closing():
            transport.write(data)

    def write_soon(self, data: bytes) -> None:
        """Write ``data`` at the end of this turn of the event loop, with what
        else is written in it: a stream's head, its events and its end often
        come in one turn, and go out in one send instead of three."""
        if self._pending is None:
            self._pending = [data]
            self.loop.call_soon(self._flush)
        else:
            self._pending.append(data)

    def write_chunk(self, chunk: bytes) -> None:
        """``write_soon`` of one chunk of a chunked answer: its size line, its
        bytes and its CRLF go out with the rest, joined once (not copied into
        a framed chunk first)."""
        size = b"%x\r\n" % len(chunk)
        pending = self._pending
        if pending is None:
            self._pending = [size, chunk, CRLF]
            self.loop.call_soon(self._flush)
        else:
            pending += (size, chunk, CRLF)

    def _flush(self) -> None:
        pending = self._pending
        if pending is not None:
            self._pending = None
            self.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def drain(self) -> Awaitable[None]:
        if self._drain is None or self._drain.done():
            self._drain = self.loop.create_future()
        return self._drain

    def body_read(self, cycle: Cycle) -> None:
        """The handler took what was buffered of ``cycle``'s body: read on
        (unless a pipelined request is waiting, which keeps reading paused)."""
        if cycle is self.cycle and not self.pipeline:
            self.resume_reading()

    def pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            with contextlib.suppress(RuntimeError):
                self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None:
            self._reading_paused = False
            with contextlib.suppress(RuntimeError):
                self.transport.resume_reading()

    # -- limits ---------------------------------------------------------------------------

    def expire(self, now: float) -> None:
        """The server's sweep: close a connection whose head is overdue
        (``--header-timeout``) or that sat idle past KEEPALIVE_TIMEOUT (one
        sweep for all connections, not a timer per request)."""
        transport = self.transport
        if transport is None or not self.idle or self._discarding:
            return
        head, idle = self.head_since, self.idle_since
        if (head is not None and self._in_head and now - head > self.server.header_timeout) or (
            idle is not None and now - idle > KEEPALIVE_TIMEOUT
        ):
            self._close(lingering=False)

    def _refuse_head(self) -> None:
        limit = self.server.max_head_bytes
        self._refuse(
            ErrorBody(f"the request head exceeds this server's limit of {limit} bytes", 431)
        )

    def _refuse(self, error: ErrorBody) -> None:
        """Answer ``error`` (unless an answer has begun) and close: what the
        server itself refuses of a connection's bytes."""
        if self._discarding or self.transport is None:
            return
        logger.info(
            "refused a request from %s: %d %s", self.client_address, error.status, error.message
        )
        if self.cycle is None or not self.cycle.response_started:
            self.write(error_head(error.status, error.encode()))
        # A request whose body broke off (or one mid-answer) ends here: its
        # handler sees the client gone, and writes nothing more.
        self._close(lingering=True)
        for cycle in (self.cycle, *self.pipeline):
            if cycle is not None:
                cycle._lost()

    def _close(self, lingering: bool) -> None:
        """Close after what was written; ``lingering``: read and drop what the
        client still sends for a moment first (closing with unread bytes would
        reset the connection, and the client could lose the answer)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self._flush()
        self.head_since = self.idle_since = None
        if not lingering:
            transport.close()
            return
        self._discarding = True  # and nothing more is written
        self.resume_reading()
        if transport.can_write_eof():
            with contextlib.suppress(OSError, RuntimeError):
                transport.write_eof()
        self.loop.call_later(LINGER_SECONDS, transport.close)

    def shutdown(self) -> None:
        """A graceful stop: close now if idle, else after the current answer."""
        if self.idle and self.transport is not None:
            self._close(lingering=False)
            return
        for cycle in (self.cycle, *self.pipeline):
            if cycle is not None:
                cycle.keep_alive = False


def _address(value: Any) -> tuple[str, int] | None:
    if isinstance(value, tuple) and len(value) >= 2:
        return str(value[0]), int(value[1])
    return None


class HttpServer:
    """Serves one ASGI app (a ``RouteTable`` or any other) until SIGTERM/SIGINT
    or ``stop_threadsafe``: ``run``, or ``serve`` on a running loop.

    ``name`` says which server it is in its logs and its 500s ("gateway",
    "engine"); ``graceful_timeout`` is the time running requests get after a
    stop before they are cancelled."""

    def __init__(
        self,
        app: Any,
        limits: RequestLimits,
        graceful_timeout: float = GRACEFUL_TIMEOUT,
        name: str = "server",
    ) -> None:
        self.app = app
        self.limits = limits
        # The two bounds read per request, one attribute away.
        self.header_timeout = limits.header_timeout
        self.max_head_bytes = limits.max_head_bytes
        self.graceful_timeout = graceful_timeout
        self.name = name
        self.connections: set[HttpProtocol] = set()
        self.stopping = False
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self._direct = self.direct
        self._stop: asyncio.Event | None = None
        self._force = False
        self._stop_asked = False
        """``stop_threadsafe`` before the loop ran: stop as soon as it does."""
        self.on_stop: Callable[[], None] | None = None
        """Called (on the loop) when a graceful stop begins, before the wait for
        running requests (the engine hands its migratable streams back then)."""

    @property
    def direct(self) -> bool:
        """A route table without middleware: handlers are called without ASGI
        messages (read when serving starts: middleware is added before)."""
        return bool(getattr(self.app, "direct", False))

    # -- one request ------------------------------------------------------------------

    async def handle(self, cycle: Cycle) -> None:
        app = self.app
        proto = cycle._proto
        try:
            if not self._direct:
                await app(cycle.scope, cycle.receive, cycle.send)
            else:
                handler = app.lookup(cycle.method, cycle.path)
                if handler is None:
                    response = app.unrouted(cycle.path)
                    cycle.respond(response.status_code, response.raw_headers, response.body)
                else:
                    try:
                        response = await handler(cycle)
                    except Exception as e:  # the client gets a 500; the log has the traceback
                        response = app.on_error(cycle, e)
                    whole = getattr(response, "body", None)
                    if type(whole) is bytes and getattr(response, "background", None) is None:
                        if not cycle.disconnected:  # a whole answer: no coroutine to run
                            cycle.respond(response.status_code, response.raw_headers, whole)
                    elif (stream_to := getattr(response, "stream_to", None)) is not None:
                        # (``_answer``'s first case, without its coroutine)
                        await stream_to(cycle.start_stream, cycle.write, cycle.end_stream)
                    else:
                        await self._answer(cycle, response)
        except asyncio.CancelledError:
            if not cycle.disconnected and not self._force:
                raise
        except Exception:
            logger.exception("request %s %s: the answer failed", cycle.method, cycle.path)
            if not cycle.response_started:
                with contextlib.suppress(Exception):
                    body = ErrorBody(f"internal error of the {self.name}", 500).encode()
                    cycle.respond(
                        500,
                        [
                            (b"content-type", b"application/json"),
                            (b"content-length", b"%d" % len(body)),
                        ],
                        body,
                    )
            cycle.keep_alive = False
        finally:
            proto.finished(cycle)

    async def _answer(self, cycle: Cycle, response: Any) -> None:
        stream_to = getattr(response, "stream_to", None)
        if stream_to is not None:
            await stream_to(cycle.start_stream, cycle.write, cycle.end_stream)
            return
        body = getattr(response, "body", None)
        if isinstance(body, bytes) and getattr(response, "background", None) is None:
            if cycle.disconnected:
                return
            cycle.respond(response.status_code, response.raw_headers, body)
            return
        await response(cycle.scope, cycle.receive, cycle.send)

    # -- serving --------------------------------------------------------------------------

    def run(self, host: str, port: int, sock: socket.socket | None = None) -> int:
        """Serve until stopped: 0 after a graceful stop, 1 if startup failed."""
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(self.serve(host, port, sock))

    async def serve(self, host: str, port: int, sock: socket.socket | None = None) -> int:
        self.loop = asyncio.get_running_loop()
        self._direct = self.direct  # (the app's middleware is in place by now)
        self._stop = asyncio.Event()
        if self._stop_asked:
            self._stop.set()
        lifespan = Lifespan(self.app)
        if not await lifespan.startup():
            logger.error("%s startup failed", self.name)
            return 1
        try:
            try:
                if sock is not None:
                    server = await self.loop.create_server(
                        lambda: HttpProtocol(self), sock=sock, backlog=BACKLOG
                    )
                else:
                    server = await self.loop.create_server(
                        lambda: HttpProtocol(self), host, port, backlog=BACKLOG
                    )
            except OSError as e:
                logger.error("the %s cannot listen on %s:%d: %s", self.name, host, port, e)
                return 1
            self._signals()
            # What startup built (the app, its modules, the engine pool) lives as
            # long as the process: keep it out of the cyclic collector's scans, so
            # an old-generation collection walks only what requests left behind.
            gc.collect()
            gc.freeze()
            sweeper = asyncio.create_task(self._sweep(), name="pdfleet-http-sweep")
            logger.info("%s serving HTTP on %s:%d", self.name, host, port)
            await self._stop.wait()
            sweeper.cancel()
            await self._shutdown(server)
        finally:
            await lifespan.shutdown()
        return 0

    async def _sweep(self) -> None:
        """Every fraction of the header deadline: close overdue and idle connections."""
        period = max(0.05, min(1.0, self.header_timeout / 4))
        while True:
            await asyncio.sleep(period)
            now = self.loop.time()
            for conn in list(self.connections):
                conn.expire(now)

    def _signals(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                self.loop.add_signal_handler(sig, self.stop)

    def stop(self, force: bool = False) -> None:
        """Begin a graceful stop (a second call, or ``force``: running requests end now)."""
        if self.stopping or force:
            self._force = True
        elif self.on_stop is not None:
            self.on_stop()
        self.stopping = True
        if self._stop is not None:
            self._stop.set()

    def stop_threadsafe(self, force: bool = False) -> None:
        """``stop`` from another thread (the engine's loader or engine thread)."""
        loop = self.loop
        if loop is None or loop.is_closed():
            self._stop_asked = True
            self._force = self._force or force
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self.stop, force)

    async def _shutdown(self, server: asyncio.AbstractServer) -> None:
        server.close()
        for conn in list(self.connections):
            conn.shutdown()
        deadline = self.loop.time() + self.graceful_timeout
        while (  # noqa: ASYNC110 (bounded by graceful_timeout; connections go idle on their own)
            any(not c.idle for c in self.connections)
            and self.loop.time() < deadline
            and not self._force
        ):
            await asyncio.sleep(0.05)
        tasks = []
        for conn in list(self.connections):
            for cycle in (conn.cycle, *conn.pipeline):
                if cycle is not None and cycle.task is not None and not cycle.task.done():
                    cycle.task.cancel()
                    tasks.append(cycle.task)
            conn._close(lingering=False)
        if tasks:
            # Cancelled handlers only clean up: a few seconds at most.
            await asyncio.wait(tasks, timeout=min(self.graceful_timeout, GRACEFUL_TIMEOUT))
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 1.0)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop where it is installed (a libuv loop: docs/gateway.md), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop
