"""Prefix-cache events are published over ZeroMQ in vLLM's format (and replayed)."""

from __future__ import annotations

import struct
import time

import msgpack
import zmq
from helpers.server import free_port

from pdfleet.engine import LLM, SamplingParams
from pdfleet.engine.contracts.block_hash import (
    external_block_hash,
    get_hash_fn,
    prompt_block_hashes,
)
from pdfleet.engine.core.block_pool import KVCacheEvent
from pdfleet.engine.kv_events import kv_events_of

STORED_KEYS = {
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
}


def test_a_chain_stored_in_one_step_is_one_tagged_block_stored_event():
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    events = kv_events_of(
        [
            KVCacheEvent("stored", a, None, (1, 2), 2),
            KVCacheEvent("stored", b, a, (3, 4), 2),
            KVCacheEvent("stored", c, None, (5, 6), 2, medium="CPU"),
            KVCacheEvent("removed", a),
            KVCacheEvent("removed", b),
            KVCacheEvent("cleared", b""),
        ]
    )
    ia, ib, ic = (int.from_bytes(x[-8:], "big") for x in (a, b, c))
    assert [e.to_wire() for e in events] == [
        {
            "type": "BlockStored",
            "block_hashes": [ia, ib],
            "parent_block_hash": None,
            "token_ids": [1, 2, 3, 4],
            "block_size": 2,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        },
        {
            "type": "BlockStored",
            "block_hashes": [ic],
            "parent_block_hash": None,
            "token_ids": [5, 6],
            "block_size": 2,
            "lora_id": None,
            "medium": "CPU",
            "lora_name": None,
        },
        {"type": "BlockRemoved", "block_hashes": [ia, ib], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ]


def _recv(sub: zmq.Socket, timeout: float = 10.0):
    if not sub.poll(int(timeout * 1000)):
        raise AssertionError(f"no KV event batch within {timeout}s")
    topic, seq, payload = sub.recv_multipart()
    return topic, struct.unpack(">q", seq)[0], msgpack.unpackb(payload, raw=False)


def test_events_are_vllm_tagged_maps_with_hashes_reproducible_from_token_ids(tiny_model):
    pub_port, replay_port = free_port(), free_port()
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    llm = LLM(
        tiny_model,
        max_model_len=128,
        num_gpu_blocks_override=10,
        kv_events_config={
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://127.0.0.1:{pub_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
            "topic": "kv",
            "heartbeat_interval": 0.2,
            # What vLLM's router subscribes to: in the clear, with token ids.
            "auth": "none",
            "include_token_ids": True,
        },
    )
    try:
        # A heartbeat (an empty batch) proves the subscription is through.
        deadline = time.monotonic() + 10
        seen: list[tuple[int, dict]] = []
        while True:
            topic, seq, batch = _recv(sub)
            seen.append((seq, batch))
            # vLLM's array-like EventBatch: [ts, events, data_parallel_rank].
            ts, events, rank = batch
            assert topic == b"kv" and ts > 0 and rank == 0
            if not events:
                break
            assert time.monotonic() < deadline
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        # 5 distinct 48-token prompts through a 9-block cache: blocks are stored, then evicted.
        prompts = [[20 + i] * 40 + list(range(100, 108)) for i in range(5)]
        for p in prompts:
            llm.generate({"prompt_token_ids": p}, params)
        stored, removed = [], []
        while not removed:
            _, seq, batch = _recv(sub)
            seen.append((seq, batch))
            for ev in batch[1]:
                if ev["type"] == "BlockStored":
                    assert set(ev) == STORED_KEYS and ev["medium"] == "GPU"
                    assert len(ev["token_ids"]) == len(ev["block_hashes"]) * ev["block_size"]
                    stored.append(ev)
                elif ev["type"] == "BlockRemoved":
                    assert set(ev) == {"type", "block_hashes", "medium"}
                    removed.append(ev)
        # The first prompt's 3 full blocks arrive as one chain; an outside router
        # recomputes their ids from the token ids, the block size and sha256.
        first = next(ev for ev in stored if ev["token_ids"][:40] == prompts[0][:40])
        want = [
            external_block_hash(h)
            for h in prompt_block_hashes(prompts[0], 16, get_hash_fn("sha256"))
        ]
        assert first["parent_block_hash"] is None
        assert first["block_hashes"] == want
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in first["block_hashes"])
        # Sequence numbers are contiguous, and the replay socket serves them again
        # (a slow-joining subscriber may miss the first ones: that is what replay is for).
        seqs = [s for s, _ in seen]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", struct.pack(">q", 0)])
        replayed = []
        while dealer.poll(5000):
            _, seq_bytes, payload = dealer.recv_multipart()
            seq = struct.unpack(">q", seq_bytes)[0]
            if seq == -1:
                break
            replayed.append((seq, msgpack.unpackb(payload, raw=False)))
        dealer.close(0)
        assert [s for s, _ in replayed] == list(range(len(replayed)))
        assert replayed[seqs[0] : seqs[0] + len(seen)] == seen
        # The publisher's first batch said "start from nothing" (a new instance).
        assert replayed[0][1][1] == [{"type": "AllBlocksCleared"}]
    finally:
        sub.close(0)
        llm.engine.shutdown()


def test_fast_sha256_path_hashes_exactly_as_the_per_block_function():
    sha = get_hash_fn("sha256")
    tokens = [(i * 7919) % 50_000 for i in range(16 * 9 + 5)] + [-3, 2**40]
    fast = prompt_block_hashes(tokens, 16, sha)
    slow, parent = [], b"\x00" * 32
    for i in range(len(tokens) // 16):
        parent = sha(parent, tokens[16 * i : 16 * i + 16])
        slow.append(parent)
    assert fast == slow and len(fast) == 9
    # Incremental extension (the scheduler's way) gives the same chain.
    from pdfleet.engine.contracts.block_hash import extend_block_hashes

    grown: list[bytes] = []
    for n in range(0, len(tokens) + 1, 5):
        extend_block_hashes(grown, tokens[:n], 16, sha)
    extend_block_hashes(grown, tokens, 16, sha)
    assert grown == fast
    assert prompt_block_hashes(tokens, 16, sha, max_blocks=3) == fast[:3]
