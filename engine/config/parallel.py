"""Parallelism of one engine process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from annotated_types import Ge, Interval

from .hashing import hash_fields


@dataclass
class ParallelConfig:
    """How one engine spreads over devices: tensor parallelism within an engine
    (one rank process per device, docs/parallelism.md); more engines scale out."""

    tensor_parallel_size: Annotated[int, Ge(1)] = 1
    """Number of tensor-parallel ranks (one process and one device each)."""
    pipeline_parallel_size: Annotated[int, Ge(1)] = 1
    """Number of pipeline stages. pdfleet engines run with 1."""
    data_parallel_size: Annotated[int, Ge(1)] = 1
    """Number of data-parallel ranks inside one engine. pdfleet scales with
    replicas instead; engines run with 1."""
    nnodes: Annotated[int, Ge(1)] = 1
    """Nodes one engine spans; each runs tensor_parallel_size / nnodes ranks."""
    node_rank: Annotated[int, Ge(0)] = 0
    """This node's index in the engine (0: the leader, with the API server)."""
    master_addr: str = "127.0.0.1"
    """The leader's address, where every node's ranks meet (nnodes > 1)."""
    master_port: Annotated[int, Interval(ge=1, le=65535)] = 29500
    """The leader's rendezvous port (nnodes > 1; one node picks a free port)."""
    headless: bool = False
    """Run this node's ranks only, without the API server (the nodes after the first)."""

    def __post_init__(self) -> None:
        for name in (
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "data_parallel_size",
            "nnodes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"--nnodes {self.nnodes} does not divide --tensor-parallel-size "
                f"{self.tensor_parallel_size}: every node runs as many ranks"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.node_rank > 0 and not self.headless:
            raise ValueError(
                f"--node-rank {self.node_rank} runs ranks only: add --headless (the node "
                "of rank 0 serves the API)"
            )
        if not 0 < self.master_port < 65536:
            raise ValueError(f"--master-port must be a port, got {self.master_port}")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def check_model(self, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
        """Raise ValueError when the model cannot be split over the ranks."""
        tp = self.tensor_parallel_size
        if tp == 1:
            return
        check_heads_split(num_heads, num_kv_heads, tp)
        if intermediate_size % tp:
            raise ValueError(
                f"--tensor-parallel-size {tp} does not divide the model's intermediate size "
                f"{intermediate_size}"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def compute_hash(self) -> str:
        return hash_fields(self, ("tensor_parallel_size", "pipeline_parallel_size"))


def check_heads_split(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """Raise ValueError when the attention heads cannot be split over ``tp_size``
    ranks (query heads divide evenly; KV heads are sharded, or replicated when
    fewer than the ranks)."""
    if num_heads % tp_size:
        raise ValueError(
            f"--tensor-parallel-size {tp_size} does not divide the model's {num_heads} "
            f"attention heads; pick a divisor of {num_heads}"
        )
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(
            f"--tensor-parallel-size {tp_size} and the model's {num_kv_heads} KV heads: one "
            "must divide the other (KV heads are sharded, or replicated when fewer)"
        )
