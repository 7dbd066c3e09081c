"""The two-leg P/D protocol (docs/gateway.md) and the relay of the decode leg.

1. Prefill leg (when the router says so): the client's body with
   ``max_tokens: 1`` (and ``max_completion_tokens: 1`` for chat),
   ``stream: false``, without ``stream_options`` / ``min_tokens`` /
   ``min_completion_tokens``, and ``kv_transfer_params`` asking for a remote
   decode — vLLM's names, so either project's engines can be driven. A failed
   leg is retried on another compatible prefill engine, then the request is
   served decode-only; a 4xx (bad input) is the client's answer as is.
2. Decode leg: the client's body plus the ``kv_transfer_params`` the prefill
   engine returned (the raw bytes, unchanged, when there are none). A
   streamed answer is relayed event by event as bytes, never re-serialized;
   if the engine fails mid-stream the client gets an SSE error event in
   OpenAI's shape and ``data: [DONE]`` at once.

Before any leg the body is checked: valid JSON (UTF-8, no lone surrogate, not
nested past the parser's depth), admissible sampling fields (the same check
the engines run, so prefill and decode never disagree), and the client's own
``kv_transfer_params`` are dropped: only what a prefill leg returned goes to
a decode engine. Engines get the fleet token, never the client's key.

Both legs carry the same ``X-Request-Id`` (the client's, or a new one), which
the answer echoes. Every wait is bounded: connect, first-token (the prefill
leg; a stream's first event; sized from the engine's queue), idle (between
events), request timeouts, and the hold while no decode engine is routable.
Clients never see engine URLs or engine bodies: errors carry a stable
``code`` and the details are logged with the request id.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import os
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from pdfleet.engine import tracing
from pdfleet.engine.config.gateway import GatewayConfig
from pdfleet.engine.config.sampling_checks import check_sampling

from .activation import Activation
from .asgi import BytesResponse, Request
from .deadlines import Deadline, IdleTimer
from .engines import EnginePool, EngineState
from .limits import BodyRejected, read_body, ready_body
from .metrics import GatewayMetrics
from .prompt import PromptAnalyzer, PromptInfo
from .routing import KVPairBreaker, NoEngineError, PrefixAffinity, Route, Router
from .upstream import UpstreamClient, UpstreamConnectError, UpstreamError, UpstreamResponse

logger = logging.getLogger("pdfleet.gateway")

PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}
# Stable machine-readable codes (OpenAI's `error.code`), one per kind of failure.
ERROR_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    404: "not_found",
    408: "request_timeout",
    413: "request_too_large",
    499: "client_closed_request",
    500: "internal_error",
    502: "upstream_error",
    503: "no_engine_available",
    504: "upstream_timeout",
}
DONE = b"data: [DONE]\n\n"
# The prompt of a request routed without analysis (``Proxy._sole_route``).
NOT_ANALYZED = PromptInfo(0, analyzed=False)
SSE_CONTENT_TYPE = (b"content-type", b"text/event-stream; charset=utf-8")
JSON_CONTENT_TYPE = (b"content-type", b"application/json")
# Prefill-leg statuses that say "this engine, now" rather than "this input": the
# leg is worth another engine (a decode leg passes them to the client).
RETRYABLE_STATUS = frozenset({408, 429})
# Seconds a client is told to wait (Retry-After) when no decode engine came back.
RETRY_AFTER_SECONDS = 5
# The longest engine error message relayed for a refused (4xx) input.
MAX_RELAYED_MESSAGE = 1000
# A client X-Request-Id is echoed and logged only when it is this tame.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
# New request ids: 64 random bits per process (each worker of --workers N is
# its own interpreter) and a counter: unique across processes and replicas
# like a uuid4, without a system call per request.
_ID_PREFIX = os.urandom(8).hex()
_id_counter = itertools.count()
# A \uD800-\uDFFF escape: the body may hold a lone surrogate (checked only then).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def error_body(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape, with a stable ``code``."""
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "Error"),
            "param": param,
            "code": code or ERROR_CODES.get(status, "error"),
        }
    }


