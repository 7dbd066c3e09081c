"""Rotary embedding: the kernel against its reference, and the cos/sin cache
and neox rotation against transformers' own rope code."""

from __future__ import annotations

import pytest
import torch

from pdfleet.kernels import (
    build_cos_sin_cache,
    rope_inv_freq,
    rotary_embedding,
    rotary_embedding_reference,
)
from pdfleet.kernels.testing import rel_error

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 512,
}


def _qk(num_tokens, num_heads, num_kv_heads, head_dim, device, dtype=torch.float32):
    """q and k as slices of one fused [q | k | v] projection output."""
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim).to(device, dtype)
    return qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 32), (8, 1, 64)])
def test_rotary_matches_reference(is_neox, num_heads, num_kv_heads, head_dim, device):
    torch.manual_seed(0)
    cache = build_cos_sin_cache(head_dim, 300, 10000.0, device=device)
    q, k = _qk(11, num_heads, num_kv_heads, head_dim, device)
    positions = torch.randint(0, 300, (11,), device=device)
    ref_q, ref_k = q.clone(), k.clone()
    rotary_embedding(positions, q, k, cache, head_dim, is_neox)
    rotary_embedding_reference(positions, ref_q, ref_k, cache, head_dim, is_neox)
    assert rel_error(q, ref_q) <= 1e-5
    assert rel_error(k, ref_k) <= 1e-5


def test_neox_rotation_matches_transformers_llama(device):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    torch.manual_seed(1)
    head_dim, theta = 64, 500000.0
    config = LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
        head_dim=head_dim, max_position_embeddings=4096,
        rope_parameters={"rope_theta": theta, **LLAMA3},
    )  # fmt: skip
    q, k = _qk(9, 4, 2, head_dim, device)
    positions = torch.tensor([0, 1, 2, 100, 511, 512, 1000, 2047, 4095], device=device)
    rope = LlamaRotaryEmbedding(config).to(device)
    cos, sin = rope(q, positions[None])
    # transformers' layout is [batch, heads, tokens, head_dim].
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    cache = build_cos_sin_cache(head_dim, 4096, theta, LLAMA3, device=device)
    rotary_embedding(positions, q, k, cache, head_dim, is_neox=True)
    assert rel_error(q, hf_q[0].transpose(0, 1)) <= 1e-5
    assert rel_error(k, hf_k[0].transpose(0, 1)) <= 1e-5


def _hf_config(head_dim, theta, scaling):
    from transformers import LlamaConfig

    params = {"rope_theta": theta, **(scaling or {"rope_type": "default"})}
    return LlamaConfig(
        hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
        max_position_embeddings=8192, rope_parameters=params,
    )  # fmt: skip


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        LLAMA3,
        {**LLAMA3, "factor": 32.0, "high_freq_factor": 2.0, "original_max_position_embeddings": 64},
    ],
)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_inv_freq_matches_transformers_rope_init_functions(scaling, head_dim):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    expected, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](
        _hf_config(head_dim, 500000.0, scaling), "cpu"
    )
    assert attention_factor == 1.0  # no cos/sin scaling for these types
    assert torch.equal(rope_inv_freq(head_dim, 500000.0, scaling), expected)


def test_default_inv_freq_matches_transformers_llama():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    expected = LlamaRotaryEmbedding(_hf_config(128, 10000.0, None)).inv_freq
    assert torch.equal(rope_inv_freq(128, 10000.0, None), expected)
    assert torch.equal(rope_inv_freq(128, 10000.0, {"rope_type": "default"}), expected)


def test_cache_layout_is_cos_then_sin_of_position_times_inv_freq():
    cache = build_cos_sin_cache(16, 50, 10000.0, {"type": "linear", "factor": 2.0})
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16) / 2.0
    assert cache.shape == (50, 16)
    assert torch.allclose(cache[7, :8], torch.cos(7 * inv_freq))
    assert torch.allclose(cache[7, 8:], torch.sin(7 * inv_freq))


def test_partial_rotary_leaves_the_tail_of_each_head_untouched(device):
    torch.manual_seed(2)
    cache = build_cos_sin_cache(16, 64, 10000.0, device=device)  # rot_dim 16 of head_dim 32
    q, k = _qk(5, 2, 1, 32, device)
    before_q, before_k = q.clone(), k.clone()
    ref_q, ref_k = q.clone(), k.clone()
    positions = torch.arange(5, device=device) * 7
    rotary_embedding(positions, q, k, cache, 32)
    rotary_embedding_reference(positions, ref_q, ref_k, cache, 32)
    assert torch.equal(q[..., 16:], before_q[..., 16:])
    assert not torch.equal(q[1:, :, :16], before_q[1:, :, :16])
    assert rel_error(q, ref_q) <= 1e-5
    assert rel_error(k, ref_k) <= 1e-5
    assert torch.equal(k[..., 16:], before_k[..., 16:])


def test_rotary_bf16_smoke(device):
    torch.manual_seed(3)
    cache = build_cos_sin_cache(64, 128, 10000.0, device=device)
    q, k = _qk(6, 4, 2, 64, device, torch.bfloat16)
    ref_q, ref_k = q.clone(), k.clone()
    positions = torch.arange(6, device=device, dtype=torch.int32) * 20
    rotary_embedding(positions, q, k, cache, 64)
    rotary_embedding_reference(positions, ref_q, ref_k, cache, 64)
    assert rel_error(q, ref_q) <= 1e-2
    assert rel_error(k, ref_k) <= 1e-2


@pytest.mark.parametrize(
    ("scaling", "match"),
    [
        ({"rope_type": "yarn", "factor": 4.0}, "rope_type 'yarn' is not supported"),
        ({"rope_type": "llama3", "factor": 8.0}, "llama3 rope scaling lacks"),
        ({"rope_type": "linear"}, "needs a 'factor'"),
    ],
)
def test_cache_builder_rejects_unsupported_scaling(scaling, match):
    with pytest.raises(ValueError, match=match):
        build_cos_sin_cache(64, 16, 10000.0, scaling)


@pytest.mark.parametrize(
    ("name", "bad", "match"),
    [
        ("positions", torch.zeros(4, dtype=torch.float32), "positions must have dtype"),
        ("q", torch.zeros(4, 2, 16), "q must have shape"),
        ("k", torch.zeros(3, 1, 32), "k must have shape"),
        ("cos_sin_cache", torch.zeros(10, 64), "at most head_dim"),
        ("cos_sin_cache", torch.zeros(10, 15), "must be even"),
    ],
)
def test_rotary_rejects_bad_arguments(name, bad, match):
    args = dict(
        positions=torch.zeros(4, dtype=torch.int64),
        q=torch.zeros(4, 2, 32),
        k=torch.zeros(4, 1, 32),
        cos_sin_cache=torch.zeros(10, 32),
        head_dim=32,
    )
    args[name] = bad
    with pytest.raises(ValueError, match=match):
        rotary_embedding(**args)
