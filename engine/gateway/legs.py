"""What every engine call of a request shares, whichever leg makes it.

:class:`Legs` holds the gateway's state that both legs and the relay use:
an engine taken and given back (its in-flight count), the bounds of a wait
on it (the first-token bound sized from its queue, a watched
deadline that the stall watchdog can end at once), a failed call classified
(:class:`LegFailed`: a message for the client, a detail for the log, a
refused connection ejecting the engine), an engine's answer passed on or its
refusal re-shaped (no engine body reaches a client), the request's final
status and latency, and the prefix-affinity table learning where a prompt's
blocks now are. The steps of the protocol are elsewhere: ``proxy`` (check,
route), ``prefill_leg``, ``decode_leg``, ``relay``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.responses import Response

from ..config.gateway import GatewayConfig
from ..contracts.errors import ErrorBody
from ..http.asgi import JSON_CONTENT_TYPE, BytesResponse
from ..http.upstream import UpstreamClient, UpstreamConnectError, UpstreamResponse
from .admission import Admission
from .answers import MAX_RELAYED_MESSAGE, error_response, upstream_message
from .call import Call
from .deadlines import Deadline
from .engines import EnginePool, EngineState
from .metrics import GatewayMetrics
from .prompt import PromptAnalyzer, PromptInfo
from .routing import KVPairBreaker, PrefixAffinity, Router

logger = logging.getLogger("pdfleet.gateway")


class LegFailed(Exception):
    """An engine call failed in a way another engine might not. ``message`` is
    for the client (no URL, no engine body); ``detail`` is for the log."""

    def __init__(self, message: str, status: int, kind: str, detail: str = "") -> None:
        super().__init__(message)
        self.message, self.status, self.kind = message, status, kind
        self.detail = detail or message


class Legs:
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
        admission: Admission | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.router = router
        self.affinity = affinity
        self.analyzer = analyzer
        self.metrics = metrics
        self.admission = admission or Admission(config, metrics)
        """Slots on decode engines: taken at the route, given back at ``finish``."""
        self.client = client
        """Sends the content type and the fleet token with every engine call
        (its fixed headers); a call adds its request id."""
        self.breaker = breaker
        self._finished: dict[tuple[str, int], tuple[Any, Any]] = {}
        """The request counter and latency histogram per (endpoint, status)."""
        self._ttft: dict[str, Any] = {}
        """The TTFT histogram per endpoint."""
        metrics.on_collect(self._inflight_gauges)

    # -- an engine taken and given back --------------------------------------------

    def acquire(self, e: EngineState) -> None:
        if e.inflight == 0:
            self.pool.started(e)  # (an idle engine's stall clock starts now)
        e.inflight += 1

    def release(self, e: EngineState) -> None:
        e.inflight -= 1

    @staticmethod
    def _streamed(call: Call) -> bool:
        """Whether its decode leg's first answer is a first event (a stream):
        only then does the gateway see how long its slot waits for it."""
        return bool(call.body and call.body.get("stream"))

    def _top(self, call: Call) -> bool:
        """Whether the request is of the best band (its share beyond capacity)."""
        top = self.admission.top_band
        return top is not None and call.ticket is not None and call.ticket.band <= top

    def take_slot(self, call: Call, e: EngineState) -> None:
        """The request's slot on its decode engine, until its answer ends."""
        body = call.body
        streamed = body is not None and bool(body.get("stream"))  # (``_streamed``, inline)
        top_band, ticket = self.admission.top_band, call.ticket  # (``_top``, inline)
        call.top = top = top_band is not None and ticket is not None and ticket.band <= top_band
        self.admission.take(e, id(call) if streamed else None, call.seqs, top)
        call.slot = e
        if not streamed and ticket is not None:
            # Its band's fair-share clock moves on to its tag now; a stream's at
            # its first event (:meth:`first_token`), when its engine serves it.
            ticket.started()

    def take_prefill_slot(self, call: Call, e: EngineState) -> None:
        """Its slot on its prefill engine, until its prefill leg ends."""
        call.top = top = self._top(call)
        self.admission.take(e, id(call), top=top)
        call.prefill_slot = e

    def move_slot(self, call: Call, e: EngineState, prefill: bool = False) -> None:
        """A leg went to another engine (failover, a retry): so does its slot."""
        held = call.prefill_slot if prefill else call.slot
        if held is not None and held is not e:
            seqs = 1 if prefill else call.seqs
            self.admission.give_back(held, id(call), ended=False, seqs=seqs, top=call.top)
            self.admission.take(
                e, id(call) if prefill or self._streamed(call) else None, seqs, call.top
            )
            if prefill:
                call.prefill_slot = e
            else:
                call.slot = e

    def free_prefill_slot(self, call: Call) -> None:
        """The prefill leg ended: its slot is free (once; a no-op without one)."""
        slot = call.prefill_slot
        if slot is not None:
            call.computed()
            call.prefill_slot = None
            self.admission.give_back(slot, id(call), ended=False, top=call.top)

    def free_slot(self, call: Call) -> None:
        """Give the request's slots back (once each; a no-op without them)."""
        if call.prefill_slot is not None:
            self.free_prefill_slot(call)
        slot = call.slot
        if slot is not None:
            call.slot = None
            self.admission.give_back(slot, id(call), seqs=call.seqs, top=call.top)

    def _inflight_gauges(self) -> None:
        """At each collection: the in-flight gauges from the engines' counts
        (kept on the engine state, not written to the series per request)."""
        for e in self.pool.engines.values():
            if e.inflight_gauge is None:
                # A re-added engine is a new state, so a removed series is never written again.
                e.inflight_gauge = self.metrics.engine_inflight.labels(e.url, e.role)
            e.inflight_gauge.set(e.inflight)

    # -- the request's outcome -------------------------------------------------------

    def finish(self, call: Call, status: int) -> None:
        """The request's final status and its latency (once per request); its slot is free."""
        if call.on_computed is not None:
            call.computed()
        if call.slot is not None or call.prefill_slot is not None:
            self.free_slot(call)
        ticket = call.ticket
        if ticket is not None:
            call.ticket = None  # released: the handler's cleanup has none to release again
            ticket.release()
        key = (call.endpoint, status)
        series = self._finished.get(key)
        if series is None:  # a few (endpoint, status) pairs: never dropped
            m = self.metrics
            series = self._finished[key] = (
                m.fast_counter(m.requests.labels(call.endpoint, str(status))),
                m.fast_histogram(m.e2e.labels(call.endpoint)),
            )
        series[0].add_one()
        series[1].observe(time.perf_counter() - call.start)

    def first_token(self, call: Call) -> None:
        """The request's first event reached the client (TTFT); its decode
        slot no longer waits for a first answer."""
        if call.on_computed is not None:
            call.computed()
        if call.slot is not None:
            self.admission.answered(call.slot, id(call))
            if call.ticket is not None:
                call.ticket.started()
        ttft = self._ttft.get(call.endpoint)
        if ttft is None:
            ttft = self._ttft[call.endpoint] = self.metrics.fast_histogram(
                self.metrics.ttft.labels(call.endpoint)
            )
        ttft.observe(time.perf_counter() - call.start)

    def error(
        self,
        call: Call,
        message: str,
        status: int,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> Response:
        self.finish(call, status)
        return error_response(message, status, call.request_id, param, headers)

    def leg_error(self, call: Call, failure: LegFailed) -> Response:
        logger.warning("request %s: %s", call.request_id, failure.detail)
        return self.error(call, failure.message, failure.status)

    def passthrough(self, call: Call, resp: UpstreamResponse, content: bytes) -> Response:
        """A 2xx answer as is; a refusal (4xx) re-shaped so no engine body leaks."""
        if resp.status_code >= 300:
            return self.refused(call, resp)
        self.finish(call, resp.status_code)
        kind = resp.header(b"content-type")
        return BytesResponse(
            content,
            resp.status_code,
            [
                JSON_CONTENT_TYPE if kind is None else (b"content-type", kind),
                (b"x-request-id", call.request_id.encode("latin-1")),
            ],
        )

    def refused(self, call: Call, resp: UpstreamResponse) -> Response:
        """An engine's 4xx for the client's input: its OpenAI message and field
        (what the client must change) under its status, nothing else of its body."""
        status = resp.status_code
        message, param = f"the request was refused ({status})", None
        error = ErrorBody.decode(resp.content, status)
        if error is not None:
            message, param = error.message[:MAX_RELAYED_MESSAGE], error.param
        else:  # not OpenAI-shaped: logged, not relayed
            logger.info(
                "request %s: engine refusal %d: %r", call.request_id, status, resp.text[:200]
            )
        headers = {}
        if "retry-after" in resp.headers:
            headers["retry-after"] = resp.headers["retry-after"]
        return self.error(call, message, status, param, headers)

    # -- bounds and failures of a call -----------------------------------------------

    def first_token_bound(self, e: EngineState) -> float:
        """The first-token wait for ``e``: grows with the requests queued ahead."""
        load = e.load
        return self.config.first_token_bound(max(load.waiting, e.inflight - load.running))

    @staticmethod
    def watched(e: EngineState, seconds: float) -> Deadline:
        """For ``with``: a :class:`Deadline` ``seconds`` from now, registered
        with ``e``'s waiters until it exits, so that the stall watchdog, which
        reschedules every registered deadline, ends the wait at once."""
        if e.stalled:
            # Ejected for a stall after this leg was routed to it (a decode
            # engine is chosen before the prefill leg runs): give up at once,
            # as the legs already waiting did, instead of for the whole bound.
            cm = Deadline(None, waiters=e.waiters)
            cm.expire_soon()
            return cm
        return Deadline(None, after=seconds, waiters=e.waiters)

    def failed(self, e: EngineState, role: str, ex: Exception) -> LegFailed:
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

    def status_error(self, e: EngineState, role: str, resp: UpstreamResponse) -> LegFailed:
        self.metrics.upstream_errors.labels(e.url, e.role, "status").inc()
        status = 503 if resp.status_code == 503 else 502
        return LegFailed(
            f"the {role} engine answered {resp.status_code}",
            status,
            "status",
            f"{role} engine {e.url} answered {resp.status_code}: {upstream_message(resp)}",
        )

    def pair_failed(self, call: Call, decode: EngineState) -> None:
        """The KV hand-off over (the call's prefill engine, ``decode``) failed."""
        if self.breaker is not None and call.prefill_url is not None:
            self.breaker.leg_failed(call.prefill_url, decode.url)

    # -- the prompt ----------------------------------------------------------------------

    def analyzed(self, call: Call, info: PromptInfo) -> PromptInfo:
        """``info``, analyzed now if the request was routed without it."""
        if info.analyzed or call.body is None:
            return info
        if call.info is None:
            try:
                call.info = self.analyzer.analyze(call.body, call.chat, self.pool.block_size)
            except (ValueError, TypeError, AttributeError):  # the engine refuses such a body
                call.info = PromptInfo(0)
        return call.info

    def record(self, call: Call, info: PromptInfo, url: str) -> None:
        """The affinity table learns that ``url`` now holds the prompt's blocks
        (when they were hashed: a request routed alone, and never failed over,
        was not analyzed)."""
        if not info.analyzed and call.info is not None:
            info = call.info
        if info.block_hashes:
            self.affinity.record(info.block_hashes, url)
