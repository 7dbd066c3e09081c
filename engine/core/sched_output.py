"""The data contract between the scheduler and the model runner (no tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ..contracts.kv_connector import KVConnectorMetadata
from ..contracts.tp_wire import StepCached
from ..sampling_params import SamplingParams
from .host_tier import KVOffloadOps


class Logprobs(NamedTuple):
    """Log-probabilities at one position: the chosen token first, then the top k."""

    token_ids: list[int]
    """[1 + k]: the chosen (sampled or prompt) token, then the k most likely."""
    logprobs: list[float]
    """[1 + k]: the log-probability of each of ``token_ids``."""
    rank: int
    """Rank of the chosen token in the vocabulary (1 = most likely)."""


@dataclass
class NewRequestData:
    """A request the runner has no state for (first scheduling or resumed after
    preemption): everything needed to rebuild its state."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # The request's LoRA adapter (name, PEFT directory), None for the base model.
    lora_name: str | None = None
    lora_path: str | None = None
    lora_id: int = 0


CachedRequestData = StepCached
"""A request the runner already tracks: only what changed (``req_id``,
``new_block_ids``, ``num_computed_tokens``). It is the tensor-parallel step's
row itself (``contracts/tp_wire.py``), so a step carries every running request
without a copy."""


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # Tokens to compute this step per request (prompt chunk, or 1 for decode).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests whose runner state must be dropped (finished, aborted, preempted).
    finished_req_ids: set[str] = field(default_factory=set)
    # The KV connector's scheduler side to its worker side: the pulls to start.
    kv_connector_metadata: KVConnectorMetadata | None = None
    # Copies between the device cache and the host tier (--kv-offload-bytes).
    kv_offload: KVOffloadOps | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0 and not self.kv_offload


@dataclass
class ModelRunnerOutput:
    """What one step produced, per request that reached the end of its known tokens."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # req_id -> the sampled token's logprobs (requests that asked for them).
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    # req_id -> per prompt position (None for the first token), once its prefill ends.
    prompt_logprobs: dict[str, list[Logprobs | None]] = field(default_factory=dict)
    # KV connector: transfers that completed (or failed) since the last step.
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    # Host slots whose device-to-host copy finished since the last step.
    offload_stores_done: list[int] = field(default_factory=list)
    # req_id -> why it cannot run (its LoRA adapter cannot be read): its row ran
    # without the adapter and sampled nothing; it ends with this error alone.
    failed_requests: dict[str, str] = field(default_factory=dict)
    # Seconds spent in the model forward (for the engine's overhead accounting).
    forward_seconds: float = 0.0
