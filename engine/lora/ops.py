"""The segmented LoRA matmul the model's projections call, and the slots it reads.

A step's rows are sorted by adapter (the runner does it), so each adapter's
tokens form one contiguous *segment*: ``(start, end, slot)``. Base-model rows
have no segment and get no delta. For each target projection with output
``y = x W^T`` the delta of a token of slot ``s`` is

    y[:, off:off+size] += (x A_s^T) Bt_s            (A_s [R, in], Bt_s [R, size])

with R = ``--max-lora-rank`` (adapters of lower rank are zero-padded, and a
module an adapter does not target is all zeros in its slot).

Two torch forms compute it, with the same weights:

* :func:`segmented_lora` loops over segments (the reference; cost follows the
  tokens of each adapter, used for prefill-sized steps);
* :func:`dense_lora` multiplies every token by the first ``k`` slots at once
  and masks each token's other slots out: three ops per projection whatever
  the number of adapters, the fast form for decode steps (few tokens).

``pdfleet.kernels.lora`` holds the Triton kernel of the segmented form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Steps of at most this many tokens use the dense (masked) form.
DENSE_MAX_TOKENS = 256


@dataclass
class LoRABatch:
    """One step's adapter layout (built by the runner, read by every projection)."""

    segments: list[tuple[int, int, int]]
    """(first token, end token, slot) per adapter run, host-side; base rows have none."""
    num_tokens: int
    num_slots: int
    """Slots the dense form covers: 1 + the largest slot in use."""
    rank: int
    mask: torch.Tensor | None = None
    """[num_tokens, num_slots * rank]: 1 where a token's own slot's columns are
    (the dense form only)."""
    seg_start: torch.Tensor | None = None
    seg_len: torch.Tensor | None = None
    seg_slot: torch.Tensor | None = None
    """int32 [num_segments] each, on the device (the Triton kernel only)."""
    use_triton: bool = False

    @property
    def dense(self) -> bool:
        return self.mask is not None


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
    num_slots = 1 + max(s for _, _, s in segments)
    batch = LoRABatch(segments, num_tokens, num_slots, rank, use_triton=use_triton)
    if use_triton:
        batch.seg_start = torch.tensor(
            [a for a, _, _ in segments], dtype=torch.int32, device=device
        )
        batch.seg_len = torch.tensor(
            [b - a for a, b, _ in segments], dtype=torch.int32, device=device
        )
        batch.seg_slot = torch.tensor([s for _, _, s in segments], dtype=torch.int32, device=device)
    elif num_tokens <= DENSE_MAX_TOKENS:
        mask = torch.zeros(num_tokens, num_slots, rank, dtype=dtype)
        for start, end, slot in segments:
            mask[start:end, slot] = 1
        batch.mask = mask.view(num_tokens, num_slots * rank).to(device)
    return batch


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
    r, off = shard.rank, shard.offset
    for start, end, slot in batch.segments:
        t = x[start:end] @ shard.a[slot].t()
        y[start:end, off : off + shard.size] += t @ shard.bt[slot * r : (slot + 1) * r]


def dense_lora(x: torch.Tensor, y: torch.Tensor, shard: LoRAShard, batch: LoRABatch) -> None:
    """Every token through slots [0, k) at once, the other slots' columns masked."""
    if batch.mask is None:
        raise RuntimeError("broken invariant: batch.mask is not None")
    cols = batch.num_slots * shard.rank
    t = x @ shard.a.view(-1, shard.a.shape[-1])[:cols].t()
    t.mul_(batch.mask)
    view = y[:, shard.offset : shard.offset + shard.size]
    view.addmm_(t, shard.bt[:cols])


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
    fn = dense_lora if batch.dense else segmented_lora
    for shard in shards:
        fn(x, y, shard, batch)


class LoRAContext:
    """The step's batch, shared by every projection of one model (None: no adapter)."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None
