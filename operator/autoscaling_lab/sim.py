"""``pdfleet sim``: compare autoscaling strategies on a simulated P/D fleet.

A :class:`Cell` is one trace (kind and seed) under one fleet model and spec:
it draws the trace once and runs any strategy over it in the discrete-event
fleet model (:mod:`.sim_fleet`), which runs the autoscaling policy's own code
on snapshots of simulated engine metrics. :func:`compare` runs several
strategies on one cell; :func:`evaluate_targets` checks the policy's result
against the targets of docs/autoscaling.md (:mod:`.matrix` checks them per
seed and trace, with B* and the tuned HPA).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from ..autoscaling.policy import FleetObservation, PolicyState, PolicyTuning, decide
from ..autoscaling.spec import AutoscalingSpec
from .bstar import BStar, Searcher, search
from .sim_fleet import FleetModel, SimResult, Simulation, Strategy
from .strategies import (
    DEFAULT_SIZING,
    FixedStrategy,
    HPAStrategy,
    HPATargets,
    OracleStrategy,
    ScheduleStrategy,
    replica_needs,
    trace_load,
)
from .traces import Trace, TraceConfig, make_trace

STRATEGIES = ("pdfleet", "fixed", "hpa", "oracle", "bstar")
# Replica-seconds the policy may spend over B*'s, per trace kind.
COST_TARGETS = {"burst": 1.30, "diurnal": 1.15, "heavytail": 1.15, "steady": 1.10}
MIN_ATTAINMENT = 0.99
# A reversal within this many seconds is a flap (steady load must have none).
FLAP_WINDOW_SECONDS = 600.0


class PolicyStrategy:
    """The pdfleet policy, unchanged."""

    name = "pdfleet"

    def __init__(self, spec: AutoscalingSpec, tuning: PolicyTuning | None = None) -> None:
        self.spec = spec
        self.tuning = tuning or PolicyTuning()
        self.state: PolicyState | None = None
        self.codes: Counter[str] = Counter()
        self.reasons: list[str] = []

    def decide(self, now: float, observation: FleetObservation) -> tuple[int, int]:
        result = decide(self.spec, observation, now, self.state, self.tuning)
        self.state = result.state
        for d in result.decisions:
            self.codes[f"{d.role}:{d.direction}:{d.code}"] += 1
            if d.direction != "none" and len(self.reasons) < 1000:
                self.reasons.append(f"t={now:.0f} {d.reason}")
        return result.prefill.desired, result.decode.desired


def summary(result: SimResult) -> dict[str, Any]:
    """What a run's comparison needs, JSON-ready (no timeline): attainment,
    latency percentiles, replica-seconds, scale events and flaps per role."""
    out = result.to_dict()
    out["oscillations"] = result.oscillations(FLAP_WINDOW_SECONDS)
    return out


class Cell:
    """One trace under one fleet model and spec, and the strategies run on it.

    Every strategy starts warm with the same replicas: what the oracle at
    the default sizing provisions for the first period (they were deployed
    a cold start before the trace)."""

    def __init__(self, config: TraceConfig, model: FleetModel, spec: AutoscalingSpec) -> None:
        self.config, self.model, self.spec = config, model, spec
        self.trace = make_trace(config)
        self.period = spec.period_seconds
        self.load = trace_load(self.trace, model, self.period)
        self.needs = replica_needs(self.load, model, spec, DEFAULT_SIZING)
        self.lookahead = model.cold_start_seconds + self.period
        self.start = OracleStrategy(self.needs, self.period, self.lookahead).at(0.0)

    def run(self, strategy: Strategy, start: tuple[int, int] | None = None) -> SimResult:
        initial = start or self.start
        return Simulation(
            self.trace, self.model, self.spec, strategy, initial, self.config.seed
        ).run()

    def policy(self, tuning: PolicyTuning | None = None) -> SimResult:
        return self.run(PolicyStrategy(self.spec, tuning))

    def hpa(self, targets: HPATargets | None = None) -> SimResult:
        return self.run(HPAStrategy(self.spec, targets))

    def oracle(self) -> SimResult:
        return self.run(OracleStrategy(self.needs, self.period, self.lookahead))

    def schedule(self, prefill: list[int], decode: list[int]) -> SimResult:
        strategy = ScheduleStrategy(prefill, decode, self.period)
        return self.run(strategy, (prefill[0], decode[0]))

    def bstar(self) -> BStar:
        searcher = Searcher(
            self.load, self.model, self.spec, self.start, lambda p, d: summary(self.schedule(p, d))
        )
        return search(searcher)

    def fixed_peak(self, prefill: int, decode: int) -> SimResult:
        return self.run(FixedStrategy(prefill, decode), (prefill, decode))


def compare(
    trace: Trace,
    model: FleetModel,
    spec: AutoscalingSpec,
    strategies: Sequence[str] = ("pdfleet", "fixed", "hpa", "oracle"),
    tuning: PolicyTuning | None = None,
    hpa_targets: HPATargets | None = None,
) -> tuple[dict[str, SimResult], BStar | None]:
    """Run each strategy on ``trace`` (its own config and seed). ``fixed``
    holds the oracle's peak counts at the default sizing; ``bstar`` searches
    B* (:mod:`.bstar`) and plays its schedule."""
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(
            f"unknown strategy {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}"
        )
    cell = Cell(trace.config, model, spec)
    cell.trace = trace
    results: dict[str, SimResult] = {}
    found: BStar | None = None
    for name in strategies:
        if name == "pdfleet":
            results[name] = cell.policy(tuning)
        elif name == "fixed":
            results[name] = cell.fixed_peak(max(cell.needs[0]), max(cell.needs[1]))
        elif name == "hpa":
            results[name] = cell.hpa(hpa_targets)
        elif name == "oracle":
            results[name] = cell.oracle()
        else:
            found = cell.bstar()
            if found.best is not None:
                p, d = found.best.schedule
                results[name] = cell.schedule(p, d)
    return results, found


def evaluate_targets(results: dict[str, SimResult], kind: str) -> dict[str, Any]:
    """The policy's targets that one run can check: each with the achieved
    value and whether it is met (cost against B* and HPA where they ran)."""
    ours = results.get("pdfleet")
    if ours is None:
        return {}
    rs = ours.replica_seconds["total"]
    out: dict[str, Any] = {
        "ttft_attainment": {
            "value": ours.ttft_attainment,
            "target": f">= {MIN_ATTAINMENT}",
            "met": ours.ttft_attainment >= MIN_ATTAINMENT,
        },
        "itl_attainment": {
            "value": ours.itl_attainment,
            "target": f">= {MIN_ATTAINMENT}",
            "met": ours.itl_attainment >= MIN_ATTAINMENT,
        },
    }
    if "bstar" in results:
        ratio = rs / max(results["bstar"].replica_seconds["total"], 1e-9)
        limit = COST_TARGETS.get(kind, 1.3)
        out["replica_seconds_vs_bstar"] = {
            "value": ratio,
            "target": f"<= {limit}",
            "met": ratio <= limit,
        }
    if "hpa" in results:
        theirs = results["hpa"].replica_seconds["total"]
        out["replica_seconds_vs_hpa"] = {
            "value": rs / max(theirs, 1e-9),
            "target": "< 1",
            "met": rs < theirs,
        }
    if kind == "steady":
        flips = ours.oscillations(FLAP_WINDOW_SECONDS)["total"]
        out["no_flap"] = {"value": flips, "target": "0", "met": flips == 0}
    return out
