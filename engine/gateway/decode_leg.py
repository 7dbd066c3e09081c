"""The decode leg of the two-leg P/D protocol (docs/gateway.md).

The client's body plus the ``kv_transfer_params`` the prefill engine returned
(the client's raw bytes, unchanged, when there are none), as one JSON answer
(:meth:`DecodeLeg.json`) or a stream handed to the relay
(:meth:`DecodeLeg.stream`). Around the call:

* failover: a decode engine that refuses the connection, or is ejected for a
  stall before it sent anything, is replaced by the next compatible one
  (same compat hash, so the producer's KV stays usable; ``--retries``), and
  when there is none the leg holds once (``--hold-timeout``) for one to
  become routable again (:meth:`DecodeLeg.next_engine`);
* refused params: an engine that refuses the producer's ``kv_transfer_params``
  (an expired lease, a restarted producer) gets the leg again without them;
* the KV-pair breaker hears of every failed hand-off over a (prefill, decode)
  pair;
* a stopping engine (its 503 says so) is left for the next one at once;
* a migratable request whose leg fails after it started moves to another
  decode engine (``migration.py``, ``--max-migrations``);
* a 4xx (also 408/429) is the client's answer; a 5xx or a transport failure
  an error in OpenAI's shape with no engine detail.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from .. import tracing
from ..contracts import kv_params
from ..contracts.errors import ErrorBody
from ..contracts.migration import MIGRATE_HEADER
from ..http.upstream import UpstreamError, UpstreamResponse
from .answers import upstream_message
from .call import Call
from .engines import EngineState
from .legs import LegFailed, Legs
from .migration import Migrator
from .prompt import PromptInfo
from .relay import Opened, RelayResponse, Resend, relay
from .routing import Route

logger = logging.getLogger("pdfleet.gateway")


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    return {**body, kv_params.FIELD: kv_transfer_params}


@dataclass(slots=True)
class Failover:
    """What a decode leg needs to go to another engine: its route and prompt,
    the payload, the engines tried, and whether it has held once already."""

    route: Route
    info: PromptInfo
    payload: bytes
    tried: set[str]
    held: list[bool]


_STOPPING = MIGRATE_HEADER.encode()


def stopping(resp: UpstreamResponse) -> bool:
    """A stopping engine's 503 (a new leg refused, or a leg handed back)."""
    return resp.status_code == 503 and resp.header(_STOPPING) is not None


