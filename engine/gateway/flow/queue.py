"""The queue of requests waiting for a slot: strict priority across bands,
weighted fair share by tokens within a band.

Within a band each tenant has its own FIFO. The next request served is the
head of the tenant with the smallest start tag (start-time fair queuing):
``start = max(tenant's finish, band's clock)``, then ``finish = start +
cost / weight``, and the band's clock moves to ``start``. A tenant that was
idle starts at the clock (it banks no credit while away); a tenant sending
``n=64`` requests pays 64 × max_tokens per request, so two backlogged
tenants of equal weight receive equal tokens, not equal requests.

Picking is linear in the band's tenants with waiters (tens, not thousands:
tenants are configured keys); pushing and removing a waiter are O(1) and
O(queue of its tenant).
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field


@dataclass(eq=False)
class Waiter:
    """One request waiting for a slot."""

    future: asyncio.Future[None]
    tenant: str
    band: int
    cost: float
    """Tokens (prompt + n × max_tokens) divided by the tenant's weight."""
    charged: bool = False
    """Its cost was counted at a previous pick (woken, then back at the head)."""


@dataclass
class _Band:
    queues: dict[str, collections.deque[Waiter]] = field(default_factory=dict)
    finish: dict[str, float] = field(default_factory=dict)
    clock: float = 0.0
    size: int = 0


class FairQueue:
    def __init__(self) -> None:
        self._bands: dict[int, _Band] = {}
        self._size = 0
        self.by_tenant: collections.Counter[str] = collections.Counter()
        """Waiters per tenant (tenants with none are dropped)."""

    def __len__(self) -> int:
        return self._size

    def push(self, waiter: Waiter, first: bool = False) -> None:
        """``first``: back at the head of its tenant's queue (it was woken but
        another request took the slot)."""
        band = self._bands.get(waiter.band)
        if band is None:
            band = self._bands[waiter.band] = _Band()
        queue = band.queues.get(waiter.tenant)
        if queue is None:
            queue = band.queues[waiter.tenant] = collections.deque()
        if first:
            queue.appendleft(waiter)
        else:
            queue.append(waiter)
        band.size += 1
        self._size += 1
        self.by_tenant[waiter.tenant] += 1

    def pop(self) -> Waiter | None:
        """The next waiter by band, then fair share; None when empty."""
        if not self._size:
            return None
        number = min(b for b, band in self._bands.items() if band.size)
        band = self._bands[number]
        best: str | None = None
        best_start = 0.0
        for tenant in band.queues:  # insertion order breaks ties
            start = max(band.finish.get(tenant, 0.0), band.clock)
            if best is None or start < best_start:
                best, best_start = tenant, start
        assert best is not None
        queue = band.queues[best]
        waiter = queue.popleft()
        if not waiter.charged:
            waiter.charged = True
            band.clock = best_start
            band.finish[best] = best_start + waiter.cost
        self._drop(band, number, best, queue)
        return waiter

    def remove(self, waiter: Waiter) -> bool:
        """Take a waiter off the queue (it timed out or went away); False when
        it was not on it (already popped)."""
        band = self._bands.get(waiter.band)
        queue = band.queues.get(waiter.tenant) if band is not None else None
        if band is None or queue is None:
            return False
        try:
            queue.remove(waiter)
        except ValueError:
            return False
        self._drop(band, waiter.band, waiter.tenant, queue)
        return True

    def _drop(self, band: _Band, number: int, tenant: str, queue: collections.deque) -> None:
        """Bookkeeping after a waiter left ``queue``."""
        band.size -= 1
        self._size -= 1
        self.by_tenant[tenant] -= 1
        if not self.by_tenant[tenant]:
            del self.by_tenant[tenant]
        if not queue:
            del band.queues[tenant]
            # A finish tag at or behind the clock carries no debt: forget it, so
            # the table holds only tenants that are waiting or recently served.
            if band.finish.get(tenant, 0.0) <= band.clock:
                band.finish.pop(tenant, None)
        if not band.size and not band.finish:
            del self._bands[number]
        elif len(band.finish) > 4 * (len(band.queues) + 16):
            behind = [t for t, f in band.finish.items() if f <= band.clock]
            for t in behind:
                del band.finish[t]
