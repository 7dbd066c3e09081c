"""The gateway's scheduling against a simulated engine, in simulated time.

The real flow control (``FlowGate``: tickets and fair-share tags), admission
(``Admission``: slots in sequences, capacity learned from scrapes, the fair
queue) and the proxy's own route-or-wait loop (``Proxy._sole_route``,
``Proxy._route``, ``Proxy._routed``) schedule closed-loop clients against an
engine model: ``max_num_seqs`` slots, one token per running sequence per
step, a step time that grows with the batch, its own waiting queue ordered by
the gateway's priority (band, then tag), an ``n > 1`` request's sequences
held to ``max_request_share`` of the slots while other requests wait, and a
``/metrics`` scrape every ``scrape_interval`` saying how many sequences wait
and how many of them are beyond the free slots; or
(``engine={"scheduler": True}``) the engine's own scheduler stepping at the
model's pace. Time is an event loop's virtual clock: ``time.monotonic`` reads it,
and a sleep advances it, so a run is deterministic and takes no wall time
beyond the Python it executes.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pdfleet.engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from pdfleet.engine.config.gateway import GatewayConfig
from pdfleet.engine.core.sched_output import ModelRunnerOutput
from pdfleet.engine.core.scheduler import Scheduler
from pdfleet.engine.gateway.admission import Admission
from pdfleet.engine.gateway.call import Call
from pdfleet.engine.gateway.engines import EngineLoad, EngineState
from pdfleet.engine.gateway.flow.gate import FlowGate
from pdfleet.engine.gateway.flow.tenants import Tenant, TenantPolicy, Tenants
from pdfleet.engine.gateway.legs import Legs
from pdfleet.engine.gateway.metrics import GatewayMetrics
from pdfleet.engine.gateway.proxy import Proxy
from pdfleet.engine.gateway.routing import Route
from pdfleet.engine.request import Request
from pdfleet.engine.sampling_params import SamplingParams

DAY = 86400.0
# The benchmark's request (benchmarks/flow_control.py, its fair phase),
# streamed with usage in every chunk. Its prompt counts 12 tokens here,
# analyzed or not (47 characters: the gateway's estimate without a tokenizer).
BODY = {
    "model": "tiny",
    "prompt": "The harbor was quiet before dawn, and the boats",
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
}


class _Selector:
    """No I/O: waiting for the next timer is jumping to it."""

    def __init__(self, loop: SimLoop) -> None:
        self.loop = loop

    def select(self, timeout: float | None) -> list[Any]:
        if timeout is None:
            raise RuntimeError("the simulation has nothing left to wait for")
        self.loop.now += timeout
        return []

    def close(self) -> None:
        pass


class SimLoop(asyncio.BaseEventLoop):
    """An event loop on a virtual clock."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        self._selector = _Selector(self)

    def time(self) -> float:
        return self.now

    def _process_events(self, event_list: list[Any]) -> None:
        pass

    def _write_to_self(self) -> None:
        pass


@contextmanager
def simulated_time() -> Iterator[SimLoop]:
    loop = SimLoop()
    real = time.monotonic
    time.monotonic = loop.time  # type: ignore[assignment]
    try:
        yield loop
    finally:
        time.monotonic = real  # type: ignore[assignment]
        loop.close()


@dataclass(eq=False)
class _Req:
    tenant: str
    seqs: int
    priority: int
    tokens: int
    arrival: float
    done_seqs: int = 0
    produced: int = 0
    first: asyncio.Future[None] | None = None
    end: asyncio.Future[None] | None = None


@dataclass(eq=False)
class _Seq:
    req: _Req
    made: int = 0


