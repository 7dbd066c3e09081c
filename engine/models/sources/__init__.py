"""Where a model comes from, made into a directory the engine reads.

``hub.py`` downloads ``hf://`` sources; ``gguf.py`` turns a GGUF file's
metadata into config and tokenizer files. The engine configuration reads only
a directory: :func:`create_engine_config` prepares it first, so a GGUF file
(or a directory holding only one) is served like any checkpoint. The names a
fetch shares with the operator (``hf://`` grammar, environment variables, the
cache directory) are ``engine/contracts/model_source.py``. Torch-free.
"""

from __future__ import annotations

from typing import Any

from ...config import EngineArgs, EngineConfig
from .gguf import resolve_model_dir


def create_engine_config(args: EngineArgs, **kwargs: Any) -> EngineConfig:
    """``args.create_engine_config(**kwargs)`` with the model's directory
    prepared (a GGUF file's config and tokenizer written once into the cache)."""
    model_dir = resolve_model_dir(args.model) if args.model else None
    return args.create_engine_config(model_dir=model_dir, **kwargs)
