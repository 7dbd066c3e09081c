"""Skeptic's probes of the waiting loop's skip past a head that cannot get blocks
(landed pulls go first) and of the token budget kept for waiting lends.
Scheduler-level, with a fake connector: milliseconds each."""

from __future__ import annotations

import pytest
from engine.test_scheduler import FakeRemote, make, request
from engine.test_scheduler_pull_probes import loading, pulling, sample

from pdfleet.engine.contracts.kv_params import KVTransferParams
from pdfleet.engine.contracts.priority import TAG_BITS
from pdfleet.engine.core.sched_output import ModelRunnerOutput
from pdfleet.engine.request import RequestStatus

WORSE = 5 << TAG_BITS  # a band below band 0


def lend(rid: str, blocks: int = 2):
    r = request(rid, blocks * 8 + 1, max_tokens=1)
    r.kv_transfer_params = KVTransferParams(do_remote_decode=True, lend_blocks=blocks)
    return r


def step(s, landed: bool = True):
    out = s.schedule()
    s.update_from_output(
        out,
        ModelRunnerOutput(
            sampled_token_ids=sample(s, out), finished_recving=loading(s) if landed else set()
        ),
    )
    return out


def warm(s, blocks: int = 2) -> None:
    """Cache ``blocks`` blocks of tokens 0.. (the prefix a lend names)."""
    s.add_request(request("warm", blocks * 8 + 1, max_tokens=1))
    while "warm" in s.requests:
        step(s)


def test_only_holders_go_past_a_head_that_cannot_get_blocks():
    s = make(num_blocks=12, tokens=64, max_len=128, connector=FakeRemote())
    s.add_request(request("r", 40, max_tokens=20, first=1000))  # 5 blocks, grows
    s.add_request(pulling("l", 20, first=2000))  # 16 loaded + 4 here: 3 blocks
    step(s)  # r prefills; l allocates its 3 blocks and lands
    assert s.requests["l"].status == RequestStatus.WAITING
    s.add_request(request("head", 64, first=3000))  # 8 blocks; 4 free
    s.add_request(request("small", 8, first=4000))  # 1 block, arrived after head
    # Order them as a preempted head would stand: head, then the landed pull.
    while s.waiting:
        s.waiting.pop()
    for rid in ("head", "l", "small"):
        s.waiting.push(s.requests[rid])
    assert [r.request_id for r in s.waiting] == ["head", "l", "small"]
    out = s.schedule()
    assert "l" in out.num_scheduled_tokens  # the landed pull goes past (the fix)
    assert "small" not in out.num_scheduled_tokens  # ... a newcomer does not


@pytest.mark.parametrize("per_step", [1, 3])
def test_a_stream_of_pulls_does_not_starve_a_head_that_cannot_get_blocks(per_step):
    """Pulls arrive each step behind a head that needs most of the pool and land
    three steps later. They go past it only while landed ones wait behind it, and
    the head is looked at first in each step, so it gets the blocks freed by the
    finished ones: it runs within a bounded number of steps."""
    s = make(num_blocks=16, tokens=64, max_len=128, connector=FakeRemote())
    s.add_request(request("r", 40, max_tokens=12, first=1000))
    born: dict[str, int] = {}
    k = 0
    for t in range(60):
        if t == 3:
            s.add_request(request("head", 100, first=3000))  # 13 of the 16 blocks
        for _ in range(per_step):
            s.add_request(pulling(f"p{k}", 20, first=10_000 + 100 * k, max_tokens=1))
            k += 1
        out = s.schedule()
        if "head" in out.num_scheduled_tokens:
            break
        landed = {rid for rid in loading(s) if born.setdefault(rid, t) <= t - 3}
        s.update_from_output(
            out, ModelRunnerOutput(sampled_token_ids=sample(s, out), finished_recving=landed)
        )
    else:
        raise AssertionError("the head never ran")


def _decoding(s, n: int) -> None:
    for i in range(n):
        s.add_request(request(f"d{i}", 4, max_tokens=100, first=5000 + 100 * i))
    while s.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running):
        step(s)
    assert len(s.running) == n


