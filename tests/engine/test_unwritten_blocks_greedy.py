"""Real tiny model: under the priority policy a running request scheduled earlier
in a step can be preempted by a later one; the blocks it allocated (and
published) that step are never computed, so no later request may hit them."""

from __future__ import annotations

from helpers.engine import random_prompts

from pdfleet.engine import LLM, SamplingParams
from pdfleet.engine.request import RequestStatus

KW = {
    "max_model_len": 144,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 128,
    "long_prefill_token_threshold": 32,
    "enable_chunked_prefill": True,
}


def test_a_prefix_hit_on_a_block_published_then_preempted_gives_the_same_tokens(tiny_model):
    vocab = 200
    a, b = random_prompts(vocab, [140, 140], seed=5)
    probe = a[:100]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (ref,) = LLM(tiny_model, **KW).generate([{"prompt_token_ids": probe}], [params])

    llm = LLM(tiny_model, scheduling_policy="priority", num_gpu_blocks_override=9, **KW)
    engine = llm.engine
    core = engine.core
    long = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": a}, long, priority=1)
    engine.step()
    engine.add_request("b", {"prompt_token_ids": b}, long, priority=0)
    engine.step()
    sched = core.scheduler
    before = sched.requests["a"].num_computed_tokens
    engine.step()  # "a" allocates blocks 4 and 5, then "b" preempts it
    assert before == 64 and sched.requests["a"].status == RequestStatus.PREEMPTED
    engine.abort_request(["a", "b"])
    (out,) = llm.generate([{"prompt_token_ids": probe}], [params])
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
