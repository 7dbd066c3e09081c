"""Routing decisions on a pool whose engine states are set by hand (no processes)."""

from __future__ import annotations

import httpx
import pytest

from pdfleet.engine.config.gateway import GatewayConfig
from pdfleet.engine.gateway.discovery import Endpoint, StaticDiscovery
from pdfleet.engine.gateway.engines import EngineLoad, EnginePool
from pdfleet.engine.gateway.metrics import GatewayMetrics
from pdfleet.engine.gateway.prompt import PromptInfo, chain_hashes
from pdfleet.engine.gateway.routing import NoEngineError, PrefixAffinity, Router

HASH = "abc"


def make_router(
    prefill: list[str], decode: list[str], mode: str = "Always", min_tokens: int = 64
) -> Router:
    config = GatewayConfig(
        prefill=prefill, decode=decode, disaggregation_mode=mode, min_prompt_tokens=min_tokens
    )
    endpoints = [Endpoint(u, "prefill") for u in prefill] + [Endpoint(u, "decode") for u in decode]
    pool = EnginePool(config, StaticDiscovery(endpoints), GatewayMetrics(), httpx.AsyncClient())
    pool.apply(endpoints)
    for e in pool.engines.values():
        pool.record_success(e, EngineLoad(compat_hash=HASH, block_size=16))
    return Router(config, pool, PrefixAffinity(1000))


def info(tokens: int, seed: int = 0) -> PromptInfo:
    ids = [seed * 100_000 + i for i in range(tokens)]
    return PromptInfo(tokens, chain_hashes(ids, 16, 64))


def test_affinity_matches_leading_blocks_and_evicts_least_recently_used():
    aff = PrefixAffinity(capacity=4)
    a = chain_hashes(list(range(64)), 16, 64)  # 4 blocks
    aff.record(a, "e1")
    assert aff.matched(a, ["e1", "e2"]) == {"e1": 4, "e2": 0}
    # A prompt that diverges in its third block shares two blocks.
    b = chain_hashes([*range(32), *range(1000, 1032)], 16, 64)
    assert aff.matched(b, ["e1"]) == {"e1": 2}
    aff.record(b[2:], "e2")  # two new hashes push the two least recently used out
    assert len(aff) == 4
    # a's shared leading blocks were just used (kept); its last two were evicted.
    assert aff.matched(a, ["e1"]) == {"e1": 2}
    aff.forget("e2")
    assert len(aff) == 2


def test_load_aware_choice_prefers_the_shorter_queue_and_lower_kv_usage():
    router = make_router(["http://p"], ["http://d1", "http://d2"], mode="Disabled")
    d1, d2 = router.pool.engines["http://d1"], router.pool.engines["http://d2"]
    d1.load.waiting, d1.load.running = 3, 8
    assert router.route(info(10)).decode is d2
    d1.load.waiting = d1.load.running = 0
    d2.load.kv_usage = 0.9
    assert router.route(info(10)).decode is d1
    # The gateway's own in-flight count counts before the next scrape shows it.
    d2.load.kv_usage = 0.0
    d1.inflight = 5
    assert router.route(info(10)).decode is d2


def test_ties_alternate_between_engines():
    router = make_router([], ["http://d1", "http://d2"], mode="Disabled")
    picked = {router.route(info(10)).decode.url for _ in range(4)}
    assert picked == {"http://d1", "http://d2"}


def test_repeated_prefix_goes_back_to_the_engine_that_caches_it_unless_it_is_overloaded():
    router = make_router([], ["http://d1", "http://d2"], mode="Disabled")
    d1 = router.pool.engines["http://d1"]
    prompt = info(128, seed=7)
    router.affinity.record(prompt.block_hashes, "http://d1")
    d1.inflight = 2  # a little busier than d2: the cached prefix still wins
    assert all(router.route(prompt).decode is d1 for _ in range(4))
    d1.inflight = 20  # far busier: load balance instead of piling on
    assert router.route(prompt).decode.url == "http://d2"


def test_prefill_is_paired_only_with_an_equal_compat_hash():
    router = make_router(["http://p1", "http://p2"], ["http://d"])
    router.pool.engines["http://p1"].load.compat_hash = "other-model"
    for _ in range(4):
        route = router.route(info(300))
        assert route.decision == "prefill_decode" and route.prefill.url == "http://p2"
    router.pool.engines["http://p2"].load.compat_hash = "other-model"
    route = router.route(info(300))
    assert (route.decision, route.reason, route.prefill) == (
        "decode_only",
        "no_prefill_engine",
        None,
    )


@pytest.mark.parametrize(
    ("mode", "tokens", "cached", "expected"),
    [
        ("Always", 10, False, ("prefill_decode", "always")),
        ("Disabled", 1000, False, ("decode_only", "disabled")),
        ("Conditional", 63, False, ("decode_only", "short_prompt")),
        ("Conditional", 64, False, ("prefill_decode", "long_prompt")),
        ("Conditional", 200, True, ("decode_only", "cached_prefix")),
    ],
)
def test_disaggregation_decision(mode, tokens, cached, expected):
    router = make_router(["http://p"], ["http://d"], mode=mode, min_tokens=64)
    prompt = info(tokens, seed=3)
    if cached:
        router.affinity.record(prompt.block_hashes, "http://d")
    route = router.route(prompt)
    assert (route.decision, route.reason) == expected
    assert (route.prefill is not None) == (expected[0] == "prefill_decode")


def test_batched_prompts_are_not_disaggregated():
    router = make_router(["http://p"], ["http://d"])
    batch = info(500)
    batch.batch = True
    assert (router.route(batch).decision, router.route(batch).reason) == ("decode_only", "batch")


def test_no_routable_decode_engine_is_an_error_that_says_so():
    router = make_router(["http://p"], ["http://d"])
    router.pool.record_failure(router.pool.engines["http://d"], "down", definitive=True)
    with pytest.raises(NoEngineError, match="no healthy decode engine"):
        router.route(info(10))


def test_an_engine_serving_both_roles_is_never_paired_with_itself():
    router = make_router([], ["http://a"])
    router.pool.apply([Endpoint("http://a", "prefill"), Endpoint("http://a", "decode")])
    e = router.pool.engines["http://a"]
    router.pool.record_success(e, EngineLoad(compat_hash=HASH))
    assert e.role == "both"
    route = router.route(info(500))
    assert route.decode is e and route.prefill is None and route.reason == "no_prefill_engine"
