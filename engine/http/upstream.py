"""A lean HTTP/1.1 client for the gateway's calls to engines (its hot path).

The gateway adds one client hop to every request. On the development VM an
``httpx.AsyncClient`` took ~1.4 ms to the first byte of a streamed answer from
a local server where a plain asyncio connection took ~0.4 ms, and that
millisecond was half of what the gateway added to TTFT. This client does only
what the legs need: ``POST`` with a body and headers to an engine (pdfleet's
or vLLM's: uvicorn, HTTP/1.1; ``http://`` or ``https://``), a
``Content-Length`` or chunked answer, kept-alive connections per engine. Health checks and metric scrapes stay on httpx.

Errors: :class:`UpstreamConnectError` (the engine refused or could not be
reached), ``TimeoutError`` (connect or total time), :class:`UpstreamError`
(anything else: a reset, a malformed answer). A stream that is not read to
its end closes its connection, which aborts the engine's request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httptools

# Largest status line + headers accepted from an engine.
MAX_HEAD_BYTES = 64 * 1024
# Body bytes received and not yet read after which reading pauses (chunks are
# handed over as they arrive, whatever size a chunk announces).
MAX_BUFFERED = 1024 * 1024
# Engine URLs whose parsed form is kept (a fleet's engines times their routes).
MAX_CACHED_URLS = 1024
# Idle connections kept per engine; more are closed when returned.
MAX_IDLE_PER_ENGINE = 256


class UpstreamError(Exception):
    """The engine's connection failed or its answer was not valid HTTP/1.1."""


class UpstreamConnectError(UpstreamError):
    """No connection: the engine refused it or its address is unreachable."""


class _NothingBack(UpstreamError):
    """The connection failed before any byte of an answer arrived."""


# The parser takes only a head of CRLF lines (no bare LF or CR, no folded
# lines): its end is the first empty line, and each header is one line.
_HEAD_END = b"\r\n\r\n"
_HEADER_PATTERNS: dict[bytes, re.Pattern[bytes]] = {}
"""A header's lines, by lower-case name (``_header``; the names the gateway reads)."""


def _parse_headers(head: bytes) -> dict[bytes, bytes]:
    """The headers of ``head`` (an answer from its start, its head whole, as
    the parser took it): lower-case names, values without the spaces around
    them (a repeated header: its last value)."""
    found: dict[bytes, bytes] = {}
    for line in head[: head.find(_HEAD_END)].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        found[name.lower()] = value.strip(b" \t")
    return found


def _header(head: bytes, name: bytes) -> bytes | None:
    """``_parse_headers(head).get(name)`` (``name`` in lower case), in one
    search of the head's lines for that header's."""
    pattern = _HEADER_PATTERNS.get(name)
    if pattern is None:
        if len(_HEADER_PATTERNS) >= 64:
            _HEADER_PATTERNS.clear()
        pattern = _HEADER_PATTERNS[name] = re.compile(
            b"\r\n" + re.escape(name) + b":[ \t]*([^\r]*)", re.IGNORECASE
        )
    found = pattern.findall(head, 0, head.find(_HEAD_END))
    return found[-1].rstrip(b" \t") if found else None


