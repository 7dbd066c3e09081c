"""Per-role load signals: what the policy measures before it decides.

Each function turns the fresh samples of one role into a :class:`RoleSignal`:
a real number of replicas the load needs (``raw``), the signal that set it,
and a line of measurements for the decision's reason. Pure functions.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from .samples import ReplicaSample
from .spec import DecodeScaling, PrefillScaling

# Share of the TTFT target that queued prefill work may take; the rest is the
# request's own prefill, the KV transfer and the first decode step.
BACKLOG_SHARE_OF_TTFT = 0.5
# Fewest samples (periods) a trend is fitted to.
MIN_TREND_POINTS = 4
# Decode follows prefill's growth at this quantile of prefill's pairwise
# slopes (a rise three quarters of the pairs agree on): prefill's own
# projection acts on its median slope (a missed ramp costs TTFT), but passing
# that noise on to decode, whose KV usage at a few replicas is noisy already,
# would make decode flap.
GROWTH_QUANTILE = 0.25
# A fall counts as decisive when this quantile of the pairwise slopes is
# negative (three quarters of the pairs agree the load is going down) and
# the fall it projects over the trend window is at least FALL_SHARE of the
# demand: noise on a steady load rarely satisfies both.
FALL_QUANTILE = 0.75
FALL_SHARE = 0.1
# A rise starts (:func:`project_rise`) where the slope before the recent
# samples is at most this share of theirs.
KINK_SHARE = 0.5

Trend = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class RoleSignal:
    """A role's load before stabilization."""

    raw: float | None
    """Replicas the load needs, as a real number; None with no fresh sample."""
    code: str
    """The reason code of the largest signal."""
    detail: str
    """The measurements, for the decision's reason."""
    complete: bool
    """Every ready replica contributed a usable sample."""
    missing: tuple[str, ...]
    """Ready replicas without a usable sample."""
    starting: int
    demand: float | None
    """Measured demand in replicas (the series the trend is fitted to)."""
    growth: float = 1.0
    """Projected / measured demand, counting only a significant rise."""
    falling: bool = False
    """The demand is falling decisively (:func:`falling`): the policy may then
    scale down on a shorter window than the spec's down window."""


def split_samples(
    replicas: Sequence[ReplicaSample], now: float, stale: float
) -> tuple[list[ReplicaSample], list[str], list[ReplicaSample]]:
    """(ready replicas with fresh samples, names of ready ones without, draining
    ones with)."""

    def fresh(r: ReplicaSample) -> bool:
        return r.time is not None and now - r.time <= stale

    ready = [r for r in replicas if r.state == "ready"]
    draining = [r for r in replicas if r.state == "draining" and fresh(r)]
    return [r for r in ready if fresh(r)], [r.name for r in ready if not fresh(r)], draining


def project(
    demand: float,
    history: Trend,
    now: float,
    ahead: float,
    quantile: float = 0.5,
    noise_z: float | None = None,
    min_span: float = 0.0,
) -> float:
    """``demand`` projected ``ahead`` seconds along its trend over ``history``
    plus now, never below ``demand`` (a falling load is left to the down
    window).

    The slope is a quantile of the slopes between every pair of samples (the
    median is the Theil-Sen estimator): one noisy sample moves it little,
    where a least-squares fit would project a single spike far ahead. A lower
    ``quantile`` asks for a rise that more of the pairs agree on. With
    ``noise_z``, a rise over the window smaller than that many times the
    series' noise (:func:`noise`) is not projected. Nor is any rise while
    the samples span less than ``min_span`` seconds: a few samples a few
    seconds apart (a fleet that just started, or decode's series just after
    a count change) see the first requests fill idle engines, and that
    warm-up carried a whole startup ahead is a scale-up on no evidence.
    """
    points = (*history, (now, demand))
    if now - points[0][0] < min_span - 1e-9:
        return demand
    slope = pairwise_slope(points, quantile)
    if slope is None or slope <= 0:
        return demand
    if noise_z is not None and slope * (now - points[0][0]) < noise_z * noise(points):
        # The rise over the window is within the series' own noise: on a
        # steady load, projecting it would turn noise into scale-ups.
        return demand
    return demand + slope * ahead


