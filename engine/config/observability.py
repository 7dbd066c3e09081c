"""Logging, metrics and tracing."""

from __future__ import annotations

from dataclasses import dataclass

from .hashing import hash_factors


@dataclass
class ObservabilityConfig:
    """Statistics and tracing."""

    log_stats: bool = True
    """Log periodic engine statistics (throughput, queue, KV usage)."""
    otlp_traces_endpoint: str | None = None
    """OTLP/HTTP traces URL (``http://collector:4318/v1/traces``); the standard
    ``OTEL_*`` variables also turn tracing on (docs/observability.md)."""
    trust_client_trace_context: bool = False
    """Continue the trace of a client's `traceparent`, sampled flag included.
    Off: a request from anyone but a holder of the fleet token (the gateway)
    starts a new trace, which the configured sampler decides on, linked to the
    client's span."""

    def compute_hash(self) -> str:
        return hash_factors([])
