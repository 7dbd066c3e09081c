"""RMSNorm, optionally fused with the residual add before it.

Semantics are Hugging Face's ``LlamaRMSNorm``: normalise in float32, cast back
to the input dtype, then multiply by the weight (in the input dtype). The fused
form first forms ``new_residual = x + residual`` in the input dtype and
normalises that, as a decoder layer does between its sublayers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_rows, check_same_device, check_same_dtype, check_tensor, require

# One program holds a whole row in registers.
_MAX_HIDDEN = 65536


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _rms_norm_kernel(  # type: ignore[no-untyped-def]  # triton reads parameter annotations (only tl.constexpr)
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    x_stride,  # elements between rows
    residual_stride,
    out_stride,
    residual_out_stride,
    eps,
    N: tl.constexpr,  # hidden size
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_stride + offs, mask=mask, other=0.0)
        # Rounded to the input dtype, as `residual + hidden_states` is in the model.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * residual_out_stride + offs, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / N
    normed = (xf * tl.math.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + offs, mask=mask)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * out_stride + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check_2d_like(name: str, t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if t is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    check_tensor(name, t, tuple(like.shape), (like.dtype,))
    check_rows(name, t)
    require(t.device == like.device, f"{name} must be on {like.device}, got {t.device}")
    return t


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None,
    residual_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    check_tensor("x", x, (None, None))
    num_tokens, hidden = x.shape
    check_tensor("weight", weight, (hidden,))
    check_rows("x", x)
    require(weight.stride(0) == 1 or hidden == 1, "weight must be contiguous")
    require(0 < hidden <= _MAX_HIDDEN, f"hidden size must be in 1..{_MAX_HIDDEN}, got {hidden}")
    require(eps >= 0, f"eps must be non-negative, got {eps}")
    check_same_dtype(x=x, weight=weight)
    check_same_device(x=x, weight=weight)
    out = _check_2d_like("out", out, x)
    if residual is not None:
        check_tensor("residual", residual, (num_tokens, hidden), (x.dtype,))
        check_rows("residual", residual)
        check_same_device(x=x, residual=residual)
        residual_out = _check_2d_like("residual_out", residual_out, x)
    if num_tokens == 0:
        return out, residual_out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_tokens,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        residual_out if residual is not None else out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        residual_out.stride(0) if residual_out is not None else 0,
        float(eps),
        N=hidden,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=min(max(block // 256, 1), 16),
    )
    return out, residual_out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``rmsnorm(x) * weight`` for ``x`` ``[num_tokens, hidden]``, ``weight`` ``[hidden]``."""
    result, _ = _launch(x, None, weight, eps, out, None)
    return result


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x + residual) * weight, x + residual)``.

    ``out``/``residual_out`` may be ``x``/``residual`` themselves (each row is
    read whole before it is written), which makes the call in place.
    """
    result, new_residual = _launch(x, residual, weight, eps, out, residual_out)
    if new_residual is None:
        raise RuntimeError("broken invariant: new_residual is not None")
    return result, new_residual


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``transformers``' LlamaRMSNorm.forward."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return rms_norm_reference(new_residual, weight, eps), new_residual