def project_rise(
    demand: float,
    history: Trend,
    now: float,
    ahead: float,
    recent_seconds: float,
    quantile: float = 0.5,
    noise_z: float | None = None,
    min_span: float = 0.0,
    rise_z: float | None = None,
) -> float:
    """:func:`project`, but once the whole window shows a rise, along the
    steeper of its slope and the slope of the last ``recent_seconds`` alone.

    At the start of a ramp most of the window's samples predate it, so the
    window's median slope is a fraction of the ramp's: the projection then
    lags the ramp by about half the window, which a cold start cannot make
    up. The recent samples see the ramp's own slope. They are used only where
    the whole window already shows a rise, and only at the lower of the
    recent slope now and one period ago: a ramp is steep in both, while a
    single noisy sample (on a steady load, or on a surge's plateau, where
    the window still holds the ramp) is in only one.
    """
    base = project(demand, history, now, ahead, quantile, noise_z, min_span)
    if base <= demand:
        return base
    points = (*history, (now, demand))
    recent = tuple(p for p in points if now - p[0] <= recent_seconds + 1e-9)
    older = points[: len(points) - len(recent) + 1]
    slope = pairwise_slope(recent, quantile)
    if slope is None or len(older) < 2:
        return base
    # The shape of a ramp's start: flat, then rising. On a surge's plateau
    # the window's older samples hold the ramp, and a noisy recent slope is
    # no steeper than theirs.
    before = statistics.median(
        (v2 - v1) / (t2 - t1)
        for i, (t1, v1) in enumerate(older)
        for t2, v2 in older[i + 1 :]
        if t2 > t1
    )
    if before > KINK_SHARE * slope:
        return base
    if rise_z is not None and slope * (now - recent[0][0]) < rise_z * noise(points):
        # A rise over the recent samples within the window's own noise: on a
        # steady load, projecting it would turn noise into scale-ups.
        return base
    return max(base, demand + slope * ahead)


def pairwise_slope(points: Trend, quantile: float) -> float | None:
    """The ``quantile`` of the slopes between every pair of ``points`` (None
    with fewer than :data:`MIN_TREND_POINTS`)."""
    if len(points) < MIN_TREND_POINTS:
        return None
    slopes = sorted(
        (v2 - v1) / (t2 - t1)
        for i, (t1, v1) in enumerate(points)
        for t2, v2 in points[i + 1 :]
        if t2 > t1
    )
    if not slopes:
        return None
    position = quantile * (len(slopes) - 1)
    low = slopes[math.floor(position)]
    high = slopes[math.ceil(position)]
    return low + (high - low) * (position - math.floor(position))


def fitted_level(demand: float, history: Trend, now: float) -> float:
    """The demand now as the robust line through ``history`` plus now gives
    it: the median of every sample carried to ``now`` along the median
    pairwise slope (the Theil-Sen line's value at ``now``). A single noisy
    sample then moves the level by a fraction of its noise, while a linear
    ramp is followed without lag. ``demand`` itself with fewer than
    :data:`MIN_TREND_POINTS` samples."""
    points = (*history, (now, demand))
    slope = pairwise_slope(points, 0.5)
    if slope is None:
        return demand
    return statistics.median(v + slope * (now - t) for t, v in points)


