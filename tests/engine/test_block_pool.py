"""Block pool and KV cache manager: free list, LRU, ref counts, collision safety."""

from __future__ import annotations

import pytest
from helpers.engine import assert_no_leaks, hf_greedy, random_prompts

from pdfleet.engine import LLM, SamplingParams
from pdfleet.engine.contracts import block_hash
from pdfleet.engine.contracts.block_hash import (
    ROOT_HASH,
    cbor_encode,
    extend_block_hashes,
    get_hash_fn,
)
from pdfleet.engine.core.block_pool import BlockPool, FreeBlockQueue, KVBlock
from pdfleet.engine.core.kv_cache_manager import KVCacheManager
from pdfleet.engine.request import Request


def req(rid: str, tokens: list[int], bs: int = 4) -> Request:
    r = Request(rid, tokens, SamplingParams(max_tokens=4))
    extend_block_hashes(r.block_hashes, r.all_token_ids, bs, get_hash_fn("sha256"))
    return r


def test_free_queue_removes_from_the_middle_in_constant_time():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and q.num_free == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    assert [b.block_id for b in q] == [1, 3, 4, 2]


def test_null_block_is_never_allocated_and_double_free_is_caught():
    pool = BlockPool(4, enable_caching=True)
    got = pool.allocate(3)
    assert 0 not in [b.block_id for b in got]
    assert pool.num_free_blocks == 0
    with pytest.raises(RuntimeError, match="cannot allocate 1 blocks"):
        pool.allocate(1)
    pool.free(got)
    with pytest.raises(RuntimeError, match="double free of block"):
        pool.free(got[:1])


def test_freed_cached_blocks_are_reused_least_recently_freed_first():
    kv = KVCacheManager(num_blocks=7, block_size=4, enable_caching=True)
    a, b = req("a", list(range(100, 109))), req("b", list(range(200, 209)))
    assert kv.allocate_slots(a, 9) is not None and kv.allocate_slots(b, 9) is not None
    kv.free(a)
    kv.free(b)
    # a's blocks were freed first (tail first), so they are evicted first.
    c = req("c", list(range(300, 313)))
    kv.allocate_slots(c, 12)
    hits_a, _ = kv.get_computed_blocks(req("a2", list(range(100, 109))))
    hits_b, _ = kv.get_computed_blocks(req("b2", list(range(200, 209))))
    assert hits_a == [] and len(hits_b) == 2
    assert kv.num_evictions == 2  # exactly a's two cached blocks


def test_manager_reports_request_blocks_and_events_without_exposing_its_pool():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True, record_events=True)
    a = req("a", list(range(100, 109)))
    assert kv.num_request_blocks("a") == 0 and kv.num_requests == 0
    assert kv.allocate_slots(a, 9) is not None
    assert kv.num_request_blocks("a") == 3 == len(kv.block_ids("a"))
    assert kv.num_requests == 1
    kv.cache_full_blocks(a, 8)
    stored = kv.take_events()
    assert stored and kv.take_events() == []  # taking clears them
    kv.free(a)
    assert kv.num_request_blocks("a") == 0 and kv.num_requests == 0


def test_prefix_hits_take_references_and_last_token_is_recomputed():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    b = req("b", list(range(8)))
    blocks, n = kv.get_computed_blocks(b)
    assert n == 4 and len(blocks) == 1  # 8 tokens: at most 7 may hit -> one full block
    kv.allocate_slots(b, 4, blocks)
    assert blocks[0].ref_cnt == 2
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_lookup_checks_tokens_and_parent_not_only_the_hash():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    kv.allocate_slots(a, 9)
    # Same hashes, different tokens (a collision): no hit.
    fake = req("f", [9, 9, 9, 9, 9, 9, 9, 9, 9])
    fake.block_hashes = list(a.block_hashes)
    assert kv.get_computed_blocks(fake) == ([], 0)
    # Second block's tokens match but the first doesn't: the chain breaks at once.
    other = req("o", [0, 0, 0, 0, 5, 6, 7, 8, 9])
    other.block_hashes = list(a.block_hashes)
    assert kv.get_computed_blocks(other) == ([], 0)


def test_engine_output_is_correct_even_if_every_block_hash_collides(
    tiny_model, hf_model_factory, monkeypatch
):
    monkeypatch.setitem(block_hash.HASH_FUNCTIONS, "sha256", lambda parent, ids: b"\x01" * 32)
    llm = LLM(tiny_model, max_model_len=256)
    vocab = llm.engine.config.model_config.vocab_size
    (shared,) = random_prompts(vocab, [40], seed=31)
    prompts = [shared + t for t in random_prompts(vocab, [5, 20], seed=32)]
    prompts += random_prompts(vocab, [45], seed=33)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for p, o in zip(prompts, outs, strict=True):
            assert o.outputs[0].token_ids == hf_greedy(hf_model_factory(tiny_model), p, 12)
    assert_no_leaks(llm)


def test_hash_algorithms():
    sha = get_hash_fn("sha256")
    cbor = get_hash_fn("sha256_cbor")
    assert sha(ROOT_HASH, [1, 2]) != sha(ROOT_HASH, [2, 1])
    assert sha(ROOT_HASH, [1, 2]) != cbor(ROOT_HASH, [1, 2])
    assert cbor_encode([b"ab", [0, 23, 24, 255, 256, 65536, -1], None]) == bytes.fromhex(
        "83426162870017181818ff1901001a0001000020f6"
    )
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        get_hash_fn("md5")


def test_usage_counts_held_blocks_only():
    kv = KVCacheManager(num_blocks=5, block_size=4, enable_caching=True)
    a = req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    assert kv.usage == pytest.approx(0.5)
    kv.free(a)
    assert kv.usage == 0.0
