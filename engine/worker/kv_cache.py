"""Sizing and allocating the paged KV cache."""

from __future__ import annotations

import logging
import os

import torch

from ..config import EngineConfig
from ..distributed import get_tp_group

logger = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20
# CPU default (no --kv-cache-memory-bytes): the cache takes at most this
# fraction of the model's weights, at least CPU_KV_CACHE_FLOOR (a small model
# still gets a usable cache), and at most CPU_AVAILABLE_SHARE of the memory
# available when the engine starts.
CPU_KV_WEIGHT_FRACTION = 0.25
CPU_KV_CACHE_FLOOR = 64 * MiB
CPU_AVAILABLE_SHARE = 0.25


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
    """Bytes this process may still allocate: the kernel's MemAvailable, lowered
    to the headroom of the memory cgroup when it has a limit (a container's
    limit, which MemAvailable, a host-wide figure, does not see)."""
    host = _meminfo_available()
    headroom = cgroup_headroom()
    return host if headroom is None else min(host, headroom)


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def cgroup_headroom(root: str = "/sys/fs/cgroup") -> int | None:
    """Limit minus usage of this process's memory cgroup (v2, else v1), or None
    when there is no limit (or no cgroup file to read)."""
    for limit_file, usage_file in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        try:
            with open(os.path.join(root, limit_file)) as f:
                limit_text = f.read().strip()
            with open(os.path.join(root, usage_file)) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max":
            return None
        try:
            limit = int(limit_text)
        except ValueError:
            continue
        # cgroup v1 reports "no limit" as a huge number near 2**63.
        if limit >= 1 << 60:
            return None
        return max(0, limit - usage)
    return None


def cpu_kv_cache_bytes(config: EngineConfig, dtype: torch.dtype, weight_bytes: int) -> int:
    """CPU default, sized from the model and the machine: a quarter of this
    rank's weights (at least 64 MiB, and at least one ``max_model_len``
    sequence), no more than ``max_num_seqs`` full-length sequences need, and no
    more than a quarter of the memory available now (the ranks of one engine
    share the host). A CPU engine's throughput is bound by its weights'
    matmuls, so a cache far larger than the weights buys concurrency it cannot
    serve; a host shared with other engines keeps most of its free memory.
    ``--kv-cache-memory-bytes`` (``spec.engine.kvCacheMemoryBytes``) replaces it."""
    s = config.scheduler_config
    bs = config.cache_config.block_size
    per_block = bytes_per_block(config, dtype)
    full = per_block * (s.max_num_seqs * -(-s.max_model_len // bs) + 1)
    one_sequence = per_block * (-(-s.max_model_len // bs) + 1)
    by_model = max(int(weight_bytes * CPU_KV_WEIGHT_FRACTION), CPU_KV_CACHE_FLOOR, one_sequence)
    ranks = get_tp_group().size
    by_machine = int(available_ram() * CPU_AVAILABLE_SHARE) // ranks
    return min(full, by_model, by_machine)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers (this rank's shard)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def determine_num_blocks(
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    profiled_peak: int = 0,
    weights: int = 0,
) -> int:
    """Blocks for the cache (block 0, the null block, included). ``weights``:
    bytes of this rank's model (the CPU default is sized from it)."""
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
        budget = cpu_kv_cache_bytes(config, dtype, weights)
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
