"""Rotary position embeddings: frequency tables (default, linear, llama3) and rotation."""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(head_dim: int, rope: dict[str, Any]) -> torch.Tensor:
    """float32 [head_dim / 2] inverse frequencies, with the model's RoPE scaling."""
    base = float(rope.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (
        base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim)
    )
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(rope["factor"])
    if kind == "llama3":
        factor = float(rope["factor"])
        low_freq_factor = float(rope["low_freq_factor"])
        high_freq_factor = float(rope["high_freq_factor"])
        old_context_len = float(rope["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {kind!r}")


def cos_sin_cache(head_dim: int, max_position: int, rope: dict[str, Any]) -> torch.Tensor:
    """float32 [max_position, head_dim]: cos in the first half, sin in the second."""
    inv_freq = inverse_frequencies(head_dim, rope)
    positions = torch.arange(max_position, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim / 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation (HF ``rotate_half``). x [T, heads, D]; cos/sin [T, D/2]."""
    half = x.shape[-1] // 2
    cos = torch.cat([cos, cos], dim=-1).unsqueeze(1).to(x.dtype)
    sin = torch.cat([sin, sin], dim=-1).unsqueeze(1).to(x.dtype)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim, self.max_position, self.rope = head_dim, max_position, dict(rope)
        if torch.get_default_device().type == "meta":
            # Built on meta, filled by reset_cache() once on its device: computing the
            # table on meta would only cost the first meta op's lazy imports (~2 s).
            cache = torch.empty(max_position, head_dim, dtype=torch.float32)
        else:
            cache = cos_sin_cache(head_dim, max_position, rope)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def reset_cache(self) -> None:
        device = self.cos_sin_cache.device
        self.cos_sin_cache = cos_sin_cache(self.head_dim, self.max_position, self.rope).to(device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
