"""The fleet simulator, with the policy in the loop, and `pdfleet sim`."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from pdfleet.engine.cli import COMMANDS, main
from pdfleet.operator.autoscaling.policy import PolicyTuning
from pdfleet.operator.autoscaling.spec import AutoscalingSpec
from pdfleet.operator.autoscaling_lab.sim import (
    FixedStrategy,
    FleetModel,
    OracleStrategy,
    PolicyStrategy,
    SimResult,
    Simulation,
    compare,
    evaluate_targets,
    replica_needs,
)
from pdfleet.operator.autoscaling_lab.traces import Burst, TraceConfig, make_trace

from .helpers import SIM_SPEC, policy_cell

SPEC = AutoscalingSpec.from_spec({"prefill": {"maxReplicas": 32}, "decode": {"maxReplicas": 32}})
MODEL = FleetModel(cold_start_seconds=30.0)


def simulate(trace, initial=(2, 1), strategy=None, model=MODEL) -> tuple[Simulation, SimResult]:
    sim = Simulation(trace, model, SPEC, strategy or PolicyStrategy(SPEC), initial)
    return sim, sim.run()


def replicas_at(result: SimResult, t: float) -> tuple[int, int]:
    return next((p, d) for when, p, d, _ in result.timeline if when >= t)


def test_traces_are_seeded():
    config = TraceConfig(kind="burst", duration_seconds=1800, base_rate=3)
    a, b = make_trace(config), make_trace(config)
    assert a.arrivals == b.arrivals and a.prompt_tokens == b.prompt_tokens and a.bursts == b.bursts
    other = make_trace(TraceConfig(kind="burst", duration_seconds=1800, base_rate=3, seed=1))
    assert other.arrivals != a.arrivals


@pytest.mark.parametrize("kind", ["steady", "diurnal", "burst"])
def test_trace_rates_follow_their_shape(kind):
    trace = make_trace(TraceConfig(kind=kind, duration_seconds=3600, base_rate=5))
    per_minute = [len(trace.between(60 * m, 60 * (m + 1))) / 60 for m in range(60)]
    if kind == "steady":
        assert max(per_minute) < 2 * min(per_minute)
    elif kind == "diurnal":
        assert sum(per_minute[25:35]) > 2 * sum(per_minute[:5])  # peak mid-trace
    else:
        assert trace.bursts and max(per_minute) > 2.2 * 5


def test_a_burst_is_answered_within_a_bounded_number_of_periods():
    # 4 req/s, then 16 req/s from t=600 on, at once.
    config = TraceConfig(kind="burst", duration_seconds=1200, base_rate=4)
    trace = make_trace(config, bursts=[Burst(start=600, factor=4, hold=1e9, ramp=0)])
    _, result = simulate(trace)
    before = replicas_at(result, 590)
    # Prefill needs ~2.5 replicas at 16 req/s x 1500 tokens / 12k tok/s / 0.8.
    answered = [t for t, p, _, _ in result.timeline if t >= 600 and p >= 3]
    assert before[0] <= 2
    assert answered and answered[0] <= 600 + 4 * SPEC.period_seconds
    # ... and the backlog the cold start left is gone a few minutes later.
    assert result.ttft_attainment > 0.9


@pytest.mark.parametrize("cold_start", [30.0, 120.0])
def test_the_first_ramp_is_projected_over_the_fleets_own_cold_start(cold_start):
    # The fleet's replicas were deployed before the trace (no start is
    # watched before its first surge): they report their cold start, and the
    # first surge's projection looks that far ahead plus a period.
    config = TraceConfig(kind="burst", duration_seconds=900, base_rate=4)
    trace = make_trace(config, bursts=[Burst(start=400, factor=4, hold=1e9, ramp=300)])
    _, result = simulate(trace, model=dataclasses.replace(MODEL, cold_start_seconds=cold_start))
    rising = [r for r in result.reasons if "rising:" in r and r.split()[1] == "prefill"]
    assert rising, result.reasons
    assert f" in {cold_start + SPEC.period_seconds:.0f} s" in rising[0]


def test_a_decisive_fall_scales_down_after_the_short_window_not_the_spec_window():
    # A surge from 200 s to 500 s, then quiet: the fall is decisive, so the
    # surge's replicas go after the falling window (90 s), not after the
    # spec's 300 s down window -- but not at once either.
    # Prefill sized on each period's token arrivals: on the request-rate
    # signal (the default) this instant drop meets the falling test only from
    # 615 s, and its last step down waits for the spec's window (930 s).
    tokens = PolicyTuning(prefill_mix_seconds=None)
    config = TraceConfig(kind="burst", duration_seconds=1500, base_rate=3)
    trace = make_trace(config, bursts=[Burst(start=200, factor=5, hold=300, ramp=0)])
    _, result = simulate(trace, strategy=PolicyStrategy(SPEC, tokens))
    quiet = replicas_at(result, 1450)[0]
    assert replicas_at(result, 480)[0] > quiet + 1
    window = SPEC.prefill.scale_down_stabilization_seconds
    falling = PolicyTuning().falling_down_window_seconds
    reached = min(t for t, p, _, _ in result.timeline if t >= 500 and p == quiet)
    assert 500 + falling <= reached < 500 + window
    # Without the falling window, the spec's window holds the surge's count.
    _, slow = simulate(
        trace,
        strategy=PolicyStrategy(
            SPEC, dataclasses.replace(tokens, falling_down_window_seconds=None)
        ),
    )
    reached_slow = min(t for t, p, _, _ in slow.timeline if t >= 500 and p == quiet)
    assert reached_slow >= 500 + window
    assert result.replica_seconds["total"] < slow.replica_seconds["total"]


def test_steady_load_does_not_oscillate():
    trace = make_trace(TraceConfig(kind="steady", duration_seconds=2400, base_rate=20))
    _, result = simulate(trace, initial=(4, 2))
    settled = [(p, d) for t, p, d, _ in result.timeline if t >= 600]
    changes = sum(1 for a, b in itertools.pairwise(settled) if a != b)
    assert changes <= 2
    assert result.ttft_attainment > 0.99


def test_fixed_provisioning_never_scales_and_every_request_finishes():
    trace = make_trace(TraceConfig(kind="burst", duration_seconds=900, base_rate=3))
    _, result = simulate(trace, initial=(6, 3), strategy=FixedStrategy(6, 3))
    assert result.scale_events["total"] == 0
    assert result.replica_seconds["total"] == pytest.approx(9 * 900)
    assert result.completed == result.requests == len(trace)


def test_scale_down_drains_instead_of_dropping_work():
    config = TraceConfig(kind="burst", duration_seconds=1500, base_rate=3)
    trace = make_trace(config, bursts=[Burst(start=100, factor=5, hold=300, ramp=30)])
    _, result = simulate(trace)
    assert result.replicas_stopped["prefill"] > 0
    assert result.completed == result.requests


def test_scrape_failures_are_held_on_not_scaled_down_on():
    trace = make_trace(TraceConfig(kind="steady", duration_seconds=1200, base_rate=3))
    model = FleetModel(cold_start_seconds=30.0, scrape_failure_rate=0.5)
    sim = Simulation(trace, model, SPEC, PolicyStrategy(SPEC), (6, 4))
    result = sim.run()
    # Every replica misses half its scrapes: some sample is stale most of the
    # time, so the over-provisioned fleet must mostly hold.
    assert any(code.endswith("metrics_missing") for code in result.decision_codes)
    assert result.completed == result.requests


def test_compare_runs_every_strategy_on_the_same_trace():
    trace = make_trace(TraceConfig(kind="burst", duration_seconds=900, base_rate=8))
    results = compare(trace, MODEL, SPEC)
    assert set(results) == {"pdfleet", "fixed", "hpa", "oracle"}
    assert {r.requests for r in results.values()} == {len(trace)}
    fixed = results["fixed"].replica_seconds["total"]
    assert results["oracle"].replica_seconds["total"] < fixed
    targets = evaluate_targets(results)
    assert set(targets) == {
        "ttft_attainment",
        "itl_attainment",
        "replica_seconds_vs_oracle",
        "replica_seconds_vs_fixed_peak",
        "scale_events_vs_hpa",
    }
    with pytest.raises(ValueError, match="unknown strategy"):
        compare(trace, MODEL, SPEC, strategies=["pdfleet", "magic"])


def test_sim_is_a_pdfleet_command():
    assert COMMANDS["sim"] == "pdfleet.operator.autoscaling_lab.sim_cmd"


def test_cli_json(capsys):
    code = main(["sim", "--json", "--duration", "600", "--rate", "3", "--trace", "steady"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["results"]) == {"pdfleet", "fixed", "hpa", "oracle"}
    pdfleet = out["results"]["pdfleet"]
    for key in ("ttft_attainment", "itl_attainment", "replica_seconds", "scale_events"):
        assert key in pdfleet
    assert out["spec"]["decode"]["targetKVCacheUsage"] == 0.7
    assert out["trace"]["kind"] == "steady"
    assert "replica_seconds_vs_oracle" in out["targets"]


def test_cli_table_and_spec_file(tmp_path, capsys):
    spec = tmp_path / "svc.yaml"
    spec.write_text(
        "spec:\n  autoscaling:\n    decode: {maxReplicas: 3}\n    prefill: {maxReplicas: 6}\n"
    )
    code = main(
        ["sim", "--duration", "300", "--rate", "2", "--spec", str(spec), "--strategies", "pdfleet"]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "pdfleet sim: burst trace" in out and "\npdfleet " in out


def test_cli_seeds_summarizes_every_seed(capsys):
    argv = ["sim", "--json", "--seeds", "2", "--duration", "300", "--rate", "2"]
    assert main([*argv, "--strategies", "pdfleet,oracle"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [run["seed"] for run in out["seeds"]] == [0, 1]
    summary = out["summary"]["strategies"]["pdfleet"]["ttft_attainment"]
    assert summary["min"] <= summary["mean"] <= summary["max"]
    assert out["summary"]["targets"]["replica_seconds_vs_oracle"]["met"] in (0, 1, 2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategies", "pdfleet,magic"], "unknown strategy magic"),
        (["--rate", "0"], "--rate must be > 0"),
        (["--spec", "/nonexistent.yaml"], "--spec: cannot read"),
        (["--seeds", "0"], "--seeds must be >= 1"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(argv, message, capsys):
    assert main(["sim", "--duration", "60", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_every_trace_fleet_and_run_field_has_a_sim_flag_with_its_default():
    import argparse
    import dataclasses

    from pdfleet.operator.autoscaling_lab import sim_cmd

    parser = sim_cmd.add_parser(argparse.ArgumentParser().add_subparsers())
    args = parser.parse_args([])
    for cls in (sim_cmd.TraceConfig, sim_cmd.FleetModel, sim_cmd.SimOptions):
        for f in dataclasses.fields(cls):
            assert getattr(args, f.name) == f.default or tuple(getattr(args, f.name)) == f.default
    parsed = parser.parse_args(["--burst-factor", "2", "3", "--cold-start", "5"])
    assert sim_cmd.dataclass_from_arguments(sim_cmd.TraceConfig, parsed).burst_factor == (2, 3)
    assert sim_cmd.dataclass_from_arguments(sim_cmd.FleetModel, parsed).cold_start_seconds == 5


def test_cli_table_names_its_targets_in_product_terms(capsys):
    argv = ["sim", "--duration", "300", "--rate", "2", "--strategies", "pdfleet,oracle"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Targets of the pdfleet policy" in out and "issue" not in out.lower()


def test_an_oracle_with_less_foresight_serves_a_surge_later():
    # benchmarks/autoscaling_foresight.py: the oracle seeing the load a cold
    # start plus a period ahead has its replicas ready when a surge arrives;
    # seeing it later, it misses the surge's first seconds.
    trace = make_trace(
        TraceConfig(kind="burst", duration_seconds=900, base_rate=3),
        bursts=[Burst(start=300, factor=5, hold=200, ramp=30)],
    )
    needs = replica_needs(trace, MODEL, SPEC)
    full = MODEL.cold_start_seconds + SPEC.period_seconds
    start = OracleStrategy(needs, SPEC.period_seconds, full).at(0.0)

    def ttft(ahead: float) -> float:
        oracle = OracleStrategy(needs, SPEC.period_seconds, ahead)
        return Simulation(trace, MODEL, SPEC, oracle, start).run().ttft_attainment

    seeing, blind = ttft(full), ttft(0.0)
    assert seeing >= 0.99
    assert blind < seeing - 0.02


def test_decode_is_not_scaled_down_on_a_documents_fall_just_after_its_scale_up():
    # Heavytail seed 6: long documents finishing drop decode's summed KV
    # usage 120 s after its 2 -> 3; on the falling window that undid the
    # scale-up, the next rise restored it, and the flap floor then held the
    # third replica for 1,350 s (docs/autoscaling.md, the matrix).
    window = SIM_SPEC.decode.scale_down_stabilization_seconds

    def decode_run(tuning: PolicyTuning) -> tuple[list[tuple[float, int, int]], float]:
        result = policy_cell("heavytail", 6, tuning)
        steps = [(t, a, b) for t, role, a, b in result.scale_log if role == "decode"]
        return steps, result.replica_seconds["decode"]

    def undone_early(steps: list[tuple[float, int, int]]) -> int:
        return sum(
            1
            for (t1, a1, b1), (t2, a2, b2) in itertools.pairwise(steps)
            if b1 > a1 and b2 < a2 and t2 - t1 < window
        )

    steps, cost = decode_run(PolicyTuning())
    assert undone_early(steps) == 0
    early, early_cost = decode_run(PolicyTuning(decode_full_down_window_after_up=False))
    assert undone_early(early) >= 1
    # Holding the replica a few minutes costs less than the flap did.
    assert cost < early_cost
