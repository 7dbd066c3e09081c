"""The sizing models: Erlang C, the TTFT miss share, the step-time fit, Theil-Sen."""

from __future__ import annotations

import math
import random

import pytest

from pdfleet.operator.autoscaling.models import (
    erlang_c,
    fit_step_model,
    queue_miss_share,
    replicas_for_ttft,
    service_quantiles,
    theil_sen,
)


@pytest.mark.parametrize(
    ("c", "a", "want"),
    [
        # Textbook values: P(wait) for M/M/c.
        (1, 0.5, 0.5),  # M/M/1: rho
        (2, 1.0, 1 / 3),
        (10, 8.0, 0.409),
    ],
)
def test_erlang_c_matches_known_values(c, a, want):
    assert erlang_c(c, a) == pytest.approx(want, abs=2e-3)


def test_erlang_c_is_one_at_and_beyond_saturation_and_zero_without_load():
    assert erlang_c(4, 4.0) == 1.0 and erlang_c(4, 9.0) == 1.0
    assert erlang_c(4, 0.0) == 0.0


def test_erlang_c_tail_matches_a_simulated_mm_c_queue():
    # M/M/c with c = 8, a = 6.4: the share of requests waiting more than
    # 0.5 service times, simulated against C(c, a) exp(-(c - a) x).
    rng = random.Random(3)
    c, rate, mean = 8, 6.4, 1.0
    free = [0.0] * c
    t, late, n = 0.0, 0, 200_000
    for _ in range(n):
        t += rng.expovariate(rate)
        i = min(range(c), key=free.__getitem__)
        start = max(t, free[i])
        late += start - t > 0.5
        free[i] = start + rng.expovariate(1 / mean)
    predicted = erlang_c(c, rate * mean) * math.exp(-(c - rate * mean) * 0.5)
    assert late / n == pytest.approx(predicted, rel=0.1)


def test_service_quantiles_keep_the_mean_and_spread():
    qs = service_quantiles(0.25, 0.5)
    mean = sum(qs) / len(qs)
    scv = sum((q - mean) ** 2 for q in qs) / len(qs) / mean**2
    assert mean == pytest.approx(0.25, rel=0.01)
    assert scv == pytest.approx(0.5, rel=0.15)  # the quantile grid trims the tail a little


def test_the_miss_share_falls_with_replicas_and_ignores_what_service_alone_misses():
    shares = [queue_miss_share(c, 60.0, 0.26, 0.55, 1.4) for c in range(16, 24)]
    assert shares == sorted(shares, reverse=True) and shares[-1] < 1e-3
    assert queue_miss_share(15, 60.0, 0.26, 0.55, 1.4) == 1.0  # a = 15.6 > c
    # A budget below every service time: nothing the replica count can save.
    assert queue_miss_share(40, 60.0, 0.26, 0.55, 0.01) == 0.0


def test_replicas_for_ttft_is_the_fewest_within_the_share():
    c = replicas_for_ttft(60.0, 0.26, 0.55, 1.4, 0.004, 200)
    assert queue_miss_share(c, 60.0, 0.26, 0.55, 1.4) <= 0.004
    assert queue_miss_share(c - 1, 60.0, 0.26, 0.55, 1.4) > 0.004
    # Economies of scale: four times the load needs fewer than four times the
    # replicas.
    assert replicas_for_ttft(240.0, 0.26, 0.55, 1.4, 0.004, 200) < 4 * c
    assert replicas_for_ttft(0.0, 0.26, 0.55, 1.4, 0.004, 200) == 0
    assert replicas_for_ttft(1e6, 0.26, 0.55, 1.4, 0.004, 50) == 50


def test_the_step_model_is_fitted_where_the_usage_spreads():
    points = [(u / 20, 0.007 + 0.022 * u / 20) for u in range(4, 18)]
    a, b, fitted = fit_step_model(points, 0.05)
    assert fitted and a == pytest.approx(0.007) and b == pytest.approx(0.022)


def test_without_spread_the_last_slope_goes_through_the_points_else_the_origin():
    points = [(0.70, 0.0225), (0.71, 0.0227)] * 5
    a, b, fitted = fit_step_model(points, 0.05, previous=(0.006, 0.023))
    assert not fitted and b == 0.023 and a == pytest.approx(0.0226 - 0.023 * 0.705)
    a, b, fitted = fit_step_model(points, 0.05)
    assert (a, fitted) == (0.0, False) and b == pytest.approx(0.0226 / 0.705)
    assert fit_step_model([], 0.05) is None


def test_theil_sen_ignores_one_spike_and_follows_a_ramp():
    flat = [(15.0 * i, 60.0) for i in range(8)]
    flat[4] = (60.0, 90.0)
    level, slope = theil_sen(flat, 105.0)
    assert level == pytest.approx(60.0) and slope == pytest.approx(0.0)
    ramp = [(15.0 * i, 60.0 + 0.5 * 15 * i) for i in range(8)]
    level, slope = theil_sen(ramp, 120.0)
    assert slope == pytest.approx(0.5) and level == pytest.approx(120.0)
    assert theil_sen(flat[:2], 15.0) is None
