"""A slow fleet is not a broken one: the stall watchdog follows each engine's
own pace, a fleet slow as a whole ejects nothing, the last engine of a role
stays, and more load than the engines take is answered as overload (429/503
with Retry-After), never as a 504 from ejecting healthy engines.

The pure parts first (the pool and the admission queue, no process), then a
real gateway over two real engines (the tiny model) whose steps a test slows
down through the engine's fault hook ($PDFLEET_FAULT_STEP_DELAY_FILE: every
step first sleeps the seconds the file holds). The day-one benchmark
(benchmarks/day_one.py) measures the same on the default fleet.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers.fleet import ENGINE_ARGS, engines_view, metric, start_gateway
from helpers.server import ServerProcess, stop_all, wait_until

from pdfleet.engine.config.gateway import GatewayConfig
from pdfleet.engine.gateway.admission import Admission, Overloaded
from pdfleet.engine.gateway.discovery import Endpoint, StaticDiscovery
from pdfleet.engine.gateway.engines import EngineLoad, EnginePool, longest_step
from pdfleet.engine.gateway.fair_queue import Waiter
from pdfleet.engine.gateway.metrics import GatewayMetrics
from pdfleet.engine.testing_hooks import FAULT_STEP_DELAY_ENV

# -- the pool: pace, slow fleets, the last engine ------------------------------------


def stepped(steps: float, total: float, buckets: dict[float, float]) -> EngineLoad:
    """A scrape whose step histogram has ``steps`` steps of ``total`` seconds."""
    bounds = (0.01, 0.1, 1.0, 2.5, 5.0, 10.0, float("inf"))
    cumulative = tuple((le, sum(n for b, n in buckets.items() if b <= le)) for le in bounds)
    return EngineLoad(steps=steps, step_seconds=total, step_buckets=cumulative)


def test_the_longest_step_between_two_scrapes_is_bounded_by_its_bucket_and_the_sum():
    before = stepped(10, 0.05, {0.01: 10})
    # Three steps, one of them in the (1, 2.5] bucket, 1.9 s in all.
    after = stepped(13, 1.95, {0.01: 10, 0.1: 2, 2.5: 1})
    assert longest_step(before, after) == pytest.approx(1.9)  # the sum is tighter
    # One long step among many short ones: the bucket bound is tighter.
    many = stepped(113, 2.05 + 6.0, {0.01: 110, 0.1: 2, 2.5: 1})
    assert longest_step(before, many) == 2.5
    assert longest_step(after, after) is None  # no step completed
    assert longest_step(EngineLoad(), after) is None  # the first scrape: steps of any age
    assert longest_step(after, stepped(2, 0.01, {0.01: 2})) is None  # a restarted engine


def pool_of(*engines: tuple[str, str], floor: float = 1.0) -> EnginePool:
    config = GatewayConfig(
        decode=["http://x"],
        stall_timeout=floor,
        stall_step_multiple=4,
        scrape_interval=0.2,
    )
    pool = EnginePool(config, StaticDiscovery([]), GatewayMetrics(), httpx.AsyncClient())
    pool.apply([Endpoint(url, role) for url, role in engines])
    for e in pool.engines.values():
        pool.record_success(e, EngineLoad())
        e.last_progress = 0.0  # (the tests' clock starts at 100)
    return pool


def paced(pool: EnginePool, url: str, at: float, step: float, progress: bool = True) -> None:
    """Engine ``url`` reported steps of ``step`` seconds in its scrape at ``at``."""
    e = pool.engines[url]
    e.load = stepped(1, step, {0.01: 1})  # (a histogram is present: a pdfleet engine)
    e.steps.add(at, step)
    if progress:
        e.last_progress = at


def test_the_stall_limit_follows_the_engines_own_longest_recent_step():
    pool = pool_of(("http://a", "decode"), ("http://b", "decode"))
    a = pool.engines["http://a"]
    assert pool.stall_limit(a, now=100.0) == 1.0  # no history: the floor
    a.steps.add(100.0, 2.0)  # a 2 s step (a long prefill on a loaded CPU)
    assert pool.stall_limit(a, now=101.0) == pytest.approx(4 * 2.0 + 0.2)
    # Remembered for STEP_WINDOW_S, then the floor again.
    assert pool.stall_limit(a, now=100.0 + 299) == pytest.approx(8.2)
    assert pool.stall_limit(a, now=100.0 + 301) == 1.0


def test_an_engine_silent_past_its_own_pace_is_ejected_while_a_peer_keeps_pace():
    pool = pool_of(("http://a", "decode"), ("http://b", "decode"))
    a, b = pool.engines["http://a"], pool.engines["http://b"]
    paced(pool, "http://a", 100.0, 0.5)  # a's steps: half a second (limit 2.2 s)
    a.inflight = 2
    paced(pool, "http://b", 101.0, 0.02)
    # 2 s of silence: within a's own limit, whatever b does.
    paced(pool, "http://b", 101.9, 0.02)
    assert pool.find_stalls(now=102.0) == []
    # Past it, while b reported steps of 20 ms since a went quiet: a is stalled.
    paced(pool, "http://b", 102.9, 0.02)
    assert pool.find_stalls(now=103.0) == [a]
    assert a.stalled and not a.routable and b.routable


def test_a_fleet_slow_as_a_whole_ejects_nothing():
    pool = pool_of(("http://a", "decode"), ("http://b", "decode"))
    a, b = pool.engines["http://a"], pool.engines["http://b"]
    paced(pool, "http://a", 100.0, 0.02)
    paced(pool, "http://b", 100.0, 0.02)
    a.inflight = b.inflight = 1
    # Every step now takes 3 s (a loaded host): b finishes one and reports it
    # while a is still in its own; a's silence is past its old limit (1 s)...
    paced(pool, "http://b", 103.0, 3.0)
    assert pool.stall_limit(a, now=103.5) == 1.0
    # ...but b kept no faster pace: nothing is ejected.
    assert pool.find_stalls(now=103.5) == []
    assert a.routable and b.routable and a.spared
    # Both silent (everything stopped): still nothing.
    assert pool.find_stalls(now=160.0) == []
    assert a.routable and b.routable


def test_progress_of_an_engine_of_another_role_does_not_make_a_stall():
    pool = pool_of(("http://p1", "prefill"), ("http://p2", "prefill"), ("http://d", "decode"))
    p1 = pool.engines["http://p1"]
    paced(pool, "http://p1", 100.0, 0.05)
    p1.inflight = 3
    for at in (101.0, 102.0, 103.0):
        paced(pool, "http://d", at, 0.01)  # decode streams tokens fast
    assert pool.find_stalls(now=103.5) == []  # p2 did nothing: a slow prefill pool
    paced(pool, "http://p2", 103.2, 0.05)
    assert pool.find_stalls(now=103.5) == [p1]


def test_the_last_routable_engine_of_a_role_is_never_ejected_for_a_stall():
    pool = pool_of(("http://a", "decode"), ("http://b", "decode"))
    a, b = pool.engines["http://a"], pool.engines["http://b"]
    b.state = "ejected"  # b is out already: a is the last decode engine
    paced(pool, "http://a", 100.0, 0.02)
    a.inflight = 4
    assert pool.find_stalls(now=500.0) == []
    assert a.routable and not a.stalled
    # Nor when another worker saw it stall.
    assert not pool.stalled_elsewhere("http://a", since=100.0, now=500.0)
    assert a.routable


# -- the admission queue -------------------------------------------------------------


def admission(**overrides: float) -> tuple[Admission, EnginePool]:
    config = GatewayConfig(decode=["http://d"], **overrides)  # type: ignore[arg-type]
    metrics = GatewayMetrics()
    pool = EnginePool(config, StaticDiscovery([]), metrics, httpx.AsyncClient())
    pool.apply([Endpoint("http://d", "decode")])
    pool.record_success(pool.engines["http://d"], EngineLoad())
    return Admission(config, metrics), pool


def test_an_engines_capacity_is_learned_from_its_own_queue():
    adm, pool = admission()
    d = pool.engines["http://d"]
    assert d.capacity is None and adm.has_room(d)  # never queued: unbounded
    for _ in range(6):
        adm.take(d)
    # It runs 2 and queues 4 of the 6 (KV pulls in flight wait for bytes, not room).
    adm.scraped(d, EngineLoad(), EngineLoad(running=2, waiting=5, kv_pulls=1))
    assert d.capacity == 2 and not adm.has_room(d)
    for _ in range(5):
        adm.give_back(d)
    assert adm.has_room(d)
    adm.take(d)
    assert not adm.has_room(d)
    adm.scraped(d, EngineLoad(), EngineLoad(running=2, waiting=0))
    assert d.capacity == 3 and adm.has_room(d)  # at capacity, not queuing: it takes more
    adm.scraped(d, EngineLoad(), EngineLoad(running=2, waiting=0))
    assert d.capacity == 3  # (only while the gateway fills it)


def test_an_engines_waiting_sequences_that_fit_its_free_slots_do_not_cut_its_capacity():
    """An engine that says which of its waiting sequences are beyond its free
    slots (a wide request's held back by its share, or by the step's token
    budget, are not): only those cut the capacity."""
    adm, pool = admission()
    d = pool.engines["http://d"]
    d.capacity = 64
    adm.take(d, seqs=64)  # an n=64 request, 2 more sequences, 32 of its own waiting
    adm.take(d, seqs=2)
    adm.scraped(d, EngineLoad(), EngineLoad(running=34, waiting=32, waiting_for_slot=0))
    assert d.capacity == 65  # not queuing for room, at capacity: it may take one more
    adm.scraped(d, EngineLoad(), EngineLoad(running=64, waiting=2, waiting_for_slot=2))
    assert d.capacity == 64  # 66 admitted, 2 beyond its slots
    adm.scraped(d, EngineLoad(), EngineLoad(running=34, waiting=32))
    assert d.capacity == 34  # an engine that does not say: every waiting one counts


def test_a_wide_request_at_the_head_keeps_the_freed_slots_and_the_best_band_overflows():
    """Slots count sequences: an n=8 request on an engine of capacity 4 waits until
    the engine is free of this gateway's requests (it never overflows it by its
    width), and the slots freed meanwhile wake it alone, not the narrow requests
    behind it. The best of several bands may fill an eighth more than capacity
    (the engine preempts a worse band for it); other bands may not."""
    adm, pool = admission()
    d = pool.engines["http://d"]
    for _ in range(5):
        adm.take(d)
    adm.scraped(d, EngineLoad(), EngineLoad(running=4, waiting=1))
    assert d.capacity == 4
    adm.give_back(d)
    adm.give_back(d)
    assert adm.has_room(d) and not adm.has_room(d, seqs=8)  # 3 of 4 taken

    async def scenario() -> list[str]:
        woken: list[str] = []

        async def wait(name: str, tag: float, seqs: int) -> None:
            if await adm.wait(time.monotonic() + 5, False, name, 0, tag, seqs):
                woken.append(name)

        tasks = [
            asyncio.create_task(wait("wide", 0.0, 8)),
            asyncio.create_task(wait("narrow", 1.0, 1)),
        ]
        await wait_for(lambda: adm.queued == 2)
        adm.give_back(d)  # one slot frees: the wide request at the head is woken alone
        await wait_for(lambda: woken == ["wide"])
        assert adm.queued_by_tenant() == {"narrow": 1}
        assert not adm.has_room(d, seqs=8)  # 2 of 4 taken: it would go back to its place
        for _ in range(2):
            adm.give_back(d)
        assert adm.has_room(d, seqs=8)  # nothing of this gateway's on it: all of it
        await wait_for(lambda: len(woken) == 2)
        await asyncio.gather(*tasks)
        return woken

    assert asyncio.run(scenario()) == ["wide", "narrow"]
    for _ in range(4):
        adm.take(d)
    assert not adm.has_room(d, band=0)  # no best band: capacity bounds every band
    adm.top_band = 0
    assert adm.has_room(d, band=0) and not adm.has_room(d, band=1)
    adm.take(d, top=True)
    assert not adm.has_room(d, band=0)  # ceil(4 / 8) = 1 over capacity, no more


def test_a_woken_request_that_leaves_before_it_runs_passes_its_wake_on():
    """A slot frees and wakes the request at the head; that request's client
    leaves before it runs: the next request gets the slot, and does not wait
    beside it."""
    adm, pool = admission()
    d = pool.engines["http://d"]
    for _ in range(5):
        adm.take(d)
    adm.scraped(d, EngineLoad(), EngineLoad(running=4, waiting=1))
    adm.give_back(d)
    assert d.capacity == 4 and not adm.has_room(d)

    async def scenario(first_seqs: int) -> list[str]:
        started: list[str] = []

        async def wait(name: str, tag: float, seqs: int) -> None:
            again = False
            while await adm.wait(time.monotonic() + 5, again, name, 0, tag, seqs):
                if adm.has_room(d, seqs):
                    adm.take(d, seqs=seqs)
                    started.append(name)
                    return
                again = True

        first = asyncio.create_task(wait("first", 0.0, first_seqs))
        second = asyncio.create_task(wait("second", 1.0, 1))
        await wait_for(lambda: adm.queued == 2)
        adm.give_back(d)  # wakes the first
        first.cancel()  # whose client leaves before it runs
        await wait_for(lambda: started == ["second"])
        await asyncio.gather(first, second, return_exceptions=True)
        adm.give_back(d)
        return started

    assert asyncio.run(scenario(1)) == ["second"]
    assert asyncio.run(scenario(8)) == ["second"]  # a wide one woken alone, too


def test_the_best_band_keeps_its_share_while_a_worse_band_holds_more_than_capacity():
    """A worse band admitted before the capacity was learned (or lowered since)
    holds more than the best band's limit: the best band's share beyond the
    capacity is its own, so its requests still go straight to the engine."""
    adm, pool = admission()
    adm.top_band = 0
    d = pool.engines["http://d"]
    for _ in range(12):  # the flood, taken while no capacity was known
        adm.take(d)
    adm.scraped(d, EngineLoad(), EngineLoad(running=8, waiting=4))
    assert d.capacity == 8 and adm.limit(d, 0) == 9  # ceil(8 / 8) = 1 beyond it
    assert not adm.has_room(d, band=1) and not adm.has_room(d, band=None)
    assert adm.has_room(d, band=0)
    adm.take(d, top=True)
    assert not adm.has_room(d, band=0)  # its share is taken
    assert not adm.has_room(d, seqs=2, band=0)
    adm.give_back(d, top=True)
    assert adm.has_room(d, band=0) and d.top_admitted == 0 and d.admitted == 12
    for _ in range(4):  # the flood drains to the capacity: the usual limit
        adm.give_back(d)
    assert adm.has_room(d, band=0) and not adm.has_room(d, band=1)
    adm.take(d, top=True)
    assert not adm.has_room(d, band=0)  # 9 of 9


async def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def test_an_engine_that_never_queues_gets_a_capacity_from_slow_first_answers():
    """An engine that runs every request at once (its own queue stays empty)
    queues inside its ever longer steps: slots that wait past a quarter of the
    first-token bound for their first answer count as its queue."""
    adm, pool = admission(first_token_base_timeout=40)
    d = pool.engines["http://d"]
    assert adm.late_after == 10
    for key in range(8):
        adm.take(d, key)
    for key in range(5):  # 5 answered at once, 3 are still waiting at t+11 s
        adm.answered(d, key)
    started = min(d.pending.values())
    adm.scraped(d, EngineLoad(), EngineLoad(running=8), now=started + 5)
    assert d.capacity is None  # not late yet: no bound
    adm.scraped(d, EngineLoad(), EngineLoad(running=8), now=started + 11)
    assert d.capacity == 5 and not adm.has_room(d)
    # They answer; at capacity, first answers in time: one more slot per scrape.
    for key in range(5, 8):
        adm.answered(d, key)
    adm.scraped(d, EngineLoad(), EngineLoad(running=8), now=started + 12)
    assert d.capacity == 6
    adm.take(d, 100)  # a new slot, its first answer slow (over half of 10 s)
    adm.scraped(d, EngineLoad(), EngineLoad(running=9), now=d.pending[100] + 6)
    assert d.capacity == 6  # no growth, no cut yet
    for key in range(8):
        adm.give_back(d, key)
    adm.give_back(d, 100)
    assert d.admitted == 0 and d.pending == {}


def test_the_rate_slots_free_at_counts_only_saturated_time():
    adm, _ = admission()
    rate = adm.freed
    for t in range(100, 110):  # requests end while nobody waits: no evidence
        rate.tick(float(t))
    assert rate.per_second(110.0) == 0.0
    rate.saturated(110.0)  # a burst after a quiet spell: measured from here
    for t in (110.5, 111.0, 111.5, 112.0):
        rate.tick(t)
    assert rate.per_second(112.0) == 0.0  # 2 s of a burst: not evidence enough yet
    for t in range(112, 120):
        rate.tick(t + 0.5)
    assert rate.per_second(120.0) == pytest.approx(12 / 10)
    rate.drained(120.0)
    rate.saturated(123.0)  # a queue that emptied for a moment: the same period
    assert rate.busy_since == 110.0
    rate.drained(124.0)
    assert rate.per_second(124.0 + 31) == 0.0  # idle for a window: no rate


def test_requests_beyond_capacity_wait_in_order_and_are_refused_fast_with_retry_after():
    async def main() -> None:
        adm, pool = admission(queue_timeout=0.5, max_queued_requests=2)
        d = pool.engines["http://d"]
        d.capacity = 1
        adm.take(d)
        loop = asyncio.get_running_loop()
        order: list[str] = []

        async def waiter(name: str) -> bool:
            adm.check_queue()
            woken = await adm.wait(loop.time() + 30, first=False)
            order.append(name)
            return woken

        first = asyncio.create_task(waiter("first"))
        second = asyncio.create_task(waiter("second"))
        await asyncio.sleep(0)
        assert adm.queued == 2
        with pytest.raises(Overloaded) as full:  # the queue is full: refused at once
            adm.check_queue()
        assert full.value.status == 429 and full.value.retry_after >= 1
        adm.give_back(d)  # a slot frees: the oldest waiter goes first
        assert await first and order == ["first"]
        adm.give_back(d)
        assert await second and order == ["first", "second"]
        # Saturated for 10 s, slots freeing at 2/s: one request ahead means a
        # 1 s wait, more than --queue-timeout (0.5 s): refused at once.
        now = time.monotonic()
        adm.freed.busy_since = now - 10
        for _ in range(20):
            adm.freed.tick(now)
        ahead = Waiter(loop.create_future(), "", 0, 0.0)
        adm._waiters.push(ahead)
        with pytest.raises(Overloaded) as late:
            adm.check_queue()
        assert (late.value.status, late.value.reason) == (429, "overloaded")
        assert late.value.retry_after == 1  # (1 ahead + itself) / 2 per s
        # A request of a band served before it waits behind nobody: not refused.
        adm.check_queue(band=-1)
        adm._waiters.remove(ahead)
        # A wait that times out says so (the proxy answers 503 with Retry-After).
        assert not await adm.wait(loop.time() + 0.05, first=False)
        assert adm.queued == 0

    asyncio.run(asyncio.wait_for(main(), 30))


# -- real engines, slowed down ------------------------------------------------------


@pytest.fixture(scope="module")
def slowable(tiny_model, tmp_path_factory):
    """Two aggregated engines (2 sequences each) whose steps the test can slow:
    {"a": (process, delay file), "b": ...}."""
    log_dir = tmp_path_factory.mktemp("slow-fleet")
    engines = {}
    for name in ("a", "b"):
        delay = log_dir / f"{name}.delay"
        delay.write_text("0")
        engines[name] = (
            ServerProcess(
                ["serve", tiny_model, *ENGINE_ARGS, "--max-num-seqs", "2"],
                log_dir,
                name,
                env={"OMP_NUM_THREADS": "1", FAULT_STEP_DELAY_ENV: str(delay)},
            ),
            delay,
        )
    try:
        for proc, _ in engines.values():
            proc.wait_healthy(180)
        yield engines
    finally:
        stop_all(proc for proc, _ in engines.values())


@pytest.fixture
def delays(slowable):
    """Sets engines' step delays; every delay is back to 0 after the test."""

    def set_delay(seconds: float, *names: str) -> None:
        for name in names:
            slowable[name][1].write_text(str(seconds))

    yield set_delay
    set_delay(0, "a", "b")


