"""The segmented LoRA kernel against its torch references (the kernel's own and
the engine's segment loop), under the interpreter without a GPU."""

from __future__ import annotations

import pytest
import torch

from pdfleet.engine.lora.ops import LoRAShard, dense_lora, make_batch, segmented_lora
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


def test_engine_torch_forms_match_the_kernel_reference():
    segments = [(0, 3, 1), (3, 4, 0), (9, 5, 2)]
    x, a, bt, y, (start, length, slot) = _case(
        "cpu", torch.float32, [(s, e - s, sl) for s, e, sl in segments], 16
    )
    want = sgmv_lora_reference(x, a, bt, y.clone(), start, length, slot, y_offset=5)
    shard = LoRAShard(5, bt.shape[1], x.shape[1], 3, 8, torch.float32, torch.device("cpu"))
    shard.a.copy_(a)
    shard.bt.copy_(bt)
    for dense in (False, True):
        batch = make_batch(segments, 16, 8, torch.float32, torch.device("cpu"))
        assert batch is not None and batch.dense
        got = y.clone()
        (dense_lora if dense else segmented_lora)(x, got, shard, batch)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_sgmv_refuses_bad_shapes(device):
    x, a, bt, y, (start, length, slot) = _case(device, torch.float32, [(0, 2, 0)], 4)
    with pytest.raises(ValueError, match="a must have shape"):
        sgmv_lora(x, a[:, :, :-1], bt, y, start, length, slot)
    with pytest.raises(ValueError, match="seg_start must have dtype"):
        sgmv_lora(x, a, bt, y, start.long(), length, slot)
