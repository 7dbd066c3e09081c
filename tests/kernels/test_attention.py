"""Paged prefill and decode attention against their torch references."""

from __future__ import annotations

import pytest
import torch

from pdfleet.kernels import (
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_prefill_attention,
    paged_prefill_attention_reference,
)
from pdfleet.kernels.prefill_attention import gather_context
from pdfleet.kernels.testing import make_paged_case, rel_error

TOL_FP32 = 1e-4
TOL_BF16 = 2e-2
NUM_KV_HEADS = 2


def _prefill(case, scale, window=None, **kw):
    args = (case.q, case.k_cache, case.v_cache, case.block_table, case.query_start_loc)
    out = paged_prefill_attention(*args, case.seq_lens, scale, window, **kw)
    ref = paged_prefill_attention_reference(*args, case.seq_lens, scale, window)
    return out, ref


def _decode(case, scale, window=None, **kw):
    args = (case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens)
    out = paged_decode_attention(*args, scale, window, **kw)
    ref = paged_decode_attention_reference(*args, scale, window)
    return out, ref


# (group, block_size, head_dim, sliding_window): every GQA ratio, block size,
# several head dims, with and without a window, without a full cross product
# (the interpreter is slow).
PREFILL_SHAPES = [
    (1, 16, 32, None),
    (4, 32, 32, None),
    (8, 16, 16, None),
    (4, 16, 64, 24),
    (1, 32, 32, 7),
]


@pytest.mark.parametrize(("group", "block_size", "head_dim", "window"), PREFILL_SHAPES)
def test_prefill_matches_reference_on_ragged_mixed_batch(
    group, block_size, head_dim, window, device
):
    # A fresh prompt, a decode, a chunk over a cached prefix of many blocks, a
    # one-token prompt, a block-aligned prefix hit and a sequence with no new tokens.
    seq_lens = [37, 33, 230, 1, 48, 20]
    q_lens = [37, 1, 70, 1, 16, 0]
    case = make_paged_case(
        seq_lens,
        q_lens,
        NUM_KV_HEADS * group,
        NUM_KV_HEADS,
        head_dim,
        block_size,
        seed=group,
        device=device,
    )
    out, ref = _prefill(case, head_dim**-0.5, window)
    assert rel_error(out, ref) <= TOL_FP32


def test_prefill_window_of_one_sees_only_itself(device):
    case = make_paged_case([40, 5], [40, 2], 4, 2, 32, 16, seed=3, device=device)
    out, ref = _prefill(case, 0.3, window=1)
    assert rel_error(out, ref) <= TOL_FP32
    # With only itself to attend to, each query returns its own value.
    values = gather_context(case.v_cache, case.block_table[0], 40)  # [40, num_kv_heads, D]
    assert torch.allclose(out[:40], values.repeat_interleave(2, dim=1), atol=1e-6)


def test_prefill_bf16_smoke(device):
    case = make_paged_case(
        [90, 17], [60, 17], 8, 2, 64, 16, dtype=torch.bfloat16, seed=5, device=device
    )
    out, ref = _prefill(case, 0.125)
    assert out.dtype == torch.bfloat16
    assert rel_error(out, ref) <= TOL_BF16


def test_prefill_writes_into_out_and_accepts_strided_q(device):
    case = make_paged_case([30, 12], [30, 4], 4, 2, 32, 16, seed=6, device=device)
    # q as the first slice of a fused [q | k | v] projection output.
    fused = torch.randn(case.q.shape[0], 4 + 2 + 2, 32, device=device)
    fused[:, :4] = case.q
    q = fused[:, :4]
    out = torch.full_like(case.q, 7.0)
    result = paged_prefill_attention(
        q, case.k_cache, case.v_cache, case.block_table, case.query_start_loc, case.seq_lens, 0.2,
        out=out,
    )  # fmt: skip
    assert result is out
    _, ref = _prefill(case, 0.2)
    assert rel_error(out, ref) <= TOL_FP32


# (group, block_size, head_dim, sliding_window, num_splits)
DECODE_SHAPES = [
    (1, 16, 32, None, None),
    (4, 32, 32, None, 1),
    (8, 16, 16, None, 5),
    (4, 16, 64, 40, None),
    (8, 32, 32, 1, 3),
]


