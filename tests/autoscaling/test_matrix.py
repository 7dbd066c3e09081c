"""The target matrix: each target against B* and the tuned HPA, and the run."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest

from pdfleet.engine.cli import main
from pdfleet.operator.autoscaling_lab.matrix import (
    case_spec,
    cell_targets,
    format_matrix,
    merge,
    misses,
    run_matrix,
    trace_summary,
    trace_targets,
    tune_hpa,
)
from pdfleet.operator.autoscaling_lab.regimes import REGIMES, regime
from pdfleet.operator.autoscaling_lab.replay import boundary_misses, replay_bstar
from pdfleet.operator.autoscaling_lab.sim import Cell


def _result(cost, ttft=0.995, itl=0.999, events=(5, 5), flips=0):
    return {
        "replica_seconds": {"total": cost},
        "ttft_attainment": ttft,
        "itl_attainment": itl,
        "scale_events": {"prefill": events[0], "decode": events[1]},
        "oscillations": {"total": flips},
    }


def _cell(kind="diurnal", cost=110.0, tuned=120.0, case="default", **kw):
    best = {**_result(100.0), "sizing": {"prefill_utilization": 1.0, "decode_kv_usage": 0.8}}
    return {
        "trace": kind,
        "seed": 0,
        "case": case,
        "results": {"pdfleet": _result(cost, **kw), "hpa_tuned": _result(tuned)},
        "bstar": {"best": best, "fewest_events": _result(101.0, events=(4, 3))},
    }


def test_every_target_of_a_cell_is_checked_against_bstar():
    t = cell_targets(_cell(cost=114.0), 3600)
    assert t["vs_bstar"]["met"] and t["vs_bstar"]["value"] == pytest.approx(1.14)
    assert t["ttft_attainment"]["met"] and t["itl_attainment"]["met"]
    assert t["events"]["met"] and t["events"]["value"] == 2  # 5 - 3 on decode
    assert t["no_flap"]["met"] is None  # only on steady load
    assert not cell_targets(_cell(cost=116.0), 3600)["vs_bstar"]["met"]  # 1.15x on diurnal
    assert not cell_targets(_cell(kind="burst", cost=131.0), 3600)["vs_bstar"]["met"]
    assert not cell_targets(_cell(kind="steady", cost=111.0), 3600)["vs_bstar"]["met"]
    assert not cell_targets(_cell(events=(5, 6)), 3600)["events"]["met"]  # 3 more
    assert not cell_targets(_cell(ttft=0.989), 3600)["ttft_attainment"]["met"]
    assert not cell_targets(_cell(kind="steady", cost=105.0, flips=1), 3600)["no_flap"]["met"]


def test_a_cost_target_without_bstar_is_missed():
    cell = _cell()
    cell["bstar"] = {"best": None, "fewest_events": None}
    t = cell_targets(cell, 3600)
    assert t["vs_bstar"]["met"] is False and t["events"]["met"] is False


def test_an_slo_miss_is_proven_infeasible_only_where_the_first_surge_ceiling_misses_too():
    def ceiling(ttft, itl=1.0):
        met = ttft >= 0.99 and itl >= 0.99
        room = {"prefill": 0.2, "decode": 0.2}
        return {
            "room": room,
            "replica_seconds": 300.0,
            "met": met,
            "ttft_attainment": ttft,
            "itl_attainment": itl,
        }

    blind = _cell(kind="burst", ttft=0.97)
    blind["first_surge_ceiling"] = ceiling(0.95)
    t = cell_targets(blind, 3600)
    assert t["ttft_attainment"]["met"] is False
    assert t["ttft_attainment"]["infeasible"]["ttft_attainment"] == 0.95
    assert "infeasible" not in t["itl_attainment"]  # met: nothing to prove
    # The ceiling meets ITL (1.0): the policy's ITL miss is its own.
    both = _cell(kind="burst", ttft=0.97, itl=0.98)
    both["first_surge_ceiling"] = ceiling(0.95)
    t = cell_targets(both, 3600)
    assert "infeasible" in t["ttft_attainment"] and "infeasible" not in t["itl_attainment"]
    # Where the ceiling meets the SLOs, a causal policy could too: a plain miss.
    seen = _cell(kind="burst", ttft=0.97)
    seen["first_surge_ceiling"] = ceiling(0.995)
    assert "infeasible" not in cell_targets(seen, 3600)["ttft_attainment"]
    cells = []
    for c in (blind, seen):
        c["targets"] = cell_targets(c, 3600)
        cells.append(c)
    result = {"cells": cells, "traces": []}
    assert misses(result) == ["default/burst/0: ttft_attainment"]
    assert len(misses(result, proven=True)) == 2
    blind["targets"] = cell_targets(blind, 3600)
    assert misses({"cells": [blind], "traces": []}) == []


def test_the_robustness_cases_need_the_slos_within_1_3x_their_bstar():
    ok = cell_targets(_cell(kind="burst", cost=129.0, case="cold_start_x2"), 3600)
    assert ok["robust"]["met"] and "events" not in ok
    slow = cell_targets(_cell(kind="burst", cost=129.0, ttft=0.98, case="cold_start_x2"), 3600)
    assert not slow["robust"]["met"]
    cells = [_cell(case="cold_start_x2", cost=c) for c in (120, 125, 129, 135, 140)]
    for c in cells:
        c["targets"] = cell_targets(c, 3600)
    assert trace_targets(cells)["robust_seeds"] == {"value": 3, "of": 5, "met": False}


def test_the_policy_must_be_cheaper_than_tuned_hpa_in_the_mean_and_on_most_seeds():
    cells = [_cell(cost=c, tuned=100.0 + 10 * (i > 0)) for i, c in enumerate([105.0] + [100.0] * 9)]
    t = trace_targets(cells)
    assert t["seeds_cheaper_than_hpa_tuned"] == {"value": 9, "of": 10, "met": True}
    assert t["mean_vs_hpa_tuned"]["met"]
    worse = [_cell(cost=115.0, tuned=110.0) for _ in range(10)]
    assert not trace_targets(worse)["mean_vs_hpa_tuned"]["met"]


def test_the_robustness_cases_change_only_what_they_say():
    base = regime("gpu")
    slow = case_spec(base, "burst", 3, "cold_start_x2")
    assert slow.model.cold_start_seconds == 2 * base.model.cold_start_seconds
    fast = case_spec(base, "diurnal", 3, "prefill_rate_+30%")
    assert fast.model.prefill_tokens_per_second == pytest.approx(
        1.3 * base.model.prefill_tokens_per_second
    )
    # The policy is configured with the nominal rate: it is mis-calibrated.
    assert fast.section["prefill"]["prefillTokensPerSecond"] == base.model.prefill_tokens_per_second
    assert fast.key != case_spec(base, "diurnal", 3, "default").key
    with pytest.raises(ValueError, match="unknown case"):
        case_spec(base, "burst", 0, "magic")


def test_the_gpu_regime_is_derived_from_its_published_numbers():
    model = REGIMES["gpu"].model
    # 989 TFLOPS x 55% over 2 FLOPs per parameter of 6.98e9.
    assert model.prefill_tokens_per_second == pytest.approx(38_965, rel=0.001)
    # 128 KiB of KV a token read at 75% of 3.35 TB/s.
    assert model.decode_step_seconds_per_token == pytest.approx(131072 / 2.5125e12)
    assert model.kv_capacity_tokens == 400_000
    # A 2k-token prefill in about 55 ms (attention's quadratic term included).
    assert model.prefill_seconds(2048) == pytest.approx(0.065, abs=0.005)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A small regime a matrix runs in seconds: the CPU fleet, 5 minutes."""
    base = regime("cpu")
    small = dataclasses.replace(
        base, trace=dataclasses.replace(base.trace, duration_seconds=300, base_rate=6)
    )
    cache = str(tmp_path_factory.mktemp("cache"))
    result = run_matrix(small, ["steady"], [0], [0], [], cache=cache)
    return small, cache, result