def outlier_bound(demand: float, history: Trend, now: float, counted: float, z: float) -> float:
    """The highest demand ``history`` plus now still counts as a rate of the
    load rather than a noisy period: ``z`` standard deviations above the
    robust line's value now (:func:`fitted_level`), where the deviation is
    the larger of the series' own noise (:func:`noise`) and the Poisson
    noise of the ``counted`` requests the demand was measured from
    (``demand / sqrt(counted)``). The floor matters on a smooth ramp, whose
    residuals are small: a period a little steeper than the last is the
    ramp, not an outlier. ``demand`` itself (no bound) with fewer than
    :data:`MIN_TREND_POINTS` samples, nothing counted, or the previous
    sample above the bound too (a step holds one period at most)."""
    points = (*history, (now, demand))
    if len(points) < MIN_TREND_POINTS or counted <= 0:
        return demand
    sigma = max(noise(points), demand / math.sqrt(counted))
    bound = fitted_level(demand, history, now) + z * sigma
    if history[-1][1] > bound:
        # Two periods in a row above it: a step of the load, not one noisy
        # period.
        return demand
    return max(min(demand, bound), 0.0)


def noise(history: Trend) -> float:
    """The spread of ``history`` about its Theil-Sen line: 1.4826 x the
    median absolute residual (a standard deviation for Gaussian noise, not
    moved by a few outliers); 0 with fewer than :data:`MIN_TREND_POINTS`."""
    slope = pairwise_slope(history, 0.5)
    if slope is None:
        return 0.0
    t0 = history[-1][0]
    carried = [v + slope * (t0 - t) for t, v in history]
    level = statistics.median(carried)
    return 1.4826 * statistics.median(abs(c - level) for c in carried)


def falling(demand: float, history: Trend, now: float, noise_z: float | None = None) -> bool:
    """Whether ``demand`` is falling decisively over ``history``: the
    :data:`FALL_QUANTILE` slope is negative and, over the history's span,
    amounts to at least :data:`FALL_SHARE` of the demand."""
    points = (*history, (now, demand))
    slope = pairwise_slope(points, FALL_QUANTILE)
    if slope is None or slope >= 0:
        return False
    span = points[-1][0] - points[0][0]
    least = FALL_SHARE * max(demand, 1e-9)
    if noise_z is not None:
        least = max(least, noise_z * noise(points))
    return -slope * span >= least


def calibrate_prefill_rate(
    samples: Sequence[ReplicaSample], previous: float | None, smoothing: float, min_busy: float
) -> float | None:
    """Prompt tokens one prefill replica computes per busy second, smoothed.

    Measured as the samples' summed prompt-token rate over their summed busy
    fraction; a fleet busier than ``min_busy`` replica-equivalents is needed
    (an idle fleet measures nothing), else ``previous`` stands.
    """
    pairs = [
        (r.prompt_tokens_per_second, r.prefill_busy_fraction)
        for r in samples
        if r.prompt_tokens_per_second is not None and r.prefill_busy_fraction is not None
    ]
    busy = sum(b for _, b in pairs)
    if busy < min_busy:
        return previous
    measured = sum(t for t, _ in pairs) / busy
    if measured <= 0:
        return previous
    return measured if previous is None else previous + smoothing * (measured - previous)


