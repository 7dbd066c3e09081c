"""The cost-bounded surge ceiling: its bounded schedule against brute force,
its family's blind windows and climbs on a small burst cell, and its search
(the least climb, the cheapest member) on a played-out stand-in for the
simulator and on the simulator itself."""

from __future__ import annotations

import itertools
import random

import pytest
from helpers.autoscaling import binding_fleet

from pdfleet.operator.autoscaling_lab.cost_ceiling import (
    Search,
    Shape,
    bounded_schedule,
    cheapest,
    family_schedule,
    least_hold,
    play,
)
from pdfleet.operator.autoscaling_lab.sim import Cell
from pdfleet.operator.autoscaling_lab.strategies import Sizing
from pdfleet.operator.autoscaling_lab.traces import TraceConfig


def _keeps(s, low, upper, start, up, down) -> bool:
    if s[0] != start:
        return False
    for t in range(1, len(s)):
        d = s[t] - s[t - 1]
        if d > up or -d > down:
            return False
        if upper[t] is not None and s[t] > upper[t]:
            return False
        if s[t] < low[t]:
            return False
    return True


def test_the_bounded_schedule_is_the_cheapest_that_keeps_both_bounds():
    rng = random.Random(3)
    checked = 0
    for _ in range(300):
        periods, top = rng.randint(2, 6), 5
        start = rng.randint(0, top)
        up, down = rng.randint(1, 3), rng.randint(1, 3)
        low = [rng.randint(0, top) for _ in range(periods)]
        given = [rng.choice([None, rng.randint(0, top)]) for _ in range(periods)]
        # What the schedule must keep: the upper bounds, and the lower ones
        # only as far as the upper bounds and the steps let it reach.
        reach, reachable = start, [start]
        for t in range(1, periods):
            reach = min(reach + up, top if given[t] is None else given[t])
            reachable.append(reach)
        need = [min(a, b) for a, b in zip(low, reachable, strict=True)]
        need[0] = start
        # An upper bound the lower ones leave no time to come down to is
        # raised to the least they force.
        forced, upper = start, list(given)
        for t in range(1, periods):
            forced = max(forced - down, need[t])
            if upper[t] is not None:
                upper[t] = max(upper[t], forced)
        best = None
        for s in itertools.product(range(top + 1), repeat=periods):
            if _keeps(s, need, upper, start, up, down) and (best is None or sum(s) < best):
                best = sum(s)
        if best is None:
            with pytest.raises(ValueError, match="no schedule"):
                bounded_schedule(low, given, start, up, down)
            continue
        got = bounded_schedule(low, given, start, up, down)
        assert _keeps(got, need, upper, start, up, down)
        assert sum(got) == best
        checked += 1
    assert checked > 100


@pytest.fixture(scope="module")
def small_cell():
    # A small fleet whose SLOs bind, two surges in ten minutes, each at its
    # full rate from its onset (a schedule with foresight would ramp up
    # before it).
    model, spec = binding_fleet()
    config = TraceConfig(
        kind="burst",
        duration_seconds=600,
        base_rate=10,
        burst_every_seconds=300,
        burst_factor=(4.0, 4.0),
        burst_ramp_seconds=0.0,
        prompt_tokens_mean=1000,
        prompt_tokens_max=3000,
        seed=1,
    )
    return Cell(config, model, spec), Sizing(1.0, 0.8)


def test_every_surge_is_blind_until_it_begins_then_climbs_for_the_hold(small_cell):
    cell, sizing = small_cell
    shape = Shape(room=1.0, room_later=2.0, hold=3)
    built = family_schedule(cell, sizing, shape)
    assert len(built["onsets"]) >= 2
    lead = int(cell.model.cold_start_seconds // cell.period)
    for role in ("prefill", "decode"):
        scaling = cell.spec.role(role)
        schedule = built["schedule"][role]
        for onset, before in zip(built["onsets"], built["before"][role], strict=True):
            first = int(onset // cell.period)
            # Nothing paid from a cold start before the surge's period to
            # that period serves more than was ready before it (or than an
            # earlier climb has had the time to shed) ...
            ahead = max(first - lead - 1, 0)
            for s in range(ahead + 1, first + 1):
                shed = schedule[ahead] - scaling.max_scale_down_step * (s - ahead)
                assert schedule[s] <= max(before, shed)
            # ... then every replica the step allows, for the hold.
            for j in range(1, shape.hold + 1):
                if first + j < len(schedule):
                    want = min(before + scaling.max_scale_up_step * j, scaling.max_replicas)
                    assert schedule[first + j] >= want
        # The room after the first surge is twice the room before it.
        base, room = built["base"][role], built["room"][role]
        first = int(built["onsets"][0] // cell.period)
        assert min(schedule[1:first]) >= base * (1 + room) - 1
        later = [c for k, c in enumerate(schedule) if k > first + lead]
        assert min(later) >= base * (1 + 2 * room) - 1


def test_the_least_hold_is_the_first_that_meets_and_the_search_keeps_the_cheapest(small_cell):
    cell, sizing = small_cell

    # A stand-in for the simulator: attainment grows with what is paid.
    def run(p, d, need):
        paid = sum(p) + sum(d)
        return {
            "ttft_attainment": 0.99 if paid >= need else 0.98,
            "itl_attainment": 1.0,
            "replica_seconds": {"total": paid * cell.period},
        }

    costs = {
        h: sum(
            sum(c) for c in family_schedule(cell, sizing, Shape(1.0, 1.0, h))["schedule"].values()
        )
        for h in range(9)
    }
    assert costs[3] > costs[2]
    search = Search()
    got = least_hold(cell, sizing, 1.0, 1.0, 8, search, run=lambda p, d: run(p, d, costs[3]))
    assert got == 3
    assert search.best is not None and search.best.shape.hold == 3
    assert all(t.met == (t.shape.hold >= 3) for t in search.tried)
    # Nothing meets: None, after trying only the longest climb.
    search = Search()
    assert least_hold(cell, sizing, 1.0, 1.0, 8, search, run=lambda p, d: run(p, d, 10**9)) is None
    assert [t.shape.hold for t in search.tried] == [8]
    # Across rooms, the cheapest member that met is kept.
    found = cheapest(cell, sizing, rooms_later=(1.0, 2.0), run=lambda p, d: run(p, d, costs[3]))
    assert found.best is not None
    assert found.best.replica_seconds == min(t.replica_seconds for t in found.tried if t.met)


def test_a_member_is_played_in_the_simulator_as_built(small_cell):
    cell, sizing = small_cell
    search = Search()
    tried = play(cell, sizing, Shape(1.0, 1.0, 2), search)
    again = cell.schedule(tried.schedule["prefill"], tried.schedule["decode"])
    assert again.replica_seconds["total"] == pytest.approx(tried.replica_seconds)
    assert again.ttft_attainment == pytest.approx(tried.ttft)
    # Played once per shape.
    assert play(cell, sizing, Shape(1.0, 1.0, 2), search) is tried
    with pytest.raises(ValueError, match="hold"):
        family_schedule(cell, sizing, Shape(hold=-1))
