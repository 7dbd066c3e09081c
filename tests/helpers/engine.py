"""Engine test helpers: transformers as the reference, and a leak check."""

from __future__ import annotations

import random

import torch


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the first ids (special tokens) so prompts look like ordinary text.
    return [[rng.randrange(8, vocab_size) for _ in range(n)] for n in lengths]


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Plain argmax decoding with transformers' own forward and KV cache."""
    import warnings

    warnings.filterwarnings("ignore", message=".*past_key_values.*is deprecated")
    ids = torch.tensor([prompt])
    out = model(ids, use_cache=True)
    past, generated = out.past_key_values, []
    for _ in range(max_tokens):
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return generated


def assert_no_leaks(llm) -> None:
    """Every KV block is back in the pool and no request is left anywhere."""
    core = llm.engine.core
    kv = core.scheduler.kv
    assert not core.scheduler.requests
    assert not core.scheduler.running
    assert not core.scheduler.held_blocks
    assert kv.num_requests == 0
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert not llm.engine.output.requests
    assert not core.runner.states or all(
        rid in core.scheduler.finished_req_ids for rid in core.runner.states
    )
