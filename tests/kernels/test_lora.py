"""The segmented LoRA kernel against its torch references (the kernel's own and
the engine's segment loop), under the interpreter without a GPU."""

from __future__ import annotations

import pytest
import torch

from pdfleet.engine.lora.ops import (
    GROUPED_MAX_TOKENS,
    LoRAShard,
    apply_lora,
    grouped_lora,
    make_batch,
    segmented_lora,
)
from pdfleet.kernels.lora import sgmv_lora, sgmv_lora_reference


def _case(device, dtype, segments, num_tokens, k=40, n=24, slots=3, r=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, k, generator=g).to(dtype).to(device)
    a = (torch.randn(slots, r, k, generator=g) * 0.2).to(dtype).to(device)
    bt = (torch.randn(slots * r, n, generator=g) * 0.2).to(dtype).to(device)
    y = torch.randn(num_tokens, n + 10, generator=g).to(dtype).to(device)
    seg = [torch.tensor(c, dtype=torch.int32, device=device) for c in zip(*segments, strict=True)]
    return x, a, bt, y, seg


# Segments: (start, length, slot); rows outside every segment are base rows.
SEGMENTS = [[(0, 3, 1), (3, 1, 0), (6, 19, 2)], [(0, 1, 2)], [(2, 30, 0), (32, 2, 1)]]


@pytest.mark.parametrize("segments", SEGMENTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sgmv_matches_reference(device, segments, dtype):
    num_tokens = max(s + n for s, n, _ in segments) + 2
    x, a, bt, y, (start, length, slot) = _case(device, dtype, segments, num_tokens)
    want = sgmv_lora_reference(x, a, bt, y.clone(), start, length, slot, y_offset=5)
    got = sgmv_lora(x, a, bt, y.clone(), start, length, slot, y_offset=5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # Columns outside the shard and base rows are untouched.
    torch.testing.assert_close(got[:, :5], y[:, :5])


# Segments (first, end, slot) as the engine forms see them: gaps of base rows,
# slots out of order, unequal lengths; back to back over a contiguous slot
# range, equal and unequal (the in-place views); one segment; a large step.
ENGINE_SEGMENTS = [
    ([(0, 3, 1), (3, 7, 0), (9, 14, 2)], 16),
    ([(4, 8, 0), (8, 12, 1), (12, 16, 2)], 16),
    ([(2, 3, 1), (3, 9, 2)], 16),
    ([(5, 16, 2)], 16),
    ([(0, 200, 0), (200, 300, 2), (300, 301, 1)], 301),
    # Decode-sized uneven spreads: Zipf-like, one popular adapter, and a skewed
    # one with base rows between and slots out of order (the long segments go
    # to the loop, the short ones are grouped).
    ([(0, 9, 0), (9, 13, 1), (13, 16, 2), (16, 18, 3), (18, 19, 4), (19, 20, 5)], 20),
    ([(0, 17, 1), (17, 18, 0), (18, 19, 2), (19, 20, 4), (20, 21, 3)], 22),
    ([(1, 2, 5), (2, 12, 3), (14, 15, 0), (15, 17, 4), (17, 18, 1), (20, 21, 2)], 23),
]


@pytest.mark.parametrize(("segments", "num_tokens"), ENGINE_SEGMENTS)
def test_engine_torch_forms_match_the_kernel_reference(segments, num_tokens):
    slots = max(s for _, _, s in segments) + 1
    x, a, bt, y, (start, length, slot) = _case(
        "cpu", torch.float32, [(s, e - s, sl) for s, e, sl in segments], num_tokens, slots=slots
    )
    want = sgmv_lora_reference(x, a, bt, y.clone(), start, length, slot, y_offset=5)
    shard = LoRAShard(5, bt.shape[1], x.shape[1], slots, 8, torch.float32, torch.device("cpu"))
    shard.a.copy_(a)
    shard.bt.copy_(bt)
    batch = make_batch(segments, num_tokens, 8, torch.float32, torch.device("cpu"))
    assert batch is not None
    for form in (segmented_lora, grouped_lora) if batch.grouped else (segmented_lora,):
        got = y.clone()
        form(x, got, shard, batch)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got = y.clone()
    apply_lora(x, got, [shard], batch)  # the form make_batch chose
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # A large step with much padding takes the segment loop.
    assert batch.grouped == (num_tokens <= GROUPED_MAX_TOKENS)


def test_sgmv_refuses_bad_shapes(device):
    x, a, bt, y, (start, length, slot) = _case(device, torch.float32, [(0, 2, 0)], 4)
    with pytest.raises(ValueError, match="a must have shape"):
        sgmv_lora(x, a[:, :, :-1], bt, y, start, length, slot)
    with pytest.raises(ValueError, match="seg_start must have dtype"):
        sgmv_lora(x, a, bt, y, start.long(), length, slot)


def test_uneven_decode_steps_split_off_the_long_segments():
    """A Zipf-like or one-popular-adapter decode step pays for its rows, not for
    every segment padded to the longest: the long segments run through the loop."""

    def batch_of(counts):
        segments, start = [], 0
        for slot, n in enumerate(counts):
            segments.append((start, start + n, slot))
            start += n
        batch = make_batch(segments, start, 8, torch.float32, torch.device("cpu"))
        assert batch is not None and batch.grouped
        assert batch.group_segments is not None and batch.loop_segments is not None
        padded = len(batch.group_segments) * batch.group_len
        looped = sum(e - s for s, e, _ in batch.loop_segments)
        return batch, padded, looped

    batch, padded, looped = batch_of([2] * 16)  # even: all grouped, no padding
    assert (padded, looped, batch.row_index) == (32, 0, None)
    batch, padded, looped = batch_of([17] + [1] * 15)
    assert (padded, looped) == (15, 17)
    batch, padded, looped = batch_of([9, 4, 3, 2, 2, 2] + [1] * 10)
    assert padded + looped <= 1.25 * 32