def gateway(slowable, tmp_path: Path, names: tuple[str, ...], *extra: str):
    """A gateway over the named engines as decode engines (``Disabled``), unless
    ``extra`` says otherwise; the watchdog's floor at 1 s."""
    args = [
        *(a for n in names for a in ("--decode", slowable[n][0].url)),
        *("--scrape-interval", "0.2", "--stall-timeout", "1", "--stall-step-multiple", "4"),
        *(extra or ("--disaggregation-mode", "Disabled")),
    ]
    return start_gateway(args, tmp_path)


def complete(url: str, max_tokens: int = 3, timeout: float = 120) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        json={"model": "tiny", "prompt": "The harbor", "max_tokens": max_tokens},
        timeout=timeout,
    )


def burst(url: str, n: int, max_tokens: int = 3) -> list[httpx.Response]:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: complete(url, max_tokens), range(n)))


def warm(url: str) -> None:
    """A few requests at full speed: each engine's recent steps are short."""
    assert {r.status_code for r in burst(url, 4)} == {200}


def test_a_whole_fleet_slowed_down_ejects_nothing_and_serves_every_request(
    slowable, delays, tmp_path
):
    gw = gateway(slowable, tmp_path, ("a", "b"))
    try:
        warm(gw.url)
        delays(1.5, "a", "b")  # every step 1.5 s: past the 1 s floor, on both engines
        answers = burst(gw.url, 4)
        assert [r.status_code for r in answers] == [200] * 4
        assert metric(gw.url, "pdfleet_gateway_engine_ejections_total") == 0
        assert all(e["state"] == "healthy" for e in engines_view(gw.url)["engines"])
    finally:
        gw.stop()


