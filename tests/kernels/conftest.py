"""The kernel tests run on the GPU when there is one, else under Triton's
interpreter on the CPU (the root conftest.py sets TRITON_INTERPRET=1 then);
tests/helpers/device.py decides which."""

from __future__ import annotations

import pytest
import torch
from helpers.device import test_device


@pytest.fixture(scope="session")
def device() -> torch.device:
    return test_device()


@pytest.fixture(scope="session")
def exact_bf16_casts(device) -> bool:
    """Whether float32 -> bfloat16 casts inside kernels round to nearest even.
    Triton's interpreter truncates instead (a 1-ulp difference), so tests
    that expect bit-exact bfloat16 results loosen to one ulp there."""
    return device.type == "cuda"
