"""Deadlines of the request path: ``asyncio.timeout``'s contract at a fraction of its cost.

Every leg waits under a bound (the first-token bound, the request timeout), so
every request made a timeout: ``asyncio.timeout`` is a coroutine to enter and
one to leave, and a timer handle of the event loop (made, then cancelled)
each time, which together cost several percent of a request. Here a
:class:`Deadline` is a plain context manager, and the deadlines of one
``RESOLUTION`` slot of loop time share one timer: a request joins its slot's
set and leaves it on exit, and a slot's timer fires those still in it. A
deadline therefore fires up to ``RESOLUTION`` seconds late, never early;
the bounds it serves are seconds to minutes long.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

# Seconds of loop time whose deadlines share one timer.
RESOLUTION = 0.05


class _Wheel:
    """The slots of one event loop: slot number -> the deadlines in it."""

    __slots__ = ("loop", "slots")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.slots: dict[int, set[Deadline]] = {}

    def add(self, deadline: Deadline, when: float) -> int:
        slot = int(when / RESOLUTION) + 1  # fires at the slot's end: never early
        members = self.slots.get(slot)
        if members is None:
            members = self.slots[slot] = set()
            self.loop.call_at(slot * RESOLUTION, self._fire, slot)
        members.add(deadline)
        return slot

    def remove(self, deadline: Deadline, slot: int) -> None:
        members = self.slots.get(slot)
        if members is not None:
            members.discard(deadline)

    def _fire(self, slot: int) -> None:
        for deadline in self.slots.pop(slot, ()):
            deadline._fire()


# The running loop's wheel, per thread (one running loop per thread).
_local = threading.local()


def _wheel_of(loop: asyncio.AbstractEventLoop) -> _Wheel:
    wheel = getattr(_local, "wheel", None)
    if wheel is None or wheel.loop is not loop:  # (a test runs several loops, one at a time)
        wheel = _local.wheel = _Wheel(loop)
    return wheel


def current_task() -> asyncio.Task[Any] | None:
    """The running task, as ``asyncio.current_task()``, without its read of
    the running loop (a ``getpid`` system call each time, about a tenth of a
    stream's gateway CPU on a VM where system calls are dear): the task of
    this thread's wheel loop when that loop runs a task, which it does only
    while it runs in this thread; else the full lookup (another loop: a test
    runs several, one at a time). None outside a task."""
    wheel = getattr(_local, "wheel", None)
    task = asyncio.current_task(wheel.loop) if wheel is not None else None
    if task is None:
        with contextlib.suppress(RuntimeError):  # no running loop
            task = asyncio.current_task()
    return task


class Deadline:
    """``with``: the task is cancelled at ``when`` (loop time; None: never)
    and the cancellation comes out of the block as ``TimeoutError``, as with
    ``asyncio.timeout``; ``reschedule`` and ``expired`` as there. Made inside
    the task it bounds. ``after``: instead of ``when``, that many seconds
    from now (the loop's time read here, not by the caller: each read of the
    running loop is a ``getpid`` system call). ``waiters``: a set it belongs
    to from now until it exits (an engine's, whose stall watchdog reschedules
    them)."""

    __slots__ = ("_cancelling", "_expired", "_handle", "_slot", "_task", "_waiters", "_wheel")

    def __init__(
        self, when: float | None, after: float | None = None, waiters: set[Deadline] | None = None
    ) -> None:
        wheel: _Wheel | None = getattr(_local, "wheel", None)
        # (``current_task`` and ``_wheel_of``, inline for this thread's wheel loop)
        task = asyncio.current_task(wheel.loop) if wheel is not None else None
        if task is None or wheel is None:
            task = current_task()
            if task is None:
                raise RuntimeError("a Deadline must be used inside a task")
            wheel = _wheel_of(task.get_loop())
        self._task = task
        self._cancelling = task.cancelling()
        self._expired = False
        self._handle: asyncio.Handle | None = None
        """A deadline rescheduled to now: fires on the next turn of the loop."""
        self._wheel = wheel
        if after is not None:
            when = wheel.loop.time() + after
        self._slot = 0 if when is None else wheel.add(self, when)
        self._waiters = waiters
        if waiters is not None:
            waiters.add(self)

    def expire_soon(self) -> None:
        """Fire on the next turn of the loop (``reschedule`` to now)."""
        self.reschedule(self._wheel.loop.time())

    def __enter__(self) -> Deadline:
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if self._waiters is not None:
            self._waiters.discard(self)
        self._cancel()
        if (
            self._expired
            and self._task.uncancel() <= self._cancelling
            and kind is asyncio.CancelledError
        ):
            raise TimeoutError from exc

    def reschedule(self, when: float | None) -> None:
        """A new deadline (None: none); one already past fires on the next turn."""
        if self._expired:
            return
        self._cancel()
        if when is None:
            return
        loop = self._wheel.loop
        if when <= loop.time():
            self._handle = loop.call_soon(self._fire)
        else:
            self._slot = self._wheel.add(self, when)

    def expired(self) -> bool:
        return self._expired

    def _cancel(self) -> None:
        if self._slot:
            self._wheel.remove(self, self._slot)
            self._slot = 0
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self._slot = 0
        self._handle = None
        if not self._expired:
            self._expired = True
            self._task.cancel()


class IdleTimer:
    """Expires ``cm`` (a :class:`Deadline`) once ``idle`` seconds pass
    without a ``touch``, and never while ``paused``. One timer per stream,
    moved on only when it fires: a reschedule per chunk (a timer cancelled
    and made twice per event) cost several percent of a stream's time.
    ``hold``, when given, is asked when the timer would fire: the seconds it
    must still wait whatever its idle time (0 or less: none)."""

    __slots__ = ("_cm", "_handle", "_hold", "_idle", "_last", "_loop", "paused")

    def __init__(self, cm: Deadline, idle: float, hold: Callable[[], float] | None = None) -> None:
        self._cm, self._idle, self._hold = cm, idle, hold
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self.paused = False
        self._handle: asyncio.TimerHandle | None = self._loop.call_at(self._last + idle, self._fire)

    def touch(self) -> None:
        """Something arrived: the idle time starts again (and runs, if paused)."""
        self._last = self._loop.time()
        self.paused = False

    def _fire(self) -> None:
        now = self._loop.time()
        if self.paused or now - self._last < self._idle:
            start = now if self.paused else self._last
            self._handle = self._loop.call_at(start + self._idle, self._fire)
            return
        if self._hold is not None:
            wait = self._hold()
            if wait > 0:
                self._handle = self._loop.call_at(now + wait, self._fire)
                return
        self._handle = None
        if not self._cm.expired():  # (the stall watchdog may have expired it already)
            self._cm.reschedule(now)  # the deadline passes: TimeoutError at its exit

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
