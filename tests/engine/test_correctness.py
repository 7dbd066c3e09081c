"""Greedy output is token-identical to transformers, whatever the batching."""

from __future__ import annotations

import pytest
import torch
from helpers.engine import assert_no_leaks, hf_greedy, random_prompts

from pdfleet.engine import LLM, SamplingParams

LENGTHS = [1, 7, 16, 33, 64, 129, 200, 300]
MAX_TOKENS = [64, 5, 64, 17, 40, 64, 9, 33]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def check_against_hf(llm, hf_model, prompts, max_tokens) -> None:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy(n) for n in max_tokens])
    for prompt, n, out in zip(prompts, max_tokens, outs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, n), (
            f"prompt len {len(prompt)}"
        )
        assert out.outputs[0].finish_reason == "length"
    assert_no_leaks(llm)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_matches_transformers_in_one_batch(tiny_model_factory, hf_model_factory, arch):
    path = tiny_model_factory(arch)
    llm = LLM(path, max_model_len=512)
    prompts = random_prompts(llm.engine.config.model_config.vocab_size, LENGTHS, seed=1)
    check_against_hf(llm, hf_model_factory(path), prompts, MAX_TOKENS)


def test_llama3_rope_scaling_and_sliding_window(tiny_model_factory, hf_model_factory):
    for path in (
        tiny_model_factory("llama", rope_scaling="llama3", max_position_embeddings=1024),
        tiny_model_factory("mistral", sliding_window=48),
    ):
        llm = LLM(path, max_model_len=512)
        prompts = random_prompts(llm.engine.config.model_config.vocab_size, [5, 60, 150], seed=2)
        check_against_hf(llm, hf_model_factory(path), prompts, [40, 40, 30])


def test_chunked_prefill_with_a_tiny_token_budget(tiny_model, hf_model_factory):
    llm = LLM(tiny_model, max_model_len=512, max_num_batched_tokens=32, max_num_seqs=8)
    prompts = random_prompts(llm.engine.config.model_config.vocab_size, LENGTHS, seed=3)
    check_against_hf(llm, hf_model_factory(tiny_model), prompts, MAX_TOKENS)


def test_long_prefill_threshold_chunks_long_prompts(tiny_model, hf_model_factory):
    llm = LLM(tiny_model, max_model_len=512, long_prefill_token_threshold=24)
    prompts = random_prompts(llm.engine.config.model_config.vocab_size, [100, 3, 250], seed=4)
    check_against_hf(llm, hf_model_factory(tiny_model), prompts, [20, 20, 20])


def test_prefix_cache_hits_keep_outputs_identical(tiny_model, hf_model_factory):
    llm = LLM(tiny_model, max_model_len=512)
    vocab = llm.engine.config.model_config.vocab_size
    (shared,) = random_prompts(vocab, [150], seed=5)
    tails = random_prompts(vocab, [1, 10, 40, 0, 17], seed=6)
    prompts = [shared + t for t in tails if shared + t]
    hf = hf_model_factory(tiny_model)
    # First the shared prefix alone, then prompts that extend it (cache hits).
    check_against_hf(llm, hf, [shared], [8])
    before = llm.engine.stats.prefix_cache_hits
    check_against_hf(llm, hf, prompts, [24] * len(prompts))
    stats = llm.engine.stats
    assert stats.prefix_cache_hits - before >= len(prompts) * 144
    assert stats.prefix_cache_queries >= stats.prefix_cache_hits > 0


def test_preemption_by_recompute_keeps_outputs_identical(tiny_model, hf_model_factory):
    # 40 blocks of 16 tokens cannot hold 6 sequences of ~100 tokens at once.
    llm = LLM(tiny_model, max_model_len=512, num_gpu_blocks_override=40, max_num_seqs=6)
    prompts = random_prompts(
        llm.engine.config.model_config.vocab_size, [60, 80, 90, 70, 100, 50], seed=7
    )
    check_against_hf(llm, hf_model_factory(tiny_model), prompts, [60] * 6)
    assert llm.engine.stats.num_preemptions > 0


def test_preemption_without_prefix_caching(tiny_model, hf_model_factory):
    llm = LLM(
        tiny_model,
        max_model_len=512,
        num_gpu_blocks_override=40,
        max_num_seqs=6,
        enable_prefix_caching=False,
        max_num_batched_tokens=64,
    )
    prompts = random_prompts(
        llm.engine.config.model_config.vocab_size, [60, 80, 90, 70, 100, 50], seed=8
    )
    check_against_hf(llm, hf_model_factory(tiny_model), prompts, [60] * 6)
    assert llm.engine.stats.num_preemptions > 0


def test_without_chunked_prefill(tiny_model, hf_model_factory):
    llm = LLM(
        tiny_model, max_model_len=512, enable_chunked_prefill=False, enable_prefix_caching=False
    )
    assert not llm.engine.config.scheduler_config.chunked_prefill_enabled
    prompts = random_prompts(llm.engine.config.model_config.vocab_size, LENGTHS, seed=9)
    check_against_hf(llm, hf_model_factory(tiny_model), prompts, MAX_TOKENS)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefill_logits_match_transformers(tiny_model_factory, hf_model_factory, arch):
    path = tiny_model_factory(arch)
    llm = LLM(path, max_model_len=512)
    (prompt,) = random_prompts(llm.engine.config.model_config.vocab_size, [120], seed=10)
    runner = llm.engine.core.runner
    from pdfleet.engine.core.sched_output import NewRequestData, SchedulerOutput

    blocks = list(range(1, 1 + (len(prompt) + 15) // 16))
    out = SchedulerOutput(
        [NewRequestData("r", prompt, [], greedy(1), blocks, 0)],
        [],
        {"r": len(prompt)},
        len(prompt),
    )
    runner._update_states(out)
    batch = runner._prepare_inputs(out)
    with torch.inference_mode():
        hidden = runner.model(
            batch.input_ids, batch.positions, runner.kv_caches, batch.attn_metadata, runner.backend
        )
        ours = runner.model.compute_logits(hidden)
        theirs = hf_model_factory(path)(torch.tensor([prompt])).logits[0]
    # transformers runs on the CPU: compare there, whatever device the engine uses.
    torch.testing.assert_close(ours.cpu(), theirs.cpu(), atol=1e-4, rtol=1e-4)
    runner.states.clear()


def test_bfloat16_greedy_agrees_with_transformers_in_bfloat16(tiny_model):
    """bf16 rounds differently in each implementation, so tokens may part after a
    while; the first token of every prompt, and most of the greedy prefix, agree."""
    from transformers import AutoModelForCausalLM

    llm = LLM(tiny_model, max_model_len=256, dtype="bfloat16")
    prompts = random_prompts(llm.engine.config.model_config.vocab_size, [40, 17, 63], seed=11)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(8))
    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16).eval()
    agreed = []
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs, strict=True):
            ours, theirs = out.outputs[0].token_ids, hf_greedy(reference, prompt, 8)
            assert len(ours) == 8
            agreed.append(
                next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), 8)
            )
    assert min(agreed) >= 1, f"first divergence per prompt: {agreed}"
    assert sum(agreed) >= 12, f"first divergence per prompt: {agreed}"
    assert_no_leaks(llm)
