"""The two-leg P/D protocol (docs/gateway.md, "The two legs") and the relay of the decode leg.

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

Both legs carry the same ``X-Request-Id`` (the client's, or a new one), which
the answer echoes. Every wait is bounded: connect, first-token (the prefill
leg; a stream's first event), idle (between events) and request timeouts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pdfleet.engine import tracing
from pdfleet.engine.config.gateway import GatewayConfig

from .engines import EnginePool, EngineState
from .metrics import GatewayMetrics
from .prompt import PromptAnalyzer, PromptInfo
from .routing import NoEngineError, PrefixAffinity, Route, Router
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
    499: "ClientClosedRequest",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}
DONE = b"data: [DONE]\n\n"
# Prefill-leg statuses that say "this engine, now" rather than "this input": the
# leg is worth another engine (a decode leg passes them to the client).
RETRYABLE_STATUS = frozenset({408, 429})


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "Error"),
            "param": param,
            "code": status,
        }
    }


def error_response(message: str, status: int, request_id: str) -> Response:
    return Response(
        json.dumps(error_body(message, status)),
        status_code=status,
        media_type="application/json",
        headers={"x-request-id": request_id},
    )


def sse_error(message: str, status: int) -> bytes:
    return b"data: " + json.dumps(error_body(message, status)).encode() + b"\n\n" + DONE


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
    """The error message of an engine's answer (an httpx or upstream response)."""
    try:
        return str(resp.json()["error"]["message"])
    except Exception:  # not OpenAI-shaped: show the start of the body
        return resp.text[:200] or resp.reason_phrase


@dataclass
class Call:
    """One request of the client, as it goes through the legs."""

    endpoint: str
    request_id: str
    start: float
    headers: dict[str, str]
    chat: bool


