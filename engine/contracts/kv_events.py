"""KV-cache events: what an engine's prefix cache publishes, in vLLM's wire format.

External routers and the gateway's exact prefix index follow which blocks each
engine caches from these events (docs/kv_events.md). One message is multipart
``[topic, sequence, payload]``: the sequence 8 bytes big-endian
(:func:`pack_seq`), the payload vLLM's ``EventBatch``, array-like in msgpack,
``[ts, events, data_parallel_rank]`` (:meth:`EventBatch.encode`), whose events
are maps tagged by ``type``::

    {"type": "BlockStored", "block_hashes": [id, ...], "parent_block_hash": id | None,
     "token_ids": [...], "block_size": 16, "lora_id": None, "medium": "GPU",
     "lora_name": None}
    {"type": "BlockRemoved", "block_hashes": [id, ...], "medium": "GPU"}
    {"type": "AllBlocksCleared"}

Block ids are the 64-bit integers of ``block_hash.external_block_hash``. A
replay socket (ROUTER) answers a packed sequence number with every buffered
batch from there on as ``[b"", sequence, payload]``, then ``[b"", END_SEQ, b""]``.
:meth:`EventBatch.decode` reads the batches of pdfleet's engines and of vLLM's
(tagged maps, or its older arrays); an event type it does not know is skipped.

With a fleet secret, publishers are ZeroMQ CURVE servers whose key pair
derives from it (:func:`curve_server_keys`): only holders of the secret can
subscribe.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack as _msgpack  # private: other modules use the carriers, never msgpack

from .block_hash import external_block_hash
from .security import kv_events_server_key

HOST_MEDIA = frozenset({"CPU", "cpu", "host", "HOST"})
"""Tier names counted as host memory (vLLM's is ``CPU``); anything else is the device."""
END_SEQ = struct.pack(">q", -1)
"""The sequence frame that ends a replay."""


def pack_seq(seq: int) -> bytes:
    return struct.pack(">q", seq)


def unpack_seq(frame: bytes) -> int:
    """A sequence frame's number; ValueError for a frame that is not one."""
    try:
        (seq,) = struct.unpack(">q", frame)
    except struct.error as e:
        raise ValueError(f"not a sequence frame: {e}") from None
    return int(seq)


@dataclass(slots=True)
class BlockStored:
    """Blocks that entered the prefix cache: a chain (each block's parent is the
    previous one), ``token_ids`` concatenated (empty when the publisher leaves
    them out)."""

    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[int] = field(default_factory=list)
    block_size: int = 0
    medium: str | None = "GPU"

    @property
    def host(self) -> bool:
        """On the host tier (copied back before use) rather than the device."""
        return self.medium in HOST_MEDIA

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": "BlockStored",
            "block_hashes": self.block_hashes,
            "parent_block_hash": self.parent_block_hash,
            "token_ids": self.token_ids,
            "block_size": self.block_size,
            "lora_id": None,
            "medium": self.medium,
            "lora_name": None,
        }


@dataclass(slots=True)
class BlockRemoved:
    """Blocks that left the prefix cache (of one tier)."""

    block_hashes: list[int]
    medium: str | None = "GPU"

    @property
    def host(self) -> bool:
        return self.medium in HOST_MEDIA

    def to_wire(self) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": self.block_hashes, "medium": self.medium}


@dataclass(slots=True)
class AllBlocksCleared:
    """The engine's prefix cache is empty (also: a new publisher's first batch)."""

    def to_wire(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

# vLLM's older array form: the fields after the type name, in order.
_ARRAY_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
}


