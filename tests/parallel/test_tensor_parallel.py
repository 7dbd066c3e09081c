"""--tensor-parallel-size 2 on CPU (gloo): real rank processes, greedy tokens
identical to TP=1 for every family, and the failure paths (bounded, clear)."""

from __future__ import annotations

import os
import time

import pytest
from helpers.engine import random_prompts

from pdfleet.engine import LLM, SamplingParams
from pdfleet.engine.config import EngineArgs
from pdfleet.engine.worker.tp_executor import RankFailed

# One model per family, chosen to cover each split: untied Llama with KV heads
# sharded (2 over 2 ranks); Mistral with one KV head replicated on both ranks;
# Qwen2 (q/k/v bias) and Qwen3 (q/k norm) with tied embeddings.
FAMILIES = {
    "llama": {"num_key_value_heads": 2},
    "mistral": {"num_key_value_heads": 1},
    "qwen2": {"num_key_value_heads": 2},
    "qwen3": {"num_key_value_heads": 1},
}
# A small token budget chunks every prompt over several steps.
ENGINE = dict(max_model_len=256, max_num_batched_tokens=24, max_num_seqs=8)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run_rounds(llm: LLM, vocab: int) -> list[list[int]]:
    """A shared prefix alone, then prompts extending it (prefix-cache hits)."""
    (shared,) = random_prompts(vocab, [40], seed=11)
    tails = random_prompts(vocab, [3, 17, 1], seed=12)
    first = llm.generate([{"prompt_token_ids": shared}], greedy(6))
    rest = llm.generate([{"prompt_token_ids": shared + t} for t in tails], greedy(10))
    return [o.outputs[0].token_ids for o in first + rest]


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_greedy_tokens_at_tp2_equal_tp1_through_chunked_prefill_and_prefix_hits(
    tiny_model_factory, arch
):
    path = tiny_model_factory(arch, **FAMILIES[arch])
    reference = LLM(path, **ENGINE)
    vocab = reference.engine.config.model_config.vocab_size
    expected = run_rounds(reference, vocab)
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    try:
        before = llm.engine.stats.prefix_cache_hits
        assert run_rounds(llm, vocab) == expected
        stats = llm.engine.stats
        assert stats.prefix_cache_hits - before >= 3 * 32  # two full blocks per extension
        sched = llm.engine.core.scheduler
        assert not sched.requests and sched.kv.num_free_blocks == sched.kv.num_usable_blocks
    finally:
        llm.engine.shutdown()


def test_a_dead_rank_takes_the_engine_down_with_a_clear_error_and_no_orphans(tiny_model):
    llm = LLM(tiny_model, tensor_parallel_size=2, max_model_len=128)
    runner = llm.engine.core.runner
    pids = [p.pid for p in runner.procs]
    try:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy(2))
        runner.procs[1].kill()
        runner.procs[1].join(10)
        with pytest.raises(RankFailed, match="rank 1 .*exited"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy(2))
    finally:
        llm.engine.shutdown()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split(") ")[1][0] != "Z"


def test_a_rank_that_never_joins_fails_the_start_within_the_rendezvous_timeout(
    tiny_model, monkeypatch
):
    monkeypatch.setenv("PDFLEET_TP_TEST_HANG_RANK", "1")
    monkeypatch.setenv("PDFLEET_TP_RENDEZVOUS_TIMEOUT", "4")
    start = time.monotonic()
    with pytest.raises(RankFailed, match="not every tensor-parallel rank joined within 4s"):
        LLM(tiny_model, tensor_parallel_size=2, max_model_len=128)
    assert time.monotonic() - start < 60


def test_a_tp_size_that_does_not_divide_the_heads_is_refused(tiny_model):
    with pytest.raises(ValueError, match="tensor-parallel-size 3 does not divide .* 4 attention"):
        EngineArgs(model=tiny_model, device="cpu", tensor_parallel_size=3).create_engine_config()


def test_a_tp_size_above_the_devices_is_refused_before_any_rank_starts(tiny_model, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # a one-core host
    with pytest.raises(ValueError, match="tensor-parallel-size 2 needs one CPU core per rank"):
        LLM(tiny_model, tensor_parallel_size=2, max_model_len=128)
