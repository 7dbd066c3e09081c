"""Where each KV block lives in memory, and what must match between engines."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from ..contracts.kv_connector import KVLayoutWire


class IncompatibleKV(Exception):
    """Two engines cannot exchange KV (different model, dtype, layout...)."""


# Compatibility factors checked before any transfer, in the order they are reported.
COMPAT_FIELDS = (
    "pdfleet_version",
    "model",
    "revision",
    "architecture",
    "dtype",
    "kv_cache_dtype",
    "block_size",
    "num_layers",
    "num_kv_heads",
    "head_dim",
)


@dataclass(frozen=True)
class KVLayout(KVLayoutWire):
    """The engine's KV buffer: ``[num_layers, 2 (K, V), num_blocks, block_size, kv_heads,
    head_dim]``, one contiguous region. A block of one layer and kind is contiguous.
    The shape is the handshake's :class:`KVLayoutWire`; this adds where it lives."""

    base_address: int = 0

    @classmethod
    def of(cls, buffer: torch.Tensor) -> KVLayout:
        layers, two, blocks, bs, heads, dim = buffer.shape
        if two != 2 or not buffer.is_contiguous():
            raise ValueError(
                "the KV buffer must be contiguous [layers, 2, blocks, block_size, heads, dim]"
            )
        return cls(
            layers,
            blocks,
            bs,
            heads,
            dim,
            str(buffer.dtype).replace("torch.", ""),
            buffer.element_size(),
            str(buffer.device),
            base_address=buffer.data_ptr(),
        )

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def num_regions(self) -> int:
        """Descriptors per engine: one per (layer, K/V, block)."""
        return self.num_layers * 2 * self.num_blocks

    def region_index(self, layer: int, kind: int, block: int) -> int:
        return (layer * 2 + kind) * self.num_blocks + block

    def region_address(self, index: int) -> int:
        return self.base_address + index * self.block_bytes

    def indices(self, block_ids: list[int]) -> list[int]:
        """Descriptor indices for whole blocks: every layer, K then V."""
        return [
            self.region_index(layer, kind, b)
            for layer in range(self.num_layers)
            for kind in (0, 1)
            for b in block_ids
        ]

    def shape_mismatch(self, other: KVLayout) -> str | None:
        """What differs between two shards' block shapes, or None. KV heads per shard
        may differ (unequal TP sizes): ``head_plan`` maps them."""
        for name in ("num_layers", "block_size", "head_dim", "dtype"):
            if getattr(self, name) != getattr(other, name):
                return (
                    f"{name} differs (this engine {getattr(self, name)}, remote "
                    f"{getattr(other, name)})"
                )
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def wire(self) -> KVLayoutWire:
        """The layout as a handshake states it (no address)."""
        return KVLayoutWire(**{f.name: getattr(self, f.name) for f in fields(KVLayoutWire)})

    @classmethod
    def of_wire(cls, wire: KVLayoutWire, base_address: int = 0) -> KVLayout:
        """A peer's layout from its handshake (``base_address``: unknown, 0)."""
        return cls(
            **{f.name: getattr(wire, f.name) for f in fields(KVLayoutWire)},
            base_address=base_address,
        )


def rank_heads(rank: int, tp_size: int, num_kv_heads: int) -> tuple[int, int]:
    """(first global KV head, count) in the shard of ``rank`` out of ``tp_size``: a
    contiguous range when the heads are sharded, one replicated head when there are
    fewer heads than ranks (as ``models/parallel.py`` splits them)."""
    if num_kv_heads >= tp_size:
        per = num_kv_heads // tp_size
        return rank * per, per
    return rank * num_kv_heads // tp_size, 1


def tp_layout_mismatch(tp_size: Any, num_kv_heads: int) -> str | None:
    """Why KV heads cannot be laid out over ``tp_size`` ranks, or None."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        return f"tp_size must be a positive rank count, got {tp_size!r}"
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        return (
            f"tp_size {tp_size} cannot hold the model's {num_kv_heads} KV heads (one must "
            "divide the other), so its KV shards cannot be mapped onto this engine's"
        )
    return None


@dataclass(frozen=True)
class HeadRun:
    """Consecutive KV heads one local shard reads from one remote shard."""

    remote_rank: int
    remote_head: int  # first head, counted within the remote shard
    local_head: int  # first head, counted within the local shard
    num_heads: int


def head_plan(local_rank: int, local_tp: int, remote_tp: int, num_kv_heads: int) -> list[HeadRun]:
    """Which slices of which remote shards fill the KV heads of local shard ``local_rank``.

    Every local head is read exactly once: from the remote rank that holds it
    (when the remote side replicates heads, from one replica, chosen by the local
    rank so that the replicas share the load). Adjacent heads of one remote shard
    are merged into one run."""
    first, count = rank_heads(local_rank, local_tp, num_kv_heads)
    runs: list[HeadRun] = []
    for i, head in enumerate(range(first, first + count)):
        if num_kv_heads >= remote_tp:
            per = num_kv_heads // remote_tp
            rank, offset = head // per, head % per
        else:
            replicas = remote_tp // num_kv_heads
            rank, offset = head * replicas + local_rank % replicas, 0
        last = runs[-1] if runs else None
        if (
            last is not None
            and last.remote_rank == rank
            and last.remote_head + last.num_heads == offset
        ):
            runs[-1] = HeadRun(rank, last.remote_head, last.local_head, last.num_heads + 1)
        else:
            runs.append(HeadRun(rank, offset, i, 1))
    return runs


def compat_mismatch(ours: Mapping[str, Any], theirs: Mapping[str, Any] | None) -> str | None:
    """A message naming the first factor that differs, or None."""
    if not theirs:
        return None
    for name in COMPAT_FIELDS:
        if name in theirs and theirs[name] != ours.get(name):
            return (
                f"the prefill engine's {name} ({theirs[name]!r}) differs from this engine's "
                f"({ours.get(name)!r}); engines must match in {', '.join(COMPAT_FIELDS)} "
                "to exchange KV"
            )
    return None
