"""What the gateway accepts from clients: header and body time limits, body size.

The request head's deadline (``--header-timeout``) and size bound
(``MAX_HEAD_BYTES``, a 431) are the server's (engine/gateway/server.py). The
body is read by :func:`read_body`, within ``body_timeout`` and
``max_body_bytes`` (refused on ``Content-Length`` before a byte is read; a
chunked body is counted as it arrives, so a huge chunk size holds nothing).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

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


def ready_body(request: Request, max_bytes: int) -> bytes | None:
    """The whole body when it has arrived with the head (the usual case: no
    coroutine to run), None when it must be read (``read_body``); BodyRejected
    as there."""
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
    ready = request.ready_body()
    if ready is not None and len(ready) > max_bytes:
        raise BodyRejected(f"the request body exceeds the limit of {max_bytes} bytes", 413)
    return ready


async def read_body(request: Request, max_bytes: int, timeout: float) -> bytes:
    """The whole body, or BodyRejected (nothing beyond ``max_bytes`` is kept)."""
    ready = ready_body(request, max_bytes)
    if ready is not None:
        return ready  # the usual case: all of it arrived with the head
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
