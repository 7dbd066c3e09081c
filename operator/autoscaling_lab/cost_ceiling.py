"""The cost-bounded surge ceiling: the cheapest schedule found that meets the
SLOs on a burst trace when no surge can be seen before it begins.

The first-surge ceiling (:mod:`.ceiling`) proves only what no causal policy
reaches whatever it spends: it sits at ``maxReplicas`` after the first
surge. This one asks what meeting >= 99% TTFT and ITL *costs* under the same
blindness, against the burst cost target (1.30x B*). Its family of
schedules, per role, built from B*'s own needs (B*'s sizing, foresight of
everything that is not a surge's onset):

* a standing **room** over the load before the first surge, ``room`` times
  the first-surge ceiling's (the whole steady budget on each role, the most
  a policy within the steady cost target holds), until the first surge; from
  its onset on, ``room_later`` times that (after one surge a policy may hold
  more: the trace no longer looks steady);
* **every** surge blind: what is paid from a cold start before its period
  to its period (and ``blind`` periods after) is at most the count ready
  just before it, so nothing serves the surge before a policy could have
  asked for it;
* after each surge's blind window, a **climb** of ``maxScaleUpStep`` a
  period for ``hold`` periods (capped at ``maxReplicas``), the ceiling's
  climb cut short; then B*'s needs again, coming down within the steps.

Within those bounds the count is the cheapest that covers the needs a cold
start ahead (:func:`bounded_schedule`, dynamic programming), and each
candidate is played in the simulator. :func:`cheapest` searches, per room
after the first surge, the least ``hold`` that meets the SLOs by bisection,
which assumes that a longer climb never lowers attainment. The simulator
does not always bear that out, so the result is the cheapest member
*found*, not one shown to be the family's cheapest, and a family that
meets nothing proves nothing: the members know more than a causal policy
(B*'s needs after each blind window) but take fewer shapes (B*'s sizing,
whole-step climbs, a few rooms). Where a member meets both SLOs within the
cost target, blindness to the onsets and the steady room bound alone do
not make the target infeasible.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .bstar import INF, MIN_ATTAINMENT, lower_counts
from .ceiling import STEADY_ROOM
from .sim import Cell, summary
from .strategies import Sizing, replica_needs

ROLES = ("prefill", "decode")


def bounded_schedule(
    lower: Sequence[int], upper: Sequence[int | None], start: int, up: int, down: int
) -> list[int]:
    """The schedule with the least sum of counts that starts at ``start``
    (period 0), moves at most ``up`` up and ``down`` down a period, stays at
    or below ``upper[t]`` (None: no bound) and at or above ``lower[t]``
    wherever that is reachable under the upper bounds. An upper bound that
    the lower bounds before it leave no time to come down to is raised to
    the least count they force there (in the family: replicas of an earlier
    climb not yet shed). ValueError where no schedule keeps the bounds."""
    if up < 1 or down < 1:
        raise ValueError(f"steps must be >= 1, got up {up}, down {down}")
    if len(lower) != len(upper):
        raise ValueError("lower and upper bounds must cover the same periods")
    n = len(lower)
    top = int(max(max(lower), start))
    cap = np.array([top if u is None else min(int(u), top) for u in upper], dtype=np.int64)
    cap[0] = start
    # The most reachable in each period under the upper bounds.
    reach = np.empty(n, dtype=np.int64)
    reach[0] = start
    for t in range(1, n):
        reach[t] = min(reach[t - 1] + up, cap[t])
    low = np.minimum(np.asarray(lower, dtype=np.int64), reach)
    low[0] = start
    # An upper bound below what the lower bounds before it force (a count
    # comes down at most ``down`` a period) is raised to that count.
    forced = start
    for t in range(1, n):
        forced = max(forced - down, int(low[t]))
        cap[t] = max(cap[t], forced)
    counts = np.arange(top + 1, dtype=np.int64)
    value = np.full(top + 1, INF, dtype=np.int64)
    value[start] = start
    choice = np.zeros((n, top + 1), dtype=np.int64)
    moves = [d for d in range(-down, up + 1) if d != 0]
    for t in range(1, n):
        best, arg = value.copy(), counts.copy()
        for d in moves:
            cand = np.full_like(value, INF)
            if d > 0:
                cand[d:] = value[:-d]
            else:
                cand[:d] = value[-d:]
            better = cand < best
            best = np.where(better, cand, best)
            arg = np.where(better, counts - d, arg)
        best[: low[t]] = INF
        best[cap[t] + 1 :] = INF
        if not (best < INF).any():
            raise ValueError(f"no schedule keeps the bounds at period {t}")
        best = np.where(best < INF, best + counts, INF)
        value, choice[t] = best, arg
    c = int(np.argmin(value))
    out = [c]
    for t in range(n - 1, 0, -1):
        c = int(choice[t][c])
        out.append(c)
    return out[::-1]


@dataclass(frozen=True)
class Shape:
    """One member of the family (module docstring)."""

    room: float = 1.0
    room_later: float = 1.0
    hold: int = 0
    blind: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "room": self.room,
            "room_later": self.room_later,
            "hold": self.hold,
            "blind": self.blind,
        }


def surge_onsets(cell: Cell) -> list[float]:
    return [b.start for b in cell.trace.bursts if b.start < cell.config.duration_seconds]


def family_schedule(cell: Cell, sizing: Sizing, shape: Shape) -> dict[str, Any]:
    """The schedule of one member: per role its counts, and what bounds it
    (the base load, the rooms, each surge's count before it)."""
    if shape.blind < 0 or shape.hold < 0:
        raise ValueError(f"blind and hold must be >= 0 periods, got {shape}")
    onsets = surge_onsets(cell)
    if not onsets:
        raise ValueError("the trace has no surge")
    period = cell.period
    lead = int(cell.model.cold_start_seconds // period)
    bins = cell.load.bins - 2
    firsts = [int(t // period) for t in onsets]
    needs = replica_needs(cell.load, cell.model, cell.spec, sizing)
    base = [max(int(statistics.median(n[: max(firsts[0], 1)])), 1) for n in needs]
    rooms = [STEADY_ROOM * sum(base) / b for b in base]
    schedules: list[list[int]] = []
    befores: list[list[int]] = []
    for i, role in enumerate(ROLES):
        scaling = cell.spec.role(role)
        floors = [
            math.ceil(base[i] * (1 + r * rooms[i]) - 1e-9) for r in (shape.room, shape.room_later)
        ]
        need = [
            max(int(x), floors[0] if k < firsts[0] else floors[1]) for k, x in enumerate(needs[i])
        ]
        role_before = []
        for f in firsts:
            # The most ready just before the surge: what a policy that held
            # the load before it (and its room) would have.
            before = max(need[max(f - lead, 0) : max(f, 1)])
            role_before.append(before)
            for k in range(f, min(f + shape.blind + lead + 1, len(need))):
                need[k] = min(need[k], before)
        lower = lower_counts(need, lead)[:bins]
        upper: list[int | None] = [None] * bins
        for f, before in zip(firsts, role_before, strict=True):
            for s in range(max(f - lead, 0), min(f + shape.blind + 1, bins)):
                upper[s] = before
            for j in range(1, shape.hold + 1):
                s = f + shape.blind + j
                if s < bins:
                    climb = min(before + scaling.max_scale_up_step * j, scaling.max_replicas)
                    lower[s] = max(lower[s], climb)
        schedules.append(
            bounded_schedule(
                lower,
                upper,
                cell.start[i],
                scaling.max_scale_up_step,
                scaling.max_scale_down_step,
            )
        )
        befores.append(role_before)
    return {
        "onsets": onsets,
        "base": dict(zip(ROLES, base, strict=True)),
        "room": dict(zip(ROLES, rooms, strict=True)),
        "before": dict(zip(ROLES, befores, strict=True)),
        "schedule": dict(zip(ROLES, schedules, strict=True)),
    }


# Plays one member: its schedule's (prefill, decode) counts -> summary.
Play = Callable[[list[int], list[int]], dict[str, Any]]


@dataclass
class Tried:
    shape: Shape
    ttft: float
    itl: float
    replica_seconds: float
    schedule: dict[str, list[int]]

    @property
    def met(self) -> bool:
        return self.ttft >= MIN_ATTAINMENT and self.itl >= MIN_ATTAINMENT

    def to_dict(self, schedule: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            **self.shape.to_dict(),
            "ttft_attainment": self.ttft,
            "itl_attainment": self.itl,
            "replica_seconds": self.replica_seconds,
            "met": self.met,
        }
        if schedule:
            out["schedule"] = self.schedule
        return out


@dataclass
class Search:
    """Every member played for one cell, and the cheapest that met the SLOs."""

    tried: list[Tried] = field(default_factory=list)

    @property
    def best(self) -> Tried | None:
        met = [t for t in self.tried if t.met]
        return min(met, key=lambda t: t.replica_seconds) if met else None


def play(
    cell: Cell, sizing: Sizing, shape: Shape, search: Search, run: Play | None = None
) -> Tried:
    """Build one member's schedule, simulate it and record it."""
    for t in search.tried:
        if t.shape == shape:
            return t
    built = family_schedule(cell, sizing, shape)
    p, d = built["schedule"]["prefill"], built["schedule"]["decode"]
    result = run(p, d) if run is not None else summary(cell.schedule(p, d))
    tried = Tried(
        shape,
        float(result["ttft_attainment"]),
        float(result["itl_attainment"]),
        float(result["replica_seconds"]["total"]),
        {"prefill": p, "decode": d},
    )
    search.tried.append(tried)
    return tried


def least_hold(
    cell: Cell,
    sizing: Sizing,
    room: float,
    room_later: float,
    most: int,
    search: Search,
    blind: int = 0,
    run: Play | None = None,
) -> int | None:
    """The least ``hold`` in 0 .. ``most`` at which the member with these
    rooms meets the SLOs (None: not even ``most``), by bisection: ``most``
    first, then halving (assumes a longer climb never lowers attainment)."""

    def meets(hold: int) -> bool:
        return play(cell, sizing, Shape(room, room_later, hold, blind), search, run).met

    if not meets(most):
        return None
    lo, hi = -1, most  # lo fails (or is below the range), hi meets
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid
    return hi


# The rooms after the first surge searched, in multiples of the first-surge
# ceiling's, and the longest climb (periods).
ROOMS_LATER = (1.0, 2.0, 3.0)
MOST_HOLD = 8


def paid(schedule: dict[str, list[int]], period: float) -> float:
    """Replica-seconds a schedule pays before drains: a lower bound of what
    the simulator charges for it."""
    return float(sum(sum(c) for c in schedule.values()) * period)


def cheapest(
    cell: Cell,
    sizing: Sizing,
    rooms_later: Sequence[float] = ROOMS_LATER,
    most: int = MOST_HOLD,
    room: float = 1.0,
    blind: int = 0,
    run: Play | None = None,
) -> Search:
    """The family searched for its cheapest member that meets the SLOs: per
    room after the first surge (ascending), the least climb that meets
    (:func:`least_hold`). A room is skipped where its member without a climb
    already pays, before drains, at least the cheapest found so far (a
    longer climb only adds)."""
    search = Search()
    for later in rooms_later:
        best = search.best
        if best is not None:
            floor = paid(
                family_schedule(cell, sizing, Shape(room, later, 0, blind))["schedule"], cell.period
            )
            if floor >= best.replica_seconds:
                continue
        least_hold(cell, sizing, room, later, most, search, blind, run)
    return search
