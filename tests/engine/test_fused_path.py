"""The fused hot path (Triton RMSNorm+residual, in-place RoPE, SiLU-and-mul and
attention, under the interpreter on a CPU) gives transformers' greedy tokens for
every family and for head sizes that are not powers of two."""

from __future__ import annotations

import pytest
from helpers.engine import assert_no_leaks, hf_greedy, random_prompts

from pdfleet.engine import LLM, SamplingParams
from pdfleet.engine.models.layers import MLP, RMSNorm
from pdfleet.engine.models.rope import RotaryEmbedding

MAX_TOKENS = 5
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def fused_flags(llm) -> set[bool]:
    model = llm.engine.core.runner.model
    return {m.fused for m in model.modules() if isinstance(m, (RMSNorm, MLP, RotaryEmbedding))}


def check_triton_greedy(path, hf_model, lengths, seed) -> None:
    # A small token budget chunks the longest prompt: mixed prefill/decode batches.
    llm = LLM(path, max_model_len=128, attention_backend="triton", max_num_batched_tokens=32)
    assert fused_flags(llm) == {True}
    prompts = random_prompts(llm.engine.config.model_config.vocab_size, lengths, seed=seed)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, MAX_TOKENS), (
            f"prompt len {len(prompt)}"
        )
    assert_no_leaks(llm)


# Every family once; Llama and Qwen3 with head sizes that are not powers of two
# (the attention kernels pad them), Mistral with a sliding window.
@pytest.mark.parametrize(
    ("arch", "spec"),
    [
        ("llama", {"head_dim": 80}),
        ("mistral", {"sliding_window": 12}),
        ("qwen2", {}),
        ("qwen3", {"head_dim": 96}),
    ],
)
def test_fused_triton_path_matches_transformers_for_each_family(
    tiny_model_factory, hf_model_factory, arch, spec
):
    path = tiny_model_factory(arch, **spec)
    check_triton_greedy(path, hf_model_factory(path), [1, 9, 40], seed=60)


def test_torch_backend_runs_the_references(tiny_model):
    llm = LLM(tiny_model, max_model_len=64, attention_backend="torch")
    assert fused_flags(llm) == {False}
