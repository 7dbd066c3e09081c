"""Megatron-style tensor-parallel layers and the per-rank weight slices.

Column-parallel projections (q/k/v, gate/up) keep a contiguous slice of the
output features on each rank and need no communication: their outputs feed
the rank's own attention heads or its slice of the MLP. Row-parallel ones
(o, down) take the matching slice of the input features and sum the partial
outputs with one all-reduce. The embedding and the LM head split the
vocabulary: the embedding all-reduces the rows each rank owns, the head
all-gathers the logits (so tied embeddings share the one shard).

KV heads are sharded like the query heads when there are at least as many as
ranks; with fewer, each KV head is replicated on ``tp / num_kv_heads`` ranks
(the ones whose query heads use it). Every rank reads only its slice of each
checkpoint tensor (safetensors ``get_slice``). At TP=1 every layer here is
the plain one. See docs/parallelism.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ..config.parallel import check_heads_split
from ..distributed import TPGroup, get_tp_group
from ..lora.ops import LoRAContext, LoRAShard, apply_lora


@dataclass(frozen=True)
class HeadSplit:
    """Which attention heads one rank computes."""

    num_heads: int
    num_kv_heads: int
    tp_size: int
    tp_rank: int

    def __post_init__(self) -> None:
        check_heads_split(self.num_heads, self.num_kv_heads, self.tp_size)

    @property
    def num_local_heads(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def num_local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def first_kv_head(self) -> int:
        """The rank's first KV head (global index)."""
        if self.num_kv_heads >= self.tp_size:
            return self.tp_rank * self.num_local_kv_heads
        # Replicated: ranks [h * tp / kv, (h + 1) * tp / kv) share KV head h.
        return self.tp_rank * self.num_kv_heads // self.tp_size


def vocab_per_rank(vocab_size: int, tp_size: int) -> int:
    """Rows of the embedding / LM head on each rank (the vocabulary padded up)."""
    return -(-vocab_size // tp_size)


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W split on its input features; one all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = get_tp_group()
        if in_features % self.tp.size:
            raise ValueError(
                f"--tensor-parallel-size {self.tp.size} does not divide {in_features} features"
            )
        local = in_features // self.tp.size
        self.weight = nn.Parameter(torch.empty(out_features, local, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        # LoRA slots and the step's adapter batch (engine/lora/manager.py). Each
        # rank's A holds its slice of the input features: its partial delta joins
        # its partial output before the all-reduce sums them.
        self.lora: tuple[list[LoRAShard], LoRAContext] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = self.lora[1].batch if self.lora is not None else None
        if self.tp.size == 1:
            y = nn.functional.linear(x, self.weight, self.bias)
            if lora is not None and self.lora is not None:
                apply_lora(x, y, self.lora[0], lora)
            return y
        y = nn.functional.linear(x, self.weight)
        if lora is not None and self.lora is not None:
            apply_lora(x, y, self.lora[0], lora)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over the ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.vocab_size = vocab_size
        rows = vocab_per_rank(vocab_size, self.tp.size)
        self.start = self.tp.rank * rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(out)


def lm_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[tokens, vocab] logits from a vocab-parallel head (or tied embedding) shard."""
    tp = get_tp_group()
    logits = nn.functional.linear(hidden, weight)
    if tp.size == 1:
        return logits
    return tp.all_gather(logits, dim=-1)[:, :vocab_size]


class Sliceable(Protocol):
    """A torch tensor or a safetensors slice (``get_slice``): indexing it reads a tensor."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...


class WeightSlicer:
    """Cuts one rank's slice out of each checkpoint tensor.

    ``tensor`` may be a torch tensor or a safetensors slice (``get_slice``):
    both index the same way, and a slice reads only the rows or columns asked.
    Names are Hugging Face's (``model.layers.0.self_attn.q_proj.weight``).
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        intermediate_size: int,
        vocab_size: int,
        tp: TPGroup,
    ) -> None:
        self.tp = tp
        self.heads = HeadSplit(num_heads, num_kv_heads, tp.size, tp.rank)
        self.head_dim = head_dim
        self.inter = intermediate_size // tp.size
        self.vocab_size = vocab_size
        self.vocab_rows = vocab_per_rank(vocab_size, tp.size)

    def __call__(self, name: str, tensor: Sliceable) -> torch.Tensor:
        parts = name.split(".")
        module, param = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])
        r, d, h = self.tp.rank, self.head_dim, self.heads
        if module == "q_proj":
            n = h.num_local_heads * d
            return tensor[r * n : (r + 1) * n]
        if module in ("k_proj", "v_proj"):
            start = h.first_kv_head * d
            return tensor[start : start + h.num_local_kv_heads * d]
        if module in ("gate_proj", "up_proj"):
            return tensor[r * self.inter : (r + 1) * self.inter]
        if module == "o_proj" and param == "weight":
            n = h.num_local_heads * d
            return tensor[:, r * n : (r + 1) * n]
        if module == "down_proj" and param == "weight":
            return tensor[:, r * self.inter : (r + 1) * self.inter]
        if module in ("embed_tokens", "lm_head"):
            start = r * self.vocab_rows
            rows = tensor[start : min(start + self.vocab_rows, self.vocab_size)]
            if rows.shape[0] < self.vocab_rows:  # the last rank: pad the vocabulary
                pad = rows.new_zeros(self.vocab_rows - rows.shape[0], *rows.shape[1:])
                rows = torch.cat([rows, pad])
            return rows
        return tensor[:]
