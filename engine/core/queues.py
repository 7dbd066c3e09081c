"""Waiting queues for the two scheduling policies.

Removal is lazy: an aborted request stays in the queue marked finished and is
dropped when it reaches the front, so abort is O(1).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from ..request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._q.append(request)

    def push_front(self, request: Request) -> None:
        self._q.appendleft(request)

    def pop(self) -> Request:
        return self._q.popleft()

    def peek(self) -> Request:
        return self._q[0]

    def prepend_all(self, requests: list[Request]) -> None:
        """Put back requests popped in order (they keep their places at the front)."""
        self._q.extendleft(reversed(requests))

    def prune(self) -> None:
        while self._q and self._q[0].is_finished:
            self._q.popleft()

    def __len__(self) -> int:
        return sum(1 for r in self._q if not r.is_finished)

    def __bool__(self) -> bool:
        self.prune()
        return bool(self._q)

    def __iter__(self) -> Iterator[Request]:
        return (r for r in self._q if not r.is_finished)

    def unordered(self) -> Iterator[Request]:
        """The requests in no particular order (no sorting: cheap to scan)."""
        return iter(self)


class PriorityQueue:
    """Lower ``priority`` first, then earlier arrival."""

    def __init__(self) -> None:
        self._h: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def push(self, request: Request) -> None:
        heapq.heappush(self._h, (request.priority, request.arrival_time, next(self._seq), request))

    push_front = push  # a preempted request returns by its own priority

    def pop(self) -> Request:
        return heapq.heappop(self._h)[3]

    def peek(self) -> Request:
        return self._h[0][3]

    def prepend_all(self, requests: list[Request]) -> None:
        for r in requests:
            self.push(r)

    def prune(self) -> None:
        while self._h and self._h[0][3].is_finished:
            heapq.heappop(self._h)

    def __len__(self) -> int:
        return sum(1 for e in self._h if not e[3].is_finished)

    def __bool__(self) -> bool:
        self.prune()
        return bool(self._h)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._h) if not e[3].is_finished)

    def unordered(self) -> Iterator[Request]:
        """The requests in heap order (no sorting: cheap to scan)."""
        return (e[3] for e in self._h if not e[3].is_finished)


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}")
