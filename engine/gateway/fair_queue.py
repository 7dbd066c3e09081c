"""The queue of requests waiting for a slot: strict priority across bands,
weighted fair share by tokens within a band.

Each request carries its band and its fair-share tag (``control.FairClock``:
start-time fair queuing by tokens, given at admission), and the queue serves
the smallest (band, tag) first, arrival breaking ties. Within a tenant tags
grow with each request's cost over the tenant's weight, so two backlogged
tenants of equal weight receive equal tokens, not equal requests; a request
woken for a slot that another request took goes back with its tag, so at
its place.

A heap with lazy removal: push and pop O(log n), remove O(1) (the entry is
skipped when it reaches the top).
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
from dataclasses import dataclass, field


@dataclass(eq=False)
class Waiter:
    """One request waiting for a slot."""

    future: asyncio.Future[None]
    tenant: str
    band: int
    tag: float
    """Its fair-share tag within the band (smaller: sooner)."""
    seqs: int = 1
    """The slots it needs (its sequences)."""
    queued: bool = field(default=False, repr=False)


class FairQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Waiter]] = []
        self._seq = itertools.count()
        self.size = 0
        """Waiters on the queue (``len``, as an attribute: read per request)."""
        self.by_tenant: collections.Counter[str] = collections.Counter()
        """Waiters per tenant (tenants with none are dropped)."""
        self.by_band: collections.Counter[int] = collections.Counter()

    def __len__(self) -> int:
        return self.size

    def push(self, waiter: Waiter) -> None:
        waiter.queued = True
        heapq.heappush(self._heap, (waiter.band, waiter.tag, next(self._seq), waiter))
        self.size += 1
        self.by_tenant[waiter.tenant] += 1
        self.by_band[waiter.band] += 1

    def pop(self) -> Waiter | None:
        """The next waiter by band, then tag; None when empty."""
        while self._heap:
            waiter = heapq.heappop(self._heap)[3]
            if waiter.queued:
                self._left(waiter)
                return waiter
        return None

    def remove(self, waiter: Waiter) -> bool:
        """Take a waiter off the queue (it timed out or went away); False when
        it was not on it (already popped)."""
        if not waiter.queued:
            return False
        self._left(waiter)
        if len(self._heap) > 2 * self.size + 64:  # drop the skipped entries
            self._heap = [e for e in self._heap if e[3].queued]
            heapq.heapify(self._heap)
        return True

    def ahead_of(self, band: int) -> int:
        """Waiters a request of ``band`` would wait behind: its band's and the
        bands served before it."""
        if len(self.by_band) == 1 and band in self.by_band:
            return self.size
        return sum(n for b, n in self.by_band.items() if b <= band)

    def _left(self, waiter: Waiter) -> None:
        waiter.queued = False
        self.size -= 1
        self.by_tenant[waiter.tenant] -= 1
        if not self.by_tenant[waiter.tenant]:
            del self.by_tenant[waiter.tenant]
        self.by_band[waiter.band] -= 1
        if not self.by_band[waiter.band]:
            del self.by_band[waiter.band]
