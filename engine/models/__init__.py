"""Model definitions (Hugging Face weight names) and their loader."""

from .registry import get_model_class

__all__ = ["get_model_class"]