def prefill_signal(
    role: PrefillScaling,
    fresh: Sequence[ReplicaSample],
    missing: Sequence[str],
    starting: int,
    tokens_per_second: float | None,
    history: Trend,
    now: float,
    ahead: float,
    target_utilization: float,
    drain_seconds: float,
    recent_peak: float = 0.0,
    noise_z: float | None = None,
    min_span: float = 0.0,
    rise_recent_seconds: float | None = None,
    rise_z: float | None = None,
    rise: bool = True,
    tokens_per_request: float | None = None,
    outlier_z: float | None = None,
) -> RoleSignal:
    """Prefill needs the larger of

    * projected demand / target utilization, where demand is prompt-token
      arrivals (computed + queue growth) over one replica's tokens per second
      (or, before that is known, the summed busy fraction);
    * projected demand plus the backlog beyond ``BACKLOG_SHARE_OF_TTFT`` of
      the TTFT target per replica, drained over ``drain_seconds``. A deep
      queue says how late capacity is, not how much is needed: sizing the
      fleet to empty it at once would overshoot by the queue's depth;
    * waiting requests / ``targetWaitingPerReplica``, only where the engines
      do not export queued prompt tokens (vLLM).

    Without ``rise`` the demand is not projected (nor its growth passed on).
    With ``tokens_per_request`` (the prompt mix measured over a longer
    window) the arrivals are the request arrival rate times it: the rate is
    what a surge moves, the mix only adds per-period noise. With
    ``outlier_z`` too, a request rate that stands out of its trend window
    is sized at :func:`outlier_bound` (the demand series keeps what was
    measured).
    """
    no_rate = [f"{r.name} (first scrape)" for r in fresh if r.interval_seconds is None]
    rate = tokens_per_second if tokens_per_second is not None else role.prefill_tokens_per_second
    arrivals = [r.prompt_token_arrivals_per_second for r in fresh]
    busy = [r.prefill_busy_fraction for r in fresh]
    parts: list[str] = []
    demand: float | None = None
    requests = [r.request_arrivals_per_second for r in fresh]
    source = "measured" if tokens_per_second is not None else "configured"
    queued = [r.waiting_prompt_tokens for r in fresh]
    backlog = None
    if rate and queued and all(q is not None for q in queued):
        backlog = sum(q or 0.0 for q in queued) / rate
    allowance = role.ttft_target_seconds * BACKLOG_SHARE_OF_TTFT
    excess = 0.0 if backlog is None else max(backlog - allowance * len(fresh), 0.0)
    level: float | None = None
    if rate and tokens_per_request and any(q is not None for q in requests):
        per_second = sum(q or 0.0 for q in requests)
        demand = per_second * tokens_per_request / rate
        parts.append(
            f"{per_second:.1f} requests/s x {tokens_per_request:.0f} prompt tokens = "
            f"{demand:.2f} replicas at {rate:.0f} tok/s ({source})"
        )
        if outlier_z is not None and not excess:
            # A queue beyond its allowance says the fleet is short already:
            # that period's rate is not noise to discount.
            counted = sum(
                (q or 0.0) * (r.interval_seconds or 0.0)
                for q, r in zip(requests, fresh, strict=True)
            )
            bound = outlier_bound(demand, history, now, counted, outlier_z)
            if bound < demand:
                level = bound
                parts.append(
                    f"an outlier of its {now - history[0][0]:.0f} s trend: sized as {bound:.2f}"
                )
    elif rate and any(a is not None for a in arrivals):
        total = sum(a or 0.0 for a in arrivals)
        demand = total / rate
        parts.append(
            f"prompt arrivals {total:.0f} tok/s = {demand:.2f} replicas at {rate:.0f} tok/s "
            f"({source})"
        )
    elif any(b is not None for b in busy):
        demand = sum(b or 0.0 for b in busy)
        parts.append(f"busy {demand:.2f} replicas (tokens/s not known yet)")
    planned = growth = 0.0
    is_falling = False
    if demand is not None:
        is_falling = falling(demand, history, now, noise_z)
        if not rise:
            projected = demand
        elif rise_recent_seconds is None:
            projected = project(demand, history, now, ahead, noise_z=noise_z, min_span=min_span)
        else:
            projected = project_rise(
                demand,
                history,
                now,
                ahead,
                rise_recent_seconds,
                0.5,
                noise_z,
                min_span,
                rise_z,
            )
        if level is not None:
            # The rise is the measured series' own; only the level it starts
            # from is the bound.
            projected += level - demand
        planned = max(projected, recent_peak)
        if demand > 0 and rise:
            growth = (
                project(demand, history, now, ahead, GROWTH_QUANTILE, noise_z, min_span) / demand
            )
        if planned > demand + 1e-9:
            parts.append(f"rising: {planned:.2f} in {ahead:.0f} s")
    terms: list[tuple[float, str]] = []
    if demand is not None:
        terms.append((planned / target_utilization, "prefill_load"))
    if backlog is not None:
        terms.append((planned + excess / drain_seconds, "prefill_backlog"))
        parts.append(f"backlog {backlog:.2f} s ({allowance:.2f} s per replica allowed)")
    else:
        waiting = sum(r.num_waiting for r in fresh)
        terms.append((waiting / role.target_waiting_per_replica, "waiting_queue"))
        parts.append(f"{waiting:.0f} waiting")
    if starting:
        parts.append(f"{starting} starting")
    raw, code = max(terms, key=lambda t: t[0]) if fresh else (None, "no_metrics")
    return RoleSignal(
        raw=raw,
        code=code,
        detail=", ".join(parts),
        complete=not missing and not no_rate,
        missing=(*missing, *no_rate),
        starting=starting,
        demand=demand,
        growth=max(growth, 1.0),
        falling=is_falling,
    )


