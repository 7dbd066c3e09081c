"""Fixtures for engine tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def hf_model_factory():
    from transformers import AutoModelForCausalLM

    cache = {}

    def load(path: str):
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return load
