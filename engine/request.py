"""One request as the scheduler tracks it (pure Python, no tensors)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .contracts.kv_params import KVTransferParams
from .sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything from here on is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


@dataclass(eq=False)
class Request:
    """Token state of a request. ``num_computed_tokens`` counts tokens whose
    KV is in the cache; ``all_token_ids`` = prompt + output."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    kv_transfer_params: KVTransferParams | None = None
    # Children of an n > 1 request wait for the leader's prefill, then share its blocks.
    wait_for: str | None = None
    # The client request this one is part of (the n children of an n > 1 request,
    # the prompts of a batch): the scheduler bounds the share of a step one group
    # takes while others wait. None: the request is its own group.
    group_id: str | None = None
    # The LoRA adapter the request runs with (None: the base model): its served
    # name, the id of its load (the runner's caches key by it), the PEFT
    # directory the runner reads it from when it is not cached, and its
    # identity (name and weights digest), which keys its prefix-cache blocks.
    lora_name: str | None = None
    lora_path: str | None = None
    lora_id: int = 0
    lora_identity: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling (-1: not yet)
    num_external_computed_tokens: int = 0  # tokens loaded from a remote engine
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    stop_reason: int | str | None = None
    # Timestamps (monotonic) for metrics.
    scheduled_time: float | None = None
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def group(self) -> str:
        return self.group_id if self.group_id is not None else self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        if self.sampling_params.max_tokens is None:
            raise RuntimeError("broken invariant: self.sampling_params.max_tokens is not None")
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> bool:
        """Token-level stop conditions after a new token; sets status/stop_reason."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
