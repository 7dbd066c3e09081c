"""Autoscaling in Kubernetes: the operator's adapter of the autoscaling loop.

Every autoscaling period the operator's timer scrapes the engine and gateway
pods (sooner when a gateway holds requests for a decode pool at zero) and
calls :class:`PolicyDecider` (the default :data:`decide_scaling`), which turns
the scrapes into :class:`~pdfleet.operator.autoscaling.control_loop.ReplicaScrape` records
and runs one :class:`~pdfleet.operator.autoscaling.control_loop.ScalingLoop`
per service: the same observe -> decide -> choose-victims step as ``pdfleet
up``. :func:`actuate` carries decisions out as the single writer of the
engine Deployments' replicas: victims (least loaded) get the lowest
pod-deletion cost first, then ``spec.replicas`` is patched. A multi-node role
scales its LeaderWorkerSet's ``spec.replicas`` (whole groups; the highest
group indices go first, so victims are not marked).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .autoscaling.control_loop import (
    ROLES,
    ActivationCounter,
    ReplicaScrape,
    ScalingLoop,
    gateway_batch_running,
)
from .autoscaling.decisions import AutoscalerMetrics
from .autoscaling.samples import snapshot_from_series
from .autoscaling.spec import AutoscalingSpec
from .kube import KubeClient
from .manifests import child_name, desired_replicas, multi_node, workload_kind
from .resource import InferenceServiceSpec, ScalingRecord
from .scrape import BATCH_RUNNING_KEY, PodSample, activation_key

# Deployment scale-down removes the pods with the lowest deletion cost first.
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
VICTIM_DELETION_COST = "-1000"


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
    """The autoscaling loop of any number of services (one loop per service)."""

    def __init__(self) -> None:
        self.loops: dict[str, ScalingLoop] = {}
        self.activations: dict[str, ActivationCounter] = {}
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
        scrape (failed ones with ``error`` set) and the gateway pods' (their
        activation counters: requests that found no engine of a role; their
        running Batch API requests, deferrable demand);
        ``replicas`` the Deployments' desired replicas per role; ``now`` Unix
        seconds."""
        scrapes = [
            ReplicaScrape(
                s.pod,
                s.role,
                "ready" if s.ready else "starting",
                snapshot_from_series({k: [v] for k, v in s.values.items()}, s.scraped_at)
                if s.error is None and s.ready
                else None,
                s.startup_seconds,
            )
            for s in samples
            if s.role in ROLES
        ]
        gateways: dict[str, dict[str, float]] = {
            s.pod: {role: s.values.get(activation_key(role), 0.0) for role in ROLES}
            for s in samples
            if s.role == "gateway" and s.error is None
        }
        activations = self.activations.setdefault(service, ActivationCounter()).update(gateways)
        batch_running = gateway_batch_running(
            s.values.get(BATCH_RUNNING_KEY, 0.0)
            for s in samples
            if s.role == "gateway" and s.error is None
        )
        loop = self.loops.setdefault(service, ScalingLoop())
        step = loop.step(
            policy,
            scrapes,
            now,
            requested=replicas,
            activations=activations,
            batch_running=batch_running,
        )
        if self.metrics is not None:
            for d in step.result.decisions:
                self.metrics.observe(d, policy.mode)
        return [ScaleDecision(a.role, a.desired, a.reason, a.victims) for a in step.actions]

    def forget(self, service: str) -> None:
        self.loops.pop(service, None)
        self.activations.pop(service, None)


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
) -> list[ScalingRecord]:
    """Apply decisions; return the status records of the changes made.

    Replicas are kept within the role's minReplicas..maxReplicas (the same
    bound the reconcile applies, so the two never disagree).
    """
    records: list[ScalingRecord] = []
    for decision in decisions:
        before = replicas[decision.role]
        after = desired_replicas(spec, decision.role, {decision.role: decision.replicas})
        if after == before:
            continue
        if after < before and not multi_node(spec, decision.role):
            for pod in decision.victims:
                await client.merge_patch(
                    "Pod",
                    namespace,
                    pod,
                    {"metadata": {"annotations": {DELETION_COST_ANNOTATION: VICTIM_DELETION_COST}}},
                )
        await client.merge_patch(
            workload_kind(spec, decision.role),
            namespace,
            child_name(name, decision.role),
            {"spec": {"replicas": after}},
        )
        records.append(
            ScalingRecord.change(decision.role, before, after, decision.reason, now, applied=True)
        )
    return records


def advise(
    spec: InferenceServiceSpec,
    decisions: Sequence[ScaleDecision],
    replicas: Mapping[str, int],
    now: str,
) -> list[ScalingRecord]:
    """Mode Advisory: the status records of what :func:`actuate` would do,
    marked not applied; nothing is patched."""
    records: list[ScalingRecord] = []
    for decision in decisions:
        before = replicas[decision.role]
        after = desired_replicas(spec, decision.role, {decision.role: decision.replicas})
        if after != before:
            records.append(
                ScalingRecord.change(
                    decision.role, before, after, decision.reason, now, applied=False
                )
            )
    return records
