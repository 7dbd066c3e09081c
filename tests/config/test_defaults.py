"""Default resolution of batch limits, chunked prefill and prefix caching (the seeds' rules)."""

from __future__ import annotations

import logging

import pytest

from pdfleet.engine.config import EngineArgs

GiB = 1 << 30


def resolve(model, usage=None, device="cpu", memory=None, name=None, **kw):
    return EngineArgs(model=model, device=device, **kw).create_engine_config(
        usage_context=usage, device_memory_bytes=memory, device_name=name
    )


@pytest.mark.parametrize(
    ("device", "memory", "name", "usage", "kw", "tokens", "seqs"),
    [
        # CPU scales with world size (1 here).
        ("cpu", None, None, "llm", {}, 4096, 256),
        ("cpu", None, None, "server", {}, 2048, 128),
        # Large-memory GPUs that are not A100s take larger batches.
        ("cuda", 141 * GiB, "NVIDIA H200", "llm", {}, 16384, 1024),
        ("cuda", 141 * GiB, "NVIDIA H200", "server", {}, 8192, 1024),
        ("cuda", 80 * GiB, "NVIDIA A100-SXM4-80GB", "llm", {}, 8192, 256),
        ("cuda", 80 * GiB, "NVIDIA A100-SXM4-80GB", "server", {}, 2048, 256),
        ("cuda", 24 * GiB, "NVIDIA L4", "server", {}, 2048, 256),
        # A GPU that cannot be queried (not on this machine) gets the generic defaults.
        ("cuda", None, None, "server", {}, 2048, 256),
        # No usage context: the scheduler's own defaults.
        ("cpu", None, None, None, {}, 2048, 128),
        # Throughput mode doubles what was defaulted, not what was given.
        ("cpu", None, None, "server", {"performance_mode": "throughput"}, 4096, 256),
        (
            "cpu",
            None,
            None,
            "server",
            {"performance_mode": "throughput", "max_num_seqs": 8},
            4096,
            8,
        ),
        ("cuda", 141 * GiB, "H200", "llm", {"performance_mode": "throughput"}, 32768, 2048),
        # max_num_seqs defaults to at most max_num_batched_tokens.
        ("cpu", None, None, "server", {"max_num_batched_tokens": 64}, 64, 64),
        # Without chunked prefill a whole prompt must fit a step: max(max_model_len, default).
        ("cpu", None, None, "server", {"enable_chunked_prefill": False}, 4096, 128),
        # ... but never more than max_num_seqs * max_model_len.
        ("cpu", None, None, "llm", {"max_model_len": 8}, 2048, 256),
        ("cpu", None, None, "llm", {"max_model_len": 8, "max_num_seqs": 4}, 32, 4),
    ],
)
def test_batch_defaults(tiny_model, device, memory, name, usage, kw, tokens, seqs):
    sched = resolve(tiny_model, usage, device, memory, name, **kw).scheduler_config
    assert (sched.max_num_batched_tokens, sched.max_num_seqs) == (tokens, seqs)


def test_explicit_limits_are_kept(tiny_model):
    sched = resolve(
        tiny_model, "server", max_num_batched_tokens=512, max_num_seqs=16
    ).scheduler_config
    assert (sched.max_num_batched_tokens, sched.max_num_seqs) == (512, 16)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"max_num_batched_tokens": 8, "max_num_seqs": 16},
            r"max_num_batched_tokens \(8\) must be greater than or equal to max_num_seqs \(16\)",
        ),
        (
            {
                "max_num_batched_tokens": 256,
                "enable_chunked_prefill": False,
                "enable_prefix_caching": False,
            },
            r"max_num_batched_tokens \(256\) is smaller than max_model_len \(4096\)",
        ),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold must be >= 0"),
        ({"max_num_seqs": 0, "max_num_batched_tokens": 64}, "max_num_seqs must be >= 1"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"block_size": 24}, "block_size must be one of"),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes must be positive"),
        ({"num_gpu_blocks_override": 0}, "num_gpu_blocks_override must be >= 1"),
        ({"max_num_seqs": "many"}, "--max-num-seqs"),
        ({"scheduling_policy": "lifo"}, "--scheduling-policy"),
    ],
)
def test_invalid_combinations_raise(tiny_model, kw, message):
    with pytest.raises(ValueError, match=message):
        resolve(tiny_model, "server", **kw)


@pytest.mark.parametrize(
    ("kw", "chunked", "prefix"),
    [
        ({}, True, True),
        ({"enable_prefix_caching": False}, True, False),
        # Chunked prefill off alone: prefix caching (on by default) keeps it from the off-switch.
        ({"enable_chunked_prefill": False}, False, True),
        ({"enable_chunked_prefill": False, "enable_prefix_caching": False}, False, False),
        ({"enable_chunked_prefill": True, "enable_prefix_caching": True}, True, True),
    ],
)
def test_chunked_prefill_and_prefix_caching_defaults(tiny_model, kw, chunked, prefix):
    cfg = resolve(tiny_model, "server", **kw)
    assert cfg.scheduler_config.chunked_prefill_enabled is chunked
    assert cfg.cache_config.enable_prefix_caching is prefix


def test_chunked_prefill_off_switch_clears_long_prefill_threshold(tiny_model):
    cfg = resolve(
        tiny_model,
        "server",
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        long_prefill_token_threshold=64,
    )
    assert cfg.scheduler_config.long_prefill_token_threshold == 0


def test_block_size_and_kv_dtype_defaults(tiny_model):
    cfg = resolve(tiny_model, "server")
    assert cfg.cache_config.block_size == 16
    assert cfg.kv_cache_dtype == cfg.model_config.dtype == "float32"
    cfg = resolve(tiny_model, "server", device="cuda")
    assert cfg.kv_cache_dtype == "bfloat16"
    assert cfg.device_config.attention_backend == "triton"
    assert resolve(tiny_model, "server").device_config.attention_backend == "torch"


def test_kv_events_warnings(tiny_model, caplog):
    with caplog.at_level(logging.WARNING):
        resolve(
            tiny_model,
            "server",
            enable_prefix_caching=False,
            kv_events_config={"enable_kv_cache_events": True},
        )
    assert "prefix caching is not enabled" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        cfg = resolve(tiny_model, "server", kv_events_config={"publisher": "zmq"})
    assert "KV cache events are disabled" in caplog.text
    assert cfg.kv_events_config.publisher == "zmq"
    cfg = resolve(tiny_model, "server", kv_events_config={"enable_kv_cache_events": True})
    assert cfg.kv_events_config.publisher == "zmq"


def test_resolution_does_not_mutate_the_arguments(tiny_model):
    args = EngineArgs(model=tiny_model, device="cpu")
    args.create_engine_config(usage_context="server")
    assert args.max_num_batched_tokens is None
    assert args.enable_prefix_caching is None
