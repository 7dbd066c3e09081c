"""RMSNorm kernels against their references and transformers' LlamaRMSNorm."""

from __future__ import annotations

import pytest
import torch

from pdfleet.kernels import (
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from pdfleet.kernels.testing import rel_error


@pytest.mark.parametrize("hidden", [64, 200])
def test_rms_norm_matches_transformers_llama_rms_norm(hidden, device):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    module = LlamaRMSNorm(hidden, eps=1e-5).to(device)
    with torch.no_grad():
        module.weight.normal_()
    x = torch.randn(7, hidden, device=device) * 3
    with torch.no_grad():
        expected = module(x)
    out = rms_norm(x, module.weight.detach(), 1e-5)
    assert rel_error(out, expected) <= 1e-5
    assert rel_error(rms_norm_reference(x, module.weight.detach(), 1e-5), expected) == 0


def test_fused_add_rms_norm_returns_normed_sum_and_the_sum(device):
    torch.manual_seed(1)
    x, residual = torch.randn(5, 128, device=device), torch.randn(5, 128, device=device)
    weight = torch.randn(128, device=device)
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_residual = fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, ref_residual)
    assert rel_error(out, ref_out) <= 1e-5


def test_fused_add_rms_norm_in_place_on_its_inputs(device):
    torch.manual_seed(2)
    x, residual, weight = (torch.randn(shape, device=device) for shape in ((6, 96), (6, 96), 96))
    ref_out, ref_residual = fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6, out=x, residual_out=residual)
    assert out is x and new_residual is residual
    assert torch.equal(residual, ref_residual)
    assert rel_error(x, ref_out) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_half_precision_rounds_like_transformers(dtype, device, exact_bf16_casts):
    torch.manual_seed(3)
    x, residual, weight = (
        torch.randn(shape).to(device, dtype) for shape in ((8, 256), (8, 256), 256)
    )
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_residual = fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    assert out.dtype == dtype
    if dtype == torch.float16 or exact_bf16_casts:
        assert torch.equal(new_residual, ref_residual)  # the add rounds once, as in the model
    else:
        assert rel_error(new_residual, ref_residual) <= 2**-7
    # Equal up to the odd last-bit flip of the normalised value before the weight.
    assert rel_error(out, ref_out) <= 1e-2


def test_rms_norm_accepts_strided_rows(device):
    torch.manual_seed(4)
    x = torch.randn(4, 2 * 64, device=device)[:, :64]
    weight = torch.randn(64, device=device)
    assert rel_error(rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6)) <= 1e-5


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.zeros(2, 8), torch.zeros(7)), "weight must have shape"),
        ((torch.zeros(2, 8, 1), torch.zeros(8)), "x must have shape"),
        ((torch.zeros(2, 8), torch.zeros(8, dtype=torch.bfloat16)), "dtypes must match"),
        ((torch.zeros(8, 2).t(), torch.zeros(8)), "x must be dense"),
    ],
)
def test_rms_norm_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        rms_norm(*args, 1e-6)


def test_fused_add_rms_norm_rejects_mismatched_residual():
    with pytest.raises(ValueError, match="residual must have shape"):
        fused_add_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8), torch.zeros(8), 1e-6)