def decode_signal(
    role: DecodeScaling,
    fresh: Sequence[ReplicaSample],
    draining: Sequence[ReplicaSample],
    missing: Sequence[str],
    starting: int,
    history: Trend,
    now: float,
    ahead: float,
    drain_seconds: float,
    prefill_growth: float,
    prefill_falling: bool = False,
    recent_peak: float = 0.0,
    fit_level: bool = False,
    noise_z: float | None = None,
    min_span: float = 0.0,
    own_trend: bool = True,
    own_fall: bool = True,
) -> RoleSignal:
    """Decode needs projected KV demand / ``targetKVCacheUsage``.

    KV demand is the KV-cache usage summed over replicas (llm-d style: a sum,
    not an average), draining ones included, plus the requests waiting beyond
    ``targetWaitingPerReplica`` at the measured usage per running request,
    spread over ``drain_seconds`` (a queue of requests that each run D seconds
    needs queue x D / drain seconds of extra concurrency; D = running /
    admissions per second). It is projected along its own trend or along
    prefill's significant growth, whichever is larger: decode's load lags, as
    the requests rising at prefill reach it after their prefill. Without
    ``own_trend`` only prefill's growth is projected; without ``own_fall``
    only prefill's decisive fall counts as falling.
    """
    # Draining replicas still hold KV for their running requests; counting it
    # keeps the demand continuous across a scale-down (their load moves to
    # the others as new requests arrive rather than vanishing).
    kv = sum(r.kv_cache_usage for r in (*fresh, *draining))
    running = sum(r.num_running for r in (*fresh, *draining))
    waiting = sum(r.num_waiting for r in fresh)
    excess = sum(max(r.num_waiting - role.target_waiting_per_replica, 0.0) for r in fresh)
    target = role.target_kv_cache_usage
    queued = excess * kv / running if running > 0 else 0.0
    admitted = sum(r.first_tokens_per_second or 0.0 for r in fresh)
    if queued and admitted > 0:
        queued *= min(1.0, running / admitted / drain_seconds)
    demand = kv + queued
    parts = [
        f"KV usage {kv:.2f} summed (target {target:.2f} per replica)",
        f"{waiting:.0f} waiting (= {queued:.2f} KV to drain them)",
    ]
    level = demand
    if fit_level:
        # Summed KV usage is a snapshot of a few dozen requests of log-normal
        # lengths: on a steady load it swings by a third from one period to
        # the next. Sizing on the robust line through the recent samples
        # keeps that noise from crossing the tolerance band.
        level = fitted_level(demand, history, now)
        if abs(level - demand) > 1e-9:
            parts.append(f"level {level:.2f} on the recent trend")
    own = level
    if own_trend:
        own = project(level, history, now, ahead, noise_z=noise_z, min_span=min_span)
    planned = max(
        own,
        level * prefill_growth,
        recent_peak,
    )
    if planned > level + 1e-9:
        parts.append(f"rising: {planned:.2f} in {ahead:.0f} s")
    if starting:
        parts.append(f"{starting} starting")
    terms = [(planned / target, "kv_cache")]
    if running == 0 and waiting > 0:
        # Requests wait yet none runs: there is no KV share to convert with.
        terms.append((waiting / role.target_waiting_per_replica, "waiting_queue"))
    raw, code = max(terms, key=lambda t: t[0]) if fresh else (None, "no_metrics")
    return RoleSignal(
        raw=raw,
        code=code,
        detail=", ".join(parts),
        complete=not missing,
        missing=tuple(missing),
        starting=starting,
        demand=demand,
        # Decode's own series restarts at each count change; prefill's fall
        # is the earlier and steadier sign that decode's load will follow.
        falling=prefill_falling or (own_fall and falling(demand, history, now, noise_z)),
    )


