"""The segmented LoRA matmul the model's projections call, and the slots it reads.

A step's rows are sorted by adapter (the runner does it), so each adapter's
tokens form one contiguous *segment*: ``(start, end, slot)``. Base-model rows
have no segment and get no delta. For each target projection with output
``y = x W^T`` the delta of a token of slot ``s`` is

    y[:, off:off+size] += (x A_s^T) Bt_s            (A_s [R, in], Bt_s [R, size])

with R = ``--max-lora-rank`` (adapters of lower rank are zero-padded, and a
module an adapter does not target is all zeros in its slot).

Two torch forms compute it, with the same weights:

* :func:`segmented_lora` loops over segments (the reference; two matmuls per
  segment, cost proportional to each adapter's tokens; used for large steps
  whose segments differ much in length: prefill);
* :func:`grouped_lora` runs all segments at once as two batched matmuls: the
  step's adapter rows as ``[S, L, in]`` (S segments padded to the longest, L),
  each segment against its own slot's ``A`` and ``Bt`` only. Its work is the
  adapter rows' own (plus padding), never every token through every slot, and
  it reads each slot's weights in place (a view) when the step's slots are a
  contiguous range in segment order (the runner orders rows by slot for that);
  when the segments are the adapter rows back to back and equally long it
  needs no gather or scatter either. Only the segments no longer than a
  chosen length L take part, padded to L; the longer ones run through the
  segment loop (two plain matmuls each, no padding). :func:`make_batch`
  picks L (and so the split) by a cost estimate in rows: so an uneven spread
  (one popular adapter and many rare ones) pays for its real rows plus a
  little padding, not for every segment padded to the longest.

``pdfleet.kernels.lora`` holds the Triton kernel of the segmented form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Steps of at most this many tokens take the grouped form (with the longest
# segments split off into the loop where that costs less); larger ones take it
# only while every segment padded to the longest is at most this many times
# the adapter rows, and the segment loop otherwise.
GROUPED_MAX_TOKENS = 256
GROUPED_MAX_PADDING = 1.25
# The cost estimate's price of one segment through the loop, in rows of the
# grouped form: two matmul calls per projection shard, whose fixed cost on a
# CPU at decode sizes is a few rows' worth of batched work (measured: 2-12
# all do far better than padding; 3 splits a Zipf mix at L = 1).
LOOP_SEGMENT_ROWS = 3


@dataclass
class LoRABatch:
    """One step's adapter layout (built by the runner, read by every projection)."""

    segments: list[tuple[int, int, int]]
    """(first token, end token, slot) per adapter run, host-side; base rows have none."""
    num_tokens: int
    rank: int
    grouped: bool = False
    """The grouped form (the fields below) for ``group_segments`` and the loop
    for ``loop_segments``; else the segment loop for all."""
    group_segments: list[tuple[int, int, int]] | None = None
    """The segments of the grouped form (the rest are in ``loop_segments``)."""
    loop_segments: list[tuple[int, int, int]] | None = None
    """With ``grouped``: the segments longer than ``group_len``, run by the loop."""
    group_len: int = 0
    """L: the longest segment; the grouped rows are [S, L]."""
    row_start: int = 0
    """With ``row_index`` None: the grouped rows are x[row_start : row_start + S * L]."""
    row_index: torch.Tensor | None = None
    """int64 [S * L]: the token of each grouped row (a padding row repeats its
    segment's first token); None when the rows are a plain range."""
    row_valid: torch.Tensor | None = None
    """[S, L, 1] of x's dtype: 0 on padding rows (their delta is dropped); None
    when no segment is padded."""
    slot_start: int = 0
    """With ``slot_index`` None: segment i uses slot slot_start + i."""
    slot_index: torch.Tensor | None = None
    """int64 [S]: each segment's slot, when they are not a contiguous range."""
    seg_start: torch.Tensor | None = None
    seg_len: torch.Tensor | None = None
    seg_slot: torch.Tensor | None = None
    """int32 [num_segments] each, on the device (the Triton kernel only)."""
    use_triton: bool = False


