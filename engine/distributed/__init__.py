"""Tensor parallelism on torch.distributed: the rank group and its collectives.

The engine's rank processes (``worker/tp_rank.py``) join one process group
(NCCL on CUDA, gloo on CPU); the parallel layers (``models/parallel.py``) call
the collectives here. A process that is not a rank (the engine at TP=1, the
main process at TP>1) sees the trivial group of size 1, where every
collective is the identity. See docs/parallelism.md.
"""

from .parallel_state import TPGroup, get_tp_group, set_tp_group

__all__ = ["TPGroup", "get_tp_group", "set_tp_group"]
