"""B*: the cheapest perfect-foresight schedule the simulator shows meets the SLOs.

Per matrix cell (a trace and a seed), B* is found by search:

1. A **sizing** (:class:`.strategies.Sizing`: prefill at a share of its
   compute, decode at a share of its KV) turns the trace into the replicas
   each role needs per period (:func:`.strategies.replica_needs`).
2. The **cheapest schedule** with those needs (:func:`cheapest_schedule`):
   a replica serves a cold start after it is requested and is paid from the
   request, so the count paid in period ``s`` must cover the most needed in
   ``s .. s + lead`` (:func:`lower_counts`); it moves within the spec's
   steps per period, from the count every strategy starts at. Dynamic
   programming; among equally cheap schedules the one with the fewest scale
   events.
3. The schedule is **played in the simulator** (:class:`.strategies.ScheduleStrategy`),
   which says whether it meets >= 99% TTFT and >= 99% ITL and what it
   really costs (drains included).

The search (:func:`search`) runs over a grid of sizings per role: each
role's hottest sizing that passes with the other role generous (a binary
search), then the cheapest passing combination at or below both, best-first
by the schedules' cost, assuming that a sizing hotter in both roles than one
that failed fails too. B* is the cheapest schedule found that passes; every
candidate simulated is kept with its figures, so a claim that a target is out
of reach is made against a simulated schedule, never against a sizing rule.

**B*'s fewest-events schedule** (:func:`fewest_events_schedule`): at B*'s
sizing, the schedule with the fewest scale events per role whose cost is
within :data:`FEWEST_EVENTS_SLACK` of B*'s schedule for that role (exact, by
dynamic programming over events x count); it is simulated too. The slack
removes the moves that follow a single period's noise for a replica-period
or two, which a cheapest schedule makes and no policy should copy.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..autoscaling.spec import AutoscalingSpec
from .sim_fleet import FleetModel
from .strategies import Sizing, TraceLoad, replica_needs

# The sizings searched: shares of compute (prefill) and of KV (decode).
GRID = tuple(round(0.3 + 0.025 * i, 4) for i in range(49))  # 0.3 .. 1.5
# The partner of a role searched alone: generous enough not to be the one
# that misses.
GENEROUS = 0.5
# Where the search starts, per role (an SLO-binding fleet's boundary is
# near; the search gallops away from it either way).
HINT = {"prefill": 1.0, "decode": 0.8}
# B*'s fewest-events schedule may cost this much more than B*, per role.
FEWEST_EVENTS_SLACK = 0.01
MIN_ATTAINMENT = 0.99


def lower_counts(need: Sequence[int], lead: int) -> list[int]:
    """Fewest replicas paid in each period so that ``need[u]`` are ready in
    period ``u``, when a replica serves ``lead`` periods after it is
    requested: the most needed in ``s .. s + lead``."""
    arr = np.asarray(need, dtype=np.int64)
    out = arr.copy()
    for d in range(1, lead + 1):
        out[:-d] = np.maximum(out[:-d], arr[d:])
    return [int(x) for x in out]


def _ramp_cap(lower: Sequence[int], start: int, up: int) -> np.ndarray:
    """``lower`` where it is reachable from ``start`` within ``up`` a period
    (period 0 is ``start`` itself)."""
    arr = np.asarray(lower, dtype=np.int64).copy()
    arr[0] = start
    return np.minimum(arr, start + up * np.arange(len(arr)))


INF = np.iinfo(np.int64).max // 4
# A schedule's cost is its sum of counts; the events break ties.
_TIE = 1 << 20


def _moves(up: int, down: int) -> list[int]:
    return [d for d in range(-down, up + 1) if d != 0]


def _shift(values: np.ndarray, d: int, fill: int) -> np.ndarray:
    """``out[..., c] = values[..., c - d]`` (``fill`` where out of range)."""
    out = np.full_like(values, fill)
    if d > 0:
        out[..., d:] = values[..., :-d]
    elif d < 0:
        out[..., :d] = values[..., -d:]
    else:
        out[...] = values
    return out


def cheapest_schedule(lower: Sequence[int], start: int, up: int, down: int) -> list[int]:
    """The schedule with the least sum of counts that starts at ``start``
    (period 0), has at least ``lower[t]`` in every later period (where
    reachable from ``start``), moves at most ``up`` up and ``down`` down a
    period, and among those the fewest changes.

    Counts above ``max(lower)`` (or ``start``) never help: clipping a
    schedule there removes changes and shortens steps."""
    if up < 1 or down < 1:
        raise ValueError(f"steps must be >= 1, got up {up}, down {down}")
    low = _ramp_cap(lower, start, up)
    top = int(max(low.max(), start))
    counts = np.arange(top + 1, dtype=np.int64)
    value = np.full(top + 1, INF, dtype=np.int64)
    value[start] = start * _TIE
    choice = np.zeros((len(low), top + 1), dtype=np.int64)
    for t in range(1, len(low)):
        best, arg = value.copy(), counts.copy()
        for d in _moves(up, down):
            cand = _shift(value, d, INF)
            cand = np.where(cand < INF, cand + 1, INF)
            better = cand < best
            best = np.where(better, cand, best)
            arg = np.where(better, counts - d, arg)
        best[: low[t]] = INF
        best = np.where(best < INF, best + counts * _TIE, INF)
        value, choice[t] = best, arg
    c = int(np.argmin(value))
    out = [c]
    for t in range(len(low) - 1, 0, -1):
        c = int(choice[t][c])
        out.append(c)
    return out[::-1]


def events(counts: Sequence[int]) -> int:
    """Periods in which the count changes (as the simulator counts them)."""
    return sum(1 for a, b in itertools.pairwise(counts) if a != b)


def fewest_events_schedule(
    lower: Sequence[int], start: int, up: int, down: int, budget: float, max_events: int
) -> tuple[list[int] | None, list[float]]:
    """The schedule with the fewest changes whose sum of counts is at most
    ``budget``, with the constraints of :func:`cheapest_schedule` (None when
    none with at most ``max_events`` changes is within the budget); and the
    frontier: the least sum of counts with at most ``k`` changes, for ``k``
    = 0 .. ``max_events`` (``inf`` where none). Dynamic programming over
    (changes so far, count)."""
    low = _ramp_cap(lower, start, up)
    top = int(max(low.max(), start))
    layers = max_events + 1
    counts = np.arange(top + 1, dtype=np.int64)
    value = np.full((layers, top + 1), INF, dtype=np.int64)
    value[0, start] = start
    moves = _moves(up, down)
    # choice[t, k, c]: the move that reached (k, c) in period t (0: stayed).
    choice = np.zeros((len(low), layers, top + 1), dtype=np.int8)
    for t in range(1, len(low)):
        best = value.copy()
        arg = np.zeros((layers, top + 1), dtype=np.int8)
        prev = np.full_like(value, INF)
        prev[1:] = value[:-1]  # a move uses one change more
        for d in moves:
            cand = _shift(prev, d, INF)
            better = cand < best
            best = np.where(better, cand, best)
            arg = np.where(better, d, arg)
        best[:, : low[t]] = INF
        best = np.where(best < INF, best + counts, INF)
        value, choice[t] = best, arg
    final = np.minimum.accumulate(value.min(axis=1))
    frontier = [float(x) if x < INF else math.inf for x in final]
    within = np.nonzero(final <= budget + 1e-9)[0]
    if not len(within):
        return None, frontier
    # The first k within the budget reaches it at k itself (the minima
    # before it are above the budget).
    k = int(within[0])
    c = int(np.argmin(value[k]))
    out = [c]
    for t in range(len(low) - 1, 0, -1):
        d = int(choice[t, k, c])
        if d:
            c, k = c - d, k - 1
        out.append(c)
    return out[::-1], frontier


# --------------------------------------------------------------------------
# the search


@dataclass
class Candidate:
    """One sizing's schedule, and what the simulator made of it."""

    sizing: Sizing
    schedule: tuple[list[int], list[int]]
    result: dict[str, Any]
    """The simulation's summary (:func:`.sim.summary`)."""

    @property
    def met(self) -> bool:
        return bool(
            self.result["ttft_attainment"] >= MIN_ATTAINMENT
            and self.result["itl_attainment"] >= MIN_ATTAINMENT
        )

    @property
    def cost(self) -> float:
        return float(self.result["replica_seconds"]["total"])

    def brief(self) -> dict[str, Any]:
        r = self.result
        return {
            "prefill_utilization": self.sizing.prefill_utilization,
            "decode_kv_usage": self.sizing.decode_kv_usage,
            "replica_seconds": r["replica_seconds"]["total"],
            "ttft_attainment": r["ttft_attainment"],
            "itl_attainment": r["itl_attainment"],
            "met": self.met,
        }