def error_response(
    message: str,
    status: int,
    request_id: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    raw = [JSON_CONTENT_TYPE, (b"x-request-id", request_id.encode("latin-1"))]
    for name, value in (headers or {}).items():
        raw.append((name.lower().encode("latin-1"), value.encode("latin-1")))
    return BytesResponse(json.dumps(error_body(message, status, param, code)).encode(), status, raw)


def sse_error(message: str, status: int, code: str | None = None) -> bytes:
    return b"data: " + json.dumps(error_body(message, status, code=code)).encode() + b"\n\n" + DONE


def prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    out = dict(body)
    out["max_tokens"] = 1
    if chat:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        out.pop(key, None)
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    return {**body, "kv_transfer_params": kv_transfer_params}


def upstream_message(resp: Any) -> str:
    """An engine answer's error message, for the gateway's log (never the client's)."""
    try:
        return str(resp.json()["error"]["message"])[:MAX_RELAYED_MESSAGE]
    except Exception:  # not OpenAI-shaped: log the start of the body
        return resp.text[:200] or resp.reason_phrase


def client_request_id(header: str | None) -> str:
    """The client's X-Request-Id when it is a tame token, else a new id."""
    if header and _REQUEST_ID.fullmatch(header):
        return header
    return f"{_ID_PREFIX}{next(_id_counter):016x}"


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or ValueError saying what is wrong
    (invalid UTF-8 or JSON, nested too deeply, a lone surrogate, not an object)."""
    try:
        # A UTF-8 object (the usual case) decoded here: json.loads(bytes) first
        # guesses among UTF-8/16/32; anything else keeps that path.
        body = json.loads(raw.decode() if raw[:1] == b"{" and raw[1:2] != b"\x00" else raw)
    except RecursionError:
        raise ValueError("the request body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                "the request body holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                "escape), which is not text"
            ) from None
    return body


def field_of(message: str, body: dict[str, Any]) -> str | None:
    """The request field a check_sampling message names (its first word)."""
    name = re.split(r"[\s:(]", message, maxsplit=1)[0]
    # A nested field (response_format.json_schema.schema, tools[0].function.name).
    return name if re.split(r"[.\[]", name, maxsplit=1)[0] in body else None


@dataclass
class Call:
    """One request of the client, as it goes through the legs."""

    endpoint: str
    request_id: str
    start: float
    headers: dict[str, str]
    """What the legs add to the engine client's fixed headers (the request id)."""
    chat: bool
    prefill_url: str | None = None
    """The prefill engine whose KV the decode leg carries, if any."""
    plain_payload: bytes | None = None
    """The decode leg without kv_transfer_params (sent when the engine refuses
    the params: an expired lease, a restarted producer)."""
    body: dict[str, Any] | None = None
    """The parsed body (its prompt is analyzed on demand when it was routed
    without, see ``Proxy._sole_route``)."""
    info: PromptInfo | None = None
    """That analysis, once made."""


@dataclass
class Resend:
    """What a relay needs to send its decode leg to another engine."""

    route: Route
    info: PromptInfo
    payload: bytes
    tried: set[str]
    held: list[bool]


class LegFailed(Exception):
    """An engine call failed in a way another engine might not. ``message`` is
    for the client (no URL, no engine body); ``detail`` is for the log."""

    def __init__(self, message: str, status: int, kind: str, detail: str = "") -> None:
        super().__init__(message)
        self.message, self.status, self.kind = message, status, kind
        self.detail = detail or message


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
        self.affinity = affinity
        self.analyzer = analyzer
        self.metrics = metrics
        self.client = client
        """Sends the content type and the fleet token with every engine call
        (its fixed headers); a call adds its request id."""
        self.breaker = breaker
        self.activation = Activation(metrics.activations)
        self._finished: dict[tuple[str, int], tuple[Any, Any]] = {}
        """The request counter and latency histogram per (endpoint, status)."""
        self._ttft: dict[str, Any] = {}
        """The TTFT histogram per endpoint."""
        self._decisions: dict[tuple[str, str], Any] = {}
        """The routing-decision counter per (decision, reason)."""
        metrics.on_collect(self._inflight_gauges)

    # -- bookkeeping -------------------------------------------------------------

    def _acquire(self, e: EngineState) -> None:
        self.pool.started(e)
        e.inflight += 1

    def _release(self, e: EngineState) -> None:
        e.inflight -= 1

    def _inflight_gauges(self) -> None:
        """At each collection: the in-flight gauges from the engines' counts
        (kept on the engine state, not written to the series per request)."""
        for e in self.pool.engines.values():
            if e.inflight_gauge is None:
                # A re-added engine is a new state, so a removed series is never written again.
                e.inflight_gauge = self.metrics.engine_inflight.labels(e.url, e.role)
            e.inflight_gauge.set(e.inflight)

    def _finish(self, call: Call, status: int) -> None:
        key = (call.endpoint, status)
        series = self._finished.get(key)
        if series is None:  # a few (endpoint, status) pairs: never dropped
            m = self.metrics
            series = self._finished[key] = (
                m.fast_counter(m.requests.labels(call.endpoint, str(status))),
                m.fast_histogram(m.e2e.labels(call.endpoint)),
            )
        series[0].inc()
        series[1].observe(time.perf_counter() - call.start)

    def _first_token_bound(self, e: EngineState) -> float:
        """The first-token wait for ``e``: grows with the requests queued ahead."""
        load = e.load
        return self.config.first_token_bound(max(load.waiting, e.inflight - load.running))

    def _watched(self, e: EngineState, seconds: float) -> Watched:
        """A :class:`Deadline` ``seconds`` from now that also fires at once when the stall
        watchdog ejects ``e`` (it reschedules every registered timeout)."""
        return Watched(e, seconds)

    def _failed(self, e: EngineState, role: str, ex: Exception) -> LegFailed:
        """Classify a transport error; a refused connection ejects the engine at once."""
        detail = f"{role} engine {e.url}: {type(ex).__name__}: {ex}"
        if isinstance(ex, UpstreamConnectError):
            kind, status = "connect", 502
            self.pool.refused(e, f"connection refused: {ex}")
            msg = f"the {role} engine could not be reached"
        elif isinstance(ex, TimeoutError) and e.stalled:
            kind, status = "stalled", 504
            msg = f"the {role} engine stopped making progress"
        elif isinstance(ex, TimeoutError):
            kind, status = "timeout", 504
            msg = f"the {role} engine did not answer in time"
        else:
            kind, status = "broken", 502
            msg = f"the {role} engine failed"
        self.metrics.upstream_errors.labels(e.url, e.role, kind).inc()
        return LegFailed(msg, status, kind, detail)

    def _status_error(self, e: EngineState, role: str, resp: UpstreamResponse) -> LegFailed:
        self.metrics.upstream_errors.labels(e.url, e.role, "status").inc()
        status = 503 if resp.status_code == 503 else 502
        return LegFailed(
            f"the {role} engine answered {resp.status_code}",
            status,
            "status",
            f"{role} engine {e.url} answered {resp.status_code}: {upstream_message(resp)}",
        )

    def _passthrough(self, call: Call, resp: UpstreamResponse, content: bytes) -> Response:
        """A 2xx answer as is; a refusal (4xx) re-shaped so no engine body leaks."""
        if resp.status_code >= 300:
            return self._refused(call, resp)
        self._finish(call, resp.status_code)
        kind = resp.header(b"content-type")
        return BytesResponse(
            content,
            resp.status_code,
            [
                JSON_CONTENT_TYPE if kind is None else (b"content-type", kind),
                (b"x-request-id", call.request_id.encode("latin-1")),
            ],
        )

    def _refused(self, call: Call, resp: UpstreamResponse) -> Response:
        """An engine's 4xx for the client's input: its OpenAI message, field and
        code (what the client must change), nothing else of the engine's body."""
        status = resp.status_code
        message, param, code = f"the request was refused ({status})", None, None
        try:
            err = resp.json()["error"]
            if isinstance(err.get("message"), str):
                message = err["message"][:MAX_RELAYED_MESSAGE]
            if isinstance(err.get("param"), str):
                param = err["param"]
            if isinstance(err.get("code"), str):
                code = err["code"]
        except Exception:  # not OpenAI-shaped: logged, not relayed
            logger.info(
                "request %s: engine refusal %d: %r", call.request_id, status, resp.text[:200]
            )
        self._finish(call, status)
        headers = {}
        if "retry-after" in resp.headers:
            headers["retry-after"] = resp.headers["retry-after"]
        return error_response(message, status, call.request_id, param, code, headers)

    def _error(
        self,
        call: Call,
        message: str,
        status: int,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> Response:
        self._finish(call, status)
        return error_response(message, status, call.request_id, param, code, headers)

    def _leg_error(self, call: Call, failure: LegFailed) -> Response:
        logger.warning("request %s: %s", call.request_id, failure.detail)
        return self._error(call, failure.message, failure.status)

    def _params_refused(self, call: Call, resp: UpstreamResponse) -> bool:
        """The decode engine refused the producer's kv_transfer_params (a 400
        naming them: expired lease, restarted producer); worth a decode-only leg."""
        if resp.status_code != 400 or call.plain_payload is None or call.prefill_url is None:
            return False
        try:
            message = resp.json()["error"]["message"]
        except Exception:
            return False
        return isinstance(message, str) and message.startswith("kv_transfer_params")

    def _without_params(self, call: Call, e: EngineState, resp: UpstreamResponse) -> bytes:
        """Mutates: the call goes on decode-only (the engine computes the prompt)."""
        logger.warning(
            "request %s: decode engine %s refused the producer's params (%s); decode-only",
            call.request_id,
            e.url,
            upstream_message(resp),
        )
        self.metrics.fallbacks.labels("kv_params_refused").inc()
        tracing.fallback("kv_params_refused")
        self._pair_failed(call, e)
        call.prefill_url = None  # refused once: the plain leg is final
        assert call.plain_payload is not None  # _params_refused checked it
        return call.plain_payload

    def _pair_failed(self, call: Call, decode: EngineState) -> None:
        if self.breaker is not None and call.prefill_url is not None:
            self.breaker.leg_failed(call.prefill_url, decode.url)

    # -- entry -------------------------------------------------------------------

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
        try:  # read before the watcher below takes over receive()
            raw = ready_body(request, self.config.max_body_bytes)
            if raw is None:
                raw = await read_body(request, self.config.max_body_bytes, self.config.body_timeout)
        except BodyRejected as e:
            reason = {413: "body_too_large", 408: "body_timeout"}.get(e.status, "invalid_body")
            self.metrics.rejected.labels(reason).inc()
            # The rest of the body is never read: the connection cannot be reused.
            return self._error(call, e.message, e.status, headers={"connection": "close"})
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
            self._finish(call, 499)
            return Response(status_code=499)
        finally:
            if not handed:
                watch.close()

    def _invalid(self, call: Call, reason: str, message: str, param: str | None = None):
        self.metrics.rejected.labels(reason).inc()
        return self._error(call, message, 400, param)

    async def _handle(self, call: Call, raw: bytes) -> Response:
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
            return self._error(call, f"The model `{body['model']}` does not exist.", 404, "model")
        route = self._sole_route()
        try:
            # The engines' own admissibility check: a body one engine would refuse
            # never reaches a prefill engine (no KV pinned for a doomed request).
            check_sampling(body)
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
            outcome = await self._prefill(call, body, route, info)
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
            return await self._decode_stream(call, route, info, payload)
        return await self._decode_json(call, route, info, payload)

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

    def _analyzed(self, call: Call, info: PromptInfo) -> PromptInfo:
        """``info``, analyzed now if the request was routed without it."""
        if info.analyzed or call.body is None:
            return info
        if call.info is None:
            try:
                call.info = self.analyzer.analyze(call.body, call.chat, self.pool.block_size)
            except (ValueError, TypeError, AttributeError):  # the engine refuses such a body
                call.info = PromptInfo(0)
        return call.info

    def _record(self, call: Call, info: PromptInfo, url: str) -> None:
        """The affinity table learns that ``url`` now holds the prompt's blocks
        (when they were hashed: a request routed alone, and never failed over,
        was not analyzed)."""
        if not info.analyzed and call.info is not None:
            info = call.info
        if info.block_hashes:
            self.affinity.record(info.block_hashes, url)

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
        return self._error(
            call,
            "no decode engine is available; retry later",
            503,
            headers={"retry-after": str(RETRY_AFTER_SECONDS)},
        )

    # -- prefill -----------------------------------------------------------------

    async def _prefill(
        self, call: Call, body: dict[str, Any], route: Route, info: PromptInfo
    ) -> dict[str, Any] | Response | None:
        """The prefill leg with retries: the producer's kv_transfer_params; None
        to serve decode-only; a Response when the input itself was refused."""
        payload = json.dumps(prefill_body(body, call.chat)).encode()
        engine: EngineState | None = route.prefill
        tried: set[str] = set()
        while engine is not None:
            tried.add(engine.url)
            try:
                result = await self._prefill_once(call, engine, payload)
            except LegFailed as e:
                logger.warning("request %s: %s", call.request_id, e.detail)
                if len(tried) > self.config.retries and e.kind != "stalled":
                    break
                engine = self.router.pick_prefill(route.decode, info, tried)
                if engine is not None:
                    self.metrics.retries.labels("prefill").inc()
                continue
            if isinstance(result, Response):
                return result
            self._record(call, info, engine.url)
            params = result.get("kv_transfer_params")
            if not isinstance(params, dict) or not params:
                # A producer without a connector: the decode engine recomputes.
                self.metrics.fallbacks.labels("no_kv_transfer_params").inc()
                tracing.fallback("no_kv_transfer_params")
                return None
            call.prefill_url = engine.url
            if self.breaker is not None:
                self.breaker.handed_off(engine.url, route.decode.url)
            return params
        self.metrics.fallbacks.labels("prefill_failed").inc()
        tracing.fallback("prefill_failed")
        return None

    async def _prefill_once(
        self, call: Call, e: EngineState, payload: bytes
    ) -> dict[str, Any] | Response:
        bound = self._first_token_bound(e)
        self._acquire(e)
        try:
            with self._watched(e, bound):
                # None: _watched bounds the call (one timer per leg, not two).
                resp = await self.client.post(e.url + call.endpoint, payload, call.headers, None)
        except (UpstreamError, TimeoutError) as ex:
            raise self._failed(e, "prefill", ex) from None
        finally:
            self._release(e)
        self.pool.progress(e)
        if resp.status_code == 200:
            try:
                data = resp.json()
            except ValueError:
                self.metrics.upstream_errors.labels(e.url, e.role, "status").inc()
                raise LegFailed(
                    "the prefill engine sent an invalid answer",
                    502,
                    "status",
                    f"prefill engine {e.url} sent invalid JSON",
                ) from None
            return data if isinstance(data, dict) else {}
        if 400 <= resp.status_code < 500 and resp.status_code not in RETRYABLE_STATUS:
            return self._refused(call, resp)
        raise self._status_error(e, "prefill", resp)

    # -- decode ------------------------------------------------------------------

    async def _next_decode(
        self, call: Call, route: Route, info: PromptInfo, tried: set[str], held: list[bool]
    ) -> EngineState | None:
        """Another decode engine after a refused connection or a stall (same
        compat hash, so a producer's KV stays usable); when there is none,
        hold once (--hold-timeout) for one to become routable again."""
        want = route.decode.load.compat_hash

        def candidates(exclude: set[str]) -> list[EngineState]:
            return [
                e
                for e in self.pool.candidates("decode")
                if e.url not in exclude and e.load.compat_hash == want
            ]

        found = candidates(tried) if len(tried) <= self.config.retries else []
        if not found and not held[0]:
            held[0] = True  # a restarted engine comes back under its own URL
            self.metrics.held.inc()
            try:
                deadline = time.monotonic() + self.config.hold_timeout
                while not found and await self.pool.wait_routable("decode", deadline):
                    found = candidates(set())
                    if not found:
                        await asyncio.sleep(self.config.scrape_interval)
            finally:
                self.metrics.held.dec()
        info = self._analyzed(call, info)
        picked = self.router.pick(found, info.block_hashes, info.exact_hashes)
        if picked is None:
            return None
        self.metrics.retries.labels("decode").inc()
        return picked[0]

    async def _decode_json(
        self, call: Call, route: Route, info: PromptInfo, payload: bytes
    ) -> Response:
        e: EngineState | None = route.decode
        tried: set[str] = set()
        held = [False]
        while e is not None:
            tried.add(e.url)
            self._acquire(e)
            try:
                with self._watched(e, self.config.request_timeout):
                    resp = await self.client.post(
                        e.url + call.endpoint, payload, call.headers, None
                    )
            except (UpstreamError, TimeoutError) as ex:
                self._release(e)
                failure = self._failed(e, "decode", ex)
                logger.warning("request %s: %s", call.request_id, failure.detail)
                if failure.kind in ("connect", "stalled"):
                    nxt = await self._next_decode(call, route, info, tried, held)
                    if nxt is not None:
                        e = nxt
                        continue
                self._pair_failed(call, e)
                return self._error(call, failure.message, failure.status)
            except BaseException:
                self._release(e)
                raise
            self._release(e)
            self.pool.progress(e)
            if self._params_refused(call, resp):
                payload = self._without_params(call, e, resp)
                tried.discard(e.url)
                continue
            if resp.status_code < 500:  # incl. 429: the client should back off, not us
                if resp.status_code == 200:
                    self._record(call, info, e.url)
                return self._passthrough(call, resp, resp.content)
            self._pair_failed(call, e)
            return self._leg_error(call, self._status_error(e, "decode", resp))
        raise AssertionError("unreachable: the loop starts with the routed engine")

    async def _decode_stream(
        self, call: Call, route: Route, info: PromptInfo, payload: bytes
    ) -> Response:
        """Open the decode stream; answer as soon as the engine accepts it.

        Headers go out while the engine computes the first token (as the
        engine's own do), so the gateway's response setup is off the TTFT
        path. Failures before the engine accepts (refused connection or a
        stall: next engine; 4xx/5xx: that status) are plain HTTP errors;
        later ones, including a first-token timeout, are SSE error events.
        """
        e: EngineState | None = route.decode
        tried: set[str] = set()
        held = [False]
        while e is not None:
            tried.add(e.url)
            try:
                opened = await self._open_stream(call, e, payload)
                if opened == "params_refused":
                    assert call.plain_payload is not None
                    payload = call.plain_payload
                    tried.discard(e.url)
                    continue
            except LegFailed as failure:
                logger.warning("request %s: %s", call.request_id, failure.detail)
                if failure.kind in ("connect", "stalled"):
                    nxt = await self._next_decode(call, route, info, tried, held)
                    if nxt is not None:
                        e = nxt
                        continue
                self._pair_failed(call, e)
                return self._error(call, failure.message, failure.status)
            if isinstance(opened, Response):
                return opened
            # Not relayed, so never None; "params_refused" was handled above.
            assert isinstance(opened, tuple)
            self._record(call, info, e.url)
            resp, chunks = opened
            return RelayResponse(
                self._relay(call, e, resp, chunks, Resend(route, info, payload, tried, held)),
                functools.partial(self._abandon, call, e, resp),
                call.request_id,
            )
        raise AssertionError("unreachable: the loop starts with the routed engine")

    async def _abandon(self, call: Call, e: EngineState, resp: UpstreamResponse) -> None:
        """What a relay that never started would have released (the client left
        before its headers went out)."""
        await resp.aclose()
        self._release(e)
        self._finish(call, 499)

    async def _open_stream(
        self, call: Call, e: EngineState, payload: bytes, relayed: bool = False
    ) -> tuple[UpstreamResponse, AsyncIterator[bytes]] | Response | str | None:
        """(accepted response, its chunk iterator), holding ``e`` (the relay
        releases it); a Response for an HTTP error (None when ``relayed``: the
        client's headers are gone, so the relay reports it as an event);
        ``"params_refused"`` when the engine refused the producer's params."""
        bound = self._first_token_bound(e)
        self._acquire(e)
        resp: UpstreamResponse | None = None
        handed = False
        try:
            with self._watched(e, bound):
                resp = await self.client.stream(e.url + call.endpoint, payload, call.headers)
                self.pool.progress(e)
                if resp.status_code != 200:
                    content = await resp.aread()
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
                        return self._passthrough(call, resp, content)
                    self._pair_failed(call, e)
                    return self._leg_error(call, self._status_error(e, "decode", resp))
            handed = True  # the relay closes the response and releases the engine
            return resp, resp.aiter_raw()
        except (UpstreamError, TimeoutError) as ex:
            raise self._failed(e, "decode", ex) from None
        finally:
            if not handed:
                if resp is not None:
                    await resp.aclose()
                self._release(e)

    async def _relay(
        self,
        call: Call,
        engine: EngineState,
        resp: UpstreamResponse,
        chunks: AsyncIterator[bytes],
        resend: Resend | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """Relay whole SSE events (so an error event never lands mid-event).

        Bytes are forwarded as they come, cut only at the last event boundary
        of what arrived (never parsed or re-serialized); the relay watches
        only for the first event (TTFT) and the ``[DONE]`` that ends a stream.

        An engine ejected for a stall before its first event is replaced: the
        client has only seen headers, so the decode leg is sent to another
        engine (``resend``) and that engine's stream is relayed instead. After
        the first event a stall ends the stream with an error event at once
        (the client can retry) rather than after the stopped engine resumes.
        """
        status = 200
        done = False
        first = True
        ended = False
        buf = b""
        first_bound: float | None = None  # (sized when there is a wait to bound)
        limit = self.config.max_body_bytes
        idle = self.config.idle_timeout
        try:
            while first:  # until the first whole event: the engine may still change
                try:
                    if resp.buffered():  # already here: there is no wait to bound
                        data = await anext(chunks)
                    else:
                        if first_bound is None:
                            first_bound = self._first_token_bound(engine)
                        with self._watched(engine, first_bound):
                            data = await anext(chunks)
                except StopAsyncIteration:
                    ended = True
                    break
                except TimeoutError:
                    if not (engine.stalled and resend is not None):
                        raise
                    moved = await self._resend(call, engine, resend)
                    if moved is None:
                        raise
                    await resp.aclose()
                    self._release(engine)
                    engine, resp, chunks = moved
                    first_bound = None
                    continue
                self.pool.progress(engine)
                buf += data
                if len(buf) > limit:
                    raise UpstreamError(f"an event of over {limit} bytes")
                cut = buf.rfind(b"\n\n")
                if cut < 0:
                    continue
                out, buf = buf[: cut + 2], buf[cut + 2 :]
                first = False
                ttft = self._ttft.get(call.endpoint)
                if ttft is None:
                    ttft = self._ttft[call.endpoint] = self.metrics.fast_histogram(
                        self.metrics.ttft.labels(call.endpoint)
                    )
                ttft.observe(time.perf_counter() - call.start)
                done = out.endswith(DONE)
                yield out
            if not ended:
                # The rest under one idle timeout, pushed back as each chunk
                # arrives and off while the client takes an event (a slow
                # reader is not an idle engine; the stall watchdog, which
                # reschedules the registered timeouts, waits on the engine only).
                # None when the engine's whole answer is here: nothing to wait for.
                with Deadline(None) as cm:
                    timer = None if resp.received() else IdleTimer(cm, idle)
                    if timer is not None:
                        engine.waiters.add(cm)
                    try:
                        async for data in chunks:  # a stall-ejected engine ends its streams now
                            self.pool.progress(engine)
                            buf += data
                            if len(buf) > limit:
                                raise UpstreamError(f"an event of over {limit} bytes")
                            cut = buf.rfind(b"\n\n")
                            if cut < 0:
                                if timer is not None:
                                    timer.touch()
                                continue
                            out, buf = buf[: cut + 2], buf[cut + 2 :]
                            done = done or out.endswith(DONE)
                            if timer is None:
                                yield out
                                continue
                            timer.paused = True
                            engine.waiters.discard(cm)
                            yield out
                            engine.waiters.add(cm)
                            timer.touch()
                    finally:
                        if timer is not None:
                            timer.cancel()
                        engine.waiters.discard(cm)
            if not done:
                self.metrics.upstream_errors.labels(engine.url, engine.role, "broken").inc()
                status = 502
                logger.warning(
                    "request %s: decode engine %s ended the stream early",
                    call.request_id,
                    engine.url,
                )
                self._pair_failed(call, engine)
                yield sse_error("the decode engine ended the stream early", status)
        except (UpstreamError, TimeoutError) as ex:
            if done:  # the client has its whole answer; only the connection's end failed
                return
            failure = self._failed(engine, "decode", ex)
            status = failure.status
            if failure.kind == "timeout":
                failure.message = (
                    f"the decode engine sent no first token within "
                    f"{first_bound or self._first_token_bound(engine):g}s"
                    if first
                    else f"the decode engine sent nothing for {idle:g}s"
                )
            logger.warning(
                "request %s: %s mid-stream (%s)", call.request_id, failure.message, failure.detail
            )
            self._pair_failed(call, engine)
            yield sse_error(failure.message, status)
        finally:
            await resp.aclose()
            self._release(engine)
            self._finish(call, status)

    async def _resend(
        self, call: Call, stalled: EngineState, resend: Resend
    ) -> tuple[EngineState, UpstreamResponse, AsyncIterator[bytes]] | None:
        """The decode leg on another engine after ``stalled``; None when none took it."""
        self.metrics.upstream_errors.labels(stalled.url, stalled.role, "stalled").inc()
        logger.warning(
            "request %s: decode engine %s stalled before its first event; resending",
            call.request_id,
            stalled.url,
        )
        while True:
            nxt = await self._next_decode(
                call, resend.route, resend.info, resend.tried, resend.held
            )
            if nxt is None:
                return None
            resend.tried.add(nxt.url)
            try:
                opened = await self._open_stream(call, nxt, resend.payload, relayed=True)
            except LegFailed as failure:
                logger.warning("request %s: %s", call.request_id, failure.detail)
                continue
            if opened is None:
                return None
            # A relayed leg answers a tuple or None, never a Response or a marker.
            assert isinstance(opened, tuple)
            return (nxt, *opened)


class Watched:
    """``with`` (or ``async with``): a :class:`Deadline` ``seconds`` from now,
    registered with an engine's waiters, so that the stall watchdog, which
    reschedules every registered deadline, ends the wait at once."""

    __slots__ = ("_cm", "_engine", "_seconds")

    def __init__(self, engine: EngineState, seconds: float) -> None:
        self._engine = engine
        self._seconds = seconds
        self._cm: Deadline | None = None

    def __enter__(self) -> Deadline:
        engine = self._engine
        if engine.stalled:
            # Ejected for a stall after this leg was routed to it (a decode
            # engine is chosen before the prefill leg runs): give up at once,
            # as the legs already waiting did, instead of for the whole bound.
            self._cm = cm = Deadline(None)
            cm.reschedule(asyncio.get_running_loop().time())
        else:
            self._cm = cm = Deadline(asyncio.get_running_loop().time() + self._seconds)
        engine.waiters.add(cm)
        return cm

    def __exit__(self, *exc: Any) -> None:
        cm = self._cm
        assert cm is not None  # entered
        self._engine.waiters.discard(cm)
        cm.__exit__(*exc)  # raises TimeoutError for an expiry; never swallows

    async def __aenter__(self) -> Deadline:
        return self.__enter__()

    async def __aexit__(self, *exc: Any) -> None:
        self.__exit__(*exc)


class RelayResponse(Response):
    """A streamed answer that always closes its relay (and so the upstream
    connection), also when the client disconnects mid-stream.

    Starlette's StreamingResponse runs a task group of two tasks per stream to
    notice a disconnect; here one watcher task cancels the relay instead (the
    one ``Proxy.handle`` started for the request, handed over as ``watch``).
    Its headers are built here, not by Starlette's per-response header code."""

    def __init__(
        self,
        relay: AsyncGenerator[bytes, None],
        abandon: Callable[[], Awaitable[None]],
        request_id: str,
    ) -> None:
        # Not Response.__init__: no body to render, and the headers are fixed.
        self.status_code = 200
        self.background = None
        self.body_iterator = relay
        self.raw_headers = [SSE_CONTENT_TYPE, (b"x-request-id", request_id.encode("latin-1"))]
        self.abandon = abandon
        """Releases what the relay holds if it never starts (its finally would)."""
        self.watch: DisconnectWatch | None = None
        """The request's disconnect watcher, if the handler started one."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """ASGI: the relay as ``http.response.*`` messages (the tracing path)."""

        def start(status: int, headers: list[tuple[bytes, bytes]]) -> Awaitable[None]:
            return send({"type": "http.response.start", "status": status, "headers": headers})

        def write(chunk: bytes) -> Awaitable[None]:
            return send({"type": "http.response.body", "body": chunk, "more_body": True})

        def end() -> Awaitable[None]:
            return send({"type": "http.response.body", "body": b"", "more_body": False})

        await self.stream_to(start, write, end, receive)

    async def stream_to(
        self,
        start: Callable[[int, list[tuple[bytes, bytes]]], Awaitable[None] | None],
        write: Callable[[bytes], Awaitable[None] | None],
        end: Callable[[], Awaitable[None] | None],
        receive: Any = None,
    ) -> None:
        """Send the head (``start``), each chunk (``write``: an awaitable only
        while the client's connection is paused for writing) and the end; the
        gateway's server calls it with its connection's writers."""
        watch = self.watch or DisconnectWatch(receive)
        started = False
        try:
            wait = start(self.status_code, self.raw_headers)
            started = True  # the relay runs next: its finally now cleans up
            if wait is not None:
                await wait
            async for chunk in self.body_iterator:
                wait = write(chunk)
                if wait is not None:
                    await wait
            wait = end()
            if wait is not None:
                await wait
        except asyncio.CancelledError:
            if not watch.uncancel():
                raise
        except OSError:  # the client's connection broke mid-write
            pass
        finally:
            watch.close()
            if started:
                await self.body_iterator.aclose()
            else:
                await self.abandon()


class DisconnectWatch:
    """Cancels the task that made it when the client disconnects. The
    gateway's server calls it back from the connection's loss (no task); an
    ASGI request gets one watcher task (``asyncio.wait`` on two tasks, or
    Starlette's task group, cost several times as much). Made after the body
    was read (under ASGI it takes over ``receive``); closed before the
    answer's last byte is sent (after it, ``receive`` reports a disconnect).
    ``request``: a request (``watch_disconnect``) or an ASGI ``receive``."""

    __slots__ = ("_closed", "_owner", "_task", "gone")

    def __init__(self, request: Any) -> None:
        self.gone = False
        self._closed = False
        self._owner = asyncio.current_task()
        self._task: asyncio.Future | None = None
        watch = getattr(request, "watch_disconnect", None)
        if watch is not None and watch(self._lost):
            return
        receive = getattr(request, "receive", request)
        self._task = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._lost()

    def _lost(self) -> None:
        if self._closed or self.gone:
            return
        self.gone = True
        if self._owner is not None:
            self._owner.cancel()

    def uncancel(self) -> bool:
        """In the owner's ``except CancelledError``: True (and the cancellation
        taken back) when the client's disconnect caused it."""
        if self.gone and self._owner is not None:
            self._owner.uncancel()
            return True
        return False

    def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
