"""Services (the engines' headless ones, the gateway's) and PodDisruptionBudgets."""

from __future__ import annotations

from typing import Any

from ..resource import (
    InferenceServiceSpec,
)
from ..roles import (
    ENGINE_PORT,
    moves_kv,
)
from .common import Owner, child_name, common_labels, multi_node, object_meta, selector_labels


def build_engine_service(
    name: str, spec: InferenceServiceSpec, role: str, *, namespace: str, owner: Owner | None
) -> dict[str, Any]:
    ports = [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}]
    if moves_kv(spec):
        ports.append(
            {"name": "kv", "port": spec.kv_transfer.port, "targetPort": "kv", "protocol": "TCP"}
        )
    service_spec: dict[str, Any] = {
        "clusterIP": "None",
        "selector": selector_labels(name, role),
        "ports": ports,
    }
    if multi_node(spec, role):
        # The LeaderWorkerSet's subdomain (its controller finds this Service under
        # the set's name and creates none): workers resolve their leader before
        # it is ready, since it becomes ready only once they have joined.
        service_spec["publishNotReadyAddresses"] = True
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(
            child_name(name, role), namespace, common_labels(name, role), owner
        ),
        "spec": service_spec,
    }


def build_gateway_service(
    name: str, spec: InferenceServiceSpec, *, namespace: str, owner: Owner | None
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(name, namespace, common_labels(name, "gateway"), owner),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name, "gateway"),
            "ports": [
                {"name": "http", "port": spec.gateway.port, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }


def build_pdb(name: str, role: str, *, namespace: str, owner: Owner | None) -> dict[str, Any]:
    # maxUnavailable rather than minAvailable: a one-pod role can still be drained.
    # For multi-node roles one pod down stops its whole group (the group is
    # recreated), so one pod at a time is also one group at a time.
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(
            child_name(name, role), namespace, common_labels(name, role), owner
        ),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name, role)}},
    }


def service_url(name: str, spec: InferenceServiceSpec, namespace: str) -> str:
    """The OpenAI base URL of the gateway Service, inside the cluster."""
    return f"http://{name}.{namespace}.svc:{spec.gateway.port}/v1"
