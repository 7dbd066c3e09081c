"""Overload answered as overload: each engine's capacity, learned from its
scrapes, and the bounded queue of requests beyond it.

A request takes a *slot* per sequence it runs (``n`` × prompts, as engines
count their queue) on the decode engine it is routed to, from its route
(before its prefill leg, so a request that must wait pins no KV anywhere) to
the end of its answer, and, when it prefills, one on its prefill engine until
its prefill leg ends. An engine's capacity is learned from what it reports:
while it queues requests of its own (``waiting``: what its last step could
not admit for lack of room, less the KV pulls in flight, which wait for
bytes, not for room), its capacity is the slots this gateway
holds on it less that queue; while it has room and the gateway fills it, the
capacity grows by a quarter per scrape (at least one). An engine that never
queued has no capacity bound. A decode engine's slots include its requests
still in their prefill leg, so they count the pipeline; the prefill engines'
own capacities keep that part short.

While every routable decode engine is at capacity (or the request should
prefill and every prefill engine that could is), a request waits in the
flow-control queue (``fair_queue.py``: strict priority bands, weighted fair
share by tokens between tenants within a band;
``pdfleet_gateway_queued_requests``) for a slot, at most
``--queue-timeout`` seconds; then it is a 503 with ``Retry-After``. It is
refused at once, with a 429 and ``Retry-After``, when the queue holds
``--max-queued-requests`` or when the rate at which slots came free while
requests waited (over the last half minute) says it could not get a slot
within ``--queue-timeout``.
So beyond the rate the fleet sustains, requests are held for a bounded time
and then refused fast, and the engines keep serving what they can: nothing
is ejected and no request times out on an engine for being one too many.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Iterable

from ..config.gateway import GatewayConfig
from .engines import EngineLoad, EngineState
from .fair_queue import FairQueue, Waiter
from .metrics import GatewayMetrics

# Slots given back per second are counted over this many one-second buckets.
RATE_WINDOW_S = 30
# Seconds of saturation before the rate is trusted to refuse at once (a rate
# from the first second of a burst is one or two completions: noise).
MIN_RATE_SPAN_S = 5.0
# The share of an engine's capacity that requests of the best band may take
# beyond it (the engine preempts a worse band's request for them).
TOP_BAND_OVERFLOW = 1 / 8
# Slots that wake every waiting request (however wide).
WAKE_ALL = 1 << 62
# Retry-After bounds (seconds).
MIN_RETRY_AFTER = 1
MAX_RETRY_AFTER = 60


class Overloaded(Exception):
    """No slot for the request: answered ``status`` with ``Retry-After``."""

    def __init__(self, status: int, message: str, retry_after: int, reason: str) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after, self.reason = (
            status,
            message,
            retry_after,
            reason,
        )


class FreedRate:
    """Slots given back per second while requests wait for one (the fleet's
    service rate when saturated), over the last ``RATE_WINDOW_S`` seconds.

    Only the saturated time counts: requests that ended while the engines
    had room say nothing of how fast slots free up under load, and idle
    seconds would make the rate look low (a burst after a quiet minute
    would be refused for it)."""

    def __init__(self) -> None:
        self._buckets: collections.deque[list[int]] = collections.deque()
        """[second, count] pairs, oldest first, within the window."""
        self.busy_since: float | None = None
        """Monotonic start of the current saturated period (None: not saturated
        within the window)."""
        self._idle_since: float | None = None

    def saturated(self, now: float) -> None:
        """A request waits for a slot: a saturated period starts, unless one
        ended less than a window ago (a queue that empties for a moment)."""
        if self.busy_since is None or (
            self._idle_since is not None and now - self._idle_since > RATE_WINDOW_S
        ):
            self.busy_since = now
        self._idle_since = None

    def drained(self, now: float) -> None:
        """No request waits any more."""
        if self._idle_since is None:
            self._idle_since = now

    def tick(self, now: float) -> None:
        second = int(now)
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += 1
        else:
            self._buckets.append([second, 1])
            self._trim(second)

    def _trim(self, second: int) -> None:
        while self._buckets and self._buckets[0][0] <= second - RATE_WINDOW_S:
            self._buckets.popleft()

    def per_second(self, now: float) -> float:
        """0.0 when not saturated for MIN_RATE_SPAN_S yet, or when nothing
        came free since it began."""
        self._trim(int(now))
        since = self.busy_since
        if (
            since is None
            or now - since < MIN_RATE_SPAN_S
            or (self._idle_since is not None and now - self._idle_since > RATE_WINDOW_S)
        ):
            return 0.0
        freed = sum(n for second, n in self._buckets if second >= int(since))
        return freed / min(float(RATE_WINDOW_S), now - since)


class Admission:
    """Slots on engines and the queue of requests waiting for one."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.freed = FreedRate()
        self._waiters = FairQueue()
        self.top_band: int | None = None
        """The best band of several (set by flow control when engines schedule by
        the gateway's priority): its requests may overflow capacity a little."""

    # -- slots -----------------------------------------------------------------------

    def limit(self, e: EngineState, band: int | None) -> int | None:
        """The slots requests of ``band`` may fill on ``e``: its capacity, and for
        the best band (:attr:`top_band`) a share more, which the engine makes
        room for by preempting a worse band's request (so a protected request
        never waits for one of them to end). None: no bound."""
        cap = e.capacity
        if cap is None or band is None or self.top_band is None or band > self.top_band:
            return cap
        return cap + max(1, math.ceil(cap * TOP_BAND_OVERFLOW))

    def has_room(self, e: EngineState, seqs: int = 1, band: int | None = None) -> bool:
        """Whether a request of ``seqs`` sequences (and ``band``) may start on
        ``e`` now: all of its sequences fit its limit, or, when it is wider than
        the limit, the engine has nothing of this gateway's on it. So a wide
        request waits until the slots it needs are free (the ones freed meanwhile
        stay free for it when it is at the head of the queue) rather than
        overflowing the engine by its width."""
        capacity = e.capacity
        if capacity is None:  # (no capacity learned: no bound, whatever the band)
            return True
        cap = self.limit(e, band)
        if cap is None:
            return True
        if e.admitted + min(seqs, cap) <= cap:
            return True
        # The best band's share beyond the capacity is its own: its requests
        # do not wait for a worse band's to end even while those hold more
        # than the capacity (admitted before it was learned, or before a
        # scrape lowered it); the engine preempts one of them instead.
        return cap > capacity and e.top_admitted + seqs <= cap - capacity

    def full(
        self, candidates: Iterable[EngineState], seqs: int = 1, band: int | None = None
    ) -> set[str]:
        """URLs of the candidates without room for the request (usually none: no
        set is made then)."""
        out: set[str] = set()
        for e in candidates:
            if e.capacity is not None and not self.has_room(e, seqs, band):
                out.add(e.url)
        return out

    def take(
        self, e: EngineState, key: int | None = None, seqs: int = 1, top: bool = False
    ) -> None:
        """A slot on ``e``; ``key``: the gateway will see its first answer
        (:meth:`answered`), so how long it waits for one is watched. ``seqs``:
        the sequences the request runs (``n`` × prompts): slots are counted in
        sequences, as the engines count their queue, so an ``n=64`` request
        takes what it uses. ``top``: a request of the best band (its share
        beyond the capacity, ``has_room``)."""
        e.admitted += seqs
        if top:
            e.top_admitted += seqs
        if key is not None:
            e.pending[key] = time.monotonic()

    def answered(self, e: EngineState, key: int) -> None:
        """The slot's first answer came (a stream's first event)."""
        e.pending.pop(key, None)

    def give_back(
        self,
        e: EngineState,
        key: int | None = None,
        ended: bool = True,
        seqs: int = 1,
        top: bool = False,
    ) -> None:
        """A request routed to ``e`` ended (``ended``; else its leg there ended
        or moved to another engine): its ``seqs`` slots are free for the next
        ones (``top``: as taken)."""
        e.admitted -= seqs
        if top:
            e.top_admitted -= seqs
        if key is not None:
            e.pending.pop(key, None)
        if ended:
            self.freed.tick(time.monotonic())
        if self._waiters.size:
            self._wake(seqs)

    @property
    def late_after(self) -> float:
        """Seconds a slot may wait for its first answer before it counts as
        queued: a quarter of the first-token bound of an idle engine."""
        bound = self.config.first_token_timeout or self.config.first_token_base_timeout
        return bound / 4

    # -- learning capacity -----------------------------------------------------------------

    def scraped(
        self, e: EngineState, old: EngineLoad, new: EngineLoad, now: float | None = None
    ) -> None:
        """An engine's scrape: its capacity follows whether it queues, by its
        own count or by the gateway's watch (slots past :attr:`late_after`
        without a first answer: an engine that runs every request at once
        queues inside its steps, which only grow longer). The engine's count is
        of the requests beyond what it holds where it says (a wide request's
        sequences held back by their share of the engine, or by the step's
        token budget, while slots are free are not: counted, they would cut
        the capacity to what runs in that step); else of every request waiting
        but its KV pulls."""
        now = time.monotonic() if now is None else now
        oldest = min(e.pending.values(), default=now)
        late = sum(1 for at in e.pending.values() if now - at > self.late_after)
        waiting = (
            new.waiting - new.kv_pulls if new.waiting_for_slot is None else new.waiting_for_slot
        )
        queued = max(waiting, float(late))
        if queued >= 1:
            e.capacity = max(1, e.admitted - math.ceil(queued))
        elif (
            e.capacity is not None
            and e.admitted >= e.capacity
            and now - oldest <= self.late_after / 2
        ):
            # At capacity here, not queuing there, and first answers come in
            # half the time that counts as late: it can take one more.
            e.capacity += 1
            if self._waiters.size:
                self._wake(e.capacity - e.admitted)

    def engines_changed(self) -> None:
        """An engine became routable (or one left): every waiting request looks again."""
        if self._waiters.size:
            self._wake(WAKE_ALL)

    # -- the queue -----------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return self._waiters.size

    def retry_after(self, ahead: int) -> int:
        """Seconds until a slot is likely free for a request with ``ahead`` before it."""
        rate = self.freed.per_second(time.monotonic())
        wait = (ahead + 1) / rate if rate > 0 else self.config.queue_timeout
        return int(min(MAX_RETRY_AFTER, max(MIN_RETRY_AFTER, math.ceil(wait))))

    def queued_by_tenant(self) -> dict[str, int]:
        return dict(self._waiters.by_tenant)

    def queued_of(self, tenant: str) -> int:
        return self._waiters.by_tenant.get(tenant, 0)

    def queued_ahead(self, band: int) -> int:
        """Requests waiting that a newcomer of ``band`` waits behind (its band's
        and better ones): a request of a better band than every waiter's need
        not queue behind them."""
        return self._waiters.ahead_of(band) if self._waiters.size else 0

    def check_queue(self, band: int = 0) -> None:
        """Raise :class:`Overloaded` (429) when a new request (of ``band``)
        should not wait: the queue is full, or the requests it would wait
        behind (its band's and the bands before it) could not all get a slot
        within --queue-timeout at the rate slots came free."""
        total = len(self._waiters)
        ahead = self._waiters.ahead_of(band)
        if total >= self.config.max_queued_requests:
            raise Overloaded(
                429,
                f"the service is overloaded ({total} requests waiting); retry later",
                self.retry_after(ahead),
                "queue_full",
            )
        rate = self.freed.per_second(time.monotonic())
        if rate > 0 and (ahead + 1) / rate > self.config.queue_timeout:
            raise Overloaded(
                429,
                f"the service is overloaded: {ahead} requests are waiting and a slot frees "
                f"every {1 / rate:.1f}s; retry later",
                self.retry_after(ahead),
                "overloaded",
            )

    async def wait(
        self,
        deadline: float,
        first: bool,
        tenant: str = "",
        band: int = 0,
        tag: float = 0.0,
        seqs: int = 1,
    ) -> bool:
        """Wait (until the monotonic ``deadline``) to be woken for a slot; ``first``:
        woken before, but another request took the slot (it goes back at its
        place: its tag). ``tenant``, ``band``, ``tag``: its place in the fair
        queue (``fair_queue.py``); ``seqs``: the slots it needs."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.freed.saturated(time.monotonic())
        waiter = Waiter(future, tenant, band, tag, seqs)
        self._waiters.push(waiter)
        self.metrics.queued.set(len(self._waiters))
        woken = False
        try:
            async with asyncio.timeout(left):
                await future
            woken = True
            return True
        except TimeoutError:
            return False
        finally:
            if not future.done():
                future.cancel()
            self._waiters.remove(waiter)  # a no-op when woken: already off the queue
            if not woken and future.done() and not future.cancelled():
                # Woken for free slots, then gone before it could take them
                # (its client left, or its time ran out): the next ones get them.
                self._wake(waiter.seqs)
            self.metrics.queued.set(len(self._waiters))
            if not self._waiters:
                self.freed.drained(time.monotonic())

    def _wake(self, n: int) -> None:
        """Wake waiting requests for ``n`` free slots, in the fair queue's order,
        each taking the slots it needs (a wide request at the head that finds
        too few goes back to its place, and the slots stay free for it)."""
        while n > 0:
            waiter = self._waiters.pop()
            if waiter is None:
                break
            if not waiter.future.done():
                waiter.future.set_result(None)
                n -= waiter.seqs
        self.metrics.queued.set(len(self._waiters))
