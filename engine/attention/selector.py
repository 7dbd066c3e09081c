"""Choosing an attention backend by name (``--attention-backend``).

Kept apart from the interface in ``backend.py`` so that the implementations
import the interface and only this module imports the implementations.
"""

from __future__ import annotations

from .backend import AttentionBackend


def get_attention_backend(name: str) -> AttentionBackend:
    """A fresh backend: ``torch`` (the reference) or ``triton`` (pdfleet's kernels)."""
    if name == "torch":
        from .torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from .triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; use torch or triton")
