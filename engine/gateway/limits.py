"""What the gateway accepts from clients: header and body time limits, body size.

uvicorn bounds the size of a request head (``h11_max_incomplete_event_size``)
but not the time a client may take to send it, so a client trickling headers
holds a connection forever. :func:`http_protocol` returns uvicorn's h11
protocol with a header deadline: a connection whose request head is not
complete ``header_timeout`` seconds after it opened (or after the first byte
of a kept-alive connection's next request) is closed. The body is read by
:func:`read_body`, within ``body_timeout`` and ``max_body_bytes`` (refused on
``Content-Length`` before a byte is read; a chunked body is counted as it
arrives, so a huge chunk size holds nothing).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request


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


def http_protocol(header_timeout: float) -> type:
    """uvicorn's h11 protocol with a deadline on each request's head."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:
                self._arm()  # the next request's head has begun (or not yet)
            else:
                self._disarm()

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
            # IDLE: no complete request head (a request in progress is past it).
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol
