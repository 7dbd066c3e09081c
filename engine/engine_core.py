"""The engine step: schedule, run, update. Tokens in, tokens out.

It sits above both the scheduler (``core/``) and the model runner
(``worker/``), which meet only through ``core/sched_output.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from .config import EngineConfig
from .core.scheduler import EngineCoreOutput, Scheduler, SchedulerStats
from .kv_transfer.base import KVConnector
from .request import Request, RequestStatus
from .worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class StepStats(SchedulerStats):
    """Scheduler state after the step plus what the step did."""

    step_seconds: float = 0.0
    forward_seconds: float = 0.0
    num_scheduled_tokens: int = 0
    num_scheduled_reqs: int = 0


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        eos_token_ids: tuple[int, ...] = (),
        connector: KVConnector | None = None,
    ) -> None:
        self.config = config
        self.connector = connector
        self.runner = ModelRunner(config, connector.worker if connector else None, eos_token_ids)
        events = bool(config.kv_events_config and config.kv_events_config.enable_kv_cache_events)
        self.scheduler = Scheduler(
            config,
            self.runner.num_blocks,
            connector.scheduler if connector else None,
            record_kv_events=events,
        )
        self.last_stats = StepStats()
        self.busy_prefill_seconds = 0.0
        self.num_steps = 0

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

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
        return self.scheduler.has_unfinished_requests() or bool(self.scheduler.held_blocks)

    def step(self) -> list[EngineCoreOutput]:
        start = time.perf_counter()
        sched_out = self.scheduler.schedule()
        runner_out = self.runner.execute_model(sched_out)
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
        self.last_stats.step_prompt_tokens = prompt_tokens
        self.last_stats.step_generation_tokens = len(runner_out.sampled_token_ids)
        self.num_steps += 1
        return outputs

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.worker.shutdown()
