"""The autoscaling policy, driven period by period with synthetic samples."""

from __future__ import annotations

import dataclasses

import pytest

from pdfleet.operator.autoscaling.policy import (
    REASON_CODES,
    PolicyState,
    PolicyTuning,
    decide,
)
from pdfleet.operator.autoscaling.signals import fitted_level, noise, project
from pdfleet.operator.autoscaling.spec import AutoscalingSpec

from .helpers import PERIOD, TO_ONE, decode, fleet, idle_prefill, prefill, starting


def spec(**section) -> AutoscalingSpec:
    base = {"prefill": {"maxReplicas": 16}, "decode": {"maxReplicas": 16}}
    for key, value in section.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return AutoscalingSpec.from_spec(base)


def decodes(t: float, n: int, kv: float, running: float = 50, **kw):
    return [decode(f"d{i}", t, kv=kv, running=running, **kw) for i in range(n)]


def run(s: AutoscalingSpec, observe, times, state=None, tuning=None):
    """Decide at each time; ``observe(t, current)`` builds the observation from the
    current counts (prefill, decode). Returns the results and the final state."""
    counts = None
    results = []
    for t in times:
        result = decide(s, observe(t, counts), t, state, tuning)
        state = result.state
        counts = (result.prefill.desired, result.decode.desired)
        results.append(result)
    return results, state


def periods(start: float, end: float):
    t = start
    while t <= end:
        yield t
        t += PERIOD


# ---------------------------------------------------------------------------
# scale up fast, bounded


@pytest.mark.parametrize(
    ("replicas", "kv", "max_replicas", "want", "code"),
    [
        (2, 0.9, 16, 3, "kv_cache"),  # 1.8 summed / 0.7 = 2.57 -> 3
        (2, 1.0, 16, 3, "kv_cache"),  # 2.0 / 0.7 = 2.86 -> 3
        (4, 1.0, 16, 6, "kv_cache"),  # 4.0 / 0.7 = 5.71 -> 6
        (8, 1.0, 16, 12, "kv_cache"),  # 11.4 -> 12 is +4: the step limit exactly
        (10, 1.0, 16, 14, "step_limit"),  # 14.3 -> 15 is +5: cut to +4
        (2, 1.0, 2, 2, "max_replicas"),  # wants 3, capped
        (2, 0.7, 16, 2, "within_tolerance"),  # exactly on target
        (3, 0.75, 16, 3, "within_tolerance"),  # 3.2 needed: within 10% of 3
    ],
)
def test_decode_scales_up_at_once_on_summed_kv_usage(replicas, kv, max_replicas, want, code):
    s = spec(decode={"maxReplicas": max_replicas})
    result = decide(s, fleet(idle_prefill(0), decodes(0, replicas, kv)), 0.0)
    assert (result.decode.desired, result.decode.code) == (want, code)
    assert result.decode.reason.startswith(f"decode {replicas} -> {want}: ")


def test_scale_up_is_limited_to_max_scale_up_step_per_period():
    s = spec(decode={"maxScaleUpStep": 2})
    result = decide(s, fleet(idle_prefill(0), decodes(0, 2, 1.0, waiting=200)), 0.0)
    assert result.decode.desired == 4
    assert result.decode.code == "step_limit"


def test_decode_queue_beyond_the_allowance_counts_as_kv_demand():
    # 1.0 KV over 100 running = 0.01 per request; 30 waiting beyond 4 per
    # replica = 26 * 0.01 = 0.26 more KV: (1.0 + 0.26) / 0.7 = 1.8 -> 2.
    obs = fleet(idle_prefill(0), [decode("d0", 0, kv=1.0, running=100, waiting=30)])
    assert decide(spec(), obs, 0.0).decode.desired == 2
    # Within the allowance the queue adds nothing: 1.0 / 0.7 = 1.43 -> 2 anyway;
    # use a lower usage to see it.
    calm = fleet(idle_prefill(0), [decode("d0", 0, kv=0.6, running=60, waiting=4)])
    assert decide(spec(), calm, 0.0).decode.desired == 1


