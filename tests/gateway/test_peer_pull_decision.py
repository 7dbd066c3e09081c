"""The peer-pull decision (engine/gateway/peer_pull.py) from measured figures: what
each scrape and lend teaches it, the crossover, and the choice on either side."""

from __future__ import annotations

import json
import math

import pytest

from pdfleet.engine.contracts.kv_events import BlockRemoved, BlockStored
from pdfleet.engine.contracts.kv_params import LEND_FIELD, REMOTE_DECODE, KVTransferParams
from pdfleet.engine.gateway.engines import EngineLoad, EngineState
from pdfleet.engine.gateway.kv_index import KVIndex
from pdfleet.engine.gateway.metrics import GatewayMetrics
from pdfleet.engine.gateway.peer_pull import PeerPull, lend_body
from pdfleet.engine.gateway.prefill_leg import pulling_prefill_body
from pdfleet.engine.gateway.prompt import PromptInfo

BS = 16
BLOCK_BYTES = 16 * 1024  # 1 KiB per token
HOLDER, PULLER = "http://h", "http://p"
STEP_BUDGET = 256
"""Tokens one engine step may schedule (25.6 ms of prefill at 10,000 tokens/s)."""


def engine(url: str) -> EngineState:
    e = EngineState(url, "decode")
    e.state = "healthy"
    return e


def load(
    prompt_tokens: float,
    busy: float,
    steps: float = 10,
    step_seconds: float = 0.1,
    waiting: float = 0,
    pulls: dict | None = None,
    budget: float = STEP_BUDGET,
) -> EngineLoad:
    return EngineLoad(
        prompt_tokens=prompt_tokens,
        prefill_busy_seconds=busy,
        steps=steps,
        step_seconds=step_seconds,
        waiting_prompt_tokens=waiting,
        kv_block_bytes=BLOCK_BYTES,
        step_token_budget=budget,
        peer_pulls=pulls or {},
    )


@pytest.fixture
def fleet():
    """Two engines prefilling 10,000 tokens/s with 10 ms steps; the holder caches
    the first 100 blocks of the prompt."""
    index = KVIndex()
    hashes = list(range(1000, 1100))
    index.apply(HOLDER, [BlockStored(hashes)])
    index.apply(PULLER, [])
    pp = PeerPull(GatewayMetrics(), index, BS, lend_timeout=2.0)
    h, p = engine(HOLDER), engine(PULLER)
    for e in (h, p):
        pp.scraped(e, EngineLoad(), load(10_000, 1.0))
    return pp, h, p, hashes


def info(hashes: list[int], blocks: int, tail: int = 40) -> PromptInfo:
    return PromptInfo(blocks * BS + tail, exact_hashes=hashes[:blocks])


def measure_pair(pp: PeerPull, h: EngineState, p: EngineState, lend_s: float, bw: float) -> None:
    """One lend answered in ``lend_s``, then a scrape of the puller showing pulls
    from the holder at ``bw`` bytes/s."""
    pp.lent(h, lend_s, "holder-id")
    before = load(10_000, 1.0)
    after = load(20_000, 2.0, pulls={"holder-id": (1.0, bw, 1.0)})
    pp.scraped(p, before, after)


def test_the_crossover_is_lend_time_over_the_per_token_margin(fleet):
    pp, h, p, _ = fleet
    assert pp.crossover(HOLDER, PULLER) is None  # no pair measured yet
    measure_pair(pp, h, p, lend_s=0.02, bw=1e9)
    # 1/rate = 100 µs per token; pulling costs 1 KiB / 1 GB/s ≈ 1 µs per token.
    expected = 0.02 / (1 / 10_000 - BLOCK_BYTES / BS / 1e9)
    assert pp.crossover(HOLDER, PULLER) == pytest.approx(expected)
    assert pp.metrics.peer_pull_fleet_crossover._value.get() == pytest.approx(expected)
    # A pair whose bandwidth cannot beat the prefill rate never pulls.
    pp.bandwidth[(HOLDER, PULLER)].value = 1e6  # 1 ms per token to pull, 0.1 to compute
    assert math.isinf(pp.crossover(HOLDER, PULLER) or 0.0)


