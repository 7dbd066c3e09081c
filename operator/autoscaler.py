"""Autoscaling: the seam where the policy plugs in, and the actuator.

Every autoscaling period the operator's timer scrapes the engine pods and
calls :func:`decide_scaling` with the samples. The policy (its own module,
written as dataclasses matching ``spec.autoscaling``) replaces it; until then
it decides nothing. :func:`actuate` carries decisions out as the single
writer of the engine Deployments' replicas: victims are marked for removal
first, then ``spec.replicas`` is patched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

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


def decide_scaling(
    service: str,
    policy: AutoscalingSpec,
    samples: Sequence[PodSample],
    replicas: Mapping[str, int],
    now: float,
) -> list[ScaleDecision]:
    """THE SEAM: the autoscaling policy's decision for one service.

    ``service`` is ``namespace/name`` (a key for per-service state such as
    stabilization windows); ``samples`` hold every engine pod's scraped
    metrics (stale or failed ones included, with ``error`` set);
    ``replicas`` the current desired replicas per role; ``now`` Unix
    seconds. Returns the roles to change. No policy is wired yet: no change.
    """
    return []


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