def test_prefill_scales_on_arrivals_against_target_utilization():
    # 30k tok/s arriving at 10k tok/s per replica = 3 replicas / 0.8 = 3.75 -> 4.
    obs = fleet(
        [prefill("p0", 0, arrivals=15_000, busy=1.0), prefill("p1", 0, arrivals=15_000, busy=1.0)],
        decodes(0, 1, 0.3),
    )
    result = decide(spec(), obs, 0.0)
    assert (result.prefill.desired, result.prefill.code) == (4, "prefill_load")
    assert "prompt arrivals 30000 tok/s" in result.prefill.reason


def test_prefill_backlog_beyond_half_the_ttft_target_is_drained_over_a_minute():
    # Demand 1.0 replica; backlog 70 s of work against 1 s allowed per replica
    # (ttft 2 s): 69 s to drain in 60 s = +1.15 -> 2.15 -> 3.
    obs = fleet([prefill("p0", 0, arrivals=10_000, busy=1.0, queued=700_000)], decodes(0, 1, 0.3))
    result = decide(spec(), obs, 0.0)
    assert (result.prefill.desired, result.prefill.code) == (3, "prefill_backlog")


def test_prefill_falls_back_to_waiting_requests_without_backlog_metrics():
    # A vLLM engine exports no queued prompt tokens and no busy time.
    from pdfleet.operator.autoscaling.samples import ReplicaSample

    vllm = ReplicaSample(name="p0", time=0.0, num_waiting=10, interval_seconds=PERIOD)
    result = decide(spec(), fleet([vllm], decodes(0, 1, 0.3)), 0.0)
    assert (result.prefill.desired, result.prefill.code) == (3, "waiting_queue")  # 10 / 4


def test_prefill_rate_is_calibrated_from_engine_metrics_over_the_configured_fallback():
    s = spec(prefill={"prefillTokensPerSecond": 40_000})
    # Engines compute 5k tok/s while fully busy: 5k tok/s per busy second.
    obs = fleet([prefill("p0", 0, arrivals=20_000, busy=1.0, rate=5_000)], decodes(0, 1, 0.3))
    result = decide(s, obs, 0.0)
    assert result.state.prefill_tokens_per_second == pytest.approx(5_000)
    assert result.prefill.desired == 5  # 20k / 5k = 4 replicas / 0.8 = 5
    # Before any busy time is measured, the configured rate is used.
    idle = fleet([prefill("p0", 0, arrivals=0.0, busy=0.0)], decodes(0, 1, 0.3))
    assert decide(s, idle, 0.0).state.prefill_tokens_per_second is None
    assert "(configured)" in decide(s, idle, 0.0).prefill.reason


# ---------------------------------------------------------------------------
# scale down slowly


def test_no_scale_down_before_the_window_then_one_step_per_period():
    s = spec()

    def observe(t, counts):
        n = counts[1] if counts else 6
        load = 4.2 if t < 100 else 0.35  # total KV usage: 6 replicas' worth, then ~1
        return fleet(idle_prefill(t), decodes(t, n, load / n, running=40))

    results, _ = run(s, observe, periods(0, 600))
    by_time = {r.decode.time: r.decode for r in results}
    # The last high recommendation was at t=90: the down window holds it to 385.
    assert all(by_time[t].desired == 6 for t in by_time if t < 390)
    assert by_time[375].code == "stabilization_window"
    assert [by_time[t].desired for t in (390, 405, 420, 435)] == [5, 4, 3, 2]
    assert by_time[390].code == "step_limit"
    assert by_time[600].desired == 1  # min replicas


def test_no_scale_down_in_the_first_window_after_start():
    s = spec()
    obs = lambda t, counts: fleet(idle_prefill(t), decodes(t, (counts or (1, 4))[1], 0.05))  # noqa: E731
    results, _ = run(s, obs, periods(0, 285))
    assert {r.decode.desired for r in results} == {4}
    assert results[-1].decode.code == "stabilization_window"
    results, _ = run(s, obs, periods(0, 300))
    assert results[-1].decode.desired == 3


