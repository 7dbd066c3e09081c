"""The gateway's HTTP app: OpenAI routes, health, engines, metrics; and its server.

``/v1/completions`` and ``/v1/chat/completions`` go through the P/D proxy;
``/v1/models`` is answered by a healthy decode engine (with the gateway's own
``--served-model-name`` names when it has them, and from those alone while no
decode engine is routable); ``/v1/models/{id}``, ``/tokenize`` and
``/detokenize`` by a healthy decode engine too. ``/health`` is 200
while at least one decode engine is routable (so a load balancer stops
sending traffic to a gateway that could not serve it) and says nothing else.
``/engines`` (the pool as the gateway sees it) and ``/metrics`` (Prometheus
text) name engines, so they need a key like the ``/v1`` routes (an API key,
or the fleet token the operator scrapes with); there is no ``/docs`` or
``/openapi.json``. See docs/gateway.md and docs/security.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from urllib.parse import quote

import httpx
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse, PlainTextResponse, Response

from .. import tracing
from ..config.gateway import GatewayConfig
from ..contracts.gateway_events import EngineRefused, EngineStalled, SiblingEvent
from ..contracts.gateway_view import EnginesView, EngineView, KVPairOpen
from ..contracts.http_limits import RequestLimits
from ..contracts.kv_params import FIELD as KV_PARAMS
from ..contracts.model_card import ModelCard, decode_list, encode_list
from ..contracts.security import (
    bearer_token,
    fleet_secret_from_env,
    fleet_token,
    key_matches,
)
from ..http.asgi import Request, RouteTable
from ..http.limits import BodyRejected, read_body, ready_body
from ..http.server import HttpServer
from ..http.upstream import UpstreamClient
from .answers import error_response, upstream_message
from .batch.api import BatchAPI
from .batch.runner import BatchRunner
from .batch.store import open_store
from .call import client_request_id, parse_body
from .discovery import Discovery, make_discovery
from .engines import EngineLoad, EnginePool, EngineState
from .flow.gate import BATCH_HEADER
from .flow.tenants import Tenants
from .kv_index import KVEventFollower, KVIndex
from .metrics import GatewayMetrics
from .peer_pull import PeerPull
from .prompt import PromptAnalyzer
from .proxy import Proxy, request_caller
from .routing import KVPairBreaker, PrefixAffinity, Router
from .siblings import Siblings, reuseport_socket
from .tls import PlaintextWarning, client_context

logger = logging.getLogger("pdfleet.gateway")

# Idle pooled connections are dropped well before the engines' 75 s keep-alive
# ends, so the gateway never reuses a connection the engine is closing.
KEEPALIVE_EXPIRY = 20.0
MAX_CONNECTIONS = 4096
# Fields only pdfleet's own legs may send an engine (the fleet token carries them):
# dropped from what a client asks a render route to forward.
INTERNAL_FIELDS = frozenset({KV_PARAMS, "migration", "priority"})


class Gateway:
    """Everything one gateway process holds; built in the app's lifespan."""

    def __init__(
        self,
        config: GatewayConfig,
        discovery: Discovery | None = None,
        fleet_secret: bytes | None = None,
        siblings: Siblings | None = None,
    ) -> None:
        self.config = config
        self.siblings = siblings
        """The other workers of ``--workers N`` (None for one process)."""
        self.metrics = GatewayMetrics()
        self.analyzer = PromptAnalyzer(
            config.tokenizer,
            config.prefix_blocks,
            config.min_prompt_tokens,
            chat_template=config.chat_template,
        )
        self.discovery = discovery or make_discovery(config)
        secret = fleet_secret if fleet_secret is not None else fleet_secret_from_env()
        self.fleet_token = fleet_token(secret) if secret else None
        # Engines get the fleet token, never a client's key.
        self.engine_headers = (
            {"authorization": f"Bearer {self.fleet_token}"} if self.fleet_token else {}
        )
        tls = client_context(config)
        self.client = httpx.AsyncClient(
            limits=httpx.Limits(
                max_connections=MAX_CONNECTIONS,
                max_keepalive_connections=MAX_CONNECTIONS,
                keepalive_expiry=KEEPALIVE_EXPIRY,
            ),
            timeout=httpx.Timeout(config.request_timeout, connect=config.connect_timeout),
            headers=self.engine_headers,
            verify=tls,
        )
        # Engine calls of the request path; health checks and scrapes use httpx.
        self.upstream = tracing.trace_upstream(
            UpstreamClient(
                config.connect_timeout,
                KEEPALIVE_EXPIRY,
                tls,
                headers={"content-type": "application/json", **self.engine_headers},
            )
        )
        self.affinity = PrefixAffinity(config.prefix_table_size)
        self.breaker = KVPairBreaker(config.kv_pair_failures, config.kv_pair_cooldown, self.metrics)
        self.plaintext = PlaintextWarning()

        def forget(url: str) -> None:
            self.affinity.forget(url)
            self.breaker.forget(url)
            if self.peer_pull is not None:
                self.peer_pull.forget(url)

        self.pool = EnginePool(
            config,
            self.discovery,
            self.metrics,
            self.client,
            on_eject=forget,
            on_add=self.plaintext.check,
        )
        self.pool.on_scrape = self._scraped
        # Exact prefix routing from the engines' KV events (docs/gateway.md).
        self.kv_index = KVIndex(
            config.kv_index_max_blocks,
            config.kv_index_stale_after,
            config.kv_host_weight,
            self.metrics,
        )
        self.kv_events = KVEventFollower(
            self.kv_index, self.metrics, secret if config.kv_events_auth == "fleet" else None
        )
        self.router = Router(config, self.pool, self.affinity, self.breaker, self.kv_index)
        # Peer pulls (--peer-pull, docs/peer-pull.md): measured costs, per-request choice.
        self.peer_pull = (
            PeerPull(
                self.metrics, self.kv_index, self.pool.block_size, config.peer_pull_lend_timeout
            )
            if config.peer_pull
            else None
        )
        self.tenants = Tenants.load(config.tenants_file) if config.tenants_file else Tenants()
        # What the batch runner's requests present with the batch header (the
        # fleet token; without a fleet secret, a token of this process).
        self.batch_token = self.fleet_token or secrets.token_urlsafe(32)
        self.proxy = Proxy(
            config,
            self.pool,
            self.router,
            self.affinity,
            self.analyzer,
            self.metrics,
            self.upstream,
            self.breaker,
            self.peer_pull,
            self.tenants,
            self.batch_token,
        )
        self.batches: BatchAPI | None = None
        """The Batch API (``--data-dir`` or ``--batch-database-url``); its runner
        runs in worker 0 only (one per gateway replica)."""
        store = open_store(config.data_dir, config.batch_database_url)
        if store is not None:
            runner = None
            if siblings is None or siblings.index == 0:
                # The runner calls this gateway: on loopback when it listens everywhere.
                everywhere = ("0.0.0.0", "::", "")  # noqa: S104 (compared, not bound)
                host = config.host if config.host not in everywhere else "127.0.0.1"
                runner = BatchRunner(
                    store,
                    f"http://{f'[{host}]' if ':' in host else host}:{config.port}",
                    self.batch_token,
                    config.batch_concurrency,
                    self._idle,
                    config.request_timeout,
                    self._batch_counts,
                )
            self.batches = BatchAPI(store, runner, config.batch_max_file_bytes)
        self.pool.on_routable = self.proxy.admission.engines_changed
        self.metrics.on_collect(self._engine_gauges)
        self.keys = list(dict.fromkeys([*config.api_key, *self.tenants.keys]))
        if not self.keys:
            logger.warning(
                "no API key configured: anyone who can reach the gateway may use it and read "
                "/engines and /metrics (set $PDFLEET_API_KEY or $PDFLEET_API_KEY_FILE)"
            )
        if not self.fleet_token:
            logger.warning(
                "no fleet secret ($PDFLEET_FLEET_SECRET / $PDFLEET_FLEET_SECRET_FILE): engine "
                "calls carry no credential, so only engines without authentication answer them"
            )

    def _idle(self) -> bool:
        """Capacity online traffic leaves idle: no request waits for a slot here,
        and no routable decode engine reports a queue of its own."""
        return not self.proxy.admission.queued and all(
            e.load.waiting < 1 for e in self.pool.candidates("decode")
        )

    def _batch_counts(self, counts: dict[str, int]) -> None:
        for state in ("pending", "running"):
            self.metrics.batch_requests.labels(state).set(counts.get(state, 0))

    def _scraped(self, e: EngineState, old: EngineLoad, new: EngineLoad) -> None:
        if e.serves("decode"):
            self.breaker.scraped(e, old, new)
        self.proxy.admission.scraped(e, old, new)
        if self.peer_pull is not None:
            self.peer_pull.scraped(e, old, new)

    def _engine_gauges(self) -> None:
        """At each collection: each engine's stall limit and learned capacity."""
        now = time.monotonic()
        for e in self.pool.engines.values():
            self.metrics.stall_limit.labels(e.url, e.role).set(self.pool.stall_limit(e, now))
            if e.capacity is not None:
                self.metrics.capacity.labels(e.url, e.role).set(e.capacity)

    def authorized(self, request: Request, admin: bool = False) -> bool:
        """A client key (or, for the admin routes, the fleet token) in constant time."""
        if not self.keys:
            return True
        given = bearer_token(request.headers.get("authorization"))
        keys = [*self.keys, self.fleet_token] if admin and self.fleet_token else self.keys
        return key_matches(given, keys)

    def _sibling_event(self, event: SiblingEvent) -> None:
        """Another worker's ejection (a stall, a refused connection) or KV
        hand-off (``--workers N``)."""
        if isinstance(event, EngineStalled):
            self.pool.stalled_elsewhere(event.url, event.since)
        elif isinstance(event, EngineRefused):
            self.pool.refused_elsewhere(event.url)
        elif event.prefill in self.pool.engines and event.decode in self.pool.engines:
            # Only pairs of engines this worker knows: its tables stay bounded
            # by the fleet (a worker that has not discovered one yet skips it).
            self.breaker.apply_shared(event)

    async def start(self) -> None:
        if self.siblings is not None:
            siblings = self.siblings
            await siblings.serve(
                lambda: generate_latest(self.metrics.registry), self._sibling_event
            )
            self.breaker.share = siblings.publish
            self.pool.on_stall = lambda e: siblings.publish(EngineStalled(e.url, e.last_progress))
            self.pool.on_refused = lambda e: siblings.publish(EngineRefused(e.url))
        await self.pool.tick()  # know the engines before the first request
        self.pool.start()
        self.kv_events.start(self.pool, self.analyzer, self.config)
        if self.batches is not None and self.batches.runner is not None:
            self.batches.runner.start()

    async def metrics_text(self) -> bytes:
        """This process's series, plus the other workers' with ``--workers N``."""
        own = generate_latest(self.metrics.registry)
        return own if self.siblings is None else await self.siblings.merged(own)

    async def close(self) -> None:
        if self.batches is not None:
            if self.batches.runner is not None:
                await self.batches.runner.stop()
            self.batches.store.close()
        await self.kv_events.stop()
        if self.siblings is not None:
            await self.siblings.close()
        await self.pool.stop()
        await self.upstream.aclose()
        await self.client.aclose()


