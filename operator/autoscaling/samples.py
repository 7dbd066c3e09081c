"""Engine metrics -> the per-replica samples the policy reads.

Two steps, both pure: :func:`parse_engine_metrics` turns the Prometheus text of
one engine's ``/metrics`` into an :class:`EngineSnapshot` (gauges and
cumulative counters at one instant), and :func:`sample_from_snapshots` turns
two consecutive snapshots of the same replica into a :class:`ReplicaSample`,
whose rates (prompt tokens per second, busy fraction, recent TTFT/ITL) are
differences of counters over the interval between them.

pdfleet's native metric names are read first; the vLLM names are the fallback,
so the same autoscaler scales vLLM pods (which lack the prefill backlog and
busy-time series: their prefill scales on the waiting queue alone).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal

from ...engine.contracts import metrics as m

ReplicaState = Literal["starting", "ready", "draining"]

# Series -> snapshot field, native name first, then vLLM's.
_GAUGES = {
    "num_running": m.names(m.ENGINE_NUM_REQUESTS_RUNNING),
    "num_waiting": m.names(m.ENGINE_NUM_REQUESTS_WAITING),
    "kv_cache_usage": m.names(m.ENGINE_KV_CACHE_USAGE),
    "waiting_prompt_tokens": m.names(m.ENGINE_WAITING_PROMPT_TOKENS),
    "kv_transfer_held_requests": m.names(m.ENGINE_KV_TRANSFER_HELD_REQUESTS),
}
_COUNTERS = {
    "prompt_tokens_total": m.names(m.ENGINE_PROMPT_TOKENS),
    "prefill_busy_seconds_total": m.names(m.ENGINE_PREFILL_BUSY_SECONDS),
}
_HISTOGRAMS = {"ttft": m.ENGINE_TTFT, "itl": m.ENGINE_ITL}
# A ratio is averaged over an engine's series (one per data-parallel rank);
# counts and totals are summed.
_AVERAGED = frozenset({"kv_cache_usage"})


@dataclass(frozen=True)
class EngineSnapshot:
    """Gauges and cumulative counters of one engine at one scrape.

    A field is None when the engine does not expose its series.
    """

    time: float
    """Scrape time in seconds (the caller's clock, the same one the policy's
    ``now`` uses)."""
    num_running: float | None = None
    num_waiting: float | None = None
    kv_cache_usage: float | None = None
    """Fraction of KV-cache blocks in use, 0 to 1."""
    waiting_prompt_tokens: float | None = None
    """Prompt tokens queued and not yet computed (prefix-cache hits excluded)."""
    kv_transfer_held_requests: float | None = None
    """Finished prefills whose KV blocks stay held until a decode engine pulls
    them (KV leases)."""
    prompt_tokens_total: float | None = None
    prefill_busy_seconds_total: float | None = None
    """Seconds the engine spent running prefill work (a counter)."""
    ttft_sum: float | None = None
    ttft_count: float | None = None
    itl_sum: float | None = None
    itl_count: float | None = None


@dataclass(frozen=True)
class ReplicaSample:
    """What the policy knows about one replica of a role."""

    name: str
    state: ReplicaState = "ready"
    """``starting`` (not serving yet), ``ready``, or ``draining`` (receives no
    new work and leaves when empty; the policy ignores it)."""
    time: float | None = None
    """When its latest metrics were scraped; None if never (starting, or every
    scrape failed)."""
    num_waiting: float = 0
    num_running: float = 0
    kv_cache_usage: float = 0.0
    """Fraction of its KV cache in use, 0 to 1."""
    waiting_prompt_tokens: float | None = None
    """Queued uncached prompt tokens; None where the engine does not say (vLLM)."""
    interval_seconds: float | None = None
    """Seconds between the two scrapes the rates below come from; None with
    no earlier scrape (the rates are then None too)."""
    prompt_tokens_per_second: float | None = None
    """Prompt tokens computed per second over the interval."""
    prompt_token_arrivals_per_second: float | None = None
    """Prompt tokens that arrived per second: computed plus the growth of the
    queue. Unlike the computed rate it keeps rising when the replica is
    saturated."""
    prefill_busy_fraction: float | None = None
    """Fraction of the interval spent running prefill work, 0 to 1."""
    request_arrivals_per_second: float | None = None
    """Requests that arrived per second: first tokens served plus the growth
    of the requests running and waiting (on prefill, where a request's
    first token ends its stay, the request arrival rate)."""
    first_tokens_per_second: float | None = None
    """Requests per second that got their first token over the interval (the
    TTFT histogram's count): on decode, the admission rate."""
    ttft_seconds: float | None = None
    """Mean time to first token of requests served in the interval."""
    itl_seconds: float | None = None
    """Mean inter-token latency over the interval."""
    startup_seconds: float | None = None
    """How long the replica took from creation to ready, as its platform
    recorded it (a Pod: its ``creationTimestamp`` to its Ready condition's
    ``lastTransitionTime``; a local engine: launch to its first healthy
    ``/health``). None where not known. Replicas that started before the
    autoscaler first saw them tell it their cold start this way."""


def _families(text: str) -> dict[str, list[float]]:
    scrape = m.parse_metrics(text)
    return {name: [value for _, value in series] for name, series in scrape.samples.items()}


def _pick(values: dict[str, list[float]], names: Iterable[str], average: bool) -> float | None:
    for name in names:
        series = values.get(name)
        if series:
            return sum(series) / len(series) if average else sum(series)
    return None


def parse_engine_metrics(text: str, time: float) -> EngineSnapshot:
    """Parse one engine's ``/metrics`` text (Prometheus exposition format).

    Series with several label sets (data-parallel ranks) are summed, except
    the KV-cache usage ratio, which is averaged. Raises ``ValueError`` on text
    that is not Prometheus exposition format.
    """
    return snapshot_from_series(_families(text), time)


def snapshot_from_series(values: dict[str, list[float]], time: float) -> EngineSnapshot:
    """An :class:`EngineSnapshot` from sample name -> values (one per label set)."""
    fields: dict[str, float | None] = {}
    for name, series in (_GAUGES | _COUNTERS).items():
        fields[name] = _pick(values, series, name in _AVERAGED)
    for name, metric in _HISTOGRAMS.items():
        series = m.names(metric)
        fields[f"{name}_sum"] = _pick(values, [s + "_sum" for s in series], False)
        fields[f"{name}_count"] = _pick(values, [s + "_count" for s in series], False)
    return EngineSnapshot(time=time, **fields)


def _delta(cur: float | None, prev: float | None) -> float | None:
    """Counter increase; None when unknown or reset (the engine restarted)."""
    if cur is None or prev is None or cur < prev:
        return None
    return cur - prev


def _in_system(snapshot: EngineSnapshot) -> float:
    return (snapshot.num_running or 0.0) + (snapshot.num_waiting or 0.0)


def _mean(sum_delta: float | None, count_delta: float | None) -> float | None:
    if sum_delta is None or not count_delta:
        return None
    return sum_delta / count_delta


def sample_from_snapshots(
    name: str,
    current: EngineSnapshot | None,
    previous: EngineSnapshot | None = None,
    state: ReplicaState = "ready",
    startup_seconds: float | None = None,
) -> ReplicaSample:
    """The policy's sample of one replica from its two latest snapshots.

    ``current`` None means no scrape has succeeded (the sample has no time,
    which the policy treats as missing metrics). Rates need ``previous``
    strictly older than ``current``; a counter that went down (an engine
    restart) yields no rate rather than a negative one.
    """
    if current is None:
        return ReplicaSample(name=name, state=state, startup_seconds=startup_seconds)
    waiting_tokens = current.waiting_prompt_tokens
    base = ReplicaSample(
        name=name,
        state=state,
        time=current.time,
        num_waiting=current.num_waiting or 0.0,
        num_running=current.num_running or 0.0,
        kv_cache_usage=min(max(current.kv_cache_usage or 0.0, 0.0), 1.0),
        waiting_prompt_tokens=waiting_tokens,
        startup_seconds=startup_seconds,
    )
    if previous is None or previous.time >= current.time:
        return base
    dt = current.time - previous.time
    tokens = _delta(current.prompt_tokens_total, previous.prompt_tokens_total)
    busy = _delta(current.prefill_busy_seconds_total, previous.prefill_busy_seconds_total)
    first = _delta(current.ttft_count, previous.ttft_count)
    arrivals = None
    if tokens is not None and waiting_tokens is not None:
        queued_growth = waiting_tokens - (previous.waiting_prompt_tokens or 0.0)
        arrivals = max(tokens + queued_growth, 0.0) / dt
    return replace(
        base,
        interval_seconds=dt,
        prompt_tokens_per_second=None if tokens is None else tokens / dt,
        prompt_token_arrivals_per_second=arrivals,
        prefill_busy_fraction=None if busy is None else min(busy / dt, 1.0),
        first_tokens_per_second=None if first is None else first / dt,
        request_arrivals_per_second=None
        if first is None
        else max(first + _in_system(current) - _in_system(previous), 0.0) / dt,
        ttft_seconds=_mean(_delta(current.ttft_sum, previous.ttft_sum), first),
        itl_seconds=_mean(
            _delta(current.itl_sum, previous.itl_sum),
            _delta(current.itl_count, previous.itl_count),
        ),
    )