def test_either_side_of_the_crossover_with_a_busy_holder(fleet):
    pp, h, p, hashes = fleet
    measure_pair(pp, h, p, lend_s=0.02, bw=1e9)
    crossover = pp.crossover(HOLDER, PULLER)
    assert crossover is not None and 150 < crossover < 250
    # The holder has 5 s of queued prompt tokens: serving there is out.
    pp.scraped(h, load(10_000, 1.0), load(20_000, 2.0, waiting=50_000))
    below = pp.plan(info(hashes, 4), h, [h, p], set(), BS)  # 64 tokens < crossover
    assert below is not None and (below.decision, below.engine) == ("recompute", p)
    above = pp.plan(info(hashes, 40), h, [h, p], set(), BS)  # 640 tokens > crossover
    assert above is not None and (above.decision, above.engine, above.reason) == ("pull", p, "cost")
    assert above.lend_blocks == 40 and above.holder is h


def test_an_idle_holder_serves_its_own_prefix(fleet):
    pp, h, p, hashes = fleet
    measure_pair(pp, h, p, lend_s=0.02, bw=1e9)
    plan = pp.plan(info(hashes, 40), p, [h, p], set(), BS)
    assert plan is not None and (plan.decision, plan.engine) == ("holder", h)
    # ... unless the gateway has it at capacity: then pull.
    plan = pp.plan(info(hashes, 40), p, [h, p], {HOLDER}, BS)
    assert plan is not None and plan.decision == "pull"


def test_tokens_routed_since_the_last_scrape_count_as_the_holders_queue(fleet):
    pp, h, p, hashes = fleet
    measure_pair(pp, h, p, lend_s=0.02, bw=1e9)
    assert pp.plan(info(hashes, 40), h, [h, p], set(), BS).decision == "holder"
    pp.routed(h, 30_000)  # a burst went there, the scrape has not seen it
    assert pp.plan(info(hashes, 40), h, [h, p], set(), BS).decision == "pull"
    pp.scraped(h, load(10_000, 1.0), load(20_000, 2.0))  # it drained
    assert pp.plan(info(hashes, 40), h, [h, p], set(), BS).decision == "holder"


def test_tokens_routed_leave_the_queue_once_computed_before_the_next_scrape(fleet):
    """A parent request computed on the holder does not make its forks, which
    arrive once it has answered, look queued behind it until the next scrape."""
    pp, h, p, hashes = fleet
    measure_pair(pp, h, p, lend_s=0.02, bw=1e9)
    parent = pp.routed(h, 30_000)
    other = pp.routed(h, 30_000)
    assert pp.plan(info(hashes, 40), h, [h, p], set(), BS).decision == "pull"
    parent()
    other()
    other()  # once only; and a no-op after a scrape reset the queue
    assert pp.view(HOLDER).queued_prompt_tokens == 0
    assert pp.plan(info(hashes, 40), h, [h, p], set(), BS).decision == "holder"
    late = pp.routed(h, 30_000)
    pp.scraped(h, load(10_000, 1.0), load(20_000, 2.0, waiting=30_000))
    late()
    assert pp.view(HOLDER).queued_prompt_tokens == 30_000  # the scrape's own count


def test_before_any_pair_is_measured_a_long_prefix_is_pulled_to_measure_it(fleet):
    pp, h, p, hashes = fleet
    pp.scraped(h, load(10_000, 1.0), load(20_000, 2.0, waiting=50_000))
    plan = pp.plan(info(hashes, 40), h, [h, p], set(), BS)
    assert plan is not None and (plan.decision, plan.reason) == ("pull", "explore")
    short = pp.plan(info(hashes, 2), h, [h, p], set(), BS)
    assert short is not None and short.decision == "recompute"


