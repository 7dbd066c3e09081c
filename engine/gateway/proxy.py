"""The two-leg P/D protocol (docs/gateway.md): ``handle`` → ``route`` → legs.

1. **handle**: the body is read (``engine/http/limits.py``) and checked:
   valid JSON (UTF-8, no lone surrogate, not nested past the parser's depth),
   admissible sampling fields (the same check the engines run, so prefill and
   decode never disagree), and the client's own ``kv_transfer_params`` are
   dropped: only what a prefill leg returned goes to a decode engine.
2. **route**: the router picks a decode engine with a free slot and, when
   the prompt is worth it, a prefill engine (``routing.py``); while no decode
   engine is routable the request is held (``--hold-timeout``) and activation
   is signalled; while every routable one is at capacity it waits for a slot
   (``--queue-timeout``) or is refused at once as overload (``admission.py``).
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

from .. import tracing
from ..config.gateway import GatewayConfig
from ..contracts.request_fields import CHAT, COMPLETIONS, check_fields
from ..contracts.sampling_checks import check_sampling
from ..contracts.security import CALLER_HEADER, bearer_token, caller_id
from ..http.asgi import Request
from ..http.limits import BodyRejected, read_body, ready_body
from ..http.upstream import UpstreamClient
from .activation import Activation
from .admission import Admission, Overloaded
from .call import (
    NOT_ANALYZED,
    Call,
    client_request_id,
    field_of,
    parse_body,
    tame_request_id,
)
from .decode_leg import DecodeLeg, decode_body
from .engines import EnginePool
from .legs import Legs
from .metrics import GatewayMetrics
from .migration import Migration, add_state, migratable, with_state
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
        self.admission = Admission(config, metrics)
        self.legs = Legs(
            config, pool, router, affinity, analyzer, metrics, client, breaker, self.admission
        )
        """What the legs and the relay share (engine bookkeeping, failures, answers)."""
        self.prefill = PrefillLeg(self.legs)
        self.decode = DecodeLeg(self.legs)
        self._decisions: dict[tuple[str, str], Any] = {}
        """The routing-decision counter per (decision, reason)."""

    # -- handle ------------------------------------------------------------------

    async def handle(self, request: Request, endpoint: str, raw: bytes | None = None) -> Response:
        """Answer one completions/chat request; a client that goes away cancels it
        (closing the upstream connections, which aborts the engine requests).
        ``raw``: the body, when the caller read it already (``/invocations``)."""
        call = Call(
            endpoint,
            client_request_id(request.headers.get("x-request-id")),
            time.perf_counter(),
            {},
            endpoint.endswith("/chat/completions"),
        )
        call.headers["x-request-id"] = call.request_id
        # Without an X-Request-Id of the client's, a body's request_id names the
        # response (the engines answer PREFIX-<request_id>, as vLLM does).
        call.id_from_body = not request.headers.get("x-request-id")
        # Engines count per-caller bounds against the client, not the gateway.
        call.headers[CALLER_HEADER] = request_caller(request, bool(self.config.api_key))
        try:  # read before the watcher below takes over receive()
            if raw is None:
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
                if call.slot is not None or call.prefill_slot is not None:
                    self.legs.free_slot(call)  # an answer that did not go through finish

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
        if "migration" in body:
            self.metrics.rejected.labels("invalid_field").inc()
            return self.legs.error(
                call,
                "migration: an internal field of pdfleet's decode legs; clients may not send it",
                403,
                "migration",
            )
        call.body = body
        given = body.get("request_id")
        if call.id_from_body and isinstance(given, str) and tame_request_id(given):
            call.request_id = call.headers["x-request-id"] = given
        names = self.config.served_model_name
        if names and body.get("model") is not None and body["model"] not in names:
            self.metrics.rejected.labels("invalid_field").inc()
            return self.legs.error(
                call, f"The model `{body['model']}` does not exist.", 404, "model"
            )
        route = self._sole_route()
        try:
            # The engines' own admissibility checks: a body one engine would refuse
            # never reaches a prefill engine (no KV pinned for a doomed request).
            check_fields(body, CHAT if call.chat else COMPLETIONS)
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
        self.legs.take_slot(call, route.decode)
        if route.prefill is not None:
            self.legs.take_prefill_slot(call, route.prefill)
        key = (route.decision, route.reason)
        decided = self._decisions.get(key)
        if decided is None:  # a few (decision, reason) pairs: never dropped
            decided = self._decisions[key] = self.metrics.fast_counter(
                self.metrics.decisions.labels(*key)
            )
        decided.inc()
        tracing.route_chosen(route)
        if migratable(body, call.chat, self.config.max_migrations):
            # Its decode legs can move between engines (migration.py).
            call.migration = Migration(body)
            payload = with_state(payload, body)
        if route.prefill is not None:
            outcome = await self.prefill.run(call, body, route, info)
            if isinstance(outcome, Response):
                return outcome
            if outcome is not None:
                call.plain_payload = payload
                leg = decode_body(body, outcome)
                payload = json.dumps(add_state(leg) if call.migration else leg).encode()
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
        and one routable decode engine with a free slot and nobody waiting
        for one (no prefill leg, no choice to score). The prompt is then not
        analyzed (its block hashes feed only the choice among several
        engines); None: route as usual."""
        if self.config.disaggregation_mode != "Disabled":
            return None
        decode = self.pool.sole_candidate("decode")
        if decode is None or self.admission.queued or not self.admission.has_room(decode):
            return None
        self.router.count_pick()
        return Route(decode, None, "decode_only", "disabled")

    def _routed(self, info: PromptInfo) -> Route | None:
        """A route to engines with a free slot; None while every routable decode
        engine is at capacity, or the request should prefill and every prefill
        engine that could is. NoEngineError: no decode engine is routable."""
        candidates = self.pool.candidates("decode")
        full = self.admission.full(self.pool.engines.values())
        if full and candidates and all(e.url in full for e in candidates):
            return None
        route = self.router.route(info, full or None, full or None)
        if (
            full
            and route.reason == "no_prefill_engine"
            and any(p.url in full for p in self.pool.candidates("prefill"))
        ):
            return None  # a prefill engine could take it, once it has room
        return route

    async def _route(self, call: Call, info: PromptInfo) -> Route | Response:
        """The route. While no decode engine is routable (all down, restarting,
        or scaled to zero) the request is held up to --hold-timeout; while
        every routable one is at capacity (or requests wait ahead of it) it
        waits for a slot up to --queue-timeout, or is refused at once when it
        could not get one in time (``admission.py``)."""
        admission = self.admission
        queue_deadline: float | None = None
        hold_deadline: float | None = None
        woken = False
        while True:
            route: Route | Response | None = None
            if woken or not admission.queued:  # newcomers wait behind the queue
                try:
                    route = self._routed(info)
                except NoEngineError:
                    if hold_deadline is None:
                        hold_deadline = time.monotonic() + self.config.hold_timeout
                        self.activation.wanted("decode")
                    route = await self._hold(call, hold_deadline)
                    if route is None:
                        continue  # a decode engine is routable again: look for a slot
            if route is not None:
                return route
            if queue_deadline is None:
                try:
                    admission.check_queue()
                except Overloaded as o:
                    return self._overloaded(call, o)
                queue_deadline = time.monotonic() + self.config.queue_timeout
            if not await admission.wait(queue_deadline, first=woken):
                return self._overloaded(
                    call,
                    Overloaded(
                        503,
                        f"no engine could take the request within {self.config.queue_timeout:g}s "
                        "(the service is overloaded); retry later",
                        admission.retry_after(admission.queued),
                        "queue_timeout",
                    ),
                )
            woken = True

    def _overloaded(self, call: Call, o: Overloaded) -> Response:
        self.metrics.rejected.labels(o.reason).inc()
        logger.info("request %s: %s (%d)", call.request_id, o.message, o.status)
        return self.legs.error(
            call, o.message, o.status, headers={"retry-after": str(o.retry_after)}
        )

    async def _hold(self, call: Call, deadline: float) -> Response | None:
        """No decode engine is routable: wait until the monotonic ``deadline``
        (--hold-timeout after the request first found none) for one (None
        when one is), else the 503."""
        self.metrics.held.inc()
        try:
            if await self.pool.wait_routable("decode", deadline):
                return None
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
