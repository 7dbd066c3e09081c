"""The two-leg P/D protocol (docs/gateway.md): ``handle`` → ``route`` → legs.

1. **handle**: the body is read (``engine/http/limits.py``) and checked:
   valid JSON (UTF-8, no lone surrogate, not nested past the parser's depth),
   admissible sampling fields (the same check the engines run, so prefill and
   decode never disagree), and the client's own ``kv_transfer_params`` are
   dropped: only what a prefill leg returned goes to a decode engine.
2. **route**: the router picks a decode engine and, when the prompt is worth
   it, a prefill engine (``routing.py``); while no decode engine is routable
   the request is held (``--hold-timeout``) and activation is signalled.
3. **legs**: the prefill leg (``prefill_leg.py``: retries, then decode-only),
   then the decode leg (``decode_leg.py``: failover, hold, refused params, the
   KV-pair breaker), whose stream the relay (``relay.py``) forwards.

Engines get the fleet token, never the client's key. Both legs carry the
same ``X-Request-Id`` (the client's, or a new one), which the answer echoes.
Every wait is bounded: connect, first-token (the prefill leg; a stream's
first event; sized from the engine's queue), idle (between events), request
timeouts, and the hold while no decode engine is routable. Clients never see
engine URLs or engine bodies: errors are OpenAI's shape
(engine/contracts/errors.py) and the details are logged with the request id.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from starlette.responses import Response

from pdfleet.engine import tracing
from pdfleet.engine.config.gateway import GatewayConfig
from pdfleet.engine.config.sampling_checks import check_sampling
from pdfleet.engine.config.security import CALLER_HEADER, bearer_token, caller_id
from pdfleet.engine.http.asgi import Request
from pdfleet.engine.http.limits import BodyRejected, read_body, ready_body
from pdfleet.engine.http.upstream import UpstreamClient

from .activation import Activation
from .call import NOT_ANALYZED, Call, client_request_id, field_of, parse_body
from .decode_leg import DecodeLeg, decode_body
from .engines import EnginePool
from .legs import Legs
from .metrics import GatewayMetrics
from .prefill_leg import PrefillLeg
from .prompt import PromptAnalyzer, PromptInfo
from .relay import DisconnectWatch, RelayResponse
from .routing import KVPairBreaker, NoEngineError, PrefixAffinity, Route, Router

logger = logging.getLogger("pdfleet.gateway")

# Seconds a client is told to wait (Retry-After) when no decode engine came back.
RETRY_AFTER_SECONDS = 5


def request_caller(request: Request, keyed: bool) -> str:
    """Who the client is, as engines count per-caller bounds (``X-Pdfleet-Caller``):
    its API key's digest when the gateway checks keys (the key was verified),
    else its address (an unchecked key would let a client pose as many)."""
    token = bearer_token(request.headers.get("authorization")) if keyed else None
    if token is not None:
        return caller_id(token)
    client = getattr(request, "client", None)
    return caller_id(None, client[0] if client else None)


class Proxy:
    def __init__(
        self,
        config: GatewayConfig,
        pool: EnginePool,
        router: Router,
        affinity: PrefixAffinity,
        analyzer: PromptAnalyzer,
        metrics: GatewayMetrics,
        client: UpstreamClient,
        breaker: KVPairBreaker | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.router = router
        self.analyzer = analyzer
        self.metrics = metrics
        self.activation = Activation(metrics.activations)
        self.legs = Legs(config, pool, router, affinity, analyzer, metrics, client, breaker)
        """What the legs and the relay share (engine bookkeeping, failures, answers)."""
        self.prefill = PrefillLeg(self.legs)
        self.decode = DecodeLeg(self.legs)
        self._decisions: dict[tuple[str, str], Any] = {}
        """The routing-decision counter per (decision, reason)."""

    # -- handle ------------------------------------------------------------------

    async def handle(self, request: Request, endpoint: str) -> Response:
        """Answer one completions/chat request; a client that goes away cancels it
        (closing the upstream connections, which aborts the engine requests)."""
        call = Call(
            endpoint,
            client_request_id(request.headers.get("x-request-id")),
            time.perf_counter(),
            {},
            endpoint.endswith("/chat/completions"),
        )
        call.headers["x-request-id"] = call.request_id
        # Engines count per-caller bounds against the client, not the gateway.
        call.headers[CALLER_HEADER] = request_caller(request, bool(self.config.api_key))
        try:  # read before the watcher below takes over receive()
            raw = ready_body(request, self.config.max_body_bytes)
            if raw is None:
                raw = await read_body(request, self.config.max_body_bytes, self.config.body_timeout)
        except BodyRejected as e:
            reason = {413: "body_too_large", 408: "body_timeout"}.get(e.status, "invalid_body")
            self.metrics.rejected.labels(reason).inc()
            # The rest of the body is never read: the connection cannot be reused.
            return self.legs.error(call, e.message, e.status, headers={"connection": "close"})
        # One watcher per request: a client that goes away cancels this task
        # (and so the legs); the answer of a request that finished is sent as is.
        watch = DisconnectWatch(request)
        handed = False
        try:
            response = await self._handle(call, raw)
            if isinstance(response, RelayResponse):
                response.watch, handed = watch, True  # the stream goes on watching
            return response
        except asyncio.CancelledError:
            if not watch.uncancel():
                raise  # the server's cancellation (shutdown), not the client's
            self.legs.finish(call, 499)
            return Response(status_code=499)
        finally:
            if not handed:
                watch.close()

    def _invalid(self, call: Call, reason: str, message: str, param: str | None = None) -> Response:
        self.metrics.rejected.labels(reason).inc()
        return self.legs.error(call, message, 400, param)

    async def _handle(self, call: Call, raw: bytes) -> Response:
        """Check the body, route it, run the legs."""
        try:
            body = parse_body(raw)
        except ValueError as e:
            return self._invalid(call, "invalid_json", str(e))
        payload = raw
        if "kv_transfer_params" in body:
            # An internal protocol: only a prefill leg's answer may set it.
            del body["kv_transfer_params"]
            payload = json.dumps(body).encode()
        call.body = body
        names = self.config.served_model_name
        if names and body.get("model") is not None and body["model"] not in names:
            self.metrics.rejected.labels("invalid_field").inc()
            return self.legs.error(
                call, f"The model `{body['model']}` does not exist.", 404, "model"
            )
        route = self._sole_route()
        try:
            # The engines' own admissibility check: a body one engine would refuse
            # never reaches a prefill engine (no KV pinned for a doomed request).
            check_sampling(
                body,
                max_n=self.config.max_n,
                max_output_tokens=self.config.max_request_output_tokens,
            )
            info = (
                NOT_ANALYZED
                if route is not None
                else self.analyzer.analyze(body, call.chat, self.pool.block_size)
            )
        except (ValueError, TypeError, AttributeError) as e:
            return self._invalid(call, "invalid_field", str(e), field_of(str(e), body))
        if route is None:
            routed = await self._route(call, info)
            if isinstance(routed, Response):
                return routed
            route = routed
        key = (route.decision, route.reason)
        decided = self._decisions.get(key)
        if decided is None:  # a few (decision, reason) pairs: never dropped
            decided = self._decisions[key] = self.metrics.fast_counter(
                self.metrics.decisions.labels(*key)
            )
        decided.inc()
        tracing.route_chosen(route)
        if route.prefill is not None:
            outcome = await self.prefill.run(call, body, route, info)
            if isinstance(outcome, Response):
                return outcome
            if outcome is not None:
                call.plain_payload = payload
                payload = json.dumps(decode_body(body, outcome)).encode()
        elif route.reason in ("no_prefill_engine", "kv_pair_open"):
            if route.reason == "no_prefill_engine":
                self.activation.wanted("prefill")
            self.metrics.fallbacks.labels(route.reason).inc()
            tracing.fallback(route.reason)
        if body.get("stream") is True:
            return await self.decode.stream(call, route, info, payload)
        return await self.decode.json(call, route, info, payload)

    # -- route -------------------------------------------------------------------

    def _sole_route(self) -> Route | None:
        """The route when it cannot depend on the prompt: ``Disabled`` mode
        and one routable decode engine (no prefill leg, no choice to score).
        The prompt is then not analyzed (its block hashes feed only the
        choice among several engines); None: route as usual."""
        if self.config.disaggregation_mode != "Disabled":
            return None
        decode = self.pool.sole_candidate("decode")
        if decode is None:
            return None
        self.router.count_pick()
        return Route(decode, None, "decode_only", "disabled")

    async def _route(self, call: Call, info: PromptInfo) -> Route | Response:
        """The route, holding the request up to --hold-timeout while no decode
        engine is routable (all down, restarting, or scaled to zero)."""
        try:
            return self.router.route(info)
        except NoEngineError:
            pass
        deadline = time.monotonic() + self.config.hold_timeout
        self.activation.wanted("decode")
        self.metrics.held.inc()
        try:
            while await self.pool.wait_routable("decode", deadline):
                try:
                    return self.router.route(info)
                except NoEngineError:
                    continue
        finally:
            self.metrics.held.dec()
        logger.warning(
            "request %s: no decode engine routable within %.1fs",
            call.request_id,
            self.config.hold_timeout,
        )
        return self.legs.error(
            call,
            "no decode engine is available; retry later",
            503,
            headers={"retry-after": str(RETRY_AFTER_SECONDS)},
        )
