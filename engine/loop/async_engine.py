"""An asyncio front to the engine: the model runs on its own thread.

The engine loop (schedule, forward, sample, detokenize) runs on one
background thread that owns the ``LLMEngine``. Coroutines submit work through
a thread-safe command queue and receive ``RequestOutput`` deltas through a
per-request ``asyncio.Queue`` fed with ``call_soon_threadsafe``, so the event
loop is never blocked by the model. Tokenization and validation run in a
worker thread before a request is queued, so bad input is rejected
synchronously with nothing left behind.

Admission is confirmed: :meth:`AsyncEngine.add_request` returns once the
engine thread accepted the request (or raises the ``ValueError`` it gave), so
a server can answer 400 before it starts a response, streaming included.

Failures: a step that raises fails the requests it had scheduled
(:class:`EngineStepError` to each) and the engine keeps serving. Repeated
failing steps, or an exception outside a step, leave the engine's state
unknown: every request gets :class:`EngineDeadError` and ``on_fatal`` is
called, so the server can exit non-zero for its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

from ..lora.adapter import LoRAError
from ..lora.hub import fetch_hub_adapter, is_hub_source
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .engine_core import StepFailed
from .llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class _Sink:
    """Where a request's outputs go: an asyncio queue on a given loop."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop, q: asyncio.Queue[_Delivery]) -> None:
        self.loop, self.queue = loop, q

    def __call__(self, item: _Delivery) -> None:
        with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits for it
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _put_all(deliveries: list[tuple[_Sink, RequestOutput]]) -> None:
    for sink, item in deliveries:
        sink.queue.put_nowait(item)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller gave up waiting
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an internal error."""


class EngineStepError(RuntimeError):
    """The step computing this request failed; the request was ended (the engine lives on)."""


# After a failed step, probe requests (one token, no client) that may fail in a row
# before the engine counts as broken.
MAX_PROBE_FAILURES = 3


class _Admitted:
    """The type of ``_ADMITTED``: the first item of every request queue once the
    engine thread accepted the request."""

    __slots__ = ()


_ADMITTED = _Admitted()
# What a request's sink takes: its admission, its outputs, or the error that ends it.
_Delivery = RequestOutput | BaseException | _Admitted


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
    sink: _Sink
    group: str | None = None
    lora_name: str | None = None
    final: bool = False


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run ``fn(engine)`` on the engine thread (LoRA loads touch the runner)."""

    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future[Any]


