"""Autoscaling of the prefill and decode roles: spec, pure policy, decision
records, metric samples, victim choice, the loop both actuators run, and the
fleet simulator (``pdfleet sim``). See docs/autoscaling.md."""

from .control_loop import LoopStep, ReplicaScrape, ScaleAction, ScalingLoop
from .decisions import AutoscalerMetrics, DecisionHistory, DecisionLog, DecisionRecord
from .policy import (
    REASON_CODES,
    FleetObservation,
    PolicyResult,
    PolicyState,
    PolicyTuning,
    RoleDecision,
    RoleObservation,
    decide,
)
from .samples import EngineSnapshot, ReplicaSample, parse_engine_metrics, sample_from_snapshots
from .spec import AutoscalingSpec, DecodeScaling, PrefillScaling, RatioBounds
from .victims import ReplicaLoad, choose_victims

__all__ = [
    "REASON_CODES",
    "AutoscalerMetrics",
    "AutoscalingSpec",
    "DecisionHistory",
    "DecisionLog",
    "DecisionRecord",
    "DecodeScaling",
    "EngineSnapshot",
    "FleetObservation",
    "LoopStep",
    "PolicyResult",
    "PolicyState",
    "PolicyTuning",
    "PrefillScaling",
    "RatioBounds",
    "ReplicaLoad",
    "ReplicaSample",
    "ReplicaScrape",
    "RoleDecision",
    "RoleObservation",
    "ScaleAction",
    "ScalingLoop",
    "choose_victims",
    "decide",
    "parse_engine_metrics",
    "sample_from_snapshots",
]
