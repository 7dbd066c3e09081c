"""The relay of a streamed decode leg: SSE framing, deadlines, disconnects.

A streamed answer is relayed event by event as bytes, never re-serialized:
what arrives is cut at its last event boundary (``\\n\\n``), so an error event
never lands mid-event; the relay watches only for the first event (TTFT)
and the ``data: [DONE]`` that ends a stream. A client that goes away ends the
relay, which closes the engine's connection and so aborts its request
(:class:`DisconnectWatch`, :class:`RelayResponse`).

One loop (:func:`relay`) relays every stream; what happens when a leg ends
short of its ``[DONE]`` is its :class:`Recovery`'s to decide:

* :class:`Resend` (a request that cannot migrate): a stall before the first
  event moves the leg to another engine (the client has only seen headers);
  any later failure ends the stream with an SSE error event in OpenAI's shape
  and ``data: [DONE]`` at once;
* ``migration.Migrating`` (a migratable request): the leg resumes on another
  decode engine after the tokens the client has (docs/migration.md); it also
  takes the migration comments off the events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from starlette.responses import Response
from starlette.types import Send

from ..http.upstream import UpstreamError, UpstreamResponse
from .answers import DONE, sse_error
from .call import Call
from .deadlines import Deadline, IdleTimer, current_task
from .engines import EngineState
from .legs import LegFailed, Legs

logger = logging.getLogger("pdfleet.gateway")

SSE_CONTENT_TYPE = (b"content-type", b"text/event-stream; charset=utf-8")
_NO_DEADLINE: contextlib.nullcontext[None] = contextlib.nullcontext()
"""The relay's idle deadline when the engine's whole answer is here (nothing to wait for)."""

Opened = tuple[EngineState, UpstreamResponse, AsyncIterator[bytes]]
"""A decode leg accepted by an engine: the engine, its response, its chunks."""
Resender = Callable[[EngineState], Awaitable[Opened | None]]
"""The decode leg sent again after ``stalled`` (None when no engine took it)."""
Writer = Callable[[bytes], Awaitable[None] | None]
"""Sends bytes to the client; an awaitable while the client reads slower than
the stream comes (its connection paused for writing), else None."""


class StreamEnd(NamedTuple):
    """The error event that ends a stream no other leg continues."""

    message: str
    status: int


@dataclass(slots=True)
class LegEnd:
    """How a relayed leg ended short of its ``data: [DONE]``."""

    engine: EngineState
    got: bool
    """The leg sent a whole event (not necessarily one the client saw)."""
    client_started: bool
    """The client has had an event of this answer (from this leg or an earlier one)."""
    handed_back: bool
    """The leg ended with a stopping engine's ``: migrate``."""
    error: LegFailed | None
    """Its transport failure or timeout, classified; None: the stream just ended."""
    first_bound: float | None
    """The leg's first-event bound, when it waited under one."""


class Recovery:
    """What the relay does besides forwarding bytes. This base forwards the
    events unchanged and ends a failed stream with an error event."""

    events: Callable[[bytes, bool], tuple[bytes, bool]] | None = None
    """``events(block, first)``: what of ``block`` (whole events; ``first``:
    the leg's first) goes to the client, and whether the block ends with a
    stopping engine's ``: migrate``; None forwards blocks unchanged (the plain
    stream's hot path makes no call per event)."""

    def __init__(self, legs: Legs, call: Call) -> None:
        self.legs = legs
        self.call = call

    def idle_hold(self, engine: EngineState) -> Callable[[], float] | None:
        """For the relay's idle timer on ``engine``'s leg: the seconds it must
        still wait when its idle time is up (see ``IdleTimer``); None: none."""
        return None

    async def recover(self, end: LegEnd) -> Opened | StreamEnd:
        """After the leg ``end`` describes (already closed and released): the
        next leg to relay, or the error event that ends the stream."""
        legs, engine, failure = self.legs, end.engine, end.error
        if failure is None:
            logger.warning(
                "request %s: decode engine %s ended the stream early",
                self.call.request_id,
                engine.url,
            )
            legs.pair_failed(self.call, engine)
            return StreamEnd("the decode engine ended the stream early", 502)
        if failure.kind == "timeout":
            failure.message = (
                f"the decode engine sent no first token within "
                f"{end.first_bound or legs.first_token_bound(engine):g}s"
                if not end.got
                else f"the decode engine sent nothing for {legs.config.idle_timeout:g}s"
            )
        logger.warning(
            "request %s: %s mid-stream (%s)", self.call.request_id, failure.message, failure.detail
        )
        legs.pair_failed(self.call, engine)
        return StreamEnd(failure.message, failure.status)


class Resend(Recovery):
    """A stream that cannot migrate: an engine ejected for a stall before its
    first event is replaced (``resend``: the decode leg on another engine;
    the client has only seen headers). After the first event a failure ends
    the stream with an error event at once (the client can retry) rather
    than after a stopped engine resumes."""

    def __init__(self, legs: Legs, call: Call, resend: Resender | None) -> None:
        super().__init__(legs, call)
        self.resend = resend

    async def recover(self, end: LegEnd) -> Opened | StreamEnd:
        error = end.error
        if error is not None and error.kind == "stalled" and not end.got and self.resend:
            moved = await self.resend(end.engine)
            if moved is not None:
                return moved
        return await super().recover(end)


