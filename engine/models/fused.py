"""The decoder's element-wise hot path: RMSNorm (fused with the residual add),
RoPE on q and k, and SiLU-and-mul.

Each op has two implementations and both live in ``pdfleet.kernels``: the
Triton kernel, and its plain torch reference. A model runs the kernels when
its attention backend is ``triton`` (the CUDA default; under Triton's
interpreter on a CPU) and the references otherwise, chosen per model by
:func:`use_kernels` so that two engines in one process may differ. The math
itself, RoPE's frequency tables included, is written once, in ``kernels/``
(see docs/gpu.md).

The modules that call these functions carry a ``fused`` attribute (False
until :func:`use_kernels` sets it).
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch
from torch import nn


@functools.cache
def kernels() -> ModuleType:
    """``pdfleet.kernels``, imported once. Without a GPU its kernels can only run
    under Triton's interpreter, which must be chosen before the first import."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from ... import kernels as module

    return module


def use_kernels(model: nn.Module, on: bool) -> int:
    """Switches every fused-op module of ``model`` to the Triton kernels (``on``)
    or to the torch references; returns how many modules it switched. Mutates
    ``model``."""
    switched = 0
    for module in model.modules():
        if hasattr(module, "fused"):
            module.fused = on  # type: ignore[assignment]  # a plain bool attribute set by the fused modules
            switched += 1
    return switched


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    fused: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``rmsnorm(x) * weight`` over the last dim, or, given ``residual``,
    ``(rmsnorm(x + residual) * weight, x + residual)`` in one pass."""
    k = kernels()
    if not fused:
        if residual is None:
            normed: torch.Tensor = k.rms_norm_reference(x, weight, eps)
            return normed
        both: tuple[torch.Tensor, torch.Tensor] = k.fused_add_rms_norm_reference(
            x, residual, weight, eps
        )
        return both
    shape = x.shape
    rows = x.reshape(-1, shape[-1])  # [tokens (* heads), width]; copies only a strided q/k
    if residual is None:
        normed = k.rms_norm(rows, weight, eps)
        return normed.view(shape)
    out: torch.Tensor
    new_residual: torch.Tensor
    out, new_residual = k.fused_add_rms_norm(rows, residual.reshape(-1, shape[-1]), weight, eps)
    return out.view(shape), new_residual.view(shape)


def rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates ``q`` ``[tokens, heads, head_dim]`` and ``k`` ``[tokens, kv_heads,
    head_dim]`` in place (neox style, as Hugging Face's ``rotate_half``); returns
    them. Both may be strided slices of the fused QKV output."""
    ops = kernels()
    head_dim = q.shape[-1]
    if fused:
        ops.rotary_embedding(positions, q, k, cos_sin_cache, head_dim, is_neox=True)
    else:
        ops.rotary_embedding_reference(positions, q, k, cos_sin_cache, head_dim, is_neox=True)
    return q, k


def silu_and_mul(x: torch.Tensor, fused: bool) -> torch.Tensor:
    """``silu(gate) * up`` for ``x`` ``[tokens, 2 * intermediate]`` = ``[gate | up]``."""
    k = kernels()
    out: torch.Tensor = k.silu_and_mul(x) if fused else k.silu_and_mul_reference(x)
    return out
