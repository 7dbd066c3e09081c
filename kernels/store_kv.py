"""Write a step's new keys and values into the paged KV cache.

Token ``t`` goes to slot ``slot_mapping[t] = block_id * block_size + offset``
of ``k_cache``/``v_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]``;
slot ``-1`` marks a padding token and is skipped. The engine calls this before
attention, which then reads every key and value from the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    check_contiguous,
    check_rows,
    check_same_device,
    check_tensor,
    require,
)

# One program copies up to this many elements of a token's [num_kv_heads, head_dim] row.
_MAX_BLOCK = 2048


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _store_kv_kernel(  # type: ignore[no-untyped-def]  # triton reads parameter annotations (only tl.constexpr)
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    key_stride,  # elements between consecutive tokens of key
    value_stride,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # padding token
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(key_ptr + token * key_stride + offs, mask=mask)
    v = tl.load(value_ptr + token * value_stride + offs, mask=mask)
    # The caches are contiguous, so a slot's row starts at slot * ROW.
    tl.store(k_cache_ptr + slot * ROW + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the
    caches at ``slot_mapping`` ``[num_tokens]`` (int64, -1 = skip). In place.

    ``key``/``value`` may be strided over tokens (a slice of a fused QKV
    output); each token's row must be dense. Slots are not bounds-checked
    (that would need a device sync): the caller owns them.
    """
    check_tensor("k_cache", k_cache, (None, None, None, None))
    _, _, num_kv_heads, head_dim = k_cache.shape
    check_tensor("v_cache", v_cache, tuple(k_cache.shape))
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)
    check_tensor("key", key, (None, num_kv_heads, head_dim))
    num_tokens = key.shape[0]
    check_tensor("value", value, (num_tokens, num_kv_heads, head_dim))
    check_tensor("slot_mapping", slot_mapping, (num_tokens,), (torch.int64,))
    check_rows("key", key)
    check_rows("value", value)
    require(slot_mapping.stride(0) == 1 or num_tokens <= 1, "slot_mapping must be contiguous")
    check_same_device(
        key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping
    )
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    block = min(triton.next_power_of_2(row), _MAX_BLOCK)
    grid = (num_tokens, triton.cdiv(row, block))
    _store_kv_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        ROW=row,
        BLOCK=block,
        num_warps=4 if block >= 512 else 1,
    )


def store_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """What :func:`store_kv` does, in plain torch."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    # [num_blocks * block_size, num_kv_heads, head_dim] views of the caches.
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[valid].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[valid].to(v_cache.dtype)
