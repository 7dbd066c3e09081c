"""Attention over the paged KV cache, behind a small backend interface."""

from .backend import AttentionBackend, AttentionMetadata
from .selector import get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
