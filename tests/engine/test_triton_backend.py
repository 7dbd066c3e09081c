"""The Triton attention backend (interpreted on CPU) and the padded decode path."""

from __future__ import annotations

import pytest
from helpers.engine import assert_no_leaks, random_prompts

from pdfleet.engine import LLM, SamplingParams
from pdfleet.engine.worker.cuda_graph import DecodeGraphs

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_model):
    # Mixed lengths: single-token, sub-block, multi-block prompts.
    return random_prompts(1800, [1, 9, 40, 70], seed=41)


def run(llm, prompts) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def test_triton_backend_greedy_equals_torch_backend(tiny_model, prompts):
    torch_llm = LLM(tiny_model, max_model_len=256, attention_backend="torch")
    triton_llm = LLM(
        tiny_model, max_model_len=256, attention_backend="triton", max_num_batched_tokens=64
    )  # chunked: mixed prefill/decode batches
    assert triton_llm.engine.core.runner.backend.name == "triton"
    assert run(triton_llm, prompts) == run(torch_llm, prompts)
    assert_no_leaks(triton_llm)


def test_padded_decode_buffers_give_the_same_tokens(tiny_model, prompts):
    llm = LLM(tiny_model, max_model_len=256, attention_backend="triton")
    expected = run(llm, prompts[:3])
    runner = llm.engine.core.runner
    # The graph path without capture: decode batches of 3 padded to 4 captured rows.
    runner.graphs = DecodeGraphs(
        runner.model,
        runner.kv_caches,
        runner.backend,
        [1, 4],
        256 // 16,
        runner.device,
        capture=False,
    )
    assert run(llm, prompts[:3]) == expected
    assert runner.graphs.padded_size(3) == 4
    assert_no_leaks(llm)


def test_graphs_refuse_the_torch_backend(tiny_model):
    # The torch backend asked for by name: on CUDA the default is triton.
    llm = LLM(tiny_model, max_model_len=64, attention_backend="torch")
    runner = llm.engine.core.runner
    with pytest.raises(ValueError, match="triton"):
        DecodeGraphs(runner.model, runner.kv_caches, runner.backend, [1], 4, runner.device)


def test_kv_cache_dtype_differs_from_the_model_dtype(tiny_model, prompts):
    llm = LLM(tiny_model, max_model_len=256, kv_cache_dtype="bfloat16")
    assert llm.engine.core.runner.kv_buffer.dtype.is_floating_point
    assert str(llm.engine.core.runner.kv_buffer.dtype) == "torch.bfloat16"
    outs = run(llm, prompts[:2])
    assert all(len(o) == 6 for o in outs)
