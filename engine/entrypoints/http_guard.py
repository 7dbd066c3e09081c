"""What the engine server checks of a request before its app sees it.

:class:`GuardMiddleware` (ASGI) checks the credential of every route but the
health probes (401), refuses a body whose ``Content-Length`` exceeds
``max_body_bytes`` before reading any of it (413, connection closed), counts
a chunked body as it arrives (413 as soon as it passes the limit, so a
rejected request never holds more than the limit in memory), and gives the
body ``body_timeout`` seconds to arrive (408, connection closed). The body
reader is the gateway's too (``engine/http/limits.py``); the limits of the
wire (the head's deadline and size, a chunk's size) are the HTTP server's
(``engine/http/server.py``), the same server and the same
:class:`RequestLimits` as the gateway's. Every refusal is OpenAI's error body
(engine/contracts/errors.py). See docs/serving.md.
"""

from __future__ import annotations

import logging
from typing import Any

from ..contracts.errors import ErrorBody
from ..contracts.http_limits import RequestLimits
from ..http.asgi import ClientDisconnect
from ..http.limits import BodyRejected, check_length, receive_body
from .auth import PROBE_PATHS, EngineAuth

logger = logging.getLogger("pdfleet.serve")


async def _send_error(
    send: Any, error: ErrorBody, close: bool, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = error.encode()
    out = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *(headers or []),
    ]
    if close:
        out.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": out})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """Credentials, then the body's size and time, before the application sees a request."""

    def __init__(self, app: Any, auth: EngineAuth, limits: RequestLimits) -> None:
        self.app, self.auth, self.limits = app, auth, limits

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length: str | None = None
        chunked = False
        authorization = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value.decode("latin-1")
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"authorization":
                authorization = value.decode("latin-1")
        has_body = chunked or (length is not None and length.strip() not in ("", "0"))
        if scope["path"] not in PROBE_PATHS and not self.auth.allows(authorization):
            await _send_error(
                send,
                ErrorBody(
                    "invalid or missing credentials: send 'Authorization: Bearer <key>'", 401
                ),
                close=has_body,
                headers=[(b"www-authenticate", b"Bearer")],
            )
            return
        if not has_body:
            await self.app(scope, receive, send)
            return
        limits = self.limits
        try:
            check_length(length, limits.max_body_bytes)
            body = await receive_body(receive, limits.max_body_bytes, limits.body_timeout)
        except BodyRejected as e:
            # The rest of the body is never read: the connection cannot be reused.
            await _send_error(send, ErrorBody(e.message, e.status), close=True)
            return
        except ClientDisconnect:
            return
        replay: list[dict[str, Any]] = [{"type": "http.request", "body": body, "more_body": False}]

        async def replayed() -> dict[str, Any]:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)