class LegFailed(Exception):
    """An engine call failed in a way another engine might not."""

    def __init__(self, message: str, status: int, kind: str) -> None:
        super().__init__(message)
        self.message, self.status, self.kind = message, status, kind


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
    ) -> None:
        self.config = config
        self.pool = pool
        self.router = router
        self.affinity = affinity
        self.analyzer = analyzer
        self.metrics = metrics
        self.client = client

    # -- bookkeeping -------------------------------------------------------------

    def _acquire(self, e: EngineState) -> None:
        e.inflight += 1
        self.metrics.engine_inflight.labels(e.url, e.role).set(e.inflight)

    def _release(self, e: EngineState) -> None:
        e.inflight -= 1
        self.metrics.engine_inflight.labels(e.url, e.role).set(e.inflight)

    def _finish(self, call: Call, status: int) -> None:
        self.metrics.requests.labels(call.endpoint, str(status)).inc()
        self.metrics.e2e.labels(call.endpoint).observe(time.perf_counter() - call.start)

    def _failed(self, e: EngineState, role: str, ex: Exception) -> LegFailed:
        """Classify a transport error; a refused connection ejects the engine at once."""
        if isinstance(ex, UpstreamConnectError):
            kind, status = "connect", 502
            self.pool.record_failure(e, f"connection refused: {ex}", definitive=True)
            msg = f"{role} engine {e.url} refused the connection"
        elif isinstance(ex, TimeoutError):
            kind, status = "timeout", 504
            msg = f"{role} engine {e.url} did not answer in time"
        else:
            kind, status = "broken", 502
            msg = f"{role} engine {e.url} failed: {type(ex).__name__}: {ex}"
        self.metrics.upstream_errors.labels(e.url, e.role, kind).inc()
        return LegFailed(msg, status, kind)

    def _status_error(self, e: EngineState, role: str, resp: UpstreamResponse) -> LegFailed:
        self.metrics.upstream_errors.labels(e.url, e.role, "status").inc()
        status = 503 if resp.status_code == 503 else 502
        return LegFailed(
            f"{role} engine {e.url} answered {resp.status_code}: {upstream_message(resp)}",
            status,
            "status",
        )

    def _passthrough(self, call: Call, resp: UpstreamResponse, content: bytes) -> Response:
        self._finish(call, resp.status_code)
        return Response(
            content,
            status_code=resp.status_code,
            media_type=resp.headers.get("content-type", "application/json"),
            headers={"x-request-id": call.request_id},
        )

    def _error(self, call: Call, message: str, status: int) -> Response:
        self._finish(call, status)
        return error_response(message, status, call.request_id)

    # -- entry -------------------------------------------------------------------

    async def handle(self, request: Request, endpoint: str) -> Response:
        """Answer one completions/chat request; a client that goes away cancels it
        (closing the upstream connections, which aborts the engine requests)."""
        call = Call(
            endpoint,
            request.headers.get("x-request-id") or uuid.uuid4().hex,
            time.perf_counter(),
            {"content-type": "application/json"},
            endpoint.endswith("/chat/completions"),
        )
        call.headers["x-request-id"] = call.request_id
        if "authorization" in request.headers:
            call.headers["authorization"] = request.headers["authorization"]
        raw = await request.body()  # read before the watcher below takes over receive()
        work = asyncio.ensure_future(self._handle(call, raw))
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if work in done:
            return work.result()
        work.cancel()
        result = (await asyncio.gather(work, return_exceptions=True))[0]
        if isinstance(result, StreamingResponse):  # raced: a relay nobody will read
            await result.body_iterator.aclose()  # type: ignore[union-attr]
        self._finish(call, 499)
        return Response(status_code=499)

    async def _handle(self, call: Call, raw: bytes) -> Response:
        try:
            body = json.loads(raw)
        except ValueError as e:
            return self._error(call, f"invalid JSON body: {e}", 400)
        if not isinstance(body, dict):
            return self._error(call, "the request body must be a JSON object", 400)
        info = self.analyzer.analyze(body, call.chat, self.pool.block_size)
        try:
            route = self.router.route(info)
        except NoEngineError as e:
            return self._error(call, str(e), 503)
        self.metrics.decisions.labels(route.decision, route.reason).inc()
        tracing.route_chosen(route)
        payload = raw
        if route.prefill is not None:
            outcome = await self._prefill(call, body, route, info)
            if isinstance(outcome, Response):
                return outcome
            if outcome is not None:
                payload = json.dumps(decode_body(body, outcome)).encode()
        elif route.reason == "no_prefill_engine":
            self.metrics.fallbacks.labels("no_prefill_engine").inc()
            tracing.fallback("no_prefill_engine")
        if body.get("stream") is True:
            return await self._decode_stream(call, route, info, payload)
        return await self._decode_json(call, route, info, payload)

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
                logger.warning("request %s: %s", call.request_id, e.message)
                if len(tried) > self.config.retries:
                    break
                engine = self.router.pick_prefill(route.decode, info, tried)
                if engine is not None:
                    self.metrics.retries.labels("prefill").inc()
                continue
            if isinstance(result, Response):
                return result
            self.affinity.record(info.block_hashes, engine.url)
            params = result.get("kv_transfer_params")
            if not isinstance(params, dict) or not params:
                # A producer without a connector: the decode engine recomputes.
                self.metrics.fallbacks.labels("no_kv_transfer_params").inc()
                tracing.fallback("no_kv_transfer_params")
                return None
            return params
        self.metrics.fallbacks.labels("prefill_failed").inc()
        tracing.fallback("prefill_failed")
        return None

    async def _prefill_once(
        self, call: Call, e: EngineState, payload: bytes
    ) -> dict[str, Any] | Response:
        self._acquire(e)
        try:
            resp = await self.client.post(
                e.url + call.endpoint, payload, call.headers, self.config.first_token_timeout
            )
        except (UpstreamError, TimeoutError) as ex:
            raise self._failed(e, "prefill", ex) from None
        finally:
            self._release(e)
        if resp.status_code == 200:
            try:
                data = resp.json()
            except ValueError:
                self.metrics.upstream_errors.labels(e.url, e.role, "status").inc()
                raise LegFailed(
                    f"prefill engine {e.url} sent invalid JSON", 502, "status"
                ) from None
            return data if isinstance(data, dict) else {}
        if 400 <= resp.status_code < 500 and resp.status_code not in RETRYABLE_STATUS:
            return self._passthrough(call, resp, resp.content)
        raise self._status_error(e, "prefill", resp)

    # -- decode ------------------------------------------------------------------

    def _next_decode(self, route: Route, info: PromptInfo, tried: set[str]) -> EngineState | None:
        """Another decode engine after a refused connection (same compat hash,
        so a producer's KV stays usable)."""
        if len(tried) > self.config.retries:
            return None
        want = route.decode.load.compat_hash
        candidates = [
            e
            for e in self.pool.candidates("decode")
            if e.url not in tried and e.load.compat_hash == want
        ]
        picked = self.router.pick(candidates, info.block_hashes)
        if picked is None:
            return None
        self.metrics.retries.labels("decode").inc()
        return picked[0]

    async def _decode_json(
        self, call: Call, route: Route, info: PromptInfo, payload: bytes
    ) -> Response:
        e: EngineState | None = route.decode
        tried: set[str] = set()
        while e is not None:
            tried.add(e.url)
            self._acquire(e)
            try:
                resp = await self.client.post(
                    e.url + call.endpoint, payload, call.headers, self.config.request_timeout
                )
            except (UpstreamError, TimeoutError) as ex:
                failure = self._failed(e, "decode", ex)
                if failure.kind == "connect" and (nxt := self._next_decode(route, info, tried)):
                    self._release(e)
                    e = nxt
                    continue
                self._release(e)
                return self._error(call, failure.message, failure.status)
            except BaseException:
                self._release(e)
                raise
            self._release(e)
            if resp.status_code < 500:  # incl. 429: the client should back off, not us
                if resp.status_code == 200:
                    self.affinity.record(info.block_hashes, e.url)
                return self._passthrough(call, resp, resp.content)
            failure = self._status_error(e, "decode", resp)
            return self._error(call, failure.message, failure.status)
        raise AssertionError("unreachable: the loop starts with the routed engine")

    async def _decode_stream(
        self, call: Call, route: Route, info: PromptInfo, payload: bytes
    ) -> Response:
        """Open the decode stream; answer as soon as the engine accepts it.

        Headers go out while the engine computes the first token (as the
        engine's own do), so the gateway's response setup is off the TTFT
        path. Failures before the engine accepts (refused connection: next
        engine; 4xx/5xx: that status) are plain HTTP errors; later ones,
        including a first-token timeout, are SSE error events.
        """
        e: EngineState | None = route.decode
        tried: set[str] = set()
        while e is not None:
            tried.add(e.url)
            try:
                opened = await self._open_stream(call, e, payload)
            except LegFailed as failure:
                if failure.kind == "connect" and (nxt := self._next_decode(route, info, tried)):
                    e = nxt
                    continue
                return self._error(call, failure.message, failure.status)
            if isinstance(opened, Response):
                return opened
            self.affinity.record(info.block_hashes, e.url)
            return RelayResponse(
                self._relay(call, e, *opened),
                media_type="text/event-stream",
                headers={"x-request-id": call.request_id},
            )
        raise AssertionError("unreachable: the loop starts with the routed engine")

    async def _open_stream(
        self, call: Call, e: EngineState, payload: bytes
    ) -> tuple[UpstreamResponse, AsyncIterator[bytes]] | Response:
        """(accepted response, its chunk iterator), holding ``e`` (the relay
        releases it); a Response for an HTTP error."""
        self._acquire(e)
        resp: UpstreamResponse | None = None
        handed = False
        try:
            async with asyncio.timeout(self.config.first_token_timeout):
                resp = await self.client.stream(e.url + call.endpoint, payload, call.headers)
                if resp.status_code != 200:
                    content = await resp.aread()
                    if resp.status_code < 500:
                        return self._passthrough(call, resp, content)
                    failure = self._status_error(e, "decode", resp)
                    return self._error(call, failure.message, failure.status)
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
    ) -> AsyncIterator[bytes]:
        """Relay whole SSE events (so an error event never lands mid-event)."""
        status = 200
        done = False
        first = True
        buf = b""
        try:
            while True:
                timeout = self.config.first_token_timeout if first else self.config.idle_timeout
                try:
                    async with asyncio.timeout(timeout):
                        data = await anext(chunks)
                except StopAsyncIteration:
                    break
                buf += data
                cut = buf.rfind(b"\n\n")
                if cut < 0:
                    continue
                out, buf = buf[: cut + 2], buf[cut + 2 :]
                if first:
                    first = False
                    self.metrics.ttft.labels(call.endpoint).observe(
                        time.perf_counter() - call.start
                    )
                yield out
                done = done or out.endswith(DONE)
            if not done:
                self.metrics.upstream_errors.labels(engine.url, engine.role, "broken").inc()
                status = 502
                yield sse_error(f"decode engine {engine.url} ended the stream early", status)
        except (UpstreamError, TimeoutError) as ex:
            if done:  # the client has its whole answer; only the connection's end failed
                return
            failure = self._failed(engine, "decode", ex)
            status = failure.status
            if failure.kind == "timeout":
                failure.message = (
                    f"decode engine {engine.url} sent no first token within "
                    f"{self.config.first_token_timeout}s"
                    if first
                    else f"decode engine {engine.url} sent nothing for {self.config.idle_timeout}s"
                )
            logger.warning("request %s: %s mid-stream", call.request_id, failure.message)
            yield sse_error(failure.message, status)
        finally:
            await resp.aclose()
            self._release(engine)
            self._finish(call, status)


class RelayResponse(StreamingResponse):
    """A StreamingResponse that always closes its relay (and so the upstream
    connection), also when the client disconnects mid-stream."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
