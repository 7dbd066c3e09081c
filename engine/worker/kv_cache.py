"""Sizing and allocating the paged KV cache."""

from __future__ import annotations

import logging
import os

import torch

from ..config import EngineConfig
from ..distributed import get_tp_group

logger = logging.getLogger(__name__)

GiB = 1 << 30
CPU_KV_CACHE_CAP = 4 * GiB


def local_kv_heads(config: EngineConfig) -> int:
    """KV heads in this rank's cache shard (all of them at TP=1; at least one:
    with fewer KV heads than ranks each rank keeps a replica of its head)."""
    return max(1, config.model_config.num_key_value_heads // get_tp_group().size)


def bytes_per_block(config: EngineConfig, dtype: torch.dtype) -> int:
    """Bytes of one block of this rank's cache shard, every layer, K and V."""
    m = config.model_config
    elem = torch.empty((), dtype=dtype).element_size()
    return (
        2
        * m.num_hidden_layers
        * config.cache_config.block_size
        * (local_kv_heads(config) * m.head_dim * elem)
    )


def available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def cpu_kv_cache_bytes(config: EngineConfig, dtype: torch.dtype) -> int:
    """CPU default: a quarter of available RAM, at most 4 GiB, and no more than
    max_num_seqs full-length sequences need."""
    s = config.scheduler_config
    full = bytes_per_block(config, dtype) * (
        s.max_num_seqs * -(-s.max_model_len // config.cache_config.block_size) + 1
    )
    ranks = get_tp_group().size  # the ranks of one engine share the host's memory
    return min(CPU_KV_CACHE_CAP // ranks, available_ram() // 4 // ranks, full)


def determine_num_blocks(
    config: EngineConfig, dtype: torch.dtype, device: torch.device, profiled_peak: int = 0
) -> int:
    """Blocks for the cache (block 0, the null block, included)."""
    cache = config.cache_config
    per_block = bytes_per_block(config, dtype)
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override + 1
    if cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_by_others = total - free - torch.cuda.memory_reserved(device)
        budget = int(total * cache.gpu_memory_utilization) - profiled_peak - used_by_others
        if budget <= 0:
            raise ValueError(
                f"no memory left for the KV cache: gpu_memory_utilization "
                f"{cache.gpu_memory_utilization} of {total / GiB:.1f} GiB is taken by the model "
                f"({profiled_peak / GiB:.1f} GiB peak) and other processes "
                f"({used_by_others / GiB:.1f} GiB); raise --gpu-memory-utilization"
            )
    else:
        budget = cpu_kv_cache_bytes(config, dtype)
    return max(2, budget // per_block)


def check_fits_max_model_len(config: EngineConfig, num_blocks: int) -> None:
    """One request of max_model_len must fit; with ``--max-model-len auto`` shrink it."""
    m = config.model_config
    bs = config.cache_config.block_size
    capacity = (num_blocks - 1) * bs
    max_model_len = config.scheduler_config.max_model_len
    if capacity >= max_model_len:
        return
    if m.max_model_len_auto:
        logger.warning(
            "max_model_len reduced from %d to %d to fit the KV cache", max_model_len, capacity
        )
        m.max_model_len = capacity
        config.scheduler_config.max_model_len = capacity
        return
    raise ValueError(
        f"the KV cache holds {capacity} tokens ({num_blocks - 1} blocks of {bs}), fewer than "
        f"max_model_len ({m.max_model_len}); raise --gpu-memory-utilization / "
        f"--kv-cache-memory-bytes / --num-gpu-blocks-override, or lower --max-model-len "
        f"(or pass --max-model-len auto)"
    )


def allocate_kv_caches(
    config: EngineConfig, num_blocks: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """One contiguous buffer [layers, 2, blocks, block_size, kv_heads, head_dim] (a
    single region to register with a transfer library) and per-layer (k, v) views."""
    m = config.model_config
    shape = (
        m.num_hidden_layers,
        2,
        num_blocks,
        config.cache_config.block_size,
        local_kv_heads(config),
        m.head_dim,
    )
    buffer = torch.zeros(shape, dtype=dtype, device=device)
    return buffer, [(buffer[i, 0], buffer[i, 1]) for i in range(m.num_hidden_layers)]
