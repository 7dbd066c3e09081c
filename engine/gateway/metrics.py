"""Prometheus metrics of the gateway (``pdfleet_gateway_*``, docs/gateway.md, "Metrics").

TTFT and E2E are measured as the client sees them: from the request's arrival
at the gateway to the first relayed stream event / the last byte, so they
include the prefill leg and KV transfer that an engine's own TTFT cannot see.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdfleet.engine.buckets import E2E_BUCKETS, TTFT_BUCKETS


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        p = "pdfleet_gateway_"
        self.requests = Counter(
            p + "requests",
            "Requests answered, by endpoint and HTTP status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Streamed requests: arrival to the first relayed event.",
            ["endpoint"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds",
            "Arrival to the last byte of the response.",
            ["endpoint"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.decisions = Counter(
            p + "disagg_decisions",
            "Disaggregation decisions: prefill_decode or decode_only, with the reason.",
            ["decision", "reason"],
            registry=r,
        )
        self.retries = Counter(
            p + "retries",
            "Legs retried on another engine, by role.",
            ["role"],
            registry=r,
        )
        self.fallbacks = Counter(
            p + "fallbacks",
            "Disaggregated requests served decode-only without a producer's KV "
            "(prefill_failed, no_prefill_engine, no_kv_transfer_params).",
            ["reason"],
            registry=r,
        )
        self.upstream_errors = Counter(
            p + "upstream_errors",
            "Failed engine calls (connect, timeout, status, stream), by engine.",
            ["engine", "role", "kind"],
            registry=r,
        )
        self.engine_healthy = Gauge(
            p + "engine_healthy",
            "1 while an engine receives traffic, 0 while it is ejected or not yet ready.",
            ["engine", "role"],
            registry=r,
        )
        self.engine_inflight = Gauge(
            p + "engine_inflight_requests",
            "Requests the gateway has in flight on an engine.",
            ["engine", "role"],
            registry=r,
        )
        self.ejections = Counter(
            p + "engine_ejections",
            "Times an engine was ejected from routing.",
            ["engine", "role"],
            registry=r,
        )

        self.stalls = Counter(
            p + "engine_stalls",
            "Times an engine was ejected because its in-flight requests made no "
            "progress while other engines did.",
            ["engine", "role"],
            registry=r,
        )
        self.kv_pair_open = Gauge(
            p + "kv_pair_open",
            "1 while the KV circuit breaker of a (prefill, decode) engine pair is open "
            "(the pair is not used for disaggregation).",
            ["prefill", "decode"],
            registry=r,
        )
        self.held = Gauge(
            p + "held_requests",
            "Requests waiting for a routable decode engine (all down, restarting or "
            "scaled to zero).",
            registry=r,
        )
        self.rejected = Counter(
            p + "rejected_requests",
            "Requests refused before routing, by reason (body_too_large, body_timeout, "
            "invalid_json, invalid_field, unauthorized).",
            ["reason"],
            registry=r,
        )

    def forget_engine(self, url: str, role: str) -> None:
        """Drop a removed engine's series so no stale gauge outlives it."""
        for metric in (self.engine_healthy, self.engine_inflight, self.ejections, self.stalls):
            with contextlib.suppress(KeyError):
                metric.remove(url, role)
        for prefill, decode in list(self.kv_pair_open._metrics):
            if url in (prefill, decode):
                with contextlib.suppress(KeyError):
                    self.kv_pair_open.remove(prefill, decode)
