"""Fair share by tokens between a wide key and a narrow one, through the
gateway's own scheduling against a simulated engine (``fair_sim.py``):
simulated time, so the runs are exact and take no wall time to speak of."""

from __future__ import annotations

import pytest
from gateway.fair_sim import Client, run

# An n=64 request of a 12-token prompt and 64 output tokens per sequence, and
# an n=1 one: what each costs in fair share (prompt + n × max_tokens).
WIDE, NARROW = 12 + 64 * 64, 12 + 64


@pytest.mark.parametrize(
    ("capacity", "latency_s", "seed", "scheduler"),
    [
        (None, 0.001, 0, False),
        (None, 0.001, 3, False),
        (None, 0.05, 0, False),
        (64, 0.001, 5, False),
        (None, 0.001, 0, True),
    ],
    ids=[
        "never-queued",
        "never-queued-3",
        "never-queued-slow-hops",
        "capacity-known",
        "never-queued-engine-scheduler",
    ],
)
def test_a_wide_key_and_a_narrow_one_start_equal_cost(capacity, latency_s, seed, scheduler):
    """Two keys of equal weight, closed loops: 4 workers sending n=64 requests
    and 128 sending n=1, on one engine of 64 slots, 30 s. Start-time fair
    queuing bounds the difference between the cost each key got started to
    about one request of each. The gateway that never saw the engine queue
    (no capacity learned) sends every request on at once; the engine orders
    them by the gateway's tags, and the narrow key's later requests keep
    their place behind its own (its tags were moved up to the wide key's
    last one when it started, which made the gap up to two and a half wide
    requests). With 50 ms between the gateway and the engine, requests reach
    the engine's free slots in their arrival order, not their tags': a wide
    request served early moves the clock past tags still waiting there, which
    must not raise the narrow key's next ones either. A request that finds
    no queue and a free slot is routed without analyzing its prompt: its
    prompt's tokens are estimated from the prompt's text, not the body's
    size (which counted the narrow key's 12-token prompts as 52). The last
    case runs the engine's own scheduler in place of the engine model."""
    r = run(
        [Client("n64", 64, 4), Client("n1", 1, 128)],
        seconds=30.0,
        capacity=capacity,
        latency_s=latency_s,
        seed=seed,
        engine={"scheduler": scheduler},
    )
    assert r.admitted["n64"] > 15 * WIDE and r.admitted["n1"] > 15 * WIDE  # both kept busy
    gap = r.routed["n64"] - r.routed["n1"]
    assert abs(gap) <= WIDE + NARROW, (r.routed, r.admitted)


@pytest.mark.parametrize(("latency_s", "seed"), [(0.001, 0), (0.01, 1), (0.05, 2)])
def test_a_long_stream_beside_a_wide_key_leaves_the_engine_busy(latency_s, seed):
    """One n=1 stream of 2,048 tokens beside the wide and narrow keys, the
    engine's capacity known. A wide request at the head of the queue starts
    on the first free slot, its sequences beyond it waiting in the engine's
    queue: the engine stays full. (Held until every slot it needs is free,
    it waited for the long stream to end, 9 s at a time, while the engine ran
    that one sequence: 36k output tokens in 30 s instead of 130k.) The keys
    still share by tokens: the cost each got started is within one request of
    each, the narrow key's output within 20% of the wide key's."""
    r = run(
        [Client("n64", 64, 4), Client("n1", 1, 128), Client("long", 1, 1, max_tokens=2048)],
        seconds=30.0,
        capacity=64,
        latency_s=latency_s,
        seed=seed,
    )
    assert sum(r.output_all.values()) > 120_000, r.output_all
    assert abs(r.routed["n64"] - r.routed["n1"]) <= WIDE + NARROW, r.routed
    assert r.output["n1"] >= 0.8 * r.output["n64"], r.output
    assert r.output["long"] > 0


@pytest.mark.parametrize(("latency_s", "seed"), [(0.001, 0), (0.05, 1)])
def test_a_better_band_using_part_of_the_engine_leaves_a_worse_band_its_rest(latency_s, seed):
    """A better band (16 n=1 streams) uses a quarter of the engine's 64 slots;
    the wide and narrow keys of band 0 share the rest. Held until the engine
    held nothing of this gateway's, a wide request of band 0 never started
    while the better band had a stream on it, and the narrow requests queued
    behind it got nothing either. Now band 0 keeps the engine full, its two
    keys within a request of each other, the better band still served, and
    the engine at most one wide request over its capacity (and the better
    band's share)."""
    r = run(
        [Client("hi", 1, 16, priority=-1), Client("n64", 64, 4), Client("n1", 1, 128)],
        seconds=30.0,
        capacity=64,
        latency_s=latency_s,
        seed=seed,
        trace=True,
    )
    assert r.routed["n64"] > 10 * WIDE and r.routed["n1"] > 10 * WIDE, r.routed
    assert abs(r.routed["n64"] - r.routed["n1"]) <= WIDE + NARROW, r.routed
    assert r.output["hi"] > 15_000, r.output
    # Slots taken when each request started, and the capacity then.
    over = [
        taken - capacity
        for kind, *ev in r.events
        if kind == "route"
        for taken, capacity in [ev[-2:]]
    ]
    assert max(over) <= 64 - 1 + 8, max(over)


def test_a_wide_request_held_in_the_engine_leaves_the_learned_capacity_alone():
    """The engine's own scheduler holds a wide request to half of its slots
    while another request waits there, and counts its held sequences as
    waiting for room. Under the rule that held a wide request until every
    slot it needs was free, in this run it started beside two narrow ones
    once the gateway had let the capacity grow two past the engine's 64
    slots: the gateway read the held half as a queue and learned a capacity
    of 34, regrown a slot a second. Now nothing of its band starts beside a
    wide request over the capacity until it is back under it, and the
    capacity stays at the engine's slots."""
    r = run(
        [Client("n64", 64, 4), Client("n1", 1, 128)],
        seconds=30.0,
        capacity=64,
        seed=0,
        trace=True,
        engine={"scheduler": True},
    )
    learned = [ev[4] for ev in r.events if ev[0] == "scrape"]
    assert min(learned) >= 56, learned
    assert abs(r.routed["n64"] - r.routed["n1"]) <= WIDE + NARROW, r.routed


def test_a_worse_band_s_wide_request_leaves_a_better_band_its_slots():
    """48 n=1 streams of band 0 beside a key of band 1 sending n=64 requests
    of 400 tokens. A wide request of band 1 starts on a slot band 0 left
    free, and its sequences beyond the capacity wait in the engine's queue:
    band 0's requests do not count them (they go ahead of them there), so
    band 0 keeps its streams going instead of waiting for the wide request
    to end, 5 s at a time; band 1 gets the rest. (Counted, they left band 0
    a twelfth of its output; held until all of its slots were free, the wide
    request never started.)"""
    r = run(
        [Client("mid", 1, 48, priority=0), Client("lo", 64, 2, priority=1, max_tokens=400)],
        seconds=30.0,
        capacity=64,
    )
    assert r.output["mid"] > 50_000, r.output
    assert r.output["lo"] > 20_000, r.output
