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
import json
from typing import TYPE_CHECKING, Any

from .asgi import ClientDisconnect

if TYPE_CHECKING:
    from .asgi import Request


from pdfleet.engine.config.http_limits import DEFAULT_LIMITS

# Largest request line + headers accepted from a client (the engine server's bound
# too); the body limits are GatewayConfig's, defaulting as the engine server's.
MAX_HEAD_BYTES = DEFAULT_LIMITS.max_head_bytes
# Seconds a refused connection is kept open to drain what the client still sends.
LINGER_SECONDS = 1.0


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
    receive = request.receive
    try:
        async with asyncio.timeout(timeout):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientDisconnect
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > max_bytes:
                    raise BodyRejected(
                        f"the request body exceeds the limit of {max_bytes} bytes", 413
                    )
                if not message.get("more_body", False):
                    if not parts:
                        return chunk  # the usual case: the whole body in one message
                    parts.append(chunk)
                    return b"".join(parts)
                parts.append(chunk)
    except TimeoutError:
        raise BodyRejected(f"the request body was not received within {timeout}s", 408) from None


class _HeadTooLarge(Exception):
    """A request head past its bound (raised inside the parser's callbacks)."""


def http_protocol(header_timeout: float, max_head_bytes: int = MAX_HEAD_BYTES) -> type:
    """uvicorn's httptools protocol with a deadline and a size bound on each
    request's head (httptools itself bounds neither)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeadLimitedProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _in_head = True
        """No complete request head yet on this connection (or since the last answer)."""
        _head_bytes = 0
        """Bytes of this request's line and headers, as the parser hands them over."""
        _buffered = 0
        """Bytes received while the head is incomplete (held by the parser)."""
        _discarding = False
        _too_large = False
        """Refused: the rest of what the client sends is dropped until the close."""

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._discarding:
                return
            if self._in_head and self._head_timer is None:
                self._arm()  # a kept-alive connection's next request has begun
            super().data_received(data)
            # A head still incomplete: count what httptools buffers of it.
            if self._in_head and not self._discarding and not self.transport.is_closing():
                self._buffered += len(data)
                if self._buffered > max_head_bytes:
                    self._refuse_head()

        def on_message_begin(self) -> None:
            self._head_bytes = 0
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def _count(self, size: int) -> None:
            self._head_bytes += size
            if self._head_bytes > max_head_bytes:
                self._too_large = True
                raise _HeadTooLarge  # httptools makes it a parse error: send_400_response

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._buffered = 0
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
            self._refuse(
                b"431 Request Header Fields Too Large",
                f"the request head exceeds {max_head_bytes} bytes",
                "request_header_fields_too_large",
            )

        def send_400_response(self, msg: str) -> None:
            if self._too_large:
                self._refuse_head()
                return
            # Not HTTP/1.1 (a malformed head, a chunk size past 64 bits): OpenAI's
            # error shape rather than uvicorn's plain text.
            self._refuse(b"400 Bad Request", "invalid HTTP/1.1 request", "invalid_request")

        def _refuse(self, status: bytes, message: str, code: str) -> None:
            body = json.dumps(
                {
                    "error": {
                        "message": message,
                        "type": "BadRequestError",
                        "param": None,
                        "code": code,
                    }
                }
            ).encode()
            self.transport.write(
                b"HTTP/1.1 %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%s" % (status, len(body), body)
            )
            # A lingering close: the answer and a FIN go out, what the client
            # still sends is read and dropped for a moment, then the connection
            # closes (closing with unread bytes would reset it, and the client
            # could lose the answer).
            self._discarding = True
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(LINGER_SECONDS, self.transport.close)

    return HeadLimitedProtocol
