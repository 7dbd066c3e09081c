"""KV transfer between prefill (producer) and decode (consumer) engines."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from .hashing import hash_factors

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KVLoadFailurePolicy = Literal["recompute", "fail"]
KNOWN_CONNECTORS = ("NixlConnector", "ZmqConnector")
DEFAULT_LEASE_SECONDS = 30.0
KV_IP_ENV = "PDFLEET_KV_IP"
"""This node's address for KV traffic (the operator sets the pod's IP on every
engine pod); it wins over ``kv_transfer_config.kv_ip``."""
KV_BIND_IP_ENV = "PDFLEET_KV_BIND_IP"
"""The address to bind KV traffic's sockets on, when it is not the advertised one
(behind NAT)."""


def kv_host(kv: KVTransferConfig | None) -> str | None:
    """The address consumers reach this node's KV traffic at: ``$PDFLEET_KV_IP``,
    else a configured connector's ``kv_ip``; None for an engine with neither."""
    if os.environ.get(KV_IP_ENV):
        return os.environ[KV_IP_ENV]
    if kv is not None and kv.kv_connector is not None:
        return kv.kv_ip
    return None


def kv_bind_host(kv: KVTransferConfig | None) -> str | None:
    """The address this node's KV sockets (the side channel, the KV-event
    publisher) bind: ``$PDFLEET_KV_BIND_IP``, else :func:`kv_host`."""
    return os.environ.get(KV_BIND_IP_ENV) or kv_host(kv)


@dataclass
class KVTransferConfig:
    """Disaggregated prefill/decode: which connector moves KV blocks and in
    which role this engine runs. Field names follow vLLM's so the same
    `--kv-transfer-config` JSON drives either engine."""

    kv_connector: str | None = None
    """Connector: `NixlConnector` (NIXL over UCX) or `ZmqConnector` (block
    bytes over ZeroMQ, for machines without NIXL)."""
    engine_id: str | None = None
    """Unique id of this engine in the fleet; a random UUID when unset."""
    kv_role: KVRole | None = None
    """`kv_producer` (prefill), `kv_consumer` (decode) or `kv_both`."""
    kv_ip: str = "127.0.0.1"
    """Host the connector's side channel advertises to peers (the pod IP in
    Kubernetes)."""
    kv_port: int = 14579
    """Port of the connector's side channel (handshakes, notifications and,
    for ZmqConnector, block bytes)."""
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    """Connector options, e.g. `lease_seconds` (how long a producer holds
    blocks for a consumer, default 30), `backends` (NIXL backends, default
    ["UCX"]), `handshake_timeout_seconds`, `transfer_timeout_seconds`."""
    kv_load_failure_policy: KVLoadFailurePolicy = "recompute"
    """When a consumer cannot pull the prompt's KV: `recompute` it locally (the
    request still completes) or `fail` the request with a clear error."""

    def __post_init__(self) -> None:
        if self.kv_connector is not None and self.kv_connector not in KNOWN_CONNECTORS:
            raise ValueError(
                f"kv_transfer_config.kv_connector {self.kv_connector!r} is not supported; "
                f"use one of {', '.join(KNOWN_CONNECTORS)}"
            )
        if self.kv_connector is not None and self.kv_role is None:
            raise ValueError(
                "kv_transfer_config.kv_role must be set when kv_connector is set "
                "(kv_producer, kv_consumer or kv_both)"
            )
        if self.kv_role is not None and self.kv_role not in (
            "kv_producer",
            "kv_consumer",
            "kv_both",
        ):
            raise ValueError(
                f"kv_transfer_config.kv_role {self.kv_role!r} is not one of "
                "kv_producer, kv_consumer, kv_both"
            )
        if self.kv_role is not None and self.kv_connector is None:
            raise ValueError("kv_transfer_config.kv_connector must be set when kv_role is set")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError(
                f"kv_transfer_config.kv_load_failure_policy {self.kv_load_failure_policy!r} is "
                "not one of recompute, fail"
            )
        if not 0 < self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config.kv_port {self.kv_port} is not a valid port")
        lease = self.kv_connector_extra_config.get("lease_seconds", DEFAULT_LEASE_SECONDS)
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) or lease <= 0:
            raise ValueError(
                f"kv_transfer_config.kv_connector_extra_config.lease_seconds must be a positive "
                f"number, got {lease!r}"
            )
        if self.engine_id is None:
            self.engine_id = str(uuid.uuid4())

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def lease_seconds(self) -> float:
        return float(self.kv_connector_extra_config.get("lease_seconds", DEFAULT_LEASE_SECONDS))

    def compute_hash(self) -> str:
        # Moving KV between engines does not change what a forward pass computes.
        return hash_factors([])
