"""Prefix-cache events are published over ZeroMQ (and replayed)."""

from __future__ import annotations

import struct
import time

import msgpack
import zmq
from helpers.server import free_port

from pdfleet.engine import LLM, SamplingParams


def test_block_stored_and_removed_events_are_published(tiny_model):
    pub_port, replay_port = free_port(), free_port()
    llm = LLM(
        tiny_model,
        max_model_len=128,
        num_gpu_blocks_override=10,
        kv_events_config={
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://127.0.0.1:{pub_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
            "topic": "kv",
        },
    )
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    time.sleep(0.3)  # let the subscription reach the publisher
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    # 5 distinct 48-token prompts through a 9-block cache: blocks are stored, then evicted.
    for i in range(5):
        llm.generate({"prompt_token_ids": [20 + i] * 48}, params)
    kinds, stored_tokens = [], []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "BlockRemoved" not in kinds:
        if sub.poll(200):
            topic, seq, payload = sub.recv_multipart()
            ts, events, _rank = msgpack.unpackb(payload, raw=False)
            assert topic == b"kv" and struct.unpack(">q", seq)[0] >= 0 and ts > 0
            for ev in events:
                kinds.append(ev[0])
                if ev[0] == "BlockStored":
                    assert len(ev[1][0]) == 32 and ev[4] == 16
                    stored_tokens.append(ev[3])
    assert "BlockStored" in kinds and "BlockRemoved" in kinds
    assert [20] * 16 in stored_tokens
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    dealer.send_multipart([b"", struct.pack(">q", 0)])
    replayed = []
    while dealer.poll(2000):
        _, seq, payload = dealer.recv_multipart()
        if struct.unpack(">q", seq)[0] == -1:
            break
        replayed.append(payload)
    assert replayed
    sub.close(0)
    dealer.close(0)
    llm.engine.shutdown()
