"""Who compiles a grammar when: per-caller limits and fair shares of the compile workers.

A request's constraint is compiled before it is admitted (a bad one is a 400
before any response starts). Compiles are the one piece of request work whose
CPU the client chooses, so the server hands the compile workers
(``--grammar-compile-workers``) out by caller:

* a caller (``caller.py``: an API key, the client a gateway names, or an
  address) has at most ``--max-grammar-compiles-per-caller`` compiles waiting
  or running; more are a 429;
* a free worker goes to the waiting caller that used the least compile time
  recently (seconds decayed with a one-minute half-life), FIFO within a
  caller, so a caller that keeps a worker busy yields it to any other that
  waits: under contention each caller gets its share, whatever it sends;
* the same constraint compiled for several requests at once is compiled
  once; a cache hit (``GrammarCompiler.lookup``) waits for nothing;
* every wait is bounded: a compile waits at most ``QUEUE_TIMEOUTS`` compile
  budgets for a worker (then 503), and runs at most one budget (then the
  worker is killed and the request gets a 400 naming its constraint field).

Compiles run on threads that only wait for the worker processes, so neither
the event loop nor the engine thread ever compiles.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ...config.admission import AdmissionConfig
from ...sample.grammar import check_bounds
from ...sampling_params import StructuredOutputsParams

# A compile waits for a worker at most this many compile budgets.
QUEUE_TIMEOUTS = 6.0
# Half-life (seconds) of the compile time a caller is charged.
USAGE_HALF_LIFE = 60.0
# Callers whose usage is remembered; beyond, the least charged are forgotten.
MAX_TRACKED_CALLERS = 4096


class CompileBusy(Exception):
    """Over a per-caller limit (429) or no worker in time (503); ``status`` says."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class FairShare:
    """Decayed compile seconds per caller; the least charged waiting caller goes next.

    Pure and deterministic (``now`` is given): ``charge`` after a compile,
    ``pick`` among the callers waiting."""

    def __init__(self, half_life: float = USAGE_HALF_LIFE, max_callers: int = MAX_TRACKED_CALLERS):
        self.half_life = half_life
        self.max_callers = max_callers
        self._usage: dict[str, tuple[float, float]] = {}
        """caller -> (seconds charged, when, monotonic)."""

    def usage(self, caller: str, now: float) -> float:
        seconds, at = self._usage.get(caller, (0.0, now))
        return seconds * math.exp2(-(now - at) / self.half_life)

    def charge(self, caller: str, seconds: float, now: float) -> None:
        self._usage[caller] = (self.usage(caller, now) + max(0.0, seconds), now)
        if len(self._usage) > self.max_callers:
            # Forget the least charged half: they would go first anyway.
            ranked = sorted(self._usage, key=lambda c: self.usage(c, now))
            for c in ranked[: len(ranked) // 2]:
                del self._usage[c]

    def pick(self, waiting: list[tuple[str, int]], now: float) -> int:
        """Index in ``waiting`` ((caller, arrival sequence) pairs) of the next to run."""
        best = min(
            range(len(waiting)), key=lambda i: (self.usage(waiting[i][0], now), waiting[i][1])
        )
        return best


@dataclass(eq=False)
class _Waiter:
    caller: str
    seq: int
    ready: asyncio.Future[None] = field(repr=False)


class CompileGate:
    """The server's way to compile a request's constraint (see the module docstring)."""

    def __init__(self, grammars: Callable[[], Any], limits: AdmissionConfig) -> None:
        self._grammars = grammars
        """Gives the engine's ``GrammarCompiler`` (built on first use; its
        ``ValueError`` says when this engine cannot constrain output)."""
        self.limits = limits
        self.workers = limits.grammar_compile_workers
        self.share = FairShare()
        self.busy = 0
        self.waiting: list[_Waiter] = []
        self.pending: dict[str, int] = {}
        """caller -> its compiles waiting or running."""
        self.num_refused = 0
        """Compiles refused for a caller limit or for no free worker in time."""
        self.inflight: dict[tuple[Any, ...], asyncio.Future[Any]] = {}
        """spec key -> the compile under way (others with the same spec wait for it)."""
        self._seq = itertools.count()
        self._threads = ThreadPoolExecutor(self.workers, thread_name_prefix="pdfleet-grammar")

    @property
    def grammars(self) -> Any:
        return self._grammars()

    async def compile(self, spec: StructuredOutputsParams, caller: str) -> Any:
        """The compiled grammar of ``spec`` (also pinned on it). Raises
        ``ValueError`` for a constraint that is bad, over a bound or over its
        compile budget; ``CompileBusy`` for the caller limits."""
        if spec.compiled is not None:
            return spec.compiled
        check_bounds(spec, self.limits)
        key = spec.key()
        while True:
            hit = self.grammars.lookup(spec)
            if hit is not None:
                break
            running = self.inflight.get(key)
            if running is None:
                hit = await self._compile_new(spec, key, caller)
                break
            try:
                hit = await asyncio.shield(running)
                break
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not running.cancelled() or (task is not None and task.cancelling()):
                    raise  # this request's own cancellation
                # The request that started it went away before it ran: take over.
        object.__setattr__(spec, "compiled", hit)
        return hit

    async def _compile_new(
        self, spec: StructuredOutputsParams, key: tuple[Any, ...], caller: str
    ) -> Any:
        limit = self.limits.max_grammar_compiles_per_caller
        if self.pending.get(caller, 0) >= limit:
            self.num_refused += 1
            raise CompileBusy(
                f"{limit} grammar compiles of this caller are already waiting or running "
                "(--max-grammar-compiles-per-caller); retry when they are done",
                status=429,
            )
        loop = asyncio.get_running_loop()
        result: asyncio.Future[Any] = loop.create_future()
        # Nobody may be waiting on it when it fails: never "exception not retrieved".
        result.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.inflight[key] = result
        self.pending[caller] = self.pending.get(caller, 0) + 1

        def forget() -> None:
            self.pending[caller] -= 1
            if not self.pending[caller]:
                del self.pending[caller]
            if self.inflight.get(key) is result:
                del self.inflight[key]

        try:
            await self._acquire(caller)
        except BaseException:
            forget()
            result.cancel()  # others waiting for it compile it themselves
            raise
        started = time.monotonic()
        job = loop.run_in_executor(self._threads, self._build, spec)

        def done(job: asyncio.Future[Any]) -> None:
            # The slot and the caller's count are freed when the compile really
            # ended, even if the request that asked for it went away meanwhile;
            # requests waiting for the same spec get its outcome.
            now = time.monotonic()
            self.share.charge(caller, now - started, now)
            self._release()
            forget()
            if result.done():
                return
            if job.cancelled():
                result.cancel()
                return
            error = job.exception()
            if error is not None:
                result.set_exception(error)
            else:
                result.set_result(job.result())

        job.add_done_callback(done)
        return await asyncio.shield(job)

    def _build(self, spec: StructuredOutputsParams) -> Any:
        # Another request may have compiled it while this one waited for a worker.
        hit = self.grammars.lookup(spec)
        return hit if hit is not None else self.grammars.build(spec)

    async def _acquire(self, caller: str) -> None:
        if self.busy < self.workers and not self.waiting:
            self.busy += 1
            return
        waiter = _Waiter(caller, next(self._seq), asyncio.get_running_loop().create_future())
        self.waiting.append(waiter)
        bound = QUEUE_TIMEOUTS * self.limits.grammar_compile_timeout
        try:
            await asyncio.wait_for(asyncio.shield(waiter.ready), bound)
        except BaseException as e:
            if waiter.ready.done() and not waiter.ready.cancelled():
                self._release()  # handed a slot just as it gave up: pass it on
            else:
                waiter.ready.cancel()
                self.waiting.remove(waiter)
            if isinstance(e, TimeoutError):
                self.num_refused += 1
                raise CompileBusy(
                    f"no grammar compiler was free within {bound:g}s; retry later", status=503
                ) from None
            raise

    def _release(self) -> None:
        """A worker slot is free: hand it to the fairest waiter, else keep it free."""
        if not self.waiting:
            self.busy -= 1
            return
        now = time.monotonic()
        i = self.share.pick([(w.caller, w.seq) for w in self.waiting], now)
        waiter = self.waiting.pop(i)
        waiter.ready.set_result(None)  # the slot passes on: busy is unchanged

    def shutdown(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