@dataclass
class SimEngine:
    """One engine: continuous batching of sequences, a step at a time."""

    max_num_seqs: int = 64
    step_base_s: float = 0.004
    step_per_seq_s: float = 0.00015
    max_request_share: float = 0.5
    relay_s_per_read: float = 0.0
    """CPU seconds one read of a stream's events costs on the way to its
    client (one read per request per step, however many of its sequences
    stepped): 0, none; else the reads queue for one processor (the gateway's
    loop and the client's), and a request's first event and end reach the
    gateway when its read is through."""
    on_tokens: Callable[[str, int, float], None] = lambda tenant, n, now: None
    waiting: list[tuple[int, float, int, _Seq]] = field(default_factory=list)
    running: list[_Seq] = field(default_factory=list)
    waiting_for_room: int = 0
    """Sequences the last step left waiting (the engine's ``num_requests_waiting``)."""
    waiting_for_slot: int = 0
    """Of those, the ones beyond the free slots (``num_requests_waiting_for_slot``)."""
    _order: Iterator[int] = field(default_factory=itertools.count)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _reads: asyncio.Queue[tuple[_Req, int, bool]] = field(default_factory=asyncio.Queue)

    def add(self, req: _Req) -> None:
        for _ in range(req.seqs):
            heapq.heappush(self.waiting, (req.priority, req.arrival, next(self._order), _Seq(req)))
        self._wake.set()

    def _schedule(self) -> None:
        groups_waiting = {id(s.req) for *_, s in self.waiting}
        group_running: dict[int, int] = {}
        for s in self.running:
            group_running[id(s.req)] = group_running.get(id(s.req), 0) + 1
        cap = max(1, int(self.max_request_share * self.max_num_seqs))
        skipped = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            entry = heapq.heappop(self.waiting)
            s = entry[3]
            g = id(s.req)
            held = s.req.seqs > 1 and (len(groups_waiting) > 1 or g not in groups_waiting)
            if held and group_running.get(g, 0) >= cap:
                skipped.append(entry)
                continue
            self.running.append(s)
            group_running[g] = group_running.get(g, 0) + 1
        for entry in skipped:
            heapq.heappush(self.waiting, entry)
        self.waiting_for_room = len(self.waiting)
        self.waiting_for_slot = max(0, len(self.waiting) - (self.max_num_seqs - len(self.running)))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.waiting and not self.running:
                self._wake.clear()
                await self._wake.wait()
            self._schedule()
            if not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(self.step_base_s + self.step_per_seq_s * len(self.running))
            stepped: dict[int, tuple[_Req, int]] = {}
            still = []
            for s in self.running:
                s.made += 1
                r = s.req
                stepped[id(r)] = (r, stepped.get(id(r), (r, 0))[1] + 1)
                if s.made >= r.tokens:
                    r.done_seqs += 1
                else:
                    still.append(s)
            self.running = still
            self._deliver(stepped, loop.time())

    def _deliver(self, stepped: dict[int, tuple[_Req, int]], now: float) -> None:
        """Each request's tokens of a step, read now or through the relay."""
        for r, n in stepped.values():
            ended = r.done_seqs == r.seqs
            if self.relay_s_per_read:
                self._reads.put_nowait((r, n, ended))
            else:
                self._read(r, n, ended, now)

    def _read(self, r: _Req, n: int, ended: bool, now: float) -> None:
        r.produced += n
        self.on_tokens(r.tenant, n, now)
        if r.first is not None and not r.first.done():
            r.first.set_result(None)
        if ended and r.end is not None:
            r.end.set_result(None)

    async def relay(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            r, n, ended = await self._reads.get()
            await asyncio.sleep(self.relay_s_per_read)
            self._read(r, n, ended, loop.time())


class RealSchedulerEngine(SimEngine):
    """The engine's own scheduler (``engine/core/scheduler.py``, the
    ``priority`` policy, prefix caching) with a forward that samples a token
    wherever a request caught up, as ``SimEngine``'s steps take their time:
    an ``n > 1`` request is its children, the first one's prefill ahead of
    its siblings', as the engine adds them. ``max_num_batched_tokens``: the
    step's token budget."""

    def __init__(self, **kwargs: Any) -> None:
        blocks = kwargs.pop("num_blocks", 8192)
        budget = kwargs.pop("max_num_batched_tokens", 2048)
        super().__init__(**kwargs)
        config = EngineConfig(
            model_config=ModelConfig(model="m", max_model_len=512),
            cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=512,
                policy="priority",
                max_request_share=self.max_request_share,
            ),
            device_config=DeviceConfig(device="cpu"),
        )
        self.scheduler = Scheduler(config, blocks + 1)
        self._of: dict[str, _Req] = {}
        self._ids = itertools.count()

    def add(self, req: _Req) -> None:
        rid = f"r{next(self._ids)}"
        children = [f"{rid}-{i}" for i in range(req.seqs)]
        for i, cid in enumerate(children):
            self._of[cid] = req
            self.scheduler.add_request(
                Request(
                    cid,
                    list(range(100, 112)),
                    SamplingParams(max_tokens=req.tokens, ignore_eos=True),
                    arrival_time=req.arrival,
                    priority=req.priority,
                    wait_for=children[0] if i else None,
                    group_id=rid if req.seqs > 1 else None,
                )
            )
        self._wake.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        s = self.scheduler
        while True:
            if not s.has_unfinished_requests():
                self._wake.clear()
                await self._wake.wait()
            out = s.schedule()
            stats = s.stats()
            self.waiting_for_room = stats.num_waiting_reqs
            self.waiting_for_slot = stats.num_waiting_for_slot_reqs
            self.running = [None] * stats.num_running_reqs  # type: ignore[list-item]
            if not out.num_scheduled_tokens:
                self._wake.clear()
                await self._wake.wait()
                continue
            seqs = len(out.num_scheduled_tokens)
            await asyncio.sleep(self.step_base_s + self.step_per_seq_s * seqs)
            sampled = {
                rid: 1
                for rid in out.num_scheduled_tokens
                if rid in s.requests
                and s.requests[rid].num_computed_tokens == s.requests[rid].num_tokens
            }
            s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
            stepped: dict[int, tuple[_Req, int]] = {}
            for rid in sampled:
                r = self._of[rid]
                stepped[id(r)] = (r, stepped.get(id(r), (r, 0))[1] + 1)
                if rid not in s.requests:  # it finished
                    del self._of[rid]
                    r.done_seqs += 1
            self._deliver(stepped, loop.time())


