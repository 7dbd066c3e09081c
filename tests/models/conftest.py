"""The real built-in model, SmolLM2-135M-Instruct (a Q4_1 GGUF), prepared once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The prepared model directory (config, tokenizer, link to the GGUF file)."""
    from pdfleet.engine.tiny.registry import builtin_model_dir

    return builtin_model_dir("smollm2-135m-instruct")
