"""The engine's step and the runner's result as the tensor-parallel wire
carries them (``contracts/tp_wire.py``: msgpack, nothing is unpickled).

A step goes out once per engine step to every rank (one broadcast); the
result comes back from rank 0 only (every rank computes the same tokens).
This module only maps the scheduler's and the runner's types to the wire's
carriers and back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..contracts.kv_connector import RankCommand
from ..contracts.tp_wire import (
    Step,
    StepLogprobs,
    StepLoRA,
    StepRequest,
    StepResult,
    StepSampling,
)
from ..core.sched_output import (
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from ..lora.manager import LoRAStats
from ..sampling_params import SamplingParams

_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(StepSampling))


def _params(p: SamplingParams) -> StepSampling:
    """The wire's carrier of ``p`` (its fields as they are: the same names,
    a test checks it)."""
    if p.structured_outputs is not None:
        raise TypeError("structured outputs need an in-process model runner (TP=1)")
    fields: dict[str, Any] = {name: getattr(p, name) for name in _SAMPLING_FIELDS}
    return StepSampling(**fields)


def _sampling(s: StepSampling) -> SamplingParams:
    fields: dict[str, Any] = {name: getattr(s, name) for name in _SAMPLING_FIELDS}
    return SamplingParams(**fields)


def pack_step(out: SchedulerOutput, commands: list[RankCommand] | None = None) -> bytes:
    """``commands``: for the ranks' KV shard agents (``contracts/kv_connector.py``)."""
    return Step(
        [
            StepRequest(
                r.req_id,
                r.prompt_token_ids,
                r.output_token_ids,
                _params(r.sampling_params),
                r.block_ids,
                r.num_computed_tokens,
                r.lora_name,
                r.lora_path,
                r.lora_id,
            )
            for r in out.scheduled_new_reqs
        ],
        out.scheduled_cached_reqs,  # already the wire's rows (``StepCached``)
        out.num_scheduled_tokens,
        out.total_num_scheduled_tokens,
        sorted(out.finished_req_ids),
        commands or [],
    ).encode()


def unpack_step(data: bytes | memoryview) -> tuple[SchedulerOutput, list[RankCommand]]:
    """ValueError for a malformed step (sampling fields this version lacks or refuses)."""
    step = Step.decode(data)
    try:
        new = [
            NewRequestData(
                r.req_id,
                r.prompt_token_ids,
                r.output_token_ids,
                _sampling(r.sampling),
                r.block_ids,
                r.num_computed_tokens,
                r.lora_name,
                r.lora_path,
                r.lora_id,
            )
            for r in step.new
        ]
    except (TypeError, ValueError) as e:  # fields SamplingParams refuses
        raise ValueError(f"malformed step sampling: {e}") from None
    out = SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=step.cached,
        num_scheduled_tokens=step.num_scheduled_tokens,
        total_num_scheduled_tokens=step.total_num_scheduled_tokens,
        finished_req_ids=set(step.finished),
    )
    return out, step.commands


def _lp(x: Logprobs | None) -> StepLogprobs | None:
    return None if x is None else StepLogprobs(*x)


def _unlp(x: StepLogprobs | None) -> Logprobs | None:
    return None if x is None else Logprobs(*x)


def pack_result(r: ModelRunnerOutput, lora: Any = None) -> bytes:
    """``lora``: rank 0's ``LoRAStats`` (None without LoRA)."""
    stats = None
    if lora is not None:
        stats = StepLoRA(
            lora.loads,
            lora.load_seconds,
            lora.cpu_evictions,
            lora.gpu_evictions,
            lora.slot_loads,
            list(lora.loaded),
            list(lora.cached),
            dict(lora.resident),
        )
    return StepResult(
        r.sampled_token_ids,
        {k: StepLogprobs(*v) for k, v in r.logprobs.items()},
        {k: [_lp(x) for x in v] for k, v in r.prompt_logprobs.items()},
        sorted(r.finished_sending),
        sorted(r.finished_recving),
        sorted(r.failed_recving),
        r.forward_seconds,
        dict(r.failed_requests),
        stats,
    ).encode()


def unpack_result(data: bytes) -> ModelRunnerOutput:
    return unpack_result_lora(data)[0]


def unpack_result_lora(data: bytes) -> tuple[ModelRunnerOutput, LoRAStats | None]:
    """The step's output, and rank 0's LoRA caches when it sent them."""
    r = StepResult.decode(data)
    lora = None
    if r.lora is not None:
        lora = LoRAStats(
            r.lora.loads,
            r.lora.load_seconds,
            r.lora.cpu_evictions,
            r.lora.gpu_evictions,
            r.lora.slot_loads,
            r.lora.loaded,
            r.lora.cached,
            r.lora.resident,
        )
    return _output(r), lora


def _output(r: StepResult) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        sampled_token_ids=r.sampled_token_ids,
        logprobs={k: Logprobs(*v) for k, v in r.logprobs.items()},
        prompt_logprobs={k: [_unlp(x) for x in v] for k, v in r.prompt_logprobs.items()},
        finished_sending=set(r.finished_sending),
        finished_recving=set(r.finished_recving),
        failed_recving=set(r.failed_recving),
        forward_seconds=r.forward_seconds,
        failed_requests=dict(r.failed_requests),
    )
