"""The gateway's HTTP app: OpenAI routes, health, metrics; and its server.

``/v1/completions`` and ``/v1/chat/completions`` go through the P/D proxy;
``/v1/models`` is answered by a healthy decode engine. ``/health`` is 200
while at least one decode engine is routable (so a load balancer stops
sending traffic to a gateway that could not serve it) and lists the engines;
``/metrics`` is Prometheus text. Only the ``/v1`` routes need an API key.
"""

from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdfleet.engine import tracing
from pdfleet.engine.config.gateway import GatewayConfig
from pdfleet.engine.entrypoints.uvicorn_server import graceful_server

from .discovery import Discovery, make_discovery
from .engines import EnginePool
from .metrics import GatewayMetrics
from .prompt import PromptAnalyzer
from .proxy import Proxy, error_response, upstream_message
from .routing import PrefixAffinity, Router
from .upstream import UpstreamClient

logger = logging.getLogger("pdfleet.gateway")

# Idle pooled connections are dropped well before the engines' 75 s keep-alive
# ends, so the gateway never reuses a connection the engine is closing.
KEEPALIVE_EXPIRY = 20.0
MAX_CONNECTIONS = 4096


class Gateway:
    """Everything one gateway process holds; built in the app's lifespan."""

    def __init__(self, config: GatewayConfig, discovery: Discovery | None = None) -> None:
        self.config = config
        self.metrics = GatewayMetrics()
        self.analyzer = PromptAnalyzer(
            config.tokenizer, config.prefix_blocks, config.min_prompt_tokens
        )
        self.discovery = discovery or make_discovery(config)
        self.client = httpx.AsyncClient(
            limits=httpx.Limits(
                max_connections=MAX_CONNECTIONS,
                max_keepalive_connections=MAX_CONNECTIONS,
                keepalive_expiry=KEEPALIVE_EXPIRY,
            ),
            timeout=httpx.Timeout(config.request_timeout, connect=config.connect_timeout),
        )
        # Engine calls of the request path; health checks and scrapes use httpx.
        self.upstream = tracing.trace_upstream(
            UpstreamClient(config.connect_timeout, KEEPALIVE_EXPIRY)
        )
        self.affinity = PrefixAffinity(config.prefix_table_size)
        self.pool = EnginePool(
            config, self.discovery, self.metrics, self.client, on_eject=self.affinity.forget
        )
        self.router = Router(config, self.pool, self.affinity)
        self.proxy = Proxy(
            config,
            self.pool,
            self.router,
            self.affinity,
            self.analyzer,
            self.metrics,
            self.upstream,
        )
        self.keys = [k.encode() for k in config.api_key]

    def authorized(self, request: Request) -> bool:
        if not self.keys:
            return True
        header = request.headers.get("authorization", "")
        if not header.startswith("Bearer "):
            return False
        given = header[len("Bearer ") :].encode()
        # Compare against every key (constant time per key): no early exit leaks which.
        return any([hmac.compare_digest(given, k) for k in self.keys])

    async def start(self) -> None:
        await self.pool.tick()  # know the engines before the first request
        self.pool.start()

    async def close(self) -> None:
        await self.pool.stop()
        await self.upstream.aclose()
        await self.client.aclose()


def build_app(config: GatewayConfig, discovery: Discovery | None = None) -> FastAPI:
    gw = Gateway(config, discovery)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gw.start()
        try:
            yield
        finally:
            await gw.close()

    app = FastAPI(title="pdfleet gateway", lifespan=lifespan)
    tracing.instrument_app(app, "gateway")
    app.state.gateway = gw

    def unauthorized(request: Request) -> Response | None:
        if gw.authorized(request):
            return None
        rid = request.headers.get("x-request-id", "")
        gw.metrics.requests.labels(request.url.path, "401").inc()
        return error_response("invalid or missing API key", 401, rid)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return unauthorized(request) or await gw.proxy.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return unauthorized(request) or await gw.proxy.handle(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        denied = unauthorized(request)
        if denied:
            return denied
        headers = {}
        if "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        last = "no healthy decode engine is available"
        for e in gw.pool.candidates("decode"):
            try:
                resp = await gw.client.get(
                    e.url + "/v1/models", headers=headers, timeout=gw.pool.check_timeout
                )
            except httpx.HTTPError as ex:
                last = f"decode engine {e.url}: {type(ex).__name__}: {ex}"
                continue
            if resp.status_code == 200 or 400 <= resp.status_code < 500:
                return Response(resp.content, resp.status_code, media_type="application/json")
            last = f"decode engine {e.url} answered {resp.status_code}: {upstream_message(resp)}"
        return error_response(last, 503, "")

    @app.get("/health")
    async def health() -> Response:
        counts = gw.pool.counts()
        body: dict[str, Any] = {
            "status": "ok" if counts["decode"] else "unavailable",
            "routable": counts,
            "engines": [
                {"url": e.url, "role": e.role, "state": e.state, "inflight": e.inflight}
                for e in gw.pool.engines.values()
            ],
        }
        return JSONResponse(body, status_code=200 if counts["decode"] else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(
            generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST
        )

    return app


def run_gateway(config: GatewayConfig) -> int:
    """Serve until SIGINT/SIGTERM; exit 0 after a graceful stop."""
    import uvicorn

    app = build_app(config)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.uvicorn_log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=75,
    )

    # httpx logs every engine call (health checks included) at INFO.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logger.info("pdfleet gateway on %s:%d: %r", config.host, config.port, config)
    graceful_server(uv_config).run()
    return 0