def test_no_plan_without_a_holder_or_measurements(tmp_path):
    index = KVIndex()
    index.apply(HOLDER, [BlockStored([1, 2, 3, 4])])
    index.apply(PULLER, [])
    pp = PeerPull(GatewayMetrics(), index, BS, lend_timeout=2.0)
    h, p = engine(HOLDER), engine(PULLER)
    # Nothing measured: the router's choice stands.
    assert pp.plan(info([1, 2, 3, 4], 4), p, [h, p], set(), BS) is None
    for e in (h, p):
        pp.scraped(e, EngineLoad(), load(10_000, 1.0))
    # A prompt nobody holds, and a batch, are left to the router.
    assert pp.plan(info([7, 8], 2), p, [h, p], set(), BS) is None
    batch = info([1, 2, 3, 4], 4)
    batch.batch = True
    assert pp.plan(batch, p, [h, p], set(), BS) is None
    # An engine without a KV connector is never pulled into.
    pp.scraped(p, load(10_000, 1.0), EngineLoad(prompt_tokens=20_000, prefill_busy_seconds=2.0))
    assert pp.plan(info([1, 2, 3, 4], 4), p, [h, p], set(), BS) is None


def test_a_lend_body_asks_for_one_token_and_the_blocks():
    body = {"prompt": [1, 2, 3], "max_tokens": 50, "stream": True, "n": 3, "response_format": {}}
    out = lend_body(body, chat=False, blocks=7)
    assert (out["max_tokens"], out["stream"], out["n"]) == (1, False, 1)
    assert "response_format" not in out
    assert out["kv_transfer_params"]["do_remote_decode"] is True
    assert out["kv_transfer_params"]["pdfleet_lend_blocks"] == 7
    assert lend_body(body, chat=True, blocks=7)["max_completion_tokens"] == 1
    # The params are the engine's carrier's wire form, and decode back to it.
    wire = json.dumps(out["kv_transfer_params"])
    assert wire == json.dumps({**REMOTE_DECODE.to_wire(), LEND_FIELD: 7})
    decoded = KVTransferParams.from_wire(json.loads(wire))
    assert (decoded.do_remote_decode, decoded.lend_blocks) == (True, 7)


def test_a_prefill_leg_that_pulls_first_carries_the_lend_params_and_asks_to_produce():
    lent = {"do_remote_prefill": True, "remote_block_ids": [4, 5], "pdfleet_sig": "s"}
    body = {"prompt": [1, 2, 3], "max_tokens": 50, "stream": True, "min_tokens": 4}
    out = pulling_prefill_body(body, chat=False, lent=lent)
    assert (out["max_tokens"], out["stream"], "min_tokens" in out) == (1, False, False)
    assert out["kv_transfer_params"] == {**lent, "pdfleet_produce": True}
    assert "pdfleet_produce" not in lent  # the lend's own params are left as signed


def test_a_busy_engine_costs_its_step_in_progress_an_idle_one_does_not(fleet):
    pp, h, _, _ = fleet
    slow = load(20_000, 2.0, steps=20, step_seconds=10.1)  # 1 s steps since the last scrape
    pp.scraped(h, load(10_000, 1.0), slow)
    assert pp.compute_seconds(h, 1000, 10_000) == pytest.approx(0.1)  # idle: no wait
    busy = load(20_000, 2.0, steps=20, step_seconds=10.1)
    busy.running = 1
    pp.scraped(h, load(10_000, 1.0), busy)
    assert pp.compute_seconds(h, 1000, 10_000) > 0.5


