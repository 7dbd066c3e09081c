"""Parallelism of one engine process."""

from __future__ import annotations

from dataclasses import dataclass

from .hashing import hash_fields


@dataclass
class ParallelConfig:
    """How one engine spreads over devices. pdfleet scales out with replicas
    (more prefill or decode engines), so each engine runs on one device."""

    tensor_parallel_size: int = 1
    """Number of tensor-parallel ranks. pdfleet engines run with 1."""
    pipeline_parallel_size: int = 1
    """Number of pipeline stages. pdfleet engines run with 1."""
    data_parallel_size: int = 1
    """Number of data-parallel ranks inside one engine. pdfleet scales with
    replicas instead; engines run with 1."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def compute_hash(self) -> str:
        return hash_fields(self, ("tensor_parallel_size", "pipeline_parallel_size"))
