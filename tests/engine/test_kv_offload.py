"""The host KV tier (--kv-offload-bytes): bookkeeping, events, and greedy output
identical to an engine without it through eviction and reload."""

from __future__ import annotations

import argparse
import time

import msgpack
import pytest
import zmq
from helpers.engine import assert_no_leaks, random_prompts
from helpers.server import free_port

from pdfleet.engine import LLM, SamplingParams
from pdfleet.engine.config import CacheConfig, EngineArgs
from pdfleet.engine.contracts.block_hash import (
    extend_block_hashes,
    external_block_hash,
    get_hash_fn,
    prompt_block_hashes,
)
from pdfleet.engine.contracts.kv_events import EventBatch
from pdfleet.engine.core.host_tier import HostTier
from pdfleet.engine.core.kv_cache_manager import KVCacheManager
from pdfleet.engine.gateway.kv_index import KVIndex
from pdfleet.engine.loop.engine_core import StepFailed
from pdfleet.engine.request import Request
from pdfleet.engine.testing_hooks import FAULT_TOKEN_ENV
from pdfleet.engine.worker.host_kv import physical_memory

BS = 4


def req(rid: str, tokens: list[int]) -> Request:
    r = Request(rid, tokens, SamplingParams(max_tokens=1))
    extend_block_hashes(r.block_hashes, r.all_token_ids, BS, KVCacheManager(2, BS, True).hash_fn)
    return r


def kinds(events) -> list[tuple[str, str]]:
    return [(e.kind, e.medium) for e in events]


# -- bookkeeping (no model) ------------------------------------------------------


def test_host_tier_evicts_least_recently_used_ready_entries_and_never_pending_ones():
    tier = HostTier(2, record_events=True)
    a = tier.reserve(b"a", (1,), None)
    b = tier.reserve(b"b", (2,), b"a")
    assert a is not None and b is not None
    assert tier.reserve(b"c", (3,), None) is None  # both slots in flight: nothing to evict
    assert tier.get(b"a", (1,), None) is None  # in flight: not a hit yet
    tier.store_done(a.slot)
    tier.store_done(b.slot)
    assert tier.get(b"a", (1,), None) is a and tier.get(b"a", (9,), None) is None
    tier.touch(b"a")  # b is now the least recently used
    c = tier.reserve(b"c", (3,), None)
    assert c is not None and c.slot == b.slot
    assert b"b" not in tier and b"a" in tier
    assert tier.num_evictions == 1
    events = tier.take_events()
    assert kinds(events) == [("stored", "CPU"), ("stored", "CPU"), ("removed", "CPU")]
    assert events[1].parent_hash == b"a" and events[2].block_hash == b"b"


def test_manager_stores_freed_blocks_and_loads_them_back_after_device_eviction():
    kv = KVCacheManager(
        num_blocks=5, block_size=BS, enable_caching=True, record_events=True, num_host_blocks=8
    )
    a = req("a", list(range(100, 109)))  # 2 full blocks + 1 token
    kv.begin_step()
    assert kv.allocate_slots(a, 9) is not None
    kv.free(a)
    # The next step queues both freed blocks for a store...
    kv.begin_step()
    b = req("b", list(range(200, 217)))  # needs all 4 usable blocks: evicts a's
    assert kv.allocate_slots(b, 16) is not None
    ops = kv.take_offload_ops()
    assert ops is not None and len(ops.stores) == 2 and not ops.loads
    # ...and overwrites a block a store still reads: the step must wait for it.
    assert ops.wait_stores
    a2 = req("a2", list(range(100, 109)))
    assert kv.get_computed_blocks(a2) == ([], 0)
    assert kv.get_host_hits(a2, 0) == []  # the copies have not landed
    kv.stores_done([slot for _b, slot in ops.stores])
    kv.free(b)
    hits = kv.get_host_hits(a2, 0)
    assert [h.block_hash for h in hits] == a2.block_hashes[:2]
    kv.begin_step()
    new = kv.allocate_slots(a2, 1, [], host_hits=hits)
    assert new is not None
    ops = kv.take_offload_ops()
    assert ops is not None
    assert [d for _s, d in ops.loads] == [blk.block_id for blk in new[:2]]
    stats = kv.host_stats()
    assert (stats.stored_blocks, stats.loaded_blocks) == (2, 2)
    assert kv.stats.host_hits == 2 * BS
    events = kv.take_events()
    assert ("stored", "CPU") in kinds(events) and ("removed", "GPU") in kinds(events)
    # The reloaded blocks are device prefix hits again.
    assert kv.get_computed_blocks(req("a3", list(range(100, 109))))[1] == 2 * BS