def step_noise(history: Trend) -> float:
    """The noise of one sample of ``history``, from its successive
    differences: 1.4826 x their median absolute value / sqrt(2) (a standard
    deviation for Gaussian noise). A trend, a surge's shape or a level
    change moves only the few differences it spans, so a long window of a
    varying load still gives the noise of one period's sample; 0 with fewer
    than :data:`MIN_TREND_POINTS` samples."""
    if len(history) < MIN_TREND_POINTS:
        return 0.0
    steps = [abs(b - a) for (_, a), (_, b) in itertools.pairwise(history)]
    return 1.4826 * statistics.median(steps) / math.sqrt(2.0)


def rise_confirmed(demand: float | None, history: Trend, long: Trend, z: float | None) -> bool:
    """Whether ``demand`` stands out of its noise: above the median of the
    trend window ``history`` by more than ``z`` times the noise of one sample
    learned over the longer window ``long`` (:func:`step_noise`). True with
    ``z`` None, without a demand, or with fewer than
    :data:`MIN_TREND_POINTS` samples in either (nothing learned yet).

    On a steady rate the slope fitted to a trend window's few samples points
    up about half the time and projects noise a startup ahead; the level
    itself rarely leaves a band of a few times its noise. A ramp leaves it
    only after a few periods (docs/autoscaling.md, "Telling a steady load
    from the start of a ramp")."""
    if z is None or demand is None or len(long) < MIN_TREND_POINTS or not history:
        return True
    level = statistics.median(v for _, v in history)
    return demand > level + z * step_noise(long)


def fall_confirmed(
    demand: float | None, history: Trend, now: float, long: Trend, z: float | None
) -> bool:
    """Whether ``demand`` falls over ``history`` plus now by more than ``z``
    times the noise of one sample learned over ``long`` (:func:`step_noise`),
    at the :data:`FALL_QUANTILE` slope. True with ``z`` None or fewer than
    :data:`MIN_TREND_POINTS` long samples.

    Six samples of a steady rate agree on a 10% fall now and then (the test
    of :func:`falling`); a surge ebbing falls by many times the rate's
    noise."""
    if z is None or demand is None or len(long) < MIN_TREND_POINTS:
        return True
    points = (*history, (now, demand))
    slope = pairwise_slope(points, FALL_QUANTILE)
    if slope is None or slope >= 0:
        return False
    return -slope * (now - points[0][0]) >= z * step_noise(long)


def decode_trend_confirmed(prefill: RoleSignal, needs_arrivals: bool) -> bool:
    """Whether decode may project its own KV trend: always, or with
    ``needs_arrivals`` only while prefill's prompt arrivals rise (their
    growth, at the lower-quartile slope, is above 1).

    Summed KV usage is a snapshot of a few dozen requests of log-normal
    lengths: on a constant request rate it swings by a third from period to
    period, and the Theil-Sen slope of six such samples points up half the
    time. The prompt-token arrival rate sums every request of the period, so
    its noise is a few percent. Measured, this gate also holds back decode
    at the start of a surge, where its own trend is the earlier sign
    (docs/autoscaling.md, "Telling a steady load from the start of a
    ramp")."""
    return not needs_arrivals or prefill.growth > 1.0 + 1e-9
