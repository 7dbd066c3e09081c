"""The paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from annotated_types import Ge, Interval

from .fields import OneOf
from .hashing import hash_fields

CacheDType = Literal["auto", "bfloat16", "float16", "float32"]
PrefixCachingHashAlgo = Literal["sha256", "sha256_cbor"]
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
DEFAULT_BLOCK_SIZE = 16


@dataclass
class CacheConfig:
    """Configuration of the paged KV cache."""

    block_size: Annotated[int, OneOf(BLOCK_SIZES)] = DEFAULT_BLOCK_SIZE
    """Number of tokens per KV-cache block (1, 8, 16, 32, 64, 128 or 256; the
    Triton kernels take 16 or 32). Defaults to 16."""
    gpu_memory_utilization: Annotated[float, Interval(gt=0, le=1)] = 0.9
    """Fraction of device memory the engine may use in all (weights,
    activations and KV cache), from 0 to 1. Ignored when
    `kv_cache_memory_bytes` is set. On CPU see `kv_cache_memory_bytes`."""
    kv_cache_memory_bytes: Annotated[int, Ge(1)] | None = None
    """Bytes of memory for the KV cache, overriding `gpu_memory_utilization`.
    On CPU, when unset, the cache is sized from the model and the machine: a
    quarter of the weights' bytes (at least 64 MiB and one max_model_len
    sequence), within a quarter of the available memory (a container's limit
    included) and what max_num_seqs full-length sequences need."""
    kv_offload_bytes: Annotated[int, Ge(1)] | None = None
    """Bytes of host memory for a second KV-cache tier: blocks evicted from the
    device cache are kept there (pinned memory when the cache is on CUDA) and
    copied back on a later prefix hit instead of being recomputed
    (docs/kv_offload.md). Unset: no host tier."""
    cache_dtype: CacheDType = "auto"
    """Data type of the KV cache; `auto` uses the model's dtype."""
    num_gpu_blocks_override: Annotated[int, Ge(1)] | None = None
    """Number of KV-cache blocks to allocate, overriding the memory-based
    computation (for tests and benchmarks)."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of identical prompt prefixes across requests."""
    prefix_caching_hash_algo: PrefixCachingHashAlgo = "sha256"
    """Hash of full blocks for prefix caching: `sha256` (of a canonical byte
    encoding of the parent hash and token ids) or `sha256_cbor` (of their CBOR
    encoding, reproducible outside Python)."""
    sliding_window: int | None = None
    """Sliding attention window, from the model (set by the engine)."""
    num_gpu_blocks: int | None = None
    """Number of KV-cache blocks actually allocated (set by the engine at start)."""
    num_cpu_blocks: int | None = None
    """Number of host-tier blocks allocated for `kv_offload_bytes` (set by the
    engine at start)."""

    def __post_init__(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(
                f"block_size must be one of {', '.join(map(str, BLOCK_SIZES))}, got {self.block_size}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}"
            )
        if self.kv_offload_bytes is not None and self.kv_offload_bytes <= 0:
            raise ValueError(
                f"kv_offload_bytes must be positive, got {self.kv_offload_bytes}; "
                "leave --kv-offload-bytes unset for no host tier"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}"
            )
        if self.cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(
                f"kv_cache_dtype {self.cache_dtype!r} is not supported by pdfleet; "
                "use auto, bfloat16, float16 or float32"
            )
        if self.prefix_caching_hash_algo not in ("sha256", "sha256_cbor"):
            raise ValueError(
                f"prefix_caching_hash_algo must be sha256 or sha256_cbor, got "
                f"{self.prefix_caching_hash_algo!r}"
            )

    def compute_hash(self) -> str:
        return hash_fields(self, ("cache_dtype", "block_size", "sliding_window"))
