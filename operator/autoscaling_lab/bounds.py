"""What any schedule could achieve on a trace, given perfect foresight.

The oracle baseline (:class:`.strategies.OracleStrategy`) provisions each
period the most replicas needed over the next cold start: a good schedule,
not the cheapest one. This module computes lower bounds instead: the fewest
replica-seconds of *any* schedule that

* has, in every period, as many ready replicas as the oracle's sizing needs
  (prefill at :data:`.strategies.BASELINE_PREFILL_UTILIZATION`, decode at
  :data:`.strategies.ORACLE_KV_CACHE_USAGE`; :func:`.strategies.replica_needs`).
  A replica ready in period ``u`` was requested a cold start earlier and
  paid since, so the count paid in period ``s`` covers the most needed in
  ``s .. s + floor(cold start / period)`` (:func:`lower_counts`; the oracle
  provisions one period more than that);
* moves within the spec's steps (``maxScaleUpStep`` up, ``maxScaleDownStep``
  down, per period), from the count the simulator starts every strategy at;
* changes its count at most ``k`` times (each period with a change is one
  scale event, as the simulator counts them).

Such a schedule knows the whole trace, starts each replica exactly a cold
start before it is needed and removes it the period its need ends, and pays
nothing for draining: no policy can do better. The matrix
(:mod:`.matrix`) uses it to tell a missed target that no schedule could meet
together with another target from one the policy merely missed: "fewer scale
events than HPA" and "at most 0.7x fixed peak" pull against each other on
smooth traces, since fewer events means holding a level longer or skipping
one (docs/autoscaling.md, "What any schedule could do").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdfleet.operator.autoscaling.spec import AutoscalingSpec

from .sim_fleet import FleetModel
from .strategies import OracleStrategy, replica_needs
from .traces import Trace


def lower_counts(need: Sequence[int], lead: int, bins: int) -> list[int]:
    """Fewest replicas paid in each of ``bins`` periods so that ``need[u]``
    are ready in period ``u``, when a replica serves ``lead`` periods after
    it is requested: the most needed in ``s .. s + lead``."""
    return [max(need[s : s + lead + 1] or need[-1:]) for s in range(bins)]


def cheapest_counts(
    lower: Sequence[int], start: int, max_events: int | None, up_step: int, down_step: int
) -> list[float]:
    """``out[k]``: the least sum of per-period counts of a schedule that starts
    at ``start``, has at least ``lower[t]`` in period ``t``, moves at most
    ``up_step`` up and ``down_step`` down per period, and changes its count
    in at most ``k`` periods (``k`` = 0 .. ``max_events``); ``inf`` where
    no such schedule exists. ``max_events=None``: one entry, any number of
    changes.

    Dynamic programming over (events so far, count). Counts above
    ``max(lower)`` (or ``start``) never help: clipping a schedule at that
    level removes changes and shortens steps, so the search stops there.
    """
    if max_events is not None and max_events < 0:
        raise ValueError(f"max_events must be >= 0, got {max_events}")
    if up_step < 1 or down_step < 1:
        raise ValueError(f"steps must be >= 1, got up {up_step}, down {down_step}")
    inf = math.inf
    top = max([start, *lower])
    layers = 1 if max_events is None else max_events + 1
    change = 0 if max_events is None else 1  # the layer a change moves to
    # best[k][c]: least cost so far ending at count c after k changes.
    best = [[inf] * (top + 1) for _ in range(layers)]
    best[0][start] = 0.0
    for need in lower:
        nxt = [[inf] * (top + 1) for _ in range(layers)]
        for k in range(layers):
            for c, cost in enumerate(best[k]):
                if cost == inf:
                    continue
                if c >= need and cost + c < nxt[k][c]:
                    nxt[k][c] = cost + c
                if k + change >= layers:
                    continue
                after = nxt[k + change]
                for c2 in range(max(need, c - down_step), min(top, c + up_step) + 1):
                    if c2 != c and cost + c2 < after[c2]:
                        after[c2] = cost + c2
        best = nxt
    out, least = [], inf
    for row in best:
        least = min(least, *row)
        out.append(least)
    return out


@dataclass(frozen=True)
class ForesightBound:
    """Least replica-seconds of a perfect-foresight schedule at the oracle's
    sizing (both roles summed), within the spec's steps and with any step:
    with any number of scale events, and with fewer than a given number
    (``inf`` where none exists)."""

    replica_seconds: float
    fewer_events: float
    any_step_replica_seconds: float
    any_step_fewer_events: float

    def to_dict(self) -> dict[str, object]:
        return {
            "replica_seconds": self.replica_seconds,
            "fewer_events_than_hpa": self.fewer_events,
            "any_steps": {
                "replica_seconds": self.any_step_replica_seconds,
                "fewer_events_than_hpa": self.any_step_fewer_events,
            },
        }


def foresight_bound(
    trace: Trace,
    model: FleetModel,
    spec: AutoscalingSpec,
    max_events: int,
    needs: tuple[list[int], list[int]] | None = None,
) -> ForesightBound:
    """The bound on one trace (module docstring). ``max_events`` counts both
    roles' events together (``fewer_events`` allows at most that many). The
    ``any_step_*`` figures lift the spec's step limits (any move in one
    period): a bound for any policy, whatever its spec. ``needs``: the
    trace's :func:`.strategies.replica_needs`, when the caller has them."""
    if max_events < 0:
        raise ValueError(f"max_events must be >= 0, got {max_events}")
    period = spec.period_seconds
    needs = needs or replica_needs(trace, model, spec)
    lead = int(model.cold_start_seconds // period)
    start = OracleStrategy(needs, period, model.cold_start_seconds + period).at(0.0)
    bins = math.ceil(trace.config.duration_seconds / period - 1e-9)
    lowers = [lower_counts(need, lead, bins) for need in needs]
    figures = []
    for steps in (True, False):
        limited, unlimited = [], []
        for lower, first, role in zip(lowers, start, (spec.prefill, spec.decode), strict=True):
            up = role.max_scale_up_step if steps else max(lower, default=1)
            down = role.max_scale_down_step if steps else max(lower, default=1)
            up, down = max(up, 1), max(down, 1)
            limited.append(cheapest_counts(lower, first, max_events, up, down))
            unlimited.append(cheapest_counts(lower, first, None, up, down)[0])
        within = min(limited[0][k] + limited[1][max_events - k] for k in range(max_events + 1))
        figures += [(unlimited[0] + unlimited[1]) * period, within * period]
    return ForesightBound(*figures)
