"""Lazy LoRA adapter loading: a request names an adapter that some engines
serve; before its legs run, the gateway loads the adapter on the route's
engines that lack it, as the engines that serve it loaded it.

One POST per (engine, adapter) at a time, however many requests wait on it;
a failed load is remembered for a while (bounded), and a leg whose load
fails gives way (``AdapterLoader.ensure``). The proxy calls ``ensure``
between routing and the legs (``proxy.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from starlette.responses import Response

from ..contracts.lora import LoRALoad, load_succeeded, name_taken
from ..contracts.model_card import ModelCard
from ..http.upstream import UpstreamClient
from .answers import upstream_message
from .call import Call
from .engines import EnginePool, EngineState
from .legs import Legs
from .metrics import GatewayMetrics
from .routing import Route, mark_routed

logger = logging.getLogger("pdfleet.gateway")

# Seconds a LoRA load on an engine may take (it reads and checks the adapter).
LORA_LOAD_TIMEOUT = 120.0
# How long a failed adapter load on one engine is remembered (seconds): its
# requests go to an engine that serves the adapter, without a retry, meanwhile.
LORA_LOAD_FAILURE_TTL = 30.0
# At most this many (engine, adapter) failures are remembered (oldest dropped).
LORA_LOAD_FAILURES_MAX = 1024


class AdapterLoader:
    def __init__(
        self, pool: EnginePool, client: UpstreamClient, metrics: GatewayMetrics, legs: Legs
    ) -> None:
        self.pool = pool
        self.client = client
        """Posts the loads (fleet token); adapter cards are read with the pool's client."""
        self.metrics = metrics
        self.legs = legs
        """Answers the error when no engine can serve the adapter."""
        self._loading: dict[tuple[str, str], asyncio.Future[Any]] = {}
        """Adapter loads in flight per (engine URL, adapter): one POST each."""
        self._load_failures: dict[tuple[str, str], tuple[float, str]] = {}
        """(expiry on the monotonic clock, error) of a recently failed load per
        (engine URL, adapter); bounded by LORA_LOAD_FAILURES_MAX."""

    async def ensure(self, call: Call, route: Route, adapter: str) -> Route | Response:
        """Load ``adapter`` on the route's engines that do not serve it yet (both
        legs of a P/D route run it), as the engines that serve it loaded it.
        A leg whose load fails (or failed within LORA_LOAD_FAILURE_TTL) gives
        way: the decode leg to the least busy engine that serves the adapter
        (decode only), the prefill leg to none (the decode engine computes
        the prompt). The route to run, or the error answer when no engine can
        serve it."""
        if self.pool.adapter(adapter) is None:
            return route  # unloaded meanwhile: the engine answers 404
        for e in (route.decode, route.prefill):
            if e is None or self.pool.holds_adapter(e, adapter):
                continue
            error = await self._load_once(e, adapter)
            if error is None:
                continue
            if e is route.prefill:
                logger.warning("%s; its prompt runs on the decode engine", error)
                route = Route(route.decode, None, "decode_only", "adapter_fallback")
                continue
            holders = [
                h for h in self.pool.candidates("decode") if self.pool.holds_adapter(h, adapter)
            ]
            if not holders:
                return self.legs.error(call, error, 503, "model")
            holder = min(holders, key=lambda h: h.queue())
            logger.warning("%s; routed to %s, which serves it", error, holder.url)
            route = Route(holder, None, "decode_only", "adapter_fallback")
            break
        for e in (route.decode, route.prefill):
            # Running the request puts the adapter into a device slot there:
            # the next requests see that before the next scrape confirms it
            # (or says which adapter it evicted instead).
            if e is not None:
                mark_routed(e, adapter)
        return route

    async def _load_once(self, e: EngineState, adapter: str) -> str | None:
        """Load ``adapter`` on ``e``: one POST per (engine, adapter) at a time,
        none while a failure is remembered; None or the error."""
        key = (e.url, adapter)
        failed = self._load_failures.get(key)
        if failed is not None:
            if failed[0] > time.monotonic():
                return failed[1]
            del self._load_failures[key]
        pending = self._loading.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._load_adapter(e, adapter))
            self._loading[key] = pending
            pending.add_done_callback(self._loaded(key))
        error: str | None = await asyncio.shield(pending)
        return error

    def _loaded(self, key: tuple[str, str]) -> Callable[[asyncio.Future[Any]], None]:
        def forget(done: asyncio.Future[Any]) -> None:
            self._loading.pop(key, None)
            if done.cancelled() or done.exception() is not None or done.result() is None:
                return
            self._load_failures.pop(key, None)
            self._load_failures[key] = (time.monotonic() + LORA_LOAD_FAILURE_TTL, done.result())
            while len(self._load_failures) > LORA_LOAD_FAILURES_MAX:
                del self._load_failures[next(iter(self._load_failures))]

        return forget

    async def _load_body(self, adapter: str) -> LoRALoad | None:
        """How the engines that serve ``adapter`` loaded it: a Hub adapter by its
        ``hf://`` source and revision (its directory is a snapshot in that
        engine's own cache, which other pods do not have), from the adapter
        card of a holder; else its directory. None when no engine serves it."""
        source = self.pool.adapter(adapter)
        if source is None:
            return None
        holders = [e for e in self.pool.engines.values() if self.pool.holds_adapter(e, adapter)]
        for holder in holders[:2]:
            try:
                resp = await self.pool.client.get(
                    f"{holder.url}/v1/models/{adapter}", timeout=self.pool.check_timeout
                )
                card = ModelCard.from_wire(resp.json()) if resp.status_code == 200 else None
            except Exception as ex:  # unreachable or not JSON: ask the next one
                logger.debug("adapter card of %r on %s: %s", adapter, holder.url, ex)
                continue
            if card is None:
                continue
            if card.source:
                return LoRALoad(adapter, card.source, card.revision)
            break
        return LoRALoad(adapter, source[1])

    async def _serves_identity(self, e: EngineState, adapter: str, identity: str) -> bool:
        """Whether ``e`` serves ``adapter`` with prefix-cache identity
        ``identity`` (the same weights): its card says (``/v1/models/NAME``)."""
        try:
            resp = await self.pool.client.get(
                f"{e.url}/v1/models/{adapter}", timeout=self.pool.check_timeout
            )
            card = ModelCard.from_wire(resp.json()) if resp.status_code == 200 else None
        except Exception as ex:  # unreachable or not JSON: not known to serve it
            logger.debug("adapter card of %r on %s: %s", adapter, e.url, ex)
            return False
        return card is not None and bool(identity) and card.lora_identity == identity

    async def _load_adapter(self, e: EngineState, adapter: str) -> str | None:
        """POST /v1/load_lora_adapter to ``e`` (fleet token); None or the error."""
        load = await self._load_body(adapter)
        if load is None:
            return f"could not load LoRA adapter {adapter!r} on {e.url}: no engine serves it"
        try:
            resp = await self.client.post(
                e.url + "/v1/load_lora_adapter",
                load.encode(),
                {"content-type": "application/json"},
                LORA_LOAD_TIMEOUT,
            )
        except Exception as ex:  # a connection failure or timeout
            return f"could not load LoRA adapter {adapter!r} on {e.url}: {type(ex).__name__}"
        source = self.pool.adapter(adapter)
        done = load_succeeded(resp.status_code) or (
            name_taken(resp.status_code, resp.content)
            and source is not None
            and await self._serves_identity(e, adapter, source[0])
        )
        if not done:
            return (
                f"could not load LoRA adapter {adapter!r} on {e.url}: "
                f"{resp.status_code} {upstream_message(resp)}"
            )
        if source is not None:
            e.load.adapters[adapter] = source  # until the next scrape says so itself
        self.metrics.lora_loads.labels(e.url).inc()
        logger.info("loaded LoRA adapter %r on %s", adapter, e.url)
        return None
