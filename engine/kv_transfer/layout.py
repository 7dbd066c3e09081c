"""Where each KV block lives in memory, and what must match between engines."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch


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
class KVLayout:
    """The engine's KV buffer: ``[num_layers, 2 (K, V), num_blocks, block_size, kv_heads,
    head_dim]``, one contiguous region. A block of one layer and kind is contiguous."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    element_size: int
    base_address: int
    device: str  # "cpu" or "cuda:N"

    @classmethod
    def of(cls, buffer: torch.Tensor) -> KVLayout:
        layers, two, blocks, bs, heads, dim = buffer.shape
        assert two == 2 and buffer.is_contiguous()
        return cls(
            layers,
            blocks,
            bs,
            heads,
            dim,
            str(buffer.dtype).replace("torch.", ""),
            buffer.element_size(),
            buffer.data_ptr(),
            str(buffer.device),
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
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype"):
            if getattr(self, name) != getattr(other, name):
                return (
                    f"{name} differs (this engine {getattr(self, name)}, remote "
                    f"{getattr(other, name)})"
                )
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compat_mismatch(ours: dict[str, Any], theirs: dict[str, Any] | None) -> str | None:
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
