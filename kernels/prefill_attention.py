"""Prefill/extend attention over the paged KV cache.

The step's tokens of all sequences are flattened in order: sequence ``s`` owns
query rows ``query_start_loc[s]:query_start_loc[s + 1]`` and has
``seq_lens[s]`` tokens in context after this step, so its new tokens sit at
positions ``[seq_lens[s] - q_len, seq_lens[s])``. Every key and value (the
cached prefix and the new tokens, which ``store_kv`` wrote first) is read from
the paged cache through ``block_table``. A query at position ``i`` attends keys
``j <= i`` (and ``i - j < sliding_window`` when set). One batch may mix
decodes (``q_len == 1``), chunked prefills and prefix-cache hits.

The kernel is FlashAttention-2 style: a program owns ``BLOCK_M`` query rows of
one sequence and one head and streams the context in ``BLOCK_N`` tiles with an
online softmax (base 2, float32 accumulators). Query tiles are laid out with no
host sync: sequence ``s``'s tiles start at program
``query_start_loc[s] // BLOCK_M + s``, which leaves room for each sequence's
ragged last tile, and a program finds its sequence by binary search.
"""

from __future__ import annotations

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

_LOG2E = 1.4426950408889634


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_M: tl.constexpr):  # type: ignore[no-untyped-def]  # triton reads parameter annotations (only tl.constexpr)
    """The last sequence whose first tile index is <= ``tile``."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _attend_tiles(  # type: ignore[no-untyped-def]  # triton reads parameter annotations (only tl.constexpr)
    acc,
    m_i,
    l_i,
    q,
    q_pos,  # [BLOCK_M] positions of the query rows
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,  # this sequence's block-table row
    kv_offset,  # kv_head * cache_stride_head
    cache_stride_block,
    cache_stride_slot,
    qk_scale,
    sliding_window,
    start,
    end,  # keys [start, end) are read
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,  # whether some key of these tiles is after some query
    HAS_WINDOW: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # operand dtype of tl.dot
    PRECISION: tl.constexpr,
):
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        page = tl.load(table_row_ptr + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        # [BLOCK_N] element offsets of each key's row for this KV head.
        row = page * cache_stride_block + (n % BLOCK_SIZE) * cache_stride_slot + kv_offset
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * qk_scale
        if CAUSAL_MASK or HAS_WINDOW:
            visible = n_ok[None, :]
            if CAUSAL_MASK:
                visible = visible & (n[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible = visible & (q_pos[:, None] - n[None, :] < sliding_window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; subtract 0 then.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_ok, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION
        )
        m_i = m_new
    return acc, m_i, l_i


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _prefill_kernel(  # type: ignore[no-untyped-def]  # triton reads parameter annotations (only tl.constexpr)
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    table_stride,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    qk_scale,  # softmax scale * log2(e)
    sliding_window,  # 0 = none
    num_seqs,
    num_tiles,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two (>= 16), masked
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # operand dtype of tl.dot
    PRECISION: tl.constexpr,
):
    # Reverse order: the last tiles of long sequences have the most keys, so start them first.
    tile = num_tiles - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_M)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    m_start = q_begin + (tile - (q_begin // BLOCK_M + seq)) * BLOCK_M
    if m_start >= q_end:  # a spare program past this sequence's last tile
        return

    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - (q_end - q_begin)  # position of the sequence's first new token
    rows = m_start + tl.arange(0, BLOCK_M)
    row_ok = rows < q_end
    q_pos = first_pos + (rows - q_begin)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    rows64 = rows.to(tl.int64)
    q = tl.load(
        q_ptr + rows64[:, None] * q_stride_t + head * q_stride_h + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    tile_first_pos = first_pos + (m_start - q_begin)
    tile_last_pos = tl.minimum(tile_first_pos + BLOCK_M, seq_len) - 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(tile_first_pos - sliding_window + 1, 0)
    # Keys [lo, diag) are visible to every row (no causal mask); [diag, hi) are not.
    diag = lo + (tile_first_pos + 1 - lo) // BLOCK_N * BLOCK_N
    hi = tile_last_pos + 1

    table_row_ptr = block_table_ptr + seq.to(tl.int64) * table_stride
    kv_offset = (head // GROUP).to(tl.int64) * cache_stride_head
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_offset,
        cache_stride_block, cache_stride_slot, qk_scale, sliding_window, lo, diag,
        HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, False, HAS_WINDOW, DOT_DTYPE, PRECISION,
    )  # fmt: skip
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_offset,
        cache_stride_block, cache_stride_slot, qk_scale, sliding_window, diag, hi,
        HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, True, HAS_WINDOW, DOT_DTYPE, PRECISION,
    )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows64[:, None] * out_stride_t + head * out_stride_h + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def _config(head_dim: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes and launch shape, picked for Hopper (H100/H200), by the padded head tile."""
    head_dim = head_tile(head_dim)
    if dtype == torch.float32:  # twice the bytes per tile: keep shared memory in bounds
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    if head_dim <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
    if head_dim <= 128:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
) -> int:
    """Validates the arguments; returns the number of query heads per KV head."""
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_tensor("q", q, (None, None, head_dim))
    check_rows("q", q)
    check_tensor("block_table", block_table, (None, None), (torch.int32,))
    num_seqs = block_table.shape[0]
    check_tensor("query_start_loc", query_start_loc, (num_seqs + 1,), (torch.int32,))
    check_tensor("seq_lens", seq_lens, (num_seqs,), (torch.int32,))
    require(block_table.stride(1) == 1, "block_table's rows must be contiguous")
    require(query_start_loc.is_contiguous(), "query_start_loc must be contiguous")
    require(seq_lens.is_contiguous(), "seq_lens must be contiguous")
    check_same_device(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
    )
    return check_gqa(q.shape[1], num_kv_heads)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` ``[num_tokens, num_heads, head_dim]`` over the
    paged cache; returns ``out`` ``[num_tokens, num_heads, head_dim]``.

    ``block_table`` ``[num_seqs, max_blocks_per_seq]``, ``query_start_loc``
    ``[num_seqs + 1]`` (cumulative query lengths) and ``seq_lens``
    ``[num_seqs]`` are int32 on the device. Rows of ``q`` past
    ``query_start_loc[-1]`` are left unwritten in ``out``. Index values are
    not checked on the host (that would need a device sync).

    ``config`` overrides some of the tile sizes and launch shape
    (``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``), for tuning.
    """
    group = _check(q, k_cache, v_cache, block_table, query_start_loc, seq_lens)
    window = check_sliding_window(sliding_window)
    out = check_out(out, q)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = block_table.shape[0]
    cfg = check_config(config, _config(head_dim, q.dtype), {"BLOCK_M": 16, "BLOCK_N": 16})
    if num_tokens == 0 or num_seqs == 0:
        return out
    # Each sequence adds at most one ragged tile to the num_tokens // BLOCK_M full ones.
    num_tiles = num_tokens // cfg["BLOCK_M"] + num_seqs
    _prefill_kernel[(num_tiles, num_heads)](
        q,
        k_cache,
        v_cache,
        block_table,
        query_start_loc,
        seq_lens,
        out,
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
        num_seqs,
        num_tiles,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=head_tile(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        HAS_WINDOW=window > 0,
        DOT_DTYPE=dot_dtype(q.dtype, q.device),
        PRECISION=dot_precision(q.dtype),
        **cfg,
    )
    return out


def gather_context(
    cache: torch.Tensor, block_table_row: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """The first ``num_tokens`` entries ``[num_tokens, num_kv_heads, head_dim]`` of
    one sequence's paged ``cache``."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    blocks = cache[block_table_row[:num_blocks].long()]  # [num_blocks, block_size, H, D]
    return blocks.flatten(0, 1)[:num_tokens]


def paged_prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """What :func:`paged_prefill_attention` computes, one sequence at a time in
    float32. A query with no visible key gets zeros."""
    num_heads = q.shape[1]
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        begin, end = starts[s], starts[s + 1]
        if end == begin:
            continue
        keys = gather_context(k_cache, block_table[s], seq_len).float()  # [seq_len, Hk, D]
        values = gather_context(v_cache, block_table[s], seq_len).float()
        group = num_heads // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)  # [seq_len, H, D]
        values = values.repeat_interleave(group, dim=1)
        q_pos = torch.arange(seq_len - (end - begin), seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        visible = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        if sliding_window is not None:
            visible &= q_pos[:, None] - k_pos[None, :] < sliding_window
        scores = torch.einsum("qhd,khd->hqk", q[begin:end].float(), keys) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no key: 0
        out[begin:end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out