def whole_events(buf: bytes, limit: int) -> tuple[bytes, bytes]:
    """(the whole SSE events at the head of ``buf``, the rest); UpstreamError once
    what is buffered passes ``limit`` bytes without ending an event."""
    if len(buf) > limit:
        raise UpstreamError(f"an event of over {limit} bytes")
    cut = buf.rfind(b"\n\n")
    if cut < 0:
        return b"", buf
    return buf[: cut + 2], buf[cut + 2 :]


async def relay(  # noqa: C901 (one relay loop: legs, first event, idle, handback, error exits)
    legs: Legs,
    call: Call,
    engine: EngineState,
    resp: UpstreamResponse,
    chunks: AsyncIterator[bytes],
    recovery: Recovery,
    write: Writer,
) -> None:
    """Relay whole SSE events to ``write`` (so an error event never lands mid-event).

    A coroutine that writes, not an async generator that a writer iterates:
    no step of an iterator per event, no registration with the loop's
    async-generator hooks. Bytes are forwarded as they come, cut only at the last event boundary
    of what arrived (never parsed or re-serialized; ``recovery.events`` may
    take comment lines off); the relay watches only for each leg's first
    event (TTFT, under the engine's first-token bound and the stall
    watchdog) and the ``[DONE]`` that ends a stream, then the rest under
    ``--idle-timeout``. A leg that ends without ``[DONE]`` (the engine died,
    stalled, timed out, or handed the stream back) is closed and released,
    and ``recovery`` names the next leg or the error event that ends the
    stream. The relay holds the current leg's engine (its in-flight count)
    and response until it ends, and finishes the call.
    """
    status = 200
    client_started = False
    limit = legs.config.max_body_bytes
    idle = legs.config.idle_timeout
    pool = legs.pool
    events = recovery.events
    holding = True  # the relay holds ``engine`` and ``resp``
    done = False  # the client has its whole answer
    try:
        while True:  # one leg per turn
            got = done = handed_back = False
            buf = b""
            first_bound: float | None = None  # (sized when there is a wait to bound)
            error: LegFailed | None = None
            try:
                while not got:  # until the leg's first whole event
                    if resp.buffered():  # already here: no wait to bound, no step of ``chunks``
                        data = resp.read_buffered()
                        if not data:
                            break  # the leg ended before its first event
                    else:
                        if first_bound is None:
                            first_bound = legs.first_token_bound(engine)
                        with legs.watched(engine, first_bound):
                            data = await anext(chunks)
                    pool.progress(engine)
                    out, buf = whole_events(buf + data, limit)
                    if not out:
                        continue
                    got = True
                    if events is not None:
                        out, handed_back = events(out, True)
                    if out:
                        if not client_started:
                            client_started = True
                            legs.first_token(call)
                        done = out.endswith(DONE)
                        wait = write(out)
                        if wait is not None:
                            await wait
                if done and resp.drained():
                    pass  # the engine's whole answer was here and went out: no wait
                elif got and not handed_back:
                    # The rest under one idle timeout, pushed back as each chunk
                    # arrives and off while the client takes an event (a slow
                    # reader is not an idle engine; the stall watchdog, which
                    # reschedules the registered timeouts, waits on the engine
                    # only). None when the engine's whole answer is here.
                    with _NO_DEADLINE if resp.received() else Deadline(None) as cm:
                        timer = (
                            None if cm is None else IdleTimer(cm, idle, recovery.idle_hold(engine))
                        )
                        if timer is not None:
                            engine.waiters.add(cm)
                        try:
                            async for data in chunks:  # a stall-ejected engine ends its streams now
                                pool.progress(engine)
                                out, buf = whole_events(buf + data, limit)
                                if not out:
                                    if timer is not None:
                                        timer.touch()
                                    continue
                                if events is not None:
                                    out, handed_back = events(out, False)
                                    if not out:
                                        if handed_back:
                                            break
                                        if timer is not None:
                                            timer.touch()
                                        continue
                                    if not client_started:
                                        client_started = True
                                        legs.first_token(call)
                                done = done or out.endswith(DONE)
                                if timer is None:
                                    wait = write(out)
                                    if wait is not None:
                                        await wait
                                else:
                                    timer.paused = True
                                    engine.waiters.discard(cm)
                                    wait = write(out)
                                    if wait is not None:
                                        await wait
                                    engine.waiters.add(cm)
                                    timer.touch()
                                if handed_back:
                                    break
                        finally:
                            if timer is not None:
                                timer.cancel()
                                engine.waiters.discard(cm)
            except StopAsyncIteration:  # the leg ended before its first event
                pass
            except (UpstreamError, TimeoutError) as ex:
                if done:  # the client has its whole answer; only the connection's end failed
                    return
                error = legs.failed(engine, "decode", ex)
            if done:
                return
            if error is None and not handed_back:
                # Ended without [DONE]: the engine went away mid-stream.
                legs.metrics.upstream_errors.labels(engine.url, engine.role, "broken").inc()
            end = LegEnd(engine, got, client_started, handed_back, error, first_bound)
            holding = False
            await resp.aclose()
            legs.release(engine)
            nxt = await recovery.recover(end)
            if isinstance(nxt, StreamEnd):
                status = nxt.status
                wait = write(sse_error(nxt.message, status))
                if wait is not None:
                    await wait
                return
            engine, resp, chunks = nxt
            holding = True
            legs.move_slot(call, engine)
    except (asyncio.CancelledError, OSError):
        # The client went away mid-stream (its disconnect cancels the relay, or
        # a write to it broke), or the gateway stopped: not an answer served,
        # unless the client had it whole ([DONE]) and only the leg's end was left.
        if not done:
            status = 499
        raise
    finally:
        if holding:
            resp.close()  # (``aclose`` without a coroutine)
            legs.release(engine)
        legs.finish(call, status)


