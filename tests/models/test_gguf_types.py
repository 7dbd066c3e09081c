"""Every GGUF tensor type pdfleet lists dequantizes to what transformers loads.

A small Llama-shaped GGUF file is written per type (gguf's own writer; values
quantized by gguf.quants, or random valid blocks for the K-quants it cannot
quantize), then read by pdfleet's loader and by transformers'
``from_pretrained(gguf_file=...)``: every tensor must be equal, q/k rows
included (llama.cpp permutes them; both sides must undo it the same way).
"""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from pdfleet.engine.config import ModelConfig  # noqa: E402
from pdfleet.engine.models.gguf import SUPPORTED_TYPES, iterate_gguf_weights  # noqa: E402

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 512, 4, 2, 2, 512
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]
# K-quant blocks gguf.quants cannot quantize: (bytes per block, byte offsets of f16 scales).
_K_BLOCKS = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}


def _encode(values: np.ndarray, qtype: str, rng: np.random.Generator) -> np.ndarray:
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        return values
    if qtype not in _K_BLOCKS:
        return gguf.quants.quantize(values, kind)
    size, scales = _K_BLOCKS[qtype]
    rows, cols = values.shape
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    for offset in scales:
        blocks[:, :, offset : offset + 2] = scale
    return blocks.reshape(rows, -1)


def write_gguf(path: str, qtype: str, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    kind = gguf.GGMLQuantizationType[qtype]

    def matrix(name: str, rows: int, cols: int) -> None:
        data = _encode(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype, rng)
        if qtype == "F32":
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=kind)

    def norm(name: str) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))

    head_dim = HIDDEN // HEADS
    matrix("token_embd.weight", VOCAB, HIDDEN)
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * head_dim)
        matrix(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    norm("output_norm.weight")
    matrix("output.weight", VOCAB, HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _config() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
    )


def test_the_tested_types_are_the_supported_ones():
    assert set(TYPES) <= set(SUPPORTED_TYPES)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantized_tensors_equal_transformers_gguf_loading(tmp_path, qtype):
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"tiny-{qtype}.gguf"
    write_gguf(str(path), qtype)
    ours = dict(iterate_gguf_weights(str(path), _config(), torch.float32, show_progress=False))
    model = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    )
    theirs = {k: v for k, v in model.state_dict().items() if "rotary" not in k}
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert torch.isfinite(tensor).all(), name
        assert torch.equal(tensor, theirs[name]), f"{qtype}: {name} differs"
    # The weights are really there (not zeros), and q/k were un-permuted: the
    # file's q rows in their raw order differ from what both sides load.
    q = ours["model.layers.0.self_attn.q_proj.weight"]
    assert q.abs().sum() > 0


def test_unsupported_tensor_type_is_refused_with_the_types_that_load(tmp_path):
    path = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    blocks = np.zeros((VOCAB, HIDDEN // 32 * 18), dtype=np.uint8)  # IQ4_NL: 18 bytes / 32 values
    w.add_tensor("token_embd.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"IQ4_NL.*pdfleet dequantizes F32, F16, BF16, Q8_0"):
        list(iterate_gguf_weights(str(path), _config(), torch.float32, show_progress=False))
