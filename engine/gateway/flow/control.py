"""Admission by tenant: limits checked before a request may queue or run.

A request's cost is its prompt tokens plus ``n × max_tokens`` (``best_of``
when larger; without ``max_tokens``, ``--flow-default-max-tokens``), so an
``n=128`` request counts as what it asks of the engines. Before it queues,
its tenant's limits are checked; over any of them it is refused at once with
a 429 and a ``Retry-After`` saying when the limit will let it through:

* ``max_inflight_requests`` / ``max_inflight_tokens``: requests (cost) the
  tenant has admitted and not finished;
* ``requests_per_second`` / ``tokens_per_second``: token buckets holding one
  second's worth (a request costing more than one second's tokens passes when
  the bucket is full and leaves it in debt);
* ``max_queued``: the tenant's requests already waiting for a slot.

An admitted request holds a :class:`Ticket` until its answer ends. Every
number here is this process's: with ``--workers N`` each worker keeps its
own, so a tenant's limits apply per worker.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from ...contracts import priority
from ...contracts.gateway_view import TenantView
from ..admission import MAX_RETRY_AFTER, MIN_RETRY_AFTER, Overloaded
from ..metrics import GatewayMetrics
from .tenants import Tenant

# Seconds a tenant's Retry-After suggests when it is at its in-flight limit
# and none of its requests finished yet to measure how long they take.
DEFAULT_SERVICE_S = 1.0


class FairClock:
    """Start-time fair queuing by tokens within one band: a request's tag is
    its tenant's finish, its tenant's finish then grows by ``cost / weight``,
    and the clock follows the largest tag that started. A tenant with no
    request waiting to start (given a tag, neither started nor dropped) is
    idle: its next tag is at least the clock, so it banks no credit.

    Requests start out of their tags' order when the engines have room for
    all of them (the engine's queue, by the same tags, orders them then): a
    tenant whose requests all went to the engines but wait there is not idle,
    and its next tags follow its own even when a later tag of another tenant
    started first. Nobody else's tag depends on its waiting requests, so one
    that waits long (for a slow first event) holds back no other tenant, and
    gives its own tenant no more than the place it had (a request cannot wait
    to start past the first-token bound)."""

    def __init__(self) -> None:
        self.clock = 0.0
        self.finish: dict[str, float] = {}
        self.waiting: dict[str, int] = {}
        """Each tenant's requests given a tag and not started or dropped yet
        (tenants with none are not in it)."""

    # Every request of the gateway passes through tag() and started() or
    # dropped(): plain dict operations, no calls beyond them.

    def tag(self, tenant: str, weighted_cost: float) -> float:
        waiting = self.waiting
        n = waiting.get(tenant, 0)
        start = self.finish.get(tenant, 0.0)
        if not n and start < self.clock:
            start = self.clock
        self.finish[tenant] = start + weighted_cost
        waiting[tenant] = n + 1
        if len(self.finish) > 4096:  # only tenants ahead of the clock, or waiting, carry a place
            clock = self.clock
            self.finish = {t: f for t, f in self.finish.items() if f > clock or t in waiting}
        return start

    def started(self, tenant: str, tag: float) -> None:
        """A request of ``tenant`` and ``tag`` started (once per tag given)."""
        if tag > self.clock:
            self.clock = tag
        waiting = self.waiting
        n = waiting[tenant]
        if n > 1:
            waiting[tenant] = n - 1
        else:
            del waiting[tenant]

    def dropped(self, tenant: str) -> None:
        """A request of ``tenant`` ended without starting (once per tag given):
        it stops counting as waiting, and the clock stays where it is."""
        self.started(tenant, -math.inf)


class TokenBucket:
    """``rate`` per second, holding at most ``burst``; ``take`` may go into debt
    when the bucket is full (a cost larger than the burst still passes)."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.level = burst
        self.at = time.monotonic()

    def _refill(self, now: float) -> None:
        self.level = min(self.burst, self.level + (now - self.at) * self.rate)
        self.at = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` may be taken (0: now)."""
        self._refill(now)
        need = min(amount, self.burst)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, amount: float) -> None:
        self.level -= amount


@dataclass
class TenantState:
    """What one tenant has in flight, and its series."""

    tenant: Tenant
    inflight: int = 0
    inflight_tokens: float = 0.0
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    service_s: float = DEFAULT_SERVICE_S
    """Moving mean of its requests' time from admission to their end."""
    queue_s: float = 0.0
    """Moving mean of the time its requests that waited for a slot waited."""
    waited: int = 0
    """Its requests that waited for a slot."""
    series: dict[str, Any] = field(default_factory=dict)


class Ticket:
    """An admitted request's hold on its tenant's in-flight limits."""

    __slots__ = ("_admitted", "_clock", "_flow", "_waiting", "band", "cost", "state", "tag")

    def __init__(
        self,
        flow: FlowControl,
        state: TenantState,
        cost: float,
        band: int,
        clock: FairClock,
        share: float | None = None,
    ) -> None:
        self._flow, self.state, self.cost, self.band = flow, state, cost, band
        self._clock = clock
        # Fair share counts ``share`` (the cost with prompt tokens weighted),
        # the limits the whole cost.
        charged = cost if share is None else share
        self.tag = clock.tag(state.tenant.name, charged / state.tenant.policy.weight)
        self._waiting = True
        self._admitted = time.monotonic()

    @property
    def engine_priority(self) -> int:
        """What an engine scheduling by priority gets: band, then tag."""
        return priority.encode(self.band, self.tag)

    def started(self) -> None:
        """It started (its slot, or a stream's first event): the band's clock
        moves to its tag (once; later calls do nothing)."""
        if self._waiting:
            self._waiting = False
            self._clock.started(self.state.tenant.name, self.tag)

    @property
    def tenant(self) -> str:
        return self.state.tenant.name

    def queued(self, seconds: float) -> None:
        """The request waited ``seconds`` for a slot (counted per tenant)."""
        if self._flow is None:
            return
        s = self.state
        s.queue_s = seconds if not s.waited else 0.8 * s.queue_s + 0.2 * seconds
        s.waited += 1
        self._flow.metrics.tenant_queue_seconds.labels(self.tenant).observe(seconds)

    def release(self) -> None:
        """The answer ended (once; later calls do nothing)."""
        flow, self._flow = self._flow, None  # type: ignore[assignment]
        if flow is None:
            return
        if self._waiting:  # it never started
            self._waiting = False
            self._clock.dropped(self.state.tenant.name)
        s = self.state
        s.inflight -= 1
        s.inflight_tokens -= self.cost
        s.service_s = 0.8 * s.service_s + 0.2 * (time.monotonic() - self._admitted)


class FlowControl:
    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.states: dict[str, TenantState] = {}
        self.clocks: dict[int, FairClock] = {}
        """Each band's fair-share clock."""
        metrics.on_collect(self._gauges)

    def state(self, tenant: Tenant) -> TenantState:
        s = self.states.get(tenant.name)
        if s is None:
            p = tenant.policy
            s = self.states[tenant.name] = TenantState(tenant)
            if p.requests_per_second is not None:
                s.requests = TokenBucket(p.requests_per_second, max(1.0, p.requests_per_second))
            if p.tokens_per_second is not None:
                s.tokens = TokenBucket(p.tokens_per_second, p.tokens_per_second)
        return s

    def admit(
        self,
        tenant: Tenant,
        cost: float,
        band: int,
        queued: int,
        limited: bool = True,
        share: float | None = None,
    ) -> Ticket:
        """A ticket for a request of ``cost`` tokens, or :class:`Overloaded` (429)
        naming the limit; ``queued``: the tenant's requests waiting now.
        ``limited``: False for a batch request (the batch runner paces those:
        idle capacity, --batch-concurrency), which counts but is never refused.
        ``share``: what fair share charges it (default ``cost``)."""
        s = self.states.get(tenant.name)
        if s is None:
            s = self.state(tenant)
        p = tenant.policy
        now = time.monotonic()
        refusal: tuple[str, str, float] | None = None
        if not limited:
            pass
        elif p.max_inflight_requests is not None and s.inflight >= p.max_inflight_requests:
            refusal = (
                "inflight_limit",
                f"{p.max_inflight_requests} requests in flight (max_inflight_requests)",
                s.service_s,
            )
        elif (
            p.max_inflight_tokens is not None
            and s.inflight
            and s.inflight_tokens + cost > p.max_inflight_tokens
        ):
            refusal = (
                "inflight_limit",
                f"{s.inflight_tokens:.0f} + {cost:.0f} tokens in flight exceed "
                f"max_inflight_tokens ({p.max_inflight_tokens})",
                s.service_s,
            )
        elif p.max_queued is not None and queued >= p.max_queued:
            refusal = (
                "queue_full",
                f"{queued} requests waiting (max_queued)",
                s.service_s * (queued + 1) / max(1, s.inflight),
            )
        else:
            wait = s.requests.wait_for(1.0, now) if s.requests is not None else 0.0
            what = "requests_per_second"
            if s.tokens is not None:
                token_wait = s.tokens.wait_for(cost, now)
                if token_wait > wait:
                    wait, what = token_wait, "tokens_per_second"
            if wait > 0:
                refusal = ("rate_limited", f"over its rate limit ({what})", wait)
        if refusal is not None:
            reason, detail, retry = refusal
            self._count(s, reason)
            raise Overloaded(
                429,
                f"tenant {tenant.name!r} is at its limit: {detail}; retry later",
                int(min(MAX_RETRY_AFTER, max(MIN_RETRY_AFTER, math.ceil(retry)))),
                reason,
            )
        if s.requests is not None and limited:
            s.requests.take(1.0)
        if s.tokens is not None and limited:
            s.tokens.take(cost)
        s.inflight += 1
        s.inflight_tokens += cost
        admitted = s.series.get("admitted")  # (``_count``, inline)
        if admitted is None:
            self._count(s, "admitted")
        else:
            admitted.add_one()
        tokens = s.series.get("tokens")
        if tokens is None:
            tokens = s.series["tokens"] = self.metrics.fast_counter(
                self.metrics.tenant_tokens.labels(tenant.name)
            )
        tokens.inc(cost)
        clock = self.clocks.get(band)
        if clock is None:
            clock = self.clocks[band] = FairClock()
        return Ticket(self, s, cost, band, clock, share)

    def refused(self, ticket: Ticket, reason: str) -> None:
        """An admitted request was refused later (the fleet's queue: full or timed out)."""
        self._count(ticket.state, reason)
        ticket.release()

    def _count(self, s: TenantState, outcome: str) -> None:
        counter = s.series.get(outcome)
        if counter is None:
            counter = s.series[outcome] = self.metrics.fast_counter(
                self.metrics.tenant_requests.labels(s.tenant.name, outcome)
            )
        counter.add_one()

    def _gauges(self) -> None:
        for name, s in self.states.items():
            self.metrics.tenant_inflight.labels(name).set(s.inflight)
            self.metrics.tenant_inflight_tokens.labels(name).set(s.inflight_tokens)

    def view(self, queued: dict[str, int]) -> list[TenantView]:
        """Each tenant as ``/engines`` (and ``pdfleet status``) show it."""
        out = []
        for name in sorted(set(self.states) | set(queued)):
            s = self.states.get(name)
            p = s.tenant.policy if s is not None else None
            out.append(
                TenantView(
                    tenant=name,
                    priority=p.priority if p else None,
                    weight=p.weight if p else None,
                    inflight=s.inflight if s else 0,
                    inflight_tokens=round(s.inflight_tokens) if s else 0,
                    queued=queued.get(name, 0),
                    # Requests that waited for a slot, and their recent mean wait.
                    waited=s.waited if s else 0,
                    queue_s=round(s.queue_s, 3) if s else 0.0,
                )
            )
        return out
