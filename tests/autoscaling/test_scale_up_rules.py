"""The scale-up side's optional rules (PolicyTuning knobs, off by default):
the recent slope at a ramp's start, the decode load floor, decode holding
while prefill rises, decode's own queue drain time."""

from __future__ import annotations

import pytest

from pdfleet.operator.autoscaling.policy import PolicyTuning, decide
from pdfleet.operator.autoscaling.signals import project, project_rise
from pdfleet.operator.autoscaling.spec import AutoscalingSpec

from .helpers import PERIOD, decode, fleet, prefill

SPEC = AutoscalingSpec.from_spec({"prefill": {"maxReplicas": 16}, "decode": {"maxReplicas": 16}})


def series(values, start=0.0):
    return tuple((start + i * PERIOD, v) for i, v in enumerate(values))


# ---------------------------------------------------------------------------
# project_rise


def test_project_rise_follows_a_ramp_from_its_start_where_the_window_lags():
    # Flat at 2.0 for 45 s, then rising 0.3 per period: the window's median
    # slope still mixes in the flat part, the recent samples do not.
    history = series([2.0, 2.0, 2.0, 2.0, 2.3, 2.6])
    now, demand = 6 * PERIOD, 2.9
    window = project(demand, history, now, 75.0, min_span=20.0)
    rise = project_rise(demand, history, now, 75.0, 45.0, min_span=20.0)
    assert window > demand  # the window sees a rise...
    assert rise > window + 0.3  # ...the recent slope a steeper one
    assert abs(rise - (demand + 0.3 / PERIOD * 75.0)) < 1e-6  # the ramp's own slope


def test_project_rise_ignores_a_noisy_sample_on_a_plateau_after_a_ramp():
    # A ramp, then a plateau whose last sample is a noise peak: the recent
    # slope is no steeper than the ramp's before it, so the window's slope stands.
    history = series([2.0, 2.4, 2.8, 3.2, 3.3, 3.2])
    now, demand = 6 * PERIOD, 3.5
    assert project_rise(demand, history, now, 75.0, 45.0) == project(demand, history, now, 75.0)


def test_project_rise_adds_nothing_without_a_rise_over_the_window():
    history = series([2.4, 2.2, 2.0, 1.8, 1.9, 2.0])
    now, demand = 6 * PERIOD, 2.1
    assert project(demand, history, now, 75.0) == demand
    assert project_rise(demand, history, now, 75.0, 45.0) == demand


def test_project_rise_needs_the_rise_beyond_the_noise_when_asked():
    # Noisy flat samples, then a small recent rise: within 3x the noise.
    history = series([2.0, 2.3, 1.8, 2.2, 2.0, 2.1])
    now, demand = 6 * PERIOD, 2.3
    loose = project_rise(demand, history, now, 75.0, 45.0)
    strict = project_rise(demand, history, now, 75.0, 45.0, rise_z=3.0)
    assert strict == project(demand, history, now, 75.0)
    assert loose > strict


# ---------------------------------------------------------------------------
# the policy with the knobs


def _ramp_decisions(tuning: PolicyTuning | None):
    """Prefill at 3 replicas, 2.0 replicas of demand for a minute, then a
    ramp of +0.25 replicas a period; the decisions up to 45 s into it."""
    state, out = None, []
    demand = [2.0] * 5 + [2.25, 2.5, 2.75]
    for i, d in enumerate(demand):
        t = (i + 1) * PERIOD
        reps = [prefill(f"p{j}", t, arrivals=d * 10_000 / 3, busy=d / 3) for j in range(3)]
        result = decide(SPEC, fleet(reps, [decode("d0", t, kv=0.3, running=30)]), t, state, tuning)
        state = result.state
        out.append(result.prefill)
    return out


def test_recent_slope_starts_prefill_replicas_earlier_on_a_ramp():
    default = _ramp_decisions(None)
    rise = _ramp_decisions(PolicyTuning(rise_recent_seconds=45.0))
    # The same measurements, but two periods into the ramp the recent slope
    # projects it at its own rate: 4.43 replicas needed against 3.65.
    assert (default[6].desired, rise[6].desired) == (4, 5)
    assert all(r.desired >= d.desired for r, d in zip(rise, default, strict=True))


def _decode_low_load(tuning: PolicyTuning | None, prefill_rise: float = 0.0, until=400.0):
    """Decode at 2 replicas with 0.2 KV summed (0.29 replicas needed) for
    longer than the down window; prefill's demand rises by ``prefill_rise``
    replicas a period. Returns the last decode decision."""
    state, last, t, n = None, None, PERIOD, 2
    while t <= until:
        d = 1.0 + prefill_rise * t / PERIOD
        reps = [prefill("p0", t, arrivals=d * 10_000, busy=min(d, 1.0))]
        decodes = [decode(f"d{i}", t, kv=0.2 / n, running=20 / n) for i in range(n)]
        result = decide(SPEC, fleet(reps, decodes), t, state, tuning)
        state, last, n = result.state, result.decode, result.decode.desired
        t += PERIOD
    return last


def test_decode_load_floor_keeps_two_decode_replicas_on_a_light_load():
    assert _decode_low_load(None).desired == 1  # the default goes to one
    kept = _decode_low_load(PolicyTuning(decode_load_floor=2))
    assert kept.desired == 2


def test_decode_load_floor_stays_within_max_replicas():
    one = AutoscalingSpec.from_spec({"decode": {"maxReplicas": 1}})
    obs = fleet([prefill("p0", 0.0, arrivals=5_000)], [decode("d0", 0.0, kv=0.2, running=20)])
    result = decide(one, obs, 0.0, tuning=PolicyTuning(decode_load_floor=2))
    assert result.decode.desired == 1


def test_decode_holds_its_count_while_prefill_demand_rises():
    # Prefill rising 0.02 replicas a period: the hold keeps decode at 2.
    tuning = PolicyTuning(hold_decode_rising_quantile=0.25)
    held = _decode_low_load(tuning, prefill_rise=0.002)
    assert (held.desired, held.code) == (2, "load_rising")
    assert _decode_low_load(None, prefill_rise=0.002).desired == 1
    # A flat prefill demand holds nothing.
    assert _decode_low_load(tuning).desired == 1


def test_decode_queue_drain_seconds_sizes_decode_for_its_queue_sooner():
    # 1 replica, 100 running at 0.9 KV, 60 waiting, 10 admissions a second:
    # each request runs 10 s. Over a 60 s drain the queue adds little; to be
    # admitted within 5 s it needs twice the KV share.
    obs = fleet(
        [prefill("p0", 0.0, arrivals=5_000)],
        [decode("d0", 0.0, kv=0.9, running=100, waiting=60, first_tokens_per_second=10.0)],
    )
    slow = decide(SPEC, obs, 0.0).decode
    fast = decide(SPEC, obs, 0.0, tuning=PolicyTuning(decode_queue_drain_seconds=5.0)).decode
    assert fast.desired > slow.desired


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("rise_recent_seconds", 0.0, "rise_recent_seconds must be > 0"),
        ("decode_queue_drain_seconds", -1.0, "decode_queue_drain_seconds must be > 0"),
        ("hold_decode_rising_quantile", 1.5, "hold_decode_rising_quantile must be in [0, 1]"),
        ("decode_load_floor", 0, "decode_load_floor must be >= 1"),
    ],
)
def test_bad_scale_up_knobs_are_refused_with_the_field_named(field, value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        PolicyTuning(**{field: value})
