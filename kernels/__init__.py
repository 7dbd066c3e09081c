"""Triton kernels for the engine's hot path, each beside its torch reference.

This package imports nothing of pdfleet (checked by import-linter).
"""