class DecodeLeg:
    def __init__(self, legs: Legs) -> None:
        self.legs = legs
        self.migrator = Migrator(legs)

    # -- a JSON answer ---------------------------------------------------------------

    async def json(self, call: Call, route: Route, info: PromptInfo, payload: bytes) -> Response:
        legs = self.legs
        e: EngineState | None = route.decode
        failover = Failover(route, info, payload, set(), [False])
        while e is not None:
            failover.tried.add(e.url)
            legs.acquire(e)
            try:
                with (
                    legs.watched(e, legs.config.request_timeout),
                    tracing.leg("decode", kv_transfer=call.prefill_url is not None),
                ):
                    resp = await legs.client.post(
                        e.url + call.endpoint, failover.payload, call.headers, None
                    )
            except (UpstreamError, TimeoutError) as ex:
                legs.release(e)
                failure = legs.failed(e, "decode", ex)
                logger.warning("request %s: %s", call.request_id, failure.detail)
                if call.migration is not None and failure.kind in ("stalled", "broken"):
                    legs.pair_failed(call, e)
                    moved = await self.migrator.move_unsent(
                        call, e, "stalled" if failure.kind == "stalled" else "died", route.decode
                    )
                    if moved is not None:
                        e, failover.payload = moved
                        legs.move_slot(call, e)
                        continue
                    return legs.error(call, failure.message, failure.status)
                if failure.kind in ("connect", "stalled"):
                    nxt = await self.next_engine(call, failover)
                    if nxt is not None:
                        legs.move_slot(call, nxt)
                        e = nxt
                        continue
                legs.pair_failed(call, e)
                return legs.error(call, failure.message, failure.status)
            except BaseException:
                legs.release(e)
                raise
            legs.release(e)
            legs.pool.progress(e)
            if resp.status_code == 503 and stopping(resp):
                # Handed back (or refused) by a stopping engine: nothing was sent.
                moved = (
                    await self.migrator.move_unsent(call, e, "drain", route.decode)
                    if call.migration is not None
                    else None
                )
                if moved is not None:
                    e, failover.payload = moved
                    legs.move_slot(call, e)
                    continue
                failover.tried.add(e.url)
                nxt = await self.next_engine(call, failover) if call.migration is None else None
                if nxt is not None:
                    legs.move_slot(call, nxt)
                    e = nxt
                    continue
                return legs.leg_error(call, legs.status_error(e, "decode", resp))
            if resp.status_code == 400 and self._params_refused(call, resp):
                failover.payload = self._without_params(call, e, resp)
                failover.tried.discard(e.url)
                continue
            if resp.status_code < 500:  # incl. 429: the client should back off, not us
                if resp.status_code == 200 and (info.block_hashes or call.info is not None):
                    legs.record(call, info, e.url)  # (only then has it blocks to record)
                return legs.passthrough(call, resp, resp.content)
            legs.pair_failed(call, e)
            return legs.leg_error(call, legs.status_error(e, "decode", resp))
        raise AssertionError("unreachable: the loop starts with the routed engine")

    # -- a stream --------------------------------------------------------------------

    async def stream(self, call: Call, route: Route, info: PromptInfo, payload: bytes) -> Response:
        """Open the decode stream; answer as soon as the engine accepts it.

        Headers go out while the engine computes the first token (as the
        engine's own do), so the gateway's response setup is off the TTFT
        path. Failures before the engine accepts (refused connection or a
        stall: next engine; 4xx/5xx: that status) are plain HTTP errors;
        later ones, including a first-token timeout, are SSE error events.
        """
        legs = self.legs
        e: EngineState | None = route.decode
        failover = Failover(route, info, payload, set(), [False])
        while e is not None:
            failover.tried.add(e.url)
            try:
                opened = await self._open(call, e, failover.payload)
                if opened == "params_refused":
                    if call.plain_payload is None:
                        raise RuntimeError("broken invariant: call.plain_payload is not None")
                    failover.payload = call.plain_payload
                    failover.tried.discard(e.url)
                    continue
            except LegFailed as failure:
                logger.warning("request %s: %s", call.request_id, failure.detail)
                if call.migration is not None and failure.kind == "broken":
                    # The engine went away before it answered: a migratable
                    # request goes again whole to another engine.
                    legs.pair_failed(call, e)
                    moved = await self.migrator.move_unsent(call, e, "died", route.decode)
                    if moved is not None:
                        e, failover.payload = moved
                        legs.move_slot(call, e)
                        continue
                    return legs.error(call, failure.message, failure.status)
                if failure.kind in ("connect", "stalled", "stopping"):
                    nxt = await self.next_engine(call, failover)
                    if nxt is not None:
                        legs.move_slot(call, nxt)
                        e = nxt
                        continue
                legs.pair_failed(call, e)
                return legs.error(call, failure.message, failure.status)
            if isinstance(opened, Response):
                return opened
            # Not relayed, so never None; "params_refused" was handled above.
            if not isinstance(opened, tuple):
                raise TypeError("broken invariant: isinstance(opened, tuple)")
            if info.block_hashes or call.info is not None:
                legs.record(call, info, e.url)  # (only then has it blocks to record)
            resp, chunks = opened
            recovery = (
                self.migrator.recovery(call, e, self._open_resumed)
                if call.migration is not None
                else Resend(legs, call, functools.partial(self._resend, call, failover))
            )
            return RelayResponse(
                functools.partial(relay, legs, call, e, resp, chunks, recovery),
                functools.partial(self._abandon, call, e, resp),
                call.request_id,
            )
        raise AssertionError("unreachable: the loop starts with the routed engine")

    async def _abandon(self, call: Call, e: EngineState, resp: UpstreamResponse) -> None:
        """What a relay that never started would have released (the client left
        before its headers went out)."""
        await resp.aclose()
        self.legs.release(e)
        self.legs.finish(call, 499)

    async def _open(
        self, call: Call, e: EngineState, payload: bytes, relayed: bool = False
    ) -> tuple[UpstreamResponse, AsyncIterator[bytes]] | Response | str | None:
        """(accepted response, its chunk iterator), holding ``e`` (the relay
        releases it); a Response for an HTTP error (None when ``relayed``: the
        client's headers are gone, so the relay reports it as an event);
        ``"params_refused"`` when the engine refused the producer's params."""
        legs = self.legs
        bound = legs.first_token_bound(e)
        legs.acquire(e)
        resp: UpstreamResponse | None = None
        handed = False
        try:
            with (
                legs.watched(e, bound),
                tracing.leg("decode", kv_transfer=call.prefill_url is not None),
            ):
                resp = await legs.client.stream(e.url + call.endpoint, payload, call.headers)
                legs.pool.progress(e)
                if resp.status_code != 200:
                    content = await resp.aread()
                    if stopping(resp):
                        raise LegFailed(
                            "the decode engine is stopping",
                            503,
                            "stopping",
                            f"decode engine {e.url} is stopping",
                        )
                    if relayed:
                        logger.warning(
                            "request %s: resent decode leg answered %d: %s",
                            call.request_id,
                            resp.status_code,
                            upstream_message(resp),
                        )
                        return None
                    if not relayed and self._params_refused(call, resp):
                        self._without_params(call, e, resp)
                        return "params_refused"
                    if resp.status_code < 500:
                        return legs.passthrough(call, resp, content)
                    legs.pair_failed(call, e)
                    return legs.leg_error(call, legs.status_error(e, "decode", resp))
            handed = True  # the relay closes the response and releases the engine
            return resp, resp.aiter_raw()
        except (UpstreamError, TimeoutError) as ex:
            raise legs.failed(e, "decode", ex) from None
        finally:
            if not handed:
                if resp is not None:
                    await resp.aclose()
                legs.release(e)

    async def _open_resumed(
        self, call: Call, e: EngineState, payload: bytes
    ) -> tuple[UpstreamResponse, AsyncIterator[bytes]] | None:
        """A migrated leg opened on ``e`` (the migrating relay's opener)."""
        opened = await self._open(call, e, payload, relayed=True)
        if not (opened is None or isinstance(opened, tuple)):  # relayed: no Response
            raise TypeError("broken invariant: a relayed leg opens to a stream or nothing")
        return opened

    async def _resend(self, call: Call, failover: Failover, stalled: EngineState) -> Opened | None:
        """The relay's ``resend``: the decode leg on another engine after
        ``stalled`` (ejected before its first event, counted by the relay);
        None when none took it."""
        logger.warning(
            "request %s: decode engine %s stalled before its first event; resending",
            call.request_id,
            stalled.url,
        )
        while True:
            nxt = await self.next_engine(call, failover)
            if nxt is None:
                return None
            failover.tried.add(nxt.url)
            try:
                opened = await self._open(call, nxt, failover.payload, relayed=True)
            except LegFailed as failure:
                logger.warning("request %s: %s", call.request_id, failure.detail)
                continue
            if opened is None:
                return None
            # A relayed leg answers a tuple or None, never a Response or a marker.
            if not isinstance(opened, tuple):
                raise TypeError("broken invariant: isinstance(opened, tuple)")
            return (nxt, *opened)

    # -- failover --------------------------------------------------------------------

    async def next_engine(self, call: Call, failover: Failover) -> EngineState | None:
        """Another decode engine after a refused connection or a stall (same
        compat hash, so a producer's KV stays usable); when there is none,
        hold once (--hold-timeout) for one to become routable again."""
        legs = self.legs
        config = legs.config
        want = failover.route.decode.load.compat_hash

        def candidates(exclude: set[str]) -> list[EngineState]:
            return [
                e
                for e in legs.pool.candidates("decode")
                if e.url not in exclude and e.load.compat_hash == want
            ]

        found = candidates(failover.tried) if len(failover.tried) <= config.retries else []
        if not found and not failover.held[0]:
            failover.held[0] = True  # a restarted engine comes back under its own URL
            legs.metrics.held.inc()
            try:
                deadline = time.monotonic() + config.hold_timeout
                while not found and await legs.pool.wait_routable("decode", deadline):
                    found = candidates(set())
                    if not found:
                        await asyncio.sleep(config.scrape_interval)
            finally:
                legs.metrics.held.dec()
        info = legs.analyzed(call, failover.info)
        picked = legs.router.pick(found, info.block_hashes, info.exact_hashes)
        if picked is None:
            return None
        legs.metrics.retries.labels("decode").inc()
        return picked[0]

    # -- refused params ----------------------------------------------------------------

    def _params_refused(self, call: Call, resp: UpstreamResponse) -> bool:
        """The decode engine refused the producer's kv_transfer_params (a 400
        naming them: expired lease, restarted producer); worth a decode-only leg."""
        if resp.status_code != 400 or call.plain_payload is None or call.prefill_url is None:
            return False
        error = ErrorBody.decode(resp.content, resp.status_code)
        return error is not None and error.param == kv_params.FIELD

    def _without_params(self, call: Call, e: EngineState, resp: UpstreamResponse) -> bytes:
        """Mutates: the call goes on decode-only (the engine computes the prompt)."""
        legs = self.legs
        logger.warning(
            "request %s: decode engine %s refused the producer's params (%s); decode-only",
            call.request_id,
            e.url,
            upstream_message(resp),
        )
        legs.metrics.fallbacks.labels("kv_params_refused").inc()
        tracing.fallback("kv_params_refused")
        legs.pair_failed(call, e)
        call.prefill_url = None  # refused once: the plain leg is final
        if call.plain_payload is None:  # _params_refused checked it
            raise RuntimeError("broken invariant: call.plain_payload is not None")
        return call.plain_payload
