"""The exact prefix index: events in, leading blocks per engine out; its routing."""

from __future__ import annotations

import asyncio
import struct
import time

import httpx
import msgpack
import pytest
from helpers.server import free_port

from pdfleet.engine.config import KVEventsConfig
from pdfleet.engine.config.gateway import GatewayConfig
from pdfleet.engine.contracts.block_hash import (
    external_block_hash,
    get_hash_fn,
    prompt_block_hashes,
)
from pdfleet.engine.contracts.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from pdfleet.engine.core.block_pool import KVCacheEvent
from pdfleet.engine.gateway.discovery import Endpoint, StaticDiscovery, parse_engines
from pdfleet.engine.gateway.engines import EngineLoad, EnginePool
from pdfleet.engine.gateway.kv_index import KVEventFollower, KVIndex, Source, sources_for
from pdfleet.engine.gateway.metrics import GatewayMetrics
from pdfleet.engine.gateway.prompt import PromptAnalyzer, PromptInfo, chain_hashes
from pdfleet.engine.gateway.routing import PrefixAffinity, Router
from pdfleet.engine.kv_events import KVEventPublisher

SHA = get_hash_fn("sha256")


def ids_of(tokens: list[int]) -> list[int]:
    return [external_block_hash(h) for h in prompt_block_hashes(tokens, 16, SHA)]


def stored(ids: list[int], host: bool = False) -> BlockStored:
    return BlockStored(list(ids), medium="CPU" if host else "GPU")


def removed(ids: list[int], host: bool = False) -> BlockRemoved:
    return BlockRemoved(list(ids), medium="CPU" if host else "GPU")


def decode_batch(payload: bytes):
    return EventBatch.decode(payload).events


def kind_of(event) -> str:
    return {BlockStored: "stored", BlockRemoved: "removed", AllBlocksCleared: "cleared"}[
        type(event)
    ]


def conversation(seed: int, blocks: int) -> list[int]:
    return [seed * 10_000 + i for i in range(16 * blocks)]


def test_an_engine_scores_the_leading_prompt_blocks_it_holds_host_blocks_weighted_lower():
    index = KVIndex(host_weight=0.5)
    prompt = ids_of(conversation(1, 8))
    index.apply("a", [stored(prompt[:6])])
    index.apply("b", [stored(prompt[:2]), stored(prompt[2:4], host=True), stored(prompt[5:])])
    index.apply("c", [])  # a heartbeat: fresh, holding nothing
    got = index.matched(prompt, ["a", "b", "c", "unknown"])
    # b's run ends at its missing fifth block; two of its four are host-tier blocks.
    assert got == {"a": (6, 6.0), "b": (4, 3.0), "c": (0, 0.0)}
    # A block removed from the device tier (moved to the host tier) still counts, lower.
    index.apply("a", [removed([prompt[0]]), stored([prompt[0]], host=True)])
    assert index.matched(prompt, ["a"]) == {"a": (6, 5.5)}
    index.apply("a", [removed([prompt[0]], host=True)])
    assert index.matched(prompt, ["a"]) == {"a": (0, 0.0)}


def test_stale_engines_are_left_out_and_a_heartbeat_brings_them_back():
    index = KVIndex(stale_after=5.0)
    prompt = ids_of(conversation(2, 4))
    index.apply("a", [stored(prompt)])
    later = time.monotonic() + 6.0
    assert not index.is_fresh("a", later)
    assert index.matched(prompt, ["a"], now=later) == {}
    index.apply("a", [])
    assert index.matched(prompt, ["a"]) == {"a": (4, 4.0)}


def test_cleared_engine_entries_stop_counting_at_once_and_the_sweep_frees_its_slot():
    index = KVIndex()
    p1, p2 = ids_of(conversation(3, 4)), ids_of(conversation(4, 4))
    index.apply("a", [stored(p1)])
    index.apply("b", [stored(p1), stored(p2)])
    old_slot = index.engines["a"].slot
    index.apply("a", [AllBlocksCleared(), stored(p2[:1])])
    assert index.matched(p1, ["a", "b"]) == {"a": (0, 0.0), "b": (4, 4.0)}
    assert index.matched(p2, ["a"]) == {"a": (1, 1.0)}
    while index.sweep(budget=3):
        pass
    assert old_slot in index._free_slots and not index._retired
    # Swept: no entry keeps a's old bits; b's survive.
    assert all(not bits & (3 << 2 * old_slot) for bits in index.table.values())
    assert index.matched(p1, ["b"]) == {"b": (4, 4.0)}


