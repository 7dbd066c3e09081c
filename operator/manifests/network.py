"""NetworkPolicies: who may reach the engines' HTTP and KV ports and the gateway's."""

from __future__ import annotations

from typing import Any

from ..resource import (
    InferenceServiceSpec,
)
from ..roles import (
    ENGINE_PORT,
    KV_EVENTS_PORT,
    KV_EVENTS_REPLAY_PORT,
    disaggregating,
    peer_pulls,
    publishes_kv_events,
)
from .common import (
    OperatorInstall,
    Owner,
    child_name,
    common_labels,
    multi_node,
    object_meta,
    selector_labels,
    ucx_port_range,
)


def _operator_peer(install: OperatorInstall) -> dict[str, Any]:
    peer: dict[str, Any] = {"podSelector": {"matchLabels": dict(install.pod_labels)}}
    if install.namespace is not None:
        peer["namespaceSelector"] = {
            "matchLabels": {"kubernetes.io/metadata.name": install.namespace}
        }
    return peer


def _tcp(port: int, end_port: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"port": port, "protocol": "TCP"}
    if end_port is not None:
        out["endPort"] = end_port
    return out


def build_network_policies(
    name: str,
    spec: InferenceServiceSpec,
    *,
    namespace: str,
    owner: Owner | None,
    install: OperatorInstall,
) -> list[dict[str, Any]]:
    """One ingress policy per role (docs/security.md).

    Engines: HTTP only from the service's gateway pods and the operator pod;
    the KV event ports (when the role publishes) only from the gateway pods;
    the KV side channel and the UCX port range only from the other role's
    pods (each way: a decode engine pulls a prefill leg's KV from a prefill
    engine, and with ``prefill.peerPull`` a prefill engine pulls a decode
    engine's cached blocks), and from the role's own pods when it pulls from
    its peers (``peerPull``); for multi-node roles, any port from the role's own pods (the
    rendezvous, NCCL and gloo pick their ports at run time). The gateway: its
    port from anywhere (it checks API keys itself).
    Policies add up, so a cluster admin may admit more (e.g. a Prometheus).
    """
    policies = []
    kv = disaggregating(spec) and spec.kv_transfer.connector is not None
    other = {"prefill": "decode", "decode": "prefill"}
    kv_ports = [_tcp(spec.kv_transfer.port)]
    if spec.kv_transfer.connector == "NixlConnector":
        kv_ports.append(_tcp(*ucx_port_range(spec)))
    for role in ("prefill", "decode"):
        ingress: list[dict[str, Any]] = [
            {
                "from": [
                    {"podSelector": {"matchLabels": selector_labels(name, "gateway")}},
                    _operator_peer(install),
                ],
                "ports": [_tcp(ENGINE_PORT)],
            }
        ]
        if publishes_kv_events(spec, role):
            ingress.append(
                {
                    "from": [{"podSelector": {"matchLabels": selector_labels(name, "gateway")}}],
                    "ports": [_tcp(KV_EVENTS_PORT), _tcp(KV_EVENTS_REPLAY_PORT)],
                }
            )
        if kv:
            ingress.append(
                {
                    "from": [{"podSelector": {"matchLabels": selector_labels(name, other[role])}}],
                    "ports": kv_ports,
                }
            )
        if peer_pulls(spec, role):
            # Peer pulls: the role's engines pull cached prefixes from each other.
            ingress.append(
                {
                    "from": [{"podSelector": {"matchLabels": selector_labels(name, role)}}],
                    "ports": kv_ports,
                }
            )
        if multi_node(spec, role):
            ingress.append(
                {"from": [{"podSelector": {"matchLabels": selector_labels(name, role)}}]}
            )
        policies.append((role, ingress))
    policies.append(("gateway", [{"ports": [_tcp(spec.gateway.port)]}]))
    return [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": object_meta(
                child_name(name, role), namespace, common_labels(name, role), owner
            ),
            "spec": {
                "podSelector": {"matchLabels": selector_labels(name, role)},
                "policyTypes": ["Ingress"],
                "ingress": ingress,
            },
        }
        for role, ingress in policies
    ]