def test_a_lend_waits_for_the_holders_step_in_progress_too(fleet):
    pp, h, p, hashes = fleet
    measure_pair(pp, h, p, lend_s=0.05, bw=1e9)
    # The holder runs long steps and has a fork's tail queued (100 tokens, 10 ms):
    # pulling from it waits for its step in progress as serving there does, so the
    # long step is no reason to pull; a queue there longer than the lend is.
    busy = load(20_000, 2.0, steps=20, step_seconds=3.1, waiting=100)
    busy.running = 1
    pp.scraped(h, load(10_000, 1.0), busy)
    step = pp.in_progress(HOLDER)
    assert step == pp._costs(HOLDER).step.value and step > 0.09
    plan = pp.plan(info(hashes, 100), h, [h, p], set(), BS)
    assert plan is not None and plan.decision == "holder", plan.options
    pull = next(o for o in plan.options if o.decision == "pull")
    assert pull.seconds > 0.05 + step
    pp.routed(h, 2_000)  # 0.2 s more queued there: pulling is cheaper than serving there
    plan = pp.plan(info(hashes, 100), h, [h, p], set(), BS)
    assert plan is not None and plan.decision != "holder", plan.options
    cost = {o.decision: o.seconds for o in plan.options}
    assert cost["pull"] < cost["holder"]


def test_a_device_tier_lend_shares_no_step_with_the_holders_queue(fleet):
    """The holder leases device-tier blocks between steps: the lend waits for the
    step in progress only, however much prompt is queued there."""
    pp, h, p, hashes = fleet
    measure_pair(pp, h, p, lend_s=0.01, bw=1e9)
    busy = load(20_000, 2.0, steps=20, step_seconds=0.3, waiting=200)
    busy.running = 1
    pp.scraped(h, load(10_000, 1.0), busy)
    step = pp.in_progress(HOLDER)
    assert step > 0
    plan = pp.plan(info(hashes, 100), h, [h, p], set(), BS)
    assert plan is not None and plan.lend_wait == pytest.approx(step)
    # The queue fits one step: serving there costs that step, pulling does not.
    assert plan.decision == "pull", plan.options
    pull = next(o for o in plan.options if o.decision == "pull")
    assert pull.seconds < next(o for o in plan.options if o.decision == "holder").seconds
    # One block of the lend on the host tier: a step copies it back, shared with the queue.
    pp.kv_index.apply(HOLDER, [BlockStored([hashes[99]], hashes[98], medium="CPU")])
    pp.kv_index.apply(HOLDER, [BlockRemoved([hashes[99]], medium="GPU")])
    assert not pp.kv_index.on_device(hashes[:100], HOLDER)
    host = pp.plan(info(hashes, 100), h, [h, p], set(), BS)
    assert host is not None and host.lend_wait == pytest.approx(step + 200 / 10_000)


def test_a_host_tier_lend_shares_the_holders_next_step_with_its_queue_up_to_the_budget(fleet):
    """A lend of host-tier blocks goes ahead of the holder's queue but runs in a
    step that computes that queue too, up to the step's token budget: a queue
    that fits one step is no reason to pull (serving there costs the same step);
    a longer one is."""
    pp, h, p, hashes = fleet
    pp.kv_index.apply(HOLDER, [BlockStored(hashes, medium="CPU")])
    pp.kv_index.apply(HOLDER, [BlockRemoved(hashes, medium="GPU")])
    measure_pair(pp, h, p, lend_s=0.01, bw=1e9)
    pp.scraped(h, load(10_000, 1.0), load(20_000, 2.0, waiting=200))
    short = pp.plan(info(hashes, 100), h, [h, p], set(), BS)
    assert short is not None and short.decision == "holder", short.options
    pp.scraped(h, load(10_000, 1.0), load(20_000, 2.0, waiting=5_000))
    long = pp.plan(info(hashes, 100), h, [h, p], set(), BS)
    assert long is not None and long.decision == "pull", long.options
    pull = next(o for o in long.options if o.decision == "pull")
    assert pull.seconds < 0.01 + STEP_BUDGET / 10_000 + 0.05  # one step's worth, not 0.5 s
    # An engine that does not publish its budget: the whole queue may share the step.
    pp.scraped(h, load(10_000, 1.0), load(20_000, 2.0, waiting=5_000, budget=0))
    unknown = pp.plan(info(hashes, 100), h, [h, p], set(), BS)
    assert unknown is not None and unknown.decision != "pull", unknown.options
    # ... unless it is at capacity: its queue waits for a free slot, the lend does not.
    full = pp.plan(info(hashes, 100), h, [h, p], {HOLDER}, BS)
    assert full is not None and full.decision == "pull", full.options
    # Or its own scrape shows every slot taken (requests sent there past this gateway).
    blocked = load(20_000, 2.0, waiting=5_000, budget=0)
    blocked.running, blocked.waiting, blocked.max_num_seqs = 4, 3, 4
    pp.scraped(h, load(10_000, 1.0), blocked)
    plan = pp.plan(info(hashes, 100), h, [h, p], set(), BS)
    assert plan is not None and plan.decision == "pull", plan.options


