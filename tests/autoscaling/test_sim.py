"""The fleet simulator, with the policy in the loop, and `pdfleet sim`."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from pdfleet.engine.cli import COMMANDS, main
from pdfleet.operator.autoscaling.spec import AutoscalingSpec
from pdfleet.operator.autoscaling_lab.sim import PolicyStrategy, compare, evaluate_targets
from pdfleet.operator.autoscaling_lab.sim_fleet import FleetModel, SimResult, Simulation
from pdfleet.operator.autoscaling_lab.strategies import (
    FixedStrategy,
    HPAStrategy,
    HPATargets,
    OracleStrategy,
    Sizing,
    replica_needs,
    trace_load,
)
from pdfleet.operator.autoscaling_lab.traces import Burst, TraceConfig, make_trace

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
    # ... and the backlog the cold start left is gone a few minutes later
    # (the surge's first cold start is late for every reactive policy).
    assert result.ttft_attainment > 0.85


@pytest.mark.parametrize("cold_start", [30.0, 120.0])
def test_the_first_ramp_is_projected_over_the_fleets_own_cold_start(cold_start):
    # The fleet's replicas were deployed before the trace (no start is
    # watched before its first surge): they report their cold start, and the
    # first surge's forecast looks that far ahead plus a period.
    config = TraceConfig(kind="burst", duration_seconds=900, base_rate=8)
    trace = make_trace(config, bursts=[Burst(start=400, factor=4, hold=1e9, ramp=300)])
    _, result = simulate(trace, model=dataclasses.replace(MODEL, cold_start_seconds=cold_start))
    rising = [r for r in result.reasons if "rising to" in r and r.split()[1] == "prefill"]
    assert rising, result.reasons
    # The lead is at most two minutes (a longer cold start is started late).
    assert f" in {min(cold_start + SPEC.period_seconds, 120):.0f} s" in rising[0]


def test_a_surge_ebbing_scales_down_after_the_short_window():
    # A surge from 200 s to 500 s, then quiet: the fall stands out of the
    # rate's noise, so its replicas go after the spec's down window (90 s),
    # not after the longer one a load that only wanders gets.
    config = TraceConfig(kind="burst", duration_seconds=1500, base_rate=6)
    trace = make_trace(config, bursts=[Burst(start=200, factor=5, hold=300, ramp=0)])
    _, result = simulate(trace)
    quiet = replicas_at(result, 1450)[0]
    assert replicas_at(result, 480)[0] > quiet + 1
    halfway = (replicas_at(result, 480)[0] + quiet) / 2
    reached = min(t for t, p, _, _ in result.timeline if t >= 500 and p <= halfway)
    assert reached < 500 + 300


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
    result = Simulation(trace, model, SPEC, PolicyStrategy(SPEC), (6, 4)).run()
    clean = Simulation(trace, MODEL, SPEC, PolicyStrategy(SPEC), (6, 4)).run()
    # Every replica misses half its scrapes: a sample that went stale is
    # "at least the current count" in the down window, so the
    # over-provisioned fleet holds longer than with every scrape answered.
    assert result.replica_seconds["total"] > clean.replica_seconds["total"]
    assert result.completed == result.requests


def test_compare_runs_every_strategy_on_the_same_trace():
    trace = make_trace(TraceConfig(kind="burst", duration_seconds=900, base_rate=8))
    results, found = compare(trace, MODEL, SPEC)
    assert found is None
    assert set(results) == {"pdfleet", "fixed", "hpa", "oracle"}
    assert {r.requests for r in results.values()} == {len(trace)}
    fixed = results["fixed"].replica_seconds["total"]
    assert results["oracle"].replica_seconds["total"] < fixed
    targets = evaluate_targets(results, "burst")
    assert set(targets) == {"ttft_attainment", "itl_attainment", "replica_seconds_vs_hpa"}
    with pytest.raises(ValueError, match="unknown strategy"):
        compare(trace, MODEL, SPEC, strategies=["pdfleet", "magic"])


def test_hpa_follows_the_kubernetes_algorithm():
    # desired = ceil(sum(metric) / target), kept within 10% of the target,
    # up at most max(+4, x2) a period, down to the highest of a 300 s window.
    from .helpers import decode, fleet, prefill

    hpa = HPAStrategy(SPEC, HPATargets(prefill_utilization=0.5, decode_kv_usage=0.5))
    busy = [prefill(f"p{i}", 0.0, busy=0.9) for i in range(2)]  # 1.8 busy / 0.5 = 3.6 -> 4
    kv = [decode(f"d{i}", 0.0, kv=0.52) for i in range(2)]  # 1.04 / 0.5: within 10%
    assert hpa.decide(0.0, fleet(busy, kv)) == (4, 2)
    big = [prefill(f"p{i}", 15.0, busy=1.0) for i in range(2)]  # 4 -> wants 4
    hot = [decode(f"d{i}", 15.0, kv=1.0) for i in range(2)]  # 2 / 0.5 = 4
    assert hpa.decide(15.0, fleet(big, hot)) == (4, 4)
    idle = [prefill(f"p{i}", 30.0, busy=0.0) for i in range(4)]
    # The window still holds 4: no scale-down within 300 s; then at once.
    assert hpa.decide(30.0, fleet(idle, kv))[0] == 4
    later = [prefill(f"p{i}", 330.0, busy=0.0) for i in range(4)]
    assert hpa.decide(330.0, fleet(later, kv))[0] == 1


def test_the_oracle_provisions_a_cold_start_ahead():
    trace = make_trace(
        TraceConfig(kind="burst", duration_seconds=900, base_rate=3),
        bursts=[Burst(start=300, factor=5, hold=200, ramp=30)],
    )
    needs = replica_needs(trace_load(trace, MODEL, 15.0), MODEL, SPEC, Sizing())
    ahead = MODEL.cold_start_seconds + SPEC.period_seconds
    oracle = OracleStrategy(needs, SPEC.period_seconds, ahead)
    # At 270 s it already holds what 300-315 s needs.
    assert oracle.at(270.0)[0] >= max(needs[0][20:22])
    seeing = Simulation(trace, MODEL, SPEC, oracle, oracle.at(0.0)).run()
    blind = Simulation(
        trace, MODEL, SPEC, OracleStrategy(needs, SPEC.period_seconds, 0.0), oracle.at(0.0)
    ).run()
    assert seeing.ttft_attainment > blind.ttft_attainment


def test_sim_is_a_pdfleet_command():
    assert COMMANDS["sim"] == "pdfleet.operator.autoscaling_lab.sim_cmd"


def test_cli_json_keeps_its_shape(capsys):
    argv = ["sim", "--json", "--regime", "cpu", "--duration", "600", "--rate", "3"]
    assert main([*argv, "--trace", "steady"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["results"]) == {"pdfleet", "fixed", "hpa", "oracle"}
    pdfleet = out["results"]["pdfleet"]
    assert isinstance(pdfleet["replica_seconds"]["total"], float)
    for key in ("ttft_attainment", "itl_attainment", "scale_events"):
        assert key in pdfleet
    assert out["trace"]["kind"] == "steady" and out["regime"] == "cpu"
    assert "replica_seconds_vs_hpa" in out["targets"]


def test_the_gpu_regime_is_the_default_and_flags_override_it(capsys):
    argv = ["sim", "--json", "--strategies", "oracle", "--duration", "120", "--rate", "5"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["regime"] == "gpu"
    assert out["model"]["ttft_slo_seconds"] == 1.5 and out["trace"]["base_rate"] == 5
    assert out["trace"]["prompt_tokens_mean"] == 8000
    assert out["spec"]["decode"]["itlTargetSeconds"] == 0.025


def test_cli_table_and_spec_file(tmp_path, capsys):
    spec = tmp_path / "svc.yaml"
    spec.write_text(
        "spec:\n  autoscaling:\n    decode: {maxReplicas: 3}\n    prefill: {maxReplicas: 6}\n"
    )
    code = main(
        [
            "sim",
            "--regime",
            "cpu",
            "--duration",
            "300",
            "--rate",
            "2",
            "--spec",
            str(spec),
            "--strategies",
            "pdfleet",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "pdfleet sim: burst trace" in out and "\npdfleet " in out


def test_cli_seeds_summarizes_every_seed(capsys):
    argv = ["sim", "--json", "--regime", "cpu", "--seeds", "2", "--duration", "300", "--rate", "2"]
    assert main([*argv, "--strategies", "pdfleet,hpa"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [run["seed"] for run in out["seeds"]] == [0, 1]
    summary = out["summary"]["strategies"]["pdfleet"]["ttft_attainment"]
    assert summary["min"] <= summary["mean"] <= summary["max"]
    assert out["summary"]["targets"]["replica_seconds_vs_hpa"]["met"] in (0, 1, 2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategies", "pdfleet,magic"], "unknown strategy magic"),
        (["--rate", "0"], "--rate must be > 0"),
        (["--spec", "/nonexistent.yaml"], "--spec: cannot read"),
        (["--seeds", "0"], "--seeds must be >= 1"),
        (["--regime", "tpu"], "invalid choice"),
        (["--figure", "x.png"], "--figure and --out go with --matrix"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(argv, message, capsys):
    try:
        code = main(["sim", "--duration", "60", *argv])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err


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
    argv = [
        "sim",
        "--regime",
        "cpu",
        "--duration",
        "300",
        "--rate",
        "2",
        "--strategies",
        "pdfleet,hpa",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Targets of the pdfleet policy" in out and "issue" not in out.lower()
