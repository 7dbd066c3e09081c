"""Prometheus metrics of the gateway (``pdfleet_gateway_*``, see docs/metrics.md).

TTFT and E2E are measured as the client sees them: from the request's arrival
at the gateway to the first relayed stream event / the last byte, so they
include the prefill leg and KV transfer that an engine's own TTFT cannot see.

The series every request touches (its answer's counter and latency, the TTFT,
the routing decision, the in-flight gauges) are updated without a lock:
``prometheus_client`` takes a lock per update, several times per request, so
the request path adds to plain numbers: a :class:`FastCounter`'s are folded
into the real series whenever the registry is collected (a scrape, a worker's
merge, a test reading it); the request path's histograms are
:class:`LockFreeHistogram` collectors, which expose their plain numbers
themselves. One event loop per process makes the plain numbers safe. Only
``prometheus_client``'s public API is used.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from ..contracts import metrics as m

# How prometheus_client writes a bucket's ``le`` (the same text, so merged and
# compared expositions line up); typed here, the library's is not annotated.
_le_text: Callable[[float], str] = floatToGoString


class FastCounter:
    """A counter series' increments, kept as plain numbers until collected."""

    __slots__ = ("_ones", "_ones_flushed", "_pending", "add_one", "series")

    def __init__(self, series: Any) -> None:
        self.series = series
        self._pending = 0.0
        self._ones = itertools.count()
        self._ones_flushed = 0
        self.add_one: Callable[[], int] = self._ones.__next__
        """``inc()`` without a Python call (the request path's counters): each
        call takes the next number of a count, read back at the flush."""

    def inc(self, amount: float = 1.0) -> None:
        self._pending += amount

    def flush(self) -> None:
        taken = next(self._ones)  # (the one number no ``add_one`` took)
        ones, self._ones_flushed = taken - self._ones_flushed, taken + 1
        pending = self._pending + ones
        if pending:
            self._pending = 0.0
            self.series.inc(pending)


class FastHistogram:
    """One histogram series (a label set), counted per bucket in plain numbers:
    its family (:class:`LockFreeHistogram`) reads them at each collection.
    ``le`` is inclusive, as Prometheus's."""

    __slots__ = ("_bounds", "_counts", "_sum", "created")

    def __init__(self, bounds: list[float]) -> None:
        self._bounds = bounds  # ascending, +Inf last
        self._counts = [0] * len(bounds)
        self._sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._sum += value

    def snapshot(self) -> tuple[list[int], float]:
        """(the cumulative count of each bucket, the sum of the observations)."""
        return list(itertools.accumulate(self._counts)), self._sum


class LockFreeHistogram:
    """A histogram family whose series take observations without a lock
    (:class:`FastHistogram`), exposed through the public collector interface
    exactly as a ``prometheus_client.Histogram`` of the same contract metric:
    the same buckets, ``_count``, ``_sum`` and ``_created`` samples."""

    def __init__(self, metric: m.Metric, registry: CollectorRegistry) -> None:
        if metric.kind != "histogram":
            raise ValueError(f"{metric.name}: not a histogram")
        self.metric = metric
        bounds = [float(b) for b in metric.buckets]
        if bounds[-1] != math.inf:
            bounds.append(math.inf)
        self._bounds = bounds
        self._series: dict[tuple[str, ...], FastHistogram] = {}
        registry.register(self)

    def labels(self, *values: str) -> FastHistogram:
        """The series of these label values (created, at 0, on first use)."""
        if len(values) != len(self.metric.labels):
            raise ValueError(f"{self.metric.name}: labels {self.metric.labels}, got {values}")
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = FastHistogram(self._bounds)
        return series

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(
            self.metric.family, self.metric.help, labels=list(self.metric.labels)
        )

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        les = [_le_text(b) for b in self._bounds]
        for values, series in list(self._series.items()):
            counts, total = series.snapshot()
            family.add_metric(list(values), list(zip(les, counts, strict=True)), total)
            named = dict(zip(self.metric.labels, values, strict=True))
            family.add_sample(self.metric.name + "_created", named, series.created)
        yield family


class _Folder:
    """Registered first on the registry: every collection folds the plain
    numbers into their series before any series is read."""

    def __init__(self) -> None:
        self.series: list[FastCounter] = []
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
        self.ttft = LockFreeHistogram(m.GATEWAY_TTFT, r)
        self.e2e = LockFreeHistogram(m.GATEWAY_E2E, r)
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
        self.migration_resume = LockFreeHistogram(m.GATEWAY_MIGRATION_RESUME, r).labels()

    def fast_counter(self, series: Any) -> FastCounter:
        """``series`` (a counter's labelled child) updated lock-free, folded at collection."""
        fast = FastCounter(series)
        self._folder.series.append(fast)
        return fast

    def fast_histogram(self, series: FastHistogram) -> FastHistogram:
        """``series``: the request path's histograms (TTFT, E2E, migration
        resume) are :class:`LockFreeHistogram` families, whose series need no
        folding."""
        return series

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
        for metric, contract in (
            (self.peer_pull_crossover, m.GATEWAY_PEER_PULL_CROSSOVER),
            (self.peer_pull_bandwidth, m.GATEWAY_PEER_PULL_BANDWIDTH),
            (self.kv_pair_open, m.GATEWAY_KV_PAIR_OPEN),
        ):
            for pair in label_sets(metric, contract):
                if url in pair:
                    with contextlib.suppress(KeyError):
                        metric.remove(*pair)


def label_sets(family: Any, metric: m.Metric) -> set[tuple[str, ...]]:
    """The label values of every series ``family`` (``metric``'s, a gauge or a
    counter) exposes now, in ``metric.labels`` order (read by collecting it)."""
    return {
        tuple(sample.labels[name] for name in metric.labels)
        for collected in family.collect()
        for sample in collected.samples
        if all(name in sample.labels for name in metric.labels)
    }
