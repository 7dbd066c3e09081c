"""store_kv against its reference."""

from __future__ import annotations

import pytest
import torch

from pdfleet.kernels import store_kv, store_kv_reference


def _caches(num_blocks, block_size, num_kv_heads, head_dim, device, dtype=torch.float32):
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(device, dtype)
    return k, torch.randn_like(k)


@pytest.mark.parametrize(("block_size", "num_kv_heads", "head_dim"), [(16, 2, 32), (32, 8, 64)])
def test_store_kv_scatters_tokens_and_skips_padding(block_size, num_kv_heads, head_dim, device):
    torch.manual_seed(0)
    k_cache, v_cache = _caches(6, block_size, num_kv_heads, head_dim, device)
    num_tokens = 40
    slots = torch.randperm(6 * block_size)[:num_tokens]
    slots[[3, 17, 39]] = -1  # padding tokens
    slots = slots.to(device)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device=device)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, device=device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv(key, value, k_cache, v_cache, slots)
    store_kv_reference(key, value, ref_k, ref_v, slots)
    assert torch.equal(k_cache, ref_k)
    assert torch.equal(v_cache, ref_v)
    # The reference itself: a stored token is where its slot says.
    blk, off = divmod(int(slots[0]), block_size)
    assert torch.equal(k_cache[blk, off], key[0])


def test_store_kv_takes_slices_of_a_fused_qkv_output_and_casts_to_the_cache_dtype(device):
    torch.manual_seed(1)
    num_tokens, num_heads, num_kv_heads, head_dim = 9, 4, 2, 16
    # float16, not bfloat16: the interpreter's float32 -> bfloat16 cast truncates.
    k_cache, v_cache = _caches(2, 16, num_kv_heads, head_dim, device, torch.float16)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, device=device)
    key, value = qkv[:, num_heads : num_heads + 2], qkv[:, num_heads + 2 :]
    slots = torch.arange(num_tokens, device=device) + 5
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv(key, value, k_cache, v_cache, slots)
    store_kv_reference(key, value, ref_k, ref_v, slots)
    assert torch.equal(k_cache, ref_k)
    assert torch.equal(v_cache, ref_v)


def test_store_kv_with_no_tokens_changes_nothing():
    k_cache, v_cache = _caches(2, 16, 2, 16, "cpu")
    before = k_cache.clone()
    empty = torch.empty(0, 2, 16)
    store_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64))
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize(
    ("name", "bad", "match"),
    [
        ("key", torch.zeros(4, 3, 16), "key must have shape"),
        ("value", torch.zeros(5, 2, 16), "value must have shape"),
        ("slot_mapping", torch.zeros(4, dtype=torch.int32), "slot_mapping must have dtype"),
        ("v_cache", torch.zeros(2, 16, 2, 8), "v_cache must have shape"),
        ("k_cache", torch.zeros(2, 16, 2, 32)[..., :16], "k_cache must be contiguous"),
        ("key", torch.zeros(4, 16, 2).transpose(1, 2), "key must be dense"),
    ],
)
def test_store_kv_rejects_bad_arguments(name, bad, match):
    args = dict(
        key=torch.zeros(4, 2, 16),
        value=torch.zeros(4, 2, 16),
        k_cache=torch.zeros(2, 16, 2, 16),
        v_cache=torch.zeros(2, 16, 2, 16),
        slot_mapping=torch.zeros(4, dtype=torch.int64),
    )
    args[name] = bad
    with pytest.raises(ValueError, match=match):
        store_kv(**args)
