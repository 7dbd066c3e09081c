"""The noise gates of the policy (``PolicyTuning`` knobs; all but decode's
flap floor off by default): each test drives ``decide()`` period by period
and shows the knob changing the decision it is for."""

from __future__ import annotations

import random

import pytest

from pdfleet.operator.autoscaling.policy import PolicyTuning, decide
from pdfleet.operator.autoscaling.signals import (
    fall_confirmed,
    noise,
    rise_confirmed,
    step_noise,
)
from pdfleet.operator.autoscaling.spec import AutoscalingSpec

from .helpers import PERIOD, TO_ONE, decode, fleet, prefill


def spec() -> AutoscalingSpec:
    return AutoscalingSpec.from_spec(
        {"prefill": {"maxReplicas": 16}, "decode": {"maxReplicas": 16}}
    )


def times(start: float, end: float) -> list[float]:
    return [start + PERIOD * i for i in range(int((end - start) / PERIOD) + 1)]


def noisy(level: float, spread: float, n: int, seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    return [level * (1 + rng.uniform(-spread, spread)) for _ in range(n)]


# ---------------------------------------------------------------------------
# the long-run noise and the tests built on it


def test_step_noise_is_the_sample_noise_under_a_ramp_and_a_level_change():
    flat = noisy(100.0, 0.1, 40)
    ramp = [v + 3.0 * i for i, v in enumerate(flat)]  # +120 over the window
    stepped = [v + (80.0 if i >= 20 else 0.0) for i, v in enumerate(flat)]
    series = {
        name: tuple((PERIOD * i, v) for i, v in enumerate(vs))
        for name, vs in {"flat": flat, "ramp": ramp, "stepped": stepped}.items()
    }
    base = step_noise(series["flat"])
    assert 3.0 < base < 9.0  # uniform +-10 has a standard deviation of 5.8
    assert step_noise(series["ramp"]) == pytest.approx(base, rel=0.5)
    assert step_noise(series["stepped"]) == pytest.approx(base, rel=0.3)
    # The spread about one line is inflated by the level change.
    assert noise(series["stepped"]) > 3 * base


def test_rise_confirmed_by_a_level_out_of_the_noise_only():
    history = tuple((PERIOD * i, v) for i, v in enumerate(noisy(100.0, 0.1, 40)))
    recent = history[-6:]
    assert not rise_confirmed(108.0, recent, history, 3.0)  # a noise peak
    assert rise_confirmed(130.0, recent, history, 3.0)  # a ramp's first periods
    assert rise_confirmed(108.0, recent, history, None)  # the gate is off
    assert rise_confirmed(108.0, recent, history[:3], 3.0)  # nothing learned yet


def test_fall_confirmed_by_a_fall_larger_than_the_noise_only():
    long = tuple((PERIOD * i, v) for i, v in enumerate(noisy(100.0, 0.1, 40)))
    now = long[-1][0] + PERIOD
    dip = tuple((now - PERIOD * (6 - i), v) for i, v in enumerate((104, 101, 99, 97, 95, 93)))
    ebb = tuple((now - PERIOD * (6 - i), 100.0 - 12.0 * i) for i in range(6))
    assert not fall_confirmed(91.0, dip, now, long, 3.0)  # 10% over 90 s, within the noise
    assert fall_confirmed(30.0, ebb, now, long, 3.0)
    assert fall_confirmed(91.0, dip, now, long, None)


# ---------------------------------------------------------------------------
# decode on a steady request rate


def steady_prefill(t: float, i: int):
    """Prompt arrivals of a steady rate: 1.6 replicas' worth, +-8%."""
    return [prefill("p0", t, arrivals=16_000.0 * (1 + 0.08 * ((-1) ** i)), rate=10_000.0)]


def decisions(tuning: PolicyTuning, kv_of, n_decode: int = 1, end: float = 900.0):
    """Decode's decisions with ``kv_of(i)`` summed KV usage at period ``i``
    over a steady prefill rate; the counts follow the decisions."""
    state, counts, out = None, None, []
    for i, t in enumerate(times(0.0, end)):
        n = counts[1] if counts else n_decode
        obs = fleet(
            steady_prefill(t, i),
            [decode(f"d{k}", t, kv=kv_of(i) / n, running=40) for k in range(n)],
        )
        result = decide(spec(), obs, t, state, tuning)
        state, counts = result.state, (result.prefill.desired, result.decode.desired)
        out.append(result.decode)
    return out


def rising_kv(i: int) -> float:
    """Decode's summed KV usage climbing from 0.45 to 0.66 in six periods,
    then back: the kind of run a snapshot of a few dozen requests makes."""
    bump = (0.45, 0.45, 0.45, 0.45, 0.45, 0.45, 0.45, 0.45, 0.5, 0.54, 0.58, 0.62, 0.66)
    return bump[i] if i < len(bump) else 0.45


def test_decode_trend_with_arrivals_keeps_a_kv_run_on_a_steady_rate_from_scaling_up():
    plain = decisions(PolicyTuning(), rising_kv, end=195.0)
    gated = decisions(PolicyTuning(decode_trend_with_arrivals=True), rising_kv, end=195.0)
    assert any(d.direction == "up" and "rising" in d.reason for d in plain)
    assert {d.desired for d in gated} == {1}, [d.reason for d in gated]


def test_rise_noise_z_keeps_a_kv_run_on_a_steady_rate_from_scaling_up():
    # The run comes after ten minutes of steady arrivals: their noise is known.
    late = [0.45] * 40 + [0.5, 0.54, 0.58, 0.62, 0.66]
    plain = decisions(PolicyTuning(), lambda i: late[min(i, len(late) - 1)], end=660.0)
    gated = decisions(
        PolicyTuning(rise_noise_z=3.0), lambda i: late[min(i, len(late) - 1)], end=660.0
    )
    assert max(d.desired for d in plain) == 2
    assert {d.desired for d in gated} == {1}, [d.reason for d in gated if "rising" in d.reason]


def test_rise_noise_z_still_projects_a_rise_the_arrivals_share():
    state, result = None, None
    jitter = noisy(1.0, 0.08, 60)
    for i, t in enumerate(times(0.0, 750.0)):
        ramp = max(0.0, t - 600.0) / 150.0  # arrivals double over the last 150 s
        arrivals = 16_000.0 * jitter[i] * (1 + ramp)
        kv = 0.45 * (1 + ramp)
        obs = fleet(
            [prefill("p0", t, arrivals=arrivals, rate=40_000.0)],
            [decode("d0", t, kv=kv, running=40)],
        )
        result = decide(spec(), obs, t, state, PolicyTuning(rise_noise_z=3.0))
        state = result.state
    assert "rising" in result.decode.reason, result.decode.reason
    assert result.decode.desired >= 2


def test_decode_down_headroom_keeps_the_count_a_noise_peak_would_restore():
    # At 2 replicas decode needs 0.8: the common 20% headroom leaves 1 (0.96),
    # decode's own 40% keeps 2 (1.12).
    flat = decisions(PolicyTuning(**TO_ONE), lambda i: 0.56, n_decode=2, end=600.0)
    held = decisions(
        PolicyTuning(**TO_ONE, decode_down_headroom=0.4), lambda i: 0.56, n_decode=2, end=600.0
    )
    assert flat[-1].desired == 1
    assert {d.desired for d in held} == {2}


def falling_kv(i: int) -> float:
    """Decode at 2 replicas on a steady rate, its summed KV usage drifting
    down through noise from 0.9 to 0.2 over 90 s after 5 minutes."""
    return 0.9 if i < 20 else max(0.2, 0.9 - 0.12 * (i - 19))


def test_decode_falls_with_arrivals_waits_the_full_window_on_its_own_fall():
    def first_down(tuning):
        for d in decisions(tuning, falling_kv, n_decode=2, end=900.0):
            if d.direction == "down":
                return d.time
        raise AssertionError("decode never scaled down")

    # Decode's own decisive fall opens the 90 s falling window ...
    assert first_down(PolicyTuning(**TO_ONE)) < 300.0 + 300.0
    # ... and without a fall of the arrivals decode waits the spec's 300 s.
    late = first_down(PolicyTuning(**TO_ONE, decode_falls_with_arrivals=True))
    assert late >= 300.0 + 300.0 - PERIOD
    assert late > first_down(PolicyTuning(**TO_ONE))


def test_knobs_that_are_off_change_nothing():
    kv = rising_kv
    assert [d.desired for d in decisions(PolicyTuning(), kv)] == [
        d.desired
        for d in decisions(
            PolicyTuning(rise_noise_window_seconds=300.0, prefill_flap_floor_full_window=False), kv
        )
    ]


def _undone_then_dip(tuning: PolicyTuning):
    """Decode needs 0.6 replicas, 1.3 for a minute after its first
    scale-down (undoing it), 0.6 again, then a dip falling to 0.1 over
    150 s and back after three minutes."""

    def need(t: float, down: float | None) -> float:
        if down is None or t < down + 30:
            return 0.6
        if t < down + 90:
            return 1.3
        if t < 1500:
            return 0.6
        return max(0.1, 0.6 - 0.5 * (t - 1500) / 150) if t < 1680 else 0.6

    state, counts, down, out = None, None, None, []
    for i, t in enumerate(times(0.0, 1800.0)):
        n = counts[1] if counts else 2
        obs = fleet(
            steady_prefill(t, i),
            [decode(f"d{k}", t, kv=0.7 * need(t, down) / n, running=40) for k in range(n)],
        )
        result = decide(spec(), obs, t, state, tuning)
        state, counts = result.state, (result.prefill.desired, result.decode.desired)
        if result.decode.direction == "down" and down is None:
            down = t
        out.append(result.decode)
    return out


def test_decode_flap_floor_is_not_lifted_by_a_short_dip():
    # The default: decode's floor waits for the spec's whole down window.
    held = _undone_then_dip(PolicyTuning(**TO_ONE))
    plain = _undone_then_dip(PolicyTuning(**TO_ONE, flap_floor_full_window=False))
    for run in (plain, held):  # the first scale-down is undone in both
        moves = [d.direction for d in run if d.direction != "none"]
        assert moves[:2] == ["down", "up"], moves
    # On the down window in force the dip's 90 s falling window lifts the
    # floor and decode goes down again; the full window still holds the 0.6
    # before the dip.
    assert any(d.direction == "down" and d.time >= 1500 for d in plain)
    assert not any(d.direction == "down" and d.time >= 1500 for d in held), [
        d.reason for d in held if d.time >= 1500 and d.direction != "none"
    ]
    assert any(d.code == "flap_damping" and d.time >= 1500 for d in held)
