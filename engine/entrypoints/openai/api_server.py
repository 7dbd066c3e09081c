"""The engine's HTTP server: OpenAI API, health, metrics, tokenize.

The port opens at once; ``/health`` answers 503 until the model is loaded and
a warm-up step ran, then 200. SIGTERM stops accepting connections and
requests (503), lets in-flight requests finish for up to
``--shutdown-timeout`` seconds, then hands the ones the gateway can migrate
back to it (``contracts/migration.py``), aborts the rest, and exits 0. An engine whose loop broke (see ``async_engine``) exits 1 at once,
for its supervisor to restart it: it is never alive with a failed health.

Every route but the health probes needs a credential (``auth.py``); bodies
are bounded (``http_guard.py``), heads and chunks by the HTTP server, which
is the gateway's too (``engine/http/server.py``: keep-alive, pipelining,
disconnects, the graceful stop). Request ids are the server's own; a
client's ``X-Request-Id`` is only echoed and logged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ... import tracing
from ...config import EngineConfig
from ...contracts import lora as lora_contract
from ...contracts.errors import ErrorBody, method_not_allowed, not_found
from ...contracts.http_limits import RequestLimits
from ...contracts.kv_params import FIELD as KV_PARAMS
from ...contracts.lora import LoRABodyError, LoRALoad
from ...contracts.migration import MIGRATE_EVENT, MIGRATE_HEADER
from ...contracts.model_card import ModelCard, encode_list
from ...http.server import HttpServer
from ...loop.async_engine import AsyncEngine
from ...loop.llm_engine import LLMEngine
from ...lora.adapter import LoRAError
from ...metrics import EngineMetrics
from ...sampling_params import SamplingParams
from ..auth import EngineAuth
from ..caller import request_caller
from ..http_guard import GuardMiddleware
from .grammar_gate import CompileGate
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    now,
    random_id,
)
from .serving_base import ChatOptions, TokenizerLanes
from .serving_chat import ChatServing
from .serving_completion import CompletionServing

logger = logging.getLogger("pdfleet.serve")


class ServerState:
    def __init__(
        self,
        config: EngineConfig,
        max_waiting_requests: int,
        auth: EngineAuth | None = None,
        limits: RequestLimits | None = None,
        large_prompt_chars: int = 1 << 16,
        options: ChatOptions | None = None,
    ) -> None:
        self.options = options or ChatOptions()
        self.config = config
        self.max_waiting_requests = max_waiting_requests
        self.auth = auth or EngineAuth()
        self.limits = limits or RequestLimits()
        self.lanes = TokenizerLanes(large_prompt_chars)
        self.engine: AsyncEngine | None = None
        self.completions: CompletionServing | None = None
        self.chat: ChatServing | None = None
        self.gate: CompileGate | None = None
        self.metrics: EngineMetrics | None = None
        self.load_error: BaseException | None = None
        self.fatal: BaseException | None = None
        self.on_exit: Any = None  # set by run_server: stops the HTTP server
        self.ready = threading.Event()
        self.draining = False
        self.handoff: asyncio.Event | None = None
        """Set when a stopping engine hands its migratable streams back to the
        gateway (``--shutdown-timeout`` after SIGTERM); made on the server's loop."""
        self.last_log = time.monotonic()

    def resume_serving(self) -> dict[str, Any]:
        """The server's factors of its resume identity (``EngineConfig.resume_factors``)."""
        o = self.options
        return {
            "chat_template": o.chat_template,
            "tool_call_parser": o.tool_call_parser,
            "reasoning_parser": o.reasoning_parser,
        }

    def check_resume(self, identity: str | None) -> None:
        """Refuse a migrated leg from an engine of another resume identity: its
        tokens would not continue the stream (docs/migration.md)."""
        mine = self.metrics.resume_identity if self.metrics is not None else None
        if identity is not None and mine is not None and identity != mine:
            raise APIError(
                f"migration.resume_identity: {identity!r} differs from this engine's "
                f"{mine!r} (model weights, tokenizer, chat template or sampling defaults "
                "differ): it cannot continue the request's tokens",
                param="migration.resume_identity",
            )

    def load(self) -> None:
        """Build the engine, run a warm-up step, then start serving (loader thread)."""
        try:
            engine = LLMEngine(self.config)
            warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
            engine.add_request("warmup", {"prompt_token_ids": [0]}, warm, output_kind="final")
            while engine.has_unfinished_requests():
                engine.step()
            self.metrics = EngineMetrics(
                engine.config, resume_identity=engine.config.resume_identity(self.resume_serving())
            )
            self.metrics.update_adapters(engine)
            self.metrics.update_kv_layout(engine)
            self.engine = AsyncEngine(
                engine, self.max_waiting_requests, self.on_step, on_fatal=self.on_fatal
            )
            names = engine.config.model_config.served_model_names
            max_len = engine.max_model_len
            self.gate = gate = CompileGate(lambda: engine.grammars, engine.config.admission_config)
            self.completions = CompletionServing(
                self.engine, names, max_len, self.lanes, self.options, gate
            )
            self.chat = ChatServing(self.engine, names, max_len, self.lanes, self.options, gate)
            self.ready.set()
            logger.info("Ready to serve %s", engine.config.model_config.name)
        except LoRAError as e:
            # A --lora-modules adapter that cannot be served: the user's input,
            # reported as one line when the server exits (run_server).
            self.load_error = e
        except BaseException as e:
            logger.exception("engine failed to start")
            self.load_error = e

    def on_fatal(self, error: BaseException) -> None:
        """The engine loop broke (engine thread): exit non-zero for a restart."""
        self.fatal = error
        logger.error("the engine cannot serve any more; exiting for a restart")
        if self.on_exit is not None:
            self.on_exit()

    def on_step(self, engine: LLMEngine) -> None:
        if self.metrics is None:
            raise RuntimeError("broken invariant: self.metrics is not None")
        self.metrics.update(engine)
        if engine.config.observability_config.log_stats and time.monotonic() - self.last_log >= 10:
            self.last_log = time.monotonic()
            s = engine.stats
            logger.info(
                "running=%d waiting=%d kv_usage=%.1f%% prefix_hit_rate=%.1f%% preemptions=%d",
                s.num_running_reqs,
                s.num_waiting_reqs,
                100 * s.kv_cache_usage,
                100 * s.prefix_cache_hits / max(1, s.prefix_cache_queries),
                s.num_preemptions,
            )


