"""Which device the tests run on, and each engine's share of it.

One place decides: ``PDFLEET_TEST_DEVICE`` (``cpu`` or ``cuda``) when set,
else CUDA when a GPU is visible. On CUDA several engines of one test share the
GPU, so each is given a fixed KV-cache budget (``--kv-cache-memory-bytes``)
instead of claiming ``--gpu-memory-utilization`` (90%) of it; see
docs/gpu.md.
"""

from __future__ import annotations

import os

# Each engine's KV cache on a shared GPU: room for the tests' tiny models at
# every max_model_len they use, and for dozens of engines on one GPU.
KV_CACHE_BYTES_PER_ENGINE = 256 << 20
_MEMORY_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization", "--num-gpu-blocks-override")


def device_name() -> str:
    """``cuda`` or ``cpu``: the device the tests' engines and comparisons use."""
    wanted = os.environ.get("PDFLEET_TEST_DEVICE")
    if wanted is not None:
        if wanted not in ("cpu", "cuda"):
            raise ValueError(f"PDFLEET_TEST_DEVICE must be cpu or cuda, got {wanted!r}")
        return wanted
    try:
        import torch
    except ImportError:  # the operator-only install has no torch
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def test_device():
    """The ``torch.device`` to run tensors on."""
    import torch

    return torch.device(device_name())


test_device.__test__ = False  # a helper, not a test


def on_cuda() -> bool:
    return device_name() == "cuda"


def engine_memory_args(args: list[str]) -> list[str]:
    """``pdfleet serve`` flags giving one engine its share of the GPU, unless
    ``args`` already size its memory; none on CPU."""
    if not on_cuda() or any(a.split("=")[0] in _MEMORY_FLAGS for a in args):
        return []
    return ["--kv-cache-memory-bytes", str(KV_CACHE_BYTES_PER_ENGINE)]


def engine_memory_kwargs(kwargs: dict) -> dict:
    """The same share as ``LLM(...)`` keyword arguments."""
    sized = {"kv_cache_memory_bytes", "gpu_memory_utilization", "num_gpu_blocks_override"}
    if not on_cuda() or sized & set(kwargs):
        return {}
    return {"kv_cache_memory_bytes": KV_CACHE_BYTES_PER_ENGINE}


def engine_memory_spec() -> dict:
    """The same share as an InferenceService ``spec.engine`` fragment (``pdfleet up``)."""
    return {"kvCacheMemoryBytes": KV_CACHE_BYTES_PER_ENGINE} if on_cuda() else {}