def test_run_matrix_reports_bstar_tuned_hpa_and_every_target(tiny):
    _, _, result = tiny
    (cell,) = result["cells"]
    assert set(cell["results"]) >= {"pdfleet", "hpa", "hpa_tuned", "fixed"}
    assert cell["bstar"]["best"]["schedule"]["prefill"]
    assert set(cell["targets"]) >= {"ttft_attainment", "vs_bstar", "events", "no_flap"}
    assert result["hpa_tuning"]["steady"]["probes"]
    text = format_matrix(result)
    assert "HPA tuned per trace" in text and "B*" in text and "per trace:" in text
    assert ("all targets met" in text) == result["all_met"]


def test_the_matrix_prints_each_surges_first_surge_ceiling(tiny):
    import copy

    _, _, first = tiny
    result = copy.deepcopy(first)
    result["cells"][0]["first_surge_ceiling"] = {
        "room": {"prefill": 0.2, "decode": 0.25},
        "replica_seconds": 1000.0,
        "ttft_attainment": 0.93,
        "itl_attainment": 1.0,
        "met": False,
    }
    text = format_matrix(result)
    assert "room 20%/25%: 93.00% TTFT, 100.00% ITL" in text


def test_a_rerun_reads_bstar_and_hpa_from_the_cache(tiny):
    small, cache, first = tiny
    entries = {p: p.stat().st_mtime_ns for p in pathlib.Path(cache).rglob("*.json")}
    assert entries
    again = run_matrix(small, ["steady"], [0], [0], [], cache=cache)
    assert again["cells"][0]["bstar"] == json.loads(json.dumps(first["cells"][0]["bstar"]))
    # Nothing computed again: no entry written, none rewritten.
    assert {p: p.stat().st_mtime_ns for p in pathlib.Path(cache).rglob("*.json")} == entries