def _block_id(value: Any, name: str = "block_hashes") -> int:
    """An event's block hash as the 64-bit id (engines send ints; vLLM can send bytes)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value & 0xFFFF_FFFF_FFFF_FFFF
    if isinstance(value, bytes | bytearray):
        return external_block_hash(bytes(value))
    raise ValueError(f"{name}: a block hash must be an int or bytes, got {type(value).__name__}")


def _int_field(kind: str, name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{kind}: {name} must be a non-negative integer")
    return value


def _event_from_wire(raw: Any) -> KVEvent | None:
    """One event; None for a type this decoder does not know (a newer vLLM's).
    ValueError naming the field for a known event whose fields have the wrong
    types (the subscriber skips the whole batch)."""
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw:
        kind = raw[0]
        if not isinstance(kind, str):
            raise ValueError(f"an event's type must be a string, got {type(kind).__name__}")
        fields = dict(zip(_ARRAY_FIELDS.get(kind, ()), raw[1:], strict=False))
    else:
        raise ValueError(f"an event must be a tagged map, got {type(raw).__name__}")
    if not isinstance(kind, str):
        raise ValueError(f"an event's type must be a string, got {type(kind).__name__}")
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    if kind not in ("BlockStored", "BlockRemoved"):
        return None
    hashes = fields.get("block_hashes")
    if not isinstance(hashes, list):
        raise ValueError(f"{kind}: block_hashes must be a list")
    ids = [_block_id(h) for h in hashes]
    medium = fields.get("medium")
    if medium is not None and not isinstance(medium, str):
        raise ValueError(f"{kind}: medium must be a string or null")
    if kind == "BlockRemoved":
        return BlockRemoved(ids, medium)
    parent = fields.get("parent_block_hash")
    tokens = fields.get("token_ids")
    if tokens is None:
        tokens = []
    if not isinstance(tokens, list):
        raise ValueError(f"{kind}: token_ids must be a list of integers")
    token_ids = [_int_field(kind, "token_ids", t) for t in tokens]
    size = fields.get("block_size")
    return BlockStored(
        ids,
        None if parent is None else _block_id(parent, "parent_block_hash"),
        token_ids,
        0 if size is None else _int_field(kind, "block_size", size),
        medium,
    )


@dataclass(slots=True)
class EventBatch:
    """One published batch: the events of one engine step (none: a heartbeat)."""

    ts: float
    events: Sequence[KVEvent] = ()
    data_parallel_rank: int = 0

    def encode(self) -> bytes:
        """The payload: msgpack ``[ts, events, data_parallel_rank]`` (vLLM's
        array-like batch; hashes are integers, never pickles)."""
        payload: bytes = _msgpack.packb(
            [self.ts, [e.to_wire() for e in self.events], self.data_parallel_rank],
            use_bin_type=True,
        )
        return payload

    @classmethod
    def decode(cls, payload: bytes) -> EventBatch:
        """A batch payload (a map ``{ts, events, ...}`` or an array ``[ts, events,
        ...]``); ValueError, naming the field, for anything else: a malformed
        batch is skipped by the subscriber, and never raises another error."""
        try:
            batch = _msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except Exception as e:
            raise ValueError(f"not msgpack: {e}") from None
        if isinstance(batch, dict):
            ts, raw_events, rank = (
                batch.get("ts"),
                batch.get("events"),
                batch.get("data_parallel_rank"),
            )
        elif isinstance(batch, list) and len(batch) >= 2:
            ts, raw_events = batch[0], batch[1]
            rank = batch[2] if len(batch) > 2 else 0
        else:
            raise ValueError(
                "a batch must be a map {ts, events, ...} or an array [ts, events, ...]"
            )
        if not isinstance(raw_events, list):
            raise ValueError("a batch's events must be a list")
        events = [e for e in map(_event_from_wire, raw_events) if e is not None]
        return cls(
            float(ts) if isinstance(ts, int | float) else 0.0,
            events,
            rank if isinstance(rank, int) else 0,
        )


def curve_server_keys(secret: bytes) -> tuple[bytes, bytes]:
    """(public, secret) Z85 CURVE keys of a fleet's KV event publishers. A
    subscriber needs only the public one to complete the handshake, and only a
    holder of the fleet secret can derive it."""
    import zmq
    import zmq.utils.z85

    private = zmq.utils.z85.encode(kv_events_server_key(secret))
    return zmq.curve_public(private), private