def test_scale_down_keeps_twenty_percent_headroom():
    # 4 replicas, 1.28 replicas needed: 2 fit it and 1.28 * 1.2 = 1.54 still
    # fits 2; 1.75 needed fits 2 but not with the headroom (2.1), so 3 stay;
    # 1.9 needed would need 3 (2.28), not 2.
    for needed, want in ((1.28, 2), (1.75, 3), (1.9, 3)):
        obs = lambda t, c, needed=needed: fleet(  # noqa: E731
            idle_prefill(t), decodes(t, (c or (1, 4))[1], needed * 0.7 / (c or (1, 4))[1])
        )
        s = spec(decode={"maxScaleDownStep": 4})
        results, _ = run(s, obs, periods(0, 300))
        assert results[-1].decode.desired == want


def test_scale_down_window_takes_the_highest_recommendation():
    s = spec(decode={"maxScaleDownStep": 4})

    def observe(t, counts):
        n = counts[1] if counts else 8
        # A needs-4 spike at t=150 among needs-1 periods.
        need = 4 * 0.7 / 1.1 if t == 150 else 0.3
        return fleet(idle_prefill(t), decodes(t, n, need / n))

    results, _ = run(s, observe, periods(0, 480))
    by_time = {r.decode.time: r.decode.desired for r in results}
    assert by_time[300] >= 4  # the spike rules the window
    assert by_time[435] == by_time[300]
    assert by_time[450] == 1  # once the spike has left it


# ---------------------------------------------------------------------------
# missing, stale and starting replicas


@pytest.mark.parametrize(
    ("replicas", "code"),
    [
        # a ready replica whose scrape failed (no sample time at all)
        (lambda t: [decode("d0", t, kv=0.01), decode("d1", None, kv=0.0)], "metrics_missing"),
        # a ready replica whose latest sample is older than metricsStaleSeconds
        (lambda t: [decode("d0", t, kv=0.01), decode("d1", t - 60, kv=0.0)], "metrics_missing"),
        # a replica still starting
        (
            lambda t: [decode("d0", t, kv=0.01), decode("d1", t, kv=0.0), starting("d2")],
            "replicas_starting",
        ),
    ],
)
def test_missing_stale_or_starting_never_scale_down(replicas, code):
    s = spec()
    state = None
    for t in periods(0, 900):
        result = decide(s, fleet(idle_prefill(t), replicas(t)), t, state)
        state = result.state
        assert result.decode.desired >= result.decode.current
    assert result.decode.code == code
    assert "holding" in result.decode.reason


def test_missing_metrics_do_not_shorten_the_down_window_once_they_return():
    s = spec()
    state = None
    for t in periods(0, 600):
        missing = 300 <= t < 450
        d1 = decode("d1", None if missing else t, kv=0.01)
        result = decide(s, fleet(idle_prefill(t), [decode("d0", t, kv=0.01), d1]), t, state)
        state = result.state
    # Metrics came back at 450: the window must again see 300 s of low load.
    assert result.decode.desired == 2


def test_missing_metrics_still_allow_scale_up_from_the_replicas_that_report():
    # d0 alone: 1.0 KV + 36 queued beyond the allowance at 0.02 each = 1.72
    # -> 2.46 replicas: more than the 2 requested, whatever d1 would say.
    d0 = decode("d0", 0.0, kv=1.0, running=50, waiting=40)
    obs = fleet(idle_prefill(0), [d0, decode("d1", None)])
    assert decide(spec(), obs, 0.0).decode.desired == 3


def test_starting_replicas_count_as_capacity_coming():
    s = spec()
    # 2 ready replicas at 0.95 each: 2.7 replicas needed -> start a third.
    first = decide(s, fleet(idle_prefill(0), decodes(0, 2, 0.95)), 0.0)
    assert first.decode.desired == 3
    # Same load next period while the third starts: no fourth.
    again = decide(
        s, fleet(idle_prefill(15), [*decodes(15, 2, 0.95), starting("d9")]), 15.0, first.state
    )
    assert again.decode.desired == 3
    # Requested but not yet listed (a Deployment's pod not created yet) counts too.
    listed = decide(
        s, fleet(idle_prefill(15), decodes(15, 2, 0.95), decode_requested=3), 15.0, first.state
    )
    assert listed.decode.desired == 3