def test_blocks_evicted_before_their_turn_to_store_are_stored_on_eviction():
    # One store per step: a's 4 freed blocks would mostly be evicted unstored.
    kv = KVCacheManager(
        num_blocks=6, block_size=BS, enable_caching=True, num_host_blocks=8, max_stores_per_step=1
    )
    a = req("a", list(range(100, 117)))  # 4 full blocks + 1 token
    kv.begin_step()
    assert kv.allocate_slots(a, 17) is not None
    kv.free(a)
    kv.begin_step()  # the budget: one store queued
    b = req("b", list(range(200, 217)))  # takes all 5 usable blocks: evicts a's 4
    assert kv.allocate_slots(b, 17) is not None
    ops = kv.take_offload_ops()
    assert ops is not None and ops.wait_stores
    assert len(ops.stores) == 4 and len({slot for _b, slot in ops.stores}) == 4
    kv.stores_done([slot for _b, slot in ops.stores])
    kv.free(b)
    a2 = req("a2", list(range(100, 117)))
    assert [h.block_hash for h in kv.get_host_hits(a2, 0)] == a2.block_hashes[:4]


def test_a_store_on_eviction_never_reuses_a_slot_the_same_step_loads_from():
    # A host tier of 2 slots holding a's 2 blocks; a2 loads them back into
    # blocks whose eviction stores c's blocks: those stores must not take a's slots.
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=True, num_host_blocks=2)
    a = req("a", list(range(100, 109)))  # 2 full blocks + 1 token
    kv.begin_step()
    assert kv.allocate_slots(a, 9) is not None
    kv.free(a)
    kv.begin_step()
    ops = kv.take_offload_ops()
    assert ops is not None and len(ops.stores) == 2
    kv.stores_done([slot for _b, slot in ops.stores])
    c = req("c", list(range(300, 317)))  # all 5 usable blocks: evicts a's device copies
    assert kv.allocate_slots(c, 17) is not None
    kv.take_offload_ops()
    kv.free(c)  # c's 4 cached blocks are free and not in the (full) host tier
    a2 = req("a2", list(range(100, 109)))
    assert kv.get_computed_blocks(a2) == ([], 0)
    hits = kv.get_host_hits(a2, 0)
    assert len(hits) == 2
    loading = {h.slot for h in hits}
    assert kv.allocate_slots(a2, 1, [], host_hits=hits) is not None  # evicts 3 of c's
    ops = kv.take_offload_ops()
    assert ops is not None and {s for s, _d in ops.loads} == loading
    assert not loading & {slot for _b, slot in ops.stores}
    assert kv.get_host_hits(req("a3", list(range(100, 109))), 0) == hits


def test_reset_prefix_cache_forgets_both_tiers():
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=True, num_host_blocks=4)
    a = req("a", list(range(9)))
    kv.begin_step()
    kv.allocate_slots(a, 9)
    kv.free(a)
    kv.begin_step()
    ops = kv.take_offload_ops()
    assert ops is not None
    kv.stores_done([slot for _b, slot in ops.stores])
    assert kv.host_stats().used_blocks == 2
    assert kv.reset_prefix_cache()
    assert kv.host_stats().used_blocks == 0
    assert kv.get_host_hits(req("a2", list(range(9))), 0) == []


# -- configuration ----------------------------------------------------------------


def test_kv_offload_bytes_flag_takes_size_suffixes():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--kv-offload-bytes", "64M"]))
    assert args.kv_offload_bytes == 64 << 20
    with pytest.raises(ValueError, match="kv_offload_bytes must be positive"):
        CacheConfig(kv_offload_bytes=0)


def test_kv_offload_with_tensor_parallelism_is_refused(tiny_model):
    args = EngineArgs(model=tiny_model, tensor_parallel_size=2, kv_offload_bytes=1 << 20)
    with pytest.raises(ValueError, match="--kv-offload-bytes with --tensor-parallel-size"):
        args.create_engine_config(device="cpu")


def test_offload_larger_than_host_memory_is_refused_with_the_numbers(tiny_model):
    too_big = physical_memory() + (1 << 30)
    with pytest.raises(ValueError, match="--kv-offload-bytes") as err:
        LLM(tiny_model, max_model_len=256, kv_offload_bytes=too_big)
    message = str(err.value)
    assert f"--kv-offload-bytes {too_big}" in message
    assert f"{physical_memory() / (1 << 30):.2f} GiB physical memory" in message


# -- the engine ----------------------------------------------------------------------

# 24 device blocks of 16 tokens hold one ~10-block prompt and its neighbour's start,
# so each of four prompts evicts the one before last.
ENGINE = {"max_model_len": 256, "num_gpu_blocks_override": 24, "max_num_seqs": 2}
LENGTHS = [150, 140, 160, 150]


def conversation(llm: LLM) -> list[list[int]]:
    """Four prompts, then each again with one more token: the second round's
    prefixes were evicted from the device cache by the first round."""
    vocab = llm.engine.config.model_config.vocab_size
    prompts = random_prompts(vocab, LENGTHS, seed=31)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = []
    for extra in ([], [9]):
        for p in prompts:
            (out,) = llm.generate([{"prompt_token_ids": p + extra}], [params])
            outs.append(out.outputs[0].token_ids)
    assert_no_leaks(llm)
    return outs


@pytest.fixture(scope="module")
def reference(tiny_model) -> tuple[list[list[int]], int]:
    """The outputs without a host tier, and the bytes of one KV block."""
    llm = LLM(tiny_model, **ENGINE)
    outs = conversation(llm)
    assert llm.engine.stats.prefix_cache_hits == 0  # every prefix was evicted in time
    return outs, llm.engine.core.runner.kv_bytes_per_block


