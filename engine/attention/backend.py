"""The attention backend interface and the per-step metadata it reads.

Contract (shared with the Triton kernels in ``pdfleet.kernels``):

* KV cache per layer: ``k_cache``, ``v_cache`` ``[num_blocks, block_size,
  num_kv_heads, head_dim]``; a token's slot is ``block_id * block_size +
  offset``; slot ``-1`` is padding.
* The step's new keys/values are written into the cache first; attention then
  reads every key (cached prefix and new tokens) from the cache.
* Tokens of all sequences are flattened in batch order. Sequence ``s`` has
  ``query_start_loc[s+1] - query_start_loc[s]`` new tokens at positions
  ``[seq_lens[s] - q_len, seq_lens[s])``; the query at position i sees keys
  j <= i (and i - j < sliding_window when set).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    num_tokens: int
    num_seqs: int
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32 (context after this step)
    block_table: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = padding
    max_query_len: int
    max_seq_len: int
    # Host copies for backends that loop over sequences.
    query_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    # Backend-specific tensors computed once per step and reused by every layer.
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend:
    """Writes the step's K/V into the paged cache and attends over it."""

    name = "base"

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Per-step precomputation shared by all layers (optional)."""

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        raise NotImplementedError
