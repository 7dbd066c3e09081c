"""The autoscaling policy's phases, driven with synthetic samples."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from pdfleet.operator.autoscaling.models import replicas_for_ttft
from pdfleet.operator.autoscaling.policy import (
    REASON_CODES,
    PolicyState,
    PolicyTuning,
    RoleState,
    decide,
    forecast,
)
from pdfleet.operator.autoscaling.samples import ReplicaSample
from pdfleet.operator.autoscaling.spec import AutoscalingSpec

from .helpers import PERIOD, fleet, starting

TUNING = PolicyTuning()


def spec(**section) -> AutoscalingSpec:
    base = {"prefill": {"maxReplicas": 200}, "decode": {"maxReplicas": 200}}
    for key, value in section.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return AutoscalingSpec.from_spec(base)


def prefills(t: float, n: int, rate: float, service: float = 0.25, queued: float = 0.0):
    """``n`` prefill replicas sharing ``rate`` requests/s of ``service`` s each
    (10k tokens/s: a request of ``service`` s is 10k x service tokens)."""
    per = rate / n
    return [
        ReplicaSample(
            name=f"p{i}",
            time=t,
            interval_seconds=PERIOD,
            request_arrivals_per_second=per,
            first_tokens_per_second=per,
            prefill_busy_fraction=min(per * service, 1.0),
            prompt_tokens_per_second=per * service * 10_000,
            prompt_token_arrivals_per_second=per * service * 10_000,
            waiting_prompt_tokens=queued / n,
        )
        for i in range(n)
    ]


def decodes(t: float, n: int, usage: float, step: float, running: float = 40, **kw):
    return [
        ReplicaSample(
            name=f"d{i}",
            time=t,
            interval_seconds=PERIOD,
            kv_cache_usage=usage,
            num_running=running,
            itl_seconds=step,
            first_tokens_per_second=running / 10,
            **kw,
        )
        for i in range(n)
    ]


def periods(start: float, end: float):
    t = start
    while t <= end + 1e-9:
        yield t
        t += PERIOD


# ---------------------------------------------------------------------------
# forecast


def _rates(values, start=0.0):
    return tuple((start + PERIOD * i, v) for i, v in enumerate(values))


def test_a_steady_rate_is_not_projected_and_its_level_is_robust():
    noisy = [60, 62, 58, 61, 59, 63, 57, 60, 61, 59, 60, 62, 58, 60, 61, 59, 60, 58, 62, 60]
    rates = _rates(noisy)
    f = forecast(rates, rates[-1][0], 75.0, TUNING)
    assert not f.rising and not f.falling
    assert f.level == pytest.approx(60, abs=1)
    # The margin for the next minute's Poisson noise: rate_z x sqrt(60 / 60).
    assert f.ahead == pytest.approx(f.level + TUNING.rate_z * math.sqrt(f.level / 60), rel=0.01)


def test_a_surge_is_projected_a_lead_ahead_within_a_few_periods():
    flat = [60.0] * 16
    ramp = [60.0 + 8.0 * (i + 1) for i in range(4)]  # 0.53 requests/s more each second
    rates = _rates(flat + ramp)
    f = forecast(rates, rates[-1][0], 75.0, TUNING)
    assert f.rising and f.slope > 0.3
    assert f.projected > ramp[-1] + 0.3 * 75


def test_one_busy_period_is_not_a_rise():
    rates = _rates([60.0] * 19 + [75.0])
    f = forecast(rates, rates[-1][0], 75.0, TUNING)
    assert not f.rising and f.level < 62


def test_a_decline_is_falling():
    rates = _rates([100.0 - 2.0 * i for i in range(20)])
    assert forecast(rates, rates[-1][0], 75.0, TUNING).falling


def test_the_level_after_a_surges_fall_is_the_flat_rate_not_the_falls_line():
    # The rates a simulated fleet measured over the end of a surge (the GPU
    # regime's burst seed 0): a ramp down from 167 to 60 requests/s, then a
    # minute flat at about 60. The level window's line, drawn through both,
    # runs on at about 35 now; sized on that, the fleet undershot its base
    # load by a third and queued for minutes.
    measured = [167, 162, 154, 146, 141, 134, 126, 115, 109, 104, 96, 86, 77, 73, 68]
    rates = _rates([*measured, 59, 63, 59, 64, 61])
    f = forecast(rates, rates[-1][0], 90.0, TUNING)
    assert f.level == pytest.approx(60.0, abs=3.0)
    assert not f.rising


# ---------------------------------------------------------------------------
# size: prefill's queueing model


def _prefill_need(s: AutoscalingSpec, rate: float, n: int = 20, service: float = 0.25) -> float:
    state = None
    for t in periods(0, 300):
        obs = fleet(prefills(t, n, rate, service), decodes(t, 10, 0.5, 0.02))
        result = decide(s, obs, t, state)
        state = result.state
    assert result.prefill.needed is not None
    return result.prefill.needed


def test_prefill_is_sized_by_its_queueing_model_for_the_ttft_target():
    s = spec(prefill={"ttftTargetSeconds": 1.5})
    need = _prefill_need(s, 60.0)
    # The load is 15 busy replicas: a few more keep the waits within target.
    assert 16 <= need <= 19
    # Measured service times of 0.25 s all alike (the spread's floor).
    budget = 1.5 * (1 - TUNING.ttft_reserve) - 2 * 0.1
    margin = TUNING.rate_z * math.sqrt(60 / 60)
    assert need == replicas_for_ttft(
        60.0 + margin, 0.25, TUNING.min_scv, budget, TUNING.ttft_miss_share, 800
    )


def test_a_tighter_ttft_target_or_more_load_needs_more_prefill_and_scale_pays():
    loose = _prefill_need(spec(prefill={"ttftTargetSeconds": 3.0}), 60.0)
    tight = _prefill_need(spec(prefill={"ttftTargetSeconds": 0.6}), 60.0)
    assert tight > loose
    small = _prefill_need(spec(), 15.0, n=5)
    large = _prefill_need(spec(), 60.0)
    assert large < 4 * small  # economies of scale of one shared queue


def test_engines_without_busy_time_size_prefill_on_their_waiting_queue():
    s = spec()
    waiting = [ReplicaSample(name="p0", time=0.0, num_waiting=20, interval_seconds=PERIOD)]
    result = decide(s, fleet(waiting, decodes(0.0, 1, 0.3, 0.02)), 0.0)
    assert (result.prefill.desired, result.prefill.code) == (5, "waiting_queue")  # 20 / 4


# ---------------------------------------------------------------------------
# size: decode's step-time model


def _decode_run(s: AutoscalingSpec, a: float, b: float, rate: float, until: float = 900.0):
    """Decode replicas whose step is exactly ``a + b x usage``, holding KV in
    proportion to the rate and their step time (Little's law), at the counts
    the policy chooses; a load that moves (so the model can be fitted)."""
    state, count = None, 14
    per_load = 6.0  # KV usage per (request/s x step second)
    result = None
    for t in periods(0, until):
        load = rate * (1 + 0.3 * math.sin(t / 300))
        # Equilibrium usage u: u c = load x (a + b u) x per_load.
        u = min(load * a * per_load / max(count - load * b * per_load, 0.1), 1.0)
        obs = fleet(prefills(t, 20, load), decodes(t, count, u, a + b * u))
        result = decide(s, obs, t, state)
        state, count = result.state, result.decode.desired
    return result


def test_decode_runs_its_replicas_at_the_usage_where_the_step_meets_the_itl_goal():
    s = spec(decode={"itlTargetSeconds": 0.025, "targetKVCacheUsage": 0.95})
    result = _decode_run(s, 0.007, 0.022, 60.0)
    goal = 0.025 * TUNING.itl_margin
    target = (goal - 0.007) / 0.022  # 0.73 a replica
    assert result.decode.code != "kv_cache"
    assert "(fitted)" in result.decode.reason
    planned = float(re.search(r"([0-9.]+) a replica;", result.decode.reason).group(1))
    assert planned == pytest.approx(target, abs=0.02)


def test_the_kv_ceiling_caps_decode_where_steps_are_cheap():
    s = spec(decode={"itlTargetSeconds": 0.1, "targetKVCacheUsage": 0.6})
    result = _decode_run(s, 0.007, 0.022, 60.0)
    assert "KV at most 0.60" in result.decode.reason and "0.60 a replica" in result.decode.reason


def test_decode_waiting_requests_add_the_kv_they_would_hold():
    s = spec()
    base = fleet(prefills(0, 4, 10.0), decodes(0, 2, 0.5, 0.02))
    queued = fleet(prefills(0, 4, 10.0), decodes(0, 2, 0.5, 0.02, num_waiting=40))
    assert decide(s, queued, 0.0).decode.needed > decide(s, base, 0.0).decode.needed


# ---------------------------------------------------------------------------
# step-limit


def test_scale_up_is_at_once_and_limited_to_max_scale_up_step():
    s = spec(decode={"maxScaleUpStep": 3})
    obs = fleet(prefills(0, 4, 10.0), decodes(0, 2, 0.95, 0.05, num_waiting=200))
    result = decide(s, obs, 0.0)
    assert (result.decode.desired, result.decode.code) == (5, "step_limit")


def _down(s, state, t, n_prefill, **kw):
    obs = fleet(prefills(t, n_prefill, 10.0, **kw), decodes(t, 2, 0.3, 0.015))
    return decide(s, obs, t, state)


def test_no_scale_down_in_the_first_window_then_after_its_window():
    s = spec(prefill={"scaleDownStabilizationSeconds": 90})
    state = None
    for t in periods(0, 600):
        result = _down(s, state, t, 10)
        state = result.state
        if t < 90:
            assert result.prefill.desired == 10
        if result.prefill.direction == "down":
            break
    assert result.prefill.direction == "down" and result.prefill.time >= 90
    assert result.prefill.desired < 10


@pytest.mark.parametrize("missing", ["stale", "starting"])
def test_missing_metrics_or_starting_replicas_never_scale_down(missing):
    s = spec()
    state = None
    for t in periods(0, 900):
        obs = fleet(prefills(t, 10, 10.0), decodes(t, 2, 0.3, 0.015))
        extra = (
            ReplicaSample(name="p9", time=t - 100, interval_seconds=PERIOD)
            if missing == "stale"
            else starting("p9")
        )
        obs = dataclasses.replace(
            obs, prefill=dataclasses.replace(obs.prefill, replicas=(*obs.prefill.replicas, extra))
        )
        result = decide(s, obs, t, state)
        state = result.state
        assert result.prefill.desired >= 11
    assert result.prefill.code in ("metrics_missing", "replicas_starting", "stabilization_window")


def test_a_scale_down_within_the_dwell_of_a_scale_up_needs_a_decisive_fall():
    s = spec()
    role = RoleState(since=-1000.0, count=20, scaled_up=-100.0, up_need=20.0)
    state = PolicyState(prefill=role)
    # The load fell a little (18 needed): within 600 s of the scale-up, hold.
    obs = fleet(prefills(0, 20, 68.0), decodes(0, 10, 0.5, 0.02))
    held = decide(s, obs, 0.0, state)
    assert held.prefill.desired == 20 and "only a fall of" in held.prefill.reason


def test_a_scale_up_within_the_dwell_of_a_scale_down_needs_more_than_the_margin():
    s = spec()
    obs = fleet(prefills(0, 15, 60.0), decodes(0, 10, 0.5, 0.02))
    assert decide(s, obs, 0.0).prefill.needed == 16
    # 16 needed at 15: within 600 s of a scale-down, one more is within the
    # models' margins; later, it is added.
    after_down = PolicyState(prefill=RoleState(since=-1000.0, count=15, scaled_down=-100.0))
    held = decide(s, obs, 0.0, after_down)
    assert held.prefill.desired == 15 and "within 600 s of a scale-down" in held.prefill.reason
    later = PolicyState(prefill=RoleState(since=-1000.0, count=15, scaled_down=-700.0))
    assert decide(s, obs, 0.0, later).prefill.desired == 16


# ---------------------------------------------------------------------------
# startup (the forecast's lead)


def test_a_startup_reported_by_serving_replicas_sets_the_lead():
    s = spec()
    state = None
    for t in periods(0, 300):
        ps = [dataclasses.replace(p, startup_seconds=90.0) for p in prefills(t, 10, 30.0 + t / 5)]
        result = decide(s, fleet(ps, decodes(t, 4, 0.5, 0.02)), t, state)
        state = result.state
    # 90 s reported, less a period (first seen a period late), plus two periods.
    assert "in 105 s" in result.prefill.reason
    assert state.startup_seconds == 75.0 and not state.startup_watched


def test_a_watched_start_replaces_the_reported_startups():
    s = spec()
    p0 = prefills(0, 1, 5.0)[0]
    obs = fleet([dataclasses.replace(p0, startup_seconds=195.0), starting("p1")], [])
    state = decide(s, obs, 0.0).state
    assert (state.startup_seconds, state.startup_watched) == (180.0, False)
    for t in (15.0, 30.0):
        replicas = [dataclasses.replace(prefills(t, 1, 5.0)[0], startup_seconds=195.0)]
        replicas.append(
            dataclasses.replace(prefills(t, 1, 5.0)[0], name="p1") if t == 30.0 else starting("p1")
        )
        state = decide(s, fleet(replicas, []), t, state).state
    assert (state.startup_seconds, state.startup_watched) == (30.0, True)


# ---------------------------------------------------------------------------
# across roles


@pytest.mark.parametrize(
    ("section", "prefill_want", "decode_want"),
    [
        ({}, 5, 1),
        # P:D at most 1: decode is raised to prefill's 5
        ({"prefillDecodeRatio": {"max": 1}}, 5, 5),
        # P:D at most 1 with decode capped at 2: prefill is cut to 2
        ({"prefillDecodeRatio": {"max": 1}, "decode": {"maxReplicas": 2}}, 2, 2),
        # a budget of 3 takes back prefill's growth first
        ({"maxTotalReplicas": 3}, 2, 1),
    ],
)
def test_bounds_ratio_and_budget(section, prefill_want, decode_want):
    # Prefill wants 5 (20 waiting / 4, engines without busy time), decode 1.
    obs = fleet(
        [ReplicaSample(name="p0", time=0.0, num_waiting=20, interval_seconds=PERIOD)],
        decodes(0.0, 1, 0.2, 0.01),
    )
    result = decide(spec(**section), obs, 0.0)
    assert (result.prefill.desired, result.decode.desired) == (prefill_want, decode_want)


# ---------------------------------------------------------------------------
# contract


def test_decide_is_pure_and_every_code_is_known():
    s = spec()
    state = None
    codes = set()
    for t in periods(0, 900):
        rate = 40.0 if t < 450 else 10.0
        obs = fleet(prefills(t, 10, rate), decodes(t, 4, 0.5 if t < 450 else 0.1, 0.02))
        a = decide(s, obs, t, state)
        b = decide(s, obs, t, state)
        assert a == b
        state = a.state
        codes |= {a.prefill.code, a.decode.code}
    assert codes <= set(REASON_CODES)
    assert {"ttft_model", "itl_model"} & codes


def test_tuning_is_validated():
    with pytest.raises(ValueError, match="itl_margin"):
        PolicyTuning(itl_margin=1.5)
    with pytest.raises(ValueError, match="min_lead_seconds"):
        PolicyTuning(min_lead_seconds=200.0)


@pytest.mark.parametrize(
    ("current", "need", "desired", "code"),
    [
        (13, 12.0, 12, "kv_cache"),  # 11% of 13 rounds to 1: one replica goes
        (14, 13.0, 14, "within_tolerance"),  # 11% of 14 rounds to 2: one is not enough
        (14, 12.0, 12, "kv_cache"),
    ],
)
def test_a_scale_down_removes_at_least_its_share_of_the_count_rounded(current, need, desired, code):
    from pdfleet.operator.autoscaling.policy import Need, RoleView, step_limit

    role = AutoscalingSpec.from_spec({"decode": {"maxReplicas": 40, "maxScaleDownStep": 8}}).decode
    view = RoleView(fresh=(), missing=(), draining=(), current=current, starting=0)
    decision, _ = step_limit(
        "decode",
        role,
        Need(need, "kv_cache", "test", down=need),
        view,
        RoleState(since=0.0),
        1000.0,
        PolicyTuning(),
        1,
        falling=True,
    )
    assert (decision.desired, decision.code) == (desired, code)