def test_greedy_output_is_identical_through_host_tier_eviction_and_reload(tiny_model, reference):
    outs, per_block = reference
    llm = LLM(tiny_model, kv_offload_bytes=4 << 20, **ENGINE)
    assert llm.engine.config.cache_config.num_cpu_blocks == (4 << 20) // per_block
    assert conversation(llm) == outs
    s = llm.engine.stats
    assert llm.engine.core.scheduler.kv.num_evictions > 0
    assert s.host_kv_stored_blocks >= sum(n // 16 for n in LENGTHS[:2])
    # Every second-round prompt's full blocks came back from the host.
    assert s.host_kv_loaded_blocks >= sum(n // 16 for n in LENGTHS)
    assert s.host_kv_hit_tokens == 16 * s.host_kv_loaded_blocks
    assert s.prefix_cache_hits >= s.host_kv_hit_tokens
    assert s.host_kv_stored_bytes == per_block * s.host_kv_stored_blocks
    assert s.host_kv_loaded_bytes == per_block * s.host_kv_loaded_blocks


def test_a_host_tier_smaller_than_the_working_set_evicts_lru_and_stays_correct(
    tiny_model, reference
):
    outs, per_block = reference
    # 12 host blocks: about one prompt; older ones are evicted from the host too.
    llm = LLM(tiny_model, kv_offload_bytes=12 * per_block, **ENGINE)
    assert conversation(llm) == outs
    s = llm.engine.stats
    assert s.host_kv_num_blocks == 12 and s.host_kv_used_blocks <= 12
    assert s.host_kv_evicted_blocks > 0
    assert s.host_kv_stored_blocks > 12


def test_kv_events_say_which_tier_holds_a_block(tiny_model):
    port = free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"tcp://127.0.0.1:{port}")
    # A plain subscriber (auth none): what the events say, not who may read them.
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{port}",
        "auth": "none",
    }
    llm = LLM(
        tiny_model,
        max_model_len=128,
        num_gpu_blocks_override=10,
        kv_offload_bytes=8 * 8192,  # 8 host blocks of the tiny model: under 4 prompts
        kv_events_config=events | {"heartbeat_interval": 0.2},
    )
    try:
        deadline = time.monotonic() + 30
        while sub.poll(200) == 0 or msgpack.unpackb(sub.recv_multipart()[2])[1]:
            assert time.monotonic() < deadline, "no heartbeat: the subscription is not through"
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        prompts = [[20 + i] * 40 + list(range(100, 108)) for i in range(5)]
        for p in prompts:
            llm.generate({"prompt_token_ids": p}, params)
        done = time.time()  # every step's events were queued before this
        index = KVIndex(host_weight=0.5)
        seen: set[tuple[str, str]] = set()
        idle = False  # the step events are all out once a later heartbeat follows them
        while not idle:
            assert time.monotonic() < deadline, f"events seen: {sorted(seen)}"
            if not sub.poll(200):
                continue
            payload = sub.recv_multipart()[2]
            ts, batch, _rank = msgpack.unpackb(payload, raw=False)
            for ev in batch:
                if ev["type"] != "AllBlocksCleared":
                    seen.add((ev["type"], ev["medium"]))
            index.apply("e", EventBatch.decode(payload).events)
            idle = not batch and ts > done
    finally:
        llm.engine.shutdown()
        sub.close(0)
    assert {("BlockStored", "CPU"), ("BlockRemoved", "CPU"), ("BlockRemoved", "GPU")} <= seen
    s = llm.engine.stats
    assert s.host_kv_evicted_blocks > 0 and s.host_kv_used_blocks == 8
    # Blocks the device evicted but the host still holds: the gateway's index
    # (fed by the events alone) counts them at the host weight.
    scores = [
        index.matched(
            [external_block_hash(h) for h in prompt_block_hashes(p, 16, get_hash_fn("sha256"))],
            ["e"],
        )["e"]
        for p in prompts
    ]
    assert any(n > 0 and weight < n for n, weight in scores), scores


def test_a_failed_step_forgets_the_stores_it_never_started(tiny_model, monkeypatch):
    monkeypatch.setenv(FAULT_TOKEN_ENV, "7")  # a step scheduling token 7 raises
    llm = LLM(tiny_model, kv_offload_bytes=1 << 20, **ENGINE)
    (prompt,) = random_prompts(llm.engine.config.model_config.vocab_size, [100], seed=32)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (first,) = llm.generate([{"prompt_token_ids": prompt}], [params])
    core = llm.engine.core
    # The next step queues stores of the finished prompt's blocks, then fails
    # before the worker runs.
    core.add_request(Request("bad", [7] * 20, params))
    with pytest.raises(StepFailed):
        core.step()
    core.fail_requests(["bad"])
    kv = core.scheduler.kv
    assert kv.host_stats().used_blocks == 0 and not kv.has_offload_work
    (again,) = llm.generate([{"prompt_token_ids": prompt}], [params])
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert kv.num_requests == 0 and kv.num_free_blocks == kv.num_usable_blocks
