"""The CPU KV-cache default: sized from the model's weights and the memory
available (a container's cgroup limit included), within what max_num_seqs
full-length sequences need; --kv-cache-memory-bytes replaces it."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from pdfleet.engine.config import EngineArgs
from pdfleet.engine.worker import kv_cache
from pdfleet.engine.worker.kv_cache import (
    CPU_KV_CACHE_FLOOR,
    GiB,
    MiB,
    bytes_per_block,
    cgroup_headroom,
    cpu_kv_cache_bytes,
    determine_num_blocks,
)

F32 = torch.float32


def config(model: str, **kw):
    return EngineArgs(model=model, **kw).create_engine_config(device="cpu")


def sequences(cfg, n: int) -> int:
    """Bytes of n max_model_len sequences (and the null block)."""
    bs = cfg.cache_config.block_size
    return bytes_per_block(cfg, F32) * (n * -(-cfg.scheduler_config.max_model_len // bs) + 1)


def test_the_cache_is_a_quarter_of_the_weights_when_the_machine_has_room(tiny_model):
    cfg = config(tiny_model, max_model_len=2048, max_num_seqs=2048, max_num_batched_tokens=4096)
    with mock.patch.object(kv_cache, "available_ram", return_value=64 * GiB):
        assert cpu_kv_cache_bytes(cfg, F32, weight_bytes=2 * GiB) == 512 * MiB
        # A small model still gets the floor; it never takes what it cannot use.
        assert cpu_kv_cache_bytes(cfg, F32, weight_bytes=MiB) == CPU_KV_CACHE_FLOOR
    few = config(tiny_model, max_model_len=128, max_num_seqs=2)
    with mock.patch.object(kv_cache, "available_ram", return_value=64 * GiB):
        assert cpu_kv_cache_bytes(few, F32, weight_bytes=2 * GiB) == sequences(few, 2)


def test_the_cache_takes_at_most_a_quarter_of_the_available_memory(tiny_model):
    cfg = config(tiny_model, max_model_len=2048, max_num_seqs=2048, max_num_batched_tokens=4096)
    with mock.patch.object(kv_cache, "available_ram", return_value=1 * GiB):
        assert cpu_kv_cache_bytes(cfg, F32, weight_bytes=8 * GiB) == 256 * MiB


def test_the_model_share_holds_at_least_one_full_length_sequence(tiny_model):
    cfg = config(tiny_model, max_model_len=4096, max_num_seqs=64, block_size=16)
    one = sequences(cfg, 1)
    with (
        mock.patch.object(kv_cache, "CPU_KV_CACHE_FLOOR", 1),
        mock.patch.object(kv_cache, "available_ram", return_value=64 * GiB),
    ):
        assert cpu_kv_cache_bytes(cfg, F32, weight_bytes=0) == one


def test_the_flag_replaces_the_default(tiny_model):
    cfg = config(tiny_model, max_model_len=256, kv_cache_memory_bytes=8 * MiB)
    per_block = bytes_per_block(cfg, F32)
    blocks = determine_num_blocks(cfg, F32, torch.device("cpu"), weights=64 * GiB)
    assert blocks == 8 * MiB // per_block


def test_a_cgroup_limit_lowers_what_counts_as_available(tmp_path):
    (tmp_path / "memory.max").write_text("1073741824\n")
    (tmp_path / "memory.current").write_text("805306368\n")
    assert cgroup_headroom(str(tmp_path)) == 256 * MiB
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_headroom(str(tmp_path)) is None
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(1 << 62))  # v1's "no limit"
    (v1 / "memory" / "memory.usage_in_bytes").write_text("1000")
    assert cgroup_headroom(str(v1)) is None
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(2 * GiB))
    assert cgroup_headroom(str(v1)) == 2 * GiB - 1000
    assert cgroup_headroom(str(tmp_path / "absent")) is None


@pytest.mark.parametrize("headroom", [None, 300 * MiB])
def test_available_ram_is_the_lower_of_the_host_and_the_cgroup(headroom):
    with (
        mock.patch.object(kv_cache, "_meminfo_available", return_value=4 * GiB),
        mock.patch.object(kv_cache, "cgroup_headroom", return_value=headroom),
    ):
        assert kv_cache.available_ram() == (4 * GiB if headroom is None else headroom)