def test_the_index_is_bounded_and_evicts_the_least_recently_stored():
    index = KVIndex(max_blocks=6)
    p1, p2 = ids_of(conversation(5, 4)), ids_of(conversation(6, 4))
    index.apply("a", [stored(p1)])
    index.apply("b", [stored(p2)])
    assert len(index) == 6 and index.evictions == 2
    assert index.matched(p1, ["a"]) == {"a": (0, 0.0)}  # its first two blocks went first
    assert index.matched(p2, ["b"]) == {"b": (4, 4.0)}


def test_batches_decode_from_tagged_maps_and_from_the_older_arrays():
    h = b"\x01" * 24 + (7).to_bytes(8, "big")
    maps = msgpack.packb(
        {
            "ts": 1.0,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [5, h],
                    "parent_block_hash": None,
                    "token_ids": [1] * 32,
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "CPU",
                    "lora_name": None,
                },
                {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"},
                {"type": "AllBlocksCleared"},
                {"type": "SomethingNewer", "x": 1},
            ],
            "data_parallel_rank": 0,
        }
    )
    events = decode_batch(maps)
    assert [
        (kind_of(e), getattr(e, "block_hashes", []), getattr(e, "host", False)) for e in events
    ] == [
        ("stored", [5, 7], True),
        ("removed", [5], False),
        ("cleared", [], False),
    ]
    arrays = msgpack.packb([1.0, [["BlockStored", [h], None, [1] * 16, 16, None, "GPU"]], 0])
    assert [(kind_of(e), e.block_hashes, e.host) for e in decode_batch(arrays)] == [
        ("stored", [7], False)
    ]
    with pytest.raises(ValueError, match="tagged map"):
        decode_batch(msgpack.packb({"ts": 1.0, "events": [3]}))


def test_stream_endpoints_come_from_the_engines_file_or_the_port_flag():
    eps = parse_engines(
        {
            "engines": [
                {"url": "http://10.0.0.1:8000", "role": "decode", "kv_events": "tcp://x:1"},
                {"url": "http://10.0.0.2:8000", "role": "decode"},
            ]
        },
        "engines.yaml",
    )
    config = GatewayConfig(
        engines_file="engines.yaml", kv_events_port=5557, kv_events_replay_port=5558
    )
    pool = EnginePool(config, StaticDiscovery(eps), GatewayMetrics(), httpx.AsyncClient())
    pool.apply(eps)
    assert sources_for(pool.engines.values(), config) == [
        Source("http://10.0.0.1:8000", "tcp://x:1", "tcp://10.0.0.1:5558"),
        Source("http://10.0.0.2:8000", "tcp://10.0.0.2:5557", "tcp://10.0.0.2:5558"),
    ]
    with pytest.raises(ValueError, match="ZMQ endpoint"):
        Endpoint("http://e:1", "decode", kv_events="http://e:5557")
    with pytest.raises(ValueError, match="--kv-host-weight"):
        GatewayConfig(engines_file="engines.yaml", kv_host_weight=2.0)


def make_router(urls: list[str], index: KVIndex) -> Router:
    config = GatewayConfig(decode=urls, disaggregation_mode="Disabled")
    endpoints = [Endpoint(u, "decode") for u in urls]
    pool = EnginePool(config, StaticDiscovery(endpoints), GatewayMetrics(), httpx.AsyncClient())
    pool.apply(endpoints)
    for e in pool.engines.values():
        pool.record_success(e, EngineLoad(compat_hash="h", block_size=16))
    return Router(config, pool, PrefixAffinity(1000), kv_index=index)


def prompt_info(tokens: list[int]) -> PromptInfo:
    return PromptInfo(len(tokens), chain_hashes(tokens, 16, 64), exact_hashes=ids_of(tokens))


def test_routing_follows_the_exact_index_and_falls_back_to_the_approximate_table_when_stale():
    urls = ["http://e1", "http://e2", "http://e3"]
    index = KVIndex(stale_after=5.0)
    router = make_router(urls, index)
    tokens = conversation(7, 6)
    for u in urls:
        index.apply(u, [])
    index.apply("http://e2", [stored(ids_of(tokens))])
    # The approximate table guesses e3 (it routed there once); the events say
    # e2 holds the prompt and e3 holds nothing.
    router.affinity.record(chain_hashes(tokens, 16, 64), "http://e3")
    assert router.route(prompt_info(tokens)).decode.url == "http://e2"
    # e2's and e3's streams go quiet: their exact entries stop counting and
    # both are scored from the approximate table, where e3's guess wins.
    for u in ("http://e2", "http://e3"):
        index.engines[u].last_event -= 10
    index.apply("http://e1", [])
    assert router.route(prompt_info(tokens)).decode.url == "http://e3"


