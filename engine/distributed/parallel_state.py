"""The tensor-parallel group of this process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This process's place among the engine's tensor-parallel ranks.

    ``group`` is None for the trivial group (size 1): every collective returns
    its input unchanged, so the parallel layers cost nothing at TP=1.
    """

    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks (in place; returns ``x``)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' ``x`` concatenated along ``dim``, rank 0 first."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` on every rank (in place; returns ``x``)."""
        if self.size > 1:
            dist.broadcast(x, src=src, group=self.group)
        return x

    def all_min(self, value: int) -> int:
        """The smallest of the ranks' ``value``."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    @property
    def device(self) -> torch.device:
        """Where this group's collectives take their tensors (NCCL: the rank's GPU)."""
        if self.group is not None and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


_GROUP = TPGroup()


def get_tp_group() -> TPGroup:
    """This process's group (the trivial one unless this is a rank process)."""
    return _GROUP


def set_tp_group(group: TPGroup) -> None:
    """Set once by a rank process after its rendezvous, before the model is built."""
    global _GROUP
    _GROUP = group
