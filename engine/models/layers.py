"""Layers shared by the Llama-family models."""

from __future__ import annotations

import torch
from torch import nn

from ..attention.backend import AttentionBackend, AttentionMetadata
from ..distributed import get_tp_group
from ..lora.ops import LoRAContext, LoRAShard, apply_lora
from . import fused
from .parallel import HeadSplit, RowParallelLinear


class RMSNorm(nn.Module):
    """HF Llama semantics: normalize in float32, cast back, then scale."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps
        self.fused = False  # see fused.use_kernels

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return fused.rms_norm(x, self.weight, self.eps, residual, self.fused)


class MergedLinear(nn.Module):
    """One matmul for several HF projections (q/k/v, gate/up): shards stacked on
    the output dimension, loaded by name."""

    def __init__(
        self, in_features: int, shard_sizes: dict[str, int], bias: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size
        self.weight = nn.Parameter(torch.empty(offset, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(offset, dtype=dtype)) if bias else None
        # LoRA slots per shard and the step's adapter batch (engine/lora/manager.py).
        self.lora: tuple[list[LoRAShard], LoRAContext] | None = None

    def load_shard(self, shard: str, param: str, tensor: torch.Tensor) -> None:
        start, size = self.shard_offsets[shard]
        target = self.weight if param == "weight" else self.bias
        if target is None:
            raise RuntimeError(f"no {param} to load for shard {shard}")
        if tensor.shape[0] != size:
            raise ValueError(f"shard {shard}.{param}: expected {size} rows, got {tensor.shape[0]}")
        with torch.no_grad():
            target[start : start + size].copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight, self.bias)
        if self.lora is not None and self.lora[1].batch is not None:
            apply_lora(x, y, self.lora[0], self.lora[1].batch)
        return y


class Attention(nn.Module):
    def __init__(
        self,
        layer_idx: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm_eps: float | None,
        sliding_window: int | None,
        rotary: nn.Module,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        # This rank's heads (all of them at TP=1); see models/parallel.py.
        tp = get_tp_group()
        heads = HeadSplit(num_heads, num_kv_heads, tp.size, tp.rank)
        num_heads, num_kv_heads = heads.num_local_heads, heads.num_local_kv_heads
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self.qkv_proj = MergedLinear(
            hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}, qkv_bias, dtype
        )
        self.o_proj = RowParallelLinear(self.q_size * tp.size, hidden_size, o_bias, dtype)
        # Qwen3: RMSNorm over each head's vector of q and k, before RoPE.
        self.q_norm = RMSNorm(head_dim, qk_norm_eps, dtype) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps, dtype) if qk_norm_eps is not None else None
        self.rotary = rotary

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = backend.forward(
            q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window
        )
        projected: torch.Tensor = self.o_proj(out.reshape(num_tokens, self.q_size))
        return projected


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        intermediate_size //= get_tp_group().size  # this rank's slice
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedLinear(
            hidden_size, {"gate": intermediate_size, "up": intermediate_size}, False, dtype
        )
        self.down_proj = RowParallelLinear(
            intermediate_size * get_tp_group().size, hidden_size, False, dtype
        )
        self.fused = False  # see fused.use_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down: torch.Tensor = self.down_proj(fused.silu_and_mul(self.gate_up_proj(x), self.fused))
        return down
