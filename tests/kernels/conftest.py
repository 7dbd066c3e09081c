"""The kernel tests run on the GPU when there is one, else under Triton's
interpreter on the CPU (tests/conftest.py sets TRITON_INTERPRET=1 then)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def exact_bf16_casts(device) -> bool:
    """Whether float32 -> bfloat16 casts inside kernels round to nearest even.
    Triton's interpreter truncates instead (a 1-ulp difference), so tests
    that expect bit-exact bfloat16 results loosen to one ulp there."""
    return device.type == "cuda"
