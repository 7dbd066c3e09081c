"""SiLU-and-mul, the gated activation of a Llama MLP.

``x`` ``[num_tokens, 2 * intermediate]`` holds the gate projection then the up
projection (one fused matmul); the result is ``silu(gate) * up``
``[num_tokens, intermediate]``, computed in float32 and rounded once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import check_rows, check_tensor, require

_BLOCK = 1024


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _silu_and_mul_kernel(  # type: ignore[no-untyped-def]  # triton reads parameter annotations (only tl.constexpr)
    x_ptr,
    out_ptr,
    x_stride,  # elements between rows
    out_stride,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTERMEDIATE
    gate = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + INTERMEDIATE + offs, mask=mask, other=0.0)
    out = gate * tl.sigmoid(gate) * up.to(tl.float32)
    tl.store(out_ptr + row * out_stride + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x`` ``[num_tokens, 2 * I]``."""
    check_tensor("x", x, (None, None))
    num_tokens, width = x.shape
    require(width % 2 == 0, f"x's last dim must be even (gate and up halves), got {width}")
    check_rows("x", x)
    intermediate = width // 2
    if out is None:
        out = torch.empty((num_tokens, intermediate), dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, (num_tokens, intermediate), (x.dtype,))
        check_rows("out", out)
        require(out.device == x.device, f"out must be on {x.device}, got {out.device}")
    if num_tokens == 0 or intermediate == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(intermediate))
    grid = (num_tokens, triton.cdiv(intermediate, block))
    _silu_and_mul_kernel[grid](
        x,
        out,
        x.stride(0),
        out.stride(0),
        INTERMEDIATE=intermediate,
        BLOCK=block,
        num_warps=4,
    )
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    intermediate = x.shape[-1] // 2
    return F.silu(x[:, :intermediate]) * x[:, intermediate:]
