"""Secrets, ConfigMaps, ServiceAccounts and RBAC of an InferenceService."""

from __future__ import annotations

import base64
import json
from typing import Any

from ..parallelism import (
    LEADER,
    WORKER,
    rendezvous_flags,
    role_layout,
)
from ..resource import (
    ROLES,
    InferenceServiceSpec,
)
from ..roles import (
    engine_command,
)
from .common import (
    FLEET_SECRET_KEY,
    IDENTITY_AUTHORITY_KEY,
    IDENTITY_CA_KEY,
    IDENTITY_ENDPOINT_KEY,
    IDENTITY_SECRET_KEY,
    OperatorInstall,
    Owner,
    child_name,
    common_labels,
    engine_service_account_name,
    fleet_secret_name,
    identity_configmap_name,
    identity_secret_name,
    multi_node,
    non_default_args,
    object_meta,
    pod_engine_args,
    pod_serving,
)
from .pods import gateway_command


def build_gateway_rbac(
    name: str, *, namespace: str, owner: Owner | None, install: OperatorInstall
) -> list[dict[str, Any]]:
    """ServiceAccount and RoleBinding letting the gateway watch the pods of its
    namespace (it filters to its own service by label). The binding names the
    chart's gateway role (a Role in the namespace, or a ClusterRole), so the
    operator never writes a role's rules."""
    sa_name = child_name(name, "gateway")
    labels = common_labels(name, "gateway")
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": object_meta(sa_name, namespace, labels, owner),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": object_meta(sa_name, namespace, labels, owner),
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": install.gateway_role_kind,
                "name": install.gateway_role,
            },
            "subjects": [{"kind": "ServiceAccount", "name": sa_name, "namespace": namespace}],
        },
    ]


def build_fleet_secret(
    name: str, *, namespace: str, owner: Owner | None, value: str
) -> dict[str, Any]:
    """The fleet Secret holding ``value`` (random: the caller draws it, once)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(fleet_secret_name(name), namespace, common_labels(name), owner),
        "type": "Opaque",
        "immutable": True,
        "data": {FLEET_SECRET_KEY: base64.b64encode(value.encode()).decode()},
    }


def build_configmap(
    name: str, spec: InferenceServiceSpec, *, namespace: str, compat: str, owner: Owner | None
) -> dict[str, Any]:
    data = {"compat-hash": compat}
    for role in ROLES:
        args = pod_engine_args(spec, role)
        command = engine_command(args, serving=pod_serving(spec))
        doc: dict[str, Any] = {"args": non_default_args(args), "command": command}
        if multi_node(spec, role):
            layout = role_layout(spec.role(role), args)
            doc["command"] = command + rendezvous_flags(layout, LEADER)
            doc["workerCommand"] = command + rendezvous_flags(layout, WORKER)
        data[f"{role}.json"] = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    gateway = {"command": gateway_command(name, spec, namespace)}
    data["gateway.json"] = json.dumps(gateway, indent=2, sort_keys=True) + "\n"
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(child_name(name, "config"), namespace, common_labels(name), owner),
        "data": data,
    }


def build_engine_service_account(
    name: str, *, namespace: str, owner: Owner | None
) -> dict[str, Any]:
    """The engine pods' ServiceAccount: no RoleBinding names it (engines call no
    API), its token is never mounted; the identity endpoint accepts projected
    tokens of this account only."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": object_meta(
            engine_service_account_name(name), namespace, common_labels(name), owner
        ),
        "automountServiceAccountToken": False,
    }


def build_identity_secret(
    name: str, *, namespace: str, owner: Owner | None, value: str
) -> dict[str, Any]:
    """The Secret holding the identity authority's private key (``value``:
    base64url of the raw key; random, drawn once by the caller). No pod mounts
    it; only the operator reads it."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(identity_secret_name(name), namespace, common_labels(name), owner),
        "type": "Opaque",
        "immutable": True,
        "data": {IDENTITY_SECRET_KEY: base64.b64encode(value.encode()).decode()},
    }


def build_identity_configmap(
    name: str,
    *,
    namespace: str,
    owner: Owner | None,
    authority: str,
    ca_pem: str,
    endpoint: str,
) -> dict[str, Any]:
    """What engine pods read about identities, all public: the authority's
    public key, the endpoint's URL and the CA its certificate chains to."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(
            identity_configmap_name(name), namespace, common_labels(name), owner
        ),
        "data": {
            IDENTITY_AUTHORITY_KEY: authority,
            IDENTITY_CA_KEY: ca_pem,
            IDENTITY_ENDPOINT_KEY: endpoint,
        },
    }