# Seconds a stopping engine gives its handed-back streams to write ``: migrate``
# and end, after --shutdown-timeout, before it cancels what is left.
HANDOFF_SECONDS = 1.0
# Seconds an engine that must exit after a failed step gives its connections to
# write the error answers of the requests that step failed, before it closes them.
EXIT_FLUSH_SECONDS = 2.0


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(
    events: AsyncGenerator[str, None], request: Request, handoff: asyncio.Event | None = None
) -> AsyncGenerator[str, None]:
    """Relay SSE events; stop (aborting the engine request) when the client goes away.

    A watcher task waits for the disconnect message and cancels the task that
    iterates the stream; the cancellation runs the generators' cleanup, which
    aborts the engine request. Chunks themselves flow with no extra tasks.

    ``handoff`` (a stream the gateway can migrate): when it is set (the engine
    is stopping) the stream ends with ``: migrate`` at its next event, or at
    once while it waits for one, and the engine request is aborted: the
    gateway resumes it elsewhere from the tokens it has relayed.
    """
    consumer = asyncio.current_task()
    gone = False
    handing_off = False
    waiting = False  # the consumer awaits the next event (not a write)

    async def watch() -> None:
        nonlocal gone
        await _wait_disconnect(request)
        gone = True
        if consumer is not None:
            consumer.cancel()

    async def watch_handoff(event: asyncio.Event) -> None:
        nonlocal handing_off
        await event.wait()
        handing_off = True
        if waiting and consumer is not None:
            consumer.cancel()

    watchers = [asyncio.ensure_future(watch())]
    if handoff is not None:
        watchers.append(asyncio.ensure_future(watch_handoff(handoff)))
    try:
        while True:
            waiting = True
            try:
                item = await anext(events)
            except StopAsyncIteration:
                break
            finally:
                waiting = False
            if handing_off:
                yield MIGRATE_EVENT.decode()
                return
            yield item
    except asyncio.CancelledError:
        if gone:
            return
        if not handing_off or consumer is None:
            raise
        consumer.uncancel()
        yield MIGRATE_EVENT.decode()
    finally:
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        await events.aclose()


def error_json(e: APIError | ErrorBody, headers: Mapping[str, str] | None = None) -> JSONResponse:
    body = e.body() if isinstance(e, APIError) else e.to_dict()
    return JSONResponse(body, status_code=e.status, headers=headers)