def test_the_matrix_summary_figure_is_drawn(tiny, tmp_path):
    from helpers.pictures import assert_picture

    from pdfleet.operator.autoscaling_lab.plot import plot_matrix

    _, _, result = tiny
    out = tmp_path / "matrix.png"
    plot_matrix(result, str(out))
    assert_picture(out, (810, 378))


def test_sim_matrix_exits_nonzero_when_a_target_is_missed(tmp_path, capsys):
    argv = [
        "sim",
        "--regime",
        "cpu",
        "--matrix",
        "1",
        "--matrix-traces",
        "steady",
        "--matrix-cases",
        "",
        "--hpa-tune-seeds",
        "0",
        "--duration",
        "300",
        "--rate",
        "6",
        "--cache",
        str(tmp_path),
        "--out",
        str(tmp_path / "m.json"),
    ]
    code = main(argv)
    result = json.loads((tmp_path / "m.json").read_text())
    assert code == (1 if result["unproven_misses"] else 0)
    assert result["unproven_misses"] == misses(result)
    assert "B* sizing" in capsys.readouterr().out


def test_runs_of_one_trace_each_merge_into_one_scored_matrix(tiny):
    import copy

    _, _, first = tiny
    other = copy.deepcopy(first)
    other["cells"][0]["trace"] = "diurnal"
    other["hpa_tuning"] = {"diurnal": other["hpa_tuning"]["steady"]}
    merged = merge([copy.deepcopy(first), other])
    assert [t["trace"] for t in merged["traces"]] == ["diurnal", "steady"]  # the traces' order
    assert set(merged["hpa_tuning"]) == {"steady", "diurnal"}
    # Scored again under the diurnal trace's cost target, not steady's.
    assert merged["cells"][0]["targets"]["vs_bstar"]["limit"] == 1.15
    assert merged["cells"][0]["targets"]["no_flap"]["met"] is None
    assert merged["unproven_misses"] == misses(merged)
    text = format_matrix(merged)
    assert "per trace, over its seeds" in text and "diurnal" in text
    # Seeds merge too; a cell twice, or a different tuned HPA, does not.
    later = copy.deepcopy(first)
    later["seeds"], later["cells"][0]["seed"] = [7], 7
    assert merge([copy.deepcopy(first), later])["seeds"] == [0, 7]
    with pytest.raises(ValueError, match="more than one result"):
        merge([first, copy.deepcopy(first)])
    bad = copy.deepcopy(later)
    bad["hpa_tuning"]["steady"]["targets"] = {"prefill_utilization": 0.1, "decode_kv_usage": 0.1}
    with pytest.raises(ValueError, match="tuned HPA on steady"):
        merge([first, bad])


