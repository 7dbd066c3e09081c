"""Rotary position embedding, applied in place to queries and keys.

``cos_sin_cache`` ``[max_position, rot_dim]`` holds ``cos`` of each position's
angles in its first ``rot_dim / 2`` columns and ``sin`` in the rest;
:func:`build_cos_sin_cache` builds it the way ``transformers`` computes its
rotary frequencies (rope types ``default``, ``linear`` and ``llama3``).

Neox style (``is_neox=True``, Hugging Face's ``rotate_half``) pairs element
``i`` with ``i + rot_dim / 2``; GPT-J style pairs ``2i`` with ``2i + 1``. The
first ``rot_dim`` elements of each head are rotated, the rest left as they are.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import triton
import triton.language as tl

from ._common import check_rows, check_same_device, check_tensor, require


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _rotate_heads(  # type: ignore[no-untyped-def]  # triton reads parameter annotations (only tl.constexpr)
    x_ptr,
    stride,  # elements between tokens
    token,
    cos,  # [1, BLOCK_HALF] float32
    sin,
    num_heads,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,  # rot_dim // 2
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    i = tl.arange(0, BLOCK_HALF)[None, :]
    if IS_NEOX:
        first = i
        second = i + HALF
    else:
        first = 2 * i
        second = 2 * i + 1
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)[:, None]
        mask = (heads < num_heads) & (i < HALF)
        base = x_ptr + token * stride + heads * HEAD_DIM
        x1 = tl.load(base + first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + second, mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        tl.store(base + first, o1.to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(base + second, o2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _rotary_kernel(  # type: ignore[no-untyped-def]  # triton reads parameter annotations (only tl.constexpr)
    positions_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    q_stride,
    k_stride,
    num_heads,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    row = cache_ptr + pos * (2 * HALF)
    cos = tl.load(row + i, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr, q_stride, token, cos, sin, num_heads, HEAD_DIM, HALF, BLOCK_H, BLOCK_HALF, IS_NEOX
    )
    _rotate_heads(
        k_ptr, k_stride, token, cos, sin, num_kv_heads, HEAD_DIM, HALF, BLOCK_H, BLOCK_HALF, IS_NEOX
    )


def _check(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> None:
    check_tensor("positions", positions, (None,), (torch.int64, torch.int32))
    num_tokens = positions.shape[0]
    check_tensor("q", q, (num_tokens, None, head_dim))
    check_tensor("k", k, (num_tokens, None, head_dim), (q.dtype,))
    check_tensor("cos_sin_cache", cos_sin_cache, (None, None))
    rot_dim = cos_sin_cache.shape[1]
    require(
        rot_dim % 2 == 0 and 0 < rot_dim <= head_dim,
        f"cos_sin_cache's width (rot_dim) must be even and at most head_dim {head_dim}, "
        f"got {rot_dim}",
    )
    check_rows("q", q)
    check_rows("k", k)
    require(cos_sin_cache.is_contiguous(), "cos_sin_cache must be contiguous")
    require(positions.stride(0) == 1 or num_tokens <= 1, "positions must be contiguous")
    check_same_device(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    is_neox: bool = True,
) -> None:
    """Rotate ``q`` ``[num_tokens, num_heads, head_dim]`` and ``k``
    ``[num_tokens, num_kv_heads, head_dim]`` in place by ``positions``
    ``[num_tokens]``. ``q``/``k`` may be strided over tokens (slices of a fused
    QKV output). Positions are not bounds-checked against the cache (that
    would need a device sync)."""
    _check(positions, q, k, cos_sin_cache, head_dim)
    num_tokens, num_heads, _ = q.shape
    if num_tokens == 0:
        return
    half = cos_sin_cache.shape[1] // 2
    block_half = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(max(num_heads, k.shape[1])), 4096 // block_half))
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        q.stride(0),
        k.stride(0),
        num_heads,
        k.shape[1],
        HEAD_DIM=head_dim,
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        IS_NEOX=is_neox,
        num_warps=4,
    )


def rotary_embedding_reference(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    is_neox: bool = True,
) -> None:
    """What :func:`rotary_embedding` does (in place), in plain torch."""
    rot_dim = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions.long()].float().unsqueeze(1).chunk(2, dim=-1)
    for x in (q, k):
        rot = x[..., :rot_dim].float()
        if is_neox:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        if is_neox:
            out = torch.cat((o1, o2), dim=-1)
        else:
            out = torch.stack((o1, o2), dim=-1).flatten(-2)
        x[..., :rot_dim] = out.to(x.dtype)


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_inv_freq(
    rot_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None = None
) -> torch.Tensor:
    """Inverse frequencies ``[rot_dim / 2]`` (float32, CPU), as ``transformers``
    computes them for rope types ``default``, ``linear`` and ``llama3``.

    ``rope_scaling`` is the model's rope scaling (or rope parameters) dict; its
    type is under ``rope_type`` (or the older ``type``), and other keys such as
    ``rope_theta`` are ignored.
    """
    require(rot_dim > 0 and rot_dim % 2 == 0, f"rot_dim must be positive and even, got {rot_dim}")
    scaling = dict(rope_scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type")) or "default"
    inv_freq = 1.0 / (
        rope_theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim)
    )
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        require("factor" in scaling, "linear rope scaling needs a 'factor'")
        return cast(torch.Tensor, inv_freq / scaling["factor"])
    if rope_type == "llama3":
        missing = [key for key in _LLAMA3_KEYS if key not in scaling]
        require(not missing, f"llama3 rope scaling lacks {', '.join(missing)}")
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, and the band
        # between them interpolated smoothly.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_type {rope_type!r} is not supported; use default, linear or llama3")


def build_cos_sin_cache(
    head_dim: int,
    max_position: int,
    rope_theta: float,
    rope_scaling: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``[max_position, head_dim]``: ``cos`` then ``sin`` of ``position * inv_freq``.

    Computed in float32 on the CPU (as ``transformers`` computes its
    frequencies), then cast to ``dtype`` and moved to ``device``.
    """
    require(max_position > 0, f"max_position must be positive, got {max_position}")
    inv_freq = rope_inv_freq(head_dim, rope_theta, rope_scaling)
    freqs = torch.arange(max_position, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    return cache.to(dtype=dtype, device=device)