class _Conn(asyncio.Protocol):
    """One kept-alive connection to an engine: a ``Protocol`` that httptools
    parses the answers of (no asyncio streams: their reader and writer cost a
    sixth of a request's time, docs/gateway.md). One answer at a time: the
    response that ``begin`` starts reads what the parser hands over."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        """Its event loop (read once: each read of the running loop is a ``getpid``)."""
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self.closed = False
        self.error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._reading_paused = False
        # The answer being read.
        self.got_bytes = False
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.stray = False
        """Bytes came after the answer's end (``_stray``)."""
        self.status = 0
        """The status of the first head that arrived (an interim one included)."""
        self.head = b""
        """What arrived of the answer until its head was whole: its status line
        and headers, then what followed them in the same read. The parser makes
        no call per header: they are read from here when asked."""
        self.chunks: list[bytes] = []
        self.buffered = 0

    # -- asyncio callbacks -----------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        in_head = not self.head_done
        if in_head:
            self.head += data  # (usually one read: ``b"" + data`` is ``data``)
        elif self.complete:
            # The answer had ended: nothing was asked, so whatever comes now
            # would be read as the next request's answer.
            self._stray()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            if self.stray:  # (the bytes after the answer: it stands, closed)
                pass
            elif self.error is None:
                if in_head and len(self.head) <= MAX_HEAD_BYTES:
                    self.error = UpstreamError(f"not an HTTP/1.1 answer: {data[:60]!r} ({e})")
                else:
                    self.error = UpstreamError(f"malformed answer: {e}")
            self.close()
        else:
            # The head's size, also when it ended in this read (then without
            # what followed it).
            if in_head and len(self.head) > MAX_HEAD_BYTES:
                end = self.head.find(_HEAD_END) if self.head_done else -1
                if (end + 4 if end >= 0 else len(self.head)) > MAX_HEAD_BYTES:
                    self.error = UpstreamError("response headers too large")
                    self.close()
        self._wake()

    def _stray(self) -> None:
        """Bytes after the end of the answer: it stands, but the connection is
        closed, not reused (nor are the bytes read into the answer)."""
        self.stray = True
        self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.head_done and not self.complete and self.until_close():
            self.complete = True  # a body without length or chunks ends with the connection
        self._wake()

    # -- httptools callbacks -----------------------------------------------------------
    # (No ``on_status`` or ``on_header``: a Python call per header, and most
    # answers go out without a look at their headers; ``UpstreamResponse``
    # reads them from ``head`` when asked.)

    def on_headers_complete(self) -> None:
        if not self.head_done:  # (an interim head and the final one may come in one read)
            self.head_done = True
            self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.stray:
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > MAX_BUFFERED and not self._reading_paused and self.transport:
            self._reading_paused = True
            self.transport.pause_reading()

    def on_message_begin(self) -> None:
        if self.complete:  # a second answer in the read that ended the first
            self._stray()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()  # the parser forgets it next

    # -- what a response uses ------------------------------------------------------------

    def begin(self) -> None:
        """Before a request is written: a fresh answer."""
        self.got_bytes = self.head_done = self.complete = self.keep_alive = False
        self.status = 0
        self.head = b""
        self.chunks = []
        self.buffered = 0

    def until_close(self) -> bool:
        """The answer's body (no length, not chunked) ends with the connection."""
        h = _parse_headers(self.head)
        if b"content-length" in h:
            return False
        coding = h.get(b"transfer-encoding")
        return coding is None or coding.find(b"chunked") < 0

    def take(self) -> bytes:
        """What arrived of the body since the last call."""
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.chunks = []
        self.buffered = 0
        if self._reading_paused and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()
        return data

    async def wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def usable(self, now: float, expiry: float) -> bool:
        return (
            now - self.idle_since < expiry
            and not self.closed
            and self.error is None
            and self.transport is not None
            and not self.transport.is_closing()
        )

    def close(self) -> None:
        if self.transport is not None:
            with contextlib.suppress(Exception):
                self.transport.close()