def test_no_fresh_metrics_at_all_holds():
    obs = fleet(idle_prefill(0), [decode("d0", None), decode("d1", None)])
    result = decide(spec(), obs, 100.0)
    assert (result.decode.desired, result.decode.code) == (2, "no_metrics")


# ---------------------------------------------------------------------------
# bounds, ratio, budget


@pytest.mark.parametrize(
    ("section", "prefill_want", "decode_want"),
    [
        # min replicas raise an idle fleet at once
        ({"decode": {"minReplicas": 3}}, 4, 3),
        # P:D at most 1: decode (wanting 1) is raised to prefill's 4
        ({"prefillDecodeRatio": {"max": 1}}, 4, 4),
        # P:D at most 1 with decode capped at 2: prefill is cut to 2
        ({"prefillDecodeRatio": {"max": 1}, "decode": {"maxReplicas": 2}}, 2, 2),
        # P:D at least 8: prefill raised to 8 for 1 decode
        ({"prefillDecodeRatio": {"min": 8}}, 8, 1),
        # a budget of 3 takes back prefill's growth first (it grew the most)
        ({"maxTotalReplicas": 3}, 2, 1),
    ],
)
def test_bounds_ratio_and_budget(section, prefill_want, decode_want):
    s = spec(**section)
    # Prefill needs 4 (32k tok/s at 10k tok/s per replica / 0.8), decode 1.
    obs = fleet(
        [prefill("p0", 0, arrivals=32_000, busy=1.0)],
        [decode("d0", 0, kv=0.3, running=30)],
    )
    result = decide(s, obs, 0.0)
    assert (result.prefill.desired, result.decode.desired) == (prefill_want, decode_want)


def test_ratio_and_budget_decisions_say_so():
    s = spec(maxTotalReplicas=3)
    obs = fleet(
        [prefill("p0", 0, arrivals=32_000, busy=1.0)], [decode("d0", 0, kv=0.3, running=30)]
    )
    result = decide(s, obs, 0.0)
    assert result.prefill.code == "budget"
    assert "maxTotalReplicas 3" in result.prefill.reason
    s = spec(prefillDecodeRatio={"max": 1})
    result = decide(s, obs, 0.0)
    assert result.decode.code == "ratio"
    assert "prefill:decode at most 1" in result.decode.reason


def test_max_replicas_below_the_current_count_scales_down_even_without_metrics():
    s = spec(decode={"maxReplicas": 2})
    obs = fleet(idle_prefill(0), [decode(f"d{i}", None) for i in range(4)])
    result = decide(s, obs, 0.0)
    assert (result.decode.desired, result.decode.code) == (2, "max_replicas")


# ---------------------------------------------------------------------------
# noise, trends, flapping


