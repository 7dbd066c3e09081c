"""Prometheus metrics of the gateway (``pdfleet_gateway_*``, see docs/metrics.md).

TTFT and E2E are measured as the client sees them: from the request's arrival
at the gateway to the first relayed stream event / the last byte, so they
include the prefill leg and KV transfer that an engine's own TTFT cannot see.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry

from pdfleet.engine.config import metrics as m


class GatewayMetrics:
    """The gateway's series (names and labels in ``engine/config/metrics.py``)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = m.GATEWAY_REQUESTS.create(r)
        self.ttft = m.GATEWAY_TTFT.create(r)
        self.e2e = m.GATEWAY_E2E.create(r)
        self.decisions = m.GATEWAY_DISAGG_DECISIONS.create(r)
        self.retries = m.GATEWAY_RETRIES.create(r)
        self.fallbacks = m.GATEWAY_FALLBACKS.create(r)
        self.upstream_errors = m.GATEWAY_UPSTREAM_ERRORS.create(r)
        self.engine_healthy = m.GATEWAY_ENGINE_HEALTHY.create(r)
        self.engine_inflight = m.GATEWAY_ENGINE_INFLIGHT.create(r)
        self.ejections = m.GATEWAY_ENGINE_EJECTIONS.create(r)
        self.stalls = m.GATEWAY_ENGINE_STALLS.create(r)
        self.kv_pair_open = m.GATEWAY_KV_PAIR_OPEN.create(r)
        self.held = m.GATEWAY_HELD_REQUESTS.create(r)
        self.rejected = m.GATEWAY_REJECTED_REQUESTS.create(r)
        self.kv_index_blocks = m.GATEWAY_KV_INDEX_BLOCKS.create(r)
        self.kv_index_events = m.GATEWAY_KV_INDEX_EVENTS.create(r)
        self.kv_index_replays = m.GATEWAY_KV_INDEX_REPLAYS.create(r)
        self.kv_index_resets = m.GATEWAY_KV_INDEX_RESETS.create(r)
        self.kv_index_fresh = m.GATEWAY_KV_INDEX_FRESH.create(r)
        self.activations = m.GATEWAY_ACTIVATIONS.create(r)

    def forget_engine(self, url: str, role: str) -> None:
        """Drop a removed engine's series so no stale gauge outlives it."""
        for metric in (self.engine_healthy, self.engine_inflight, self.ejections, self.stalls):
            with contextlib.suppress(KeyError):
                metric.remove(url, role)
        with contextlib.suppress(KeyError):
            self.kv_index_fresh.remove(url)
        for prefill, decode in list(self.kv_pair_open._metrics):
            if url in (prefill, decode):
                with contextlib.suppress(KeyError):
                    self.kv_pair_open.remove(prefill, decode)
