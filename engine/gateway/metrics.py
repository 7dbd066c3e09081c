"""Prometheus metrics of the gateway (``pdfleet_gateway_*``, see docs/metrics.md).

TTFT and E2E are measured as the client sees them: from the request's arrival
at the gateway to the first relayed stream event / the last byte, so they
include the prefill leg and KV transfer that an engine's own TTFT cannot see.

The series every request touches (its answer's counter and latency, the TTFT,
the routing decision, the in-flight gauges) are updated without a lock:
``prometheus_client`` takes a lock per update, several times per request, so
the request path adds to plain numbers (:class:`FastCounter`,
:class:`FastHistogram`) that are folded into the real series whenever the
registry is collected (a scrape, a worker's merge, a test reading it). One
event loop per process makes the plain numbers safe.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from ..contracts import metrics as m


class FastCounter:
    """A counter series' increments, kept as a plain number until collected."""

    __slots__ = ("_pending", "series")

    def __init__(self, series: Any) -> None:
        self.series = series
        self._pending = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self._pending += amount

    def flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, 0.0
            self.series.inc(pending)


class FastHistogram:
    """A histogram series' observations, counted per bucket until collected
    (the same buckets: ``le`` is inclusive, as prometheus_client's)."""

    __slots__ = ("_bounds", "_counts", "_sum", "series")

    def __init__(self, series: Any) -> None:
        self.series = series
        # prometheus_client's own bucket bounds and values; without them (another
        # version of the library) every observation goes straight to the series.
        bounds = getattr(series, "_upper_bounds", None)
        buckets = getattr(series, "_buckets", None)
        ok = bounds is not None and buckets is not None and len(bounds) == len(buckets)
        self._bounds: list[float] | None = list(bounds) if ok and bounds else None
        self._counts = [0] * len(self._bounds) if self._bounds is not None else []
        self._sum = 0.0

    def observe(self, value: float) -> None:
        bounds = self._bounds
        if bounds is None:
            self.series.observe(value)
            return
        self._counts[bisect.bisect_left(bounds, value)] += 1
        self._sum += value

    def flush(self) -> None:
        if self._bounds is None or not any(self._counts):
            return
        counts, self._counts = self._counts, [0] * len(self._counts)
        total, self._sum = self._sum, 0.0
        self.series._sum.inc(total)
        for bucket, n in zip(self.series._buckets, counts, strict=True):
            if n:
                bucket.inc(n)


class _Folder:
    """Registered first on the registry: every collection folds the plain
    numbers into their series before any series is read."""

    def __init__(self) -> None:
        self.series: list[FastCounter | FastHistogram] = []
        self.hooks: list[Callable[[], None]] = []

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Any]:
        for series in self.series:
            series.flush()
        for hook in self.hooks:
            hook()
        return iter(())


class GatewayMetrics:
    """The gateway's series (names and labels in ``engine/contracts/metrics.py``)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self._folder = _Folder()
        r.register(self._folder)  # before the series: collected (folded) first
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
        self.stall_limit = m.GATEWAY_ENGINE_STALL_LIMIT.create(r)
        self.capacity = m.GATEWAY_ENGINE_CAPACITY.create(r)
        self.queued = m.GATEWAY_QUEUED_REQUESTS.create(r)
        self.kv_pair_open = m.GATEWAY_KV_PAIR_OPEN.create(r)
        self.held = m.GATEWAY_HELD_REQUESTS.create(r)
        self.rejected = m.GATEWAY_REJECTED_REQUESTS.create(r)
        self.kv_index_blocks = m.GATEWAY_KV_INDEX_BLOCKS.create(r)
        self.kv_index_events = m.GATEWAY_KV_INDEX_EVENTS.create(r)
        self.kv_index_replays = m.GATEWAY_KV_INDEX_REPLAYS.create(r)
        self.kv_index_resets = m.GATEWAY_KV_INDEX_RESETS.create(r)
        self.kv_index_fresh = m.GATEWAY_KV_INDEX_FRESH.create(r)
        self.activations = m.GATEWAY_ACTIVATIONS.create(r)
        self.peer_pull_decisions = m.GATEWAY_PEER_PULL_DECISIONS.create(r)
        self.peer_pull_crossover = m.GATEWAY_PEER_PULL_CROSSOVER.create(r)
        self.peer_pull_fleet_crossover = m.GATEWAY_PEER_PULL_FLEET_CROSSOVER.create(r)
        self.peer_pull_bandwidth = m.GATEWAY_PEER_PULL_BANDWIDTH.create(r)
        self.peer_pull_prefill_rate = m.GATEWAY_PEER_PULL_PREFILL_RATE.create(r)
        self.peer_pull_lend_seconds = m.GATEWAY_PEER_PULL_LEND_SECONDS.create(r)
        self.tenant_requests = m.GATEWAY_TENANT_REQUESTS.create(r)
        self.tenant_tokens = m.GATEWAY_TENANT_TOKENS.create(r)
        self.tenant_inflight = m.GATEWAY_TENANT_INFLIGHT.create(r)
        self.tenant_inflight_tokens = m.GATEWAY_TENANT_INFLIGHT_TOKENS.create(r)
        self.tenant_queued = m.GATEWAY_TENANT_QUEUED.create(r)
        self.tenant_queue_seconds = m.GATEWAY_TENANT_QUEUE_SECONDS.create(r)
        self.batch_requests = m.GATEWAY_BATCH_REQUESTS.create(r)
        self.lora_loads = m.GATEWAY_LORA_LOADS.create(r)
        self.lora_identity_conflicts = m.GATEWAY_LORA_IDENTITY_CONFLICTS.create(r)
        self.migrations = m.GATEWAY_MIGRATIONS.create(r)
        self.migration_replayed = m.GATEWAY_MIGRATION_REPLAYED_TOKENS.create(r)
        self.migration_resume = m.GATEWAY_MIGRATION_RESUME.create(r)

    def fast_counter(self, series: Any) -> FastCounter:
        """``series`` (a counter's labelled child) updated lock-free, folded at collection."""
        fast = FastCounter(series)
        self._folder.series.append(fast)
        return fast

    def fast_histogram(self, series: Any) -> FastHistogram:
        """``series`` (a histogram's labelled child) updated lock-free, folded at collection."""
        fast = FastHistogram(series)
        self._folder.series.append(fast)
        return fast

    def on_collect(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` at each collection, before any series is read (gauges
        whose value the gateway keeps elsewhere: in-flight requests)."""
        self._folder.hooks.append(hook)

    def forget_engine(self, url: str, role: str) -> None:
        """Drop a removed engine's series so no stale gauge outlives it."""
        for metric in (
            self.engine_healthy,
            self.engine_inflight,
            self.ejections,
            self.stalls,
            self.stall_limit,
            self.capacity,
        ):
            with contextlib.suppress(KeyError):
                metric.remove(url, role)
        with contextlib.suppress(KeyError):
            self.kv_index_fresh.remove(url)
        for metric in (self.peer_pull_prefill_rate, self.peer_pull_lend_seconds):
            with contextlib.suppress(KeyError):
                metric.remove(url)
        for metric in (self.peer_pull_crossover, self.peer_pull_bandwidth):
            for holder, puller in list(metric._metrics):
                if url in (holder, puller):
                    with contextlib.suppress(KeyError):
                        metric.remove(holder, puller)
        for prefill, decode in list(self.kv_pair_open._metrics):
            if url in (prefill, decode):
                with contextlib.suppress(KeyError):
                    self.kv_pair_open.remove(prefill, decode)
