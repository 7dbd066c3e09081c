"""Prometheus text -> engine snapshots -> the policy's per-replica samples."""

from __future__ import annotations

import pytest

from pdfleet.operator.autoscaling.samples import (
    EngineSnapshot,
    parse_engine_metrics,
    sample_from_snapshots,
)

NATIVE = """\
# HELP pdfleet_engine_num_requests_running Requests in the running batch.
# TYPE pdfleet_engine_num_requests_running gauge
pdfleet_engine_num_requests_running{{model_name="m"}} {running}
# TYPE pdfleet_engine_num_requests_waiting gauge
pdfleet_engine_num_requests_waiting{{model_name="m"}} {waiting}
# TYPE pdfleet_engine_kv_cache_usage_ratio gauge
pdfleet_engine_kv_cache_usage_ratio{{model_name="m"}} {kv}
# TYPE pdfleet_engine_waiting_prompt_tokens gauge
pdfleet_engine_waiting_prompt_tokens{{model_name="m"}} {queued}
# TYPE pdfleet_engine_prompt_tokens_total counter
pdfleet_engine_prompt_tokens_total{{model_name="m"}} {prompt}
# TYPE pdfleet_engine_prefill_busy_seconds_total counter
pdfleet_engine_prefill_busy_seconds_total{{model_name="m"}} {busy}
# TYPE pdfleet_engine_time_to_first_token_seconds histogram
pdfleet_engine_time_to_first_token_seconds_bucket{{model_name="m",le="0.5"}} 1
pdfleet_engine_time_to_first_token_seconds_bucket{{model_name="m",le="+Inf"}} {ttft_count}
pdfleet_engine_time_to_first_token_seconds_sum{{model_name="m"}} {ttft_sum}
pdfleet_engine_time_to_first_token_seconds_count{{model_name="m"}} {ttft_count}
# TYPE pdfleet_engine_inter_token_latency_seconds histogram
pdfleet_engine_inter_token_latency_seconds_bucket{{model_name="m",le="+Inf"}} {itl_count}
pdfleet_engine_inter_token_latency_seconds_sum{{model_name="m"}} {itl_sum}
pdfleet_engine_inter_token_latency_seconds_count{{model_name="m"}} {itl_count}
"""


def native(**values) -> str:
    defaults = dict(
        running=3,
        waiting=2,
        kv=0.25,
        queued=4096,
        prompt=10_000,
        busy=2.0,
        ttft_sum=3.0,
        ttft_count=6,
        itl_sum=1.0,
        itl_count=50,
    )
    return NATIVE.format(**{**defaults, **values})


def test_native_metrics_are_read():
    snap = parse_engine_metrics(native(), time=12.5)
    assert snap == EngineSnapshot(
        time=12.5,
        num_running=3,
        num_waiting=2,
        kv_cache_usage=0.25,
        waiting_prompt_tokens=4096,
        prompt_tokens_total=10_000,
        prefill_busy_seconds_total=2.0,
        ttft_sum=3.0,
        ttft_count=6,
        itl_sum=1.0,
        itl_count=50,
    )


def test_vllm_names_are_the_fallback():
    text = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m",engine="0"} 4
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m",engine="0"} 1
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.5
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="m",engine="0"} 900
"""
    snap = parse_engine_metrics(text, time=1.0)
    assert (snap.num_running, snap.num_waiting, snap.kv_cache_usage) == (4, 1, 0.5)
    assert snap.prompt_tokens_total == 900
    # vLLM exports no queued-token or busy-time series: None, not 0.
    assert snap.waiting_prompt_tokens is None
    assert snap.prefill_busy_seconds_total is None


def test_native_names_win_over_vllm_names():
    text = native(running=7) + 'vllm:num_requests_running{model_name="m"} 99\n'
    assert parse_engine_metrics(text, 0.0).num_running == 7


def test_several_ranks_sum_counts_and_average_the_usage_ratio():
    text = """\
pdfleet_engine_num_requests_running{engine="0"} 3
pdfleet_engine_num_requests_running{engine="1"} 5
pdfleet_engine_kv_cache_usage_ratio{engine="0"} 0.2
pdfleet_engine_kv_cache_usage_ratio{engine="1"} 0.6
"""
    snap = parse_engine_metrics(text, 0.0)
    assert snap.num_running == 8
    assert snap.kv_cache_usage == pytest.approx(0.4)


def test_text_that_is_not_prometheus_raises_value_error():
    with pytest.raises(ValueError, match="Prometheus"):
        parse_engine_metrics("this is { not metrics", 0.0)


def test_rates_come_from_consecutive_snapshots():
    before = parse_engine_metrics(native(prompt=10_000, busy=2.0, queued=4_000), time=100.0)
    after = parse_engine_metrics(
        native(
            prompt=40_000,
            busy=5.0,
            queued=10_000,
            ttft_sum=9.0,
            ttft_count=12,
            itl_sum=2.0,
            itl_count=150,
        ),
        time=115.0,
    )
    sample = sample_from_snapshots("p0", after, before)
    assert sample.interval_seconds == 15.0
    assert sample.prompt_tokens_per_second == pytest.approx(2_000)  # 30k / 15 s
    # arrivals = computed 30k + queue growth 6k, over 15 s
    assert sample.prompt_token_arrivals_per_second == pytest.approx(2_400)
    assert sample.prefill_busy_fraction == pytest.approx(0.2)  # 3 s of 15
    assert sample.ttft_seconds == pytest.approx(1.0)  # 6 s over 6 requests
    assert sample.first_tokens_per_second == pytest.approx(0.4)
    assert sample.itl_seconds == pytest.approx(0.01)  # 1 s over 100 tokens
    assert sample.waiting_prompt_tokens == 10_000


def test_a_counter_reset_gives_no_rate_rather_than_a_negative_one():
    before = parse_engine_metrics(native(prompt=50_000, busy=9.0), time=0.0)
    after = parse_engine_metrics(native(prompt=1_000, busy=0.5), time=15.0)
    sample = sample_from_snapshots("p0", after, before)
    assert sample.prompt_tokens_per_second is None
    assert sample.prefill_busy_fraction is None
    assert sample.prompt_token_arrivals_per_second is None


def test_without_a_previous_snapshot_there_are_gauges_but_no_rates():
    sample = sample_from_snapshots("d0", parse_engine_metrics(native(kv=0.9), 3.0))
    assert (sample.time, sample.kv_cache_usage, sample.num_running) == (3.0, 0.9, 3)
    assert sample.interval_seconds is None and sample.prompt_tokens_per_second is None


def test_no_snapshot_means_no_metrics():
    sample = sample_from_snapshots("d0", None, state="starting")
    assert sample.time is None and sample.state == "starting"
