"""The models the policy sizes from: pure functions, no state.

* :func:`queue_miss_share`: a queueing model of prefill's TTFT. Requests
  arrive at rate ``lambda`` (Poisson) and wait for one of ``c`` replicas
  (the gateway sends each to the least loaded, which behaves like one
  shared queue); service times have mean ``s`` and squared coefficient of
  variation ``scv``. The wait's tail is Erlang C's, ``P(W > x) = C(c, a)
  exp(-(c - a) x / s)`` for exponential service, stretched by ``(1 +
  scv) / 2`` for general service (Allen-Cunneen); a request misses the TTFT
  budget when its wait plus its own service exceeds it, its service drawn
  from a log-normal with the measured mean and spread.
* :func:`fit_step_model`: decode's step time against its KV usage, ``step
  = a + b x usage``, by least squares over recent per-replica samples (the
  mean inter-token latency of a period against the mean of the KV usage at
  its ends); with too little spread in the usage to tell ``a`` from ``b``,
  the last fit's slope through the recent samples, or before any fit ``a =
  0`` (every step's time in proportion to its KV: the estimate that never
  overstates the usage a target allows).
* :func:`theil_sen`: a robust line through a time series (its value now and
  its slope), for the arrival rate's short-horizon forecast.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

# Quantiles of the service time the TTFT model integrates over (midpoints
# of equal-probability bins, so each carries 1/n of the requests).
_BINS = 48
_NORMAL_QUANTILES = tuple(statistics.NormalDist().inv_cdf((i + 0.5) / _BINS) for i in range(_BINS))


def erlang_c(c: int, a: float) -> float:
    """Probability that an arrival waits, in an M/M/c queue with offered load
    ``a`` (arrival rate x mean service time) and ``c`` servers; 1 when
    ``a >= c`` (the queue grows without bound)."""
    if c <= 0 or a >= c:
        return 1.0
    if a <= 0:
        return 0.0
    b = 1.0  # Erlang B, by the stable recursion B(k) = a B(k-1) / (k + a B(k-1))
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    return c * b / (c - a * (1 - b))


def service_quantiles(mean: float, scv: float) -> list[float]:
    """Service times of :data:`_BINS` equally likely requests, from a
    log-normal with this mean and squared coefficient of variation."""
    sigma2 = math.log1p(max(scv, 0.0))
    mu = math.log(mean) - sigma2 / 2
    sigma = math.sqrt(sigma2)
    return [math.exp(mu + sigma * z) for z in _NORMAL_QUANTILES]


def queue_miss_share(c: int, rate: float, mean: float, scv: float, budget: float) -> float:
    """Share of requests whose wait plus service exceeds ``budget`` seconds,
    less the share whose service alone does (those no replica count saves):
    the misses the replica count is answerable for."""
    if rate <= 0:
        return 0.0
    a = rate * mean
    if a >= c:
        return 1.0
    waits = erlang_c(c, a)
    decay = (c - a) / (mean * (1 + scv) / 2)  # per second of the wait's tail
    missed = 0.0
    for s in service_quantiles(mean, scv):
        room = budget - s
        if room > 0:
            missed += waits * math.exp(-decay * room)
    return missed / _BINS


def replicas_for_ttft(
    rate: float, mean: float, scv: float, budget: float, miss_share: float, limit: int
) -> int:
    """The fewest replicas (up to ``limit``) that keep
    :func:`queue_miss_share` at most ``miss_share``."""
    if rate <= 0 or mean <= 0:
        return 0
    c = max(math.floor(rate * mean) + 1, 1)
    while c < limit and queue_miss_share(c, rate, mean, scv, budget) > miss_share:
        c += 1
    return min(c, limit)


def fit_step_model(
    points: Sequence[tuple[float, float]],
    min_spread: float,
    previous: tuple[float, float] | None = None,
) -> tuple[float, float, bool] | None:
    """``(a, b)`` of ``step = a + b x usage`` through ``(usage, step)``
    points: least squares where the usages spread by at least
    ``min_spread`` (their 10th to 90th percentile) and the fit is sane (both
    terms >= 0). Otherwise the ``previous`` fit's slope through the points'
    mean (the load moved little since it was fitted: its slope still holds,
    its level follows the points), or without one the line through the
    origin and the points' mean (``a = 0``). The third value says whether
    the line was fitted here (not carried over or through the origin). None
    without points."""
    if not points:
        return None
    xs = sorted(u for u, _ in points)
    mean_u = sum(xs) / len(xs)
    mean_s = sum(s for _, s in points) / len(points)
    if len(xs) >= 12:
        spread = xs[int(0.9 * (len(xs) - 1))] - xs[int(0.1 * (len(xs) - 1))]
        if spread >= min_spread:
            sxx = sum((u - mean_u) ** 2 for u, _ in points)
            sxy = sum((u - mean_u) * (s - mean_s) for u, s in points)
            b = sxy / sxx if sxx > 0 else 0.0
            a = mean_s - b * mean_u
            if b > 0 and a >= 0:
                return a, b, True
    if mean_u <= 0:
        return None
    if previous is not None and previous[1] > 0:
        b = previous[1]
        a = mean_s - b * mean_u
        if a >= 0:
            return a, b, False
    return 0.0, mean_s / mean_u, False


def theil_sen(points: Sequence[tuple[float, float]], now: float) -> tuple[float, float] | None:
    """The Theil-Sen line through ``(time, value)`` points: its value at
    ``now`` (the median of the points carried to ``now`` along the median
    pairwise slope) and that slope. None with fewer than 3 points."""
    if len(points) < 3:
        return None
    slopes = sorted(
        (v2 - v1) / (t2 - t1)
        for i, (t1, v1) in enumerate(points)
        for t2, v2 in points[i + 1 :]
        if t2 > t1
    )
    if not slopes:
        return None
    slope = statistics.median(slopes)
    level = statistics.median(v + slope * (now - t) for t, v in points)
    return level, slope
