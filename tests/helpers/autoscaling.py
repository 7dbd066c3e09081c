"""A small simulated fleet for the autoscaling lab's tests."""

from __future__ import annotations

from pdfleet.operator.autoscaling.spec import AutoscalingSpec
from pdfleet.operator.autoscaling_lab.sim_fleet import FleetModel


def binding_fleet() -> tuple[FleetModel, AutoscalingSpec]:
    """A small fleet whose SLOs bind (a few replicas decide them), and a spec
    of up to 40 replicas a role."""
    model = FleetModel(
        prefill_tokens_per_second=4000.0,
        cold_start_seconds=30.0,
        ttft_slo_seconds=1.2,
        itl_slo_seconds=0.02,
    )
    spec = AutoscalingSpec.from_spec({r: {"maxReplicas": 40} for r in ("prefill", "decode")})
    return model, spec
