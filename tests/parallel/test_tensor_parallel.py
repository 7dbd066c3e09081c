"""--tensor-parallel-size 2 on CPU (gloo): real rank processes, greedy tokens
identical to TP=1 for every family, and the failure paths (bounded, clear)."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from helpers.engine import random_prompts
from helpers.server import ServerProcess, free_port, wait_until

from pdfleet.engine import LLM, SamplingParams
from pdfleet.engine.config import EngineArgs
from pdfleet.engine.sampling_params import StructuredOutputsParams
from pdfleet.engine.testing_hooks import TP_HANG_RANK_ENV
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


@pytest.fixture(scope="module")
def tp2_engine(tiny_model_factory):
    """``get(arch) -> (path, LLM at TP=2)``: one engine per family for the module."""
    engines: dict[str, tuple[str, LLM]] = {}

    def get(arch: str) -> tuple[str, LLM]:
        if arch not in engines:
            path = tiny_model_factory(arch, **FAMILIES[arch])
            engines[arch] = (path, LLM(path, tensor_parallel_size=2, **ENGINE))
        return engines[arch]

    yield get
    for _path, llm in engines.values():
        llm.engine.shutdown()


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_greedy_tokens_at_tp2_equal_tp1_through_chunked_prefill_and_prefix_hits(tp2_engine, arch):
    path, llm = tp2_engine(arch)
    reference = LLM(path, **ENGINE)
    vocab = reference.engine.config.model_config.vocab_size
    expected = run_rounds(reference, vocab)
    before = llm.engine.stats.prefix_cache_hits
    assert run_rounds(llm, vocab) == expected
    stats = llm.engine.stats
    assert stats.prefix_cache_hits - before >= 3 * 32  # two full blocks per extension
    sched = llm.engine.core.scheduler
    assert not sched.requests and sched.kv.num_free_blocks == sched.kv.num_usable_blocks


def test_seeded_random_sampling_at_tp2_equals_tp1(tp2_engine):
    path, llm = tp2_engine("llama")
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [9, 10, 11]}, {"prompt_token_ids": [40, 41]}]
    expected = [o.outputs[0].token_ids for o in LLM(path, **ENGINE).generate(prompts, sp)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == expected


def test_structured_outputs_at_tp2_are_refused_with_a_clear_error(tp2_engine):
    _path, llm = tp2_engine("llama")
    sp = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(ValueError, match="structured_outputs: not supported with --tensor"):
        llm.generate([{"prompt_token_ids": [5, 6]}], sp)
    assert not llm.engine.core.scheduler.requests  # nothing was queued


def test_a_dead_rank_takes_the_engine_down_with_a_clear_error_and_no_orphans(tp2_engine):
    _path, llm = tp2_engine("llama")  # the module's last use of it
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


def test_pdfleet_serve_at_tp2_answers_like_tp1_and_its_ranks_die_with_it(tiny_model, tmp_path):
    server = ServerProcess(
        ["serve", tiny_model, "--served-model-name", "tiny", "-tp", "2", "--max-model-len", "128"],
        tmp_path,
    )
    try:
        server.wait_healthy(timeout=240)
        ranks = _children(server.proc.pid)
        assert len(ranks) == 2 and all(_alive(pid) for pid in ranks)
        body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0}
        reply = httpx.post(
            server.url + "/v1/completions", json=body, headers=server.headers, timeout=60
        )
        assert reply.status_code == 200, reply.text
        expected = LLM(tiny_model, max_model_len=128).generate(
            [{"prompt_token_ids": [5, 6, 7, 8]}], greedy(8)
        )
        assert reply.json()["choices"][0]["text"] == expected[0].outputs[0].text
    finally:
        server.signal(signal.SIGKILL)  # whatever ends the engine, even SIGKILL
        server.stop()
    assert wait_until(lambda: not any(_alive(pid) for pid in ranks), timeout=10), (
        "rank processes outlived the engine"
    )


def test_two_nodes_of_one_rank_each_meet_at_the_leader_and_answer_like_tp1(tiny_model, tmp_path):
    port = free_port()
    flags = ["-tp", "2", "--nnodes", "2", "--master-port", str(port), "--max-model-len", "128"]
    node1 = ServerProcess(
        ["serve", tiny_model, *flags, "--node-rank", "1", "--headless"], tmp_path, "node1"
    )
    try:
        leader = LLM(
            tiny_model, tensor_parallel_size=2, nnodes=2, master_port=port, max_model_len=128
        )
        try:
            assert len(leader.engine.core.runner.procs) == 1  # rank 1 runs on node 1
            prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8], list(range(30, 70)))]
            got = [o.outputs[0].token_ids for o in leader.generate(prompts, greedy(8))]
        finally:
            leader.engine.shutdown()
        expected = LLM(tiny_model, max_model_len=128).generate(prompts, greedy(8))
        assert got == [o.outputs[0].token_ids for o in expected]
        # The leader's stop ends the headless node's ranks, and the node exits cleanly.
        assert node1.proc.wait(30) == 0, node1.log()
    finally:
        node1.stop()


def _children(pid: int) -> list[int]:
    """The rank processes among the children of ``pid`` (spawned by multiprocessing)."""
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in (int(x) for x in f.read().split()):
                with open(f"/proc/{child}/cmdline", "rb") as cmd:
                    if b"spawn_main" in cmd.read():
                        out.append(child)
    return out


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
    monkeypatch.setenv(TP_HANG_RANK_ENV, "1")
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