def test_the_trace_summary_is_each_strategys_cost_over_bstars_and_its_worst_seed():
    cells = [_cell(cost=120.0, tuned=130.0), _cell(cost=110.0, tuned=100.0, ttft=0.98)]
    for c in cells:
        c["results"]["hpa"] = _result(150.0, ttft=0.9)
    s = trace_summary(cells)
    assert s["pdfleet"]["x_bstar"] == pytest.approx(1.15)  # 230 over 200
    assert s["hpa_tuned"]["x_bstar"] == pytest.approx(1.15)
    assert s["hpa"]["x_bstar"] == pytest.approx(1.5)
    assert s["bstar"]["x_bstar"] == pytest.approx(1.0)
    assert s["pdfleet"]["min_ttft_attainment"] == 0.98
    assert (s["pdfleet"]["seeds_meeting_slos"], s["hpa"]["seeds_meeting_slos"]) == (1, 0)


def test_hpa_is_tuned_with_its_other_role_at_the_coolest_target():
    # A fleet where decode above 0.4 KV usage misses ITL whatever prefill
    # does, and prefill above 0.7 busy misses TTFT: tuned, HPA is (0.7, 0.4),
    # not stuck at the coolest prefill by a decode partner that misses.
    def runs(batch):
        out = []
        for _, t in batch:
            ok = t.prefill_utilization <= 0.7 and t.decode_kv_usage <= 0.4
            out.append(
                {
                    "ttft_attainment": 1.0 if t.prefill_utilization <= 0.7 else 0.9,
                    "itl_attainment": 1.0 if ok or t.decode_kv_usage <= 0.4 else 0.9,
                    "replica_seconds": {"total": 1.0},
                }
            )
        return out

    tuned = tune_hpa(regime("cpu"), "steady", [0, 1], runs)
    assert tuned["targets"] == {"prefill_utilization": 0.7, "decode_kv_usage": 0.4}
    assert tuned["met"] is True


def test_an_earlier_bstar_is_kept_only_where_it_replays_exactly(tiny, tmp_path):
    import copy

    small, _, first = tiny
    (cell,) = first["cells"]
    key = (small.name, "steady", 0, "default")
    # A fresh cache (as after a change to the simulator's code): the
    # earlier record replays exactly and is kept, marked as replayed.
    again = run_matrix(
        small, ["steady"], [0], [0], [], cache=str(tmp_path / "a"), prior={key: cell["bstar"]}
    )
    found = again["cells"][0]["bstar"]
    assert found["replayed"][:2] == ["best", "fewest_events"]
    # The failures that rule out hotter sizings were replayed too.
    assert len(found["replayed"]) > 2, found["replayed"]
    assert {k: v for k, v in found.items() if k != "replayed"} == json.loads(
        json.dumps(cell["bstar"])
    )
    # One figure off in the winner's record, or in a boundary miss's: rejected
    # (the matrix then searches B* again).
    spec = case_spec(small, "steady", 0, "default")
    sim_cell = Cell(spec.trace, spec.model, spec.spec())
    forged = copy.deepcopy(cell["bstar"])
    forged["best"]["ttft_attainment"] -= 1e-12
    assert replay_bstar(sim_cell, forged) == (
        None,
        "the winner's simulation differs (ttft_attainment)",
    )
    forged = copy.deepcopy(cell["bstar"])
    (near, *_) = boundary_misses(forged)
    near["replica_seconds"] += 1.0
    found, why = replay_bstar(sim_cell, forged)
    assert found is None and why.endswith("differs (replica_seconds)")