class UpstreamResponse:
    """Status, headers (lower-case names) and, once read, the body."""

    def __init__(
        self,
        client: UpstreamClient,
        key: tuple[str, int, bool],
        conn: _Conn,
        status: int,
    ) -> None:
        self._client, self._key = client, key
        self._conn: _Conn | None = conn
        """The connection while the body is unread; None once it is released."""
        self.status_code = status
        self._head = conn.head
        """The answer's head (and what followed it in its read), read when asked."""
        self._raw_headers: dict[bytes, bytes] | None = None
        self._headers: dict[str, str] | None = None
        self.content = b""
        self._done = False

    @property
    def reason_phrase(self) -> str:
        """The status line's reason phrase ("" when it has none)."""
        head = self._head
        parts = head[: head.find(b"\r\n")].split(b" ", 2)
        return parts[2].decode("latin-1") if len(parts) > 2 else ""

    @property
    def raw_headers(self) -> dict[bytes, bytes]:
        """Lower-case names, values as sent (``headers`` decodes them)."""
        raw = self._raw_headers
        if raw is None:
            raw = self._raw_headers = _parse_headers(self._head)
        return raw

    @property
    def headers(self) -> dict[str, str]:
        """Lower-case names, values stripped (decoded on first use)."""
        if self._headers is None:
            self._headers = {
                k.decode("latin-1"): v.decode("latin-1").strip()
                for k, v in self.raw_headers.items()
            }
        return self._headers

    def header(self, name: bytes) -> bytes | None:
        """One header's raw value (``name`` in lower case), without reading the rest."""
        raw = self._raw_headers
        return _header(self._head, name) if raw is None else raw.get(name)

    # -- body ---------------------------------------------------------------------

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked encoding removed): what came since
        the last chunk, each time."""
        conn = self._conn
        if conn is None:
            raise RuntimeError("the response body was already released")
        while True:
            if conn.chunks:
                yield conn.take()
            elif conn.complete:
                break
            elif conn.error is not None:
                raise conn.error
            elif conn.closed:
                raise UpstreamError("connection closed before the end of the body")
            else:
                await conn.wait()
        self._done = True
        self._release()

    def buffered(self) -> bool:
        """The next ``aiter_raw`` step needs no wait (body bytes, or its end, are here)."""
        conn = self._conn
        return conn is not None and (bool(conn.chunks) or conn.complete)

    def read_buffered(self) -> bytes:
        """What the next ``aiter_raw`` step would give when ``buffered``, without
        a step of the iterator: the body bytes here, or, at the body's end, b""
        (the connection then released as the iterator's end releases it). The
        iterator, if stepped later, goes on after them."""
        conn = self._conn
        if conn is None:
            raise RuntimeError("the response body was already released")
        if conn.chunks:
            return conn.take()
        if not conn.complete:
            raise RuntimeError("read_buffered: nothing buffered (see buffered)")
        self._done = True
        self._release()
        return b""

    def drained(self) -> bool:
        """True (and the connection released, as at the end of ``aiter_raw``)
        when the whole body has arrived and was read: the iterator's next step
        would only end it."""
        conn = self._conn
        if conn is None or not conn.complete or conn.chunks:
            return False
        self._done = True
        self._release()
        return True

    def received(self) -> bool:
        """The whole answer has arrived (what is left of it needs no wait)."""
        conn = self._conn
        return conn is not None and conn.complete

    async def aread(self) -> bytes:
        conn = self._conn
        if conn is None:
            raise RuntimeError("the response body was already released")
        if conn.complete:  # (usually: the body came with the head)
            return self._read_done(conn)
        while not conn.complete:
            if conn.error is not None:
                raise conn.error
            if conn.closed:
                raise UpstreamError("connection closed before the end of the body")
            await conn.wait()
        return self._read_done(conn)

    def _read_done(self, conn: _Conn) -> bytes:
        self.content = conn.take() if conn.chunks else b""
        self._done = True
        self._release()
        return self.content

    async def aclose(self) -> None:
        """Give the connection back when the body was read, else close it."""
        self._release()

    def close(self) -> None:
        """``aclose`` without a coroutine (the proxy's hot path)."""
        self._release()

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        # (``keep_alive``, the parser's, is False for a body that ends with the
        # connection, but not for a 204 or 304 without a length: whatever an engine
        # sent after one would be read as the next answer.)
        if (
            self._done
            and conn.keep_alive
            and not conn.stray
            and (self.status_code not in (204, 304) or not conn.until_close())
        ):
            conn.head = b""  # (the response keeps its own reference while it lives)
            self._client._put(self._key, conn)
        else:
            conn.close()

    # -- helpers the proxy uses ------------------------------------------------------

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")


class UpstreamClient:
    """Kept-alive HTTP/1.1 connections to engines, per (host, port)."""

    def __init__(
        self,
        connect_timeout: float,
        keepalive_expiry: float = 20.0,
        ssl_context: ssl.SSLContext | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.keepalive_expiry = keepalive_expiry
        self._fixed = "".join(
            f"{k}: {v}\r\n" for k, v in (headers or {}).items() if k.lower() != "content-length"
        )
        """Headers of every request (the gateway's: the content type, the fleet
        token), encoded once into each URL's request head."""
        self._idle: dict[tuple[str, int, bool], deque[_Conn]] = {}
        self._targets: dict[str, tuple[tuple[str, int, bool], bytes]] = {}
        self._closed = False
        self._ssl = ssl_context

    async def post(
        self,
        url: str,
        content: bytes,
        headers: dict[str, str],
        timeout: float | None,  # noqa: ASYNC109 (the per-call bound goes to the read)
    ) -> UpstreamResponse:
        """A whole answer, read within ``timeout`` seconds (None: the caller bounds it)."""
        if timeout is not None:
            async with asyncio.timeout(timeout):
                return await self.post(url, content, headers, None)
        resp = await self.stream(url, content, headers)
        conn = resp._conn
        try:
            if conn is not None and conn.complete:  # no wait: no coroutine
                resp._read_done(conn)
            else:
                await resp.aread()
        finally:
            resp.close()
        return resp

    async def stream(self, url: str, content: bytes, headers: dict[str, str]) -> UpstreamResponse:
        """Send the request and read the status and headers; the caller reads
        the body (``aiter_raw``/``aread``) and must ``aclose`` the response."""
        target = self._targets.get(url)
        if target is None:
            target = self._target(url)
        key, fixed = target
        own = "".join(
            [f"{k}: {v}\r\n" for k, v in headers.items() if k.lower() != "content-length"]
        )
        request = b"%s%scontent-length: %d\r\n\r\n%s" % (
            fixed,
            own.encode("latin-1"),
            len(content),
            content,
        )
        conn = self._take(key)
        # A kept-alive connection the engine had closed fails before it answers
        # (``_NothingBack``): the request never reached it, and goes once more
        # on a new connection. (One loop, not a coroutine per exchange.)
        retry = conn is not None
        if conn is None:
            conn = await self._connect(key)
        while True:
            try:
                transport = conn.transport
                if conn.closed or transport is None or transport.is_closing():
                    raise _NothingBack("the connection was closed")
                conn.begin()
                transport.write(request)  # head and body in one write
                while not conn.head_done:
                    if conn.error is not None:
                        raise conn.error
                    if conn.closed:
                        if not conn.got_bytes:
                            raise _NothingBack("the engine closed the connection without answering")
                        raise UpstreamError("the answer ended in its headers")
                    # (``conn.wait()``, inline: no coroutine for the wait every request has)
                    waiter = conn._waiter = conn._loop.create_future()
                    try:
                        await waiter
                    finally:
                        conn._waiter = None
                status = conn.status
                resp = UpstreamResponse(self, key, conn, status)
                if 100 <= status < 200:
                    raise UpstreamError(f"an interim answer ({status}) was not asked for")
                if conn.error is not None:  # (a head too large, whole in one read)
                    raise conn.error
                return resp
            except _NothingBack:
                conn.close()
                if not retry:
                    raise
                retry = False
            except BaseException:
                conn.close()  # cancelled or timed out: the engine sees the request end
                raise
            conn = await self._connect(key)

    def _target(self, url: str) -> tuple[tuple[str, int, bool], bytes]:
        """(connection key, request line, host and fixed headers) of ``url``, cached."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamError(f"not an http(s) URL: {url!r}")
        tls = parts.scheme == "https"
        key = (parts.hostname, parts.port or (443 if tls else 80), tls)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        if len(self._targets) >= MAX_CACHED_URLS:
            self._targets.clear()  # engines come and go: the cache stays small
        line = f"POST {path} HTTP/1.1\r\nhost: {parts.netloc}\r\n{self._fixed}"
        self._targets[url] = target = (key, line.encode("latin-1"))
        return target

    async def _connect(self, key: tuple[str, int, bool]) -> _Conn:
        if self._closed:
            raise UpstreamError("the client is closed")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    _Conn,
                    key[0],
                    key[1],
                    # https:// is always TLS with a verified certificate and host name.
                    ssl=self._tls() if key[2] else None,
                    server_hostname=key[0] if key[2] else None,
                )
        except TimeoutError:  # an OSError too, but not a refusal
            raise
        except ssl.SSLError as e:  # an OSError too: the engine's certificate was refused
            raise UpstreamError(f"TLS with {key[0]}:{key[1]} failed: {e.reason or e}") from None
        except OSError as e:
            raise UpstreamConnectError(f"{key[0]}:{key[1]}: {e.strerror or e}") from None
        return conn

    def _tls(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def _take(self, key: tuple[str, int, bool]) -> _Conn | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used: least likely to be stale
            if conn.usable(now, self.keepalive_expiry):
                return conn
            conn.close()
        if idle is not None:
            del self._idle[key]  # engines come and go: keep no entry per engine ever seen
        return None

    def _put(self, key: tuple[str, int, bool], conn: _Conn) -> None:
        if self._closed:
            conn.close()
            return
        idle = self._idle.setdefault(key, deque())
        if len(idle) >= MAX_IDLE_PER_ENGINE:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
        self._idle.clear()
