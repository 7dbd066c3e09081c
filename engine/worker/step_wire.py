"""The packed step and its result, as the main process and the rank processes
exchange them (msgpack: nothing is unpickled).

A step goes out once per engine step to every rank (one broadcast); the
result comes back from rank 0 only (every rank computes the same tokens).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from ..contracts.kv_connector import RankCommand, decode_rank_commands, encode_rank_commands
from ..core.sched_output import (
    CachedRequestData,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from ..sampling_params import SamplingParams


def _params(p: SamplingParams) -> dict[str, Any]:
    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.init}


def pack_step(out: SchedulerOutput, commands: list[RankCommand] | None = None) -> bytes:
    """``commands``: for the ranks' KV shard agents (``contracts/kv_connector.py``)."""
    packed: bytes = msgpack.packb(
        [
            [
                [
                    r.req_id,
                    r.prompt_token_ids,
                    r.output_token_ids,
                    _params(r.sampling_params),
                    r.block_ids,
                    r.num_computed_tokens,
                    r.lora_name,
                    r.lora_path,
                    r.lora_id,
                ]
                for r in out.scheduled_new_reqs
            ],
            [[c.req_id, c.new_block_ids, c.num_computed_tokens] for c in out.scheduled_cached_reqs],
            out.num_scheduled_tokens,
            out.total_num_scheduled_tokens,
            sorted(out.finished_req_ids),
            encode_rank_commands(commands) if commands else None,
        ],
        use_bin_type=True,
    )
    return packed


def unpack_step(data: bytes | memoryview) -> tuple[SchedulerOutput, list[RankCommand]]:
    new, cached, num, total, finished, commands = msgpack.unpackb(data, raw=False)
    out = SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData(
                rid, prompt, output, SamplingParams(**params), blocks, computed, name, path, lid
            )
            for rid, prompt, output, params, blocks, computed, name, path, lid in new
        ],
        scheduled_cached_reqs=[CachedRequestData(*c) for c in cached],
        num_scheduled_tokens=num,
        total_num_scheduled_tokens=total,
        finished_req_ids=set(finished),
    )
    return out, decode_rank_commands(commands or [])


def _lp(x: Logprobs | None) -> list[Any] | None:
    return None if x is None else [x.token_ids, x.logprobs, x.rank]


def _unlp(x: list[Any] | None) -> Logprobs | None:
    return None if x is None else Logprobs(*x)


def pack_result(r: ModelRunnerOutput) -> bytes:
    packed: bytes = msgpack.packb(
        [
            r.sampled_token_ids,
            {k: _lp(v) for k, v in r.logprobs.items()},
            {k: [_lp(x) for x in v] for k, v in r.prompt_logprobs.items()},
            sorted(r.finished_sending),
            sorted(r.finished_recving),
            sorted(r.failed_recving),
            r.forward_seconds,
        ],
        use_bin_type=True,
    )
    return packed


def unpack_result(data: bytes) -> ModelRunnerOutput:
    sampled, lps, prompt_lps, sending, recving, failed, seconds = msgpack.unpackb(data, raw=False)
    return ModelRunnerOutput(
        sampled_token_ids=sampled,
        logprobs={k: Logprobs(*v) for k, v in lps.items()},
        prompt_logprobs={k: [_unlp(x) for x in v] for k, v in prompt_lps.items()},
        finished_sending=set(sending),
        finished_recving=set(recving),
        failed_recving=set(failed),
        forward_seconds=seconds,
    )
