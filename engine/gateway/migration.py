"""Request migration: a decode leg that fails mid-answer resumes on another
decode engine, and the client sees one answer (docs/migration.md).

A request is migratable when it asks for one sequence (``n`` 1, one prompt)
and ``--max-migrations`` is above 0. Its decode legs carry the internal field
``migration`` (``contracts/migration.py``): the engine then names, in an SSE
comment on each event, the output token ids that event sends, and a stopping
engine ends the stream with ``: migrate`` instead of cutting it.

The migrating relay (:func:`Migrator.relay`) forwards a stream event by event
(the comments taken off, the bytes of the events otherwise unchanged) and
keeps the token ids the client has received. When the leg fails before its
``data: [DONE]`` (the engine died: connection refused, reset, or the stream
ended early; it stalled and the watchdog ejected it; it drained), the
request goes to another decode engine of the same compatibility hash as the
original body plus ``migration.output_token_ids``: the prompt is rendered as
before and the sent tokens follow it as token ids (no re-tokenized text), so
the new engine recomputes them or finds them in its prefix cache, then
continues with the same sampling state (a seeded request's draw is a
function of its seed and the output position; max_tokens, stop strings,
penalties and grammars count the sent tokens). It sends none of them again,
keeps the first engine's ``id`` and ``created``, and its ``usage`` counts
every token the client got. A non-streamed request has sent nothing: it is
sent again whole.

Bounds: at most ``--max-migrations`` moves per request, then an error event
(a 502 for a non-streamed request); each wait is the one the first leg had
(the first-token bound for the resumed leg's first event, the idle timeout
between events), and the wait for another engine when none is routable is
``--hold-timeout``. A plain timeout (an engine that is slow, not stalled) is
not migrated: the fleet would only do the work twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from .. import tracing
from ..contracts.migration import FIELD, IDS_PREFIX, MIGRATE_EVENT, MIGRATE_HEADER, parse_ids
from ..http.upstream import UpstreamError, UpstreamResponse
from .answers import DONE, sse_error
from .call import NOT_ANALYZED, Call
from .engines import EngineState
from .legs import LegFailed, Legs

logger = logging.getLogger("pdfleet.gateway")

_CREATED = re.compile(rb'"created":\s*(\d+)')
_MIGRATE = MIGRATE_EVENT[:-2]


@dataclass
class Migration:
    """A migratable request's state across its decode legs."""

    body: dict[str, Any]
    """The client's body (no kv_transfer_params): what every resumed leg sends."""
    sent: list[int] = field(default_factory=list)
    """Output token ids the client has received, in order."""
    created: int | None = None
    """The first leg's ``created`` (kept by the resumed legs)."""
    moves: int = 0
    failed: set[str] = field(default_factory=set)
    """Decode engines whose leg of this request failed."""

    def payload(self) -> bytes:
        """A resumed (decode-only) leg: the body plus the tokens already sent."""
        state: dict[str, Any] = {"output_token_ids": self.sent}
        if self.created is not None:
            state["created"] = self.created
        return json.dumps({**self.body, FIELD: state}, separators=(",", ":")).encode()


def migratable(body: dict[str, Any], chat: bool, max_migrations: int) -> bool:
    """Whether a request can move between decode engines: one sequence of
    one prompt (the sent tokens of several would not be told apart)."""
    if max_migrations <= 0 or body.get("n") not in (None, 1):
        return False
    if body.get("best_of") not in (None, 1):
        return False
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return len(prompt) == 1
    return True


def with_state(payload: bytes, body: dict[str, Any]) -> bytes:
    """``payload`` (``body``'s JSON bytes) with an empty migration state: the
    first decode leg (the engine annotates its stream for migration). UTF-8
    bytes are spliced (no second serialization); others are encoded again."""
    text = payload.lstrip()
    if text[:1] != b"{":  # UTF-16/32 JSON, which the body parser also takes
        return json.dumps(add_state(body)).encode()
    rest = text[1:].lstrip()
    sep = b"" if rest.startswith(b"}") else b","
    return b'{"' + FIELD.encode() + b'":{}' + sep + rest


def add_state(body: dict[str, Any]) -> dict[str, Any]:
    """A decode leg's body with an empty migration state."""
    return {**body, FIELD: {}}


def split_events(block: bytes, sent: list[int]) -> tuple[bytes, bool]:
    """Whole SSE events as they go to the client: the ``: ids`` comments taken
    off (their ids appended to ``sent``); True when the block ends with the
    engine's ``: migrate``."""
    if IDS_PREFIX not in block and _MIGRATE not in block:
        return block, False
    if block.startswith(IDS_PREFIX) and block.find(b"\n\n") == len(block) - 2:
        # One event (the usual block: an engine writes each event as it comes).
        line_end = block.find(b"\n")
        sent.extend(map(int, block[len(IDS_PREFIX) : line_end].split()))
        return block[line_end + 1 :] if line_end < len(block) - 2 else b"", False
    out: list[bytes] = []
    handed_back = False
    for event in block.split(b"\n\n")[:-1]:
        if event.startswith(IDS_PREFIX):
            line, _, event = event.partition(b"\n")
            sent.extend(parse_ids(line))
        if event == _MIGRATE:
            handed_back = True
            continue
        if event:
            out.append(event + b"\n\n")
    return b"".join(out), handed_back


