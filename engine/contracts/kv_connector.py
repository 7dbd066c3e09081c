"""The KV connector's messages between its sides, and to the rank processes' shards.

* :class:`HandshakeReply`: the producer's answer to a consumer's handshake on the
  side channel (``kv_side_channel.py`` carries it), with its :class:`KVLayoutWire`
  and, for NIXL, one :class:`ShardInfo` per rank. Decoders raise ValueError
  naming the field.
* :class:`KVConnectorMetadata`: what the connector's scheduler side hands its
  worker side with each step (vLLM's ``KVConnectorMetadata``): the pulls to
  start, one :class:`KVLoad` per request.
* Shard commands: at tensor-parallel size > 1 every rank process owns its KV
  shard's NIXL agent, which the main process drives with commands that travel
  with the next step (``worker/step_wire.py``, msgpack). Each command is a
  dataclass here with one wire form, a list whose first item names it:

  - ``["connect", key, remote_shards, runs]``: add the remote shards this shard
    reads from (their agent metadata and layouts) and the head runs to read
    (``kv_transfer/layout.py``, ``head_plan``);
  - ``["read", token, key, local_ids, remote_ids]``: post the READs that fill the
    local blocks' heads from the remote blocks;
  - ``["release", token]``, ``["forget", key]``.

  A step carries ``[rank, command]`` pairs (:class:`RankCommand`); a rank
  reports each read that ended as ``[token, state, bytes]``
  (:class:`ShardReadEnded`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from .kv_params import KVTransferParams


@dataclass(frozen=True, slots=True)
class KVLoad:
    """Blocks to pull for one consumer request (or, ``release_only``, none: the
    producer may free its lease at once because the prefix cache covers it)."""

    request_id: str
    params: KVTransferParams
    """The producer's verified params: where to pull from, under which lease."""
    local_ids: list[int]
    """This engine's blocks the pull fills, in prompt order."""
    remote_ids: list[int]
    """The producer's blocks to read, one per local block."""
    deadline: float
    """Monotonic seconds by which the pull must have finished."""
    release_only: bool = False
    chain: str | None = None
    """The hex chained hash of the leased blocks, hashed from this engine's own
    tokens: the claim or read names it, and the producer refuses it unless it is
    the chain of the blocks it leased."""


@dataclass(frozen=True, slots=True)
class KVConnectorMetadata:
    """One step's message from the connector's scheduler side to its worker side."""

    loads: tuple[KVLoad, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.loads)


def _field(data: Any, name: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{name.rsplit('.', 1)[0]}: not a map")
    return data.get(name.rsplit(".", 1)[-1])


def _wire_int(data: Any, name: str, low: int = 0) -> int:
    value = _field(data, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name}: missing or not an integer >= {low}")
    return value


def _wire_str(data: Any, name: str, limit: int = 256) -> str:
    value = _field(data, name)
    if not isinstance(value, str) or len(value) > limit:
        raise ValueError(f"{name}: missing, not a string, or over {limit} characters")
    return value


@dataclass(frozen=True, slots=True)
class KVLayoutWire:
    """An engine's KV buffer shape as the handshake states it: ``kv_transfer/
    layout.py``'s ``KVLayout`` without its address (a READ needs only each
    shard's base, which :class:`ShardInfo` carries)."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    element_size: int
    device: str
    """``cpu`` or ``cuda:N``."""

    def to_wire(self) -> dict[str, Any]:
        # Exactly the wire's fields, in their order (a subclass's own stay out).
        return {f.name: getattr(self, f.name) for f in fields(KVLayoutWire)}

    @classmethod
    def from_wire(cls, data: Any, name: str = "layout") -> KVLayoutWire:
        """ValueError naming the field for a missing or mistyped one."""
        return cls(
            _wire_int(data, f"{name}.num_layers", 1),
            _wire_int(data, f"{name}.num_blocks", 1),
            _wire_int(data, f"{name}.block_size", 1),
            _wire_int(data, f"{name}.num_kv_heads", 1),
            _wire_int(data, f"{name}.head_dim", 1),
            _wire_str(data, f"{name}.dtype", 64),
            _wire_int(data, f"{name}.element_size", 1),
            _wire_str(data, f"{name}.device", 64),
        )


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """What a consumer's shard needs to READ one KV shard of a producer: its NIXL
    agent's metadata (UCX address, memory keys), where its buffer starts, and
    which KV heads it holds. The producer's handshake lists one per rank; a rank
    process reports its own to the main process when it is ready."""

    rank: int
    agent_metadata: bytes
    base_address: int
    """The shard's KV buffer address in the producer's memory."""
    device_id: int
    num_blocks: int
    num_kv_heads: int
    """KV heads of this shard (the model's, divided over the producer's ranks)."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "agent_metadata": self.agent_metadata,
            "base_address": self.base_address,
            "device_id": self.device_id,
            "num_blocks": self.num_blocks,
            "num_kv_heads": self.num_kv_heads,
        }

    @classmethod
    def from_wire(cls, data: Any, name: str = "shard") -> ShardInfo:
        """ValueError naming the field for a missing or mistyped one."""
        meta = _field(data, f"{name}.agent_metadata")
        if not isinstance(meta, bytes) or not meta:
            raise ValueError(f"{name}.agent_metadata: missing or not bytes")
        return cls(
            _wire_int(data, f"{name}.rank"),
            meta,
            _wire_int(data, f"{name}.base_address"),
            _wire_int(data, f"{name}.device_id"),
            _wire_int(data, f"{name}.num_blocks", 1),
            _wire_int(data, f"{name}.num_kv_heads", 1),
        )


