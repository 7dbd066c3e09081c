"""The KV connector's messages between its sides, and to the rank processes' shards.

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
from dataclasses import dataclass, field
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


@dataclass(frozen=True, slots=True)
class ShardConnect:
    key: str
    """Names the producer (engine, instance, address) in later commands."""
    remote_shards: list[dict[str, Any]]
    """The producer's shards this shard reads from (``nixl_shard.shard_info``)."""
    runs: list[list[int]]
    """``layout.HeadRun`` fields, one list per run of heads to read."""

    def to_wire(self) -> list[Any]:
        return ["connect", self.key, self.remote_shards, self.runs]


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
            return ShardConnect(str(key), list(remotes), [list(r) for r in runs])
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