def test_two_replicas_fed_the_same_streams_choose_the_same_engines():
    urls = [f"http://e{i}" for i in range(4)]
    replicas = [KVIndex(max_blocks=40), KVIndex(max_blocks=40)]
    routers = [make_router(urls, ix) for ix in replicas]
    streams = {u: [stored(ids_of(conversation(10 + i, 3 + i)))] for i, u in enumerate(urls)}
    # The replicas see the engines in different orders (different slots), same events.
    for ix, order in zip(replicas, (urls, urls[::-1]), strict=True):
        for u in order:
            ix.apply(u, [])
        for u in urls:
            ix.apply(u, streams[u])
    assert list(replicas[0].table) == list(replicas[1].table)
    prompts = [conversation(s, 4) for s in range(8, 20)]  # hits, partial hits and misses
    for p in prompts:
        a, b = (r.route(prompt_info(p)).decode.url for r in routers)
        assert a == b
    # Misses spread over the engines by rendezvous hashing, not all to one.
    misses = {routers[0].route(prompt_info(conversation(s, 4))).decode.url for s in range(50, 70)}
    assert len(misses) >= 3


def test_analyzer_hashes_token_id_prompts_exactly_as_the_engine():
    analyzer = PromptAnalyzer(None, max_blocks=64, exact=True)
    tokens = conversation(9, 5)
    got = analyzer.analyze({"prompt": [*tokens, 1, 2, 3]}, chat=False, block_size=16)
    assert got.exact_hashes == ids_of(tokens)
    text = analyzer.analyze({"prompt": "no tokenizer " * 100}, chat=False, block_size=16)
    assert text.exact_hashes is None


async def _until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_follower_replays_a_late_join_and_a_gap_and_drops_a_restarted_engine():
    async def main() -> None:
        pub_port, replay_port = free_port(), free_port()
        config = KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=f"tcp://127.0.0.1:{pub_port}",
            replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
            heartbeat_interval=0.1,
        )
        tokens = conversation(11, 3)
        digests = prompt_block_hashes(tokens, 16, SHA)
        ids = [external_block_hash(d) for d in digests]

        def store(i: int) -> KVCacheEvent:
            parent = digests[i - 1] if i else None
            return KVCacheEvent(
                "stored", digests[i], parent, tuple(tokens[16 * i : 16 * i + 16]), 16
            )

        metrics = GatewayMetrics()
        index = KVIndex(metrics=metrics)
        follower = KVEventFollower(index, metrics)
        pub = KVEventPublisher(config)
        try:
            pub.publish([store(0), store(1)])  # before anyone listens: only replay has it
            await _until(lambda: pub.seq >= 2)
            follower.sync(
                [
                    Source(
                        "http://e",
                        config.endpoint.replace("*", "127.0.0.1"),
                        config.replay_endpoint,
                    )
                ]
            )
            await _until(lambda: index.matched(ids, ["http://e"]).get("http://e", (0,))[0] == 2)
            replays = metrics.kv_index_replays.labels("http://e", "ok")
            await _until(lambda: replays._value.get() >= 1)
            # A gap: the batch holding store(2) is lost on the way; the next one
            # arrives and the follower fetches the lost one from the replay socket.
            pub.publish([store(2)])
            entry = index.engines["http://e"]

            def stored_seq() -> int | None:
                for seq, payload in list(pub.buffer):
                    if any(isinstance(e, BlockStored) for e in decode_batch(payload)) and seq > 1:
                        return seq
                return None

            await _until(lambda: stored_seq() is not None)
            lost = stored_seq()
            assert lost is not None
            await _until(lambda: (entry.next_seq or 0) > lost)
            live = follower.tasks.pop("http://e")
            src = follower.sources.pop("http://e")
            live.cancel()  # the rest is driven by hand, free of races with live batches
            entry.next_seq = lost
            index.apply("http://e", [removed([ids[2]])])
            assert index.matched(ids, ["http://e"])["http://e"][0] == 2
            heartbeat = msgpack.packb({"ts": 0.0, "events": [], "data_parallel_rank": 0})
            await follower._on_batch(src, lost + 1, heartbeat)
            assert index.matched(ids, ["http://e"])["http://e"][0] == 3  # store(2) replayed
            assert entry.next_seq == lost + 2
            follower.sync([src])  # follow live again
        finally:
            pub.shutdown()
        # A new engine process on the same ports: its sequence restarts, its
        # first batch clears everything the old one said.
        pub2 = None
        deadline = time.monotonic() + 10
        while pub2 is None:  # the old sockets release their ports asynchronously
            try:
                pub2 = KVEventPublisher(config)
            except ValueError:
                assert time.monotonic() < deadline, "ports not released in time"
                await asyncio.sleep(0.05)
        try:
            await _until(lambda: index.matched(ids, ["http://e"]).get("http://e") == (0, 0.0))
            resets = metrics.kv_index_resets.labels("http://e", "restart")._value.get()
            cleared = metrics.kv_index_resets.labels("http://e", "cleared")._value.get()
            assert resets + cleared >= 2
        finally:
            pub2.shutdown()
            await follower.stop()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_replay_request_frame_is_what_vllm_subscribers_send():
    # vLLM's subscriber sends one frame, the start sequence, from a REQ socket.
    import zmq

    port = free_port()
    pub = KVEventPublisher(
        KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=f"tcp://127.0.0.1:{free_port()}",
            replay_endpoint=f"tcp://127.0.0.1:{port}",
        )
    )
    req = zmq.Context.instance().socket(zmq.REQ)
    try:
        req.connect(f"tcp://127.0.0.1:{port}")
        req.send(struct.pack(">q", 0))
        assert req.poll(5000)
        seq, payload = req.recv_multipart()
        assert struct.unpack(">q", seq)[0] == 0
        assert msgpack.unpackb(payload)[1] == [{"type": "AllBlocksCleared"}]
    finally:
        req.close(0)
        pub.shutdown()


