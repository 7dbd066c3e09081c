"""Peer pulls in a real `pdfleet up` P/D fleet (the conformance fleet: two prefill
engines with ``peerPull``, one decode engine, NIXL): a burst of requests sharing a
long prefix that one prefill engine caches has some of its prefill legs run on the
other prefill engine, which pulls the prefix first; every answer is the prompt's
plain computation."""

from __future__ import annotations

import asyncio

import httpx
from helpers.fleet import engines_view, metric
from helpers.server import fleet_headers, wait_until

DECISIONS = "pdfleet_gateway_peer_pull_decisions_total"
PULL_BYTES = "pdfleet_engine_kv_peer_pull_bytes_total"
INDEXED = "pdfleet_gateway_kv_index_events_total"
BURST = 32
"""Requests sent at once: those planned while the holder has enough of the earlier
ones' tails queued are cheaper where the prefix is pulled (a lend of the
holder's device-tier blocks waits for its step in progress, not for its queue)."""
TAIL = 96
"""Each request's own tokens after the shared prefix."""
MAX_BURSTS = 5
"""Bursts sent at most before the test gives up on a pull."""
TOKEN_DELAY = 0.001
"""Seconds per scheduled token each engine's forward pass takes longer while the
bursts run (counted as forward time: the engines' measured prefill rates fall to
about 1,000 tokens per second)."""


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 131 + i * 17) % 1700 + 40 for i in range(n)]


def body(prompt: list[int], **extra) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def answer(url: str, prompt: list[int], **extra) -> str:
    r = httpx.post(
        url + "/v1/completions", json=body(prompt, **extra), headers=fleet_headers(), timeout=120
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


async def at_once(gateway: str, prompts: list[list[int]]) -> list[str]:
    """``prompts`` posted together, each on its own connection opened first."""
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=gateway, timeout=120, limits=limits) as client:
        opened = await asyncio.gather(*(client.get("/health") for _ in prompts))
        assert all(r.status_code == 200 for r in opened), opened
        answered = await asyncio.gather(
            *(client.post("/v1/completions", json=body(p)) for p in prompts)
        )
    for r in answered:
        assert r.status_code == 200, r.text
    return [r.json()["choices"][0]["text"] for r in answered]


def rate_measured(gateway: str) -> bool:
    return any(
        e["role"] == "prefill" and e["peer_pull"]["prefill_tokens_per_s"]
        for e in engines_view(gateway)["engines"]
    )


def test_prefill_legs_pull_a_shared_prefix_from_the_other_prefill_engine(
    fleet_up, fleet_step_delay
):
    gw = fleet_up.url
    prefill = [e["url"] for e in fleet_up.engines() if e["role"] == "prefill"]
    decode = fleet_up.engine_url("decode")
    assert len(prefill) == 2, fleet_up.engines()
    prefix = tokens(320, 1)  # 20 blocks of the fleet's 512-token context
    prompts = {(0,): prefix + tokens(TAIL, 100)}
    indexed = metric(gw, INDEXED)
    answers = {(0,): answer(gw, prompts[(0,)])}
    # The gateway's index has the prefix's blocks (on one prefill engine, the
    # holder), and a prefill rate is measured: the decision is on.
    assert wait_until(lambda: metric(gw, INDEXED) > indexed and rate_measured(gw), timeout=30)
    pulls = metric(gw, DECISIONS, decision="pull")
    pulled = {u: metric(u, PULL_BYTES) for u in prefill}
    # Before any pull of the fleet is measured the decision explores: it pulls once
    # serving on the holder is predicted no sooner, i.e. once the holder's queue of
    # the burst outlasts the lend and the puller's own queue and step (the gateway
    # counts what it sent there until that prefill leg ends), and recomputing the
    # prefix is predicted slower than the holder's step in progress. So
    # the burst must reach the gateway before its first legs end, and the
    # prefill engines' steps must be short next to the prefix's computation: one
    # event loop posts the burst on connections opened beforehand, the prefill
    # engines' steps hold at most PREFILL_BUDGET tokens, and the engines compute
    # as a slower device would (on the tiny model a leg otherwise ends within a
    # few milliseconds, less than a burst can take to arrive on a busy machine).
    fleet_step_delay(0, TOKEN_DELAY)
    for burst in range(MAX_BURSTS):
        keys = [(burst, i) for i in range(1, BURST + 1)]
        prompts.update({k: prefix + tokens(TAIL, 200 + 10 * burst + k[1]) for k in keys})
        texts = asyncio.run(at_once(gw, [prompts[k] for k in keys]))
        answers.update(zip(keys, texts, strict=True))
        if metric(gw, DECISIONS, decision="pull") > pulls:
            break
    fleet_step_delay(0)
    assert metric(gw, DECISIONS, decision="pull") > pulls, (
        {d: metric(gw, DECISIONS, decision=d) for d in ("holder", "pull", "recompute")},
        metric(gw, "pdfleet_gateway_peer_pull_fleet_crossover_tokens"),
        [(e["url"], e["role"], e["peer_pull"]) for e in engines_view(gw)["engines"]],
    )
    # A prefill engine pulled (the one that did not hold the prefix).
    assert any(metric(u, PULL_BYTES) > pulled[u] for u in prefill), pulled
    # Every answer is the prompt computed from scratch (the decode engine, its own
    # cache namespace: no prefix of it cached there).
    for key, text in answers.items():
        assert text == answer(decode, prompts[key], cache_salt=f"reference-{key}"), key