class RelayResponse(Response):
    """A streamed answer that always closes its relay (and so the upstream
    connection), also when the client disconnects mid-stream.

    Starlette's StreamingResponse runs a task group of two tasks per stream to
    notice a disconnect; here one watcher task cancels the relay instead (the
    one ``Proxy.handle`` started for the request, handed over as ``watch``).
    Its headers are built here, not by Starlette's per-response header code."""

    def __init__(
        self,
        relay: Callable[[Writer], Awaitable[None]],
        abandon: Callable[[], Awaitable[None]],
        request_id: str,
    ) -> None:
        # Not Response.__init__: no body to render, and the headers are fixed.
        self.status_code = 200
        self.background = None
        self.relay = relay
        """:func:`relay` but for its writer (which always runs its ``finally``)."""
        self.raw_headers = [SSE_CONTENT_TYPE, (b"x-request-id", request_id.encode("latin-1"))]
        self.abandon = abandon
        """Releases what the relay holds if it never starts (its finally would)."""
        self.watch: DisconnectWatch | None = None
        """The request's disconnect watcher, if the handler started one."""

    async def __call__(self, scope: Any, receive: Any, send: Send) -> None:
        """ASGI: the relay as ``http.response.*`` messages (the tracing path)."""

        def start(status: int, headers: list[tuple[bytes, bytes]]) -> Awaitable[None]:
            return send({"type": "http.response.start", "status": status, "headers": headers})

        def write(chunk: bytes) -> Awaitable[None]:
            return send({"type": "http.response.body", "body": chunk, "more_body": True})

        def end() -> Awaitable[None]:
            return send({"type": "http.response.body", "body": b"", "more_body": False})

        await self.stream_to(start, write, end, receive)

    async def stream_to(
        self,
        start: Callable[[int, list[tuple[bytes, bytes]]], Awaitable[None] | None],
        write: Callable[[bytes], Awaitable[None] | None],
        end: Callable[[], Awaitable[None] | None],
        receive: Any = None,
    ) -> None:
        """Send the head (``start``), each chunk (``write``: an awaitable only
        while the client's connection is paused for writing) and the end; the
        HTTP server calls it with its connection's writers."""
        watch = self.watch or DisconnectWatch(receive)
        relaying = False
        try:
            wait = start(self.status_code, self.raw_headers)
            if wait is not None:
                await wait
            relaying = True  # the relay runs now: its finally cleans up, whatever happens
            await self.relay(write)
            wait = end()
            if wait is not None:
                await wait
        except asyncio.CancelledError:
            if not watch.uncancel():
                raise
        except OSError:  # the client's connection broke mid-write
            pass
        finally:
            watch.close()
            if not relaying:
                await self.abandon()


class DisconnectWatch:
    """Cancels the task that made it when the client disconnects. The HTTP
    server calls it back from the connection's loss (no task); an ASGI
    request gets one watcher task (``asyncio.wait`` on two tasks, or
    Starlette's task group, cost several times as much). Made after the body
    was read (under ASGI it takes over ``receive``); closed before the
    answer's last byte is sent (after it, ``receive`` reports a disconnect).
    ``request``: a request (``watch_disconnect``) or an ASGI ``receive``."""

    __slots__ = ("_closed", "_owner", "_task", "gone")

    def __init__(self, request: Any) -> None:
        self.gone = False
        self._closed = False
        self._owner: asyncio.Task[Any] | None = current_task()
        self._task: asyncio.Future[None] | None = None
        watch = getattr(request, "watch_disconnect", None)
        if watch is not None and watch(self._lost):
            return
        receive = getattr(request, "receive", request)
        self._task = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._lost()

    def _lost(self) -> None:
        if self._closed or self.gone:
            return
        self.gone = True
        if self._owner is not None:
            self._owner.cancel()

    def uncancel(self) -> bool:
        """In the owner's ``except CancelledError``: True (and the cancellation
        taken back) when the client's disconnect caused it."""
        if self.gone and self._owner is not None:
            self._owner.uncancel()
            return True
        return False

    def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