# Plays a schedule in the simulator: (prefill counts, decode counts) -> summary.
Simulate = Callable[[list[int], list[int]], dict[str, Any]]


@dataclass
class BStar:
    """The search's outcome for one cell."""

    best: Candidate | None
    """The cheapest candidate that met the SLOs (None: none did)."""
    fewest: Candidate | None
    """B*'s fewest-events schedule, simulated."""
    candidates: list[Candidate] = field(default_factory=list)
    frontier: dict[str, dict[str, int | None]] = field(default_factory=dict)
    """Per role: the fewest scale events of a schedule at B*'s sizing whose
    cost is within each multiple of B*'s (``"1.05"`` -> events)."""

    def to_dict(self, schedules: bool = True) -> dict[str, Any]:
        def one(c: Candidate | None) -> dict[str, Any] | None:
            if c is None:
                return None
            out: dict[str, Any] = {
                "sizing": dataclasses.asdict(c.sizing),
                "met": c.met,
                **c.result,
            }
            if schedules:
                out["schedule"] = {"prefill": c.schedule[0], "decode": c.schedule[1]}
            return out

        return {
            "best": one(self.best),
            "fewest_events": one(self.fewest),
            "events_frontier": self.frontier,
            "candidates": [c.brief() for c in self.candidates],
        }


