"""Rotary position embeddings for the Llama family.

The frequency tables (rope types default, linear and llama3) and the rotation
are ``pdfleet.kernels.rotary``'s; this module holds one model's cos/sin cache
and applies it through :mod:`.fused`.
"""

from __future__ import annotations

from typing import Any

import torch

from . import fused


def cos_sin_cache(head_dim: int, max_position: int, rope: dict[str, Any]) -> torch.Tensor:
    """float32 [max_position, head_dim]: cos in the first half, sin in the second."""
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    theta = float(rope.get("rope_theta", 10000.0))
    cache: torch.Tensor = fused.kernels().build_cos_sin_cache(
        head_dim, max_position, theta, scaling
    )
    return cache


class RotaryEmbedding(torch.nn.Module):
    cos_sin_cache: torch.Tensor  # [max_position, head_dim] float32, a non-persistent buffer

    def __init__(self, head_dim: int, max_position: int, rope: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim, self.max_position, self.rope = head_dim, max_position, dict(rope)
        self.fused = False  # see fused.use_kernels
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
        """Rotates q and k in place; returns them."""
        return fused.rotary(positions, q, k, self.cos_sin_cache, self.fused)
