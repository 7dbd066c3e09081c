"""The first-surge ceiling: the best any causal schedule does on a surge it
cannot see coming, however much it spends after.

B* (:mod:`.bstar`) knows the whole trace and starts a surge's replicas a
cold start before they are needed. A policy learns of a surge only once it
has begun: whatever it requests then serves a cold start later. Before its
first surge a bursty trace looks like a steady one, and on a steady trace
the cost target (1.10x B*) lets a policy hold at most 10% of B*'s replicas
as standing room.

The ceiling is the most favourable schedule under those two constraints,
played in the simulator:

* before the first surge's period: B*'s own needs (at B*'s sizing, with
  foresight of everything before the surge) with a standing floor of
  ``(1 + room)`` times the load before the surge, where each role's room is
  the *whole* steady budget spent on that role alone (``0.10 x (prefill +
  decode) / role``: more than any policy within the steady target holds on
  both roles at once);
* the requests of the surge's own period and of the cold start before it
  see nothing of it (they stay at the count before);
* from the next period on, each role climbs by the spec's
  ``maxScaleUpStep`` every period up to ``maxReplicas`` and stays there to
  the end: every replica the step limits allow, from the first moment a
  policy could act, so every later surge is met too.

No causal policy within the steady cost target does better on this trace's
SLOs: it holds no more room before the surge, can request no earlier and no
more after it. So where the ceiling misses >= 99% TTFT (or ITL), no policy
meets that SLO on this seed and the steady trace's cost target both; the
matrix counts the policy's miss of that SLO there as proven infeasible. The
ceiling ignores cost (it sits at ``maxReplicas`` after the surge), so it
says nothing about a miss of any other target.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from .bstar import MIN_ATTAINMENT, cheapest_schedule, lower_counts
from .sim import COST_TARGETS, Cell, summary
from .strategies import Sizing, replica_needs

# The standing room the steady trace's cost target leaves, as a share of
# B*'s replicas (both roles together).
STEADY_ROOM = round(COST_TARGETS["steady"] - 1, 2)


def first_surge_ceiling(cell: Cell, sizing: Sizing, blind: int = 0) -> dict[str, Any] | None:
    """The ceiling's simulated figures and schedule (module docstring); None
    for a trace without surges.

    ``blind``: periods after the surge's own during which the schedule still
    holds the count before it (0, the matrix's proof: it climbs from the
    first period a policy could act in). A causal policy must see a surge in
    its measured rate before it can tell it from noise: with ``blind`` 1 it
    climbs once one whole period of the surge has been measured, with 2 once
    two have. Those are not proofs (a policy may bet on less evidence); they
    say how much of the ceiling's attainment rests on reacting to a surge
    before its rate stands out."""
    if blind < 0:
        raise ValueError(f"blind must be >= 0 periods, got {blind}")
    onsets = [b.start for b in cell.trace.bursts if b.start < cell.config.duration_seconds]
    if not onsets:
        return None
    period = cell.period
    lead = int(cell.model.cold_start_seconds // period)
    bins = cell.load.bins - 2
    first = int(onsets[0] // period)
    needs = replica_needs(cell.load, cell.model, cell.spec, sizing)
    base = [max(int(statistics.median(n[: max(first, 1)])), 1) for n in needs]
    rooms = [STEADY_ROOM * sum(base) / b for b in base]
    schedules = []
    for i, role in enumerate(("prefill", "decode")):
        scaling = cell.spec.role(role)
        floor = math.ceil(base[i] * (1 + rooms[i]) - 1e-9)
        need = [max(n, floor) for n in needs[i]]
        before = need[max(first - 1, 0)]
        # A request serves ``lead`` periods later: those of periods up to and
        # including the surge's own (and the blind ones after it) see only
        # the count before it.
        for k in range(first, min(first + blind + lead + 1, len(need))):
            need[k] = min(need[k], before)
        head = cheapest_schedule(
            lower_counts(need, lead)[: first + blind + 1],
            cell.start[i],
            scaling.max_scale_up_step,
            scaling.max_scale_down_step,
        )
        schedule = list(head)
        while len(schedule) < bins:
            schedule.append(min(schedule[-1] + scaling.max_scale_up_step, scaling.max_replicas))
        schedules.append(schedule[:bins])
    result = summary(cell.schedule(schedules[0], schedules[1]))
    return {
        "by": "first_surge_ceiling",
        "onset": onsets[0],
        "blind_periods": blind,
        "base": {"prefill": base[0], "decode": base[1]},
        "room": {"prefill": rooms[0], "decode": rooms[1]},
        "ttft_attainment": result["ttft_attainment"],
        "itl_attainment": result["itl_attainment"],
        "replica_seconds": result["replica_seconds"]["total"],
        "met": result["ttft_attainment"] >= MIN_ATTAINMENT
        and result["itl_attainment"] >= MIN_ATTAINMENT,
        "schedule": {"prefill": schedules[0], "decode": schedules[1]},
    }
