"""Continuous-batching scheduler limits."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Annotated, Literal

from annotated_types import Ge, Interval

from .hashing import hash_factors

logger = logging.getLogger(__name__)

SchedulerPolicy = Literal["fcfs", "priority"]
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 128


@dataclass
class SchedulerConfig:
    """Limits and policy of the scheduler."""

    max_num_batched_tokens: Annotated[int, Ge(1)] = DEFAULT_MAX_NUM_BATCHED_TOKENS
    """Maximum number of tokens processed in one engine step (the chunked
    prefill budget). The default depends on the device and usage context."""
    max_num_seqs: Annotated[int, Ge(1)] = DEFAULT_MAX_NUM_SEQS
    """Maximum number of sequences in one engine step. The default depends on
    the device and usage context."""
    max_model_len: int = 8192
    """Maximum context length (copied from the model configuration)."""
    enable_chunked_prefill: bool = True
    """Split long prompts into chunks that fit the step's token budget, so
    decodes keep running while a long prompt is prefilled."""
    long_prefill_token_threshold: Annotated[int, Ge(0)] = 0
    """With chunked prefill, a prompt longer than this is scheduled at most
    this many tokens per step (0: no extra limit)."""
    max_num_partial_prefills: int = 1
    """Maximum number of prompts partially prefilled at once. pdfleet supports 1."""
    max_long_partial_prefills: int = 1
    """Maximum number of long prompts partially prefilled at once. pdfleet supports 1."""
    policy: SchedulerPolicy = "fcfs"
    """Scheduling policy: `fcfs` (first come, first served) or `priority`
    (lower `priority` value first, ties by arrival). Under `priority`,
    preemption evicts the lowest-priority running request."""
    max_request_share: Annotated[float, Interval(gt=0, le=1)] = 0.5
    """Largest share of `max_num_seqs`, and of a step's token budget, that the
    sequences of one request (the `n` completions of an `n > 1` request) may
    hold while other requests wait: its other sequences wait, and running ones
    beyond the share are preempted, until the others are scheduled. Alone, a
    request may use every slot. 1 turns the bound off."""
    chunked_prefill_enabled: bool = True
    """Resolved: whether chunked prefill is in effect."""

    def __post_init__(self) -> None:
        self.chunked_prefill_enabled = self.enable_chunked_prefill
        self.verify()

    def verify(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.policy!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.chunked_prefill_enabled and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}) while chunked prefill is off, which would "
                "reject longer prompts. Increase max_num_batched_tokens, decrease max_model_len, "
                "or enable chunked prefill."
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater than or "
                f"equal to max_num_seqs ({self.max_num_seqs})."
            )
        if self.max_num_batched_tokens > self.max_num_seqs * self.max_model_len:
            logger.warning(
                "max_num_batched_tokens (%d) exceeds max_num_seqs * max_model_len (%d); "
                "the excess is never used.",
                self.max_num_batched_tokens,
                self.max_num_seqs * self.max_model_len,
            )
        if not 0.0 < self.max_request_share <= 1.0:
            raise ValueError(
                f"max_request_share must be within (0, 1], got {self.max_request_share}"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}"
            )
        if self.long_prefill_token_threshold > self.max_model_len:
            raise ValueError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) must be <= "
                f"max_model_len ({self.max_model_len})"
            )

    def compute_hash(self) -> str:
        # Step limits change batch sizes, not the computation of a forward pass;
        # the capture sizes they imply are hashed with the compilation config.
        return hash_factors([])