class Searcher:
    """Schedules and their simulations for one cell, each sizing once."""

    def __init__(
        self,
        load: TraceLoad,
        model: FleetModel,
        spec: AutoscalingSpec,
        start: tuple[int, int],
        simulate: Simulate,
    ) -> None:
        self.load, self.model, self.spec, self.start = load, model, spec, start
        self.simulate = simulate
        self.lead = int(model.cold_start_seconds // load.period)
        # Periods of the trace itself (the needs carry two more for the drain).
        self.bins = load.bins - 2
        self._schedules: dict[tuple[str, float], list[int]] = {}
        self.tried: dict[Sizing, Candidate] = {}

    def schedule(self, role: str, share: float) -> list[int]:
        key = (role, share)
        if key not in self._schedules:
            sizing = (
                Sizing(prefill_utilization=share)
                if role == "prefill"
                else Sizing(decode_kv_usage=share)
            )
            needs = replica_needs(self.load, self.model, self.spec, sizing)
            i = 0 if role == "prefill" else 1
            scaling = self.spec.role(role)
            lower = lower_counts(needs[i], self.lead)[: self.bins]
            self._schedules[key] = cheapest_schedule(
                lower, self.start[i], scaling.max_scale_up_step, scaling.max_scale_down_step
            )
        return self._schedules[key]

    def cost(self, role: str, share: float) -> int:
        return sum(self.schedule(role, share))

    def run(self, sizing: Sizing) -> Candidate:
        if sizing not in self.tried:
            p = self.schedule("prefill", sizing.prefill_utilization)
            d = self.schedule("decode", sizing.decode_kv_usage)
            self.tried[sizing] = Candidate(sizing, (p, d), self.simulate(p, d))
        return self.tried[sizing]

    def hottest(self, role: str) -> float | None:
        """The hottest share on :data:`GRID` at which the schedule passes
        with the other role at :data:`GENEROUS` (a galloping search from
        :data:`HINT`; None when even the coolest fails)."""

        def passes(share: float) -> bool:
            sizing = Sizing(share, GENEROUS) if role == "prefill" else Sizing(GENEROUS, share)
            return self.run(sizing).met

        return hottest(GRID, passes, GRID.index(HINT[role]))


def hottest(grid: Sequence[float], passes: Callable[[float], bool], start: int) -> float | None:
    """The largest ``grid`` value that ``passes``, assuming that every value
    below one that passes passes too: probe ``start``, then double the
    stride away from it until the answer flips, then bisect. About
    2 log2(distance) probes; None when ``grid[0]`` fails."""
    lo, hi = -1, len(grid)  # grid[lo] passes, grid[hi] fails (sentinels)
    if passes(grid[start]):
        lo, step = start, 1
        while lo + step < len(grid) and passes(grid[lo + step]):
            lo, step = lo + step, step * 2
        hi = min(lo + step, len(grid))
    else:
        hi, step = start, 1
        while hi - step >= 0 and not passes(grid[hi - step]):
            hi, step = hi - step, step * 2
        lo = max(hi - step, -1)
        if lo < 0 and hi > 0 and passes(grid[0]):
            lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if passes(grid[mid]):
            lo = mid
        else:
            hi = mid
    return grid[lo] if lo >= 0 else None


def search(searcher: Searcher, fewest_slack: float = FEWEST_EVENTS_SLACK) -> BStar:
    """B* for one cell (module docstring)."""
    u_top = searcher.hottest("prefill")
    k_top = searcher.hottest("decode")
    best: Candidate | None = None
    if u_top is not None and k_top is not None:
        us = [u for u in GRID if u <= u_top]
        ks = [k for k in GRID if k <= k_top]
        pairs = sorted(
            (
                (searcher.cost("prefill", u) + searcher.cost("decode", k), u, k)
                for u in us
                for k in ks
            ),
            key=lambda x: (x[0], -x[1], -x[2]),
        )
        failed: list[Sizing] = [s for s, c in searcher.tried.items() if not c.met]
        for _, u, k in pairs:
            if any(u >= f.prefill_utilization and k >= f.decode_kv_usage for f in failed):
                continue
            candidate = searcher.run(Sizing(u, k))
            if candidate.met:
                best = candidate
                break
            failed.append(candidate.sizing)
    # The cheapest of everything simulated that passed (a generous partner
    # can, rarely, come out cheaper than the pairs above).
    passed = [c for c in searcher.tried.values() if c.met]
    if passed:
        best = min(passed, key=lambda c: c.cost)
    fewest: Candidate | None = None
    frontier: dict[str, dict[str, int | None]] = {}
    if best is not None:
        fewest, frontier = _fewest(searcher, best, fewest_slack)
    return BStar(best, fewest, list(searcher.tried.values()), frontier)


# The multiples of B*'s cost the events frontier is reported at.
FRONTIER_RATIOS = (1.0, 1.01, 1.05, 1.1, 1.15, 1.3)


def _fewest(
    searcher: Searcher, best: Candidate, slack: float
) -> tuple[Candidate, dict[str, dict[str, int | None]]]:
    schedules = []
    frontier: dict[str, dict[str, int | None]] = {}
    needs = replica_needs(searcher.load, searcher.model, searcher.spec, best.sizing)
    for i, role in enumerate(("prefill", "decode")):
        own = best.schedule[i]
        scaling = searcher.spec.role(role)
        lower = lower_counts(needs[i], searcher.lead)[: searcher.bins]
        fewer, costs = fewest_events_schedule(
            lower,
            searcher.start[i],
            scaling.max_scale_up_step,
            scaling.max_scale_down_step,
            sum(own) * (1 + slack),
            events(own),
        )
        schedules.append(fewer if fewer is not None else own)
        frontier[role] = {
            f"{r:g}": next((k for k, c in enumerate(costs) if c <= sum(own) * r + 1e-9), None)
            for r in FRONTIER_RATIOS
        }
    candidate = Candidate(best.sizing, (schedules[0], schedules[1]), searcher.simulate(*schedules))
    return candidate, frontier