class RequestStream:
    """The delta outputs of one admitted request; closing it early aborts it.

    Iterate it once. ``close()`` is idempotent and safe on a stream never
    iterated (a sibling's admission failed, a client left before the first
    chunk)."""

    def __init__(self, engine: AsyncEngine, request_id: str, q: asyncio.Queue[_Delivery]) -> None:
        self.engine, self.request_id, self._queue = engine, request_id, q
        self.done = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.done = True  # the engine already dropped the request
                    raise item
                # add() took the admission off the queue before handing out the stream.
                output = cast(RequestOutput, item)
                yield output
                if output.finished:
                    self.done = True
                    return
        finally:
            self.close()

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.engine.abort(self.request_id)


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        max_waiting_requests: int = 0,
        on_step: Callable[[LLMEngine], None] | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.on_step = on_step
        self.on_fatal = on_fatal
        self._commands: queue.Queue[_Add | _Abort | _Call | None] = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.num_in_flight = 0
        # Adds put on the queue and not yet in the scheduler: with the engine's
        # waiting count they make the queue bound exact under a burst.
        self._admit_lock = threading.Lock()
        self._num_queued_adds = 0
        # Run-time LoRA loads read and check adapters here, one at a time, so
        # the step loop only waits for the final swap into the caches.
        self._lora_reader = ThreadPoolExecutor(1, thread_name_prefix="pdfleet-lora-read")
        # Adapters loaded from the Hub at run time: name -> (hf:// source, the
        # revision asked for, None for the default branch). /v1/models shows
        # them, so the operator can tell which revision an engine serves.
        self.lora_sources: dict[str, tuple[str, str | None]] = {}
        self._hub_loads: dict[tuple[str, str, str | None], asyncio.Future[None]] = {}
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
                # Lends of device-tier blocks are answered now, not after a step.
                self._route(engine.serve_lends())
                if not engine.has_unfinished_requests():
                    if self.on_step is not None:
                        self.on_step(engine)
                    continue
                try:
                    outputs = engine.step()
                except StepFailed as failure:
                    self._fail_step(failure)
                    self._probe()
                    if self.on_step is not None:
                        self.on_step(engine)
                    continue
                idle_step = engine.stats.num_scheduled_tokens == 0
                self._route(outputs)
                if self.on_step is not None:
                    self.on_step(engine)
        except BaseException as e:  # the engine is unusable: fail every request loudly
            logger.exception("engine loop failed; the engine stops serving")
            self.error = e
            self._fail_all(
                EngineDeadError("the engine failed and is restarting; retry the request")
            )
            if self.on_fatal is not None:
                self.on_fatal(e)
            return
        self._fail_all(EngineDeadError("the engine is shutting down"))

    def _fail_all(self, error: EngineDeadError) -> None:
        """End every admitted request and every add still queued (the loop is gone)."""
        for sink in list(self._sinks.values()):
            sink(error)
        self._sinks.clear()
        self.num_in_flight = 0
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                self._took_add()
                cmd.sink(error)
            elif isinstance(cmd, _Call):
                cmd.future.get_loop().call_soon_threadsafe(_settle, cmd.future, None, error)

    def _took_add(self) -> None:
        with self._admit_lock:
            self._num_queued_adds -= 1

    def _route(self, outputs: list[RequestOutput]) -> None:
        deliveries = []
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                deliveries.append((sink, out))
            if out.finished:
                self._sinks.pop(out.request_id, None)
        self.num_in_flight = len(self._sinks)
        self._deliver(deliveries)

    def _probe(self) -> None:
        """After a failed step: can the engine still compute?

        A one-token request with no client is added, and the engine steps
        until a step that ran the model succeeds (the probe's own, or one
        shared with queued requests, whose outputs are delivered as usual).
        A failing step fails its requests and the probe is retried. A request
        that breaks the model only for itself costs its own failure; a broken
        engine fails every probe and the loop gives up (the process exits for
        a restart). At most a few steps: commands wait meanwhile."""
        engine = self.engine
        probe = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        for _ in range(MAX_PROBE_FAILURES):
            rid = f"pdfleet-probe-{uuid.uuid4().hex}"
            engine.add_request(rid, {"prompt_token_ids": [0]}, probe, output_kind="final")
            try:
                for _ in range(64):  # steps that schedule nothing prove nothing; bounded
                    self._route(engine.step())
                    if engine.stats.num_scheduled_tokens or rid not in engine.output.requests:
                        break
            except StepFailed as failure:
                self._fail_step(failure)
                continue
            if rid in engine.output.requests:
                engine.abort_request(rid)
            logger.info("the engine ran a step after a failure; serving on")
            return
        raise RuntimeError(f"the engine failed {MAX_PROBE_FAILURES} probe steps after a failure")

    def _fail_step(self, failure: StepFailed) -> None:
        """End the requests of a failed step with an error; the rest carry on."""
        logger.error(
            "a step failed (%s); failing its %d request(s) and serving on",
            failure,
            len(failure.request_ids),
            exc_info=failure.cause,
        )
        for rid in self.engine.fail_step(failure):
            sink = self._sinks.pop(rid, None)
            if sink is not None:
                sink(EngineStepError("the engine failed while computing this request"))
        self.num_in_flight = len(self._sinks)

    def _deliver(self, deliveries: list[tuple[_Sink, RequestOutput]]) -> None:
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
                # Under the lock, the request moves from the queued adds into the
                # engine's waiting count in one step, as add_request sees it.
                with self._admit_lock:
                    self._num_queued_adds -= 1
                    lora = None
                    if cmd.lora_name is not None:
                        lora = self.engine.resolve_lora(cmd.lora_name)
                        if lora is None:  # unloaded since the server checked it
                            raise LoRAError(f"The model `{cmd.lora_name}` does not exist.")
                    self.engine.add_request(
                        cmd.request_id,
                        {"prompt": cmd.prompt_text, "prompt_token_ids": cmd.prompt_ids},
                        cmd.params,
                        arrival_time=cmd.arrival,
                        priority=cmd.priority,
                        kv_transfer_params=cmd.kv_transfer_params,
                        output_kind="final" if cmd.final else "delta",
                        group=cmd.group,
                        lora_request=lora,
                    )
            except ValueError as e:  # bad input: nothing was queued
                cmd.sink(e)
                return
            except Exception as e:  # a bug on some input: refuse it, keep the engine
                logger.exception("request %s could not be added", cmd.request_id)
                self.engine.abort_request(cmd.request_id)
                cmd.sink(
                    EngineStepError(f"the engine could not take the request ({type(e).__name__})")
                )
                return
            cmd.sink(_ADMITTED)
            self._sinks[cmd.request_id] = cmd.sink
        elif isinstance(cmd, _Abort):
            self._sinks.pop(cmd.request_id, None)
            self.engine.abort_request(cmd.request_id)
        elif isinstance(cmd, _Call):
            loop = cmd.future.get_loop()
            try:
                result = cmd.fn(self.engine)
            except Exception as e:
                loop.call_soon_threadsafe(_settle, cmd.future, None, e)
            else:
                loop.call_soon_threadsafe(_settle, cmd.future, result, None)
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
        """Requests accepted and not running (waiting for room, for a leader's
        prefill or for their first step) plus those queued to join the engine."""
        return self.engine.stats.num_queued_reqs + self._num_queued_adds

    async def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt_text: str | None = None,
        priority: int = 0,
        kv_transfer_params: dict[str, Any] | None = None,
        group: str | None = None,
        lora_name: str | None = None,
        final: bool = False,
    ) -> RequestStream:
        """Queue a request and wait until the engine accepted it.

        Raises the engine's ``ValueError`` for a request it refuses (nothing
        is left behind), :class:`QueueFullError` or :class:`EngineDeadError`.
        ``request_id`` must be unique among requests in flight: the server
        generates it, never takes it from a client. Its stream yields a delta
        each step it progressed; with ``final``, one output at its end holding
        everything (for an answer sent whole: the event loop then does nothing
        for it while it runs)."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[_Delivery] = asyncio.Queue()
        add = _Add(
            request_id,
            prompt_ids,
            prompt_text,
            params,
            time.monotonic(),
            priority,
            kv_transfer_params,
            _Sink(loop, q),
            group,
            lora_name,
            final,
        )
        with self._admit_lock:
            waiting = self.num_waiting()
            if self.max_waiting_requests and waiting >= self.max_waiting_requests:
                raise QueueFullError(
                    f"the server has {waiting} requests waiting (limit "
                    f"{self.max_waiting_requests}); retry later"
                )
            self._num_queued_adds += 1
            self._commands.put(add)
        stream = RequestStream(self, request_id, q)
        # The loop sets error (or _stop) before draining queued adds, so an add put
        # after the drain is seen here instead of waiting forever.
        if self.error is not None or self._stop.is_set():
            raise EngineDeadError("the engine is not running")
        try:
            first = await q.get()
        except BaseException:  # cancelled while waiting: the add may still land
            stream.close()
            raise
        if isinstance(first, BaseException):
            stream.done = True  # refused: there is nothing to abort
            raise first
        if first is not _ADMITTED:
            raise RuntimeError("broken invariant: first is _ADMITTED")
        return stream

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
        stream = await self.add_request(
            request_id, prompt_ids, params, prompt_text, priority, kv_transfer_params
        )
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def call(
        self,
        fn: Callable[[LLMEngine], Any],
        timeout: float = 600.0,  # noqa: ASYNC109 (bounds the engine thread's answer)
    ) -> Any:
        """``fn(engine)`` on the engine thread, between steps; its result or its
        exception. Bounded: a wedged engine thread raises TimeoutError."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._commands.put(_Call(fn, future))
        return await asyncio.wait_for(future, timeout)

    async def load_lora(
        self,
        name: str,
        path: str,
        timeout: float = 600.0,  # noqa: ASYNC109 (bounds the fetch, the read and the swap)
        revision: str | None = None,
    ) -> None:
        """Load an adapter while the engine keeps stepping: an ``hf://ORG/NAME``
        ``path`` is first downloaded (at ``revision``) into the Hugging Face
        cache by a child process (lora/hub.py), then the directory is read and
        checked on the reader thread and installed between two steps. Raises
        LoRAError naming it (and nothing changes) when it cannot be served."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        if is_hub_source(path):
            # One download per (name, source, revision): a caller that gave up
            # (the operator bounds its calls) and asks again joins the load
            # still running, which goes on to install the adapter.
            key = (name, path, revision)
            task = self._hub_loads.get(key)
            if task is None:
                if name in self.engine.loras:
                    raise LoRAError(f"LoRA adapter {name!r} is already loaded", name_taken=True)
                task = asyncio.ensure_future(self._load_hub(name, path, revision, timeout))
                self._hub_loads[key] = task
                task.add_done_callback(functools.partial(self._hub_load_done, key))
            await asyncio.shield(task)
            return
        if revision is not None:
            raise LoRAError(f"LoRA adapter {name!r}: a revision needs an hf://ORG/NAME source")
        await self._load_dir(name, path, timeout)
        self.lora_sources.pop(name, None)

    async def _load_hub(self, name: str, source: str, revision: str | None, timeout: float) -> None:  # noqa: ASYNC109
        path = await fetch_hub_adapter(name, source, revision, timeout)
        await self._load_dir(name, path, timeout)
        self.lora_sources[name] = (source, revision)

    def _hub_load_done(self, key: tuple[str, str, str | None], task: asyncio.Future[None]) -> None:
        self._hub_loads.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved: a caller that left is not told, the next one is

    async def _load_dir(self, name: str, path: str, timeout: float) -> None:  # noqa: ASYNC109
        loop = asyncio.get_running_loop()
        read = loop.run_in_executor(self._lora_reader, self.engine.prepare_lora, name, path)
        prepared = await asyncio.wait_for(read, timeout)
        await self.call(lambda engine: engine.install_lora(prepared), timeout)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        if self.alive:
            # A prefill engine keeps serving its KV leases until they are claimed.
            self.engine.wait_for_kv_leases()
        self._stop.set()
        self._commands.put(None)
        self._lora_reader.shutdown(wait=False, cancel_futures=True)
        self._thread.join(timeout)
        self.engine.shutdown()
