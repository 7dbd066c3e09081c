"""ASGI pieces of the HTTP stack: a route-table app, what its handlers read and
answer, and the lifespan protocol run for any ASGI app.

The gateway serves seven fixed routes. FastAPI's stack (a dozen middleware
layers, dependency solving, exception wrappers) cost about a third of a core
per request at a few thousand requests per second (docs/gateway.md has the
profile), so its app is a :class:`RouteTable`: one dict lookup of
``(method, path)``, the handler (a :class:`Request` in, a Starlette
``Response`` out), a 500 in OpenAI's shape for anything a handler raises.
Unknown paths are 404 and known paths with another method 405, in OpenAI's
error shape (engine/contracts/errors.py), as the engine's FastAPI app answers
them. The server (``server.py``) calls a route table's handlers itself when no
middleware wraps it; any other ASGI app (the engine's FastAPI app) is served
through ``scope``/``receive``/``send``, and :class:`Lifespan` runs its
``lifespan`` messages.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Send

from ..contracts.errors import ErrorBody, method_not_allowed, not_found

logger = logging.getLogger("pdfleet.http")

JSON_CONTENT_TYPE = (b"content-type", b"application/json")


class ClientDisconnect(Exception):
    """The client went away while its body was being read."""


class Request:
    """What a handler reads of a request: its path, its headers (a plain dict
    of lower-case names, the first value of a repeated header, built on first
    use) and ``receive``. Starlette's ``Request`` and ``Headers`` cost several
    percent of a core per request at a few thousand requests per second."""

    __slots__ = ("_headers", "receive", "scope")

    def __init__(self, scope: dict[str, Any], receive: Receive) -> None:
        self.scope, self.receive = scope, receive
        self._headers: dict[str, str] | None = None

    @property
    def path(self) -> str:
        path: str = self.scope["path"]
        return path

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

    @property
    def client(self) -> tuple[str, int] | None:
        """The client's (host, port), as the server gives it."""
        return self.scope.get("client")

    def ready_body(self) -> bytes | None:
        """None: under ASGI the body is read with ``receive`` (the server's own
        request, ``server.Cycle``, hands a whole body over at once)."""
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
    here). Sent by the server in one write, or as ASGI messages."""

    def __init__(self, body: bytes, status_code: int, raw_headers: list[tuple[bytes, bytes]]):
        self.status_code = status_code
        self.body = body
        self.background = None
        raw_headers.append((b"content-length", b"%d" % len(body)))
        self.raw_headers = raw_headers


def error_answer(
    error: ErrorBody, headers: list[tuple[bytes, bytes]] | None = None
) -> BytesResponse:
    """``error`` as a whole JSON answer (its status, OpenAI's body)."""
    return BytesResponse(error.encode(), error.status, [JSON_CONTENT_TYPE, *(headers or ())])


Handler = Callable[[Request], Awaitable[Response]]


class State:
    """Attributes the app carries (``app.state.gateway``)."""

    gateway: Any = None


class RouteTable:
    """ASGI app: ``(method, path)`` → handler, a lifespan, an error handler."""

    def __init__(
        self,
        lifespan: Callable[[Any], AbstractAsyncContextManager[None]],
        on_error: Callable[[Request, Exception], Response],
    ) -> None:
        self.routes: dict[tuple[str, str], Handler] = {}
        self.prefixes: list[tuple[str, str, Handler]] = []
        """(method, path prefix, handler): a route for every path under the
        prefix (``/v1/models/`` takes ``/v1/models/{id}``)."""
        self.paths: dict[str, list[str]] = {}
        """Each path's methods (the ``Allow`` header of a 405)."""
        self.lifespan = lifespan
        self.on_error = on_error
        self.state = State()
        self._entry: Callable[..., Awaitable[None]] = self._dispatch

    def post(self, path: str) -> Callable[[Handler], Handler]:
        return self._route("POST", path)

    def get(self, path: str) -> Callable[[Handler], Handler]:
        return self._route("GET", path)

    def delete(self, path: str) -> Callable[[Handler], Handler]:
        return self._route("DELETE", path)

    def _route(self, method: str, path: str) -> Callable[[Handler], Handler]:
        def register(handler: Handler) -> Handler:
            self.routes[(method, path)] = handler
            self.paths.setdefault(path, []).append(method)
            return handler

        return register

    def get_prefix(self, prefix: str, method: str = "GET") -> Callable[[Handler], Handler]:
        """``method`` (GET by default) of every path that starts with ``prefix``
        (the handler reads the rest)."""

        def register(handler: Handler) -> Handler:
            self.prefixes.append((method, prefix, handler))
            return handler

        return register

    def lookup(self, method: str, path: str) -> Handler | None:
        """The handler of ``method path``: its exact route, else a prefix route."""
        handler = self.routes.get((method, path))
        if handler is None:
            for m, prefix, h in self.prefixes:
                if m == method and path.startswith(prefix) and len(path) > len(prefix):
                    return h
        return handler

    def unrouted(self, path: str) -> BytesResponse:
        """The answer to a request no route takes: 405 (with ``Allow``) for a
        known path, else 404."""
        methods = self.paths.get(path)
        if methods is None:
            # As :meth:`lookup` matches: the prefix itself (`/v1/models/`) is no route.
            methods = [
                m
                for m, prefix, _ in self.prefixes
                if path.startswith(prefix) and len(path) > len(prefix)
            ] or None
        if methods is None:
            return error_answer(not_found())
        return error_answer(method_not_allowed(), [(b"allow", ", ".join(methods).encode())])

    @property
    def direct(self) -> bool:
        """No middleware: the server calls the handlers itself (``server.py``),
        without ASGI messages."""
        return self._entry == self._dispatch

    def add_middleware(self, cls: type, **options: Any) -> None:
        """Wrap the request path in a pure ASGI middleware (tracing uses it)."""
        self._entry = cls(self._entry, **options)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._entry(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _dispatch(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        path = scope["path"]
        handler = self.lookup(scope["method"], path)
        request = Request(scope, receive)
        if handler is None:
            response: Response = self.unrouted(path)
        else:
            try:
                response = await handler(request)
            except Exception as e:  # the client gets a 500; the log has the traceback
                response = self.on_error(request, e)
        await response(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        message = await receive()
        if message["type"] != "lifespan.startup":
            raise RuntimeError(
                f"the first lifespan message must be lifespan.startup, not {message['type']!r}"
            )
        manager = self.lifespan(self)
        try:
            await manager.__aenter__()
        except Exception as e:
            logger.exception("startup failed")
            await send({"type": "lifespan.startup.failed", "message": repr(e)})
            return
        await send({"type": "lifespan.startup.complete"})
        message = await receive()
        try:
            await manager.__aexit__(None, None, None)
        except Exception as e:
            logger.exception("shutdown failed")
            await send({"type": "lifespan.shutdown.failed", "message": repr(e)})
            return
        await send({"type": "lifespan.shutdown.complete"})


class Lifespan:
    """An ASGI app's ``lifespan`` protocol, run by the server: ``startup``
    before it listens, ``shutdown`` after its last request.

    An app that does not speak the protocol (it raises at the first message)
    is served without one, as ASGI servers do."""

    def __init__(self, app: Any) -> None:
        self._app = app
        self._inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._unsupported = False

    async def _run(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        try:
            await self._app(scope, self._inbox.get, self._outbox.put)
        except Exception:
            self._unsupported = True
            logger.debug("the app does not speak the ASGI lifespan protocol", exc_info=True)
        finally:
            # Whatever waits on an answer gets one (the app returned without it).
            self._outbox.put_nowait({"type": "lifespan.ended"})

    async def startup(self) -> bool:
        """True when the app started (or has no lifespan); False when it failed."""
        self._task = asyncio.create_task(self._run(), name="pdfleet-http-lifespan")
        await self._inbox.put({"type": "lifespan.startup"})
        answer = await self._outbox.get()
        if answer["type"] == "lifespan.startup.failed":
            logger.error("startup failed: %s", answer.get("message", ""))
            return False
        return answer["type"] == "lifespan.startup.complete" or self._unsupported

    async def shutdown(self) -> None:
        task = self._task
        if task is None or task.done():
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        answer = await self._outbox.get()
        if answer["type"] == "lifespan.shutdown.failed":
            logger.error("shutdown failed: %s", answer.get("message", ""))
        await asyncio.gather(task, return_exceptions=True)
