"""CUDA-graph capture sizes resolve exactly as the seed's _set_cudagraph_sizes."""

from __future__ import annotations

import logging

import pytest

from pdfleet.engine.config import EngineArgs, default_capture_sizes

DEFAULT_256 = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]


def resolve(model: str, **kw):
    kw.setdefault("device", "cuda")
    return EngineArgs(model=model, **kw).create_engine_config(usage_context="server")


def test_default_sizes_for_256_seqs_and_8192_tokens(tiny_model):
    cfg = resolve(tiny_model, max_num_seqs=256, max_num_batched_tokens=8192)
    cc = cfg.compilation_config
    assert cc.cudagraph_mode == "FULL_DECODE_ONLY"
    assert cc.cudagraph_capture_sizes == DEFAULT_256
    assert cc.cudagraph_capture_sizes[:6] == [1, 2, 4, 8, 16, 24]
    assert cc.cudagraph_capture_sizes[-4:] == [464, 480, 496, 512]
    assert cc.max_cudagraph_capture_size == 512


@pytest.mark.parametrize(
    ("kw", "sizes", "max_size"),
    [
        # max = min(2 * max_num_seqs, 512, max_num_batched_tokens)
        ({"max_num_seqs": 4, "max_num_batched_tokens": 8192}, [1, 2, 4, 8], 8),
        ({"max_num_seqs": 2, "max_num_batched_tokens": 8192}, [1, 2, 4], 4),
        ({"max_num_seqs": 1, "max_num_batched_tokens": 8192}, [1, 2], 2),
        ({"max_num_seqs": 64, "max_num_batched_tokens": 100}, [1, 2, 4, *range(8, 97, 8)], 96),
        (
            {"max_num_seqs": 200, "max_num_batched_tokens": 8192},
            [1, 2, 4, *range(8, 256, 8), *range(256, 401, 16)],
            400,
        ),
        # explicit sizes are de-duplicated and sorted; the max follows them
        ({"cudagraph_capture_sizes": [8, 4, 4, 1]}, [1, 4, 8], 8),
        ({"compilation_config": {"cudagraph_capture_sizes": [3, 3, 2]}}, [2, 3], 3),
        # an explicit max alone is truncated to the last default size below it
        (
            {
                "max_cudagraph_capture_size": 300,
                "max_num_seqs": 256,
                "max_num_batched_tokens": 8192,
            },
            [1, 2, 4, *range(8, 256, 8), 256, 272, 288],
            288,
        ),
        ({"max_cudagraph_capture_size": 16, "cudagraph_capture_sizes": [16, 1]}, [1, 16], 16),
    ],
)
def test_capture_size_table(tiny_model, kw, sizes, max_size):
    cc = resolve(tiny_model, **kw).compilation_config
    assert cc.cudagraph_capture_sizes == sizes
    assert cc.max_cudagraph_capture_size == max_size


def test_truncating_an_explicit_max_warns(tiny_model, caplog):
    with caplog.at_level(logging.WARNING):
        cc = resolve(
            tiny_model, max_cudagraph_capture_size=300, max_num_seqs=256
        ).compilation_config
    assert cc.max_cudagraph_capture_size == 288
    assert "Truncating max_cudagraph_capture_size to 288" in caplog.text


def test_inconsistent_explicit_max_and_sizes_is_an_error(tiny_model):
    with pytest.raises(ValueError, match=r"max_cudagraph_capture_size \(32\) must equal.*\(16\)"):
        resolve(tiny_model, max_cudagraph_capture_size=32, cudagraph_capture_sizes=[1, 16])


def test_empty_explicit_sizes_is_an_error(tiny_model):
    with pytest.raises(ValueError, match="at least one size"):
        resolve(tiny_model, cudagraph_capture_sizes=[])


@pytest.mark.parametrize(
    "kw",
    [
        {"enforce_eager": True},
        {"compilation_config": {"cudagraph_mode": "NONE"}},
        {"device": "cpu"},
    ],
)
def test_no_cuda_graphs_means_no_sizes(tiny_model, kw):
    cc = resolve(tiny_model, **kw).compilation_config
    assert cc.cudagraph_mode == "NONE"
    assert cc.cudagraph_capture_sizes == []
    assert cc.max_cudagraph_capture_size == 0


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {
                "cudagraph_capture_sizes": [1],
                "compilation_config": {"cudagraph_capture_sizes": [2]},
            },
            "--cudagraph-capture-sizes and compilation_config.cudagraph_capture_sizes are mutually",
        ),
        (
            {
                "max_cudagraph_capture_size": 8,
                "compilation_config": {"max_cudagraph_capture_size": 8},
            },
            "--max-cudagraph-capture-size and compilation_config.max_cudagraph_capture_size are",
        ),
        (
            {"compilation_config": {"cudagraph_mode": "PIECEWISE"}},
            "cudagraph_mode.*'PIECEWISE' is not",
        ),
    ],
)
def test_mutually_exclusive_and_unsupported_compilation_settings(tiny_model, kw, message):
    with pytest.raises(ValueError, match=message):
        resolve(tiny_model, **kw)


def test_padding_to_captured_sizes(tiny_model):
    cfg = resolve(tiny_model, max_num_seqs=256, max_num_batched_tokens=8192)
    assert [cfg.pad_for_cudagraph(b) for b in (1, 3, 5, 9, 255, 257, 512)] == [
        1,
        4,
        8,
        16,
        256,
        272,
        512,
    ]
    with pytest.raises(IndexError):
        cfg.pad_for_cudagraph(513)


def test_default_capture_sizes_helper():
    assert default_capture_sizes(512) == DEFAULT_256
    assert default_capture_sizes(7) == [1, 2, 4]
