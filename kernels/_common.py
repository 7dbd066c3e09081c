"""Argument checks and launch helpers shared by the kernel launchers.

Every launcher validates what it is given before launching, because a Triton
kernel handed a wrong shape or stride reads or writes the wrong memory
silently. Failures are ``ValueError``s that say what to change.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Attention takes any head size up to this (powers of two or not: tiles are
# padded to the next power of two and masked).
MAX_HEAD_DIM = 256
# Every block size the engine's cache config allows.
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_tensor(
    name: str,
    t: object,
    shape: Sequence[int | None],
    dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
) -> torch.Tensor:
    """``t`` is a tensor of ``len(shape)`` dims whose sizes match ``shape``
    (``None`` = any size) and whose dtype is one of ``dtypes``."""
    require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(t, torch.Tensor):  # (require raised already: this narrows the type)
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    require(
        t.dim() == len(shape)
        and all(s is None or s == got for s, got in zip(shape, t.shape, strict=True)),
        f"{name} must have shape {want}, got {list(t.shape)}",
    )
    require(
        t.dtype in dtypes,
        f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}",
    )
    return t


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    require(
        all(d == first for d in devices.values()),
        "all tensors must be on one device, got "
        + ", ".join(f"{name} on {d}" for name, d in devices.items()),
    )
    return first


def check_same_dtype(**tensors: torch.Tensor) -> torch.dtype:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    first = next(iter(dtypes.values()))
    require(
        all(d == first for d in dtypes.values()),
        "dtypes must match, got " + ", ".join(f"{name} {d}" for name, d in dtypes.items()),
    )
    return first


def check_rows(name: str, t: torch.Tensor) -> None:
    """All dims but the first are packed row-major (the first may have any
    stride), so one row is one dense run of memory. This admits views such as
    the K slice of a fused QKV projection."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:]), strict=True):
        require(
            size == 1 or stride == expected,
            f"{name} must be dense in every dim but the first (strides {list(t.stride())} for "
            f"shape {list(t.shape)}); pass a .contiguous() tensor",
        )
        expected *= size


def check_contiguous(name: str, t: torch.Tensor) -> None:
    require(t.is_contiguous(), f"{name} must be contiguous; pass {name}.contiguous()")


def check_head_dim(head_dim: int) -> None:
    require(
        0 < head_dim <= MAX_HEAD_DIM,
        f"head_dim must be in 1..{MAX_HEAD_DIM}, got {head_dim}",
    )


def head_tile(head_dim: int) -> int:
    """The head dim as the attention kernels tile it: the next power of two,
    at least 16 (``tl.dot``'s smallest K); the padding lanes are masked."""
    tile: int = triton.next_power_of_2(head_dim)  # triton ships no types
    return max(16, tile)


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Paged caches ``[num_blocks, block_size, num_kv_heads, head_dim]``; returns those four sizes."""
    check_tensor("k_cache", k_cache, (None, None, None, None))
    check_tensor("v_cache", v_cache, tuple(k_cache.shape))
    check_same_dtype(k_cache=k_cache, v_cache=v_cache)
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    require(
        block_size in BLOCK_SIZES,
        f"the attention kernels take block_size {', '.join(map(str, BLOCK_SIZES))}, "
        f"got {block_size}",
    )
    check_head_dim(head_dim)
    return num_blocks, block_size, num_kv_heads, head_dim


def check_gqa(num_heads: int, num_kv_heads: int) -> int:
    """Query heads per KV head."""
    require(
        num_kv_heads > 0 and num_heads % num_kv_heads == 0,
        f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})",
    )
    return num_heads // num_kv_heads


def check_sliding_window(sliding_window: int | None) -> int:
    """The window as the kernels take it: 0 means none."""
    if sliding_window is None:
        return 0
    require(
        isinstance(sliding_window, int) and sliding_window > 0,
        f"sliding_window must be a positive int or None, got {sliding_window!r}",
    )
    return sliding_window


def check_config(
    config: dict[str, int] | None, defaults: dict[str, int], minimum: dict[str, int]
) -> dict[str, int]:
    """``defaults`` updated with a tuning override ``config``: its keys must be
    among the defaults', tile sizes (``BLOCK_*``) and ``num_warps`` powers of
    two, tile sizes at least ``minimum[key]`` (``tl.dot``'s smallest tile)."""
    if config is None:
        return defaults
    unknown = set(config) - set(defaults)
    require(not unknown, f"config keys must be among {sorted(defaults)}, got {sorted(unknown)}")
    merged = defaults | config
    for key, value in merged.items():
        require(isinstance(value, int) and value > 0, f"config {key} must be a positive int")
        if key.startswith("BLOCK_") or key == "num_warps":
            require(value & (value - 1) == 0, f"config {key} must be a power of two, got {value}")
        require(value >= minimum.get(key, 1), f"config {key} must be at least {minimum.get(key)}")
    return merged


def check_out(out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``out`` (allocated like ``like`` when None) with ``like``'s shape, dtype and device."""
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    check_tensor("out", out, tuple(like.shape), (like.dtype,))
    require(out.device == like.device, f"out must be on {like.device}, got {out.device}")
    check_contiguous("out", out)
    return out


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dot_dtype(dtype: torch.dtype, device: torch.device) -> tl.dtype:
    """The dtype attention kernels feed to ``tl.dot``: the tensors' own on a GPU;
    float32 under the interpreter, whose ``tl.dot`` on bfloat16 operands returns
    garbage (Triton 3.x treats their raw bits as integers)."""
    return tl.float32 if device.type == "cpu" else _TL_DTYPES[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    """float32 matmuls run as three TF32 products (about float32 accuracy on
    tensor cores; plain IEEE float32 dots spill registers at these tile
    sizes). The setting only matters for float32 operands."""
    return "tf32x3" if dtype == torch.float32 else "tf32"
