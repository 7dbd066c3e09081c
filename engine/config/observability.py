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

    def compute_hash(self) -> str:
        return hash_factors([])
