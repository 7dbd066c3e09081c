"""Probe (real tiny model): under the priority policy a running request scheduled
earlier in a step can be preempted by a later one; the blocks it allocated (and
published) that step were never computed, yet a later request hits them."""

from __future__ import annotations

import pytest
from helpers.engine import random_prompts

from pdfleet.engine import LLM, SamplingParams

KW = {
    "max_model_len": 144,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 128,
    "long_prefill_token_threshold": 32,
    "enable_chunked_prefill": True,
}


@pytest.mark.xfail(
    strict=True, reason="the preempted request's block published this step stays cached unwritten"
)
def test_a_prefix_hit_on_a_block_published_then_preempted_gives_the_same_tokens(tiny_model):
    vocab = 200
    a, b = random_prompts(vocab, [140, 140], seed=5)
    probe = a[:100]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (ref,) = LLM(tiny_model, **KW).generate([{"prompt_token_ids": probe}], [params])

    llm = LLM(tiny_model, scheduling_policy="priority", num_gpu_blocks_override=9, **KW)
    engine = llm.engine
    core = engine.core
    print("usable blocks", core.scheduler.kv.num_usable_blocks, "bs", core.scheduler.block_size)
    long = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": a}, long, priority=1)
    engine.step()
    engine.add_request("b", {"prompt_token_ids": b}, long, priority=0)
    engine.step()
    sched = core.scheduler
    before = sched.requests["a"].num_computed_tokens
    engine.step()
    print("a status", sched.requests["a"].status, "computed before", before)
    engine.abort_request(["a", "b"])
    (out,) = llm.generate([{"prompt_token_ids": probe}], [params])
    print(
        "cached tokens",
        out.num_cached_tokens,
        "ref",
        ref.outputs[0].token_ids,
        "got",
        out.outputs[0].token_ids,
    )
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
