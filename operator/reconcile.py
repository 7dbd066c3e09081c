"""Reconciling one InferenceService: check, build, apply in a coherent order.

Rollout order (docs/operator.md): everything but the workloads (Deployments,
and LeaderWorkerSets for multi-node roles) first, then the gateway, then
decode, then prefill. When the compatibility hash changes,
prefill waits until every decode pod runs the new spec: old prefill pods keep
serving old decode pods (equal hashes) meanwhile, and new decode pods serve
decode-only until new prefill pods arrive. The gateway never pairs engines
with different hashes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .compat import check_service
from .kube import KubeClient
from .manifests import (
    LABEL_COMPAT,
    LABEL_ROLE,
    OperatorInstall,
    Owner,
    build_children,
    child_name,
    multi_node,
    workload_kind,
)
from .resource import MAX_NAME_LENGTH, ROLES, InferenceServiceSpec, is_valid_name, parse_spec
from .status import rollout_done

DEPLOYMENT_ROLES = ("prefill", "decode", "gateway")
WORKLOAD_KINDS = ("Deployment", "LeaderWorkerSet")


class InvalidSpec(ValueError):
    """The spec cannot run; ``problems`` name each field and its fix."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class WaitingForRollout(Exception):
    """A step of a coherent rollout waits for the previous one to finish."""


def checked_spec(
    name: str, spec: Mapping[str, Any] | None, *, leader_worker_set: bool = True
) -> InferenceServiceSpec:
    """Parse and check a live object; :class:`InvalidSpec` lists every problem.

    ``leader_worker_set``: whether multi-node roles may run here (the
    operator's installation enables LeaderWorkerSets)."""
    problems = []
    if not is_valid_name(name):
        problems.append(
            f"metadata.name: {name!r} cannot name the child Services; use at most "
            f"{MAX_NAME_LENGTH} lowercase letters, digits and '-', starting with a letter"
        )
    try:
        parsed = parse_spec(dict(spec or {}))
    except ValueError as e:
        raise InvalidSpec(problems + str(e).splitlines()) from None
    problems += [str(v) for v in check_service(parsed, name=name)]
    for role in ROLES:
        if multi_node(parsed, role) and not leader_worker_set:
            problems.append(
                f"spec.{role}.nodesPerReplica: multi-node engines run as LeaderWorkerSets, "
                "which this operator is not allowed to manage; install the LeaderWorkerSet "
                "controller and the chart with leaderWorkerSet.enabled=true, or set "
                "nodesPerReplica: 1"
            )
    if problems:
        raise InvalidSpec(problems)
    return parsed


def autoscaled_replicas(status: Mapping[str, Any] | None) -> dict[str, int]:
    """The replicas the autoscaler last chose, from the status it wrote."""
    roles = (status or {}).get("roles") or {}
    out = {}
    for role in ("prefill", "decode"):
        value = (roles.get(role) or {}).get("desiredReplicas")
        if isinstance(value, int):
            out[role] = value
    return out


async def read_deployments(
    client: KubeClient, name: str, namespace: str, spec: InferenceServiceSpec | None = None
) -> dict[str, dict[str, Any] | None]:
    """Each role's workload: its Deployment, or its LeaderWorkerSet when the
    spec makes it multi-node (their status fields have the same names)."""
    return {
        role: await client.get(
            workload_kind(spec, role) if spec is not None else "Deployment",
            namespace,
            child_name(name, role),
        )
        for role in DEPLOYMENT_ROLES
    }


def pod_templates(workload: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    """The pod templates of a Deployment (one) or a LeaderWorkerSet (leader, worker)."""
    spec = (workload or {}).get("spec") or {}
    if "leaderWorkerTemplate" in spec:
        lwt = spec["leaderWorkerTemplate"] or {}
        return [t for t in (lwt.get("leaderTemplate"), lwt.get("workerTemplate")) if t]
    return [spec["template"]] if spec.get("template") else []


async def _retire_other_kind(
    client: KubeClient, obj: Mapping[str, Any], install: OperatorInstall
) -> None:
    """A role that changed kind (nodesPerReplica 1 <-> more): scale its old
    workload to zero once the new one exists. The operator deletes nothing;
    the old object goes with the InferenceService."""
    kind = "LeaderWorkerSet" if obj["kind"] == "Deployment" else "Deployment"
    if kind == "LeaderWorkerSet" and not install.leader_worker_set:
        return  # never created here, and not readable without the RBAC for it
    meta = obj["metadata"]
    old = await client.get(kind, meta["namespace"], meta["name"])
    if old is not None and ((old.get("spec") or {}).get("replicas") or 0) > 0:
        await client.merge_patch(kind, meta["namespace"], meta["name"], {"spec": {"replicas": 0}})


async def apply_children(
    client: KubeClient,
    name: str,
    namespace: str,
    spec: InferenceServiceSpec,
    *,
    owner: Owner | None,
    image: str | None,
    autoscaled: Mapping[str, int] | None,
    install: OperatorInstall | None = None,
    secret_version: str | None = None,
    identity_version: str | None = None,
) -> None:
    """Create or update every child (idempotent); raises
    :class:`WaitingForRollout` while prefill waits for decode."""
    live = {
        role: await client.get(workload_kind(spec, role), namespace, child_name(name, role))
        for role in ROLES
    }
    children = build_children(
        name,
        spec,
        namespace=namespace,
        image=image,
        owner=owner,
        autoscaled=autoscaled,
        install=install,
        secret_version=secret_version,
        identity_version=identity_version,
        live_templates={
            role: templates[0] for role in ROLES if (templates := pod_templates(live[role]))
        },
    )
    install = install or OperatorInstall()
    workloads = {
        obj["metadata"]["labels"][LABEL_ROLE]: obj
        for obj in children
        if obj["kind"] in WORKLOAD_KINDS
    }
    for obj in children:
        if obj["kind"] not in WORKLOAD_KINDS:
            await client.apply(obj)
    await client.apply(workloads["gateway"])
    new_compat = workloads["prefill"]["metadata"]["labels"][LABEL_COMPAT]
    live_prefill = live["prefill"]
    old_compat = ((live_prefill or {}).get("metadata", {}).get("labels") or {}).get(LABEL_COMPAT)
    decode = await client.apply(workloads["decode"])
    await _retire_other_kind(client, workloads["decode"], install)
    if live_prefill is not None and old_compat != new_compat and not rollout_done(decode):
        raise WaitingForRollout(
            f"compatibility hash {old_compat} -> {new_compat}: prefill waits until every "
            "decode pod (group) runs the new spec"
        )
    await client.apply(workloads["prefill"])
    await _retire_other_kind(client, workloads["prefill"], install)
