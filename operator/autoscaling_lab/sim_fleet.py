"""The simulated prefill/decode fleet: replicas, routing, actuation, events.

A :class:`Simulation` runs one strategy over one trace. Every period it takes
a snapshot of each replica's engine metrics (the same
:class:`~.samples.EngineSnapshot` the Prometheus parser produces), turns them
into samples with :func:`~.samples.sample_from_snapshots`, asks the strategy
for desired replicas and applies them as an actuator would: new replicas serve
after a cold start; scale-down drains (a victim chosen by
:func:`~.victims.choose_victims` receives no new work and leaves when empty).

The model, per replica:

* prefill -- first come first served: a fixed overhead per request plus the
  prompt at ``prefill_tokens_per_second`` plus attention's quadratic term; the gateway routes each request to the ready
  prefill replica with the fewest outstanding prompt tokens.
* KV transfer -- ``transfer_seconds_per_token`` times the prompt length.
* decode -- continuous batching: every running request gets one token per
  step; a step takes ``a + b * batch + c * context_tokens`` seconds. A request
  is admitted when its whole length (prompt + output) fits the remaining KV
  capacity and the batch is below ``max_num_seqs`` (no preemption is
  modelled); otherwise it waits on the replica the gateway chose (the one
  with the least KV reserved).

TTFT is arrival to the first decode step's end; ITL is a request's mean gap
between output tokens. Replica-seconds count from the moment a replica is
requested (its cold start costs) to the moment it stops, within the trace.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
import time as wallclock
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...engine.reports.stats import percentile
from ..autoscaling.policy import FleetObservation, RoleObservation
from ..autoscaling.samples import (
    EngineSnapshot,
    ReplicaSample,
    ReplicaState,
    sample_from_snapshots,
)
from ..autoscaling.spec import AutoscalingSpec
from ..autoscaling.victims import ReplicaLoad, choose_victims
from .traces import Trace

DRAIN_LIMIT_SECONDS = 900.0


@dataclass(frozen=True)
class FleetModel:
    """Per-replica performance, cold start and SLOs of the simulated fleet."""

    prefill_tokens_per_second: float = 12000.0
    """Prompt tokens one prefill replica computes per second."""
    prefill_overhead_seconds: float = 0.015
    """Fixed cost per prefill request (scheduling, sampling, KV registration)."""
    prefill_seconds_per_token_squared: float = 0.0
    """Attention's share of prefill time, which grows with the square of the
    prompt (causal self-attention over T tokens costs about
    2 x layers x T^2 x hidden FLOPs): seconds per token squared. 0 for a
    prompt cost linear in its length."""
    decode_step_seconds: float = 0.010
    """Decode step time with an empty batch (the ``a`` of ``a + b*batch + c*ctx``)."""
    decode_step_seconds_per_seq: float = 6e-5
    """Added step time per running request (``b``)."""
    decode_step_seconds_per_token: float = 2e-8
    """Added step time per context token in the batch (``c``)."""
    kv_capacity_tokens: int = 200_000
    """KV-cache capacity of one decode replica, in tokens."""
    max_num_seqs: int = 256
    """Most requests one decode replica runs at once."""
    transfer_seconds_per_token: float = 4e-6
    """KV transfer time per prompt token (prefill to decode)."""
    cold_start_seconds: float = 60.0
    """Seconds from requesting a replica to its serving."""
    ttft_slo_seconds: float = 2.0
    """Time-to-first-token objective a request must meet to count as served well."""
    itl_slo_seconds: float = 0.05
    """Inter-token latency objective (mean over a request's output)."""
    scrape_failure_rate: float = 0.0
    """Probability that one replica's scrape fails in a period (its sample
    then ages, and turns stale after ``metricsStaleSeconds``)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "scrape_failure_rate":
                if not 0 <= value < 1:
                    raise ValueError(f"scrape failure rate must be in [0, 1), got {value}")
            elif (
                f.name in ("cold_start_seconds", "transfer_seconds_per_token")
                or f.name.startswith("decode_step_seconds_per")
                or f.name in ("prefill_overhead_seconds", "prefill_seconds_per_token_squared")
            ):
                if value < 0:
                    raise ValueError(f"{f.name} must be >= 0, got {value}")
            elif value <= 0:
                raise ValueError(f"{f.name} must be > 0, got {value}")

    def prefill_seconds(self, prompt_tokens: float) -> float:
        """Seconds one prefill replica computes a prompt of this length."""
        return (
            self.prefill_overhead_seconds
            + prompt_tokens / self.prefill_tokens_per_second
            + self.prefill_seconds_per_token_squared * prompt_tokens * prompt_tokens
        )

    def step_seconds(self, batch: float, context_tokens: float) -> float:
        return (
            self.decode_step_seconds
            + self.decode_step_seconds_per_seq * batch
            + self.decode_step_seconds_per_token * context_tokens
        )


# ---------------------------------------------------------------------------
# replicas

STARTING, READY, DRAINING, STOPPED = "starting", "ready", "draining", "stopped"
_TICK, _READY, _PREFILL_DONE, _DECODE_ARRIVE, _DECODE_STEP = range(5)


class _Request:
    __slots__ = ("arrival", "decode_in", "done", "first", "index", "output", "prompt", "start_step")

    def __init__(self, index: int, arrival: float, prompt: int, output: int) -> None:
        self.index = index
        self.arrival = arrival
        self.prompt = prompt
        self.output = output
        self.decode_in = 0.0
        self.first = -1.0
        self.done = -1.0
        self.start_step = 0.0


class _Replica(ABC):
    __slots__ = ("created", "name", "prev_snap", "role", "snap", "state", "stopped")

    def __init__(self, role: str, name: str, created: float, state: str) -> None:
        self.role = role
        self.name = name
        self.created = created
        self.state = state
        self.stopped = -1.0
        self.snap: EngineSnapshot | None = None
        self.prev_snap: EngineSnapshot | None = None

    @abstractmethod
    def load(self) -> float:
        """Tokens queued or being served (what the router balances on)."""

    @abstractmethod
    def in_flight(self) -> int:
        """Requests queued or running."""


class _Prefill(_Replica):
    __slots__ = (
        "busy_done",
        "queue",
        "queued_tokens",
        "serve_end",
        "serve_start",
        "serving",
        "tokens_done",
        "ttft_count",
        "ttft_sum",
    )

    def __init__(self, name: str, created: float, state: str) -> None:
        super().__init__("prefill", name, created, state)
        self.queue: deque[_Request] = deque()
        self.queued_tokens = 0
        self.serving: _Request | None = None
        self.serve_start = self.serve_end = 0.0
        self.tokens_done = 0.0
        self.busy_done = 0.0
        self.ttft_sum = 0.0
        self.ttft_count = 0

    def load(self) -> float:
        return self.queued_tokens + (self.serving.prompt if self.serving else 0)

    def in_flight(self) -> int:
        return len(self.queue) + (1 if self.serving else 0)

    def snapshot(self, now: float) -> EngineSnapshot:
        tokens, busy, remaining = self.tokens_done, self.busy_done, 0.0
        if self.serving is not None:
            span = self.serve_end - self.serve_start
            frac = (now - self.serve_start) / span if span > 0 else 1.0
            tokens += self.serving.prompt * frac
            busy += now - self.serve_start
            remaining = self.serving.prompt * (1 - frac)
        return EngineSnapshot(
            time=now,
            num_running=1.0 if self.serving else 0.0,
            num_waiting=float(len(self.queue)),
            kv_cache_usage=0.0,
            waiting_prompt_tokens=self.queued_tokens + remaining,
            prompt_tokens_total=tokens,
            prefill_busy_seconds_total=busy,
            ttft_sum=self.ttft_sum,
            ttft_count=float(self.ttft_count),
        )


class _Decode(_Replica):
    __slots__ = (
        "finish",
        "itl_count",
        "itl_sum",
        "n",
        "prompt_sum",
        "reserved",
        "start_sum",
        "step_time",
        "steps",
        "ttft_count",
        "ttft_sum",
        "updated",
        "version",
        "waiting",
        "waiting_prompt",
        "waiting_tokens",
    )

    def __init__(self, name: str, created: float, state: str) -> None:
        super().__init__("decode", name, created, state)
        self.steps = 0.0  # steps run since the replica started (a float clock)
        self.updated = created
        self.step_time = 0.0
        self.finish: list[tuple[float, int, _Request]] = []  # (finish step, index, request)
        self.n = 0
        self.prompt_sum = 0
        self.start_sum = 0.0
        self.reserved = 0  # prompt + output tokens of running requests
        self.waiting: deque[_Request] = deque()
        self.waiting_prompt = 0
        self.waiting_tokens = 0
        self.version = 0
        self.ttft_sum = self.itl_sum = self.itl_count = 0.0
        self.ttft_count = 0

    def context(self) -> float:
        """KV tokens in use: prompts plus tokens generated so far."""
        return self.prompt_sum + self.n * self.steps - self.start_sum

    def advance(self, now: float) -> None:
        """Run the batch's steps up to ``now``: each running request got a
        token every step, and each gap is one inter-token latency (the
        engine's ITL histogram observes them as they happen)."""
        if self.n and self.step_time > 0:
            elapsed = now - self.updated
            steps = elapsed / self.step_time
            self.steps += steps
            self.itl_sum += self.n * elapsed
            self.itl_count += self.n * steps
        self.updated = now

    def load(self) -> float:
        return self.reserved + self.waiting_tokens

    def in_flight(self) -> int:
        return self.n + len(self.waiting)

    def snapshot(self, now: float, capacity: int) -> EngineSnapshot:
        return EngineSnapshot(
            time=now,
            num_running=float(self.n),
            num_waiting=float(len(self.waiting)),
            kv_cache_usage=self.context() / capacity,
            waiting_prompt_tokens=float(self.waiting_prompt),
            ttft_sum=self.ttft_sum,
            ttft_count=float(self.ttft_count),
            itl_sum=self.itl_sum,
            itl_count=float(self.itl_count),
        )


class _Router:
    """Least-loaded choice among routable replicas in O(log n) (a lazy heap)."""

    def __init__(self) -> None:
        self.load: dict[_Replica, float] = {}
        self.heap: list[tuple[float, int, _Replica]] = []
        self.seq = 0

    def set(self, replica: _Replica, load: float) -> None:
        if replica not in self.load:
            return
        self.load[replica] = load
        self.seq += 1
        heapq.heappush(self.heap, (load, self.seq, replica))
        if len(self.heap) > 4 * len(self.load) + 64:
            self.heap = [(v, i, r) for i, (r, v) in enumerate(self.load.items())]
            heapq.heapify(self.heap)

    def add(self, replica: _Replica, load: float) -> None:
        self.load[replica] = load
        self.set(replica, load)

    def remove(self, replica: _Replica) -> None:
        self.load.pop(replica, None)

    def pick(self) -> _Replica | None:
        heap, load = self.heap, self.load
        while heap:
            value, _, replica = heap[0]
            if load.get(replica) == value:
                return replica
            heapq.heappop(heap)
        return None


class Strategy(Protocol):
    """Decides desired replicas each period from what the fleet's metrics show."""

    name: str

    def decide(self, now: float, observation: FleetObservation) -> tuple[int, int]:
        """Desired (prefill, decode) replicas."""
        ...


# ---------------------------------------------------------------------------
# the simulation


@dataclass
class SimResult:
    strategy: str
    requests: int
    completed: int
    ttft_attainment: float
    itl_attainment: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    replica_seconds: dict[str, float]
    mean_replicas: dict[str, float]
    peak_replicas: dict[str, int]
    scale_events: dict[str, int]
    """Periods in which a role's replica count changed."""
    replicas_started: dict[str, int]
    replicas_stopped: dict[str, int]
    wall_seconds: float
    timeline: list[tuple[float, int, int, float]] = field(default_factory=list)
    """(time, prefill replicas, decode replicas, arrivals per second) per period."""
    decision_codes: dict[str, int] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    scale_log: list[tuple[float, str, int, int]] = field(default_factory=list)
    """(time, role, replicas before, replicas after) of every scale event."""
    ttft_series: list[tuple[float, float]] = field(default_factory=list)
    """(period start, TTFT p99 of the requests arriving in that period)."""

    def to_dict(self, timeline: bool = False) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if not timeline:
            out.pop("timeline")
            out.pop("scale_log")
            out.pop("ttft_series")
        out.pop("reasons")
        return out

    def oscillations(self, window: float) -> dict[str, int]:
        """Per role, scale-ups undone by a scale-down (or the reverse) less than
        ``window`` seconds later: the count went back the way it came."""
        out = {"prefill": 0, "decode": 0}
        last: dict[str, tuple[float, int]] = {}
        for t, role, before, after in self.scale_log:
            sign = 1 if after > before else -1
            prev = last.get(role)
            if prev is not None and prev[1] != sign and t - prev[0] < window:
                out[role] += 1
            last[role] = (t, sign)
        return {**out, "total": out["prefill"] + out["decode"]}


def _percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100); 0 when nothing was served."""
    return percentile(sorted(values), p) if values else 0.0


class Simulation:
    """One run of one strategy over one trace."""

    def __init__(
        self,
        trace: Trace,
        model: FleetModel,
        spec: AutoscalingSpec,
        strategy: Strategy,
        initial: tuple[int, int],
        seed: int = 0,
    ) -> None:
        self.trace, self.model, self.spec, self.strategy = trace, model, spec, strategy
        # The hot paths read these as plain attributes.
        self._kv_capacity, self._max_seqs = model.kv_capacity_tokens, model.max_num_seqs
        self._step_a = model.decode_step_seconds
        self._step_b = model.decode_step_seconds_per_seq
        self._step_c = model.decode_step_seconds_per_token
        self.rng = random.Random(seed + 7919)
        self.events: list[tuple[float, int, int, Any, int]] = []
        self.seq = 0
        self.replicas: dict[str, list[_Replica]] = {"prefill": [], "decode": []}
        self.retired: list[_Replica] = []
        self.routers = {"prefill": _Router(), "decode": _Router()}
        self.pending: dict[str, deque[_Request]] = {"prefill": deque(), "decode": deque()}
        self.counter = 0
        self.scale_events = {"prefill": 0, "decode": 0}
        self.started = {"prefill": 0, "decode": 0}
        self.stopped = {"prefill": 0, "decode": 0}
        self.timeline: list[tuple[float, int, int, float]] = []
        self.scale_log: list[tuple[float, str, int, int]] = []
        self.requests: list[_Request] = []
        self.arrivals_since_tick = 0
        for role, count in zip(("prefill", "decode"), initial, strict=True):
            for _ in range(count):
                self._new_replica(role, 0.0, ready=True)

    # -- plumbing ----------------------------------------------------------

    def _push(self, t: float, kind: int, obj: Any, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, obj, version))

    def _new_replica(self, role: str, now: float, ready: bool) -> _Replica:
        self.counter += 1
        cls = _Prefill if role == "prefill" else _Decode
        replica = cls(f"{role}-{self.counter}", now, READY if ready else STARTING)
        self.replicas[role].append(replica)
        if ready:
            self.routers[role].add(replica, 0.0)
        else:
            self._push(now + self.model.cold_start_seconds, _READY, replica)
        return replica

    def _stop(self, replica: _Replica, now: float) -> None:
        replica.state = STOPPED
        replica.stopped = now
        self.routers[replica.role].remove(replica)
        self.replicas[replica.role].remove(replica)
        self.retired.append(replica)
        self.stopped[replica.role] += 1

    # -- prefill -----------------------------------------------------------

    def _route_prefill(self, req: _Request, now: float) -> None:
        router = self.routers["prefill"]
        replica = router.pick()
        if replica is None:
            self.pending["prefill"].append(req)
            return
        if not isinstance(replica, _Prefill):
            raise TypeError("broken invariant: isinstance(replica, _Prefill)")
        replica.queue.append(req)
        replica.queued_tokens += req.prompt
        router.set(replica, replica.load())
        if replica.serving is None:
            self._start_prefill(replica, now)

    def _start_prefill(self, replica: _Prefill, now: float) -> None:
        req = replica.queue.popleft()
        replica.queued_tokens -= req.prompt
        replica.serving = req
        replica.serve_start = now
        replica.serve_end = now + self.model.prefill_seconds(req.prompt)
        self._push(replica.serve_end, _PREFILL_DONE, replica)

    def _prefill_done(self, replica: _Prefill, now: float) -> None:
        req = replica.serving
        if req is None:
            raise RuntimeError("broken invariant: req is not None")
        replica.serving = None
        replica.tokens_done += req.prompt
        replica.busy_done += now - replica.serve_start
        replica.ttft_sum += now - req.arrival
        replica.ttft_count += 1
        self._push(now + req.prompt * self.model.transfer_seconds_per_token, _DECODE_ARRIVE, req)
        if replica.queue:
            self._start_prefill(replica, now)
        if replica.state == READY:
            self.routers["prefill"].set(replica, replica.load())
        elif replica.state == DRAINING and replica.serving is None:
            self._stop(replica, now)

    # -- decode ------------------------------------------------------------

    def _route_decode(self, req: _Request, now: float) -> None:
        replica = self.routers["decode"].pick()
        if replica is None:
            self.pending["decode"].append(req)
            return
        if not isinstance(replica, _Decode):
            raise TypeError("broken invariant: isinstance(replica, _Decode)")
        req.decode_in = now
        replica.advance(now)
        replica.waiting.append(req)
        replica.waiting_prompt += req.prompt
        replica.waiting_tokens += req.prompt + req.output
        self._admit(replica, now)

    def _admit(self, replica: _Decode, now: float) -> None:
        """Admit waiting requests that fit, then reschedule (``advance`` done)."""
        waiting = replica.waiting
        admitted: list[_Request] | None = None
        if waiting:
            capacity, max_seqs = self._kv_capacity, self._max_seqs
            finish = replica.finish
            steps = replica.steps
            while waiting and replica.n < max_seqs:
                req = waiting[0]
                size = req.prompt + req.output
                if replica.reserved + size > capacity:
                    break
                waiting.popleft()
                replica.waiting_prompt -= req.prompt
                replica.waiting_tokens -= size
                replica.reserved += size
                replica.n += 1
                replica.prompt_sum += req.prompt
                replica.start_sum += steps
                req.start_step = steps
                heapq.heappush(finish, (steps + req.output, req.index, req))
                if admitted is None:
                    admitted = [req]
                else:
                    admitted.append(req)
        self._reschedule(replica, now)
        if admitted:
            first = now + replica.step_time
            for req in admitted:
                req.first = first
                replica.ttft_sum += first - req.decode_in
            replica.ttft_count += len(admitted)
        if replica.state == READY:
            self.routers["decode"].set(replica, replica.reserved + replica.waiting_tokens)

    def _reschedule(self, replica: _Decode, now: float) -> None:
        n = replica.n
        context = replica.prompt_sum + n * replica.steps - replica.start_sum
        step = self._step_a + self._step_b * n + self._step_c * context
        replica.step_time = step
        replica.version += 1
        finish = replica.finish
        if finish:
            steps_left = finish[0][0] - replica.steps
            if steps_left < 0.0:
                steps_left = 0.0
            self.seq += 1
            heapq.heappush(
                self.events,
                (now + steps_left * step, self.seq, _DECODE_STEP, replica, replica.version),
            )

    def _decode_step(self, replica: _Decode, version: int, now: float) -> None:
        if version != replica.version:
            return
        replica.advance(now)
        finish = replica.finish
        edge = replica.steps + 1e-6
        while finish and finish[0][0] <= edge:
            _, _, req = heapq.heappop(finish)
            req.done = now
            replica.n -= 1
            replica.prompt_sum -= req.prompt
            replica.start_sum -= req.start_step
            replica.reserved -= req.prompt + req.output
        if not replica.n:
            # Exact zero: floating sums would otherwise drift across requests.
            replica.start_sum = 0.0
            replica.prompt_sum = 0
        self._admit(replica, now)
        if replica.state == DRAINING and not replica.n and not replica.waiting:
            self._stop(replica, now)

    # -- control loop ------------------------------------------------------

    def _observe(self, now: float) -> FleetObservation:
        roles = {}
        fail = self.model.scrape_failure_rate
        capacity = self.model.kv_capacity_tokens
        for role, replicas in self.replicas.items():
            samples = []
            for r in replicas:
                if r.state == STARTING:
                    samples.append(ReplicaSample(name=r.name, state="starting"))
                    continue
                if isinstance(r, _Decode):
                    r.advance(now)
                    self._reschedule(r, now)  # the context grew: refresh the step time
                if not fail or self.rng.random() >= fail:
                    if not isinstance(r, (_Decode, _Prefill)):
                        raise TypeError("broken invariant: isinstance(r, (_Decode, _Prefill))")
                    snap = r.snapshot(now, capacity) if isinstance(r, _Decode) else r.snapshot(now)
                    r.prev_snap, r.snap = r.snap, snap
                state: ReplicaState = "ready" if r.state == READY else "draining"
                # Every replica took one cold start to become ready, the
                # initial ones too (they were deployed before the trace), and
                # reports it as a platform would (a Pod's Ready transition).
                samples.append(
                    sample_from_snapshots(
                        r.name, r.snap, r.prev_snap, state, self.model.cold_start_seconds
                    )
                )
            roles[role] = RoleObservation(replicas=tuple(samples))
        return FleetObservation(prefill=roles["prefill"], decode=roles["decode"])

    def _actuate(self, role: str, desired: int, now: float) -> None:
        live = [r for r in self.replicas[role] if r.state in (STARTING, READY)]
        current = len(live)
        if desired == current:
            return
        self.scale_events[role] += 1
        self.scale_log.append((now, role, current, desired))
        if desired > current:
            for _ in range(desired - current):
                self._new_replica(role, now, ready=False)
                self.started[role] += 1
            return
        loads = [
            ReplicaLoad(
                name=r.name,
                ready=r.state == READY,
                in_flight=r.in_flight(),
                kv_cache_usage=r.context() / self.model.kv_capacity_tokens
                if isinstance(r, _Decode)
                else 0.0,
                waiting_prompt_tokens=r.load(),
            )
            for r in live
        ]
        victims = set(choose_victims(loads, current - desired))
        for r in live:
            if r.name not in victims:
                continue
            if r.state == STARTING or not r.in_flight():
                self._stop(r, now)
            else:
                r.state = DRAINING
                self.routers[role].remove(r)

    def _tick(self, now: float) -> None:
        observation = self._observe(now)
        prefill, decode = self.strategy.decide(now, observation)
        self._actuate("prefill", prefill, now)
        self._actuate("decode", decode, now)
        live = {
            role: sum(1 for r in rs if r.state in (STARTING, READY))
            for role, rs in self.replicas.items()
        }
        rate = self.arrivals_since_tick / self.spec.period_seconds
        self.arrivals_since_tick = 0
        self.timeline.append((now, live["prefill"], live["decode"], rate))

    def _ready(self, replica: _Replica, now: float) -> None:
        if replica.state != STARTING:
            return  # cancelled while starting
        replica.state = READY
        if isinstance(replica, _Decode):
            replica.updated = now
        # Its engine's counters start at zero when it starts serving: the
        # first scrape after this has rates over the time since (as the
        # control loop measures a replica it saw starting); a millisecond
        # before, so that a scrape at this very instant has an interval too.
        replica.snap = EngineSnapshot(
            time=now - 1e-3,
            num_running=0.0,
            num_waiting=0.0,
            kv_cache_usage=0.0,
            waiting_prompt_tokens=0.0,
            prompt_tokens_total=0.0,
            prefill_busy_seconds_total=0.0,
            ttft_sum=0.0,
            ttft_count=0.0,
            itl_sum=0.0,
            itl_count=0.0,
        )
        self.routers[replica.role].add(replica, 0.0)
        pending = self.pending[replica.role]
        route = self._route_prefill if replica.role == "prefill" else self._route_decode
        while pending:
            route(pending.popleft(), now)

    def run(self) -> SimResult:
        started = wallclock.perf_counter()
        trace = self.trace
        duration = trace.config.duration_seconds
        period = self.spec.period_seconds
        arrivals, prompts, outputs = trace.arrivals, trace.prompt_tokens, trace.output_tokens
        total = len(arrivals)
        self.requests = requests = [
            _Request(i, arrivals[i], prompts[i], outputs[i]) for i in range(total)
        ]
        events = self.events
        # The first decision comes one period in, as after a real start: a
        # sample at time 0 would see an empty fleet.
        self._push(period, _TICK, None)
        nxt = 0
        done_limit = duration + DRAIN_LIMIT_SECONDS
        now = 0.0
        while True:
            next_arrival = arrivals[nxt] if nxt < total else math.inf
            if events and events[0][0] <= next_arrival:
                now, _, kind, obj, version = heapq.heappop(events)
                if now > done_limit:
                    break
                if kind == _DECODE_STEP:
                    self._decode_step(obj, version, now)
                elif kind == _PREFILL_DONE:
                    self._prefill_done(obj, now)
                elif kind == _DECODE_ARRIVE:
                    self._route_decode(obj, now)
                elif kind == _READY:
                    self._ready(obj, now)
                else:
                    if now >= duration and self._idle():
                        break
                    self._tick(now)
                    self._push(now + period, _TICK, None)
            elif nxt < total:
                now = next_arrival
                self._route_prefill(requests[nxt], now)
                self.arrivals_since_tick += 1
                nxt += 1
            else:
                break
        return self._result(duration, wallclock.perf_counter() - started)

    def _idle(self) -> bool:
        busy = any(r.in_flight() for rs in self.replicas.values() for r in rs)
        return not busy and not any(self.pending.values())

    def _result(self, duration: float, wall: float) -> SimResult:
        model = self.model
        ttfts, itls = [], []
        ttft_ok = itl_ok = completed = 0
        for req in self.requests:
            if req.first >= 0:
                ttft = req.first - req.arrival
                ttfts.append(ttft)
                ttft_ok += ttft <= model.ttft_slo_seconds
            if req.done >= 0:
                completed += 1
                itl = (req.done - req.first) / (req.output - 1) if req.output > 1 else 0.0
                itls.append(itl)
                itl_ok += itl <= model.itl_slo_seconds
        n = max(len(self.requests), 1)
        period = self.spec.period_seconds
        by_period: dict[int, list[float]] = {}
        for req in self.requests:
            if req.first >= 0 and req.arrival < duration:
                by_period.setdefault(int(req.arrival // period), []).append(req.first - req.arrival)
        ttft_series = [(b * period, _percentile(v, 99)) for b, v in sorted(by_period.items())]
        seconds = {"prefill": 0.0, "decode": 0.0}
        for r in [*self.retired, *self.replicas["prefill"], *self.replicas["decode"]]:
            end = r.stopped if r.stopped >= 0 else duration
            seconds[r.role] += max(0.0, min(end, duration) - min(r.created, duration))
        seconds_total = {**seconds, "total": seconds["prefill"] + seconds["decode"]}
        peak = {
            "prefill": max((p for _, p, _, _ in self.timeline), default=0),
            "decode": max((d for _, _, d, _ in self.timeline), default=0),
        }
        strategy = self.strategy
        return SimResult(
            strategy=strategy.name,
            requests=len(self.requests),
            completed=completed,
            ttft_attainment=ttft_ok / n,
            itl_attainment=itl_ok / n,
            ttft_p50=_percentile(ttfts, 50),
            ttft_p99=_percentile(ttfts, 99),
            itl_p50=_percentile(itls, 50),
            itl_p99=_percentile(itls, 99),
            replica_seconds=seconds_total,
            mean_replicas={k: v / duration for k, v in seconds_total.items()},
            peak_replicas=peak,
            scale_events={**self.scale_events, "total": sum(self.scale_events.values())},
            replicas_started=dict(self.started),
            replicas_stopped=dict(self.stopped),
            wall_seconds=wall,
            timeline=[t for t in self.timeline if t[0] <= duration],
            decision_codes=dict(getattr(strategy, "codes", {})),
            reasons=list(getattr(strategy, "reasons", [])),
            scale_log=[e for e in self.scale_log if e[0] <= duration],
            ttft_series=ttft_series,
        )
