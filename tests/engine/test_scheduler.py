"""The scheduler on its own (no model): budgets, chunking, preemption, priority, hooks."""

from __future__ import annotations

import pytest

from pdfleet.engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from pdfleet.engine.contracts.kv_params import KVTransferParams
from pdfleet.engine.core.sched_output import ModelRunnerOutput
from pdfleet.engine.core.scheduler import Scheduler
from pdfleet.engine.kv_transfer.base import KVConnectorScheduler
from pdfleet.engine.request import Request, RequestStatus
from pdfleet.engine.sampling_params import SamplingParams


def make(
    num_blocks=64,
    tokens=64,
    seqs=8,
    chunked=True,
    policy="fcfs",
    caching=True,
    threshold=0,
    connector=None,
    max_len=256,
    host=0,
) -> Scheduler:
    config = EngineConfig(
        model_config=ModelConfig(model="m", max_model_len=max_len),
        cache_config=CacheConfig(block_size=8, enable_prefix_caching=caching),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=tokens,
            max_num_seqs=seqs,
            max_model_len=max_len,
            enable_chunked_prefill=chunked,
            policy=policy,
            long_prefill_token_threshold=threshold,
        ),
        device_config=DeviceConfig(device="cpu"),
    )
    return Scheduler(config, num_blocks + 1, connector, num_host_blocks=host)


def request(rid, n_prompt, max_tokens=4, priority=0, arrival=0.0, first=0) -> Request:
    return Request(
        rid,
        list(range(first, first + n_prompt)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        priority=priority,
        arrival_time=arrival,
    )


def step(s: Scheduler):
    """One schedule + a fake forward that samples token 1 wherever a request caught up."""
    out = s.schedule()
    sampled = {
        rid: 1
        for rid in out.num_scheduled_tokens
        if s.requests[rid].num_computed_tokens == s.requests[rid].num_tokens
    }
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
    return out


def run_all(s: Scheduler, limit=500) -> list:
    outs = []
    for _ in range(limit):
        if not s.has_unfinished_requests():
            return outs
        outs.append(step(s))
    raise AssertionError("scheduler did not finish")


def test_token_budget_and_chunked_prefill():
    s = make(tokens=16)
    s.add_request(request("a", 40))
    s.add_request(request("b", 3))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 16}
    assert s.requests["a"].num_computed_tokens == 16


def test_decodes_go_first_then_new_prompts_fill_the_budget():
    s = make(tokens=10)
    s.add_request(request("a", 5))
    step(s)
    s.add_request(request("b", 20))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_step():
    s = make(tokens=16, chunked=False, max_len=16)
    s.add_request(request("a", 12))
    s.add_request(request("b", 10, first=100))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 12}


def test_long_prefill_threshold():
    s = make(tokens=64, threshold=8)
    s.add_request(request("a", 30))
    s.add_request(request("b", 30))
    assert s.schedule().num_scheduled_tokens == {"a": 8, "b": 8}


def test_max_num_seqs():
    s = make(seqs=2)
    for i in range(4):
        s.add_request(request(str(i), 2))
    assert len(s.schedule().num_scheduled_tokens) == 2


def test_waiting_counts_only_requests_left_for_lack_of_room():
    # A group of three siblings (n = 3): the second and third wait for the
    # first's prefill (two steps of a chunked 40-token prompt), not for room.
    s = make(tokens=32, seqs=3)
    for i in range(3):
        r = request(f"g{i}", 40, max_tokens=8)
        r.group_id = "g"
        r.wait_for = "g0" if i else None
        s.add_request(r)
    assert s.stats().num_waiting_reqs == 0  # not looked at yet: the next step's
    assert s.stats().num_queued_reqs == 3  # the server's queue bound counts them
    for _ in range(2):  # the leader's two prefill chunks: its siblings wait on it
        step(s)
        assert s.stats().num_waiting_reqs == 0
    out = step(s)  # the siblings join (prefix hits): every slot is taken
    assert set(out.num_scheduled_tokens) == {"g0", "g1", "g2"}
    assert s.stats().num_waiting_reqs == 0
    # Two more groups find no slot: max-min fair sharing preempts two of g's
    # three for x and h's leader. The preempted two wait for room; h1 waits
    # for its admitted leader's prefill.
    s.add_request(request("x", 4, max_tokens=8, first=600))
    for i in range(2):
        r = request(f"h{i}", 4, max_tokens=8, first=700)
        r.group_id = "h"
        r.wait_for = "h0" if i else None
        s.add_request(r)
    step(s)
    running = {r.request_id for r in s.running}
    assert running == {"g0", "x", "h0"}
    assert s.stats().num_waiting_reqs == 2
    assert s.stats().num_queued_reqs == 3
    run_all(s)
    assert s.stats().num_waiting_reqs == 0
    # A group whose leader waits for room: its siblings count with it.
    s = make(seqs=1)
    s.add_request(request("a", 4, max_tokens=8))
    for i in range(2):
        r = request(f"h{i}", 4, max_tokens=8, first=700)
        r.group_id = "h"
        r.wait_for = "h0" if i else None
        s.add_request(r)
    step(s)
    assert s.stats().num_waiting_reqs == 2