class Migrator:
    """Moves failed decode legs to other decode engines (``--max-migrations``)."""

    def __init__(self, legs: Legs) -> None:
        self.legs = legs
        self.max_migrations = legs.config.max_migrations
        self._resume = legs.metrics.fast_histogram(legs.metrics.migration_resume)

    # -- choosing the next engine -------------------------------------------------

    async def next_engine(
        self, call: Call, state: Migration, want: str | None
    ) -> EngineState | None:
        """A routable decode engine of compat hash ``want`` whose leg of this request
        did not fail; while there is none, up to --hold-timeout for one (a
        restarted engine comes back under its old URL: then it is taken too)."""
        legs = self.legs

        def candidates(exclude: set[str]) -> list[EngineState]:
            return [
                e
                for e in legs.pool.candidates("decode")
                if e.url not in exclude and (want is None or e.load.compat_hash == want)
            ]

        found = candidates(state.failed)
        if not found:
            legs.metrics.held.inc()
            try:
                deadline = time.monotonic() + legs.config.hold_timeout
                while not found:
                    if not await legs.pool.wait_routable("decode", deadline):
                        break
                    found = candidates(state.failed) or candidates(set())
                    if not found:
                        if time.monotonic() >= deadline:
                            break
                        await asyncio.sleep(legs.config.scrape_interval)
            finally:
                legs.metrics.held.dec()
        if not found:
            return None
        info = legs.analyzed(call, call.info or NOT_ANALYZED)
        picked = legs.router.pick(found, info.block_hashes, info.exact_hashes)
        return picked[0] if picked is not None else None

    def _moved(self, state: Migration, reason: str) -> bool:
        """Count a move; False when the request has used its last one."""
        m = self.legs.metrics
        if state.moves >= self.max_migrations:
            m.migrations.labels("exhausted").inc()
            return False
        state.moves += 1
        m.migrations.labels(reason).inc()
        if state.sent:
            m.migration_replayed.inc(len(state.sent))
        return True

    # -- a leg that sent the client nothing ---------------------------------------

    def handed_back(self, resp: UpstreamResponse) -> bool:
        """A non-streamed leg a stopping engine handed back (503 + the header)."""
        return resp.status_code == 503 and resp.header(MIGRATE_HEADER.encode()) is not None

    async def move_unsent(
        self, call: Call, e: EngineState, reason: str, want: str | None
    ) -> tuple[EngineState, bytes] | None:
        """The next engine for a leg that failed on ``e`` before the client got
        any of it (a non-streamed leg; a stream before its headers): the leg
        goes again whole, decode-only. With its payload; None when it may not
        move (the cap, no engine)."""
        state = call.migration
        if state is None:
            return None
        state.failed.add(e.url)
        if not self._moved(state, reason):
            return None
        started = time.perf_counter()
        nxt = await self.next_engine(call, state, want)
        if nxt is None:
            return None
        logger.warning(
            "request %s: decode leg on %s failed (%s); sent again to %s",
            call.request_id,
            e.url,
            reason,
            nxt.url,
        )
        tracing.migrated(reason, e.url, nxt.url, 0, started)
        return nxt, state.payload()

    # -- a stream -------------------------------------------------------------------

    async def relay(  # noqa: C901 (one loop over the legs' events: strip, forward, end or move)
        self,
        call: Call,
        engine: EngineState,
        resp: UpstreamResponse,
        chunks: AsyncIterator[bytes],
        opener: Any,
    ) -> AsyncGenerator[bytes, None]:
        """Relay a migratable stream, moving it when its leg fails (see the module).

        ``opener(call, engine, payload)``: a decode leg opened on ``engine``
        (``DecodeLeg._open`` with ``relayed=True``), holding it: (response,
        chunks), None for an HTTP error, LegFailed for a transport failure.
        The relay holds ``engine`` (its in-flight count) and ``resp`` until
        the leg ends, and finishes the call."""
        legs = self.legs
        state = call.migration
        if state is None:
            raise RuntimeError("broken invariant: a migrating relay on a call that cannot move")
        want = engine.load.compat_hash
        status = 200
        first_client_event = True
        limit = legs.config.max_body_bytes
        idle = legs.config.idle_timeout
        pool = legs.pool
        failed_at: float | None = None  # perf_counter of the failure being resumed
        moved_from, reason_of_move, replayed = "", "", 0
        holding = True  # the relay holds ``engine`` and ``resp``
        try:
            while True:  # one leg per turn
                got = False  # this leg sent an event
                capable = False  # its first event named token ids (see contracts)
                done = handed_back = False
                reason = "died"
                buf = b""
                error: LegFailed | None = None
                try:
                    while True:
                        bound = idle if got else legs.first_token_bound(engine)
                        if resp.buffered():
                            data = await anext(chunks)
                        else:
                            with legs.watched(engine, bound):
                                data = await anext(chunks)
                        pool.progress(engine)
                        buf += data
                        if len(buf) > limit:
                            raise UpstreamError(f"an event of over {limit} bytes")
                        cut = buf.rfind(b"\n\n")
                        if cut < 0:
                            continue
                        block, buf = buf[: cut + 2], buf[cut + 2 :]
                        if not got:
                            capable = block.startswith(IDS_PREFIX)
                        out, handed_back = split_events(block, state.sent)
                        got = True
                        if failed_at is not None:
                            took = time.perf_counter() - failed_at
                            self._resume.observe(took)
                            logger.info(
                                "request %s: resumed on %s in %.3fs (%d tokens replayed)",
                                call.request_id,
                                engine.url,
                                took,
                                replayed,
                            )
                            tracing.migrated(
                                reason_of_move, moved_from, engine.url, replayed, failed_at
                            )
                            failed_at = None
                        if out:
                            if state.created is None:
                                found = _CREATED.search(out)
                                if found is not None:
                                    state.created = int(found.group(1))
                            if first_client_event:
                                first_client_event = False
                                legs.first_token(call)
                            done = out.endswith(DONE)
                            yield out
                        if done or handed_back:
                            break
                except StopAsyncIteration:
                    pass
                except (UpstreamError, TimeoutError) as ex:
                    error = legs.failed(engine, "decode", ex)
                    reason = "stalled" if error.kind == "stalled" else "died"
                if done:
                    return
                if handed_back:
                    reason = "drain"
                elif error is None:
                    # Ended without [DONE]: the engine went away mid-stream.
                    legs.metrics.upstream_errors.labels(engine.url, engine.role, "broken").inc()
                    reason = "died"
                failure_message = (
                    error.message
                    if error is not None
                    else "the decode engine ended the stream early"
                )
                if reason != "drain":
                    legs.pair_failed(call, engine)
                if got and not capable:
                    # The engine does not name the tokens it sends (not a
                    # pdfleet engine): no exact resume; the stream ends here.
                    status = 502 if error is None else error.status
                    yield sse_error(failure_message, status)
                    return
                if error is not None and error.kind == "timeout":
                    # Slow, not stalled: moving it would only do the work twice.
                    status = error.status
                    yield sse_error(
                        f"the decode engine sent nothing for {idle:g}s"
                        if got or not first_client_event
                        else "the decode engine sent no first token in time",
                        status,
                    )
                    return
                # Move the leg: this engine's stream ends here.
                failed_at = time.perf_counter()
                moved_from = engine.url
                reason_of_move = reason
                replayed = len(state.sent)
                holding = False
                await resp.aclose()
                legs.release(engine)
                state.failed.add(engine.url)
                opened = await self._reopen(call, state, engine, reason, want, opener)
                if opened is None:
                    status = 502
                    capped = state.moves >= self.max_migrations
                    yield sse_error(
                        f"{failure_message}; the request was moved {state.moves} times "
                        "(the most --max-migrations allows)"
                        if capped
                        else f"{failure_message}, and no other decode engine could take it",
                        status,
                    )
                    return
                engine, resp, chunks = opened
                holding = True
                legs.move_slot(call, engine)
        except (UpstreamError, TimeoutError) as ex:  # pragma: no cover (handled per leg)
            status = 502
            yield sse_error(f"the decode engine failed: {ex}", status)
        finally:
            if holding:
                await resp.aclose()
                legs.release(engine)
            legs.finish(call, status)

    async def _reopen(
        self,
        call: Call,
        state: Migration,
        failed: EngineState,
        reason: str,
        want: str | None,
        opener: Any,
    ) -> tuple[EngineState, UpstreamResponse, AsyncIterator[bytes]] | None:
        """The resumed leg on another engine: (engine, response, chunks), or None
        (the cap reached, no engine took it within the bounds)."""
        while True:
            if not self._moved(state, reason):
                return None
            nxt = await self.next_engine(call, state, want)
            if nxt is None:
                return None
            logger.warning(
                "request %s: decode leg on %s failed (%s) after %d tokens; resuming on %s",
                call.request_id,
                failed.url,
                reason,
                len(state.sent),
                nxt.url,
            )
            try:
                opened = await opener(call, nxt, state.payload())
            except LegFailed as failure:
                logger.warning("request %s: %s", call.request_id, failure.detail)
                state.failed.add(nxt.url)
                failed, reason = nxt, "refused"
                continue
            if opened is None:  # an HTTP error (a draining engine's 503, a refusal)
                state.failed.add(nxt.url)
                failed, reason = nxt, "refused"
                continue
            resp, chunks = opened
            return nxt, resp, chunks
