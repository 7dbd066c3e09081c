"""The body limits of a request, as its handler reads the body: size and time.

The head's deadline and size bound (431) and the chunk-size bound (413) are
the server's (``server.py``), since only the wire sees them; the limits
themselves are :class:`RequestLimits` (engine/contracts/http_limits.py), one
definition for the engine server and the gateway. A body is refused on its
``Content-Length`` before a byte of it is read (413), counted as it arrives
(a chunked body: 413 as soon as it passes ``max_body_bytes``, so a refused
request never holds more than the limit), and must arrive within
``body_timeout`` seconds of the handler's first read (408). The gateway reads
its bodies with :func:`read_body`, the engine's ASGI guard with
:func:`receive_body`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from .asgi import ClientDisconnect

if TYPE_CHECKING:
    from .asgi import Request

# Seconds a refused connection is kept open to drain what the client still
# sends, and the most it drains: a client that keeps sending past that (a huge
# body refused at its limit) has its connection closed at once.
LINGER_SECONDS = 1.0
LINGER_BYTES = 256 * 1024


class BodyRejected(Exception):
    """The client's body is too large (413), too slow (408) or its length invalid (400)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message, self.status = message, status


def check_length(value: str | None, max_bytes: int) -> int | None:
    """A ``Content-Length`` header's value checked against ``max_bytes`` (None: no header)."""
    if value is None:
        return None
    try:
        declared = int(value)
    except ValueError:
        raise BodyRejected("invalid Content-Length header", 400) from None
    if declared > max_bytes:
        raise BodyRejected(f"the request body is {declared} bytes; the limit is {max_bytes}", 413)
    return declared


def too_large(max_bytes: int) -> BodyRejected:
    return BodyRejected(f"the request body exceeds the limit of {max_bytes} bytes", 413)


def ready_body(request: Request, max_bytes: int) -> bytes | None:
    """The whole body when it has arrived with the head (the usual case: no
    coroutine to run), None when it must be read (``read_body``); BodyRejected
    as there."""
    check_length(request.headers.get("content-length"), max_bytes)
    ready = request.ready_body()
    if ready is not None and len(ready) > max_bytes:
        raise too_large(max_bytes)
    return ready


async def read_body(request: Request, max_bytes: int, timeout: float) -> bytes:  # noqa: ASYNC109 (the per-call bound goes to asyncio.timeout)
    """The whole body, or BodyRejected (nothing beyond ``max_bytes`` is kept)."""
    ready = ready_body(request, max_bytes)
    if ready is not None:
        return ready  # the usual case: all of it arrived with the head
    return await receive_body(request.receive, max_bytes, timeout)


async def receive_body(
    receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
    max_bytes: int,
    timeout: float,  # noqa: ASYNC109 (the per-call bound goes to asyncio.timeout)
) -> bytes:
    """The body from ASGI ``receive`` messages: BodyRejected past ``max_bytes``
    (what arrived is dropped) or after ``timeout`` seconds; ClientDisconnect
    when the client goes."""
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientDisconnect
                chunk: bytes = message.get("body", b"")
                size += len(chunk)
                if size > max_bytes:
                    parts.clear()
                    raise too_large(max_bytes)
                if not message.get("more_body", False):
                    if not parts:
                        return chunk  # the usual case: the whole body in one message
                    parts.append(chunk)
                    return b"".join(parts)
                parts.append(chunk)
    except TimeoutError:
        raise BodyRejected(f"the request body was not received within {timeout}s", 408) from None