def test_waiting_for_slot_leaves_out_requests_held_by_their_share_or_the_token_budget():
    """``num_waiting_for_slot_reqs`` counts the waiting requests that queue:
    not a running group's requests held back by its share or the token budget
    while the slots they need are free; every request of a group with nothing
    running (a queue behind the token budget is a queue); every one when the
    step ran out of slots or KV blocks."""
    s = make(seqs=16, tokens=256)
    for i in range(12):  # n = 12: the leader's prefill first
        r = request(f"g{i}", 4, max_tokens=8)
        r.group_id = "g"
        r.wait_for = "g0" if i else None
        s.add_request(r)
    s.add_request(request("x", 4, max_tokens=8, first=600))
    step(s)
    assert {r.request_id for r in s.running} == {"g0", "x"}
    s.add_request(request("y", 4, max_tokens=8, first=700))
    step(s)  # y waits beside g's siblings: g is held to its share, 8 of 16
    assert len(s.running) == 10
    st = s.stats()
    # 6 slots free: g's held siblings are not counted.
    assert "y" in {r.request_id for r in s.running}
    assert st.num_waiting_reqs == 4 and st.num_waiting_for_slot_reqs == 0
    step(s)  # y runs: nothing holds g back
    assert len(s.running) == 14 and s.stats().num_waiting_reqs == 0
    # Slots taken: beyond the free slots, every waiting request counts.
    s = make(seqs=2)
    for i in range(5):
        s.add_request(request(str(i), 2, first=100 * i))
    step(s)
    st = s.stats()
    assert st.num_waiting_reqs == 3 and st.num_waiting_for_slot_reqs == 3
    # The token budget: a queue of long prompts, one prefilled at a time, is a
    # queue (the gateway must not send more: beyond what the next
    # PIPELINE_STEPS steps start); one request's own sequences behind the
    # budget are not.
    s = make(num_blocks=256, tokens=64, seqs=8, max_len=2048)
    for i in range(4):
        s.add_request(request(f"q{i}", 300, first=1000 * i))
    step(s)
    st = s.stats()
    assert st.num_running_reqs == 1
    assert st.num_waiting_reqs == 3 and st.num_waiting_for_slot_reqs == 3
    s = make(num_blocks=256, tokens=64, seqs=8, max_len=2048)
    for i in range(4):
        r = request(f"b{i}", 40, first=1000 * i)
        r.group_id = "b"  # the prompts of one batch request
        s.add_request(r)
    step(s)
    st = s.stats()
    assert st.num_running_reqs == 2  # 40 tokens and a 24-token chunk
    assert st.num_waiting_reqs == 2 and st.num_waiting_for_slot_reqs == 0
    # Every slot taken while a running prompt's chunk fills the step (no
    # waiting request is even tried): short prompts the budget would start
    # still wait for a slot, and count.
    s = make(num_blocks=2000, tokens=64, seqs=8, max_len=4096)
    for i in range(7):
        s.add_request(request(f"d{i}", 4, max_tokens=500, first=10000 * (i + 1)))
    step(s)
    s.add_request(request("long", 1000, max_tokens=500, first=900000))
    for i in range(30):
        s.add_request(request(f"w{i}", 5, max_tokens=500, first=100000 + 100 * i))
    for _ in range(3):
        step(s)
        st = s.stats()
        assert st.num_running_reqs == 8
        assert st.num_waiting_reqs == 30 and st.num_waiting_for_slot_reqs == 30
    # Slots free, but a running long prompt's chunks take the next steps'
    # budgets: the short prompts behind it queue, and count.
    s = make(num_blocks=2000, tokens=64, seqs=8, max_len=4096)
    s.add_request(request("long", 1000, max_tokens=4, first=900000))
    step(s)
    for i in range(4):
        s.add_request(request(f"v{i}", 5, max_tokens=4, first=100000 + 100 * i))
    step(s)
    st = s.stats()
    assert st.num_running_reqs == 1 and st.num_waiting_reqs == 4
    assert st.num_waiting_for_slot_reqs == 4
    # KV blocks short with slots free: every waiting request counts.
    s = make(num_blocks=4, tokens=64, seqs=4)
    for i in range(3):
        s.add_request(request(str(i), 20, first=100 * i))  # 3 blocks each
    step(s)
    st = s.stats()
    assert st.num_running_reqs == 1
    assert st.num_waiting_reqs == 2 and st.num_waiting_for_slot_reqs == 2


def test_preemption_recomputes_and_everything_finishes():
    s = make(num_blocks=4, tokens=64, seqs=4)
    for i in range(3):
        s.add_request(request(str(i), 7, max_tokens=8, first=100 * i))
    run_all(s)
    assert s.num_preemptions > 0
    assert s.kv.num_free_blocks == s.kv.num_usable_blocks


def test_priority_policy_orders_waiting_and_preempts_the_lowest_priority():
    s = make(num_blocks=3, tokens=64, seqs=4, policy="priority")
    s.add_request(request("low", 7, max_tokens=8, priority=5, arrival=0.0))
    s.add_request(request("high", 7, max_tokens=8, priority=0, arrival=1.0, first=100))
    assert list(step(s).num_scheduled_tokens) == ["high", "low"]
    for _ in range(6):
        step(s)
        if s.num_preemptions:
            break
    assert s.requests["low"].num_preemptions >= 1
    assert s.requests["high"].num_preemptions == 0


BAND = 1 << 40  # contracts/priority.py: the band sits above a 40-bit fair-share tag


def test_a_better_band_prefills_alone_and_takes_a_worse_bands_slot():
    """Bands are strict on the engine: a band-0 request arriving while every slot
    runs band-1 requests preempts the newest of them, and its prefill step
    schedules no band-1 request; within a band nothing is preempted."""
    s = make(num_blocks=64, tokens=64, seqs=2, policy="priority")
    s.add_request(request("w1", 7, max_tokens=16, priority=BAND + 1, arrival=0.0))
    s.add_request(request("w2", 7, max_tokens=16, priority=BAND + 2, arrival=1.0, first=100))
    step(s)
    step(s)
    # The same band, a smaller tag: it waits for a slot, preempting no one.
    s.add_request(request("tag", 7, max_tokens=4, priority=BAND, arrival=2.0, first=200))
    step(s)
    assert s.num_preemptions == 0
    s.add_request(request("p", 7, max_tokens=4, priority=5, arrival=3.0, first=300))
    out = step(s)
    assert list(out.num_scheduled_tokens) == ["p"]  # alone in its prefill step
    assert s.requests["w2"].num_preemptions == 1 and s.requests["w1"].num_preemptions == 0
    out = step(s)  # p decodes: the worse band steps again beside it
    assert set(out.num_scheduled_tokens) == {"p", "w1"}
    run_all(s)
    assert s.kv.num_free_blocks == s.kv.num_usable_blocks


def test_running_batch_band_requests_sit_out_an_online_prefill_step():
    from pdfleet.engine.contracts.priority import BATCH_BAND

    s = make(num_blocks=64, tokens=64, seqs=8, policy="priority")
    for i in range(3):
        s.add_request(request(f"b{i}", 7, max_tokens=16, priority=BATCH_BAND * BAND + i,
                              arrival=float(i), first=100 * i))  # fmt: skip
    step(s)
    s.add_request(request("online", 30, max_tokens=4, priority=BAND, arrival=5.0, first=900))
    s.add_request(request("b3", 7, max_tokens=4, priority=BATCH_BAND * BAND, arrival=6.0,
                          first=700))  # fmt: skip
    out = step(s)
    # The running batch requests sit it out; a waiting one still starts on a free
    # slot (held back, it would look like a queue to the gateway).
    assert list(out.num_scheduled_tokens) == ["online", "b3"]
    assert s.num_preemptions == 0  # slots were free: nothing preempted
    assert len(step(s).num_scheduled_tokens) == 5  # then all decode together


def test_small_client_priorities_are_one_band_as_in_vllm():
    """vLLM-style priorities (0, 1, 5) are one band: no step is held back for them."""
    s = make(num_blocks=64, tokens=64, seqs=2, policy="priority")
    s.add_request(request("a", 7, max_tokens=8, priority=5, arrival=0.0))
    step(s)
    s.add_request(request("b", 7, max_tokens=8, priority=0, arrival=1.0, first=100))
    assert set(step(s).num_scheduled_tokens) == {"a", "b"}


def test_abort_frees_blocks_of_running_and_waiting_requests():
    s = make(seqs=1)
    s.add_request(request("a", 10))
    s.add_request(request("b", 10))
    s.schedule()
    s.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == s.kv.num_usable_blocks
    assert s.schedule().is_empty


class FakeRemote(KVConnectorScheduler):
    def __init__(self):
        self.allocated = {}
        self.finished = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.kv_transfer_params and request.kv_transfer_params.do_remote_prefill:
            return (request.num_tokens - 1) // 8 * 8 - num_computed_tokens, True
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocated[request.request_id] = (list(block_ids), num_external_tokens)

    def request_finished(self, request, block_ids):
        self.finished.append(request.request_id)
        hold = bool(request.kv_transfer_params and request.kv_transfer_params.do_remote_decode)
        return hold, KVTransferParams(do_remote_prefill=True) if hold else None


def test_waiting_for_remote_kv_does_not_block_other_requests():
    remote = FakeRemote()
    s = make(connector=remote)
    r = request("remote", 18)
    r.kv_transfer_params = KVTransferParams(do_remote_prefill=True)
    s.add_request(r)
    s.add_request(request("local", 5))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"local": 5}
    assert remote.allocated["remote"][1] == 16
    assert s.requests["remote"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    s.update_from_output(out, ModelRunnerOutput(finished_recving={"remote"}))
    out = s.schedule()
    # 16 tokens arrived from the remote engine: only the last 2 are computed here.
    assert out.num_scheduled_tokens["remote"] == 2
    assert s.requests["remote"].num_external_computed_tokens == 16


def test_a_remote_load_takes_blocks_for_the_rest_of_the_prompt_too():
    """Loads that filled the pool would leave no block for any request's tail and
    nothing running to free one: a load is admitted with room for its whole prompt."""
    remote = FakeRemote()
    s = make(num_blocks=9, max_len=64, connector=remote)
    for i in range(3):
        r = request(f"r{i}", 30, first=100 * i)  # 24 tokens loaded (3 blocks), 6 computed here
        r.kv_transfer_params = KVTransferParams(do_remote_prefill=True)
        s.add_request(r)
    out = s.schedule()
    loading = {
        rid for rid, r in s.requests.items() if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    }
    assert loading == {"r0", "r1"}  # 4 blocks each of 9: not three loads of 3
    s.update_from_output(out, ModelRunnerOutput(finished_recving=loading))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r0": 6, "r1": 6}


def test_failed_remote_load_falls_back_to_local_recompute():
    remote = FakeRemote()
    s = make(connector=remote)
    r = request("remote", 18)
    r.kv_transfer_params = KVTransferParams(do_remote_prefill=True)
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(failed_recving={"remote"}))
    out = s.schedule()
    # Nothing of the failed load may be reused: the whole prompt is computed here.
    assert out.num_scheduled_tokens == {"remote": 18}
    assert s.requests["remote"].kv_transfer_params is None


def test_finished_requests_can_hand_their_blocks_to_a_connector():
    remote = FakeRemote()
    s = make(connector=remote)
    r = request("p", 9, max_tokens=1)
    r.kv_transfer_params = KVTransferParams(do_remote_decode=True)
    s.add_request(r)
    outs = run_all(s)
    assert outs and "p" in s.held_blocks
    assert s.kv.num_free_blocks < s.kv.num_usable_blocks
    s.update_from_output(s.schedule(), ModelRunnerOutput(finished_sending={"p"}))
    assert s.kv.num_free_blocks == s.kv.num_usable_blocks


def test_duplicate_request_ids_are_rejected():
    s = make()
    s.add_request(request("a", 3))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(request("a", 3))


def lend_request(rid, prompt, blocks) -> Request:
    params = KVTransferParams(do_remote_decode=True, lend_blocks=blocks)
    return Request(rid, list(prompt), SamplingParams(max_tokens=1), kv_transfer_params=params)


def test_a_lend_goes_first_past_max_num_seqs_and_is_refused_without_its_blocks():
    s = make(seqs=1)
    s.add_request(request("cached", 25, max_tokens=1))  # 3 full blocks of 8 enter the cache
    run_all(s)
    s.add_request(request("busy", 4, max_tokens=50, first=500))
    step(s)  # the only slot is taken
    s.add_request(request("queued", 4, first=600))
    s.add_request(lend_request("lend", range(25), 3))
    out = step(s)
    # Ahead of "queued", past the slot bound, computing only the token after the blocks.
    assert out.num_scheduled_tokens.get("lend") == 1 and "queued" not in out.num_scheduled_tokens
    assert "lend" not in s.requests
    # Blocks no cache holds: refused before any forward, with an error output.
    s.add_request(lend_request("gone", range(900, 925), 3))
    out = s.schedule()
    assert "gone" not in out.num_scheduled_tokens
    outputs = s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={}))
    refused = [o for o in outputs if o.request_id == "gone"]
    assert refused and refused[0].finish_reason == "error"
    assert "pdfleet_lend_blocks" in str(refused[0].stop_reason)