def test_steady_noisy_load_does_not_oscillate():
    s = spec()
    # Decode needs 2.5 replicas on average, +-8% period to period.
    wobble = [1.0, 1.08, 0.95, 1.03, 0.92, 1.06, 0.97, 1.01]

    def observe(t, counts):
        n = counts[1] if counts else 3
        total = 2.5 * 0.7 * wobble[int(t // PERIOD) % len(wobble)]
        return fleet(idle_prefill(t), decodes(t, n, total / n))

    results, _ = run(s, observe, periods(0, 3600))
    assert {r.decode.desired for r in results} == {3}


def test_a_rising_load_is_projected_one_startup_ahead():
    s = spec()
    state = None
    # Arrivals grow 1k tok/s every period (10k tok/s replicas).
    for i, t in enumerate(periods(0, 60)):
        obs = fleet([prefill("p0", t, arrivals=10_000 + 1_000 * i, busy=1.0)], decodes(t, 1, 0.3))
        result = decide(s, obs, t, state)
        state = result.state
    # 14k tok/s now = 1.4 replicas; rising 67 tok/s/s, for 75 s -> 1.9 / 0.8 = 2.4 -> 3.
    assert result.prefill.desired == 3
    assert "rising" in result.prefill.reason


def _rising_prefill(reported: float | None):
    """The ramp of the test above, its replica reporting ``reported`` seconds of
    startup; returns the last decision."""
    s = spec()
    state = None
    for i, t in enumerate(periods(0, 60)):
        ready = prefill("p0", t, arrivals=10_000 + 1_000 * i, busy=1.0, startup_seconds=reported)
        result = decide(s, fleet([ready], decodes(t, 1, 0.3)), t, state)
        state = result.state
    return result


def test_a_startup_reported_by_serving_replicas_sets_the_projection_horizon():
    # A fleet deployed before the autoscaler saw it: no start was watched,
    # but its replica says it took 195 s to become ready. The ramp is then
    # projected 195 s + a period ahead, not the default 75 s.
    long = _rising_prefill(195.0)
    assert "rising: 2.80 in 210 s" in long.prefill.reason
    assert long.prefill.desired == 4  # 14k + 67 tok/s/s x 210 s = 2.8 / 0.8 = 3.5
    # The default startup (60 s) reported projects what nothing reported does.
    assert "in 75 s" in _rising_prefill(60.0).prefill.reason
    assert "in 75 s" in _rising_prefill(None).prefill.reason
    assert _rising_prefill(None).prefill.desired == 3


def test_a_watched_start_replaces_the_reported_startups():
    s = spec()
    obs = fleet([prefill("p0", 0, startup_seconds=195.0), starting("p1")], decodes(0, 1, 0.3))
    state = decide(s, obs, 0.0).state
    assert (state.startup_seconds, state.startup_watched) == (180.0, False)  # less a period
    # p1 turns ready 30 s after it was first seen starting: the watched start
    # is the measurement from then on, and p0's report no longer counts.
    for t in (15.0, 30.0):
        replicas = [prefill("p0", t, startup_seconds=195.0)]
        replicas.append(prefill("p1", t, startup_seconds=45.0) if t == 30.0 else starting("p1"))
        state = decide(s, fleet(replicas, decodes(t, 1, 0.3)), t, state).state
    assert (state.startup_seconds, state.startup_watched) == (30.0, True)
    # Later watched starts are smoothed into it.
    for t, p2 in ((45.0, starting("p2")), (120.0, prefill("p2", 120.0))):
        replicas = [prefill("p0", t, startup_seconds=195.0), prefill("p1", t), p2]
        state = decide(s, fleet(replicas, decodes(t, 1, 0.3)), t, state).state
    assert state.startup_seconds == pytest.approx(30.0 + 0.3 * (75.0 - 30.0))


def test_one_pod_whose_readiness_came_back_late_does_not_set_the_startup():
    # A Pod that went unready and back reports the time to its latest Ready
    # transition (here an hour): the low median of the reports leaves it out.
    s = spec()
    for reports, want in (([95.0, 3600.0], 80.0), ([95.0, 3600.0, 110.0], 95.0)):
        replicas = [prefill(f"p{i}", 0, startup_seconds=r) for i, r in enumerate(reports)]
        assert decide(s, fleet(replicas, decodes(0, 1, 0.3)), 0.0).state.startup_seconds == want


def test_undoing_a_scale_down_raises_the_bar_for_the_next_one():
    s = spec()

    # Decode needs 0.8 replicas at 2 replicas (0.96 with the 20% headroom:
    # 1 looks enough) but 1.15 at 1 (a consolidated batch runs slower
    # steps), the bistable case at a few replicas.
    def observe(t, counts):
        n = counts[1] if counts else 2
        need = 0.8 if n >= 2 else 1.15
        return fleet(idle_prefill(t), decodes(t, n, need * 0.7 / n))

    results, _ = run(s, observe, periods(0, 3600), tuning=PolicyTuning(**TO_ONE))
    changes = [(r.decode.time, r.decode.desired) for r in results if r.decode.direction != "none"]
    assert changes[:2] == [(300.0, 1), (315.0, 2)]  # one flap, then
    assert len(changes) == 2
    assert results[-1].decode.code == "flap_damping"


# ---------------------------------------------------------------------------
# contract


def test_decide_is_pure():
    s = spec()
    obs = fleet([prefill("p0", 0, arrivals=30_000, busy=1.0)], decodes(0, 2, 0.9))
    state = decide(s, obs, 0.0).state
    snapshot = dataclasses.replace(state)
    a = decide(s, obs, 15.0, state)
    b = decide(s, obs, 15.0, state)
    assert a == b
    assert state == snapshot


def test_every_code_is_a_known_reason_code():
    s = spec()
    state = PolicyState()
    codes = set()
    for t in periods(0, 900):
        load = 3.0 if t < 200 else 0.2
        obs = fleet(
            [prefill("p0", t, arrivals=load * 10_000, busy=min(load, 1.0))],
            decodes(t, 2, load / 4),
        )
        result = decide(s, obs, t, state)
        state = result.state
        codes |= {d.code for d in result.decisions}
    assert codes <= set(REASON_CODES)
    assert len(codes) > 2


# ---------------------------------------------------------------------------
# the demand's own noise


def test_noise_is_the_spread_about_the_trend_not_the_trend_itself():
    ramp = tuple((15.0 * i, 1.0 + 0.1 * i) for i in range(7))
    assert noise(ramp) == pytest.approx(0.0, abs=1e-9)
    wobble = tuple((15.0 * i, 1.0 + (0.1 if i % 2 else -0.1)) for i in range(6))
    assert noise(wobble) == pytest.approx(1.4826 * 0.1, rel=1e-6)
    assert noise(wobble[:3]) == 0.0  # too few samples to tell


def test_fitted_level_ignores_one_spike_and_follows_a_ramp():
    flat = tuple((15.0 * i, 0.5) for i in range(6))
    assert fitted_level(0.9, flat, 90.0) == pytest.approx(0.5)
    ramp = tuple((15.0 * i, 0.5 + 0.01 * 15 * i) for i in range(6))
    assert fitted_level(0.5 + 0.9, ramp, 90.0) == pytest.approx(1.4)


def test_a_rise_within_the_noise_is_not_projected():
    # Noise of +-0.1 around 1.0 with the last samples drifting up by 0.1.
    history = ((0, 0.9), (15, 1.1), (30, 0.9), (45, 1.1), (60, 1.0))
    now, demand = 75.0, 1.15
    assert project(demand, history, now, 75) > demand  # a median slope > 0
    assert project(demand, history, now, 75, noise_z=2.0) == demand
    ramp = tuple((15.0 * i, 1.0 + 0.1 * i) for i in range(5))
    assert project(1.5, ramp, 75, 75, noise_z=2.0) == pytest.approx(1.5 + 0.1 / 15 * 75)


def test_noise_band_keeps_a_count_the_demand_noise_would_push_back():
    # Decode needs 0.7-1.15 replicas at 1: peaks beyond the 10% tolerance,
    # within twice the noise.
    wobble = [0.85, 0.75, 0.8, 0.7, 1.15, 0.8, 0.75, 1.12]

    def observe(t, counts):
        n = counts[1] if counts else 1
        need = wobble[int(t // PERIOD) % len(wobble)]
        return fleet(idle_prefill(t), decodes(t, n, 0.7 * need / n))

    plain = run(spec(), observe, periods(0, 1800))[0]
    banded = []
    state = None
    counts = None
    tuning = PolicyTuning(noise_band=2.0, trend_noise_z=2.0)
    for t in periods(0, 1800):
        result = decide(spec(), observe(t, counts), t, state, tuning)
        state, counts = result.state, (result.prefill.desired, result.decode.desired)
        banded.append(result)
    assert max(r.decode.desired for r in plain) == 2  # a noise peak scales up
    assert {r.decode.desired for r in banded} == {1}, [
        r.decode.reason for r in banded if r.decode.direction != "none"
    ]
    assert any("(noise)" in r.decode.reason for r in banded)


def test_decode_trend_restarts_at_a_count_change():
    s = spec()
    state = None
    # At 2 replicas the summed KV usage rises slowly ...
    for i, t in enumerate(periods(0, 90)):
        obs = fleet(idle_prefill(t), decodes(t, 2, (0.30 + 0.01 * i) / 2))
        state = decide(s, obs, t, state).state
    # ... then the fleet is at 1 replica, whose first sample shows more.
    obs = fleet(idle_prefill(105), decodes(105, 1, 0.45))
    result = decide(s, obs, 105.0, state)
    assert "rising" not in result.decode.reason, result.decode.reason
    assert result.decode.desired == 1


def test_no_scale_down_on_the_short_falling_window_just_after_a_scale_up():
    # Decode needs 0.6 replicas, jumps to 1.6 at 400 s, then falls decisively.
    def need(t):
        return 0.6 if t < 400 else 1.6 if t < 420 else max(0.3, 1.6 - 0.0065 * (t - 420))

    def observe(t, counts):
        n = counts[1] if counts else 1
        return fleet(idle_prefill(t), decodes(t, n, 0.7 * need(t) / n))

    def up_then_down(tuning):
        state, counts, up = None, None, None
        for t in periods(0, 1800):
            result = decide(spec(), observe(t, counts), t, state, tuning)
            state, counts = result.state, (result.prefill.desired, result.decode.desired)
            if result.decode.direction == "up":
                up = t
            elif result.decode.direction == "down":
                return up, t
        raise AssertionError("decode never scaled down")

    # Decode's default: the spec's whole window after its own scale-up.
    up, down = up_then_down(PolicyTuning(**TO_ONE))
    assert down - up >= 300
    # Without it the falling window undoes the scale-up early ...
    early = PolicyTuning(**TO_ONE, decode_full_down_window_after_up=False)
    up, down = up_then_down(early)
    assert down - up < 300
    # ... unless the rule is on for both roles.
    both = PolicyTuning(
        **TO_ONE, decode_full_down_window_after_up=False, full_down_window_after_up=True
    )
    up, down = up_then_down(both)
    assert down - up >= 300


def test_settled_decode_trend_ignores_the_transient_after_a_count_change():
    def reasons(tuning):
        state = None
        for t in periods(0, 60):  # steady at 2 replicas
            state = decide(
                spec(), fleet(idle_prefill(t), decodes(t, 2, 0.2)), t, state, tuning
            ).state
        out = []
        # At 1 replica the consolidating load raises the summed usage for a minute.
        for i, t in enumerate(periods(75, 135)):
            obs = fleet(idle_prefill(t), decodes(t, 1, 0.4 + 0.05 * i))
            result = decide(spec(), obs, t, state, tuning)
            state = result.state
            out.append(result.decode.reason)
        return out

    assert "rising" in reasons(PolicyTuning())[-1]
    assert not any("rising" in r for r in reasons(PolicyTuning(settle_decode_trend=True)))


def _warm_up_decisions(tuning=None):
    """The real fleet's first seconds (period 2 s, decode 1..3): idle, then
    one request's KV (0.27 of the engine) at 6 s and 8 s, then steady."""
    s = spec(periodSeconds=2, decode={"maxReplicas": 3, "maxScaleUpStep": 2})
    state, out = None, []
    for t in (0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0):
        kv = 0.0 if t < 6 else 0.27
        obs = fleet(idle_prefill(t), [decode("d0", t, kv=kv, running=1 if kv else 0)])
        result = decide(s, obs, t, state, tuning)
        state = result.state
        out.append(result.decode)
    return out


def test_warm_up_seconds_after_start_project_no_rise():
    decisions = _warm_up_decisions()
    assert {d.desired for d in decisions} == {1}, [d.reason for d in decisions]
    assert not any("rising" in d.reason for d in decisions)
    # The same samples with only the point count as evidence: a rise
    # projected a default startup ahead takes decode straight to 3.
    short = _warm_up_decisions(PolicyTuning(min_trend_span_seconds=0))
    assert any(d.desired == 3 and "rising" in d.reason for d in short)


def test_a_rise_over_the_minimum_span_is_still_projected():
    s = spec(periodSeconds=2, decode={"maxReplicas": 8})
    state, result = None, None
    # Summed KV usage rising steadily for 24 s at 2 s periods.
    for i, t in enumerate(2.0 * k for k in range(13)):
        obs = fleet(idle_prefill(t), [decode("d0", t, kv=0.3 + 0.02 * i, running=10)])
        result = decide(s, obs, t, state)
        state = result.state
    assert "rising" in result.decode.reason, result.decode.reason
    assert result.decode.desired > 1


def test_min_trend_span_must_not_be_negative():
    with pytest.raises(ValueError, match="min_trend_span_seconds"):
        PolicyTuning(min_trend_span_seconds=-1)
