"""CUDA-graph capture of decode steps."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Annotated, Literal

from annotated_types import Ge

from .hashing import hash_fields

CUDAGraphMode = Literal["NONE", "FULL_DECODE_ONLY"]
# Accepted spellings (any case) -> the mode.
_CUDAGRAPH_MODES: dict[str, CUDAGraphMode] = {
    "NONE": "NONE",
    "FULL_DECODE_ONLY": "FULL_DECODE_ONLY",
}


@dataclass
class CompilationConfig:
    """CUDA-graph capture configuration.

    pdfleet captures whole decode steps (`FULL_DECODE_ONLY`): a decode batch
    is padded to the next captured size and replayed; prefill and mixed steps
    run eagerly.
    """

    cudagraph_mode: CUDAGraphMode | None = None
    """`FULL_DECODE_ONLY` or `NONE`. Unset: `FULL_DECODE_ONLY` on cuda unless
    `enforce_eager`, else `NONE`."""
    cudagraph_capture_sizes: list[Annotated[int, Ge(1)]] | None = None
    """Decode batch sizes to capture. Unset: 1, 2, 4, then multiples of 8 below
    256, then multiples of 16 up to `max_cudagraph_capture_size`."""
    max_cudagraph_capture_size: Annotated[int, Ge(1)] | None = None
    """Largest batch size to capture. Unset: min(2 * max_num_seqs, 512),
    bounded by max_num_batched_tokens."""

    def __post_init__(self) -> None:
        if self.cudagraph_mode is not None:
            mode = _CUDAGRAPH_MODES.get(str(self.cudagraph_mode).upper())
            if mode is None:
                raise ValueError(
                    f"cudagraph_mode {self.cudagraph_mode!r} is not supported by pdfleet; "
                    "use FULL_DECODE_ONLY or NONE"
                )
            self.cudagraph_mode = mode
        if self.cudagraph_capture_sizes is not None and any(
            s < 1 for s in self.cudagraph_capture_sizes
        ):
            raise ValueError(
                f"cudagraph_capture_sizes must be positive, got {self.cudagraph_capture_sizes}"
            )

    def padded_size(self, batch_size: int) -> int:
        """The smallest captured size >= batch_size (IndexError above the largest)."""
        sizes = self.cudagraph_capture_sizes or []
        pos = bisect.bisect_left(sizes, batch_size)
        if batch_size < 1 or pos == len(sizes):
            raise IndexError(f"no captured CUDA graph for batch size {batch_size}")
        return sizes[pos]

    def compute_hash(self) -> str:
        return hash_fields(self, ("cudagraph_mode", "cudagraph_capture_sizes"))
