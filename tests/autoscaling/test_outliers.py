"""One noisy period of prefill's request rate (``PolicyTuning.prefill_outlier_z``,
:func:`pdfleet.operator.autoscaling.signals.outlier_bound`): sized at a bound
above the trend window's robust line, unless it is a step of the load (the
previous period above the bound too) or the fleet is queueing beyond its
allowance. Each ``decide()`` test shows the rule changing the decision it is
for; the simulator test is the steady seed whose flap it removed."""

from __future__ import annotations

import math

import pytest

from pdfleet.operator.autoscaling.policy import PolicyTuning, decide
from pdfleet.operator.autoscaling.signals import fitted_level, outlier_bound
from pdfleet.operator.autoscaling.spec import AutoscalingSpec

from .helpers import PERIOD, SIM_SPEC, decode, fleet, policy_cell, prefill

# Six periods of a steady load (1.8 replicas of prefill work), a little noise.
FLAT = tuple((PERIOD * i, v) for i, v in enumerate([1.80, 1.76, 1.84, 1.78, 1.82, 1.79]))
NOW = PERIOD * len(FLAT)


def test_one_period_far_above_a_steady_line_is_bounded_at_z_poisson_deviations():
    # 260 requests counted: the Poisson noise (demand / sqrt(260)) is wider
    # than the series' own residuals, so it sets the deviation.
    bound = outlier_bound(2.6, FLAT, NOW, counted=260, z=2.0)
    assert bound == pytest.approx(fitted_level(2.6, FLAT, NOW) + 2 * 2.6 / math.sqrt(260))
    assert 1.8 < bound < 2.2
    # A period within that noise is the load, as measured.
    assert outlier_bound(2.0, FLAT, NOW, counted=260, z=2.0) == 2.0


def test_a_ramp_steepening_within_its_poisson_noise_is_not_bounded():
    ramp = tuple((PERIOD * i, 1.0 + 0.1 * i) for i in range(6))  # residuals of zero
    # The line says 1.6 now; the period measures 1.75 from 200 requests.
    assert outlier_bound(1.75, ramp, NOW, counted=200, z=2.0) == 1.75
    # Without the Poisson floor (a count so large its noise is nil) the
    # ramp's own residuals would call it an outlier.
    assert outlier_bound(1.75, ramp, NOW, counted=1e9, z=2.0) < 1.7


def test_a_step_is_bounded_for_one_period_at_most():
    # A 90 s window at a 7.5 s period: two high samples among thirteen do
    # not move the robust line, so only the previous sample, above the
    # bound too, tells a step of the load from one noisy period.
    period = 7.5
    flat = tuple((period * i, v) for i, (_, v) in enumerate(FLAT + FLAT))
    now = period * len(flat)
    assert outlier_bound(2.6, flat, now, counted=260, z=2.0) < 2.2
    stepped = (*flat[1:], (now, 2.6))
    assert outlier_bound(2.6, stepped, now + period, counted=260, z=2.0) == 2.6


def test_too_short_a_series_or_nothing_counted_is_not_bounded():
    assert outlier_bound(2.6, FLAT[:2], NOW, counted=260, z=2.0) == 2.6
    assert outlier_bound(2.6, FLAT, NOW, counted=0, z=2.0) == 2.6


def spec() -> AutoscalingSpec:
    return AutoscalingSpec.from_spec(
        {"prefill": {"maxReplicas": 16}, "decode": {"maxReplicas": 16}}
    )


# Per replica of three, 1,500-token prompts at 10k tokens/s: 4 requests/s is
# 1.8 replicas of work (2.25 at 0.8 utilization, within the band of 3); 6.4
# requests/s (1.6x) is 2.88 (3.6 at 0.8: a scale-up to 4).
STEADY = [4.0, 3.9, 4.1, 3.95, 4.05, 4.0] * 3


def _run(rates, tuning: PolicyTuning, queued: float = 0.0):
    """Prefill counts decided, one period per entry of ``rates`` (requests/s
    per replica); ``queued`` prompt tokens wait on each replica in the last
    period."""
    s, state, count, counts = spec(), None, 3, []
    for i, per_replica in enumerate(rates):
        t = PERIOD * (i + 1)
        waiting = queued if i == len(rates) - 1 else 0.0
        prefills = [
            prefill(
                f"p{k}",
                t,
                arrivals=per_replica * 1500.0,
                queued=waiting,
                request_arrivals_per_second=per_replica,
            )
            for k in range(count)
        ]
        obs = fleet(
            prefills,
            [decode("d0", t, kv=0.3, running=20)],
            prefill_requested=count,
            decode_requested=1,
        )
        out = decide(s, obs, t, state, tuning)
        state, count = out.state, out.prefill.desired
        counts.append(count)
    return counts, out


def test_one_busy_period_of_a_steady_rate_keeps_the_count():
    counts, out = _run([*STEADY, 6.4], PolicyTuning())
    assert counts == [3] * (len(STEADY) + 1)
    assert "an outlier of its" in out.prefill.reason, out.prefill.reason
    # The same period, taken as measured, scales up.
    counts, _ = _run([*STEADY, 6.4], PolicyTuning(prefill_outlier_z=None))
    assert counts[:-1] == [3] * len(STEADY) and counts[-1] == 4


def test_a_step_of_the_rate_scales_up_one_period_later():
    counts, _ = _run([*STEADY, 6.4, 6.4], PolicyTuning())
    assert counts[: len(STEADY) + 1] == [3] * (len(STEADY) + 1)
    assert counts[-1] >= 4


def test_a_busy_period_with_a_queue_beyond_its_allowance_scales_up_at_once():
    # 20k prompt tokens on each replica: 2 s of work each, twice the 1 s
    # allowed (half the 2 s TTFT target).
    counts, out = _run([*STEADY, 6.4], PolicyTuning(), queued=20_000.0)
    assert counts[-1] >= 4
    assert "an outlier" not in out.prefill.reason


def test_steady_seed_6_no_longer_flaps():
    # The flap the bound removed: one period a third above steady seed 6's
    # rate at 315 s set prefill 3 -> 4, undone at 585 s, within the 300 s
    # window (docs/autoscaling.md, the matrix).
    window = SIM_SPEC.prefill.scale_down_stabilization_seconds

    def flaps(tuning: PolicyTuning) -> int:
        return policy_cell("steady", 6, tuning).oscillations(window)["total"]

    assert flaps(PolicyTuning()) == 0
    assert flaps(PolicyTuning(prefill_outlier_z=None)) == 1