def make_batch(
    segments: list[tuple[int, int, int]],
    num_tokens: int,
    rank: int,
    dtype: torch.dtype,
    device: torch.device,
    use_triton: bool = False,
) -> LoRABatch | None:
    """The batch of a step, or None when no token runs an adapter."""
    if not segments:
        return None
    batch = LoRABatch(segments, num_tokens, rank, use_triton=use_triton)
    if use_triton:
        batch.seg_start = torch.tensor(
            [a for a, _, _ in segments], dtype=torch.int32, device=device
        )
        batch.seg_len = torch.tensor(
            [b - a for a, b, _ in segments], dtype=torch.int32, device=device
        )
        batch.seg_slot = torch.tensor([s for _, _, s in segments], dtype=torch.int32, device=device)
        return batch
    lengths = [b - a for a, b, _ in segments]
    longest = max(lengths)
    if num_tokens > GROUPED_MAX_TOKENS:
        if len(segments) * longest > GROUPED_MAX_PADDING * sum(lengths):
            return batch
        group_len = longest
    else:
        group_len = _best_group_len(lengths)
    group = [seg for seg, n in zip(segments, lengths, strict=True) if n <= group_len]
    batch.loop_segments = [seg for seg, n in zip(segments, lengths, strict=True) if n > group_len]
    batch.group_segments = segments = group
    lengths = [b - a for a, b, _ in segments]
    num_segs, longest = len(segments), max(lengths)
    padded = num_segs * longest
    batch.grouped, batch.group_len = True, longest
    back_to_back = all(segments[i][1] == segments[i + 1][0] for i in range(num_segs - 1))
    if back_to_back and all(n == longest for n in lengths):
        batch.row_start = segments[0][0]
    else:
        rows = [
            start + min(j, n - 1)
            for (start, _, _), n in zip(segments, lengths, strict=True)
            for j in range(longest)
        ]
        batch.row_index = torch.tensor(rows, dtype=torch.int64, device=device)
        if padded != sum(lengths):
            valid = torch.tensor(
                [[[float(j < n)] for j in range(longest)] for n in lengths], dtype=dtype
            )
            batch.row_valid = valid.to(device)
    slots = [s for _, _, s in segments]
    if slots == list(range(slots[0], slots[0] + num_segs)):
        batch.slot_start = slots[0]
    else:
        batch.slot_index = torch.tensor(slots, dtype=torch.int64, device=device)
    return batch


def _best_group_len(lengths: list[int]) -> int:
    """The L whose estimated cost is least: the segments of length <= L padded
    to L (S_L * L rows) plus every longer one through the loop (its rows plus
    LOOP_SEGMENT_ROWS). L is one of the lengths, so at least one segment is
    grouped; ties go to the larger L (fewer calls)."""
    best, best_cost = 0, 0.0
    for cand in sorted(set(lengths)):
        short = sum(1 for n in lengths if n <= cand)
        cost = short * cand + sum(n + LOOP_SEGMENT_ROWS for n in lengths if n > cand)
        if best == 0 or cost <= best_cost:
            best, best_cost = cand, cost
    return best