@dataclass
class Client:
    """A closed loop: ``workers`` streamed requests in flight, each of ``n``
    sequences."""

    key: str
    n: int
    workers: int
    think_s: float = 0.002
    """Between a request's end and the worker's next request (jittered)."""
    max_tokens: int | None = None
    """Each sequence's output tokens (None: the run's ``max_tokens``)."""
    priority: int = 0
    """The key's band (a lower value is served first)."""
    weight: float = 1.0


@dataclass
class SimResult:
    admitted: dict[str, float]
    """Cost each key had admitted (flow control's count)."""
    routed: dict[str, float]
    """Cost of each key's requests that took their slots before the run's end
    (what they ask of the engine: prompt + n × max_tokens)."""
    output: dict[str, float]
    """Output tokens each key received after the warm-up, before the end."""
    output_all: dict[str, float]
    """Output tokens each key received from the start to the end (the engine's
    work in ``seconds``)."""
    events: list[tuple[Any, ...]]
    """With ``trace``: ("tag", t, key, tag, clock), ("route", t, key, tag,
    clock, queued by tenant, slots taken, capacity), ("scrape", t, waiting,
    slots taken, capacity)."""


def run(
    clients: list[Client],
    seconds: float = 30.0,
    warmup_s: float = 5.0,
    max_tokens: int = 64,
    prompt_tokens: int = 12,
    capacity: int | None = None,
    latency_s: float = 0.001,
    seed: int = 0,
    trace: bool = False,
    engine: dict[str, Any] | None = None,
) -> SimResult:
    """Run the clients against one engine through the gateway's scheduling for
    ``seconds`` of simulated time (their last requests run to their end).
    ``capacity``: the engine's capacity the gateway starts with (None: it never
    saw the engine queue); ``latency_s``: the mean of each hop between the
    gateway and the engine (the request, its first event, its end)."""
    with simulated_time() as loop:
        sim = _Sim(loop, clients, seconds, warmup_s, max_tokens, prompt_tokens, seed, trace)
        sim.e.capacity = capacity
        sim.latency_s = latency_s
        args = dict(engine or {})
        kind = RealSchedulerEngine if args.pop("scheduler", False) else SimEngine
        sim.engine = kind(on_tokens=sim.tokens, **args)
        return loop.run_until_complete(sim.run())


class _Pool:
    def __init__(self, e: EngineState) -> None:
        self.e = e
        self.engines = {e.url: e}

    def candidates(self, role: str) -> list[EngineState]:
        return [self.e]

    def sole_candidate(self, role: str) -> EngineState:
        return self.e


class _Router:
    def __init__(self, e: EngineState) -> None:
        self.e = e

    def route(self, info: Any, full: Any, prefill_full: Any) -> Route:
        return Route(self.e, None, "decode_only", "disabled")

    def count_pick(self) -> None:
        pass


