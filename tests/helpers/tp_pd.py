"""The checks that P/D tests between tensor-parallel engines share
(tests/kv_transfer/test_tp_pd.py on one node, test_tp_nodes.py over two):
stepping one request to its end, a pair's pulls against aggregated serving,
and an abort in the middle of a pull."""

from __future__ import annotations

import time

from prometheus_client import generate_latest

from pdfleet.engine.contracts.metrics import ENGINE_KV_TRANSFER_SHARD_BYTES, parse_metrics
from pdfleet.engine.kv_transfer.layout import rank_heads
from pdfleet.engine.loop.llm_engine import LLMEngine
from pdfleet.engine.metrics import EngineMetrics
from pdfleet.engine.sampling_params import SamplingParams

BLOCK = 16
ENGINE = dict(device="cpu", max_model_len=256, block_size=BLOCK, max_num_seqs=4)
# Prompt lengths: whole blocks plus one token, and several blocks plus a partial one.
LENGTHS = [33, 70]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def prompt_of(n: int, seed: int) -> list[int]:
    return [(seed * 131 + i * 17) % 900 + 20 for i in range(n)]


def run(llm: LLMEngine, rid: str, prompt: list[int], sp: SamplingParams, params=None):
    """Step one request to its end (bounded); its last output."""
    llm.add_request(rid, {"prompt_token_ids": prompt}, sp, kv_transfer_params=params)
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, f"{rid} did not finish"
        for out in llm.step():
            if out.request_id == rid and out.finished:
                return out  # a producer still holds the blocks: leave them leased
        if llm.stats.num_scheduled_tokens == 0:
            time.sleep(0.002)  # waiting for the pull: poll gently


def check_pair_matches_aggregated(
    prefill: LLMEngine, decode: LLMEngine, aggregated: LLMEngine, tag: str, seed: int
) -> None:
    """Prefill on one engine, decode on the other: the tokens of ``aggregated``
    alone; every decode rank moved exactly its own heads' share of every pulled
    block, and the engine exports that per rank; every lease is confirmed."""
    transport = decode.connector.worker.connector.transport
    cfg = decode.config.model_config
    tp = decode.config.parallel_config.tensor_parallel_size
    before = list(transport.rank_bytes)
    pulled_blocks = 0
    for i, n in enumerate(LENGTHS):
        # Prompts no decode engine has seen: none of it is in its prefix cache.
        prompt = prompt_of(n, seed + i)
        expected = run(aggregated, f"{tag}-agg-{i}", prompt, greedy(8))
        first = run(prefill, f"{tag}-pre-{i}", prompt, greedy(1), {"do_remote_decode": True})
        params = first.kv_transfer_params
        assert params["tp_size"] == prefill.config.parallel_config.tensor_parallel_size
        assert len(params["remote_block_ids"]) == (n - 1) // BLOCK
        got = run(decode, f"{tag}-dec-{i}", prompt, greedy(8), params=params)
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids, f"prompt of {n}"
        pulled_blocks += len(params["remote_block_ids"])
    assert pulled_blocks > 0
    heads = rank_heads(0, tp, cfg.num_key_value_heads)[1]
    per_block = 2 * cfg.num_hidden_layers * BLOCK * heads * cfg.head_dim * 4  # float32
    moved = [a - b for a, b in zip(transport.rank_bytes, before, strict=True)]
    assert moved == [pulled_blocks * per_block] * tp
    metrics = EngineMetrics(decode.config)
    metrics.update(decode)
    samples = parse_metrics(generate_latest(metrics.registry).decode()).samples
    exported = {
        labels["rank"]: value for labels, value in samples[ENGINE_KV_TRANSFER_SHARD_BYTES.name]
    }
    assert exported == {str(r): float(b) for r, b in enumerate(transport.rank_bytes)}
    stats = decode.connector.worker.connector.stats
    assert stats.failed_transfers == 0
    assert stats.bytes_transferred >= pulled_blocks * per_block * tp
    # Every lease was claimed and confirmed: the producer frees its blocks.
    deadline = time.monotonic() + 10
    while prefill.core.scheduler.held_blocks and time.monotonic() < deadline:
        prefill.step()
        time.sleep(0.01)
    assert not prefill.core.scheduler.held_blocks


def start_pull(decode: LLMEngine, rid: str, prompt: list[int], params: dict) -> int:
    """Add a decode request and step until its READs are shipped to the ranks;
    the pull's token."""
    transport = decode.connector.worker.connector.transport
    tokens = transport.next_token
    decode.add_request(rid, {"prompt_token_ids": prompt}, greedy(4), kv_transfer_params=params)
    deadline = time.monotonic() + 20
    while transport.next_token == tokens or transport.outbox:
        assert time.monotonic() < deadline, "the pull never started"
        decode.step()
        time.sleep(0.002)
    return transport.next_token - 1


def assert_quarantine_ends(decode: LLMEngine) -> None:
    """Once every rank's READ has ended, the quarantined blocks go back to the pool."""
    sched = decode.core.scheduler
    deadline = time.monotonic() + 20
    while sched.held_blocks and time.monotonic() < deadline:
        decode.step()
        time.sleep(0.005)
    assert not sched.held_blocks
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks
