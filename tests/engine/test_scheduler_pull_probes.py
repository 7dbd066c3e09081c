"""Skeptic's probes of a pulling request's scheduling (blocks for its whole prompt
taken before the READ; quarantine; cached tokens) and of a lend's wait at a busy
holder. Scheduler-level, with a fake connector: milliseconds each."""

from __future__ import annotations

import dataclasses

import pytest
from engine.test_scheduler import FakeRemote, make, request

from pdfleet.engine.contracts.block_hash import extend_block_hashes, root_hash
from pdfleet.engine.contracts.kv_events import BlockStored
from pdfleet.engine.contracts.kv_params import KVTransferParams
from pdfleet.engine.contracts.priority import TAG_BITS
from pdfleet.engine.core.connector_side import QUARANTINE
from pdfleet.engine.core.sched_output import ModelRunnerOutput
from pdfleet.engine.gateway.engines import EngineLoad, EngineState
from pdfleet.engine.gateway.kv_index import KVIndex
from pdfleet.engine.gateway.metrics import GatewayMetrics
from pdfleet.engine.gateway.peer_pull import PeerPull
from pdfleet.engine.gateway.prompt import PromptInfo
from pdfleet.engine.request import Request, RequestStatus

BS = 8


class InFlight(FakeRemote):
    """A connector whose READs may still be writing when a request is aborted or
    its load failed (NIXL READs cannot be cancelled)."""

    def request_aborted(self, request):
        return True

    def pull_in_flight(self, request):
        return True


def pulling(rid: str, n: int, first: int = 0, max_tokens: int = 4):
    r = request(rid, n, max_tokens=max_tokens, first=first)
    r.kv_transfer_params = KVTransferParams(do_remote_prefill=True)
    return r


def sample(s, out) -> dict[str, int]:
    return {
        rid: 1
        for rid in out.num_scheduled_tokens
        if s.requests[rid].num_computed_tokens == s.requests[rid].num_tokens
    }


def loading(s) -> set[str]:
    return {r for r, q in s.requests.items() if q.status == RequestStatus.WAITING_FOR_REMOTE_KVS}


def test_an_abort_while_loading_quarantines_the_loaded_blocks_and_frees_the_tail():
    s = make(num_blocks=16, connector=InFlight())
    s.add_request(pulling("r", 60))  # 56 loaded (7 blocks), 4 computed here (1 block)
    s.schedule()
    assert loading(s) == {"r"}
    assert s.kv.num_free_blocks == 16 - 8
    s.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert len(s.held_blocks[QUARANTINE + "r"]) == 7
    assert s.kv.num_free_blocks == 16 - 7
    s.update_from_output(s.schedule(), ModelRunnerOutput(finished_sending={QUARANTINE + "r"}))
    assert s.kv.num_free_blocks == 16 and not s.held_blocks


def test_an_abort_while_loading_after_own_prefix_hits():
    """Own hits (2 blocks) + 5 loaded + 1 tail: the quarantine keeps 7 blocks (the
    hits are shared cache blocks; the READ writes the 5)."""
    s = make(num_blocks=16, connector=InFlight())
    s.add_request(request("warm", 17, max_tokens=1))  # caches 2 blocks of tokens 0..15
    for _ in range(3):
        out = s.schedule()
        s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sample(s, out)))
    assert not s.requests
    s.add_request(pulling("r", 60))
    s.schedule()
    assert loading(s) == {"r"} and s.requests["r"].num_computed_tokens == 16
    s.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert len(s.held_blocks[QUARANTINE + "r"]) == 7
    s.update_from_output(s.schedule(), ModelRunnerOutput(finished_sending={QUARANTINE + "r"}))
    assert s.kv.num_free_blocks == 16 and not s.held_blocks


def test_a_failed_load_with_a_read_in_flight_recomputes_with_the_tail_freed():
    s = make(num_blocks=16, tokens=64, connector=InFlight())
    s.add_request(pulling("r", 60))
    s.schedule()
    s.update_from_output(s.schedule(), ModelRunnerOutput(failed_recving={"r"}))
    # 7 blocks quarantined; the request recomputes its whole prompt in the 9 left.
    assert len(s.held_blocks[QUARANTINE + "r"]) == 7
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r": 60}
    out_r = s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"r": 1}))
    assert out_r[0].num_cached_tokens == 0  # nothing it computed was cached
    s.update_from_output(s.schedule(), ModelRunnerOutput(finished_sending={QUARANTINE + "r"}))
    s.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_free_blocks == 16


@pytest.mark.parametrize("n", [24, 25, 32, 33])
def test_prompt_lengths_around_block_multiples(n):
    """FakeRemote offers the whole blocks before the last token."""
    remote = FakeRemote()
    s = make(num_blocks=16, connector=remote)
    s.add_request(pulling("r", n))
    s.schedule()
    loaded = (n - 1) // BS * BS
    assert remote.allocated["r"][1] == loaded
    assert s.kv.num_request_blocks("r") == -(-n // BS)
    s.update_from_output(s.schedule(), ModelRunnerOutput(finished_recving={"r"}))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r": n - loaded}
    outs = s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"r": 1}))
    assert outs[0].num_cached_tokens == loaded
    # The tail blocks publish as they fill (the prompt's full blocks are cached).
    assert s.kv.num_cached_blocks["r"] == n // BS


def test_a_pulled_request_preempted_after_loading_finishes_and_frees_everything():
    remote = FakeRemote()
    s = make(num_blocks=8, tokens=64, connector=remote)
    s.add_request(request("a", 16, max_tokens=30, first=500))
    s.add_request(pulling("r", 20, max_tokens=30))  # 16 loaded, 4 computed: 3 blocks
    cached = None
    preempted = False
    for _ in range(200):
        if not s.requests:
            break
        out = s.schedule()
        outs = s.update_from_output(
            out,
            ModelRunnerOutput(
                sampled_token_ids=sample(s, out),
                finished_recving=loading(s),
            ),
        )
        preempted = preempted or s.num_preemptions > 0
        for o in outs:
            if o.request_id == "r" and cached is None:
                cached = o.num_cached_tokens
    assert not s.requests and preempted
    assert cached == 16
    assert s.kv.num_free_blocks == 8


def lend_of(rid: str, blocks: int) -> Request:
    """A lend of the first ``blocks`` blocks of tokens 0.. (and the token after them)."""
    r = request(rid, blocks * BS + 1, max_tokens=1)
    r.kv_transfer_params = KVTransferParams(do_remote_decode=True, lend_blocks=blocks)
    return r


def probe(s, blocks: int) -> Request:
    """A lend of ``blocks`` blocks hashed as ``add_request`` would, not added."""
    r = lend_of("probe", blocks)
    extend_block_hashes(
        r.block_hashes, r.all_token_ids, s.block_size, s.kv.hash_fn, root_hash(None, None)
    )
    return r


def warmed(s, blocks: int = 2) -> list[int]:
    """Tokens 0.. cached for ``blocks`` blocks (a prompt of one token more run to
    its end); their device block ids."""
    s.add_request(request("warm", blocks * BS + 1, max_tokens=1))
    while "warm" in s.requests:
        out = s.schedule()
        s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sample(s, out)))
    cached, _ = s.kv.get_computed_blocks(probe(s, blocks))
    assert len(cached) == blocks
    return [b.block_id for b in cached]


def to_host_tier(s, blocks: int = 2) -> None:
    """The warm blocks stored to the host tier and gone from the device cache."""
    out = s.schedule()  # its first act: store the blocks freed since the last step
    stores = out.kv_offload.stores if out.kv_offload is not None else []
    assert len(stores) >= blocks
    s.update_from_output(out, ModelRunnerOutput(offload_stores_done=[x for _, x in stores]))
    r = probe(s, blocks)
    cached, _ = s.kv.get_computed_blocks(r)
    s.kv._pool.uncache(cached)
    assert s.kv.get_computed_blocks(r) == ([], 0)
    assert len(s.kv.get_host_hits(r, 0)) == blocks


def test_a_device_tier_lend_is_leased_between_steps_without_a_forward():
    """A lend whose blocks are all in the device prefix cache computes nothing: it
    takes references on exactly those blocks, the connector holds them, and its
    output (no token, the lease's params) is ready before the next step; the
    running chunked prefill keeps the whole budget of the step after it."""
    remote = FakeRemote()
    s = make(num_blocks=64, tokens=64, connector=remote)
    ids = warmed(s)
    s.add_request(request("long", 400, first=1000))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sample(s, out)))
    s.add_request(lend_of("lend", 2))
    s.serve_lends()
    (ready,) = s.take_ready()
    assert ready.request_id == "lend" and ready.new_token_ids == []
    assert ready.finish_reason == "length" and ready.kv_transfer_params is not None
    assert ready.num_cached_tokens == 2 * BS
    assert "lend" not in s.requests and remote.finished[-1] == "lend"
    assert [b.block_id for b in s.held_blocks["lend"]] == ids
    assert all(b.ref_cnt == 1 for b in s.held_blocks["lend"])
    out = s.schedule()
    assert out.num_scheduled_tokens == {"long": 64}  # nothing kept back for the lend
    assert "lend" not in {r.req_id for r in out.scheduled_new_reqs}
    s.update_from_output(out, ModelRunnerOutput(finished_sending={"lend"}))
    assert not s.held_blocks and all(b.ref_cnt == 0 for b in s.kv._pool.blocks if b.block_id in ids)


def test_a_lend_added_before_a_schedule_is_answered_with_that_steps_outputs():
    """Without the engine loop's call between steps (an offline engine), the next
    ``schedule`` serves the lend first and its output goes out with the step's."""
    s = make(num_blocks=64, tokens=64, connector=FakeRemote())
    warmed(s)
    s.add_request(lend_of("lend", 2))
    s.add_request(lend_of("gone", 3))  # its third block was never cached
    out = s.schedule()
    assert not out.num_scheduled_tokens
    outs = {o.request_id: o for o in s.update_from_output(out, ModelRunnerOutput())}
    assert outs["lend"].kv_transfer_params is not None and outs["lend"].new_token_ids == []
    assert outs["gone"].finish_reason == "error"
    assert "holds 2 of the 3 blocks" in str(outs["gone"].stop_reason)
    assert not s.requests and not s.waiting


def test_an_aborted_lend_is_not_leased():
    s = make(num_blocks=64, tokens=64, connector=FakeRemote())
    warmed(s)
    s.add_request(lend_of("lend", 2))
    s.finish_requests(["lend"], RequestStatus.FINISHED_ABORTED)
    s.serve_lends()
    assert not s.take_ready() and not s.held_blocks


def test_a_host_tier_lend_runs_in_the_next_step_beside_a_running_chunked_prefill():
    """A lend whose blocks are on the host tier only waits for a step, which copies
    them back. A long prompt's chunks would take each step's whole budget before
    the waiting queue is looked at; the lend keeps its token from them and runs
    in the next step, as ``PeerPull.lend_wait`` predicts for a host-tier lend."""
    remote = FakeRemote()
    s = make(num_blocks=64, tokens=64, connector=remote, host=8)
    warmed(s)
    to_host_tier(s)
    s.add_request(request("long", 400, first=1000))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"long": 64}
    s.add_request(lend_of("lend", 2))
    s.serve_lends()
    assert not s.take_ready() and s.requests["lend"].status == RequestStatus.WAITING
    steps = 0
    while "lend" not in out.num_scheduled_tokens:
        s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sample(s, out)))
        out = s.schedule()
        steps += 1
    assert steps == 1  # not 6: (400 - 64) / 64 rounded up, the long prompt's whole prefill
    assert out.num_scheduled_tokens["long"] == 63  # the chunk gave the lend its token
    assert out.num_scheduled_tokens["lend"] == 1
    assert out.kv_offload is not None and len(out.kv_offload.loads) == 2


def _engine(url: str) -> EngineState:
    e = EngineState(url, "decode")
    e.state = "healthy"
    return e