@pytest.mark.parametrize(("group", "block_size", "head_dim", "window", "num_splits"), DECODE_SHAPES)
def test_decode_matches_reference_on_ragged_batch(
    group, block_size, head_dim, window, num_splits, device
):
    seq_lens = [1, 16, 17, 100, 300, 33]
    case = make_paged_case(
        seq_lens, [1] * len(seq_lens), NUM_KV_HEADS * group, NUM_KV_HEADS, head_dim, block_size,
        seed=10 + group, device=device,
    )  # fmt: skip
    out, ref = _decode(case, head_dim**-0.5, window, num_splits=num_splits)
    assert rel_error(out, ref) <= TOL_FP32


def test_decode_with_more_splits_than_tiles_leaves_empty_splits_harmless(device):
    case = make_paged_case([1, 2, 70], [1, 1, 1], 8, 2, 32, 16, seed=4, device=device)
    out, ref = _decode(case, 0.2, num_splits=64)
    assert rel_error(out, ref) <= TOL_FP32


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_padding_sequence_gets_zeros(num_splits, device):
    # CUDA-graph batches are padded with seq_len-0 entries whose block tables are garbage.
    case = make_paged_case([25, 1, 60], [1, 1, 1], 8, 2, 32, 16, seed=8, device=device)
    case.seq_lens[1] = 0
    case.block_table[1] = 10**6
    out, ref = _decode(case, 0.2, num_splits=num_splits)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert rel_error(out, ref) <= TOL_FP32


def test_decode_agrees_with_prefill_kernel_on_single_queries(device):
    case = make_paged_case([5, 64, 131], [1, 1, 1], 8, 2, 32, 32, seed=9, device=device)
    decoded, _ = _decode(case, 0.2, window=50)
    prefilled, _ = _prefill(case, 0.2, window=50)
    assert rel_error(decoded, prefilled) <= TOL_FP32


def test_decode_bf16_smoke(device):
    case = make_paged_case(
        [200, 3, 64], [1, 1, 1], 16, 2, 128, 16, dtype=torch.bfloat16, seed=2, device=device
    )
    out, ref = _decode(case, 128**-0.5)
    assert out.dtype == torch.bfloat16
    assert rel_error(out, ref) <= TOL_BF16


def test_decode_reads_a_cache_of_another_dtype(device):
    case = make_paged_case(
        [50, 7], [1, 1], 4, 2, 32, 16, dtype=torch.bfloat16, seed=12, device=device
    )
    case.q = case.q.float()
    out, ref = _decode(case, 0.2, num_splits=2)
    assert out.dtype == torch.float32
    assert rel_error(out, ref) <= 1e-2


def test_num_splits_heuristic_fills_the_gpu():
    h200_sms = 132
    # One sequence, long context: enough splits for about two programs per SM.
    assert choose_num_splits(1, 8, 8192, 128, h200_sms) == 33
    # A batch that fills the GPU on its own: one split (no reduce pass).
    assert choose_num_splits(64, 8, 8192, 128, h200_sms) == 1
    # A short maximum context is never cut finer than the minimum split length.
    assert choose_num_splits(1, 8, 64, 128, h200_sms) == 1
    assert choose_num_splits(1, 8, 512, 128, h200_sms) == 4


# The launcher checks run before any launch: CPU tensors do on any machine.
def _decode_args(**override):
    case = make_paged_case([20, 5], [1, 1], 4, 2, 32, 16, seed=1)
    args = dict(
        q=case.q, k_cache=case.k_cache, v_cache=case.v_cache, block_table=case.block_table,
        seq_lens=case.seq_lens, scale=0.1,
    )  # fmt: skip
    args.update(override)
    return args


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (dict(q=torch.zeros(2, 4, 16)), "q must have shape"),
        (dict(q=torch.zeros(2, 3, 32)), "multiple of num_kv_heads"),
        (dict(q=torch.zeros(2, 4, 32, dtype=torch.int32)), "q must have dtype"),
        (dict(k_cache=torch.zeros(9, 12, 2, 32), v_cache=torch.zeros(9, 12, 2, 32)), "block_size"),
        (dict(k_cache=torch.zeros(7, 16, 2, 32, dtype=torch.bfloat16)), "dtypes must match"),
        (dict(v_cache=torch.zeros(9, 16, 2, 16)), "v_cache must have shape"),
        (dict(block_table=torch.zeros(2, 4, dtype=torch.int64)), "block_table must have dtype"),
        (dict(seq_lens=torch.zeros(3, dtype=torch.int32)), "seq_lens must have shape"),
        (dict(num_splits=0), "num_splits"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(out=torch.zeros(2, 4, 32, dtype=torch.bfloat16)), "out must have dtype"),
    ],
)
def test_decode_launcher_rejects_bad_arguments(override, match):
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(**_decode_args(**override))


