"""silu_and_mul against its reference."""

from __future__ import annotations

import pytest
import torch

from pdfleet.kernels import silu_and_mul, silu_and_mul_reference
from pdfleet.kernels.testing import rel_error


@pytest.mark.parametrize("intermediate", [1, 96, 1500])
def test_silu_and_mul_matches_reference(intermediate, device):
    torch.manual_seed(intermediate)
    x = torch.randn(5, 2 * intermediate, device=device) * 4
    assert rel_error(silu_and_mul(x), silu_and_mul_reference(x)) <= 1e-6


def test_silu_and_mul_bf16_into_out(device):
    torch.manual_seed(0)
    x = torch.randn(3, 256, device=device).bfloat16()
    out = torch.empty(3, 128, dtype=torch.bfloat16, device=device)
    assert silu_and_mul(x, out=out) is out
    assert rel_error(out, silu_and_mul_reference(x)) <= 1e-2


@pytest.mark.parametrize(
    ("x", "match"),
    [
        (torch.zeros(2, 7), "must be even"),
        (torch.zeros(8), "x must have shape"),
        (torch.zeros(2, 8, dtype=torch.int64), "x must have dtype"),
    ],
)
def test_silu_and_mul_rejects_bad_arguments(x, match):
    with pytest.raises(ValueError, match=match):
        silu_and_mul(x)
