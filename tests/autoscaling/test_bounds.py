"""The perfect-foresight bound: the cheapest schedule at the oracle's sizing,
with and without a limit on scale events (operator/autoscaling/bounds.py)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from pdfleet.operator.autoscaling.spec import AutoscalingSpec
from pdfleet.operator.autoscaling_lab.bounds import cheapest_counts, foresight_bound, lower_counts
from pdfleet.operator.autoscaling_lab.sim import compare
from pdfleet.operator.autoscaling_lab.sim_fleet import FleetModel
from pdfleet.operator.autoscaling_lab.traces import TraceConfig, make_trace


def brute_force(lower, start, max_events, up, down):
    """Every schedule of counts 0..top, checked one by one."""
    top = max([start, *lower])
    best = [math.inf] * (max_events + 1)
    for counts in itertools.product(range(top + 1), repeat=len(lower)):
        prev, changes, ok = start, 0, True
        for c, need in zip(counts, lower, strict=True):
            if c < need or c - prev > up or prev - c > down:
                ok = False
                break
            changes += c != prev
            prev = c
        if ok and changes <= max_events:
            for k in range(changes, max_events + 1):
                best[k] = min(best[k], sum(counts))
    return best


def test_a_replica_is_paid_from_its_request_until_the_need_it_was_started_for():
    # Needed in periods 6 and 7, ready 4 periods after the request: paid from
    # period 2 on, through the periods before it serves.
    need = [1, 1, 1, 1, 1, 1, 3, 3, 1, 1]
    assert lower_counts(need, 4, 10) == [1, 1, 3, 3, 3, 3, 3, 3, 1, 1]
    assert lower_counts(need, 0, 10) == need
    assert lower_counts(need, 4, 12)[-2:] == [1, 1]  # past the needs: the last one


def test_a_short_peak_costs_more_the_fewer_changes_are_allowed():
    # Up in one step, down one replica per period: 3 changes give the
    # exact fit (1+1+3+3+2+1), 2 hold the peak a period longer, 1 for good.
    lower = [1, 1, 3, 3, 1, 1]
    assert cheapest_counts(lower, 1, 3, up_step=4, down_step=1) == [math.inf, 14, 12, 11]
    assert cheapest_counts(lower, 1, None, up_step=4, down_step=1) == [11]
    # Down at once: two changes reach the exact fit.
    assert cheapest_counts(lower, 1, 2, up_step=4, down_step=4) == [math.inf, 14, 10]
    # One replica up per period: a peak of 4 is climbed to over three periods.
    assert cheapest_counts([1, 1, 1, 4, 1, 1], 1, None, up_step=1, down_step=4) == [12]


def test_the_dynamic_program_agrees_with_trying_every_schedule():
    rng = random.Random(7)
    for _ in range(60):
        length = rng.randint(1, 6)
        lower = [rng.randint(0, 3) for _ in range(length)]
        start = rng.randint(0, 3)
        up, down = rng.randint(1, 3), rng.randint(1, 3)
        events = rng.randint(0, 4)
        want = brute_force(lower, start, events, up, down)
        assert cheapest_counts(lower, start, events, up, down) == want, (lower, start, up, down)
        # Any number of changes: at most one per period.
        anything = brute_force(lower, start, length, up, down)[-1]
        assert cheapest_counts(lower, start, None, up, down) == [anything]


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="max_events"):
        cheapest_counts([1], 1, -1, 1, 1)
    with pytest.raises(ValueError, match="steps"):
        cheapest_counts([1], 1, 1, 0, 1)


def test_the_oracles_own_run_costs_at_least_the_bound():
    # The oracle provisions the load's needs a cold start ahead: it is one of
    # the schedules the bound ranges over (with no step limits), so no bound
    # may exceed what it paid, with its own number of events or any number.
    spec = AutoscalingSpec.from_spec(
        {"prefill": {"maxReplicas": 16}, "decode": {"maxReplicas": 16}}
    )
    trace = make_trace(TraceConfig(kind="diurnal", duration_seconds=1800, base_rate=8, seed=3))
    model = FleetModel(cold_start_seconds=45)
    oracle = compare(trace, model, spec, ("oracle",), seed=3)["oracle"]
    events = oracle.scale_events["total"]
    bound = foresight_bound(trace, model, spec, events)
    paid = oracle.replica_seconds["total"]
    assert bound.any_step_replica_seconds <= paid
    assert bound.any_step_fewer_events <= paid
    # Fewer events can only cost more; the spec's one-replica scale-down step too.
    fewer = foresight_bound(trace, model, spec, max(events // 3, 1))
    assert fewer.any_step_fewer_events >= bound.any_step_fewer_events
    assert fewer.fewer_events >= bound.fewer_events
    assert bound.replica_seconds >= bound.any_step_replica_seconds
    assert bound.fewer_events >= bound.any_step_fewer_events
    # The bound is tight enough to say something: within a few percent of the
    # oracle, which provisions the most of each cold start's window.
    assert bound.any_step_replica_seconds >= 0.9 * paid
