"""The workloads that run the pods: Deployments, and LeaderWorkerSets for multi-node roles."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..parallelism import (
    LEADER,
    WORKER,
)
from ..resource import (
    InferenceServiceSpec,
)
from ..roles import (
    disaggregating,
)
from .common import (
    LABEL_COMPAT,
    LWS_API_VERSION,
    Owner,
    child_name,
    common_labels,
    multi_node,
    object_meta,
    selector_labels,
)
from .pods import engine_pod_template, gateway_pod_template


def desired_replicas(
    spec: InferenceServiceSpec, role: str, autoscaled: Mapping[str, int] | None = None
) -> int:
    """Replicas of a role: the autoscaler's choice (kept within min..max) when
    autoscaling is on, else the spec's; no prefill pods when not disaggregating."""
    if role == "gateway":
        return spec.gateway.replicas
    if role == "prefill" and not disaggregating(spec):
        return 0
    replicas = spec.role(role).replicas
    if spec.autoscaling is None:
        return replicas
    policy = spec.autoscaling.role(role)
    wanted = (autoscaled or {}).get(role, replicas)
    return max(policy.min_replicas, min(policy.max_replicas, wanted))


# Rollouts add a pod (a group, for a LeaderWorkerSet) before removing one:
# serving capacity never drops.
SURGE_ONE = {"maxSurge": 1, "maxUnavailable": 0}


def _workload(
    api_version: str,
    kind: str,
    name: str,
    role: str,
    namespace: str,
    labels: dict[str, str],
    owner: Owner | None,
    replicas: int,
    body: dict[str, Any],
) -> dict[str, Any]:
    """What every workload of a role shares: its name, labels, owner and replicas;
    ``body``, the rest of its spec."""
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": object_meta(child_name(name, role), namespace, labels, owner),
        "spec": {"replicas": replicas, **body},
    }


def build_deployment(
    name: str,
    spec: InferenceServiceSpec,
    role: str,
    *,
    namespace: str,
    image: str,
    compat: str,
    replicas: int,
    owner: Owner | None = None,
    secret_version: str | None = None,
    identity_version: str | None = None,
    live: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``live``: the role's pod template as it runs (see engine_pod_template)."""
    if role == "gateway":
        template = gateway_pod_template(
            name, spec, namespace=namespace, image=image, secret_version=secret_version
        )
        labels = common_labels(name, role)
    else:
        template = engine_pod_template(
            name,
            spec,
            role,
            image=image,
            compat=compat,
            secret_version=secret_version,
            identity_version=identity_version,
            live=live,
        )
        labels = {**common_labels(name, role), LABEL_COMPAT: compat}
    body = {
        "revisionHistoryLimit": 3,
        "selector": {"matchLabels": selector_labels(name, role)},
        "strategy": _strategy(spec, role),
        "template": template,
    }
    return _workload("apps/v1", "Deployment", name, role, namespace, labels, owner, replicas, body)


def _strategy(spec: InferenceServiceSpec, role: str) -> dict[str, Any]:
    """Add a pod before removing one: serving capacity never drops in a rollout.
    Except a gateway whose Batch API state is on a claim: SQLite has one writer
    and a ReadWriteOnce claim one node, so its old pod goes before the new one
    opens the claim (a short gap in the gateway's service)."""
    if role == "gateway" and spec.gateway.batch is not None and spec.gateway.batch.claim_name:
        return {"type": "Recreate"}
    return {"type": "RollingUpdate", "rollingUpdate": dict(SURGE_ONE)}


def workload_kind(spec: InferenceServiceSpec, role: str) -> str:
    """The kind of a role's workload object: Deployment or LeaderWorkerSet."""
    return "LeaderWorkerSet" if multi_node(spec, role) else "Deployment"


def build_leader_worker_set(
    name: str,
    spec: InferenceServiceSpec,
    role: str,
    *,
    namespace: str,
    image: str,
    compat: str,
    replicas: int,
    owner: Owner | None = None,
    secret_version: str | None = None,
    identity_version: str | None = None,
    live: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A multi-node role: ``replicas`` groups of ``nodesPerReplica`` pods each.

    The leader (worker index 0) serves the API and runs node rank 0; workers
    join its rendezvous. A pod that fails restarts its whole group (the ranks
    of one engine live and die together). Rollouts add a new group before
    removing an old one, as the Deployments do with pods.
    """
    templates = {
        group_role: engine_pod_template(
            name,
            spec,
            role,
            image=image,
            compat=compat,
            secret_version=secret_version,
            group_role=group_role,
            identity_version=identity_version,
            live=live,
        )
        for group_role in (LEADER, WORKER)
    }
    labels = {**common_labels(name, role), LABEL_COMPAT: compat}
    body = {
        "startupPolicy": "LeaderCreated",
        "rolloutStrategy": {
            "type": "RollingUpdate",
            "rollingUpdateConfiguration": dict(SURGE_ONE),
        },
        "networkConfig": {"subdomainPolicy": "Shared"},
        "leaderWorkerTemplate": {
            "size": spec.role(role).nodes_per_replica,
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": templates[LEADER],
            "workerTemplate": templates[WORKER],
        },
    }
    return _workload(
        LWS_API_VERSION, "LeaderWorkerSet", name, role, namespace, labels, owner, replicas, body
    )
