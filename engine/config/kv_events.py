"""Publishing KV-cache events (block stored / removed) for external routers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .hashing import hash_factors


@dataclass
class KVEventsConfig:
    """KV-cache event publishing."""

    enable_kv_cache_events: bool = False
    """Publish an event whenever a full block enters or leaves the prefix cache."""
    publisher: Literal["null", "zmq"] | None = None
    """Where events go: `zmq` (a PUB socket) or `null`. Unset: `zmq` when
    events are enabled, else `null`."""
    endpoint: str = "tcp://*:5557"
    """ZMQ endpoint the publisher binds. A `*` host binds the engine's KV
    address instead when it has one ($PDFLEET_KV_BIND_IP, $PDFLEET_KV_IP, or
    kv_transfer_config.kv_ip), as the KV side channel does."""
    replay_endpoint: str | None = None
    """ZMQ ROUTER endpoint serving replays of recent batches by sequence number."""
    buffer_steps: int = 10_000
    """Number of recent batches kept for replay."""
    hwm: int = 100_000
    """ZMQ high-water mark of the PUB socket."""
    max_queue_size: int = 100_000
    """Maximum number of batches waiting to be published."""
    topic: str = ""
    """Topic prefix of published messages."""
    include_token_ids: bool = False
    """Put each stored block's token ids in `BlockStored.token_ids` (vLLM's
    router wants them). Off: an empty list; the block hashes alone say which
    prefixes are cached, without the prompt's tokens."""
    auth: Literal["fleet", "none"] | None = None
    """Who may subscribe: `fleet` (ZeroMQ CURVE with keys derived from the
    fleet secret: only fleet members can complete the handshake, and the
    stream is encrypted) or `none` (anyone who reaches the port, e.g. vLLM's
    router). Unset: `fleet` when the engine has a fleet secret, else `none`."""
    heartbeat_interval: float = 1.0
    """Seconds of quiet after which the publisher sends an empty batch, so a
    subscriber (the gateway's prefix index) can tell an idle engine from a
    lost stream."""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.auth not in (None, "fleet", "none"):
            raise ValueError(f"kv_events_config.auth must be fleet or none, got {self.auth!r}")
        if self.publisher not in ("null", "zmq"):
            raise ValueError(
                f"kv_events_config.publisher must be null or zmq, got {self.publisher!r}"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv_events_config.{name} must be >= 1")
        if not self.heartbeat_interval > 0:
            raise ValueError(
                f"kv_events_config.heartbeat_interval must be > 0 seconds, "
                f"got {self.heartbeat_interval}"
            )

    def compute_hash(self) -> str:
        return hash_factors([])