def test_decode_launcher_rejects_head_dim_over_256():
    k = torch.zeros(4, 16, 2, 320)
    with pytest.raises(ValueError, match=r"head_dim must be in 1\.\.256"):
        paged_decode_attention(
            torch.zeros(1, 2, 320), k, k, torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), 0.1,
        )  # fmt: skip


# Every head size released models use, powers of two or not (the kernels pad
# the head tile to the next power of two and mask it), each paired with a
# different block size the cache config allows and with or without a window,
# so the whole grid is covered without a cross product (the interpreter is slow).
HEAD_SIZE_CASES = [
    (64, 1, None),
    (80, 8, 9),
    (96, 16, None),
    (112, 32, 20),
    (128, 64, None),
    (192, 128, 33),
    (256, 256, None),
    (80, 256, 5),
    (96, 128, None),
]


@pytest.mark.parametrize(("head_dim", "block_size", "window"), HEAD_SIZE_CASES)
def test_prefill_matches_reference_at_every_head_size(head_dim, block_size, window, device):
    # A fresh prompt, a chunk over a cached prefix and a decode, under GQA 2.
    case = make_paged_case(
        [19, 41, 9], [19, 7, 1], 4, 2, head_dim, block_size, seed=head_dim, device=device
    )
    out, ref = _prefill(case, head_dim**-0.5, window, config={"BLOCK_M": 16, "BLOCK_N": 16})
    assert rel_error(out, ref) <= TOL_FP32


@pytest.mark.parametrize(("head_dim", "block_size", "window"), HEAD_SIZE_CASES)
def test_decode_matches_reference_at_every_head_size(head_dim, block_size, window, device):
    case = make_paged_case(
        [3, 40, 17], [1, 1, 1], 4, 2, head_dim, block_size, seed=head_dim + 1, device=device
    )
    # Two splits: the padded partials go through the reduce kernel too.
    out, ref = _decode(case, head_dim**-0.5, window, num_splits=2, config={"BLOCK_N": 16})
    assert rel_error(out, ref) <= TOL_FP32


@pytest.mark.parametrize(
    ("name", "bad", "match"),
    [
        ("query_start_loc", torch.zeros(2, dtype=torch.int32), "query_start_loc must have shape"),
        ("seq_lens", torch.zeros(2, dtype=torch.int64), "seq_lens must have dtype"),
        ("q", torch.zeros(6, 4, 16), "q must have shape"),
        ("q", torch.zeros(6, 32, 4).transpose(1, 2), "dense"),
    ],
)
def test_prefill_launcher_rejects_bad_arguments(name, bad, match):
    case = make_paged_case([20, 5], [4, 2], 4, 2, 32, 16, seed=1)
    args = dict(
        q=case.q, k_cache=case.k_cache, v_cache=case.v_cache, block_table=case.block_table,
        query_start_loc=case.query_start_loc, seq_lens=case.seq_lens, scale=0.1,
    )  # fmt: skip
    args[name] = bad
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(**args)


def test_prefill_with_small_tiles_matches_reference(device):
    # Many ragged query tiles per sequence exercise the tile -> sequence search.
    case = make_paged_case([45, 33, 100, 17], [45, 1, 40, 17], 4, 2, 32, 16, seed=13, device=device)
    out, ref = _prefill(case, 0.2, 20, config={"BLOCK_M": 16, "BLOCK_N": 16, "num_stages": 1})
    assert rel_error(out, ref) <= TOL_FP32


def test_decode_with_small_tiles_matches_reference(device):
    case = make_paged_case([45, 3, 100], [1, 1, 1], 4, 2, 32, 16, seed=14, device=device)
    out, ref = _decode(case, 0.2, num_splits=3, config={"BLOCK_N": 16, "num_warps": 2})
    assert rel_error(out, ref) <= TOL_FP32


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"BLOCK_K": 16}, "config keys must be among"),
        ({"BLOCK_N": 24}, "power of two"),
        ({"BLOCK_N": 8}, "at least 16"),
        ({"num_stages": 0}, "positive int"),
    ],
)
def test_attention_launchers_reject_bad_configs(config, match):
    case = make_paged_case([20, 5], [1, 1], 4, 2, 32, 16, seed=1)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(
            case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens, 0.1, config=config
        )