def test_pulls_into_one_engine_queue_behind_each_other(fleet):
    pp, h, p, hashes = fleet
    measure_pair(pp, h, p, lend_s=0.01, bw=1e8)  # 16 KB blocks: 0.16 ms each
    pp.scraped(h, load(10_000, 1.0), load(20_000, 2.0, waiting=50_000))
    first = pp.plan(info(hashes, 100), h, [h, p], set(), BS)
    assert first is not None and first.decision == "pull"
    seconds = next(o for o in first.options if o.decision == "pull").seconds
    done = pp.routed(p, 40, pull_bytes=100 * BLOCK_BYTES)
    second = pp.plan(info(hashes, 100), h, [h, p], set(), BS)
    later = next(o for o in second.options if o.decision == "pull").seconds
    # Its transfer waits for the first one, and its tail for the first tail (and
    # for the step in progress there: the puller is busy now).
    waits = 100 * BLOCK_BYTES / 1e8 + 40 / 10_000 + pp.in_progress(PULLER)
    assert pp.in_progress(PULLER) == pytest.approx(0.01)
    assert later == pytest.approx(seconds + waits, rel=1e-6)
    done()
    again = pp.plan(info(hashes, 100), h, [h, p], set(), BS)
    assert next(o for o in again.options if o.decision == "pull").seconds == pytest.approx(seconds)


def test_a_recompute_is_charged_the_delay_it_adds_to_the_pulls_in_flight_there(fleet):
    """Pulls planned into the puller and still reading their KV land behind a
    prompt sent there now: recomputing the prefix there costs each of them that
    computation, which tips a short prefix below the crossover towards pulling."""
    pp, h, p, hashes = fleet
    measure_pair(pp, h, p, lend_s=0.02, bw=1e9)  # crossover about 200 tokens
    pp.scraped(h, load(10_000, 1.0), load(20_000, 2.0, waiting=50_000))  # the holder is out
    prompt = info(hashes, 8)  # 128 prefix tokens
    n = 8 * BS + 40
    plan = pp.plan(prompt, h, [h, p], set(), BS)
    assert plan is not None and plan.decision == "recompute", plan.options
    done = [pp.routed(p, 40, pull_bytes=BLOCK_BYTES) for _ in range(3)]
    plan = pp.plan(prompt, h, [h, p], set(), BS)
    assert plan is not None and plan.decision == "pull", plan.options
    cost = {o.decision: o.seconds for o in plan.options}
    assert cost["recompute"] == pytest.approx(pp.compute_seconds(p, n, 10_000) + 3 * n / 10_000)
    for computed in done:
        computed()
    plan = pp.plan(prompt, h, [h, p], set(), BS)
    assert plan is not None and plan.decision == "recompute", plan.options