class _Sim:
    """The gateway's parts a request goes through before its engine answers,
    with the proxy's own methods for its route (``self`` stands in for the
    proxy: it holds what they read)."""

    def __init__(
        self,
        loop: SimLoop,
        clients: list[Client],
        seconds: float,
        warmup_s: float,
        max_tokens: int,
        prompt_tokens: int,
        seed: int,
        trace: bool,
    ) -> None:
        self.loop = loop
        self.clients = clients
        self.max_tokens, self.prompt_tokens = max_tokens, prompt_tokens
        self.rng = random.Random(seed)
        self.trace = trace
        self.latency_s = 0.001
        self.config = GatewayConfig(
            decode=["http://sim"],
            disaggregation_mode="Disabled",
            engine_priority=True,
            queue_timeout=DAY,
        )
        metrics = GatewayMetrics()
        self.admission = Admission(self.config, metrics)
        # Each key its own tenant, as a tenants file names them (so the best of
        # several bands may overflow a little, as configured bands do).
        tenants = Tenants()
        for c in clients:
            tenant = Tenant(c.key, TenantPolicy(weight=c.weight, priority=c.priority))
            tenants.by_caller[f"key:{c.key}"] = tenants.named[c.key] = tenant
        self.flow = FlowGate(self.config, tenants, self.admission, metrics)
        self.e = EngineState("http://sim", "decode", state="healthy")
        self.pool = _Pool(self.e)
        self.router = _Router(self.e)
        self.legs = Legs(
            self.config, self.pool, None, None, None, metrics, None, None, self.admission
        )  # type: ignore[arg-type]
        self.engine = SimEngine()
        self.t0 = t0 = loop.time()
        self.start, self.end = t0 + warmup_s, t0 + seconds
        self.result = SimResult({}, {}, {}, {}, [])

    # What Proxy._route and Proxy._sole_route call on the proxy.
    _need = staticmethod(Proxy._need)

    def _routed(self, call: Call, info: Any) -> Route | None:
        return Proxy._routed(self, call, info)  # type: ignore[arg-type]

    def _overloaded(self, call: Call, o: Any) -> Any:
        raise AssertionError(f"refused: {o.message}")

    def tokens(self, key: str, n: int, now: float) -> None:
        out = self.result
        if now < self.end:
            out.output_all[key] = out.output_all.get(key, 0) + n
            if self.start <= now:
                out.output[key] = out.output.get(key, 0) + n

    def _hop(self) -> float:
        return self.latency_s * (0.5 + self.rng.random())

    async def request(self, c: Client) -> None:
        loop, admission, e, out = self.loop, self.admission, self.e, self.result
        max_tokens = self.max_tokens if c.max_tokens is None else c.max_tokens
        body: dict[str, Any] = {**BODY, "max_tokens": max_tokens}
        if c.n > 1:
            body["n"] = c.n
        raw = json.dumps(body).encode()
        # As Proxy._check: the sole route when nothing waits and a slot is free
        # (the prompt is then not analyzed), admission, and no sole route for a
        # request wider than the room; then Proxy._route (or the wait for one).
        route = Proxy._sole_route(self)  # type: ignore[arg-type]
        tokens = None if route is not None else self.prompt_tokens
        tenant = self.flow.tenant(f"key:{c.key}")
        admitted = self.flow.admit(tenant, body, tokens, len(raw))
        ticket = admitted.ticket
        out.admitted[c.key] = out.admitted.get(c.key, 0) + ticket.cost
        clock = self.flow.control.clocks[ticket.band]
        if self.trace:
            out.events.append(("tag", loop.time(), c.key, ticket.tag, clock.clock))
        call = Call("/v1/completions", c.key, 0.0, {}, False, body=body)
        call.ticket, call.seqs = ticket, admitted.seqs
        wide = e.capacity is not None and not admission.has_room(e, call.seqs, ticket.band)
        if route is not None and wide:
            route = None
        if route is None:
            await Proxy._route(self, call, None)  # type: ignore[arg-type]
        self.legs.take_slot(call, e)
        if loop.time() < self.end:
            cost = self.prompt_tokens + call.seqs * max_tokens
            out.routed[c.key] = out.routed.get(c.key, 0) + cost
        if self.trace:
            queued = dict(admission.queued_by_tenant())
            out.events.append(
                (
                    "route",
                    loop.time(),
                    c.key,
                    ticket.tag,
                    clock.clock,
                    queued,
                    e.admitted,
                    e.capacity,
                )
            )
        r = _Req(c.key, call.seqs, body["priority"], max_tokens, loop.time())
        r.first, r.end = loop.create_future(), loop.create_future()
        await asyncio.sleep(self._hop())
        self.engine.add(r)
        await r.first
        await asyncio.sleep(self._hop())
        self.legs.first_token(call)
        await r.end
        await asyncio.sleep(self._hop())
        self.legs.finish(call, 200)

    async def worker(self, c: Client) -> None:
        await asyncio.sleep(self.rng.random() * 0.01)
        while self.loop.time() < self.end:
            await self.request(c)
            await asyncio.sleep(c.think_s * (0.5 + self.rng.random()))

    async def scrape(self) -> None:
        """The engine's /metrics as the gateway reads them: sequences waiting."""
        old = EngineLoad()
        await asyncio.sleep(self.rng.random() * self.config.scrape_interval)
        while True:
            engine = self.engine
            new = EngineLoad(
                waiting=float(engine.waiting_for_room),
                waiting_for_slot=float(engine.waiting_for_slot),
                running=len(engine.running),
            )
            self.admission.scraped(self.e, old, new)
            if self.trace:
                self.result.events.append(
                    ("scrape", self.loop.time(), new.waiting, self.e.admitted, self.e.capacity)
                )
            old = new
            await asyncio.sleep(self.config.scrape_interval)

    async def run(self) -> SimResult:
        engine = self.loop.create_task(self.engine.run())
        relay = self.loop.create_task(self.engine.relay())
        scrapes = self.loop.create_task(self.scrape())
        await asyncio.gather(*(self.worker(c) for c in self.clients for _ in range(c.workers)))
        engine.cancel()
        relay.cancel()
        scrapes.cancel()
        return self.result