def test_waiting_lends_past_the_lend_slots_take_no_token_from_running_decodes():
    s = make(num_blocks=128, tokens=16, seqs=8, max_len=128)
    warm(s)
    _decoding(s, 8)
    for i in range(20):
        s.add_request(lend(f"lend{i}"))
    out = s.schedule()
    lends = [rid for rid in out.num_scheduled_tokens if rid.startswith("lend")]
    assert len(lends) == 8  # LEND_SLOTS of them
    decodes = [rid for rid in out.num_scheduled_tokens if rid.startswith("d")]
    assert len(decodes) == 8, out.num_scheduled_tokens  # the budget holds all 16 tokens


def test_a_head_is_not_skipped_for_a_holder_that_cannot_run_either():
    s = make(num_blocks=12, tokens=64, max_len=128, connector=FakeRemote())
    s.max_loras = 1
    held = pulling("held", 20, first=2000)  # 3 blocks, adapter 2
    held.lora_id, held.lora_name = 2, "b"
    s.add_request(held)
    lo = request("lo", 40, max_tokens=20, first=1000)  # 5 blocks, adapter 1: the slot
    lo.lora_id, lo.lora_name = 1, "a"
    s.add_request(lo)
    step(s)  # held allocates and lands; lo takes the adapter slot
    assert s.requests["held"].status == RequestStatus.WAITING
    assert s.kv.num_request_blocks("held") == 3
    s.add_request(request("head", 64, first=3000))  # 8 blocks; 4 free
    s.add_request(request("small", 8, first=4000))
    while s.waiting:  # the head in front, as a preempted request stands
        s.waiting.pop()
    for rid in ("head", "held", "small"):
        s.waiting.push(s.requests[rid])
    out = s.schedule()
    assert "held" not in out.num_scheduled_tokens  # no adapter slot: it cannot run
    assert "small" not in out.num_scheduled_tokens  # so nothing justifies passing head


def test_a_worse_band_let_past_a_blocked_head_is_not_preempted_for_nothing():
    """Under the priority policy a worse band's landed pull goes past a better band's
    head that cannot get blocks. Preempting it would not make room for the head
    either (its 3 blocks and the 3 free are 6 of the 8 it needs): it keeps its pulled
    KV and steps on, and the head waits for the better band's decode to finish."""
    s = make(num_blocks=12, tokens=64, max_len=128, connector=FakeRemote(), policy="priority")
    pull = pulling("l", 20, first=2000, max_tokens=40)  # 3 blocks
    pull.priority, pull.arrival_time = WORSE, 1.0
    s.add_request(pull)
    s.add_request(request("r", 40, max_tokens=30, first=1000))  # 5 blocks, grows
    step(s)  # r prefills; the pull allocates and lands
    s.add_request(request("head", 64, first=3000, arrival=2.0))  # 8 blocks; 4 free
    s.add_request(request("w", 16, max_tokens=40, first=4000, priority=WORSE, arrival=3.0))
    first = step(s)
    assert "head" not in first.num_scheduled_tokens and "l" in first.num_scheduled_tokens
    second = step(s)
    assert s.num_preemptions == 0
    assert set(second.num_scheduled_tokens) == {"r", "l"}  # not held out for the head
    while s.requests:
        step(s)
    assert s.kv.num_free_blocks == s.kv.num_usable_blocks


def test_the_skip_past_blocked_requests_is_linear_in_the_queue(monkeypatch):
    s = make(num_blocks=12, tokens=4096, seqs=4096, max_len=128, connector=FakeRemote())
    s.max_loras = 1
    lo = request("lo", 40, max_tokens=80, first=1000)  # takes the adapter slot
    lo.lora_id, lo.lora_name = 1, "a"
    held = pulling("held", 20, first=2000)  # lands, then waits for an adapter slot
    held.lora_id, held.lora_name = 2, "b"
    s.add_request(held)
    s.add_request(lo)
    step(s)
    n = 200
    for i in range(n):  # 8 blocks each; 4 free
        s.add_request(request(f"big{i}", 64, first=10_000 + 100 * i))
    while s.waiting:
        s.waiting.pop()
    for i in range(n):
        s.waiting.push(s.requests[f"big{i}"])
    s.waiting.push(held)
    calls = 0
    real = s.kv.num_request_blocks

    def counted(rid):
        nonlocal calls
        calls += 1
        return real(rid)

    monkeypatch.setattr(s.kv, "num_request_blocks", counted)
    s.schedule()
    assert calls <= 4 * n