@dataclass(frozen=True, slots=True)
class HandshakeReply:
    """The producer's answer to a consumer's KV handshake (sent inside the side
    channel's authenticated auth answer): who it is, what its KV must match, its
    layout and its transport; a NIXL producer adds ``tp_size`` and one
    :class:`ShardInfo` per rank. Wire form: a map, ``{"ok": true, "version",
    "engine_id", "instance_id", "compat", "compat_hash", "layout",
    "transport"}`` plus ``tp_size`` and ``shards`` when there are shards."""

    version: int
    engine_id: str
    instance_id: str
    compat: dict[str, Any]
    """The compatibility factors (``layout.COMPAT_FIELDS``) the consumer compares."""
    compat_hash: str
    layout: KVLayoutWire
    transport: str
    """The producer's transport's name (``nixl``, ``zmq``): the consumer's must match."""
    tp_size: int | None = None
    shards: list[ShardInfo] | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "ok": True,
            "version": self.version,
            "engine_id": self.engine_id,
            "instance_id": self.instance_id,
            "compat": self.compat,
            "compat_hash": self.compat_hash,
            "layout": self.layout.to_wire(),
            "transport": self.transport,
        }
        if self.shards is not None:
            wire["tp_size"] = self.tp_size
            wire["shards"] = [s.to_wire() for s in self.shards]
        return wire

    @classmethod
    def from_wire(cls, data: Any) -> HandshakeReply:
        """ValueError naming the field for a missing or mistyped one. Whether the
        values fit this engine (compat, layout, shard heads) is the connector's
        check, which names what differs."""
        if not isinstance(data, dict) or data.get("ok") is not True:
            raise ValueError("ok: a handshake reply is a map with ok true")
        compat = data.get("compat")
        if not isinstance(compat, dict) or not all(isinstance(k, str) for k in compat):
            raise ValueError("compat: missing or not a map of factors")
        raw_shards = data.get("shards")
        shards = None
        tp_size = None
        if raw_shards is not None:
            if not isinstance(raw_shards, list):
                raise ValueError("shards: not a list")
            shards = [ShardInfo.from_wire(s, f"shards[{i}]") for i, s in enumerate(raw_shards)]
            tp_size = _wire_int(data, "tp_size", 1)
        return cls(
            _wire_int(data, "version"),
            _wire_str(data, "engine_id"),
            _wire_str(data, "instance_id"),
            compat,
            _wire_str(data, "compat_hash", 128),
            KVLayoutWire.from_wire(data.get("layout")),
            _wire_str(data, "transport", 64),
            tp_size,
            shards,
        )


@dataclass(frozen=True, slots=True)
class ShardConnect:
    key: str
    """Names the producer (engine, instance, address) in later commands."""
    remote_shards: list[ShardInfo]
    """The producer's shards this shard reads from."""
    runs: list[list[int]]
    """``layout.HeadRun`` fields, one list per run of heads to read."""

    def to_wire(self) -> list[Any]:
        return ["connect", self.key, [s.to_wire() for s in self.remote_shards], self.runs]


@dataclass(frozen=True, slots=True)
class ShardRead:
    token: int
    key: str
    local_ids: list[int]
    remote_ids: list[int]

    def to_wire(self) -> list[Any]:
        return ["read", self.token, self.key, self.local_ids, self.remote_ids]


@dataclass(frozen=True, slots=True)
class ShardRelease:
    token: int

    def to_wire(self) -> list[Any]:
        return ["release", self.token]


@dataclass(frozen=True, slots=True)
class ShardForget:
    key: str

    def to_wire(self) -> list[Any]:
        return ["forget", self.key]


ShardCommand = ShardConnect | ShardRead | ShardRelease | ShardForget


def shard_command_from_wire(wire: Sequence[Any]) -> ShardCommand:
    """The command of a wire list; ValueError for an unknown or malformed one."""
    if not isinstance(wire, list | tuple) or not wire:
        raise ValueError("malformed shard command: not a non-empty list")
    op, *args = wire
    try:
        if op == "connect":
            key, remotes, runs = args
            shards = [ShardInfo.from_wire(r, "remote shard") for r in remotes]
            return ShardConnect(str(key), shards, [list(r) for r in runs])
        if op == "read":
            token, key, local_ids, remote_ids = args
            return ShardRead(int(token), str(key), list(local_ids), list(remote_ids))
        if op == "release":
            (token,) = args
            return ShardRelease(int(token))
        if op == "forget":
            (key,) = args
            return ShardForget(str(key))
    except (TypeError, ValueError) as e:
        raise ValueError(f"malformed shard command {op!r}: {e}") from None
    raise ValueError(f"unknown shard command {op!r}")


@dataclass(frozen=True, slots=True)
class RankCommand:
    """A shard command for one rank process."""

    rank: int
    command: ShardCommand


def encode_rank_commands(commands: Sequence[RankCommand]) -> list[list[Any]]:
    """``[rank, command]`` pairs, as a step carries them."""
    return [[c.rank, c.command.to_wire()] for c in commands]


def decode_rank_commands(wire: Sequence[Sequence[Any]]) -> list[RankCommand]:
    """ValueError for anything but ``[rank, command]`` pairs of known commands."""
    try:
        return [RankCommand(int(rank), shard_command_from_wire(cmd)) for rank, cmd in wire]
    except TypeError as e:
        raise ValueError(f"malformed rank commands: {e}") from None


@dataclass(frozen=True, slots=True)
class ShardReadEnded:
    """A read that ended on one shard: ``state`` DONE or ERR, ``nbytes`` read (0 unless DONE)."""

    token: int
    state: str
    nbytes: int = field(default=0)