def test_a_lend_at_a_busy_holder_learns_its_time_less_the_step_it_waited_for(fleet, monkeypatch):
    import asyncio
    from types import SimpleNamespace

    from pdfleet.engine.gateway import peer_pull
    from pdfleet.engine.gateway.peer_pull import Plan

    pp, h, p, _ = fleet
    busy = load(20_000, 2.0, steps=20, step_seconds=10.1)
    busy.running = 1
    pp.scraped(h, load(10_000, 1.0), busy)
    step = pp.in_progress(HOLDER)
    assert step > 0.3

    class Answer:
        status_code = 200
        content = b""

        def json(self):
            return {"kv_transfer_params": {"remote_block_ids": [1], "remote_engine_id": "x"}}

    class Client:
        async def post(self, url, payload, headers, timeout):
            return Answer()

    clock = iter([100.0, 100.7])  # the lend took 0.7 s
    monkeypatch.setattr(peer_pull, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    plan = Plan("pull", "cost", p, h, 4, [])
    params = asyncio.run(pp.lend(Client(), plan, "/v1/completions", {"prompt": [1]}, False, {}))  # type: ignore[arg-type]
    monkeypatch.undo()
    assert params is not None
    assert pp._costs(HOLDER).lend.value == pytest.approx(0.7 - step)


# -- P/D: a decode engine holds the prefix -----------------------------------------------
DECODE = "http://d"


@pytest.fixture
def pd_fleet():
    """Two prefill engines and a decode engine (a lender), all prefilling 10,000
    tokens/s with 10 ms steps; the decode engine holds 100 blocks of the prompt
    (a conversation's last turn and its answer), the first prefill engine the
    first 60 of them (that turn's prompt), the second none."""
    index = KVIndex()
    hashes = list(range(1000, 1100))
    index.apply(DECODE, [BlockStored(hashes)])
    index.apply(HOLDER, [BlockStored(hashes[:60])])
    index.apply(PULLER, [])
    pp = PeerPull(GatewayMetrics(), index, BS, lend_timeout=2.0)
    d, h, p = engine(DECODE), EngineState(HOLDER, "prefill"), EngineState(PULLER, "prefill")
    for e in (d, h, p):
        e.state = "healthy"
        pp.scraped(e, EngineLoad(), load(10_000, 1.0))
    return pp, d, h, p, hashes


def test_a_prefill_leg_pulls_what_only_a_decode_engine_holds(pd_fleet):
    pp, d, h, p, hashes = pd_fleet
    measure_pair(pp, d, h, lend_s=0.005, bw=1e9)
    # The decode engine has a long queue: the prefill engine routed, which holds the
    # first 60 blocks, pulls the other 40 from it and computes only the tail.
    pp.scraped(d, load(10_000, 1.0), load(20_000, 2.0, waiting=50_000))
    plan = pp.plan(info(hashes, 100), h, [h, p], set(), BS, lenders=[d], alone_below=256)
    assert plan is not None, "no plan"
    assert (plan.decision, plan.engine, plan.holder) == ("pull", h, d), plan.options
    assert plan.lend_blocks == 100 and not plan.alone
    pull, served = (next(o for o in plan.options if o.decision == k) for k in ("pull", "holder"))
    assert pull.tokens == served.tokens == 40  # the tail only
    assert served.seconds > 5  # its queue
    # Without lenders the routed prefill engine holds the most: its own leg stays.
    plan = pp.plan(info(hashes, 100), h, [h, p], set(), BS)
    assert plan is not None and (plan.decision, plan.engine, plan.alone) == ("holder", h, False)


def test_an_idle_decode_holder_serves_the_request_alone(pd_fleet):
    pp, d, h, p, hashes = pd_fleet
    measure_pair(pp, d, h, lend_s=0.05, bw=1e9)
    # Idle, with all 100 blocks: computing the 40-token tail there beats a lend,
    # where it may compute that few tokens alone (under --min-prompt-tokens).
    plan = pp.plan(info(hashes, 100), h, [h, p], set(), BS, lenders=[d], alone_below=256)
    assert plan is not None and (plan.decision, plan.engine) == ("holder", d), plan.options
    assert plan.alone
    # A longer tail than that, or a fleet that always prefills: the prefill leg pulls.
    for below in (40, 0):
        plan = pp.plan(info(hashes, 100), h, [h, p], set(), BS, lenders=[d], alone_below=below)
        assert plan is not None and (plan.decision, plan.engine, plan.alone) == ("pull", h, False)
        assert "holder" not in {o.decision for o in plan.options}
    # At the gateway's capacity it cannot either.
    plan = pp.plan(info(hashes, 100), h, [h, p], {DECODE}, BS, lenders=[d], alone_below=256)
    assert plan is not None and (plan.decision, plan.engine, plan.alone) == ("pull", h, False)
    # A prefill engine that holds as much: the tie goes to it (a candidate), which
    # serves its own prefill leg, never the request alone.
    pp.kv_index.apply(PULLER, [BlockStored(hashes)])
    plan = pp.plan(info(hashes, 100), h, [h, p], set(), BS, lenders=[d], alone_below=256)
    assert plan is not None and plan.holder is p and not plan.alone


def test_a_decode_engine_that_refuses_to_lend_is_not_asked_again(pd_fleet):
    import asyncio

    pp, d, h, p, hashes = pd_fleet
    pp.scraped(d, load(10_000, 1.0), load(20_000, 2.0, waiting=50_000))
    plan = pp.plan(info(hashes, 100), h, [h, p], set(), BS, lenders=[d])
    assert plan is not None and (plan.decision, plan.reason, plan.holder) == ("pull", "explore", d)

    class Refused:
        status_code = 400
        content = b"not a KV producer"

        def json(self):
            message = "kv_transfer_params: this engine is not a KV producer (kv_role kv_consumer)"
            return {"error": {"message": message, "param": "kv_transfer_params"}}

    async def lend(answer):
        class Client:
            async def post(self, url, payload, headers, timeout):
                return answer

        return await pp.lend(Client(), plan, "/v1/completions", {"prompt": [1]}, False, {})  # type: ignore[arg-type]

    # A refusal about this lend's blocks says nothing of the next lend's.
    short = Refused()
    short.json = lambda: {  # type: ignore[method-assign]
        "error": {
            "message": "kv_transfer_params: pdfleet_lend_blocks 100 needs at least 1601 "
            "prompt tokens",
            "param": "kv_transfer_params",
        }
    }
    assert asyncio.run(lend(short)) is None
    assert pp.plan(info(hashes, 100), h, [h, p], set(), BS, lenders=[d]).holder is d
    assert asyncio.run(lend(Refused())) is None
    # It is no holder now: the routed prefill engine holds the most of the others.
    plan = pp.plan(info(hashes, 100), h, [h, p], set(), BS, lenders=[d])
    assert plan is not None and plan.holder is h
    # It left the pool and came back (restarted, perhaps as kv_both): asked again.
    pp.forget(DECODE)
    pp.scraped(d, EngineLoad(), load(10_000, 1.0))
    plan = pp.plan(info(hashes, 100), h, [h, p], set(), BS, lenders=[d])
    assert plan is not None and plan.holder is d


def test_the_route_of_a_plan(pd_fleet):
    from pdfleet.engine.gateway.peer_pull import Plan
    from pdfleet.engine.gateway.proxy import planned_route
    from pdfleet.engine.gateway.routing import Route

    _, d, h, p, _ = pd_fleet
    route = Route(d, h, "prefill_decode", "always")
    # A decode engine that holds the prefix serves the request alone: decode-only.
    alone = planned_route(route, Plan("holder", "cost", d, d, alone=True))
    assert (alone.decode, alone.prefill, alone.decision, alone.reason) == (
        d,
        None,
        "decode_only",
        "peer_holder",
    )
    # A pull from it (or any plan for a prefill engine): the prefill leg moves there.
    pulled = planned_route(route, Plan("pull", "cost", p, d, lend_blocks=4))
    assert (pulled.decode, pulled.prefill, pulled.decision) == (d, p, "prefill_decode")
    # Aggregated: the engine that serves it.
    served = planned_route(Route(h, None, "decode_only", "disabled"), Plan("pull", "cost", p, h))
    assert (served.decode, served.prefill, served.reason) == (p, None, "disabled")
