"""B*: the schedules' dynamic programs against brute force, the needs against
a per-request count, the search on a small cell."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from helpers.autoscaling import binding_fleet

from pdfleet.operator.autoscaling.spec import AutoscalingSpec
from pdfleet.operator.autoscaling_lab.bstar import (
    _ramp_cap,
    cheapest_schedule,
    events,
    fewest_events_schedule,
    hottest,
    lower_counts,
)
from pdfleet.operator.autoscaling_lab.sim import Cell
from pdfleet.operator.autoscaling_lab.sim_fleet import FleetModel
from pdfleet.operator.autoscaling_lab.strategies import Sizing, replica_needs, trace_load
from pdfleet.operator.autoscaling_lab.traces import TraceConfig, make_trace


def _feasible(s, low, start, up, down) -> bool:
    if s[0] != start:
        return False
    for t in range(1, len(s)):
        d = s[t] - s[t - 1]
        if s[t] < low[t] or d > up or -d > down:
            return False
    return True


def test_the_schedules_are_the_cheapest_and_the_fewest_events_of_every_schedule():
    rng = random.Random(1)
    for _ in range(200):
        periods, top = rng.randint(2, 6), 4
        lower = [rng.randint(0, top) for _ in range(periods)]
        start, up, down = rng.randint(0, top), rng.randint(1, 3), rng.randint(1, 2)
        low = list(_ramp_cap(lower, start, up))
        every = [
            s
            for s in itertools.product(range(top + 1), repeat=periods)
            if _feasible(s, low, start, up, down)
        ]
        best = min(every, key=lambda s: (sum(s), events(s)))
        got = cheapest_schedule(lower, start, up, down)
        assert _feasible(got, low, start, up, down)
        assert (sum(got), events(got)) == (sum(best), events(best))
        budget = sum(best) + rng.randint(0, 4)
        fewer, frontier = fewest_events_schedule(lower, start, up, down, budget, events(best))
        assert fewer is not None and _feasible(fewer, low, start, up, down)
        assert sum(fewer) <= budget
        assert events(fewer) == min(events(s) for s in every if sum(s) <= budget)
        for k, cost in enumerate(frontier):
            want = min((sum(s) for s in every if events(s) <= k), default=math.inf)
            assert cost == want


def test_lower_counts_cover_every_need_a_cold_start_ahead():
    assert lower_counts([1, 1, 5, 1, 1, 2], 2) == [5, 5, 5, 2, 2, 2]
    assert lower_counts([3, 1], 0) == [3, 1]


def test_hottest_finds_the_boundary_from_any_start():
    grid = [i / 10 for i in range(20)]
    for edge in range(-1, 20):
        for start in range(20):
            calls = []

            def passes(x, edge=edge, calls=calls):
                calls.append(x)
                return edge >= 0 and x <= grid[edge]

            assert hottest(grid, passes, start) == (grid[edge] if edge >= 0 else None)
            assert len(calls) <= 2 * math.ceil(math.log2(20)) + 2


def test_the_needs_match_a_count_of_every_request():
    model = FleetModel(cold_start_seconds=30)
    spec = AutoscalingSpec.from_spec({r: {"maxReplicas": 500} for r in ("prefill", "decode")})
    trace = make_trace(TraceConfig(kind="burst", duration_seconds=300, base_rate=20, seed=2))
    sizing = Sizing(0.9, 0.6)
    p_need, d_need = replica_needs(trace_load(trace, model, 15.0), model, spec, sizing)
    # The same sums, request by request.
    bins = len(p_need)
    work, kv, seqs = [0.0] * bins, [0.0] * bins, [0.0] * bins
    n = len(trace)
    mean_kv = (
        sum(p + o / 2 for p, o in zip(trace.prompt_tokens, trace.output_tokens, strict=False)) / n
    )
    context = sizing.decode_kv_usage * model.kv_capacity_tokens
    step = model.step_seconds(min(context / mean_kv, model.max_num_seqs), context)
    for t, p, o in zip(trace.arrivals, trace.prompt_tokens, trace.output_tokens, strict=False):
        prefill = model.prefill_seconds(p)
        work[min(int(t // 15), bins - 1)] += prefill
        start = t + prefill + p * model.transfer_seconds_per_token
        end = start + o * step
        for b in range(bins):
            overlap = min(end, (b + 1) * 15) - max(start, b * 15)
            if overlap > 0:
                kv[b] += (p + o / 2) * overlap
                seqs[b] += overlap
    for b in range(bins):
        assert p_need[b] == max(1, math.ceil(work[b] / 15 / 0.9 - 1e-9))
        want = max(
            math.ceil(kv[b] / 15 / context - 1e-9),
            math.ceil(seqs[b] / 15 / model.max_num_seqs - 1e-9),
        )
        assert d_need[b] == max(1, want)


def test_a_schedule_is_played_as_given():
    model = FleetModel(cold_start_seconds=30)
    spec = AutoscalingSpec.from_spec({})
    cell = Cell(TraceConfig(kind="steady", duration_seconds=120, base_rate=5), model, spec)
    prefill = [2, 3, 3, 1, 1, 2, 2, 2, 2]
    decode = [1, 1, 2, 2, 2, 2, 1, 1, 1]
    result = cell.schedule(prefill, decode)
    for t, p, d, _ in result.timeline:
        i = round(t / 15)
        assert (p, d) == (prefill[i], decode[i])


@pytest.fixture(scope="module")
def small_bstar():
    # A small fleet whose SLOs bind: B* is found by simulating schedules.
    model, spec = binding_fleet()
    config = TraceConfig(
        kind="burst",
        duration_seconds=600,
        base_rate=10,
        burst_every_seconds=300,
        prompt_tokens_mean=1000,
        prompt_tokens_max=3000,
        seed=1,
    )
    cell = Cell(config, model, spec)
    return cell, cell.bstar()


def test_bstar_is_the_cheapest_candidate_that_met_the_slos(small_bstar):
    cell, found = small_bstar
    best = found.best
    assert best is not None and best.met
    assert best.result["ttft_attainment"] >= 0.99 and best.result["itl_attainment"] >= 0.99
    assert all(c.cost >= best.cost for c in found.candidates if c.met)
    # Some hotter sizing missed: the SLOs bind in this fleet.
    assert any(not c.met for c in found.candidates)
    # Its schedule, played again, gives the same figures (the search's
    # simulations are the proof of its claims).
    again = cell.schedule(*best.schedule)
    assert again.replica_seconds["total"] == pytest.approx(best.cost)


def test_bstars_fewest_events_schedule_costs_at_most_one_percent_more(small_bstar):
    _, found = small_bstar
    best, fewest = found.best, found.fewest
    assert fewest is not None and fewest.sizing == best.sizing
    for i in range(2):
        assert events(fewest.schedule[i]) <= events(best.schedule[i])
        assert sum(fewest.schedule[i]) <= sum(best.schedule[i]) * 1.01 + 1e-9
    frontier = found.frontier
    assert frontier["prefill"]["1.01"] == events(fewest.schedule[0])
    assert frontier["decode"]["1.3"] <= frontier["decode"]["1.01"]


def test_the_first_surge_ceiling_is_blind_only_until_a_cold_start_after_the_first_surge(
    small_bstar,
):
    from pdfleet.operator.autoscaling_lab.ceiling import STEADY_ROOM, first_surge_ceiling

    cell, found = small_bstar
    ceiling = first_surge_ceiling(cell, found.best.sizing)
    assert ceiling is not None
    period, lead = cell.period, int(cell.model.cold_start_seconds // cell.period)
    first = int(ceiling["onset"] // period)
    base = ceiling["base"]
    for role in ("prefill", "decode"):
        scaling = cell.spec.role(role)
        schedule = ceiling["schedule"][role]
        # Each role gets the whole steady budget as room before the surge.
        assert ceiling["room"][role] == pytest.approx(STEADY_ROOM * sum(base.values()) / base[role])
        # Nothing requested in the surge's period knows of it ...
        assert schedule[first] <= max(schedule[max(first - lead - 1, 0) : first])
        # ... and from the next period on, every replica the steps allow.
        for k in range(first + 1, len(schedule)):
            step = min(schedule[k - 1] + scaling.max_scale_up_step, scaling.max_replicas)
            assert schedule[k] == step
    # The schedule given is the one simulated.
    again = cell.schedule(ceiling["schedule"]["prefill"], ceiling["schedule"]["decode"])
    assert again.replica_seconds["total"] == pytest.approx(ceiling["replica_seconds"])
    assert again.ttft_attainment == pytest.approx(ceiling["ttft_attainment"])


def test_a_blind_ceiling_holds_the_count_before_the_surge_for_its_blind_periods(small_bstar):
    from pdfleet.operator.autoscaling_lab.ceiling import first_surge_ceiling

    cell, found = small_bstar
    blind = first_surge_ceiling(cell, found.best.sizing, blind=2)
    assert blind is not None and blind["blind_periods"] == 2
    first = int(blind["onset"] // cell.period)
    for role in ("prefill", "decode"):
        scaling = cell.spec.role(role)
        schedule = blind["schedule"][role]
        # Nothing requested until two whole periods of the surge were
        # measured knows of it; then the same climb.
        lead = int(cell.model.cold_start_seconds // cell.period)
        before = max(schedule[max(first - lead - 1, 0) : first])
        assert max(schedule[first : first + 3]) <= before
        k = first + 3
        assert schedule[k] == min(schedule[k - 1] + scaling.max_scale_up_step, scaling.max_replicas)
    with pytest.raises(ValueError, match="blind"):
        first_surge_ceiling(cell, found.best.sizing, blind=-1)
