"""A lean HTTP/1.1 client for the gateway's calls to engines (the hot path).

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
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

# Largest status line + headers accepted from an engine.
MAX_HEAD_BYTES = 64 * 1024
# Largest chunk-size line (hex digits and extensions).
MAX_CHUNK_LINE = 1024
# Largest chunk of a chunked answer (an engine's SSE event is a few KiB).
MAX_CHUNK_BYTES = 16 * 1024 * 1024
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


class _Conn:
    __slots__ = ("idle_since", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.idle_since = 0.0

    def usable(self, now: float, expiry: float) -> bool:
        return (
            now - self.idle_since < expiry
            and not self.reader.at_eof()
            and not self.writer.is_closing()
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class UpstreamResponse:
    """Status, headers (lower-case names) and, once read, the body."""

    def __init__(
        self,
        client: UpstreamClient,
        key: tuple[str, int, bool],
        conn: _Conn,
        status: int,
        reason: str,
    ) -> None:
        self._client, self._key = client, key
        self._conn: _Conn | None = conn
        """The connection while the body is unread; None once it is released."""
        self.status_code = status
        self.reason_phrase = reason
        self.headers: dict[str, str] = {}
        self.content = b""
        self._length: int | None = None
        self._chunked = False
        self._until_close = False
        self._done = False

    # -- body ---------------------------------------------------------------------

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked encoding removed)."""
        if self._conn is None:
            raise RuntimeError("the response body was already released")
        reader = self._conn.reader
        try:
            if self._chunked:
                while True:
                    line = await reader.readuntil(b"\r\n")
                    if len(line) > MAX_CHUNK_LINE:
                        raise UpstreamError("chunk-size line too long")
                    try:
                        size = int(line.split(b";", 1)[0].strip(), 16)
                    except ValueError:
                        raise UpstreamError(f"bad chunk size {line[:40]!r}") from None
                    if size > MAX_CHUNK_BYTES:
                        raise UpstreamError(f"chunk of {size} bytes exceeds {MAX_CHUNK_BYTES}")
                    if size == 0:
                        # Trailers (none from uvicorn) end with an empty line.
                        while await reader.readuntil(b"\r\n") != b"\r\n":
                            pass
                        break
                    data = await reader.readexactly(size + 2)
                    yield data[:-2]
            elif self._length is not None:
                left = self._length
                while left:
                    data = await reader.read(min(left, 1 << 16))
                    if not data:
                        raise UpstreamError("connection closed before the end of the body")
                    left -= len(data)
                    yield data
            else:  # no length, not chunked: the body runs to the connection's end
                while data := await reader.read(1 << 16):
                    yield data
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError) as e:
            raise UpstreamError(f"{type(e).__name__}: {e}") from None
        self._done = True
        self._release()

    async def aread(self) -> bytes:
        if self._length is not None and self._conn is not None:  # one read, no generator
            try:
                self.content = await self._conn.reader.readexactly(self._length)
            except (asyncio.IncompleteReadError, OSError) as e:
                raise UpstreamError(f"{type(e).__name__}: {e}") from None
            self._done = True
            self._release()
            return self.content
        parts = [part async for part in self.aiter_raw()]
        self.content = b"".join(parts)
        return self.content

    async def aclose(self) -> None:
        """Give the connection back when the body was read, else close it."""
        self._release()

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done and not self._until_close and self.headers.get("connection") != "close":
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
    ) -> None:
        self.connect_timeout = connect_timeout
        self.keepalive_expiry = keepalive_expiry
        self._idle: dict[tuple[str, int, bool], deque[_Conn]] = {}
        self._targets: dict[str, tuple[tuple[str, int, bool], str]] = {}
        self._closed = False
        self._ssl = ssl_context

    async def post(
        self, url: str, content: bytes, headers: dict[str, str], timeout: float | None
    ) -> UpstreamResponse:
        """A whole answer, read within ``timeout`` seconds (None: the caller bounds it)."""
        if timeout is None:
            return await self._post(url, content, headers)
        async with asyncio.timeout(timeout):
            return await self._post(url, content, headers)

    async def _post(self, url: str, content: bytes, headers: dict[str, str]) -> UpstreamResponse:
        resp = await self.stream(url, content, headers)
        try:
            await resp.aread()
        finally:
            await resp.aclose()
        return resp

    async def stream(self, url: str, content: bytes, headers: dict[str, str]) -> UpstreamResponse:
        """Send the request and read the status and headers; the caller reads
        the body (``aiter_raw``/``aread``) and must ``aclose`` the response."""
        target = self._targets.get(url)
        if target is None:
            target = self._target(url)
        key, request_line = target
        head = [request_line]
        head += [f"{k}: {v}" for k, v in headers.items() if k.lower() != "content-length"]
        head.append(f"content-length: {len(content)}")
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + content
        conn = self._take(key)
        if conn is not None:
            try:
                return await self._exchange(key, conn, request)
            except _NothingBack:
                # A kept-alive connection the engine had closed: the request never
                # reached it. Retry once, on a new connection.
                conn.close()
            except BaseException:
                conn.close()  # cancelled or timed out: the engine sees the request end
                raise
        conn = await self._connect(key)
        try:
            return await self._exchange(key, conn, request)
        except BaseException:
            conn.close()
            raise

    def _target(self, url: str) -> tuple[tuple[str, int, bool], str]:
        """(connection key, request line and host header) of ``url``, cached."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamError(f"not an http(s) URL: {url!r}")
        tls = parts.scheme == "https"
        key = (parts.hostname, parts.port or (443 if tls else 80), tls)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        if len(self._targets) >= MAX_CACHED_URLS:
            self._targets.clear()  # engines come and go: the cache stays small
        self._targets[url] = target = (key, f"POST {path} HTTP/1.1\r\nhost: {parts.netloc}")
        return target

    async def _exchange(
        self, key: tuple[str, int, bool], conn: _Conn, request: bytes
    ) -> UpstreamResponse:
        try:
            conn.writer.write(request)
            await conn.writer.drain()
        except OSError as e:
            raise _NothingBack(f"{type(e).__name__}: {e}") from None
        try:
            head = await conn.reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise UpstreamError("response headers too large") from None
        except asyncio.IncompleteReadError as e:
            if not e.partial:
                raise _NothingBack("the engine closed the connection without answering") from None
            raise UpstreamError(f"the answer ended in its headers: {e}") from None
        except OSError as e:
            raise UpstreamError(f"{type(e).__name__}: {e}") from None
        lines = head.decode("latin-1").split("\r\n")
        status_line = lines[0].split(" ", 2)
        if len(status_line) < 2 or not status_line[0].startswith("HTTP/1."):
            raise UpstreamError(f"not an HTTP/1.1 answer: {lines[0][:60]!r}")
        try:
            status = int(status_line[1])
        except ValueError:
            raise UpstreamError(f"bad status line {lines[0][:60]!r}") from None
        resp = UpstreamResponse(
            self, key, conn, status, status_line[2] if len(status_line) > 2 else ""
        )
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(":")
            if not sep:
                raise UpstreamError(f"bad header line {line[:60]!r}")
            resp.headers[name.strip().lower()] = value.strip()
        encoding = resp.headers.get("transfer-encoding", "").lower()
        if "chunked" in encoding:
            resp._chunked = True
        elif "content-length" in resp.headers:
            try:
                resp._length = int(resp.headers["content-length"])
            except ValueError:
                raise UpstreamError("bad content-length") from None
        elif status in (204, 304) or 100 <= status < 200:
            resp._length = 0
        else:
            resp._until_close = True
        return resp

    async def _connect(self, key: tuple[str, int, bool]) -> _Conn:
        if self._closed:
            raise UpstreamError("the client is closed")
        try:
            async with asyncio.timeout(self.connect_timeout):
                reader, writer = await asyncio.open_connection(
                    key[0],
                    key[1],
                    limit=MAX_HEAD_BYTES,
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
        return _Conn(reader, writer)

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
