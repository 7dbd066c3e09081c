"""pdfleet's inference engine.

Names are imported lazily so that ``pdfleet.engine.config`` (and the CLI's
help) stay importable without torch, e.g. in the operator image.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "LLM": "pdfleet.engine.llm",
    "SamplingParams": "pdfleet.engine.sampling_params",
    "RequestOutput": "pdfleet.engine.outputs",
    "CompletionOutput": "pdfleet.engine.outputs",
    "EngineArgs": "pdfleet.engine.config",
    "EngineConfig": "pdfleet.engine.config",
    "LoRARequest": "pdfleet.engine.lora.adapter",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pdfleet.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