def test_one_engine_stalled_against_its_own_pace_is_ejected_and_its_requests_move(
    slowable, delays, tmp_path
):
    # A step may run 2 s before its engine counts as wedged, however it answers.
    gw = gateway(slowable, tmp_path, ("a", "b"), "--stall-max-step", "2")
    try:
        warm(gw.url)
        delays(4, "a")  # a's steps go from milliseconds to 4 s; b keeps its pace
        answers = burst(gw.url, 6, max_tokens=8)
        # Every answer arrives: requests waiting on a are resent to b.
        assert [r.status_code for r in answers] == [200] * 6
        a_url = slowable["a"][0].url
        assert metric(gw.url, "pdfleet_gateway_engine_stalls_total", engine=a_url) >= 1
        b_url = slowable["b"][0].url
        assert metric(gw.url, "pdfleet_gateway_engine_ejections_total", engine=b_url) == 0
    finally:
        gw.stop()


def test_the_last_engine_of_a_role_stays_while_it_is_slow_and_its_requests_wait(
    slowable, delays, tmp_path
):
    # a decodes, b prefills: b answers its legs at full speed (progress) while a,
    # the only decode engine, is silent far past its own pace.
    gw = gateway(
        slowable,
        tmp_path,
        ("a",),
        *("--prefill", slowable["b"][0].url, "--disaggregation-mode", "Always"),
        # Its 2 s steps are past this bound, and past the 1 s floor whatever
        # steps it ran before: only the last-engine rule keeps it.
        *("--stall-max-step", "0.5", "--stall-step-multiple", "0"),
    )
    try:
        warm(gw.url)
        delays(2, "a")
        answers = burst(gw.url, 2, max_tokens=2)
        assert [r.status_code for r in answers] == [200, 200]
        assert metric(gw.url, "pdfleet_gateway_engine_ejections_total") == 0
        assert "last routable engine of its role" in gw.log()
    finally:
        gw.stop()