class LoRAShard:
    """The slots of one output shard of a projection (q, k or v of the merged
    qkv, gate or up, or a whole o/down projection).

    ``a``: [S, R, in] (each slot's A, zero-padded to R rows); ``bt``:
    [S * R, size] (slot s's B transposed in rows s*R..(s+1)*R, scaled)."""

    def __init__(
        self,
        offset: int,
        size: int,
        in_features: int,
        num_slots: int,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.offset, self.size, self.rank = offset, size, rank
        self.a = torch.zeros(num_slots, rank, in_features, dtype=dtype, device=device)
        self.bt = torch.zeros(num_slots * rank, size, dtype=dtype, device=device)

    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Fill one slot (A [r, in], B [size, r]); None clears it."""
        r0 = slot * self.rank
        self.a[slot].zero_()
        self.bt[r0 : r0 + self.rank].zero_()
        if a is None or b is None:
            return
        r = a.shape[0]
        self.a[slot, :r].copy_(a)
        self.bt[r0 : r0 + r].copy_(b.t())


def segmented_lora(x: torch.Tensor, y: torch.Tensor, shard: LoRAShard, batch: LoRABatch) -> None:
    """The reference: ``y[start:end, off:off+size] += x A_s^T Bt_s`` per segment."""
    _loop_shard(x, y, shard, batch.segments)


def _loop_shard(
    x: torch.Tensor, y: torch.Tensor, shard: LoRAShard, segments: list[tuple[int, int, int]]
) -> None:
    r, off = shard.rank, shard.offset
    for start, end, slot in segments:
        t = x[start:end] @ shard.a[slot].t()
        y[start:end, off : off + shard.size] += t @ shard.bt[slot * r : (slot + 1) * r]


def _grouped_rows(x: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    """The step's adapter rows of ``x`` as [S, L, in] (a view when they are a range)."""
    if batch.group_segments is None:
        raise RuntimeError("broken invariant: batch.group_segments is not None")
    num_segs = len(batch.group_segments)
    if batch.row_index is None:
        start = batch.row_start
        return x[start : start + num_segs * batch.group_len].reshape(num_segs, batch.group_len, -1)
    return x.index_select(0, batch.row_index).reshape(num_segs, batch.group_len, -1)


def grouped_lora(x: torch.Tensor, y: torch.Tensor, shard: LoRAShard, batch: LoRABatch) -> None:
    """Every segment against its own slot at once: two batched matmuls."""
    if not batch.grouped:
        raise RuntimeError("broken invariant: batch.grouped")
    rows = _grouped_rows(x, batch)
    _grouped_shard(rows, y, shard, batch)
    _loop_shard(x, y, shard, batch.loop_segments or [])


def _grouped_shard(rows: torch.Tensor, y: torch.Tensor, shard: LoRAShard, batch: LoRABatch) -> None:
    num_segs, r = len(batch.group_segments or ()), shard.rank
    bt = shard.bt.view(-1, r, shard.size)  # [slots, R, size]
    if batch.slot_index is None:
        a = shard.a[batch.slot_start : batch.slot_start + num_segs]
        bt = bt[batch.slot_start : batch.slot_start + num_segs]
    else:
        a = shard.a.index_select(0, batch.slot_index)
        bt = bt.index_select(0, batch.slot_index)
    t = torch.bmm(rows, a.transpose(1, 2))  # [S, L, R]
    if batch.row_valid is not None:
        t.mul_(batch.row_valid)
    delta = torch.bmm(t, bt).view(num_segs * batch.group_len, shard.size)
    view = y[:, shard.offset : shard.offset + shard.size]
    if batch.row_index is None:
        start = batch.row_start
        view[start : start + delta.shape[0]] += delta
    else:
        view.index_add_(0, batch.row_index, delta)


def apply_lora(x: torch.Tensor, y: torch.Tensor, shards: list[LoRAShard], batch: LoRABatch) -> None:
    """Add every shard's delta to ``y`` in place (x [T, in], y [T, out])."""
    if batch.use_triton:
        from ...kernels.lora import sgmv_lora

        for shard in shards:
            if not (batch.seg_start is not None and batch.seg_len is not None):
                raise RuntimeError(
                    "broken invariant: batch.seg_start is not None and batch.seg_len is not None"
                )
            if batch.seg_slot is None:
                raise RuntimeError("broken invariant: batch.seg_slot is not None")
            sgmv_lora(
                x,
                shard.a,
                shard.bt,
                y,
                batch.seg_start,
                batch.seg_len,
                batch.seg_slot,
                shard.offset,
                max(e - s for s, e, _ in batch.segments),
            )
        return
    if batch.grouped:
        rows = _grouped_rows(x, batch)  # once for all the shards of one input
        for shard in shards:
            _grouped_shard(rows, y, shard, batch)
            _loop_shard(x, y, shard, batch.loop_segments or [])
        return
    for shard in shards:
        segmented_lora(x, y, shard, batch)


class LoRAContext:
    """The step's batch, shared by every projection of one model (None: no adapter)."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None
