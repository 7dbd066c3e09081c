"""Reconciling one InferenceService: check, build, apply in a coherent order.

Rollout order (docs/operator.md): everything but the Deployments first, then
the gateway, then decode, then prefill. When the compatibility hash changes,
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
from .manifests import LABEL_COMPAT, OperatorInstall, Owner, build_children, child_name
from .resource import MAX_NAME_LENGTH, InferenceServiceSpec, is_valid_name, parse_spec
from .status import rollout_done

DEPLOYMENT_ROLES = ("prefill", "decode", "gateway")


class InvalidSpec(ValueError):
    """The spec cannot run; ``problems`` name each field and its fix."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class WaitingForRollout(Exception):
    """A step of a coherent rollout waits for the previous one to finish."""


def checked_spec(name: str, spec: Mapping[str, Any] | None) -> InferenceServiceSpec:
    """Parse and check a live object; :class:`InvalidSpec` lists every problem."""
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
    problems += [str(v) for v in check_service(parsed)]
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
    client: KubeClient, name: str, namespace: str
) -> dict[str, dict[str, Any] | None]:
    return {
        role: await client.get("Deployment", namespace, child_name(name, role))
        for role in DEPLOYMENT_ROLES
    }


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
) -> None:
    """Create or update every child (idempotent); raises
    :class:`WaitingForRollout` while prefill waits for decode."""
    children = build_children(
        name,
        spec,
        namespace=namespace,
        image=image,
        owner=owner,
        autoscaled=autoscaled,
        install=install,
        secret_version=secret_version,
    )
    deployments = {
        obj["metadata"]["labels"]["pdfleet.dev/role"]: obj
        for obj in children
        if obj["kind"] == "Deployment"
    }
    for obj in children:
        if obj["kind"] != "Deployment":
            await client.apply(obj)
    await client.apply(deployments["gateway"])
    new_compat = deployments["prefill"]["metadata"]["labels"][LABEL_COMPAT]
    live_prefill = await client.get("Deployment", namespace, child_name(name, "prefill"))
    old_compat = ((live_prefill or {}).get("metadata", {}).get("labels") or {}).get(LABEL_COMPAT)
    decode = await client.apply(deployments["decode"])
    if live_prefill is not None and old_compat != new_compat and not rollout_done(decode):
        raise WaitingForRollout(
            f"compatibility hash {old_compat} -> {new_compat}: prefill waits until every "
            "decode pod runs the new spec"
        )
    await client.apply(deployments["prefill"])