def test_load_beyond_the_engines_capacity_is_refused_with_retry_after_never_a_504(
    slowable, delays, tmp_path
):
    gw = gateway(slowable, tmp_path, ("b",), "--queue-timeout", "3", "--max-queued-requests", "2")
    try:
        delays(0.25, "b")  # a request of 6 tokens takes ~1.5 s; b runs 2 at once
        # A burst the engine queues: the gateway learns b's capacity from its queue.
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            first = [pool.submit(complete, gw.url, 6) for _ in range(6)]
            assert wait_until(
                lambda: engines_view(gw.url)["engines"][0]["capacity"] is not None, 30
            )
            # Beyond it: at most 2 wait for a slot (3 s at most), the rest are refused.
            second = [pool.submit(complete, gw.url, 6) for _ in range(10)]
            answers = [f.result(120) for f in (*first, *second)]
        statuses = [r.status_code for r in answers]
        assert set(statuses) <= {200, 429, 503}, statuses
        assert statuses.count(429) >= 1 and statuses.count(200) >= 6, statuses
        for r in answers:
            if r.status_code != 200:
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["code"] == r.status_code
        view = engines_view(gw.url)
        assert view["queued"] == 0 and view["engines"][0]["admitted"] == 0
        assert metric(gw.url, "pdfleet_gateway_engine_ejections_total") == 0
    finally:
        gw.stop()


