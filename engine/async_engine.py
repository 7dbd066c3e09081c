"""An asyncio front to the engine: the model runs on its own thread.

The engine loop (schedule, forward, sample, detokenize) runs on one
background thread that owns the ``LLMEngine``. Coroutines submit work through
a thread-safe command queue and receive ``RequestOutput`` deltas through a
per-request ``asyncio.Queue`` fed with ``call_soon_threadsafe``, so the event
loop is never blocked by the model. Tokenization and validation run in a
worker thread before a request is queued, so bad input is rejected
synchronously with nothing left behind.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class _Sink:
    """Where a request's outputs go: an asyncio queue on a given loop."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop, q: asyncio.Queue) -> None:
        self.loop, self.queue = loop, q

    def __call__(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _put_all(deliveries: list) -> None:
    for sink, item in deliveries:
        sink.queue.put_nowait(item)


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an internal error."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting; retry later (HTTP 503)."""


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    arrival: float
    priority: int
    kv_transfer_params: dict[str, Any] | None
    sink: Callable[[RequestOutput | BaseException], None]


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        max_waiting_requests: int = 0,
        on_step: Callable[[LLMEngine], None] | None = None,
    ) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.on_step = on_step
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, Callable[[RequestOutput | BaseException], None]] = {}
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.num_in_flight = 0
        self._thread = threading.Thread(target=self._loop, name="pdfleet-engine", daemon=True)
        self._thread.start()

    # -- engine thread ------------------------------------------------------------

    def _loop(self) -> None:
        engine = self.engine
        idle_step = False
        try:
            while not self._stop.is_set():
                busy = engine.has_unfinished_requests()
                # Nothing to compute (e.g. waiting for remote KV): poll gently, never spin.
                wait = None if not busy else (0.005 if idle_step else 0)
                try:
                    cmd = (
                        self._commands.get(timeout=wait)
                        if wait != 0
                        else self._commands.get_nowait()
                    )
                    self._apply(cmd)
                    while True:
                        self._apply(self._commands.get_nowait())
                except queue.Empty:
                    pass
                if self._stop.is_set():
                    break
                if not engine.has_unfinished_requests():
                    if self.on_step is not None:
                        self.on_step(engine)
                    continue
                outputs = engine.step()
                idle_step = engine.stats.num_scheduled_tokens == 0
                deliveries = []
                for out in outputs:
                    sink = self._sinks.get(out.request_id)
                    if sink is not None:
                        deliveries.append((sink, out))
                    if out.finished:
                        self._sinks.pop(out.request_id, None)
                        self.num_in_flight = len(self._sinks)
                self._deliver(deliveries)
                if self.on_step is not None:
                    self.on_step(engine)
        except BaseException as e:  # the engine is unusable: fail every request loudly
            logger.exception("engine loop failed")
            self.error = e
            for sink in list(self._sinks.values()):
                sink(EngineDeadError(f"the engine stopped: {e}"))
            self._sinks.clear()

    def _deliver(self, deliveries: list) -> None:
        """Hand a step's outputs to the event loop in one wake-up."""
        if not deliveries:
            return
        loop = deliveries[0][0].loop
        loop.call_soon_threadsafe(_put_all, deliveries)

    def _apply(self, cmd: Any) -> None:
        if cmd is None:
            return
        if isinstance(cmd, _Add):
            try:
                self.engine.add_request(
                    cmd.request_id,
                    {"prompt": cmd.prompt_text, "prompt_token_ids": cmd.prompt_ids},
                    cmd.params,
                    arrival_time=cmd.arrival,
                    priority=cmd.priority,
                    kv_transfer_params=cmd.kv_transfer_params,
                    output_kind="delta",
                )
            except ValueError as e:
                cmd.sink(e)
                return
            self._sinks[cmd.request_id] = cmd.sink
        elif isinstance(cmd, _Abort):
            self._sinks.pop(cmd.request_id, None)
            self.engine.abort_request(cmd.request_id)
        self.num_in_flight = len(self._sinks)

    # -- asyncio side ---------------------------------------------------------------

    @property
    def alive(self) -> bool:
        # A KV pull stuck in quarantine past its bound also makes the engine unhealthy.
        return (
            self.error is None
            and self._thread.is_alive()
            and self.engine.unhealthy_reason() is None
        )

    def num_waiting(self) -> int:
        return self.engine.stats.num_waiting_reqs

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt_text: str | None = None,
        priority: int = 0,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream delta outputs; abort the request if the consumer goes away."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        if self.max_waiting_requests and self.num_waiting() >= self.max_waiting_requests:
            raise QueueFullError(
                f"the server has {self.num_waiting()} requests waiting (limit "
                f"{self.max_waiting_requests}); retry later"
            )
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        sink = _Sink(loop, q)

        self._commands.put(
            _Add(
                request_id,
                prompt_ids,
                prompt_text,
                params,
                time.monotonic(),
                priority,
                kv_transfer_params,
                sink,
            )
        )
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        if self.alive:
            # A prefill engine keeps serving its KV leases until they are claimed.
            self.engine.wait_for_kv_leases()
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout)
        self.engine.shutdown()
