"""Every child of an InferenceService, in the order the operator applies them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..compat import compat_hash
from ..resource import (
    ROLES,
    InferenceServiceSpec,
)
from .access import build_configmap, build_engine_service_account, build_gateway_rbac
from .common import DEFAULT_IMAGE, OperatorInstall, Owner, multi_node
from .network import build_network_policies
from .services import build_engine_service, build_gateway_service, build_pdb
from .workloads import build_deployment, build_leader_worker_set, desired_replicas


def build_children(
    name: str,
    spec: InferenceServiceSpec,
    *,
    namespace: str,
    image: str | None = None,
    owner: Owner | None = None,
    autoscaled: Mapping[str, int] | None = None,
    install: OperatorInstall | None = None,
    secret_version: str | None = None,
    identity_version: str | None = None,
    live_templates: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Every child object, in apply order (workloads last: gateway, decode, prefill).

    An engine role's workload is a Deployment, or a LeaderWorkerSet when its
    ``nodesPerReplica`` is above 1 (:func:`workload_kind`).

    ``image`` is the default when ``spec.image`` is unset; ``autoscaled``
    holds the replicas the autoscaler chose (used when autoscaling is on);
    ``install`` says where the operator runs; ``secret_version`` is the fleet
    secret's fingerprint (a change rolls every pod), ``identity_version`` the
    identity authority's (a change rolls the engine pods); ``live_templates``
    each engine role's pod template as it runs (it keeps the adapters the pods
    started with when nothing else changes, see engine_pod_template).
    The spec must pass :func:`pdfleet.operator.compat.check_service`.
    """
    image = spec.image or image or DEFAULT_IMAGE
    install = install or OperatorInstall()
    compat = compat_hash(spec)
    objects = build_gateway_rbac(name, namespace=namespace, owner=owner, install=install)
    objects.append(build_engine_service_account(name, namespace=namespace, owner=owner))
    objects += build_network_policies(name, spec, namespace=namespace, owner=owner, install=install)
    objects.append(build_configmap(name, spec, namespace=namespace, compat=compat, owner=owner))
    for role in ROLES:
        objects.append(build_engine_service(name, spec, role, namespace=namespace, owner=owner))
    objects.append(build_gateway_service(name, spec, namespace=namespace, owner=owner))
    for role in ("prefill", "decode", "gateway"):
        objects.append(build_pdb(name, role, namespace=namespace, owner=owner))
    for role in ("gateway", "decode", "prefill"):
        build = build_leader_worker_set if multi_node(spec, role) else build_deployment
        engine: dict[str, Any] = {}
        if role != "gateway":
            engine = {
                "identity_version": identity_version,
                "live": (live_templates or {}).get(role),
            }
        objects.append(
            build(
                name,
                spec,
                role,
                namespace=namespace,
                image=image,
                compat=compat,
                replicas=desired_replicas(spec, role, autoscaled),
                owner=owner,
                secret_version=secret_version,
                **engine,
            )
        )
    return objects