def step_running(engine_url: str) -> float:
    """The age of the engine's step in progress, as its /metrics says."""
    return metric(engine_url, "pdfleet_engine_step_running_seconds")


def stream(url: str, max_tokens: int, first: threading.Event) -> tuple[str, list[str]]:
    """A streamed completion: (its finish reason, the error events it got);
    ``first`` is set at its first token."""
    errors: list[str] = []
    finish = ""
    body = {"model": "tiny", "prompt": "The harbor", "max_tokens": max_tokens, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(str(event["error"]))
                continue
            first.set()
            finish = event["choices"][0].get("finish_reason") or finish
    return finish, errors


def streams_on_both(slowable, gw_url: str, n: int, max_tokens: int):
    """``n`` streams started through the gateway, waited for until every one
    relays and both engines carry some: (their futures, the executor)."""
    pool = concurrent.futures.ThreadPoolExecutor(n)
    firsts = [threading.Event() for _ in range(n)]
    futures = [pool.submit(stream, gw_url, max_tokens, f) for f in firsts]
    urls = {slowable[name][0].url for name in ("a", "b")}
    assert wait_until(lambda: all(f.is_set() for f in firsts), 60)
    assert wait_until(
        lambda: {e["url"] for e in engines_view(gw_url)["engines"] if e["inflight"]} == urls, 30
    )
    return futures, pool


def test_one_long_step_of_a_healthy_engine_is_no_stall_and_its_streams_go_on(
    slowable, delays, tmp_path
):
    """Steps of 0.2 s teach the gateway a stall limit of about 1.2 s; one step
    of a then runs 6 s while b keeps stepping. a reports its step in progress
    at each check (its HTTP loop answers while the step runs): it stays, and
    the streams it relays finish without an error."""
    gw = gateway(slowable, tmp_path, ("a", "b"))
    a_url = slowable["a"][0].url
    try:
        warm(gw.url)
        delays(0.2, "a", "b")
        futures, pool = streams_on_both(slowable, gw.url, 4, max_tokens=40)
        with pool:
            delays(6, "a")  # the next step of a sleeps 6 s first
            assert wait_until(lambda: step_running(a_url) >= 1.5, 30)
            delays(0.2, "a")  # only that one step is long
            view = engines_view(gw.url)["engines"]
            assert any(e["url"] == a_url and (e["step_running_s"] or 0) > 0 for e in view)
            results = [f.result(120) for f in futures]
        assert results == [("length", [])] * 4, results
        assert metric(gw.url, "pdfleet_gateway_engine_stalls_total") == 0
        assert metric(gw.url, "pdfleet_gateway_engine_ejections_total") == 0
    finally:
        gw.stop()


def test_a_stopped_engine_is_still_ejected_though_it_was_in_a_step(slowable, delays, tmp_path):
    """SIGSTOP in the middle of a step: its last check said it was stepping,
    but no check answers any more, so its silence counts again: ejected, and
    its requests finish on the other engine."""
    gw = gateway(slowable, tmp_path, ("a", "b"))
    a_proc = slowable["a"][0]
    try:
        warm(gw.url)
        delays(0.2, "a", "b")
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = [pool.submit(complete, gw.url, 10) for _ in range(4)]
            assert wait_until(
                lambda: all(e["inflight"] for e in engines_view(gw.url)["engines"]), 30
            )
            delays(3, "a")
            assert wait_until(lambda: step_running(a_proc.url) >= 0.5, 30)
            a_proc.signal(signal.SIGSTOP)
            try:
                assert wait_until(
                    lambda: (
                        metric(gw.url, "pdfleet_gateway_engine_stalls_total", engine=a_proc.url)
                        >= 1
                    ),
                    60,
                )
                statuses = [f.result(120).status_code for f in answers]
            finally:
                a_proc.signal(signal.SIGCONT)
        assert statuses == [200] * 4
    finally:
        gw.stop()
