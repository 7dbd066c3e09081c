"""The engine step: schedule, run, update. Tokens in, tokens out.

It sits above both the scheduler (``core/``) and the model runner
(``worker/``), which meet only through ``core/sched_output.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from ..config import EngineConfig
from ..core.scheduler import EngineCoreOutput, Scheduler, SchedulerStats
from ..kv_transfer.base import KVConnector
from ..request import Request, RequestStatus
from ..testing_hooks import StepFaults
from ..worker.executor import Executor
from ..worker.model_runner import ModelRunner
from ..worker.tp_executor import RankFailed, TPExecutor

logger = logging.getLogger(__name__)


class StepFailed(RuntimeError):
    """A step raised; ``request_ids`` are the (core) requests it had scheduled.

    The scheduler's state is still consistent: those requests can be finished
    with an error and the engine can keep stepping.
    """

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids
        self.cause = cause


@dataclass
class StepStats(SchedulerStats):
    """Scheduler state after the step plus what the step did."""

    step_seconds: float = 0.0
    forward_seconds: float = 0.0
    num_scheduled_tokens: int = 0
    num_scheduled_reqs: int = 0
    # Host tier (--kv-offload-bytes): bytes copied each way since the start.
    host_kv_stored_bytes: int = 0
    host_kv_loaded_bytes: int = 0


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        eos_token_ids: tuple[int, ...] = (),
        connector: KVConnector | None = None,
    ) -> None:
        self.config = config
        self.connector = connector
        self.runner: Executor
        if config.parallel_config.tensor_parallel_size > 1:
            self.runner = TPExecutor(config, eos_token_ids, connector.worker if connector else None)
        else:
            self.runner = ModelRunner(
                config, connector.worker if connector else None, eos_token_ids
            )
        events = bool(config.kv_events_config and config.kv_events_config.enable_kv_cache_events)
        self.scheduler = Scheduler(
            config,
            self.runner.num_blocks,
            connector.scheduler if connector else None,
            record_kv_events=events,
            num_host_blocks=self.runner.num_host_blocks,
        )
        scheduler = self.scheduler
        self.runner.pin_loras(lambda: {r.lora_id for r in scheduler.requests.values() if r.lora_id})
        self.last_stats = StepStats()
        self.busy_prefill_seconds = 0.0
        self.num_steps = 0
        self.num_failed_steps = 0
        # Load id -> why: adapters a step could not read (their requests
        # failed); the engine unloads them (``LLMEngine.step``).
        self.failed_loras: dict[int, str] = {}
        # The step in progress, read by the HTTP loop (another thread) at each
        # scrape so the gateway can tell a long step from a wedged engine:
        # its start (time.monotonic()) or None between steps, and the tokens
        # it scheduled (0 until scheduled). Plain attribute stores: atomic.
        self.step_started: float | None = None
        self.step_scheduled_tokens = 0
        # Fault injection for tests of the error paths (testing_hooks.py).
        self.faults = StepFaults.from_env()
        self.broken = False
        if self.faults.active or self.faults.step_delay_file is not None:
            logger.warning("fault injection: %s", self.faults.describe())

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)
        # Counted at once, not at the next step: the server's queue bound
        # (``AsyncEngine.add_request``) reads this between steps.
        self.last_stats.num_queued_reqs += 1

    def serve_lends(self) -> list[EngineCoreOutput]:
        """Between steps: the lends added since the last step that finished
        without a forward pass (leased from the device tier, or refused), as
        ``Scheduler.serve_lends`` decides; their outputs go out now, before the
        next step's forward pass."""
        if not self.scheduler.new_lends:
            return []
        self.scheduler.serve_lends()
        ready = self.scheduler.take_ready()
        if ready:
            self._refresh_gauges()
        return ready

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        done = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self._refresh_gauges()
        return done

    def stop_requests(self, request_ids: list[str]) -> list[Request]:
        """End requests that met a stop condition outside the core (stop strings)."""
        done = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)
        self._refresh_gauges()
        return done

    def _refresh_gauges(self) -> None:
        """Scheduler state changed between steps (abort): keep the snapshot current."""
        self.last_stats = dataclasses.replace(self.last_stats, **vars(self.scheduler.stats()))

    def has_work(self) -> bool:
        # Host-tier stores to start or in flight keep the engine stepping until
        # they land, so an idle engine still fills its host tier.
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self.scheduler.held_blocks)
            or self.scheduler.kv.has_offload_work
        )

    def fail_requests(self, request_ids: list[str]) -> list[Request]:
        """Finish requests with an error (after a failed step); frees their blocks
        and takes them out of the prefix cache, since the step may not have
        written them."""
        for rid in request_ids:
            self.scheduler.kv.uncache(rid)
        # Aborted, not errored: a producer must never hold (lease) unwritten blocks.
        done = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self._refresh_gauges()
        return done

    def _inject_fault(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            request = self.scheduler.requests.get(rid)
            prompt = request.prompt_token_ids if request is not None else []
            if self.faults.break_on_token is not None and self.faults.break_on_token in prompt:
                self.broken = True
            if self.faults.raise_on_token is not None and self.faults.raise_on_token in prompt:
                raise RuntimeError(f"injected fault ({self.faults.describe()})")
        if self.broken:
            raise RuntimeError(f"injected fault: the device is broken ({self.faults.describe()})")

    def step(self) -> list[EngineCoreOutput]:
        """One step; a failure while running the model raises :class:`StepFailed`."""
        start = time.perf_counter()
        self.step_scheduled_tokens = 0
        self.step_started = time.monotonic()
        try:
            return self._step(start)
        finally:
            self.step_started = None
            self.step_scheduled_tokens = 0

    def _step(self, start: float) -> list[EngineCoreOutput]:
        per_token = 0.0
        if self.faults.step_delay_file is not None:
            first, per_token = self.faults.step_delay()
            time.sleep(first)
        sched_out = self.scheduler.schedule()
        self.step_scheduled_tokens = sched_out.total_num_scheduled_tokens
        try:
            if self.faults.active:
                self._inject_fault(list(sched_out.num_scheduled_tokens))
            runner_out = self.runner.execute_model(sched_out)
            if per_token and sched_out.total_num_scheduled_tokens:
                slower = per_token * sched_out.total_num_scheduled_tokens
                time.sleep(slower)
                runner_out.forward_seconds += slower
        except RankFailed:
            raise  # not one request's failure: the engine is down
        except Exception as e:
            self.num_failed_steps += 1
            ops = sched_out.kv_offload
            if ops is not None and ops.stores:
                # Stores the worker never started will not land: forget them.
                lost = self.runner.unissued_stores([slot for _b, slot in ops.stores])
                self.scheduler.kv.stores_done(lost, failed=True)
            raise StepFailed(list(sched_out.num_scheduled_tokens), e) from e
        for rid, why in runner_out.failed_requests.items():
            request = self.scheduler.requests.get(rid)
            if request is not None and request.lora_id:
                self.failed_loras.setdefault(request.lora_id, why)
        outputs = self.scheduler.update_from_output(sched_out, runner_out)
        stats = self.scheduler.stats()
        elapsed = time.perf_counter() - start
        prompt_tokens = self.scheduler.last_step_prompt_tokens
        if prompt_tokens:
            self.busy_prefill_seconds += runner_out.forward_seconds
        self.last_stats = StepStats(
            **vars(stats),
            step_seconds=elapsed,
            forward_seconds=runner_out.forward_seconds,
            num_scheduled_tokens=sched_out.total_num_scheduled_tokens,
            num_scheduled_reqs=len(sched_out.num_scheduled_tokens),
        )
        stored, loaded = self.runner.host_kv_bytes()
        self.last_stats.host_kv_stored_bytes = stored
        self.last_stats.host_kv_loaded_bytes = loaded
        self.last_stats.step_prompt_tokens = prompt_tokens
        self.last_stats.step_generation_tokens = len(runner_out.sampled_token_ids)
        self.num_steps += 1
        return outputs

    def shutdown(self) -> None:
        self.runner.shutdown()
        if self.connector is not None:
            self.connector.worker.shutdown()
