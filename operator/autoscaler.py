"""Autoscaling in Kubernetes: the policy over scraped pods, and the actuator.

Every autoscaling period the operator's timer scrapes the engine pods and
calls :class:`PolicyDecider` (the default :data:`decide_scaling`), which runs
the same pure ``decide()`` as ``pdfleet up`` and ``pdfleet sim`` with per-service
state (stabilization windows, calibration, previous scrapes). :func:`actuate`
carries decisions out as the single writer of the engine Deployments'
replicas: victims (least loaded, from ``choose_victims``) get the lowest
pod-deletion cost first, then ``spec.replicas`` is patched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .autoscaling.decisions import AutoscalerMetrics
from .autoscaling.policy import FleetObservation, PolicyState, RoleObservation, decide
from .autoscaling.samples import (
    EngineSnapshot,
    ReplicaSample,
    sample_from_snapshots,
    snapshot_from_series,
)
from .autoscaling.spec import AutoscalingSpec as PolicySpec
from .autoscaling.victims import ReplicaLoad, choose_victims
from .kube import KubeClient
from .manifests import child_name, desired_replicas
from .resource import AutoscalingSpec, InferenceServiceSpec
from .scrape import PodSample

# Deployment scale-down removes the pods with the lowest deletion cost first.
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
VICTIM_DELETION_COST = "-1000"
MAX_RECORDED_DECISIONS = 10


@dataclass(frozen=True)
class ScaleDecision:
    """Set ``role`` to ``replicas`` pods, because ``reason``."""

    role: str
    replicas: int
    reason: str
    victims: tuple[str, ...] = ()
    """Pods to remove first when scaling down (e.g. the least loaded)."""


DecideFn = Callable[
    [str, AutoscalingSpec, Sequence[PodSample], Mapping[str, int], float], Sequence[ScaleDecision]
]


class PolicyDecider:
    """The autoscaling policy for any number of services (state kept per service)."""

    def __init__(self) -> None:
        self.state: dict[str, PolicyState] = {}
        self.snapshots: dict[str, dict[str, EngineSnapshot]] = {}
        # Set by the operator to export every decision (holds included) on its /metrics.
        self.metrics: AutoscalerMetrics | None = None

    def __call__(
        self,
        service: str,
        policy: AutoscalingSpec,
        samples: Sequence[PodSample],
        replicas: Mapping[str, int],
        now: float,
    ) -> list[ScaleDecision]:
        """``service`` is ``namespace/name``; ``samples`` hold every engine pod's
        scrape (failed ones with ``error`` set); ``replicas`` the Deployments'
        desired replicas per role; ``now`` Unix seconds."""
        spec = PolicySpec.from_spec(policy.model_dump(by_alias=True))
        previous = self.snapshots.get(service, {})
        current: dict[str, EngineSnapshot] = {}
        roles: dict[str, list[ReplicaSample]] = {"prefill": [], "decode": []}
        loads: dict[str, list[ReplicaLoad]] = {"prefill": [], "decode": []}
        for s in samples:
            if s.role not in roles:
                continue
            snap = None
            if s.error is None and s.ready:
                snap = snapshot_from_series({k: [v] for k, v in s.values.items()}, s.scraped_at)
                current[s.pod] = snap
            state = "ready" if s.ready else "starting"
            roles[s.role].append(sample_from_snapshots(s.pod, snap, previous.get(s.pod), state))
            in_flight = (
                s.values.get("pdfleet_engine_num_requests_running", 0.0)
                + s.values.get("pdfleet_engine_num_requests_waiting", 0.0)
                + s.values.get("pdfleet_engine_kv_transfer_held_requests", 0.0)
            )
            loads[s.role].append(
                ReplicaLoad(
                    s.pod,
                    ready=s.ready,
                    in_flight=int(in_flight),
                    kv_cache_usage=s.values.get("pdfleet_engine_kv_cache_usage_ratio", 0.0),
                )
            )
        self.snapshots[service] = current
        observation = FleetObservation(
            prefill=RoleObservation(tuple(roles["prefill"]), requested=replicas.get("prefill")),
            decode=RoleObservation(tuple(roles["decode"]), requested=replicas.get("decode")),
        )
        result = decide(spec, observation, now, self.state.get(service))
        self.state[service] = result.state
        if self.metrics is not None:
            for d in result.decisions:
                self.metrics.observe(d)
        out = []
        for d in result.decisions:
            if d.desired == d.current:
                continue
            victims: tuple[str, ...] = ()
            if d.desired < d.current and loads[d.role]:
                count = min(d.current - d.desired, len(loads[d.role]))
                victims = tuple(choose_victims(loads[d.role], count))
            out.append(ScaleDecision(d.role, d.desired, d.reason, victims))
        return out

    def forget(self, service: str) -> None:
        self.state.pop(service, None)
        self.snapshots.pop(service, None)


decide_scaling: DecideFn = PolicyDecider()


async def actuate(
    client: KubeClient,
    *,
    name: str,
    namespace: str,
    spec: InferenceServiceSpec,
    decisions: Sequence[ScaleDecision],
    replicas: Mapping[str, int],
    now: str,
) -> list[dict[str, object]]:
    """Apply decisions; return the status records of the changes made.

    Replicas are kept within the role's minReplicas..maxReplicas (the same
    bound the reconcile applies, so the two never disagree).
    """
    records: list[dict[str, object]] = []
    for decision in decisions:
        before = replicas[decision.role]
        after = desired_replicas(spec, decision.role, {decision.role: decision.replicas})
        if after == before:
            continue
        if after < before:
            for pod in decision.victims:
                await client.merge_patch(
                    "Pod",
                    namespace,
                    pod,
                    {"metadata": {"annotations": {DELETION_COST_ANNOTATION: VICTIM_DELETION_COST}}},
                )
        await client.merge_patch(
            "Deployment",
            namespace,
            child_name(name, decision.role),
            {"spec": {"replicas": after}},
        )
        records.append(
            {
                "role": decision.role,
                "from": before,
                "to": after,
                "reason": decision.reason,
                "time": now,
            }
        )
    return records


def merge_records(
    previous: Sequence[Mapping[str, object]], new: Sequence[Mapping[str, object]]
) -> list[dict[str, object]]:
    """The bounded decision history, newest last."""
    return [dict(r) for r in [*previous, *new]][-MAX_RECORDED_DECISIONS:]
