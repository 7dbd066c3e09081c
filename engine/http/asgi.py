"""The gateway's ASGI app: a route table and nothing else on the request path.

The gateway serves seven fixed routes. FastAPI's stack (a dozen middleware
layers, dependency solving, exception wrappers) cost about a third of a core
per request at a few thousand requests per second (docs/gateway.md has the
profile), so the app is a plain ASGI callable: one dict lookup of
``(method, path)``, the handler (a :class:`Request` in, a Starlette
``Response`` out), a 500 in OpenAI's shape for anything a handler raises.
Unknown paths are 404 and known paths with another method 405, as before.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from starlette.responses import Response

logger = logging.getLogger("pdfleet.gateway")


class ClientDisconnect(Exception):
    """The client went away while its body was being read."""


class Request:
    """What a handler reads of a request: its path, its headers (a plain dict
    of lower-case names, the first value of a repeated header, built on first
    use) and ``receive``. Starlette's ``Request`` and ``Headers`` cost several
    percent of a core per request at a few thousand requests per second."""

    __slots__ = ("_headers", "receive", "scope")

    def __init__(self, scope: dict, receive: Callable) -> None:
        self.scope, self.receive = scope, receive
        self._headers: dict[str, str] | None = None

    @property
    def path(self) -> str:
        return self.scope["path"]

    @property
    def headers(self) -> dict[str, str]:
        if self._headers is None:
            headers: dict[str, str] = {}
            for name, value in self.scope["headers"]:  # the server lower-cases names
                key = name.decode("latin-1")
                if key not in headers:
                    headers[key] = value.decode("latin-1")
            self._headers = headers
        return self._headers

    def ready_body(self) -> bytes | None:
        """None: under ASGI the body is read with ``receive`` (the gateway's own
        server, engine/gateway/server.py, hands a whole body over at once)."""
        return None

    def watch_disconnect(self, callback: Callable[[], None]) -> bool:
        """False: under ASGI a disconnect is watched for with ``receive``."""
        return False

    async def stream(self) -> AsyncIterator[bytes]:
        """The body's chunks as they arrive; ClientDisconnect if the client goes."""
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect
            body = message.get("body", b"")
            if body:
                yield body
            if not message.get("more_body", False):
                return


class BytesResponse(Response):
    """A whole answer from bytes and raw headers: Starlette's ``Response``
    without its per-response header rendering (``content-length`` is added
    here). Sent by the gateway's server in one write, or as ASGI messages."""

    def __init__(self, body: bytes, status_code: int, raw_headers: list[tuple[bytes, bytes]]):
        self.status_code = status_code
        self.body = body
        self.background = None
        raw_headers.append((b"content-length", b"%d" % len(body)))
        self.raw_headers = raw_headers


Handler = Callable[[Request], Awaitable[Response]]


class State:
    """Attributes the app carries (``app.state.gateway``)."""

    gateway: Any = None


class GatewayASGI:
    """ASGI app: ``(method, path)`` → handler, a lifespan, an error handler."""

    def __init__(
        self,
        lifespan: Callable[[Any], AbstractAsyncContextManager[None]],
        on_error: Callable[[Request, Exception], Response],
    ) -> None:
        self.routes: dict[tuple[str, str], Handler] = {}
        self.paths: set[str] = set()
        self.lifespan = lifespan
        self.on_error = on_error
        self.state = State()
        self._entry: Callable[..., Awaitable[None]] = self._dispatch

    def post(self, path: str) -> Callable[[Handler], Handler]:
        return self._route("POST", path)

    def get(self, path: str) -> Callable[[Handler], Handler]:
        return self._route("GET", path)

    def _route(self, method: str, path: str) -> Callable[[Handler], Handler]:
        def register(handler: Handler) -> Handler:
            self.routes[(method, path)] = handler
            self.paths.add(path)
            return handler

        return register

    @property
    def direct(self) -> bool:
        """No middleware: the gateway's server calls the handlers itself
        (engine/gateway/server.py), without ASGI messages."""
        return self._entry == self._dispatch

    def add_middleware(self, cls: type, **options: Any) -> None:
        """Wrap the request path in a pure ASGI middleware (tracing uses it)."""
        self._entry = cls(self._entry, **options)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._entry(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _dispatch(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope["path"]
        handler = self.routes.get((scope["method"], path))
        request = Request(scope, receive)
        if handler is None:
            if path in self.paths:
                response = Response(
                    b'{"detail":"Method Not Allowed"}', 405, media_type="application/json"
                )
            else:
                response = Response(b'{"detail":"Not Found"}', 404, media_type="application/json")
        else:
            try:
                response = await handler(request)
            except Exception as e:  # the client gets a 500; the log has the traceback
                response = self.on_error(request, e)
        await response(scope, receive, send)

    async def _lifespan(self, receive: Callable, send: Callable) -> None:
        message = await receive()
        assert message["type"] == "lifespan.startup"
        manager = self.lifespan(self)
        try:
            await manager.__aenter__()
        except Exception as e:
            logger.exception("gateway startup failed")
            await send({"type": "lifespan.startup.failed", "message": repr(e)})
            return
        await send({"type": "lifespan.startup.complete"})
        message = await receive()
        try:
            await manager.__aexit__(None, None, None)
        except Exception as e:
            logger.exception("gateway shutdown failed")
            await send({"type": "lifespan.shutdown.failed", "message": repr(e)})
            return
        await send({"type": "lifespan.shutdown.complete"})
