"""The onset bound: what a surge's start costs a policy that cannot see it coming.

B* knows the whole trace: it starts a surge's replicas a cold start before the
surge needs them. A policy learns of a surge only once it has begun, and a
replica it requests then serves a cold start later. So until ``onset + cold
start`` (plus however long the policy takes to tell the surge from noise), a
surge meets only the capacity the fleet held before it; whatever the policy
does afterwards.

The onset bound is the most favourable schedule under that constraint: B*'s
needs (at B*'s sizing), except that in ``[onset, onset + cold start + delay)``
each surge gets no more than the count before it, and a standing floor of
``(1 + headroom)`` times the load before the first surge everywhere; the
cheapest schedule with those needs (:func:`.bstar.cheapest_schedule`), played
in the simulator. It knows each surge's whole course the moment it starts and
loses nothing to noise, so no causal policy with the same standing capacity
does better. :func:`onset_bound` finds the least standing headroom at which
it meets >= 99% TTFT and ITL: a policy that meets the SLO on a bursty trace
must hold at least that much room at every moment a surge may start, on
every trace it cannot yet tell from a bursty one.

The first surge is the sharper case. Before it, a bursty trace looks like a
steady one, and on a steady trace the cost target (1.10x B*) leaves a policy
at most ``STEADY_ROOM`` of standing room. ``first_surge`` is the onset bound
with only the first surge blind and that room (or none) before it; every
later surge is met with perfect foresight. Where it misses 99%, no causal
policy meets both the steady cost target and the SLO on that bursty seed:
whatever it learns from the first surge comes too late for it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from .bstar import MIN_ATTAINMENT, cheapest_schedule, hottest, lower_counts
from .sim import COST_TARGETS, Cell, summary
from .strategies import Sizing, replica_needs

# The standing headrooms tried (shares of the load before the first surge).
HEADROOMS = tuple(round(0.1 * i, 2) for i in range(16))  # 0 .. 1.5

# The most standing room a policy can hold on a steady trace within its cost
# target (as a share of the load).
STEADY_ROOM = round(COST_TARGETS["steady"] - 1, 2)


def onset_needs(need: Sequence[int], onsets: Sequence[int], blind: int, floor: int) -> list[int]:
    """``need`` per period with each surge (starting in period ``onsets[k]``)
    capped at the count before it for ``blind`` periods, and ``floor`` under
    everything."""
    out = [max(n, floor) for n in need]
    for start in onsets:
        before = max(need[max(start - 1, 0)], floor)
        for b in range(start, min(start + blind, len(out))):
            out[b] = min(out[b], before)
    return out


def onset_bound(cell: Cell, sizing: Sizing, delay_seconds: float = 0.0) -> dict[str, Any] | None:
    """The least standing headroom (on :data:`HEADROOMS`) at which the onset
    bound meets the SLOs on ``cell``'s surges, with its simulated figures,
    and the figures with no headroom at all. None for a trace without
    surges."""
    onsets_s = [b.start for b in cell.trace.bursts if b.start < cell.config.duration_seconds]
    if not onsets_s:
        return None
    period = cell.period
    lead = int(cell.model.cold_start_seconds // period)
    bins = cell.load.bins - 2
    needs = replica_needs(cell.load, cell.model, cell.spec, sizing)
    onsets = [int(s // period) for s in onsets_s]
    first = onsets[0]
    blind = lead + 1 + math.ceil(delay_seconds / period)
    base = [int(statistics.median(n[: max(first, 1)])) for n in needs]
    tried: dict[float, dict[str, Any]] = {}

    def play(headroom: float, blinded: Sequence[int]) -> dict[str, Any]:
        schedules = []
        for i, role in enumerate(("prefill", "decode")):
            scaling = cell.spec.role(role)
            floor = math.ceil(base[i] * (1 + headroom) - 1e-9)
            lower = lower_counts(onset_needs(needs[i], blinded, blind, floor), lead)[:bins]
            schedules.append(
                cheapest_schedule(
                    lower,
                    cell.start[i],
                    scaling.max_scale_up_step,
                    scaling.max_scale_down_step,
                )
            )
        result = summary(cell.schedule(schedules[0], schedules[1]))
        return {"headroom": headroom, **_brief(result), "schedule": schedules}

    def run(headroom: float) -> dict[str, Any]:
        if headroom not in tried:
            tried[headroom] = play(headroom, onsets)
            del tried[headroom]["schedule"]
        return tried[headroom]

    def passes(headroom: float) -> bool:
        r = run(headroom)
        return bool(r["met"])

    # Less headroom must not pass where more fails: search from the top down.
    grid = [-h for h in reversed(HEADROOMS)]
    found = hottest(grid, lambda h: passes(-h), grid.index(-0.5))
    none = run(0.0)
    first_surge = {
        "blind_periods": blind,
        "at_steady_room": play(STEADY_ROOM, [first]),
        "without_headroom": play(0.0, [first]),
    }
    return {
        "sizing": {
            "prefill_utilization": sizing.prefill_utilization,
            "decode_kv_usage": sizing.decode_kv_usage,
        },
        "delay_seconds": delay_seconds,
        "base": {"prefill": base[0], "decode": base[1]},
        "onsets": onsets_s,
        "least": None if found is None else tried[-found],
        "without_headroom": none,
        "tried": sorted(tried.values(), key=lambda r: r["headroom"]),
        "first_surge": first_surge,
    }


def _brief(result: dict[str, Any]) -> dict[str, Any]:
    return {
        "replica_seconds": result["replica_seconds"]["total"],
        "ttft_attainment": result["ttft_attainment"],
        "itl_attainment": result["itl_attainment"],
        "met": result["ttft_attainment"] >= MIN_ATTAINMENT
        and result["itl_attainment"] >= MIN_ATTAINMENT,
    }
