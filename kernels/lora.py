"""The segmented LoRA matmul (SGMV): each adapter's delta on its rows of a batch.

A batch's rows are grouped into segments, one per adapter run: segment ``i``
covers rows ``[seg_start[i], seg_start[i] + seg_len[i])`` and uses slot
``seg_slot[i]``. For every row of a segment of slot ``s``:

    y[row, off:off+N] += (x[row] @ a[s].T) @ bt[s*R:(s+1)*R]

with ``a`` ``[S, R, K]`` (each slot's LoRA A) and ``bt`` ``[S*R, N]`` (each
slot's B transposed, scaling folded in). Rows in no segment (the base model's)
are left alone. One program computes a ``BLOCK_M x BLOCK_N`` tile of one
segment: the shrink ``x @ a[s].T`` over K in ``BLOCK_K`` steps (recomputed
per N tile: R is small), then the expand, accumulated in float32 and added to
``y`` once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_tensor, require


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _sgmv_kernel(  # type: ignore[no-untyped-def]  # triton reads parameter annotations (only tl.constexpr)
    x_ptr,
    a_ptr,
    bt_ptr,
    y_ptr,
    seg_start_ptr,
    seg_len_ptr,
    seg_slot_ptr,
    x_stride,
    y_stride,
    y_offset,  # first column of y this projection's shard writes
    K,
    N,
    R: tl.constexpr,
    R_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0)
    start = tl.load(seg_start_ptr + seg).to(tl.int64)
    length = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    m0 = tl.program_id(1) * BLOCK_M
    if m0 >= length:
        return
    rows = m0 + tl.arange(0, BLOCK_M)
    row_mask = rows < length
    rows64 = start + rows.to(tl.int64)
    ranks = tl.arange(0, R_PAD)
    rank_mask = ranks < R
    # Shrink: t [BLOCK_M, R_PAD] = x[rows] @ a[slot].T
    t = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(
            x_ptr + rows64[:, None] * x_stride + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        a = tl.load(
            a_ptr + (slot * R + ranks[:, None]) * K + ks[None, :],
            mask=rank_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        t += tl.dot(x, tl.trans(a))
    # Expand: y[rows, off + cols] += t @ bt[slot*R:(slot+1)*R, cols]
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    bt = tl.load(
        bt_ptr + (slot * R + ranks[:, None]) * N + cols[None, :],
        mask=rank_mask[:, None] & col_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    delta = tl.dot(t, bt)
    y_ptrs = y_ptr + rows64[:, None] * y_stride + y_offset + cols[None, :]
    out_mask = row_mask[:, None] & col_mask[None, :]
    y = tl.load(y_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=out_mask)


def sgmv_lora(
    x: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    y: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    seg_slot: torch.Tensor,
    y_offset: int = 0,
    max_seg_len: int | None = None,
) -> torch.Tensor:
    """Add each segment's LoRA delta to ``y[:, y_offset:y_offset+N]`` in place.

    ``x`` [T, K]; ``a`` [S, R, K]; ``bt`` [S*R, N]; ``y`` [T, >= y_offset+N];
    ``seg_*`` int32 [num_segments]. ``max_seg_len``: the longest segment
    (read from the device when not given)."""
    check_tensor("x", x, (None, None))
    num_tokens, k = x.shape
    check_tensor("a", a, (None, None, k), (x.dtype,))
    num_slots, r, _ = a.shape
    check_tensor("bt", bt, (num_slots * r, None), (x.dtype,))
    n = bt.shape[1]
    check_tensor("y", y, (num_tokens, None), (x.dtype,))
    require(y_offset >= 0 and y_offset + n <= y.shape[1], "y is narrower than y_offset + N")
    require(x.stride(1) == 1 and y.stride(1) == 1, "x and y rows must be contiguous")
    require(a.is_contiguous() and bt.is_contiguous(), "a and bt must be contiguous")
    num_segs = seg_start.shape[0]
    for name, t in (("seg_start", seg_start), ("seg_len", seg_len), ("seg_slot", seg_slot)):
        check_tensor(name, t, (num_segs,), (torch.int32,))
        require(t.device == x.device, f"{name} must be on {x.device}")
    if num_segs == 0 or num_tokens == 0:
        return y
    if max_seg_len is None:
        max_seg_len = int(seg_len.max().item())
    block_m = 16
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (num_segs, triton.cdiv(max_seg_len, block_m), triton.cdiv(n, block_n))
    _sgmv_kernel[grid](
        x,
        a,
        bt,
        y,
        seg_start,
        seg_len,
        seg_slot,
        x.stride(0),
        y.stride(0),
        y_offset,
        k,
        n,
        R=r,
        R_PAD=max(16, triton.next_power_of_2(r)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return y


def sgmv_lora_reference(
    x: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    y: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    seg_slot: torch.Tensor,
    y_offset: int = 0,
) -> torch.Tensor:
    """The same in plain torch (float32 accumulation), segment by segment."""
    r, n = a.shape[1], bt.shape[1]
    for start, length, slot in zip(
        seg_start.tolist(), seg_len.tolist(), seg_slot.tolist(), strict=True
    ):
        rows = slice(start, start + length)
        t = x[rows].float() @ a[slot].float().t()
        delta = t @ bt[slot * r : (slot + 1) * r].float()
        y[rows, y_offset : y_offset + n] = (y[rows, y_offset : y_offset + n].float() + delta).to(
            y.dtype
        )
    return y