def test_a_holder_waiting_for_token_budget_is_not_at_capacity():
    # The real scheduler's figures for a queue over one step's budget.
    s = make(num_blocks=256, tokens=64, seqs=8, max_len=2048)
    for i in range(4):
        s.add_request(request(f"q{i}", 300, first=1000 * i))
    s.schedule()
    st = s.stats()
    assert st.num_running_reqs == 1 and st.num_waiting_reqs == 3  # slots and KV free
    assert st.kv_cache_usage < 0.2
    index = KVIndex()
    hashes = list(range(1000, 1100))
    # On the host tier: the lend runs in a step (a device-tier one shares none).
    index.apply("http://h", [BlockStored(hashes, medium="CPU")])
    index.apply("http://p", [])
    pp = PeerPull(GatewayMetrics(), index, BS, lend_timeout=2.0)
    h, p = _engine("http://h"), _engine("http://p")
    before = EngineLoad(prompt_tokens=10_000, prefill_busy_seconds=1.0, steps=10, step_seconds=1.0)
    idle = EngineLoad(
        prompt_tokens=20_000,
        prefill_busy_seconds=2.0,
        steps=20,
        step_seconds=2.0,
        kv_block_bytes=1024,
        step_token_budget=64,
    )
    pp.scraped(p, before, idle)
    busy = dataclasses.replace(
        idle,
        waiting_prompt_tokens=st.waiting_prompt_tokens,
        running=st.num_running_reqs,
        waiting=st.num_waiting_reqs,
    )
    pp.scraped(h, before, busy)
    plan = pp.plan(PromptInfo(100 * BS + 40, exact_hashes=hashes), h, [h, p], set(), BS)
    assert plan is not None and plan.lend_wait is not None
    rate = 10_000.0  # 10,000 tokens in 1 s of prefill at both scrapes
    # At least the step the lend shares with the running chunks (one budget).
    assert plan.lend_wait >= pp.in_progress("http://h") + 64 / rate


def test_loaded_requests_behind_a_preempted_head_do_not_deadlock():
    remote = FakeRemote()
    s = make(num_blocks=9, tokens=64, max_len=64, connector=remote)
    s.add_request(request("r", 20, max_tokens=30, first=500))  # 3 blocks, grows to a 4th
    for i in range(2):
        s.add_request(pulling(f"l{i}", 20, first=100 * i))  # 16 loaded + 4 here: 3 blocks each
    for _ in range(100):
        if not s.requests:
            break
        out = s.schedule()
        # The READs land once "r" ran out of room (a slow holder, or many pulls).
        landed = loading(s) if s.num_preemptions else set()
        s.update_from_output(
            out, ModelRunnerOutput(sampled_token_ids=sample(s, out), finished_recving=landed)
        )
    else:
        stuck = {rid: (r.status.name, r.num_computed_tokens) for rid, r in s.requests.items()}
        raise AssertionError(
            f"no progress: running={len(s.running)} free={s.kv.num_free_blocks} {stuck}"
        )


def test_a_better_bands_pull_into_a_full_pool_of_a_worse_band_makes_progress():
    """Under the priority policy a better band's pulling request (a P/D decode leg,
    a peer pull) at the head of the queue holds the worse bands' running requests
    out of the step; its load takes a worse band's KV as a plain request does
    (else no request would step again)."""
    s = make(num_blocks=9, tokens=64, max_len=64, connector=FakeRemote(), policy="priority")
    worse = 5 << TAG_BITS
    for i in range(3):  # 3 blocks each: the pool is full
        s.add_request(request(f"low{i}", 20, max_tokens=30, first=100 * i, priority=worse))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sample(s, out)))
    hi = pulling("hi", 20, first=900)
    hi.priority = 0
    s.add_request(hi)
    scheduled = 0
    for _ in range(20):
        out = s.schedule()
        scheduled += out.total_num_scheduled_tokens
        s.update_from_output(
            out, ModelRunnerOutput(sampled_token_ids=sample(s, out), finished_recving=loading(s))
        )
    assert scheduled > 0 and "hi" not in s.requests and s.num_preemptions >= 1
    while s.requests:
        out = s.schedule()
        s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sample(s, out)))
    assert s.kv.num_free_blocks == 9


def test_a_routed_entry_leaves_once_and_never_for_another_equal_one(monkeypatch):
    """Two requests routed at the same instant with the same tokens and bytes: each
    hook takes off its own entry, once (a retried leg calls it again)."""
    from pdfleet.engine.gateway import peer_pull

    monkeypatch.setattr(peer_pull.time, "monotonic", lambda: 100.0)
    pp = PeerPull(GatewayMetrics(), KVIndex(), BS, lend_timeout=2.0)
    e = _engine("http://e")
    first = pp.routed(e, 500, pull_bytes=4096)
    pp.routed(e, 500, pull_bytes=4096)
    first()
    first()
    c = pp._costs("http://e")
    assert [n for _, n in c.routed] == [500] and [b for _, b in c.pulling] == [4096]
