"""Limits on what one HTTP connection may cost an engine, and its credentials check.

Two layers, because some limits need the wire and some need the request:

* :func:`guarded_h11_protocol` is uvicorn's h11 protocol with timers. A
  connection must finish a request's headers within ``header_timeout``
  seconds of its first byte (a slow-loris client trickling headers is cut
  off; so is a connection that never sends anything) and its body within
  ``body_timeout`` seconds of the headers (answered 408). A chunked body whose
  chunk-size line announces more than ``max_chunk_bytes`` is answered 413 and
  the connection closed at once (h11 alone would wait for those bytes). A
  request head is counted as it arrives: past ``max_head_bytes`` it is
  answered 431 and the connection closed.
* :class:`GuardMiddleware` (ASGI) checks the credential of every route but
  the health probes (401), refuses a body whose ``Content-Length`` exceeds
  ``max_body_bytes`` before reading any of it (413, connection closed), and
  counts a chunked body as it arrives (413 as soon as it passes the limit),
  so a rejected request never holds more than the limit in memory.

The limits themselves (:class:`RequestLimits`, shared with the gateway) are
defined in ``engine/config/http_limits.py``. Every refusal is an OpenAI-shaped
JSON error. See docs/serving.md.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from ..config.http_limits import RequestLimits
from .auth import PROBE_PATHS, EngineAuth

logger = logging.getLogger("pdfleet.serve")


def error_bytes(message: str, status: int) -> bytes:
    from .openai.protocol import APIError

    return json.dumps(APIError(message, status=status).body()).encode()


async def _send_error(
    send: Any, status: int, message: str, close: bool, headers: list | None = None
) -> None:
    body = error_bytes(message, status)
    out = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *(headers or []),
    ]
    if close:
        out.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": out})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """Credentials and body size, before the application sees a request."""

    def __init__(self, app: Any, auth: EngineAuth, limits: RequestLimits) -> None:
        self.app, self.auth, self.limits = app, auth, limits

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        length: int | None = None
        chunked = False
        authorization = None
        for name, value in headers:
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = None
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"authorization":
                authorization = value.decode("latin-1")
        has_body = chunked or bool(length)
        if scope["path"] not in PROBE_PATHS and not self.auth.allows(authorization):
            await _send_error(
                send,
                401,
                "invalid or missing credentials: send 'Authorization: Bearer <key>'",
                close=has_body,
                headers=[(b"www-authenticate", b"Bearer")],
            )
            return
        limit = self.limits.max_body_bytes
        if length is not None and length > limit:
            await _send_error(send, 413, _too_large(length, limit), True)
            return
        if not has_body:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            total += len(body)
            if total > limit:
                chunks.clear()
                await _send_error(send, 413, _too_large(None, limit), True)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replay: list[dict] = [
            {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        ]
        chunks.clear()

        async def replayed() -> dict:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)


def _too_large(length: int | None, limit: int) -> str:
    size = f" ({length} bytes)" if length is not None else ""
    return (
        f"the request body{size} exceeds this server's limit of {limit} bytes "
        "(--max-request-body-bytes)"
    )


# The end of a request head: an empty line (h11 also takes bare LF line ends).
_HEAD_END = re.compile(rb"\n\r?\n")


def guarded_h11_protocol(limits: RequestLimits) -> type:
    """uvicorn's h11 protocol class with header/body timers and a chunk-size bound."""
    import h11
    from h11._readers import ChunkedReader
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:
            self._header_timer: Any = None
            self._body_timer: Any = None
            self._head_bytes = 0
            """Bytes of the request head being received (0 between requests)."""
            self._head_tail = b""
            """The last bytes received of that head (its end may span two reads)."""
            super().connection_made(transport)
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_timers()
            super().connection_lost(exc)

        def _cancel_timers(self) -> None:
            for name in ("_header_timer", "_body_timer"):
                timer = getattr(self, name, None)
                if timer is not None:
                    timer.cancel()
                    setattr(self, name, None)

        def _arm_header_timer(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(
                    limits.header_timeout, self._on_header_timeout
                )

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:
                self._arm_header_timer()  # the first bytes of a (next) request
                if self._head_too_large(data):
                    return
            super().data_received(data)
            if self.transport.is_closing():
                self._cancel_timers()
                return
            state = self.conn.their_state
            if state is not h11.IDLE and self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            if state is h11.SEND_BODY:
                if self._body_timer is None:
                    self._body_timer = self.loop.call_later(
                        limits.body_timeout, self._on_body_timeout
                    )
                reader = getattr(self.conn, "_reader", None)
                pending = getattr(reader, "_bytes_in_chunk", 0)
                if isinstance(reader, ChunkedReader) and pending > limits.max_chunk_bytes:
                    self.logger.warning(
                        "refused a %d-byte chunk from %s (--max-chunk-bytes %d)",
                        pending,
                        self.client,
                        limits.max_chunk_bytes,
                    )
                    self._refuse(
                        413,
                        f"a body chunk of {pending} bytes exceeds this server's limit of "
                        f"{limits.max_chunk_bytes} bytes (--max-chunk-bytes)",
                    )
            elif self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def _head_too_large(self, data: bytes) -> bool:
            """Count a request head as it arrives; past ``max_head_bytes`` answer 431
            and close. (h11 bounds only a head it must buffer across reads: one that
            arrives in a single read would pass at any size.)"""
            joined = self._head_tail + data
            end = _HEAD_END.search(joined)
            if end is None:
                self._head_bytes += len(data)
                self._head_tail = joined[-3:]
            else:
                self._head_bytes += end.end() - len(self._head_tail)
            if self._head_bytes > limits.max_head_bytes:
                self.logger.warning(
                    "refused a request head of more than %d bytes from %s",
                    limits.max_head_bytes,
                    self.client,
                )
                self._cancel_timers()
                body = error_bytes(
                    f"the request head exceeds this server's limit of "
                    f"{limits.max_head_bytes} bytes",
                    431,
                )
                self.transport.write(
                    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                    b"content-type: application/json\r\nconnection: close\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body)
                )
                self.transport.close()
                return True
            if end is not None:
                self._head_bytes, self._head_tail = 0, b""
            return False

        def _on_header_timeout(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.logger.warning(
                    "closed a connection from %s: no complete request headers within %.1fs "
                    "(--header-timeout)",
                    self.client,
                    limits.header_timeout,
                )
                self.transport.close()

        def _on_body_timeout(self) -> None:
            self._body_timer = None
            if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
                self.logger.warning(
                    "closed a connection from %s: request body not received within %.1fs "
                    "(--body-timeout)",
                    self.client,
                    limits.body_timeout,
                )
                self._refuse(
                    408,
                    f"the request body did not arrive within {limits.body_timeout:g}s "
                    "(--body-timeout)",
                )

        def _refuse(self, status: int, message: str) -> None:
            """Answer with an error (when no response has started) and close."""
            self._cancel_timers()
            cycle = self.cycle
            if cycle is not None:
                cycle.keep_alive = False
            started = cycle is not None and getattr(cycle, "response_started", False)
            if not started and self.conn.our_state is h11.SEND_RESPONSE:
                body = error_bytes(message, status)
                try:
                    out = self.conn.send(
                        h11.Response(
                            status_code=status,
                            headers=[
                                (b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close"),
                            ],
                        )
                    )
                    out += self.conn.send(h11.Data(data=body))
                    out += self.conn.send(h11.EndOfMessage())
                    self.transport.write(out)
                    if cycle is not None:
                        cycle.response_started = cycle.response_complete = True
                except h11.LocalProtocolError:
                    pass
            self.transport.close()

    return GuardedH11Protocol
