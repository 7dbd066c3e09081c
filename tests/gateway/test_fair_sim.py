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


@pytest.mark.parametrize("seed", [0, 1])
def test_a_wide_requests_sequences_held_back_by_the_token_budget_do_not_cut_the_capacity(seed):
    """The engine's own scheduler with a step budget of 128 tokens: an n=64
    request's 12-token prompts start over several steps, the rest of its
    sequences waiting beside free slots (for the budget, or for its share of
    it while an n=1 request waits). Counted as the engine's queue they cut the
    learned capacity to what ran in that step (31 and 53 of 64 here), and it
    grew back one slot a scrape; the engine counts a served request's held
    sequences only beyond its free slots, and the capacity stays at the
    engine's 64. (With 128 narrow requests in flight the narrow ones queue
    behind the budget themselves, and are counted.)"""
    r = run(
        [Client("n64", 64, 4), Client("n1", 1, 16)],
        seconds=30.0,
        capacity=64,
        seed=seed,
        trace=True,
        engine={"scheduler": True, "max_num_batched_tokens": 128},
    )
    learned = [capacity for kind, *_, capacity in r.events if kind == "scrape"]
    assert len(learned) >= 29 and min(learned) >= 64, learned
    assert r.admitted["n64"] > 10 * WIDE and r.admitted["n1"] > 5 * WIDE  # both kept busy
