"""The per-token kernels at every head size released models use (powers of two
or not): rotary on q and k, store_kv into each block size the cache allows,
RMSNorm over one head's vector (Qwen3's q/k norm) and SiLU-and-mul. The
attention kernels' head-size cases live in test_attention.py."""

from __future__ import annotations

import pytest
import torch

from pdfleet.kernels import (
    build_cos_sin_cache,
    rms_norm,
    rms_norm_reference,
    rotary_embedding,
    rotary_embedding_reference,
    silu_and_mul,
    silu_and_mul_reference,
    store_kv,
    store_kv_reference,
)
from pdfleet.kernels.testing import rel_error

HEAD_SIZES = [64, 80, 96, 112, 128, 192, 256]
BLOCK_SIZES = [1, 8, 16, 32, 64, 128, 256]


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim", HEAD_SIZES)
def test_rotary_matches_reference_at_every_head_size(head_dim, is_neox, device):
    torch.manual_seed(head_dim)
    cache = build_cos_sin_cache(head_dim, 64, 10000.0, device=device)
    qkv = torch.randn(5, 4 + 2 + 2, head_dim, device=device)
    q, k = qkv[:, :4], qkv[:, 4:6]  # strided slices of a fused projection
    v = qkv[:, 6:].clone()
    positions = torch.tensor([0, 1, 7, 33, 63], device=device)
    ref_q, ref_k = q.clone(), k.clone()
    rotary_embedding(positions, q, k, cache, head_dim, is_neox)
    rotary_embedding_reference(positions, ref_q, ref_k, cache, head_dim, is_neox)
    assert rel_error(q, ref_q) <= 1e-5
    assert rel_error(k, ref_k) <= 1e-5
    # v, right after k in each token's row, is untouched by the padded lanes.
    assert torch.equal(qkv[:, 6:], v)


@pytest.mark.parametrize(
    ("head_dim", "block_size"), list(zip(HEAD_SIZES, BLOCK_SIZES, strict=True))
)
def test_store_kv_at_every_head_size_and_block_size(head_dim, block_size, device):
    torch.manual_seed(head_dim)
    num_blocks = max(2, 24 // block_size + 1)
    k_cache = torch.randn(num_blocks, block_size, 2, head_dim, device=device)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(num_blocks * block_size)[:6]
    slots[2] = -1
    slots = slots.to(device)
    key = torch.randn(6, 2, head_dim, device=device)
    value = torch.randn(6, 2, head_dim, device=device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv(key, value, k_cache, v_cache, slots)
    store_kv_reference(key, value, ref_k, ref_v, slots)
    assert torch.equal(k_cache, ref_k)
    assert torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("head_dim", HEAD_SIZES)
def test_per_head_rms_norm_at_every_head_size(head_dim, device):
    torch.manual_seed(head_dim)
    x = torch.randn(3 * 4, head_dim, device=device) * 2  # [tokens * heads, head_dim]
    weight = torch.randn(head_dim, device=device)
    assert rel_error(rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6)) <= 1e-5


@pytest.mark.parametrize("head_dim", HEAD_SIZES)
def test_silu_and_mul_at_head_size_multiples(head_dim, device):
    torch.manual_seed(head_dim)
    x = torch.randn(3, 2 * 3 * head_dim, device=device) * 4
    assert rel_error(silu_and_mul(x), silu_and_mul_reference(x)) <= 1e-6
