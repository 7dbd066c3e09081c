"""Prefill sized on its request rate times the prompt mix of a longer window
(``PolicyTuning.prefill_mix_seconds``), and decode's headroom for going down
to one replica (``single_decode_headroom``): each test drives ``decide()``
period by period and shows the rule changing the decision it is for."""

from __future__ import annotations

import pytest

from pdfleet.operator.autoscaling.policy import PolicyTuning, decide
from pdfleet.operator.autoscaling.samples import EngineSnapshot, sample_from_snapshots
from pdfleet.operator.autoscaling.spec import AutoscalingSpec

from .helpers import PERIOD, decode, fleet, idle_prefill, prefill


def spec() -> AutoscalingSpec:
    return AutoscalingSpec.from_spec(
        {"prefill": {"maxReplicas": 16}, "decode": {"maxReplicas": 16}}
    )


def test_request_arrivals_are_first_tokens_plus_the_growth_of_the_requests_held():
    before = EngineSnapshot(time=100.0, num_running=1, num_waiting=2, ttft_count=40)
    after = EngineSnapshot(time=115.0, num_running=1, num_waiting=8, ttft_count=70)
    sample = sample_from_snapshots("p0", after, before)
    # 30 requests got their first token and 6 more are held than before.
    assert sample.request_arrivals_per_second == pytest.approx(36 / 15)
    drained = EngineSnapshot(time=130.0, num_running=0, num_waiting=0, ttft_count=80)
    # A queue that empties faster than requests arrive gives no negative rate.
    assert sample_from_snapshots("p0", drained, after).request_arrivals_per_second == (
        pytest.approx(1 / 15)
    )
    # A first scrape: no rate.
    assert sample_from_snapshots("p0", after).request_arrivals_per_second is None


def _prefill_fleet(t: float, tokens_per_request: float, requests_per_replica: float = 4.0):
    return [
        prefill(
            f"p{i}",
            t,
            arrivals=requests_per_replica * tokens_per_request,
            request_arrivals_per_second=requests_per_replica,
        )
        for i in range(3)
    ]


def _run_prefill(mixes, tuning: PolicyTuning, requests=None):
    """Three prefill replicas at 10k tokens/s each; one period per entry of
    ``mixes`` (mean prompt tokens of that period's requests). Returns the
    prefill counts decided."""
    s, state, counts = spec(), None, []
    count = 3
    for i, mix in enumerate(mixes):
        t = PERIOD * (i + 1)
        rate = 4.0 if requests is None else requests[i]
        obs = fleet(
            _prefill_fleet(t, mix, rate),
            [decode("d0", t, kv=0.3, running=20)],
            prefill_requested=count,
            decode_requested=1,
        )
        out = decide(s, obs, t, state, tuning)
        state = out.state
        count = out.prefill.desired
        counts.append(count)
    return counts


# Twelve requests/s over three replicas, prompts averaging 1,500 tokens: 1.8
# replicas of work, 2.25 at 0.8 utilization, within the band of 3. The last
# periods draw a few long documents: the same request rate, 60% more tokens.
STEADY_MIX = [1500.0, 1200.0, 1800.0, 1400.0, 1600.0, 1300.0, 1700.0] * 3 + [2400.0, 2500.0]


def test_a_noisy_prompt_mix_at_a_steady_request_rate_keeps_the_count():
    assert _run_prefill(STEADY_MIX, PolicyTuning()) == [3] * len(STEADY_MIX)


def test_per_period_token_arrivals_scale_up_on_the_same_mix():
    counts = _run_prefill(STEADY_MIX, PolicyTuning(prefill_mix_seconds=None))
    assert counts[:-2] == [3] * (len(STEADY_MIX) - 2)
    assert counts[-1] > 3


def test_a_rising_request_rate_still_scales_prefill_up():
    n = len(STEADY_MIX)
    # The rate doubles over the last six periods, the mix as before.
    rates = [4.0] * (n - 6) + [4.0 * (1 + k / 6) for k in range(1, 7)]
    counts = _run_prefill([1500.0] * n, PolicyTuning(), rates)
    assert counts[: n - 6] == [3] * (n - 6)
    assert counts[-1] >= 5


def _run_decode(kv_summed: float, tuning: PolicyTuning, periods: int = 50):
    s, state, count = spec(), None, 2
    for i in range(periods):
        t = PERIOD * (i + 1)
        obs = fleet(
            idle_prefill(t),
            [decode(f"d{k}", t, kv=kv_summed / 2, running=10) for k in range(count)],
            prefill_requested=1,
            decode_requested=count,
        )
        out = decide(s, obs, t, state, tuning)
        state, count = out.state, out.decode.desired
    return count


def test_decode_keeps_two_replicas_for_a_load_one_holds_at_its_target_only():
    # 0.5 summed KV usage is 0.71 replicas at the 0.7 target: one replica
    # would hold it, with 30% headroom; with the headroom for going down to
    # one (1.0, the default) it must hold twice the load, so decode stays at 2.
    assert _run_decode(0.5, PolicyTuning()) == 2
    assert _run_decode(0.5, PolicyTuning(single_decode_headroom=None)) == 1
    # A load one replica holds twice over still goes down to one.
    assert _run_decode(0.3, PolicyTuning()) == 1


def test_the_reason_names_the_request_rate_and_the_prompt_mix():
    s, state = spec(), None
    for i in range(3):
        t = PERIOD * (i + 1)
        obs = fleet(
            _prefill_fleet(t, 1500.0), [decode("d0", t, kv=0.3, running=20)], prefill_requested=3
        )
        out = decide(s, obs, t, state)
        state = out.state
    # 3 replicas x 4 requests/s, 1,500 tokens each, at 10k tokens/s.
    assert "12.0 requests/s x 1500 prompt tokens = 1.80 replicas" in out.prefill.reason, (
        out.prefill.reason
    )