def test_pod_annotations_name_the_engines_kv_event_sockets():
    from types import SimpleNamespace

    from pdfleet.engine.gateway.discovery import pod_endpoint

    pod = SimpleNamespace(
        metadata=SimpleNamespace(
            name="decode-0",
            deletion_timestamp=None,
            labels={"pdfleet.dev/role": "decode"},
            annotations={
                "pdfleet.dev/kv-events-port": "5557",
                "pdfleet.dev/kv-events-replay-port": "5558",
            },
        ),
        status=SimpleNamespace(phase="Running", pod_ip="10.1.2.3"),
    )
    ep = pod_endpoint(pod, 8000)
    assert ep is not None
    assert (ep.kv_events, ep.kv_events_replay) == ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558")


def test_a_malformed_batch_is_skipped_and_a_failed_stream_is_followed_again(caplog):
    import zmq
    import zmq.asyncio

    async def main() -> None:
        port = free_port()
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(f"tcp://127.0.0.1:{port}")
        index = KVIndex()
        follower = KVEventFollower(index)
        src = Source("http://e", f"tcp://127.0.0.1:{port}")
        seq = 0

        async def send(payload: bytes) -> None:
            nonlocal seq
            await pub.send_multipart([b"", struct.pack(">q", seq), payload])
            seq += 1

        try:
            follower.sync([src])
            # Until the subscription is up, heartbeats are what may be lost.
            heartbeat = EventBatch(0.0).encode()
            while (
                index.engines.get("http://e") is None or index.engines["http://e"].next_seq is None
            ):
                await send(heartbeat)
                await asyncio.sleep(0.02)
            await send(msgpack.packb([0.0, [["BlockStored", [1], None, 5, 16]], 0]))
            await send(msgpack.packb([0.0, [[["x"], 1]], 0]))
            await send(EventBatch(0.0, [stored([41, 42])]).encode())
            await _until(lambda: index.matched([41, 42], ["http://e"])["http://e"][0] == 2)
            assert not follower.tasks["http://e"].done()
            assert "undecodable batch skipped (BlockStored: token_ids" in caplog.text

            # A stream whose task ends with an error (here: one batch raises out
            # of the follower) is followed again by a sync once its backoff has
            # passed, and not before.
            real = follower._on_batch

            async def broken(*_args) -> None:
                follower._on_batch = real  # type: ignore[method-assign]
                raise RuntimeError("boom")

            follower._on_batch = broken  # type: ignore[method-assign]
            failed = follower.tasks["http://e"]
            await send(heartbeat)
            await _until(failed.done)
            assert follower._failures["http://e"] == 1
            assert follower._retry_at["http://e"] > time.monotonic()
            follower.sync([src])
            assert follower.tasks["http://e"] is failed  # still backing off
            follower._retry_at["http://e"] = 0.0
            follower.sync([src])
            assert not follower.tasks["http://e"].done()
            while index.matched([43], ["http://e"])["http://e"][0] != 1:  # until subscribed
                await send(EventBatch(0.0, [stored([43])]).encode())
                await asyncio.sleep(0.02)
            assert "http://e" not in follower._failures  # reset by a batch applied
        finally:
            pub.close(0)
            await follower.stop()
            ctx.term()

    asyncio.run(asyncio.wait_for(main(), 30))
