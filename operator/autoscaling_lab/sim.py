"""``pdfleet sim``: compare autoscaling strategies on a simulated P/D fleet.

:func:`compare` runs each strategy (:mod:`.strategies`) over the same seeded
trace (:mod:`.traces`) in the discrete-event fleet model (:mod:`.fleet`),
which runs the autoscaling policy's own code on snapshots of simulated engine
metrics. :func:`evaluate_targets` checks the policy's results against the
targets in docs/autoscaling.md (:mod:`.matrix` checks them per seed and trace).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdfleet.operator.autoscaling.policy import PolicyTuning
from pdfleet.operator.autoscaling.spec import AutoscalingSpec

from .sim_fleet import FleetModel, SimResult, Simulation, Strategy
from .strategies import FixedStrategy, HPAStrategy, OracleStrategy, PolicyStrategy, replica_needs
from .traces import Trace

STRATEGIES = ("pdfleet", "fixed", "hpa", "oracle")

__all__ = [
    "STRATEGIES",
    "FixedStrategy",
    "FleetModel",
    "HPAStrategy",
    "OracleStrategy",
    "PolicyStrategy",
    "SimResult",
    "Simulation",
    "Targets",
    "compare",
    "evaluate_targets",
    "replica_needs",
]


@dataclass(frozen=True)
class Targets:
    """What the policy must achieve on every trace: SLO attainment, and
    replica-seconds against the oracle and fixed peak provisioning
    (docs/autoscaling.md)."""

    min_attainment: float = 0.99
    max_oracle_ratio: float = 1.25
    max_fixed_ratio: float = 0.7


def evaluate_targets(
    results: dict[str, SimResult], targets: Targets | None = None
) -> dict[str, Any]:
    """Each target with the achieved value and whether it is met (None: the
    strategy it compares against was not run)."""
    targets = targets or Targets()
    ours = results.get("pdfleet")
    if ours is None:
        return {}
    rs = ours.replica_seconds["total"]
    out: dict[str, Any] = {
        "ttft_attainment": {
            "value": ours.ttft_attainment,
            "target": f">= {targets.min_attainment}",
            "met": ours.ttft_attainment >= targets.min_attainment,
        },
        "itl_attainment": {
            "value": ours.itl_attainment,
            "target": f">= {targets.min_attainment}",
            "met": ours.itl_attainment >= targets.min_attainment,
        },
    }
    if "oracle" in results:
        ratio = rs / max(results["oracle"].replica_seconds["total"], 1e-9)
        out["replica_seconds_vs_oracle"] = {
            "value": ratio,
            "target": f"<= {targets.max_oracle_ratio}",
            "met": ratio <= targets.max_oracle_ratio,
        }
    if "fixed" in results:
        ratio = rs / max(results["fixed"].replica_seconds["total"], 1e-9)
        out["replica_seconds_vs_fixed_peak"] = {
            "value": ratio,
            "target": f"<= {targets.max_fixed_ratio}",
            "met": ratio <= targets.max_fixed_ratio,
        }
    if "hpa" in results:
        ours_events = ours.scale_events["total"]
        theirs = results["hpa"].scale_events["total"]
        out["scale_events_vs_hpa"] = {
            "value": f"{ours_events} vs {theirs}",
            "target": "fewer",
            "met": ours_events < theirs,
        }
    return out


def compare(
    trace: Trace,
    model: FleetModel,
    spec: AutoscalingSpec,
    strategies: Sequence[str] = STRATEGIES,
    tuning: PolicyTuning | None = None,
    hpa_prefill_metric: str = "utilization",
    seed: int = 0,
) -> dict[str, SimResult]:
    """Run each strategy on the same trace. Every strategy but ``fixed`` starts
    with the oracle's replicas for the first period, already warm."""
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(
            f"unknown strategy {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}"
        )
    tuning = tuning or PolicyTuning()
    needs = replica_needs(trace, model, spec)
    oracle = OracleStrategy(
        needs, spec.period_seconds, model.cold_start_seconds + spec.period_seconds
    )
    initial = oracle.at(0.0)
    peak = (max(needs[0]), max(needs[1]))
    results = {}
    for name in strategies:
        strategy: Strategy
        start = initial
        if name == "pdfleet":
            strategy = PolicyStrategy(spec, tuning)
        elif name == "fixed":
            strategy = FixedStrategy(*peak)
            start = peak
        elif name == "hpa":
            strategy = HPAStrategy(spec, hpa_prefill_metric)
        else:
            strategy = OracleStrategy(needs, spec.period_seconds, oracle.lookahead)
        results[name] = Simulation(trace, model, spec, strategy, start, seed).run()
    return results
