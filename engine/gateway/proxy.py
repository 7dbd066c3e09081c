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
import re
import time
from typing import Any

from starlette.responses import Response

from .. import tracing
from ..config.gateway import GatewayConfig
from ..contracts import metrics as m
from ..contracts.kv_params import FIELD as KV_PARAMS
from ..contracts.request_fields import CHAT, COMPLETIONS, check_fields
from ..contracts.sampling_checks import check_sampling
from ..contracts.security import CALLER_HEADER, bearer_token, caller_id, key_matches
from ..http.asgi import Request
from ..http.limits import BodyRejected, read_body, ready_body
from ..http.upstream import UpstreamClient
from .activation import Activation
from .adapters import AdapterLoader
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
from .engines import EnginePool, EngineState
from .flow.gate import BATCH_HEADER, FlowGate, FlowRefused
from .flow.tenants import Tenants
from .legs import Legs
from .metrics import GatewayMetrics
from .migration import Migration, add_state, migratable, with_state
from .peer_pull import PeerPull, Plan
from .prefill_leg import PrefillLeg
from .prompt import PromptAnalyzer, PromptInfo
from .relay import DisconnectWatch, RelayResponse
from .routing import KVPairBreaker, NoEngineError, PrefixAffinity, Route, Router

logger = logging.getLogger("pdfleet.gateway")

# A batch owner as the batch runner names it: a caller id (an API key's digest).
BATCH_OWNER = re.compile(r"key:[0-9a-f]{16}")
# Seconds a client is told to wait (Retry-After) when no decode engine came back.
RETRY_AFTER_SECONDS = 5
# A decode-only route's reasons that count a fallback (``Proxy._first_leg``).
FALLBACK_REASONS = ("no_prefill_engine", "kv_pair_open")


def request_caller(request: Request, keyed: bool) -> str:
    """Who the client is, as engines count per-caller bounds (``X-Pdfleet-Caller``):
    its API key's digest when the gateway checks keys (the key was verified),
    else its address (an unchecked key would let a client pose as many)."""
    token = bearer_token(request.headers.get("authorization")) if keyed else None
    if token is not None:
        return caller_id(token)
    client = getattr(request, "client", None)
    return caller_id(None, client[0] if client else None)


