"""Paged decode attention, flash-decoding style.

One query per sequence, at position ``seq_lens[s] - 1``, attends every key of
its context (the last ``sliding_window`` keys when set) in the paged cache.

Decode reads the whole KV cache once per step and does little arithmetic on
it, so the kernel is built to stream memory: a program owns one sequence, one
KV head (all of that head's query heads at once, so each key and value is read
once under GQA) and one *split* of the context. Splits let short batches fill
the GPU: ``num_splits`` programs share a sequence, each writes a partial
(normalised output, base-2 log-sum-exp), and a reduce kernel combines them.
With one split the first kernel writes the output directly.

CUDA-graph safe: the launch shape and the partial buffers depend only on
tensor shapes, never on values (no host sync). Each sequence divides its own
context evenly among the splits on the device, so a graph captured for a long
maximum context stays balanced for the short contexts it replays with.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._common import (
    check_config,
    check_gqa,
    check_kv_cache,
    check_out,
    check_rows,
    check_same_device,
    check_sliding_window,
    check_tensor,
    dot_dtype,
    dot_precision,
    head_tile,
    require,
)
from .prefill_attention import paged_prefill_attention_reference

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64
# The heuristic gives each split at least this many tokens of the widest context
# the block table can hold.
_MIN_TOKENS_PER_SPLIT = 128


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _decode_split_kernel(  # type: ignore[no-untyped-def]  # triton reads parameter annotations (only tl.constexpr)
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    out_ptr,  # [num_seqs, num_heads, head_dim], written when NUM_SPLITS == 1
    part_out_ptr,  # [num_seqs, num_heads, NUM_SPLITS, head_dim] float32
    part_lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] float32
    q_stride_s,
    q_stride_h,
    out_stride_s,
    out_stride_h,
    table_stride,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    qk_scale,  # softmax scale * log2(e)
    sliding_window,  # 0 = none
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded for tl.dot (>= 16)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two (>= 16), masked
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # operand dtype of tl.dot
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - sliding_window, 0)
    # This sequence's keys [lo, seq_len), cut into NUM_SPLITS runs of whole tiles.
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    g_ok = g < GROUP
    q = tl.load(
        q_ptr + seq * q_stride_s + heads[:, None] * q_stride_h + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    table_row_ptr = block_table_ptr + seq * table_stride
    kv_offset = kv_head.to(tl.int64) * cache_stride_head
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # Every tile starts at a visible key (start < end), so m_i is finite after it.
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        page = tl.load(table_row_ptr + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        row = page * cache_stride_block + (n % BLOCK_SIZE) * cache_stride_slot + kv_offset
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * qk_scale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_ok, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION
        )
        m_i = m_new

    has_keys = l_i > 0  # false for an empty split (or an empty sequence)
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + seq * out_stride_s + heads[:, None] * out_stride_h + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None] & d_ok[None, :],
        )
    else:
        part = (seq * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(
            part_out_ptr + part[:, None] * HEAD_DIM + d[None, :],
            o,
            mask=g_ok[:, None] & d_ok[None, :],
        )
        lse = tl.where(has_keys, m_i + tl.math.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=g_ok)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _decode_reduce_kernel(  # type: ignore[no-untyped-def]  # triton reads parameter annotations (only tl.constexpr)
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    out_stride_s,
    out_stride_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two, masked
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # NUM_SPLITS padded to a power of two
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = seq * tl.num_programs(1) + head  # index into [num_seqs, num_heads]
    sp = tl.arange(0, BLOCK_S)
    sp_ok = sp < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + base * NUM_SPLITS + sp, mask=sp_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no keys at all: every weight is 0
    w = tl.math.exp2(lse - top)  # [BLOCK_S]
    o = tl.load(
        part_out_ptr + (base * NUM_SPLITS + sp)[:, None] * HEAD_DIM + d[None, :],
        mask=sp_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * out_stride_s + head * out_stride_h + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 4 off the GPU (under the
    interpreter), so that the default split count still exercises the reduce."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _config(head_dim: int) -> dict[str, int]:
    """Tile size (tokens per step of the context loop) and launch shape, for Hopper."""
    if head_tile(head_dim) <= 128:
        return dict(BLOCK_N=64, num_warps=4, num_stages=3)
    return dict(BLOCK_N=32, num_warps=4, num_stages=2)


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_context: int, head_dim: int, sm_count: int
) -> int:
    """Splits per sequence, from shapes only (CUDA-graph safe): enough programs
    to give each of ``sm_count`` SMs about two, no split shorter than a few
    tiles of the widest context the block table holds (``max_context``)."""
    programs = max(num_seqs * num_kv_heads, 1)
    # triton ships no types: its cdiv returns an int here.
    wanted: int = triton.cdiv(2 * sm_count, programs)
    useful: int = triton.cdiv(max_context, max(_MIN_TOKENS_PER_SPLIT, _config(head_dim)["BLOCK_N"]))
    return max(1, min(wanted, useful, _MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ``[num_seqs, num_heads, head_dim]`` (one query per
    sequence, at position ``seq_lens[s] - 1``) over the paged cache; returns
    ``out`` ``[num_seqs, num_heads, head_dim]``.

    ``block_table`` ``[num_seqs, max_blocks_per_seq]`` and ``seq_lens``
    ``[num_seqs]`` are int32 on the device. A sequence with ``seq_lens == 0``
    (batch padding) gets zeros. ``num_splits=None`` picks
    :func:`choose_num_splits`. ``config`` overrides some of ``BLOCK_N``,
    ``num_warps`` and ``num_stages``, for tuning.
    """
    _, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_tensor("q", q, (None, None, head_dim))
    check_rows("q", q)
    num_seqs, num_heads, _ = q.shape
    group = check_gqa(num_heads, num_kv_heads)
    check_tensor("block_table", block_table, (num_seqs, None), (torch.int32,))
    check_tensor("seq_lens", seq_lens, (num_seqs,), (torch.int32,))
    require(block_table.stride(1) == 1, "block_table's rows must be contiguous")
    require(seq_lens.is_contiguous(), "seq_lens must be contiguous")
    check_same_device(
        q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens
    )
    window = check_sliding_window(sliding_window)
    out = check_out(out, q)
    if num_splits is None:
        max_context = block_table.shape[1] * block_size
        num_splits = choose_num_splits(
            num_seqs, num_kv_heads, max_context, head_dim, num_sms(q.device)
        )
    require(
        isinstance(num_splits, int) and 1 <= num_splits <= 256,
        f"num_splits must be an int in 1..256, got {num_splits!r}",
    )
    cfg = check_config(config, _config(head_dim), {"BLOCK_N": 16})
    if num_seqs == 0:
        return out

    if num_splits == 1:
        part_out = part_lse = out  # unused
    else:
        part_out = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device
        )
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        out,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        float(scale) * _LOG2E,
        window,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=head_tile(head_dim),
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        HAS_WINDOW=window > 0,
        DOT_DTYPE=dot_dtype(q.dtype, q.device),
        PRECISION=dot_precision(q.dtype),
        **cfg,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=head_tile(head_dim),
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4 if head_tile(head_dim) * num_splits >= 2048 else 1,
        )
    return out


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Decode is prefill with one query per sequence: the prefill reference."""
    num_seqs = q.shape[0]
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=q.device)
    # A padding sequence (seq_len 0) has no query position; give it zeros.
    live = seq_lens > 0
    out = torch.zeros_like(q)
    out[live] = paged_prefill_attention_reference(
        q[live],
        k_cache,
        v_cache,
        block_table[live],
        query_start_loc[: int(live.sum()) + 1],
        seq_lens[live],
        scale,
        sliding_window,
    )
    return out
