"""What the gateway accepts from clients: header and body time limits, body size.

uvicorn's httptools protocol bounds neither the time a client may take to send
a request head nor its size, so a client trickling headers would hold a
connection forever. :func:`http_protocol` returns that protocol with a header
deadline (a connection whose request head is not complete ``header_timeout``
seconds after it opened, or after the first byte of a kept-alive
connection's next request, is closed) and a bound of ``MAX_HEAD_BYTES`` on
the head (a 431, then the connection is closed). The body is read by
:func:`read_body`, within ``body_timeout`` and ``max_body_bytes`` (refused on
``Content-Length`` before a byte is read; a chunked body is counted as it
arrives, so a huge chunk size holds nothing).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request

# Largest request line + headers accepted from a client.
MAX_HEAD_BYTES = 64 * 1024


class BodyRejected(Exception):
    """The client's body is too large or too slow: ``status`` is 413 or 408."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message, self.status = message, status


async def read_body(request: Request, max_bytes: int, timeout: float) -> bytes:
    """The whole body, or BodyRejected (nothing beyond ``max_bytes`` is kept)."""
    length = request.headers.get("content-length")
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            raise BodyRejected("invalid Content-Length header", 400) from None
        if declared > max_bytes:
            raise BodyRejected(
                f"the request body is {declared} bytes; the limit is {max_bytes}", 413
            )
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise BodyRejected(
                        f"the request body exceeds the limit of {max_bytes} bytes", 413
                    )
                parts.append(chunk)
    except TimeoutError:
        raise BodyRejected(f"the request body was not received within {timeout}s", 408) from None
    return b"".join(parts)


def http_protocol(header_timeout: float, max_head_bytes: int = MAX_HEAD_BYTES) -> type:
    """uvicorn's httptools protocol with a deadline and a size bound on each
    request's head (httptools itself bounds neither)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeadLimitedProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _in_head = True
        """No complete request head yet on this connection (or since the last answer)."""
        _head_bytes = 0

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._in_head and self._head_timer is None:
                self._arm()  # a kept-alive connection's next request has begun
            super().data_received(data)
            if self._in_head and not self.transport.is_closing():
                self._head_bytes += len(data)
                if self._head_bytes > max_head_bytes:
                    self._refuse_head()

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._head_bytes = 0
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            self._in_head = True
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._head_timer is None and not self.transport.is_closing():
                self._head_timer = self.loop.call_later(header_timeout, self._head_expired)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_expired(self) -> None:
            self._head_timer = None
            if self._in_head and not self.transport.is_closing():
                self.transport.close()

        def _refuse_head(self) -> None:
            self._disarm()
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                b"content-length: 31\r\n\r\nRequest header fields too large"
            )
            self.transport.close()

    return HeadLimitedProtocol
