"""OpenTelemetry tracing across the P/D hop (docs/observability.md).

Off unless the standard ``OTEL_*`` variables ask for it
(``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_TRACES_EXPORTER=otlp|console``) or the engine's
``--otlp-traces-endpoint`` flag gives an endpoint; ``OTEL_SDK_DISABLED=true``
and ``OTEL_TRACES_EXPORTER=none`` turn it off. While off nothing of
OpenTelemetry is imported and every hook below returns at its first line.

One P/D request is one trace (W3C ``traceparent`` carries it between
processes; a client's own ``traceparent`` is only linked, unless the operator
trusts clients' trace context: ``_ServerSpans``)::

    gateway: POST /v1/completions       routing decision, scores, fallback
      gateway: prefill leg              one per attempt (a failed one is an error)
        prefill engine: prefill request
          queue                         arrival -> first scheduled
          prefill forward               first scheduled -> first token
          end                           finish reason
      gateway: decode leg               time to first token as the client sees it
        decode engine: decode request
          kv pull                       bytes, blocks, GB/s, peer engine
          decode                        first scheduled -> finished, TTFT
          end                           finish reason

Engine-side spans are built when the request finishes, from the timestamps the
engine already keeps (``RequestOutput.metrics``), so the engine loop does no
tracing work at all; the KV pull span is built on the connector's thread when
the pull ends.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .contracts.kv_params import KVTransferParams

if TYPE_CHECKING:
    from starlette.types import Message, Receive, Send

logger = logging.getLogger("pdfleet.tracing")

TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
EXPORTER_ENV = "OTEL_TRACES_EXPORTER"
SDK_DISABLED_ENV = "OTEL_SDK_DISABLED"
TRACER_NAME = "pdfleet"

# The tracer once tracing is on (None: off, and every hook is a no-op).
_tracer: Any = None
_lock = threading.Lock()
# Monotonic clock -> Unix nanoseconds (the engine's timestamps are monotonic).
_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()
# Engine request id -> span context of its server span, for the KV pull span
# that the connector's thread builds.
_parents: dict[str, Any] = {}


def tracing_requested(
    environ: Mapping[str, str] | None = None, endpoint: str | None = None
) -> bool:
    """Whether the ``OTEL_*`` variables (or an explicit endpoint) turn tracing on."""
    env = os.environ if environ is None else environ
    if env.get(SDK_DISABLED_ENV, "").strip().lower() == "true":
        return False
    exporter = env.get(EXPORTER_ENV, "").strip().lower()
    if exporter == "none":
        return False
    if exporter:
        if exporter not in ("otlp", "console"):
            raise ValueError(
                f"{EXPORTER_ENV}={exporter!r}: pdfleet exports traces with 'otlp' "
                "(OTLP/HTTP) or 'console'; set one of those or 'none'"
            )
        return True
    return bool(endpoint or env.get(TRACES_ENDPOINT_ENV) or env.get(ENDPOINT_ENV))


def enabled() -> bool:
    return _tracer is not None


def init_tracing(component: str, endpoint: str | None = None) -> bool:
    """Start the SDK for this process when requested; idempotent. Returns whether on.

    ``component`` (gateway, engine) names the service unless
    ``OTEL_SERVICE_NAME`` does. ``endpoint`` is a full OTLP/HTTP traces URL
    (``http://collector:4318/v1/traces``) and wins over the variables.
    """
    global _tracer
    if _tracer is not None:
        return True
    if not tracing_requested(endpoint=endpoint):
        return False
    with _lock:
        if _tracer is not None:
            return True
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if os.environ.get(EXPORTER_ENV, "").strip().lower() == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporter: Any = ConsoleSpanExporter()
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
        # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES override these defaults.
        resource = Resource.create({"service.name": f"pdfleet-{component}"})
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        # pdfleet's own provider, not the global one: libraries that trace through
        # the global provider (FastAPI's native telemetry spans every health check
        # and scrape) stay silent; only the spans of docs/observability.md go out.
        atexit.register(provider.shutdown)  # flush what is queued on a clean exit
        _tracer = provider.get_tracer(TRACER_NAME)
        logger.info("tracing on: %s spans exported over OTLP/HTTP", component)
    return True


def _ns(monotonic_s: float) -> int:
    return int(monotonic_s * 1e9) + _EPOCH_OFFSET_NS


# -- HTTP servers (gateway and engine) --------------------------------------------------


class _ServerSpans:
    """Pure ASGI middleware: one SERVER span per POST, current for the whole
    request, streamed body included.

    A caller's ``traceparent`` is the span's parent only when ``trusted`` says
    so for its headers (an engine: the fleet token, i.e. the gateway; either:
    the operator's opt-in). Anyone else's starts a new trace, which the
    configured sampler (``OTEL_TRACES_SAMPLER``) decides on, linked to the
    caller's span: a client can neither force spans to be exported with its
    sampled flag nor pick the trace id a ratio sampler decides on."""

    def __init__(
        self, app: Any, component: str, trusted: Callable[[dict[str, str]], bool] | None = None
    ) -> None:
        self.app = app
        self.component = component
        self.trusted = trusted

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        parent = TraceContextTextMapPropagator().extract(carrier)
        links = None
        if self.trusted is None or not self.trusted(carrier):
            caller = trace.get_current_span(parent).get_span_context()
            if caller.is_valid:
                links = [trace.Link(caller, {"pdfleet.link": "caller"})]
            parent = context.Context()  # a root: the configured sampler decides
        path = scope.get("path", "")
        span = _tracer.start_span(
            f"{self.component} POST {path}",
            context=parent,
            links=links,
            kind=trace.SpanKind.SERVER,
            attributes={
                "http.request.method": "POST",
                "url.path": path,
                "pdfleet.component": self.component,
                "pdfleet.request_id": carrier.get("x-request-id", ""),
            },
        )
        status = 0

        async def traced_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                span.set_attribute("http.response.status_code", status)
            await send(message)

        token = context.attach(trace.set_span_in_context(span, parent))
        try:
            await self.app(scope, receive, traced_send)
        except BaseException as e:
            span.record_exception(e)
            span.set_status(trace.Status(trace.StatusCode.ERROR, type(e).__name__))
            raise
        finally:
            context.detach(token)
            if status >= 500:
                span.set_status(trace.Status(trace.StatusCode.ERROR, f"HTTP {status}"))
            span.end()


def instrument_app(
    app: Any,
    component: str,
    endpoint: str | None = None,
    trusted: Callable[[dict[str, str]], bool] | None = None,
) -> None:
    """Trace ``app``'s POST requests when tracing is requested (else nothing).

    ``trusted(headers)``: whether a request's ``traceparent`` may continue its
    trace (see ``_ServerSpans``); None trusts no caller."""
    if init_tracing(component, endpoint):
        app.add_middleware(_ServerSpans, component=component, trusted=trusted)


def set_attributes(**attributes: Any) -> None:
    """Add ``pdfleet.<name>`` attributes to the current span (no-op when off)."""
    if _tracer is None:
        return
    from opentelemetry import trace

    span = trace.get_current_span()
    for name, value in attributes.items():
        if value is not None:
            span.set_attribute(f"pdfleet.{name}", value)


# -- gateway ---------------------------------------------------------------------------


def route_chosen(route: Any) -> None:
    """The gateway's routing decision on the request span."""
    if _tracer is None:
        return
    set_attributes(
        route_decision=route.decision,
        route_reason=route.reason,
        decode_engine=route.decode.url,
        prefill_engine=route.prefill.url if route.prefill is not None else None,
    )


class ScoredEngine(Protocol):
    """What the request span names of an engine ``Router.pick`` scored."""

    url: str
    role: str


def route_scores(scored: Sequence[tuple[float, ScoredEngine, int]]) -> None:
    """``Router.pick``'s (score, engine, matched blocks) triples on the request span."""
    if _tracer is None or not scored:
        return
    role = scored[0][1].role
    set_attributes(
        **{
            f"{role}_scores": [f"{e.url}={s:.3f}" for s, e, _ in scored],
            f"{role}_prefix_blocks": [f"{e.url}={b}" for _, e, b in scored],
        }
    )


def fallback(reason: str) -> None:
    """The request is served decode-only without a producer's KV."""
    if _tracer is None:
        return
    from opentelemetry import trace

    span = trace.get_current_span()
    span.set_attribute("pdfleet.fallback", reason)
    span.add_event("fallback", {"pdfleet.fallback": reason})


def migrated(reason: str, source: str, target: str, replayed: int, since: float) -> None:
    """A decode leg moved from engine ``source`` to ``target`` (docs/migration.md):
    one span in the request's trace from the failure (``since``, a
    ``perf_counter`` time) to now (the resumed leg's first event)."""
    if _tracer is None:
        return
    start = time.time_ns() - int((time.perf_counter() - since) * 1e9)
    span = _tracer.start_span(
        "migration",
        start_time=start,
        attributes={
            "pdfleet.migration.reason": reason,
            "pdfleet.migration.from": source,
            "pdfleet.migration.to": target,
            "pdfleet.migration.replayed_tokens": replayed,
        },
    )
    span.end()


class _LegResponse:
    """An upstream streamed response whose leg span ends when it is closed."""

    def __init__(self, resp: Any, span: Any, started: float) -> None:
        self._resp, self._span, self._started = resp, span, started
        self._first = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._resp, name)

    def _first_chunk(self) -> None:
        if self._first:
            self._first = False
            ttft = time.perf_counter() - self._started
            self._span.set_attribute("pdfleet.time_to_first_chunk_s", ttft)
            self._span.add_event("first chunk")

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        async for chunk in self._resp.aiter_raw():
            self._first_chunk()
            yield chunk

    def read_buffered(self) -> bytes:
        chunk: bytes = self._resp.read_buffered()
        if chunk:
            self._first_chunk()
        return chunk

    async def aclose(self) -> None:
        try:
            await self._resp.aclose()
        finally:
            if self._span.is_recording():
                self._span.end()

    def close(self) -> None:
        try:
            self._resp.close()
        finally:
            if self._span.is_recording():
                self._span.end()


_LEG: contextvars.ContextVar[tuple[str, bool]] = contextvars.ContextVar(
    "pdfleet_leg", default=("decode", False)
)


_NO_LEG = contextlib.nullcontext()
"""What :func:`leg` answers while tracing is off (reusable: it holds no state)."""


def leg(kind: str, kv_transfer: bool = False) -> contextlib.AbstractContextManager[None]:
    """The engine calls made inside are one ``kind`` leg (``prefill`` or
    ``decode``); ``kv_transfer``: a decode leg that carries a producer's
    kv_transfer_params. Named on the leg's CLIENT span; while tracing is off
    nothing reads it, so nothing is set (no generator per leg)."""
    if _tracer is None:
        return _NO_LEG
    return _named_leg(kind, kv_transfer)


@contextlib.contextmanager
def _named_leg(kind: str, kv_transfer: bool) -> Iterator[None]:
    token = _LEG.set((kind, kv_transfer))
    try:
        yield
    finally:
        _LEG.reset(token)


class TracedUpstream:
    """Wraps the gateway's upstream client: one CLIENT span per engine call (a
    leg attempt), whose context travels to the engine as ``traceparent``."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def _start(
        self, url: str, content: bytes, headers: dict[str, str]
    ) -> tuple[Any, dict[str, str]]:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        # The leg the gateway names (``leg``): the prefill leg asks for a remote
        # decode, a decode leg after it carries the producer's params.
        leg, kv_transfer = _LEG.get()
        span = _tracer.start_span(
            f"{leg} leg",
            kind=trace.SpanKind.CLIENT,
            attributes={
                "pdfleet.leg": leg,
                "pdfleet.engine": url.rsplit("/v1/", 1)[0],
                "url.full": url,
                "pdfleet.kv_transfer": kv_transfer,
            },
        )
        out = dict(headers)
        TraceContextTextMapPropagator().inject(out, context=trace.set_span_in_context(span))
        return span, out

    @staticmethod
    def _failed(span: Any, e: BaseException) -> None:
        from opentelemetry import trace

        span.record_exception(e)
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(e).__name__}: {e}"))
        span.end()

    @staticmethod
    def _status(span: Any, status: int) -> None:
        from opentelemetry import trace

        span.set_attribute("http.response.status_code", status)
        if status >= 400:
            span.set_status(trace.Status(trace.StatusCode.ERROR, f"HTTP {status}"))

    async def post(self, url: str, content: bytes, headers: dict[str, str], timeout: float) -> Any:  # noqa: ASYNC109 (passed through to the wrapped client)
        span, headers = self._start(url, content, headers)
        try:
            resp = await self._client.post(url, content, headers, timeout)
        except BaseException as e:
            self._failed(span, e)
            raise
        self._status(span, resp.status_code)
        span.end()
        return resp

    async def stream(self, url: str, content: bytes, headers: dict[str, str]) -> _LegResponse:
        span, headers = self._start(url, content, headers)
        started = time.perf_counter()
        try:
            resp = await self._client.stream(url, content, headers)
        except BaseException as e:
            self._failed(span, e)
            raise
        self._status(span, resp.status_code)
        return _LegResponse(resp, span, started)


def trace_upstream(client: Any, component: str = "gateway") -> Any:
    """The client itself when tracing is off (starts tracing when requested)."""
    return TracedUpstream(client) if init_tracing(component) else client


# -- engine ----------------------------------------------------------------------------


def trace_request(stream: Any, request_id: str, kv_params: KVTransferParams | None) -> Any:
    """Wrap an admitted engine request's output stream (returned as is when off).

    Called at admission, in the request's server span, so a KV pull that ends
    before the first output still finds its parent."""
    if _tracer is None:
        return stream
    return _TracedStream(stream, request_id, kv_params or KVTransferParams())


class _TracedStream:
    """A ``RequestStream`` whose iteration ends with the request's engine spans."""

    def __init__(self, stream: Any, request_id: str, kv: KVTransferParams) -> None:
        from opentelemetry import trace

        self._stream, self.request_id = stream, request_id
        self._server = trace.get_current_span()
        self._parent = trace.set_span_in_context(self._server)
        if kv.produces:
            self._leg = "prefill"
        elif kv.do_remote_prefill:
            self._leg = "decode"
            _parents[request_id] = self._parent
        else:
            self._leg = "decode_only"
        self._server.update_name(f"{'decode' if self._leg == 'decode_only' else self._leg} request")
        self._server.set_attribute("pdfleet.leg", self._leg)
        self._server.set_attribute("pdfleet.engine_request_id", request_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        last = None
        generated = 0  # outputs are deltas: count their tokens as they pass
        failure: BaseException | None = None
        try:
            async for out in self._stream:
                last = out
                generated += sum(len(c.token_ids) for c in out.outputs)
                yield out
        except BaseException as e:
            failure = e
            raise
        finally:
            _parents.pop(self.request_id, None)
            _engine_spans(self._parent, self._server, self._leg, last, generated, failure)

    def close(self) -> None:
        _parents.pop(self.request_id, None)
        self._stream.close()


def _engine_spans(
    parent: Any, server: Any, leg: str, out: Any, generated: int, failure: Any
) -> None:
    """Children of the engine's server span, from the request's timestamps."""
    from opentelemetry import trace

    m = getattr(out, "metrics", None)
    if m is None:
        return
    now = time.monotonic()
    finished = m.finished_time or now
    scheduled = m.first_scheduled_time or finished
    first_token = m.first_token_time
    queue = _tracer.start_span("queue", context=parent, start_time=_ns(m.arrival_time))
    queue.set_attribute("pdfleet.queue_wait_s", scheduled - m.arrival_time)
    queue.end(end_time=_ns(scheduled))
    server.set_attribute("pdfleet.queue_wait_s", scheduled - m.arrival_time)
    num_prompt = len(out.prompt_token_ids or ())
    if leg != "decode" and first_token is not None:
        fwd = _tracer.start_span("prefill forward", context=parent, start_time=_ns(scheduled))
        fwd.set_attribute("pdfleet.prompt_tokens", num_prompt)
        fwd.set_attribute("pdfleet.cached_tokens", out.num_cached_tokens)
        fwd.end(end_time=_ns(first_token))
    if leg != "prefill":
        start = scheduled if leg == "decode" else (first_token or scheduled)
        dec = _tracer.start_span("decode", context=parent, start_time=_ns(start))
        if first_token is not None:
            ttft = first_token - m.arrival_time
            dec.set_attribute("pdfleet.time_to_first_token_s", ttft)
            server.set_attribute("pdfleet.time_to_first_token_s", ttft)
        dec.set_attribute("pdfleet.output_tokens", generated)
        dec.end(end_time=_ns(max(start, finished)))
    reasons = sorted({c.finish_reason for c in out.outputs if c.finish_reason})
    reason = ",".join(reasons) or ("aborted" if failure is not None else "unfinished")
    end = _tracer.start_span("end", context=parent, start_time=_ns(finished))
    end.set_attribute("pdfleet.finish_reason", reason)
    end.set_attribute("pdfleet.output_tokens", generated)
    end.end(end_time=_ns(finished))
    server.set_attribute("pdfleet.finish_reason", reason)
    if failure is not None and not isinstance(failure, GeneratorExit):
        server.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(failure).__name__}"))


def kv_pull(
    request_id: str,
    started: float,
    num_bytes: int,
    num_blocks: int,
    params: KVTransferParams,
    ok: bool,
    why: str,
) -> None:
    """A finished (or failed) KV pull of ``request_id``, as a span of its request.

    ``started`` is the pull's start on the monotonic clock (0: it never started).
    """
    if _tracer is None:
        return
    parent = _parents.get(request_id)
    if parent is None:
        return
    from opentelemetry import trace

    now = time.monotonic()
    start = started or now
    seconds = max(now - start, 1e-9)
    span = _tracer.start_span("kv pull", context=parent, start_time=_ns(start))
    span.set_attribute("pdfleet.kv.bytes", num_bytes if ok else 0)
    span.set_attribute("pdfleet.kv.blocks", num_blocks)
    span.set_attribute("pdfleet.kv.seconds", seconds)
    span.set_attribute("pdfleet.kv.gbps", (num_bytes / seconds / 1e9) if ok else 0.0)
    span.set_attribute("pdfleet.kv.peer_engine_id", params.remote_engine_id or "")
    span.set_attribute("pdfleet.kv.peer", f"{params.remote_host}:{params.remote_port}")
    if not ok:
        span.set_status(trace.Status(trace.StatusCode.ERROR, why))
        span.set_attribute("pdfleet.kv.failure", why)
    span.end(end_time=_ns(now))
