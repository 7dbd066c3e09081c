"""benchmarks/sim_vs_real.py picks its trace's base rate from the
calibration: the lowest rung of its ladder at which the simulated decode
reaches ``--decode-peak`` replicas, so that the real and the simulated fleet
both have scaling to do."""

from __future__ import annotations

import argparse

import pytest
from helpers.scripts import benchmark_module

from pdfleet.operator.autoscaling.spec import AutoscalingSpec
from pdfleet.operator.autoscaling_lab.sim_fleet import FleetModel


@pytest.fixture(scope="module")
def bench():
    yield from benchmark_module("sim_vs_real")


def _args(**kw) -> argparse.Namespace:
    base = {
        "duration": 180.0,
        "seed": 0,
        "prompt_tokens": 128.0,
        "output_tokens": 96.0,
        "burst_factor": 3.0,
        "min_rate": 0.5,
        "max_rate": 6.0,
        "decode_peak": 2,
    }
    return argparse.Namespace(**{**base, **kw})


# A calibration like the CPU runs' (docs/autoscaling.md, "The simulator
# against the real fleet"): decode engines of 4 sequences and 768 KV tokens.
MODEL = FleetModel(
    prefill_tokens_per_second=50_000.0,
    decode_step_seconds=0.0015,
    decode_step_seconds_per_seq=0.0002,
    kv_capacity_tokens=768,
    max_num_seqs=4,
    cold_start_seconds=5.0,
    ttft_slo_seconds=2.0,
    itl_slo_seconds=0.1,
)


def test_the_lowest_rung_that_scales_decode_is_chosen(bench):
    spec = AutoscalingSpec.from_spec(bench.AUTOSCALING)
    args = _args()
    rate, ladder = bench.choose_rate(args, MODEL, spec)
    assert ladder[-1]["rate"] == pytest.approx(rate, abs=1e-3)
    assert ladder[-1]["decode_peak"] >= 2
    assert len(ladder) >= 2 and all(r["decode_peak"] < 2 for r in ladder[:-1])
    rungs = [r["rate"] for r in ladder]
    assert rungs == sorted(rungs) and rungs[0] == args.min_rate
    # The chosen rate's trace, simulated again, scales decode up.
    result = bench.simulate(bench.make_run_trace(args, rate)[2], MODEL, spec, args.seed)
    assert result.peak_replicas["decode"] >= 2 and result.scale_events["decode"] >= 1


def test_a_peak_out_of_reach_stops_at_the_ladders_top(bench):
    spec = AutoscalingSpec.from_spec(bench.AUTOSCALING)
    rate, ladder = bench.choose_rate(_args(decode_peak=99, max_rate=2.0), MODEL, spec)
    assert rate <= 2.0 < rate * 1.25
    assert all(r["decode_peak"] < 99 for r in ladder)


def test_slos_at_the_real_fleets_own_percentile_compare_both_sides(bench):
    # Requests in replay()'s shape: the real fleet's p99 sets the SLO, so its
    # attainment sits at 99% and the simulator's is read at the same SLO.
    real = [{"ttft": 0.1 + i / 1000, "itl": 0.01, "tokens": 10, "error": None} for i in range(100)]
    real[5] = {"ttft": None, "itl": 0.0, "tokens": 0, "error": "status 503"}
    slo = bench.percentile(sorted(r["ttft"] for r in real if r["ttft"] is not None), 99)
    figures = bench.slo_figures(real, slo, 0.02)
    assert figures["ttft_attainment"] == pytest.approx(0.98)  # 1 late, 1 failed
    assert figures["itl_attainment"] == pytest.approx(0.99)
    sim = {**figures, "ttft_attainment": 0.95, "replica_seconds": {"total": 110.0}}
    out = bench.fidelity({**figures, "replica_seconds": {"total": 100.0}}, sim)
    assert not out["ttft_attainment"]["met"] and out["itl_attainment"]["met"]
    assert out["ttft_p99"]["met"] and out["replica_seconds"]["met"]
    far = bench.fidelity(
        {**figures, "replica_seconds": {"total": 100.0}},
        {**figures, "ttft_p50": figures["ttft_p50"] * 1.3, "replica_seconds": {"total": 120.0}},
    )
    assert not far["ttft_p50"]["met"] and not far["replica_seconds"]["met"]


def test_the_simulators_requests_are_read_like_the_replays(bench):
    spec = AutoscalingSpec.from_spec(bench.AUTOSCALING)
    trace = bench.make_run_trace(_args(duration=60.0), 1.0)[2]
    result, sim = bench.run_sim(trace, MODEL, spec, 0)
    rows = bench.sim_latencies(sim)
    assert len(rows) == result.requests
    figures = bench.slo_figures(rows, MODEL.ttft_slo_seconds, MODEL.itl_slo_seconds)
    assert figures["ttft_attainment"] == pytest.approx(result.ttft_attainment)
    assert figures["ttft_p99"] == pytest.approx(result.ttft_p99)
