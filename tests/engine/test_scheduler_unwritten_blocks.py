"""A block published at allocation whose request is preempted later in the same
step (before the forward) leaves the prefix cache: no request hits it, no lend
leases it."""

from __future__ import annotations

from .test_scheduler import FakeRemote, lend_request, make, request, step


def test_block_published_then_preempted_in_the_same_step_is_not_lent():
    s = make(num_blocks=9, tokens=64, policy="priority", threshold=16, connector=FakeRemote())
    a = request("a", 160, priority=1, arrival=0.0)
    s.add_request(a)
    step(s)  # a: tokens 0..15
    s.add_request(request("b", 160, priority=0, arrival=1.0, first=1000))
    out = step(s)  # a: 16..31, b joins
    assert out.num_scheduled_tokens == {"a": 16, "b": 16}, out.num_scheduled_tokens
    computed_before = s.requests["a"].num_computed_tokens
    out = step(s)  # a allocates (and publishes) 32..47, then b preempts it
    assert "a" not in out.num_scheduled_tokens, out.num_scheduled_tokens
    # Tokens 32..39 (block 4) were never in any step's forward.
    computed, _ = s.kv.get_computed_blocks(request("probe", 49))
    s.add_request(lend_request("lend", range(41), 5))
    s.serve_lends()
    ready = s.take_ready()
    assert len(computed) * 8 <= computed_before, "an unwritten block is a prefix-cache hit"
    assert not any(o.finish_reason == "length" for o in ready), "a lend leased an unwritten block"


def test_the_same_unwritten_block_is_an_ordinary_prefix_hit():
    """Not lend-specific: a later request with that prefix computes it."""
    s = make(num_blocks=9, tokens=64, policy="priority", threshold=16)
    s.add_request(request("a", 160, priority=1, arrival=0.0))
    step(s)
    s.add_request(request("b", 160, priority=0, arrival=1.0, first=1000))
    step(s)
    out = step(s)
    assert "a" not in out.num_scheduled_tokens
    c = request("c", 49, max_tokens=1, priority=0, arrival=2.0)
    s.add_request(c)
    computed, _ = s.kv.get_computed_blocks(c)
    assert len(computed) * 8 <= 32, "an unwritten block is a prefix-cache hit"