def planned_route(route: Route, plan: Plan) -> Route:
    """The route a peer-pull plan serves a request by."""
    if plan.alone:
        # A decode engine holds the prefix of a request with a prefill leg, and
        # serving it there is predicted fastest: it runs decode-only there.
        return Route(plan.engine, None, "decode_only", "peer_holder")
    if route.prefill is not None:
        # The prefill leg runs where the plan says (it may pull first there).
        return Route(route.decode, plan.engine, route.decision, route.reason)
    return Route(plan.engine, None, route.decision, route.reason)


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
        peer_pull: PeerPull | None = None,
        tenants: Tenants | None = None,
        batch_token: str | None = None,
    ) -> None:
        self.config = config
        self.peer_pull = peer_pull
        """Peer pulls (``--peer-pull``): serve a held prefix on its holder, pull it, or
        recompute it, by measured cost (``peer_pull.py``)."""
        self.pool = pool
        self.router = router
        self.analyzer = analyzer
        self.client = client
        # A served LoRA adapter's prefix-cache identity, from the engines' scrapes.
        analyzer.lora_identity = lambda name: (pool.adapter(name) or (None,))[0]
        self.metrics = metrics
        self.activation = Activation(metrics.activations)
        self.admission = Admission(config, metrics)
        self.flow = FlowGate(config, tenants or Tenants(), self.admission, metrics)
        """Tenants, their limits and their queue (``flow/``)."""
        self.keyed = bool(config.api_key or self.flow.tenants.keys)
        self.batch_token = batch_token
        """What the batch runner's requests present (the fleet token, or the process's)."""
        self.legs = Legs(
            config, pool, router, affinity, analyzer, metrics, client, breaker, self.admission
        )
        """What the legs and the relay share (engine bookkeeping, failures, answers)."""
        self.prefill = PrefillLeg(self.legs)
        self.decode = DecodeLeg(self.legs)
        self.adapters = AdapterLoader(pool, client, metrics, self.legs)
        """Loads a request's LoRA adapter on its route's engines (``adapters.py``)."""
        self._decisions: dict[tuple[str, str], Any] = {}
        """The routing-decision counter per (decision, reason)."""

    # -- handle ------------------------------------------------------------------

    async def handle(self, request: Request, endpoint: str, raw: bytes | None = None) -> Response:
        """Answer one completions/chat request; a client that goes away cancels it
        (closing the upstream connections, which aborts the engine requests).
        ``raw``: the body, when the caller read it already (``/invocations``)."""
        given = request.headers.get("x-request-id")
        call = Call(
            endpoint,
            client_request_id(given),
            time.perf_counter(),
            {},
            endpoint.endswith("/chat/completions"),
        )
        call.headers["x-request-id"] = call.request_id
        # Without an X-Request-Id of the client's, a body's request_id names the
        # response (the engines answer PREFIX-<request_id>, as vLLM does).
        call.id_from_body = not given
        # Engines count per-caller bounds against the client, not the gateway.
        call.headers[CALLER_HEADER] = request_caller(request, self.keyed)
        owner = request.headers.get(BATCH_HEADER)
        if (
            owner is not None
            and self.batch_token is not None
            and key_matches(bearer_token(request.headers.get("authorization")), [self.batch_token])
        ):
            # The batch runner's request (its token): it runs in the batch
            # band as its batch's owner (a caller id), whose tenant it counts to.
            call.batch = True
            call.headers[CALLER_HEADER] = owner if BATCH_OWNER.fullmatch(owner) else "addr:batch"
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
                if call.ticket is not None:
                    call.ticket.release()

    def _invalid(self, call: Call, reason: str, message: str, param: str | None = None) -> Response:
        self.metrics.rejected.labels(reason).inc()
        return self.legs.error(call, message, 400, param)

    async def _handle(self, call: Call, raw: bytes) -> Response:
        """Check the body, route it, run the legs."""
        checked = self._check(call, raw)
        if isinstance(checked, Response):
            return checked
        body, payload, info, route = checked
        if route is None:
            routed = await self._route(call, info)
            if isinstance(routed, Response):
                return routed
            route = routed
        plan = self._peer_plan(call, route, info) if self.peer_pull is not None else None
        if plan is not None:
            route = planned_route(route, plan)
        if info.adapter is not None:
            ensured = await self.adapters.ensure(call, route, info.adapter)
            if isinstance(ensured, Response):
                return ensured
            if ensured is not route:
                plan = None  # a peer's lend was planned for the engine given up
            route = ensured
        self.legs.take_slot(call, route.decode)  # (and the fair-share clock moves on)
        if route.prefill is not None:
            self.legs.take_prefill_slot(call, route.prefill)
        key = (route.decision, route.reason)
        decided = self._decisions.get(key)
        if decided is None:  # a few (decision, reason) pairs: never dropped
            decided = self._decisions[key] = self.metrics.fast_counter(
                self.metrics.decisions.labels(*key)
            )
        decided.add_one()
        tracing.route_chosen(route)
        choices = migratable(body, call.chat, self.config.max_migrations)
        if choices:
            # Its decode legs can move between engines (migration.py).
            call.migration = Migration(body, choices=choices)
            payload = with_state(payload, body)
        if route.prefill is not None or plan is not None or route.reason in FALLBACK_REASONS:
            first = await self._first_leg(call, body, route, info, plan, payload)
            if isinstance(first, Response):
                return first
        else:
            first = payload  # (nothing precedes the decode leg: no coroutine)
        if body.get("stream") is True:
            return await self.decode.stream(call, route, info, first)
        return await self.decode.json(call, route, info, first)

    def _check(
        self, call: Call, raw: bytes
    ) -> tuple[dict[str, Any], bytes, PromptInfo, Route | None] | Response:
        """Parse, check and admit a body: (body, payload to forward, prompt
        analysis, the one route when there is no choice), or the refusal."""
        try:
            body = parse_body(raw)
        except ValueError as e:
            return self._invalid(call, "invalid_json", str(e))
        payload = raw
        if KV_PARAMS in body:
            # An internal protocol: only a prefill leg's answer may set it.
            del body[KV_PARAMS]
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
        model = body.get("model")
        if names and model is not None and model not in names and self.pool.adapter(model) is None:
            self.metrics.rejected.labels("invalid_field").inc()
            return self.legs.error(
                call, f"The model `{body['model']}` does not exist.", 404, "model"
            )
        route = self._sole_route()
        tenant = self.flow.tenant(call.headers[CALLER_HEADER])
        max_n, max_output = self.flow.caps(tenant)
        try:
            # The engines' own admissibility checks: a body one engine would refuse
            # never reaches a prefill engine (no KV pinned for a doomed request).
            check_fields(body, CHAT if call.chat else COMPLETIONS)
            check_sampling(body, max_n=max_n, max_output_tokens=max_output)
            info = (
                NOT_ANALYZED
                if route is not None
                else self.analyzer.analyze(body, call.chat, self.pool.block_size)
            )
        except (ValueError, TypeError, AttributeError) as e:
            return self._invalid(call, "invalid_field", str(e), field_of(str(e), body))
        try:
            admitted = self.flow.admit(
                tenant, body, info.num_tokens if info.analyzed else None, len(raw), call.batch
            )
        except FlowRefused as r:
            if r.overloaded is not None:
                return self._overloaded(call, r.overloaded)
            return self._invalid(call, "invalid_field", r.message, r.param)
        call.ticket, call.seqs = admitted.ticket, admitted.seqs
        if (
            route is not None
            and route.decode.capacity is not None  # (no capacity learned: room, no call)
            and not self.admission.has_room(route.decode, admitted.seqs, admitted.ticket.band)
        ):
            route = None  # a wide request: it waits until all its slots are free
        if admitted.changed:
            payload = json.dumps(body).encode()
        return body, payload, info, route

    async def _first_leg(
        self,
        call: Call,
        body: dict[str, Any],
        route: Route,
        info: PromptInfo,
        plan: Plan | None,
        payload: bytes,
    ) -> bytes | Response:
        """What precedes the decode leg: a prefill leg, a peer's lend, or nothing;
        returns the decode leg's payload (or the prefill leg's refusal)."""
        if route.prefill is not None:
            lent = None
            if plan is not None and plan.decision == "pull":
                if self.peer_pull is None:
                    raise RuntimeError("broken invariant: a pull plan without a peer-pull planner")
                # The prefill engine pulls the holder's blocks first, computes the
                # tail, and lends the whole prompt to the decode leg; a refused or
                # failed lend: a plain prefill leg.
                lent = await self.peer_pull.lend(
                    self.legs.client, plan, call.endpoint, body, call.chat, call.headers
                )
            outcome = await self.prefill.run(call, body, route, info, lent)
            if isinstance(outcome, Response):
                return outcome
            if outcome is not None:
                call.plain_payload = payload
                leg = decode_body(body, outcome)
                payload = json.dumps(add_state(leg) if call.migration else leg).encode()
        elif plan is not None and plan.decision == m.PULL:
            if self.peer_pull is None:
                raise RuntimeError("broken invariant: a pull plan without a peer-pull planner")
            params = await self.peer_pull.lend(
                self.legs.client, plan, call.endpoint, body, call.chat, call.headers
            )
            if params is not None:
                # As a decode leg: refused params fall back to the plain body.
                call.plain_payload, call.prefill_url = payload, plan.holder.url
                leg = decode_body(body, params)
                payload = json.dumps(add_state(leg) if call.migration else leg).encode()
        elif route.reason in FALLBACK_REASONS:
            if route.reason == "no_prefill_engine":
                self.activation.wanted("prefill")
            self.metrics.fallbacks.labels(route.reason).inc()
            tracing.fallback(route.reason)
        return payload

    # -- route -------------------------------------------------------------------

    @staticmethod
    def _need(call: Call) -> tuple[int, int | None]:
        """(slots, band) of a request: what it needs of an engine's room."""
        return call.seqs, call.ticket.band if call.ticket is not None else None

    def _peer_plan(self, call: Call, route: Route, info: PromptInfo) -> Plan | None:
        """Peer pulls: where to serve a request whose prefix another engine holds
        (None: as routed). Without a prefill leg, among the decode engines; with
        one, where the prefill leg runs, among the prefill engines that can hand
        their KV to the route's decode engine (the holder's leg, or a leg that
        pulls from the holder first, or a plain one), while the decode engines
        of that compatibility lend what they hold too (what they decoded: a
        conversation's last turn), or, in Conditional mode with fewer uncached
        tokens than --min-prompt-tokens, serve the request alone. A
        disaggregating fleet's requests routed decode-only are served as routed."""
        if self.peer_pull is None:
            return None
        if route.prefill is None and self.config.disaggregation_mode != "Disabled":
            return None
        full = self.admission.full(self.pool.engines.values(), *self._need(call))
        lenders: list[EngineState] = []
        alone_below = 0
        if route.prefill is None:
            routed, candidates = route.decode, self.pool.candidates("decode")
        else:
            routed, candidates = route.prefill, self.router.prefill_candidates(route.decode)
            compat = route.decode.load.compat_hash
            lenders = [e for e in self.pool.candidates("decode") if e.load.compat_hash == compat]
            if self.config.disaggregation_mode == "Conditional":
                # A decode engine computes a prompt alone only where the router's own
                # rule would let it: fewer uncached tokens than --min-prompt-tokens.
                alone_below = self.config.min_prompt_tokens
        plan = self.peer_pull.plan(
            info, routed, candidates, full, self.pool.block_size, lenders, alone_below
        )
        if plan is None:
            call.on_computed = self.peer_pull.routed_request(routed, info)
            return None
        if plan.decision != m.PULL:  # a pull is counted once its lend is answered
            self.peer_pull.count(plan.decision, plan.reason)
        served = next(o for o in plan.options if o.decision == plan.decision)
        call.on_computed = self.peer_pull.routed(plan.engine, served.tokens, served.pull_bytes)
        return plan

    def _sole_route(self) -> Route | None:
        """The route when it cannot depend on the prompt: ``Disabled`` mode
        and one routable decode engine with a free slot and nobody waiting
        for one (no prefill leg, no choice to score). The prompt is then not
        analyzed (its block hashes feed only the choice among several
        engines); None: route as usual."""
        if self.config.disaggregation_mode != "Disabled":
            return None
        decode = self.pool.sole_candidate("decode")
        if (
            decode is None
            or self.admission.queued
            or (decode.capacity is not None and not self.admission.has_room(decode))
        ):
            return None
        self.router.count_pick()
        return Route(decode, None, "decode_only", "disabled")

    def _routed(self, call: Call, info: PromptInfo) -> Route | None:
        """A route to engines with room for the request (its slots, its band);
        None while every routable decode engine is full, or the request should
        prefill and every prefill engine that could is. NoEngineError: no
        decode engine is routable."""
        candidates = self.pool.candidates("decode")
        full = self.admission.full(self.pool.engines.values(), *self._need(call))
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
        ticket = call.ticket
        queue_deadline: float | None = None
        waited_since: float | None = None
        hold_deadline: float | None = None
        woken = False
        while True:
            route: Route | Response | None = None
            band = ticket.band if ticket is not None else 0
            # Newcomers wait behind the queue (its requests of their band and better).
            if woken or not admission.queued_ahead(band):
                try:
                    route = self._routed(call, info)
                except NoEngineError:
                    if hold_deadline is None:
                        hold_deadline = time.monotonic() + self.config.hold_timeout
                        self.activation.wanted("decode")
                    route = await self._hold(call, hold_deadline)
                    if route is None:
                        continue  # a decode engine is routable again: look for a slot
            if route is not None:
                if waited_since is not None and ticket is not None:
                    ticket.queued(time.monotonic() - waited_since)
                return route
            if queue_deadline is None:
                try:
                    admission.check_queue(ticket.band if ticket is not None else 0)
                except Overloaded as o:
                    return self._overloaded(call, o)
                queue_deadline = time.monotonic() + self.config.queue_timeout
                waited_since = time.monotonic()
            tenant, tag = (ticket.tenant, ticket.tag) if ticket else ("", 0.0)
            if not await admission.wait(queue_deadline, woken, tenant, band, tag, call.seqs):
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
        if call.ticket is not None and o.reason in ("queue_full", "overloaded", "queue_timeout"):
            self.flow.control.refused(call.ticket, o.reason)
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