def build_app(  # noqa: C901 (the route table: each route is a closure counted here)
    config: GatewayConfig,
    discovery: Discovery | None = None,
    fleet_secret: bytes | None = None,
    siblings: Siblings | None = None,
) -> RouteTable:
    gw = Gateway(config, discovery, fleet_secret, siblings)

    @asynccontextmanager
    async def lifespan(app: RouteTable) -> AsyncIterator[None]:
        await gw.start()
        try:
            yield
        finally:
            await gw.close()

    def internal_error(request: Request, exc: Exception) -> Response:
        rid = client_request_id(request.headers.get("x-request-id"))
        logger.error("request %s: %s failed", rid, request.path, exc_info=exc)
        return error_response("internal error of the gateway", 500, rid)

    # The routes below and nothing else (no /docs, /redoc or /openapi.json: the
    # API is OpenAI's, documented in docs/).
    app = RouteTable(lifespan, internal_error)
    tracing.instrument_app(
        app, "gateway", trusted=(lambda _: True) if config.trust_client_trace_context else None
    )
    app.state.gateway = gw

    def unauthorized(request: Request, admin: bool = False) -> Response | None:
        if gw.authorized(request, admin):
            return None
        if BATCH_HEADER in request.headers and key_matches(
            bearer_token(request.headers.get("authorization")), [gw.batch_token]
        ):
            return None  # the batch runner's request (batch/runner.py)
        rid = client_request_id(request.headers.get("x-request-id"))
        gw.metrics.rejected.labels("unauthorized").inc()
        gw.metrics.requests.labels(request.path, "401").inc()
        return error_response(
            "invalid or missing API key", 401, rid, headers={"www-authenticate": "Bearer"}
        )

    async def answered(response: Response) -> Response:
        return response

    # The two routes of almost every request are plain functions that hand over
    # the proxy's coroutine (one coroutine less a request), and check keys only
    # when there are keys.
    @app.post("/v1/completions")
    def completions(request: Request) -> Awaitable[Response]:
        denied = unauthorized(request) if gw.keys else None
        if denied is not None:
            return answered(denied)
        return gw.proxy.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    def chat(request: Request) -> Awaitable[Response]:
        denied = unauthorized(request) if gw.keys else None
        if denied is not None:
            return answered(denied)
        return gw.proxy.handle(request, "/v1/chat/completions")

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        """SageMaker's route, as vLLM serves it: a chat body (``messages``) or a
        completions body (``prompt``), answered as that endpoint answers it."""
        denied = unauthorized(request)
        if denied:
            return denied
        raw = await bounded_body(request)
        if isinstance(raw, Response):
            return raw
        return await gw.proxy.handle(request, invocation_endpoint(raw), raw)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        denied = unauthorized(request)
        if denied:
            return denied
        rid = client_request_id(request.headers.get("x-request-id"))
        for e in gw.pool.candidates("decode"):
            try:
                resp = await gw.client.get(e.url + "/v1/models", timeout=gw.pool.check_timeout)
            except httpx.HTTPError as ex:
                logger.warning("request %s: /v1/models on %s: %r", rid, e.url, ex)
                continue
            if resp.status_code == 200:
                try:
                    cards = decode_list(resp.json())
                except ValueError as ex:  # not JSON, or not a listing: ask the next one
                    logger.warning("request %s: /v1/models on %s: %s", rid, e.url, ex)
                    continue
                if gw.config.served_model_name:
                    cards = models_named(gw.config, cards)
                return JSONResponse(encode_list(with_adapters(cards, gw.pool)))
            logger.warning(
                "request %s: /v1/models on %s answered %d: %s",
                rid,
                e.url,
                resp.status_code,
                upstream_message(resp),
            )
        if gw.config.served_model_name:
            cards = with_adapters(models_named(gw.config, []), gw.pool)
            return JSONResponse(encode_list(cards))
        return error_response("no healthy decode engine is available", 503, rid)

    async def on_a_decode_engine(
        request: Request,
        method: str,
        path: str,
        body: bytes | None = None,
        timeout: httpx.Timeout | None = None,  # noqa: ASYNC109 (the per-call bound goes to the HTTP client)
    ) -> Response:
        """The answer of the first healthy decode engine that answers ``method
        path`` (the model-retrieval and tokenizer routes: every engine serves the
        same model and tokenizer). An engine's 4xx is the answer; a 5xx or a
        connection failure tries the next; none: a 503."""
        rid = client_request_id(request.headers.get("x-request-id"))
        for e in gw.pool.candidates("decode"):
            try:
                resp = await gw.client.request(
                    method,
                    e.url + path,
                    content=body,
                    headers={"content-type": "application/json"} if body is not None else None,
                    timeout=timeout or gw.pool.check_timeout,
                )
            except httpx.HTTPError as ex:
                logger.warning("request %s: %s on %s: %r", rid, path, e.url, ex)
                continue
            if resp.status_code < 500:
                return Response(resp.content, resp.status_code, media_type="application/json")
            logger.warning(
                "request %s: %s on %s answered %d: %s",
                rid,
                path,
                e.url,
                resp.status_code,
                upstream_message(resp),
            )
        return error_response("no healthy decode engine is available", 503, rid)

    @app.get_prefix("/v1/models/")
    async def model(request: Request) -> Response:
        denied = unauthorized(request)
        if denied:
            return denied
        name = request.path[len("/v1/models/") :]
        if gw.config.served_model_name:
            listing = await models(request)
            if listing.status_code != 200:
                return listing
            cards = decode_list(json.loads(bytes(listing.body)))
            card = next((c for c in cards if c.id == name), None)
            if card is None:
                rid = client_request_id(request.headers.get("x-request-id"))
                return error_response(
                    f"The model `{name}` does not exist.", 404, rid, param="model"
                )
            return JSONResponse(card.to_wire())
        return await on_a_decode_engine(request, "GET", "/v1/models/" + quote(name, safe=""))

    async def bounded_body(request: Request) -> bytes | Response:
        try:
            raw = ready_body(request, gw.config.max_body_bytes)
            if raw is None:
                raw = await read_body(request, gw.config.max_body_bytes, gw.config.body_timeout)
        except BodyRejected as e:
            rid = client_request_id(request.headers.get("x-request-id"))
            return error_response(e.message, e.status, rid, headers={"connection": "close"})
        return raw

    async def authorized_body(request: Request) -> bytes | Response:
        """The request's body within its bounds, or the answer refusing it."""
        denied = unauthorized(request)
        if denied:
            return denied
        return await bounded_body(request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        raw = await authorized_body(request)
        if isinstance(raw, Response):
            return raw
        return await on_a_decode_engine(request, "POST", "/tokenize", raw)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        raw = await authorized_body(request)
        if isinstance(raw, Response):
            return raw
        return await on_a_decode_engine(request, "POST", "/detokenize", raw)

    # vLLM's render routes (a request's token ids and sampling parameters, not
    # generated) and its tokenizer settings: every engine renders alike, so a
    # decode engine answers.
    @app.post("/v1/completions/render")
    async def completions_render(request: Request) -> Response:
        return await forwarded_post(request, "/v1/completions/render")

    @app.post("/v1/chat/completions/render")
    async def chat_render(request: Request) -> Response:
        return await forwarded_post(request, "/v1/chat/completions/render")

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        denied = unauthorized(request)
        if denied:
            return denied
        return await on_a_decode_engine(request, "GET", "/tokenizer_info")

    async def forwarded_post(request: Request, path: str) -> Response:
        raw = await authorized_body(request)
        if isinstance(raw, Response):
            return raw
        # Internal fields, as on the generation routes: a client's are dropped (the
        # engine would take them from the fleet token the gateway sends). Parsed,
        # not searched for: a JSON-escaped key names the same field.
        try:
            body = parse_body(raw)
        except ValueError:
            body = None  # not JSON: the engine answers the 400
        if isinstance(body, dict) and INTERNAL_FIELDS & body.keys():
            for name in INTERNAL_FIELDS & body.keys():
                del body[name]
            raw = json.dumps(body).encode()
        # A render tokenizes and compiles the request's grammar, as a first token
        # would: bounded by the first-token timeout, not the health checks'.
        timeout = httpx.Timeout(
            gw.config.first_token_base_timeout, connect=gw.config.connect_timeout
        )
        return await on_a_decode_engine(request, "POST", path, raw, timeout)

    if gw.batches is not None:
        add_batch_routes(app, gw, unauthorized)

    @app.get("/health")
    async def health(request: Request) -> Response:
        ok = gw.config.scale_to_zero or bool(gw.pool.candidates("decode"))
        return JSONResponse(
            {"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503
        )

    @app.get("/engines")
    async def engines(request: Request) -> Response:
        denied = unauthorized(request, admin=True)
        if denied:
            return denied
        now = time.monotonic()
        view = EnginesView(
            queued=gw.proxy.admission.queued,
            tenants=gw.proxy.flow.view(),
            worker=None if gw.siblings is None else f"{gw.siblings.index}/{gw.siblings.count}",
            routable=gw.pool.counts(),
            engines=[
                EngineView(
                    url=e.url,
                    role=e.role,
                    state=e.state,
                    inflight=e.inflight,
                    stalled=e.stalled,
                    admitted=e.admitted,
                    capacity=e.capacity,
                    longest_step_s=round(e.steps.longest(now), 3),
                    stall_limit_s=round(gw.pool.stall_limit(e, now), 3),
                    step_running_s=None
                    if e.step_started is None
                    else round(now - e.step_started, 3),
                    # The LoRA adapters it serves and where routing sees their weights.
                    adapters={
                        name: e.load.resident.get(name, "registered")
                        for name in sorted(e.load.adapters)
                    },
                    peer_pull=None if gw.peer_pull is None else gw.peer_pull.view(e.url),
                )
                for e in gw.pool.engines.values()
            ],
            kv_pairs_open=[KVPairOpen(p, d) for p, d in sorted(gw.breaker.open_until)],
        )
        return JSONResponse(view.to_wire())

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        denied = unauthorized(request, admin=True)
        if denied:
            return denied
        return PlainTextResponse(await gw.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return app


def add_batch_routes(
    app: RouteTable, gw: Gateway, unauthorized: Callable[[Request], Response | None]
) -> None:
    """``/v1/files`` and ``/v1/batches`` (batch/api.py): each object is its
    caller's (the caller id of its API key)."""
    api = gw.batches
    if api is None:
        raise RuntimeError("broken invariant: batch routes without a batch store")

    def owned(
        handler: Callable[[Request, str], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        """The route: the caller's credentials checked, then ``handler`` with the
        caller id that owns the objects it reads or makes."""

        async def route(request: Request) -> Response:
            denied = unauthorized(request)
            if denied is not None:
                return denied
            return await handler(request, request_caller(request, gw.proxy.keyed))

        return route

    async def upload(request: Request, owner: str) -> Response:
        return await api.upload(request, owner, gw.config.body_timeout)

    async def create(request: Request, owner: str) -> Response:
        try:
            raw = ready_body(request, gw.config.max_body_bytes)
            if raw is None:
                raw = await read_body(request, gw.config.max_body_bytes, gw.config.body_timeout)
        except BodyRejected as e:
            rid = client_request_id(request.headers.get("x-request-id"))
            return error_response(e.message, e.status, rid, headers={"connection": "close"})
        return await api.create(raw, owner)

    app.post("/v1/files")(owned(upload))
    app.get("/v1/files")(owned(api.list_files))
    app.post("/v1/batches")(owned(create))
    app.get("/v1/batches")(owned(api.list_batches))
    # One object's routes (retrieve, content, delete, cancel): the API tells them apart.
    for prefix, methods, handler in (
        ("/v1/files/", ("GET", "DELETE"), api.file_route),
        ("/v1/batches/", ("GET", "POST"), api.batch_route),
    ):
        for method in methods:
            app.get_prefix(prefix, method)(owned(handler))


def invocation_endpoint(raw: bytes) -> str:
    """The endpoint an ``/invocations`` body is for: chat when it is a JSON object
    with ``messages``, else completions (whose checks answer a malformed body)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return "/v1/completions"
    if isinstance(body, dict) and "messages" in body:
        return "/v1/chat/completions"
    return "/v1/completions"


def request_limits(config: GatewayConfig) -> RequestLimits:
    """The gateway's client limits, as the engine server's (one definition)."""
    return RequestLimits(
        max_body_bytes=config.max_body_bytes,
        max_chunk_bytes=config.max_chunk_bytes,
        header_timeout=config.header_timeout,
        body_timeout=config.body_timeout,
    )


def models_named(config: GatewayConfig, engine_cards: list[ModelCard]) -> list[ModelCard]:
    """``/v1/models`` listing the gateway's names, each with what a decode engine
    says of its first model (``root``, ``max_model_len``) when one answered."""
    first = engine_cards[0] if engine_cards else ModelCard("", created=int(time.time()))
    return [dataclasses.replace(first, id=name) for name in config.served_model_name]


def with_adapters(cards: list[ModelCard], pool: EnginePool) -> list[ModelCard]:
    """A ``/v1/models`` listing plus every LoRA adapter some engine of the pool
    serves (the one engine that answered may not serve them all), each with
    ``parent``: the listing's first (base) model, as vLLM lists adapters."""
    listed = {c.id for c in cards}
    base = next((c for c in cards if not c.is_adapter), None)
    names = sorted({n for e in pool.engines.values() for n in e.load.adapters} - listed)
    added = []
    for name in names:
        source = pool.adapter(name)
        added.append(
            dataclasses.replace(
                base or ModelCard(name),
                id=name,
                root=source[1] if source else None,
                parent=base.id if base is not None else None,
                lora_identity=source[0] if source else None,
                source=None,
                revision=None,
            )
        )
    return cards + added


def run_gateway(config: GatewayConfig, siblings: Siblings | None = None) -> int:
    """Serve this process's gateway until SIGINT/SIGTERM; exit 0 after a
    graceful stop. ``siblings``: the other workers of ``--workers N`` (their
    supervisor is ``workers.serve``). The HTTP server is pdfleet's own
    (engine/http/server.py), the engine server's too."""
    app = build_app(config, siblings=siblings)
    # httpx logs every engine call (health checks included) at INFO.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("pdfleet.http").setLevel(config.uvicorn_log_level.upper())
    logger.info("pdfleet gateway on %s:%d: %r", config.host, config.port, config)
    sock = None if siblings is None else reuseport_socket(config.host, config.port)
    server = HttpServer(app, request_limits(config), name="gateway")
    return server.run(config.host, config.port, sock)