def build_app(state: ServerState) -> FastAPI:  # noqa: C901 (the route table: each route is a closure counted here)
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        threading.Thread(target=state.load, name="pdfleet-loader", daemon=True).start()
        state.handoff = asyncio.Event()
        yield
        state.draining = True
        if state.engine is not None:
            # A prefill engine keeps serving its KV leases until they are claimed
            # (AsyncEngine.shutdown waits, bounded by the lease).
            await asyncio.to_thread(state.engine.shutdown)

    # No redirect to the path without a trailing slash (Starlette's default,
    # a 307 that POST clients do not follow): `/v1/chat/completions/` is an
    # unknown route, the OpenAI 404 body, as the gateway answers it.
    app = FastAPI(title="pdfleet engine", lifespan=lifespan, redirect_slashes=False)
    # Outermost of the app's own layers: credentials and body size come first.
    app.add_middleware(GuardMiddleware, auth=state.auth, limits=state.limits)
    # Tracing wraps even that (a refused request is a span too); off: nothing added.
    observability = state.config.observability_config

    def trusted(headers: dict[str, str]) -> bool:
        # The gateway's legs carry the fleet token: one trace across the P/D hop.
        return observability.trust_client_trace_context or state.auth.is_internal(
            headers.get("authorization")
        )

    tracing.instrument_app(app, "engine", observability.otlp_traces_endpoint, trusted)

    def ids(request: Request) -> str:
        rid = getattr(request.state, "request_id", None)
        given = getattr(request.state, "client_request_id", None)
        return f"{rid} (client id {given!r})" if given else str(rid or "-")

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        if e.status >= 500:
            logger.warning("request %s: %d %s", ids(request), e.status, e.message)
        return error_json(e, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return error_json(APIError(f"invalid JSON body: {first.get('msg')}"))
        param = ".".join(loc[:8]) or None
        return error_json(
            APIError(f"{param or 'body'}: {first.get('msg', 'invalid request')}", param=param)
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own refusals (unparsable body, unknown route, wrong method);
        # an unknown route or method is answered as the gateway answers it.
        if e.status_code == 404:
            return error_json(not_found())
        if e.status_code == 405:
            return error_json(method_not_allowed(), headers=e.headers)
        detail = e.detail if isinstance(e.detail, str) else "invalid request"
        if e.status_code == 400 and "parsing the body" in detail:
            detail = "the body is not valid JSON (or is nested too deeply)"
        return error_json(APIError(detail, status=e.status_code))

    @app.exception_handler(RecursionError)
    async def _too_deep(_: Request, e: RecursionError) -> JSONResponse:
        return error_json(APIError("the JSON body is nested too deeply"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        # The client learns nothing of the internals; the log has the traceback.
        logger.error("request %s: internal error", ids(request), exc_info=e)
        return error_json(APIError("internal server error; the server log has the details", 500))

    def serving(request: Request) -> tuple[CompletionServing, ChatServing]:
        if state.draining or state.fatal is not None:
            # A gateway sends the request to another engine at once.
            raise APIError(
                "the server is shutting down", status=503, headers={MIGRATE_HEADER: "stopping"}
            )
        if state.completions is None or state.chat is None:
            raise APIError("the model is still loading", status=503)
        return state.completions, state.chat

    def request_id(request: Request, prefix: str) -> str:
        """A fresh internal id; the client's X-Request-Id is kept for logs and the echo."""
        rid = random_id(prefix)
        request.state.request_id = rid
        given = request.headers.get("x-request-id")
        if given:
            request.state.client_request_id = given[:256]
            logger.debug("request %s has client id %r", rid, given[:256])
        return rid

    def echo_headers(request: Request, rid: str) -> dict[str, str]:
        return {"x-request-id": getattr(request.state, "client_request_id", None) or rid}

    def response_id(request: Request, prefix: str, rid: str, body: Any = None) -> str:
        """The body's ``id``: ``PREFIX-<X-Request-Id>`` as vLLM answers, else
        ``PREFIX-<request_id>`` from the body, else the internal id. Only a label:
        the engine keys requests by the internal id."""
        given = getattr(request.state, "client_request_id", None) or getattr(
            body, "request_id", None
        )
        if getattr(body, "user", None) is not None:
            logger.info("request %s is for user %r", rid, body.user[:256])
        return f"{prefix}-{given}" if given else rid

    # Routes that answer plain JSON say response_model=None: FastAPI would
    # otherwise take their return annotation as a response model to validate.
    @app.get("/health", response_model=None)
    async def health() -> JSONResponse | dict[str, str]:
        if (
            state.load_error is not None
            or state.fatal is not None
            or (state.engine is not None and not state.engine.alive)
        ):
            return JSONResponse({"status": "failed"}, status_code=503)
        if not state.ready.is_set() or state.draining:
            return JSONResponse(
                {"status": "loading" if not state.draining else "draining"}, status_code=503
            )
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        if state.metrics is None:
            return PlainTextResponse("", media_type=CONTENT_TYPE_LATEST)
        if state.engine is not None:
            state.metrics.update_grammars(state.engine.engine.built_grammars, state.gate)
            state.metrics.update_step(state.engine.engine.core)
        return PlainTextResponse(
            generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST
        )

    def model_card(s: CompletionServing, name: str) -> ModelCard:
        return ModelCard(
            name,
            created=now(),
            root=state.config.model_config.model,
            max_model_len=s.max_model_len,
        )

    def adapter_cards(s: CompletionServing) -> dict[str, ModelCard]:
        """One card per loaded LoRA adapter, as vLLM lists them (``parent``: the
        base model), plus its prefix-cache identity (engine/contracts/block_hash.py)."""
        if state.engine is None:
            raise RuntimeError("broken invariant: state.engine is not None")
        engine = state.engine.engine
        cards = {}
        for name, lora in list(engine.loras.items()):
            hub = state.engine.lora_sources.get(name)
            cards[name] = dataclasses.replace(
                model_card(s, name),
                root=lora.lora_path,
                parent=s.served_names[0],
                lora_identity=engine.lora_identities.get(name),
                lora_int_id=lora.lora_int_id,
                # Loaded from the Hub: root is its snapshot in the cache.
                source=hub[0] if hub is not None else None,
                revision=hub[1] if hub is not None else None,
            )
        return cards

    @app.get("/v1/models", response_model=None)
    async def models(request: Request) -> dict[str, Any]:
        s, _ = serving(request)
        data = [model_card(s, name) for name in s.served_names]
        return encode_list(data + list(adapter_cards(s).values()))

    @app.get("/v1/models/{model_id:path}", response_model=None)
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        s, _ = serving(request)
        if model_id in s.served_names:
            return model_card(s, model_id).to_wire()
        card = adapter_cards(s).get(model_id)
        if card is None:
            raise APIError(f"The model `{model_id}` does not exist.", status=404, param="model")
        return card.to_wire()

    def internal_only(request: Request, route: str) -> None:
        """Routes that change what an engine serves: the fleet token or an internal
        key only, never a client API key (docs/security.md)."""
        if not state.auth.is_internal(request.headers.get("authorization")):
            raise APIError(
                f"{route}: only the fleet token or an internal API key may call it",
                status=403,
            )

    async def lora_body(request: Request, route: str, allowed: frozenset[str]) -> LoRALoad:
        """The load or unload body."""
        try:
            raw = await request.json()
        except (ValueError, RecursionError):
            raise APIError("the body is not valid JSON (or is nested too deeply)") from None
        try:
            body = LoRALoad.from_json(raw, route, allowed)
        except LoRABodyError as e:
            raise APIError(str(e), param=e.param) from None
        return body

    @app.post("/v1/load_lora_adapter", response_model=None)
    async def load_lora_adapter(request: Request) -> Response:
        """vLLM's run-time load: {"lora_name", "lora_path"}; 400 naming the adapter
        when it cannot be served (the engine keeps serving). ``lora_path`` may be
        ``hf://ORG/NAME``, with an optional ``revision``: the engine downloads it
        first (lora/hub.py)."""
        internal_only(request, "/v1/load_lora_adapter")
        serving(request)
        body = await lora_body(request, "/v1/load_lora_adapter", lora_contract.LOAD_FIELDS)
        name, path, revision = body.lora_name, body.lora_path, body.revision
        if path is None:
            raise APIError("lora_path: required", param="lora_path")
        if state.engine is None:
            raise RuntimeError("broken invariant: state.engine is not None")
        try:
            await state.engine.load_lora(name, path, revision=revision)
        except LoRAError as e:
            if e.name_taken:  # vLLM's 400; the gateway then reads the card
                taken = lora_contract.already_loaded(name, e.already_loaded)
                raise APIError(taken.message, taken.status, taken.param) from None
            raise APIError(str(e), param="lora_name" if e.bad_name else "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_model=None)
    async def unload_lora_adapter(request: Request) -> Response:
        internal_only(request, "/v1/unload_lora_adapter")
        serving(request)
        body = await lora_body(request, "/v1/unload_lora_adapter", lora_contract.UNLOAD_FIELDS)
        name, int_id = body.lora_name, body.lora_int_id
        if state.engine is None:
            raise RuntimeError("broken invariant: state.engine is not None")
        try:
            await state.engine.call(lambda engine: engine.remove_lora(name, int_id))
        except LoRAError as e:
            if e.wrong_id:  # loaded, under another id: nothing was unloaded
                raise APIError(str(e), param=lora_contract.INT_ID) from None
            raise APIError(str(e), status=404, param="lora_name") from None
        state.engine.lora_sources.pop(name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @app.get("/version", response_model=None)
    async def version() -> dict[str, str]:
        from importlib.metadata import version as v

        return {"version": v("pdfleet")}

    async def respond(
        request: Request, coro_or_stream: Any, stream: bool, rid: str, migratable: bool = False
    ) -> Response:
        headers = echo_headers(request, rid)
        handoff = state.handoff if migratable else None
        if stream:
            events = await coro_or_stream
            return StreamingResponse(
                until_disconnected(events, request, handoff),
                media_type="text/event-stream",
                headers=headers,
            )
        task = asyncio.ensure_future(coro_or_stream)
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return JSONResponse(task.result(), headers=headers)
            if await request.is_disconnected():
                task.cancel()  # aborts the engine request and frees its blocks
                await asyncio.gather(task, return_exceptions=True)
                return JSONResponse({}, status_code=499)
            if handoff is not None and handoff.is_set():
                # Stopping: the gateway sends the request to another engine.
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return error_json(
                    APIError("the engine is stopping; migrate the request", status=503),
                    {MIGRATE_HEADER: "drain"},
                )

    def for_caller(body: CompletionRequest | ChatCompletionRequest, request: Request) -> None:
        client = request.client.host if request.client is not None else None
        body.for_caller(request_caller(request.headers, client, state.auth))

    def internal_fields_only_from_internal_callers(body: Any, request: Request) -> None:
        """kv_transfer_params steer KV pulls and leases, a non-zero priority orders
        admission and preemption, and migration resumes a stream as if its tokens
        were the engine's own: only the fleet token (the gateway, which sets the
        priority from the caller's tenant) or an internal key may send them, never
        a client API key (docs/security.md, docs/flow-control.md, docs/migration.md)."""
        internal = None
        for name, given in (
            (KV_PARAMS, body.kv_transfer_params is not None),
            ("priority", bool(body.priority)),
            ("migration", body.migration is not None),
        ):
            if not given:
                continue
            if internal is None:
                internal = state.auth.is_internal(request.headers.get("authorization"))
            if not internal:
                raise APIError(
                    f"{name}: an internal field; only the fleet token or an internal "
                    "API key may send it, not a client API key",
                    status=403,
                    param=name,
                )
        if body.migration is not None:
            state.check_resume(body.migration.resume_identity)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        internal_fields_only_from_internal_callers(body, request)
        s, _ = serving(request)
        for_caller(body, request)
        rid = request_id(request, "cmpl")
        out = response_id(request, "cmpl", rid, body)
        migratable = body.migration is not None
        if body.stream:
            return await respond(
                request, s.completion_stream(body, rid, out), True, rid, migratable
            )
        return await respond(request, s.completion(body, rid, out), False, rid, migratable)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        internal_fields_only_from_internal_callers(body, request)
        _, s = serving(request)
        for_caller(body, request)
        rid = request_id(request, "chatcmpl")
        out = response_id(request, "chatcmpl", rid, body)
        migratable = body.migration is not None
        if body.stream:
            return await respond(request, s.chat_stream(body, rid, out), True, rid, migratable)
        return await respond(request, s.chat(body, rid, out), False, rid, migratable)

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        """SageMaker's route, as vLLM serves it: a chat body (``messages``) or a
        completions body (``prompt``), answered as that endpoint answers it."""
        try:
            raw = await request.json()
        except (ValueError, RecursionError):
            raise APIError("the body is not valid JSON (or is nested too deeply)") from None
        if not isinstance(raw, dict) or not ("messages" in raw or "prompt" in raw):
            raise APIError(
                "/invocations takes a chat body (messages) or a completions body (prompt)",
                param="messages",
            )
        model_cls = ChatCompletionRequest if "messages" in raw else CompletionRequest
        try:
            body = model_cls.model_validate(raw)
        except ValidationError as e:
            errors = e.errors()
            loc = errors[0]["loc"] if errors else ()
            msg = errors[0]["msg"] if errors else "invalid request"
            param = ".".join(str(x) for x in loc[:8]) or None
            raise APIError(f"{param or 'body'}: {msg}", param=param) from None
        if isinstance(body, ChatCompletionRequest):
            return await chat(body, request)
        return await completions(body, request)

    # vLLM's render routes: what a completions or chat request becomes (its
    # prompt's token ids and resolved sampling parameters) without generating.
    # vLLM's P/D routers call them to tokenize once before routing. Every check
    # of the generation route runs (fields, lengths, logprob bounds, grammars),
    # so a body that renders is one the generation route admits.
    @app.post("/v1/completions/render", response_model=None)
    async def completions_render(body: CompletionRequest, request: Request) -> list[dict[str, Any]]:
        internal_fields_only_from_internal_callers(body, request)
        s, _ = serving(request)
        for_caller(body, request)
        model, jobs = await s.prepare_completion(body)
        return [rendered(body, random_id("cmpl"), model, ids, params) for _, ids, params in jobs]

    @app.post("/v1/chat/completions/render", response_model=None)
    async def chat_render(body: ChatCompletionRequest, request: Request) -> dict[str, Any]:
        internal_fields_only_from_internal_callers(body, request)
        _, s = serving(request)
        for_caller(body, request)
        model, _text, ids, params, _k, _parser = await s.prepare_chat(body)
        return rendered(body, random_id("chatcmpl"), model, ids, params)

    @app.get("/tokenizer_info", response_model=None)
    async def tokenizer_info(request: Request) -> dict[str, Any]:
        s, _ = serving(request)
        return tokenizer_config(s._need_tokenizer(), s.options.chat_template)

    @app.post("/tokenize", response_model=None)
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        s, _ = serving(request)
        s.check_model(body.model)
        # Not bounded by the context (counting a too-long prompt is what it is for):
        # the body limit bounds it, and large prompts take the large lane.
        prompt = body.prompt
        if prompt is not None and body.messages is None:
            ids = await s.lanes.run(
                len(prompt), lambda: s.tokenize(prompt, body.add_special_tokens is not False)
            )
        elif body.messages is not None and prompt is None:
            _, ids = await s.chat_prompt(body, bounded=False)
        else:
            raise APIError("give exactly one of prompt or messages", param="prompt")
        out: dict[str, Any] = {"count": len(ids), "max_model_len": s.max_model_len, "tokens": ids}
        if body.return_token_strs:
            tok = s._need_tokenizer()
            out["token_strs"] = tok.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize", response_model=None)
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
        s, _ = serving(request)
        s.check_model(body.model)
        vocab = state.config.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(
                f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens"
            )
        return {"prompt": s._need_tokenizer().decode(body.tokens)}

    return app


def sampling_dict(params: SamplingParams) -> dict[str, Any]:
    """``params`` as JSON, vLLM's names: ``logit_bias`` a token-id map, the
    grammar (``structured_outputs``) with only the fields it sets."""
    # Field by field, not asdict: asdict would deep-copy a compiled grammar.
    out = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    out["stop"], out["stop_token_ids"] = list(params.stop), list(params.stop_token_ids)
    out["logit_bias"] = {str(t): b for t, b in params.logit_bias} if params.logit_bias else None
    grammar = params.structured_outputs
    out["structured_outputs"] = (
        {
            f.name: getattr(grammar, f.name)
            for f in dataclasses.fields(grammar)
            if f.name != "compiled" and getattr(grammar, f.name) not in (None, False)
        }
        if grammar is not None
        else None
    )
    return out


def rendered(
    body: CompletionRequest | ChatCompletionRequest,
    request_id: str,
    model: str,
    ids: list[int],
    params: SamplingParams,
) -> dict[str, Any]:
    """One rendered prompt in the shape of vLLM's render routes (its
    ``GenerateRequest``): what the generation route would run, not run."""
    return {
        "request_id": request_id,
        "token_ids": ids,
        "features": None,  # multimodal features: pdfleet serves text models
        "sampling_params": sampling_dict(params),
        "model": body.model if body.model is not None else model,
        "stream": bool(body.stream),
        "stream_options": body.stream_options.model_dump()
        if body.stream and body.stream_options
        else None,
        "cache_salt": body.cache_salt,
        "priority": body.priority,
        KV_PARAMS: body.kv_transfer_params,
        "token_offsets": None,  # return_token_offsets is refused (request_fields.py)
    }


# Tokenizer settings that name files on the server: not part of the answer.
_LOCAL_KEYS = ("name_or_path", "_file", "_dir")


def tokenizer_config(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    """``GET /tokenizer_info`` as vLLM answers it: the tokenizer's settings (its
    ``tokenizer_config.json``), ``tokenizer_class`` and the chat template the
    server applies; special tokens as their text. Settings that name files on
    the server are left out."""

    def plain(value: Any, depth: int = 0) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if depth < 8 and isinstance(value, dict):
            return {str(k): plain(v, depth + 1) for k, v in value.items()}
        if depth < 8 and isinstance(value, (list, tuple)):
            return [plain(v, depth + 1) for v in value]
        content = getattr(value, "content", None)  # an AddedToken
        return content if isinstance(content, str) else str(value)

    config = {
        k: plain(v)
        for k, v in dict(getattr(tokenizer, "init_kwargs", {}) or {}).items()
        if not any(k.endswith(x) for x in _LOCAL_KEYS)
    }
    config["tokenizer_class"] = type(tokenizer).__name__
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        config["chat_template"] = template
    return config


def run_server(
    config: EngineConfig,
    host: str,
    port: int,
    max_waiting_requests: int,
    auth: EngineAuth | None = None,
    log_level: str = "info",
    limits: RequestLimits | None = None,
    large_prompt_chars: int = 1 << 16,
    options: ChatOptions | None = None,
) -> int:
    """Serve until stopped; 0 after a clean stop, 1 when loading or the engine failed."""
    auth = auth or EngineAuth()
    limits = limits or RequestLimits()
    auth.warn_if_open()
    logging.getLogger("pdfleet.http").setLevel(log_level.upper())
    state = ServerState(config, max_waiting_requests, auth, limits, large_prompt_chars, options)
    app = build_app(state)
    # --shutdown-timeout 0 aborts in-flight requests at once (as vLLM's); a
    # stream the gateway can migrate is handed back to it then (": migrate"),
    # which takes it up to HANDOFF_SECONDS more to write and end.
    grace = config.shutdown_timeout + HANDOFF_SECONDS
    server = HttpServer(app, limits, graceful_timeout=grace, name="engine")

    def stopping() -> None:
        # New requests get a 503 from now on (the gateway sends them elsewhere);
        # the streams in flight get --shutdown-timeout to end, then go back.
        state.draining = True
        handoff = state.handoff
        if handoff is not None:
            asyncio.get_running_loop().call_later(config.shutdown_timeout, handoff.set)
            logger.info(
                "stopping: migratable requests are handed back to the gateway in %ds",
                config.shutdown_timeout,
            )

    server.on_stop = stopping

    def exit_for_restart() -> None:
        # Requests in flight were already failed: a graceful stop ends as soon as
        # their error answers are written (a forced one could close a connection
        # before its 500). Forced after a moment, and the process goes even if a
        # connection holds the stop open.
        server.stop_threadsafe()
        force = threading.Timer(EXIT_FLUSH_SECONDS, lambda: server.stop_threadsafe(force=True))
        force.daemon = True
        force.start()
        timer = threading.Timer(10.0, lambda: os._exit(1))
        timer.daemon = True
        timer.start()

    state.on_exit = exit_for_restart

    def watch_load() -> None:
        while not state.ready.wait(0.2):
            if state.load_error is not None:
                server.stop_threadsafe()
                return

    threading.Thread(target=watch_load, daemon=True).start()
    code = server.run(host, port)
    state.lanes.shutdown()
    if isinstance(state.load_error, LoRAError):
        raise ValueError(f"--lora-modules: {state.load_error}")
    return 1 if code or state.load_error is not None or state.fatal is not None else 0
