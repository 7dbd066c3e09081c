"""The prefill leg of the two-leg P/D protocol (docs/gateway.md).

The client's body with ``max_tokens: 1`` (and ``max_completion_tokens: 1`` for
chat), ``stream: false``, without ``stream_options`` / ``min_tokens`` /
``min_completion_tokens``, and ``kv_transfer_params`` asking for a remote
decode — vLLM's names, so either project's engines can be driven. Its answer's
``kv_transfer_params`` go to the decode leg. A failed leg (a transport error,
a 5xx, a 408/429, a stall) is retried on another compatible prefill engine
(``--retries``; a stalled one always), then the request is served
decode-only; a 4xx (bad input) is the client's answer as is.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.responses import Response

from .. import tracing
from ..contracts import kv_params
from ..contracts.errors import ErrorBody
from ..contracts.kv_params import PRODUCE_FIELD, REMOTE_DECODE
from ..http.upstream import UpstreamError, UpstreamResponse
from .answers import upstream_message
from .call import Call
from .engines import EngineState
from .legs import LegFailed, Legs
from .prompt import PromptInfo
from .routing import Route

logger = logging.getLogger("pdfleet.gateway")

# Prefill-leg statuses that say "this engine, now" rather than "this input": the
# leg is worth another engine (a decode leg passes them to the client).
RETRYABLE_STATUS = frozenset({408, 429})


def prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    out = dict(body)
    out["max_tokens"] = 1
    if chat:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        out.pop(key, None)
    out[kv_params.FIELD] = REMOTE_DECODE.to_wire()
    return out


def pulling_prefill_body(body: dict[str, Any], chat: bool, lent: dict[str, Any]) -> dict[str, Any]:
    """A prefill leg that first pulls a peer's cached prefix: the peer's signed
    lend params, asked to end as a prefill leg (``pdfleet_produce``)."""
    out = prefill_body(body, chat)
    out[kv_params.FIELD] = {**lent, PRODUCE_FIELD: True}
    return out


class PrefillLeg:
    def __init__(self, legs: Legs) -> None:
        self.legs = legs

    async def run(
        self,
        call: Call,
        body: dict[str, Any],
        route: Route,
        info: PromptInfo,
        lent: dict[str, Any] | None = None,
    ) -> dict[str, Any] | Response | None:
        """The prefill leg with retries: the producer's kv_transfer_params; None
        to serve decode-only; a Response when the input itself was refused.
        ``lent``: a peer's lend params for the first engine, which pulls the
        cached prefix first (peer pulls); a retry, or an engine that refuses
        them, runs the plain leg."""
        try:
            return await self._run(call, body, route, info, lent)
        finally:
            self.legs.free_prefill_slot(call)  # the next request may prefill there

    async def _run(
        self,
        call: Call,
        body: dict[str, Any],
        route: Route,
        info: PromptInfo,
        lent: dict[str, Any] | None,
    ) -> dict[str, Any] | Response | None:
        legs = self.legs
        plain = json.dumps(prefill_body(body, call.chat)).encode()
        payload = plain
        if lent is not None:
            payload = json.dumps(pulling_prefill_body(body, call.chat, lent)).encode()
        engine: EngineState | None = route.prefill
        tried: set[str] = set()
        while engine is not None:
            tried.add(engine.url)
            try:
                result = await self._once(call, engine, payload, payload is not plain)
            except LegFailed as e:
                # The lease binds to the first engine that claims it: another engine
                # runs the plain leg.
                payload = plain
                logger.warning("request %s: %s", call.request_id, e.detail)
                if len(tried) > legs.config.retries and e.kind != "stalled":
                    break
                engine = legs.router.pick_prefill(route.decode, info, tried)
                if engine is not None:
                    legs.metrics.retries.labels("prefill").inc()
                    legs.move_slot(call, engine, prefill=True)
                continue
            if result is None:
                # The engine refused the peer's params (expired, not a KV consumer):
                # it runs the plain leg instead.
                legs.metrics.fallbacks.labels("kv_params_refused").inc()
                tracing.fallback("kv_params_refused")
                payload = plain
                continue
            if isinstance(result, Response):
                return result
            legs.record(call, info, engine.url)
            params = result.get(kv_params.FIELD)
            if not isinstance(params, dict) or not params:
                # A producer without a connector: the decode engine recomputes.
                legs.metrics.fallbacks.labels("no_kv_transfer_params").inc()
                tracing.fallback("no_kv_transfer_params")
                return None
            call.prefill_url = engine.url
            if legs.breaker is not None:
                legs.breaker.handed_off(engine.url, route.decode.url)
            return params
        legs.metrics.fallbacks.labels("prefill_failed").inc()
        tracing.fallback("prefill_failed")
        return None

    async def _once(
        self, call: Call, e: EngineState, payload: bytes, pulling: bool = False
    ) -> dict[str, Any] | Response | None:
        """One prefill call: its answer's JSON; a Response for a refused input;
        None when ``pulling`` and the engine refused the peer's params; LegFailed
        for anything another engine might do better."""
        legs = self.legs
        bound = legs.first_token_bound(e)
        legs.acquire(e)
        try:
            with legs.watched(e, bound), tracing.leg("prefill"):
                # None: ``watched`` bounds the call (one timer per leg, not two).
                resp = await legs.client.post(e.url + call.endpoint, payload, call.headers, None)
        except (UpstreamError, TimeoutError) as ex:
            raise legs.failed(e, "prefill", ex) from None
        finally:
            legs.release(e)
        legs.pool.progress(e)
        if resp.status_code == 200:
            try:
                data = resp.json()
            except ValueError:
                legs.metrics.upstream_errors.labels(e.url, e.role, "status").inc()
                raise LegFailed(
                    "the prefill engine sent an invalid answer",
                    502,
                    "status",
                    f"prefill engine {e.url} sent invalid JSON",
                ) from None
            return data if isinstance(data, dict) else {}
        if pulling and params_refused(resp):
            logger.warning(
                "request %s: prefill engine %s refused a peer's lend params (%s); plain leg",
                call.request_id,
                e.url,
                upstream_message(resp),
            )
            return None
        if 400 <= resp.status_code < 500 and resp.status_code not in RETRYABLE_STATUS:
            return legs.refused(call, resp)
        raise legs.status_error(e, "prefill", resp)


def params_refused(resp: UpstreamResponse) -> bool:
    """A 400 naming ``kv_transfer_params``: the engine refused the params, not the input."""
    if resp.status_code != 400:
        return False
    error = ErrorBody.decode(resp.content, resp.status_code)
    return error is not None and error.param == kv_params.FIELD
