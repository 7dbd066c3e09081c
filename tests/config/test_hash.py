"""compute_hash is stable across processes and tracks only what shapes the computation."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdfleet.engine.config import EngineArgs


def config(model, **kw):
    kw.setdefault("device", "cuda")
    return EngineArgs(model=model, **kw).create_engine_config("server")


def test_hash_is_stable_across_processes(tiny_model):
    code = (
        "from pdfleet.engine.config import EngineArgs;"
        f"print(EngineArgs(model={tiny_model!r}, device='cuda').create_engine_config('server')"
        ".compute_hash())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-P", "-c", code],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
            env={"PYTHONHASHSEED": str(seed), "PATH": "/usr/bin:/bin"},
        ).stdout.strip()
        for seed in (1, 2)
    }
    assert outs == {config(tiny_model).compute_hash()}


@pytest.mark.parametrize(
    "kw",
    [
        {"dtype": "float16"},
        {"block_size": 32},
        {"kv_cache_dtype": "float16"},
        {"enforce_eager": True},
        {"cudagraph_capture_sizes": [1, 2]},
        {"device": "cpu"},
        {"max_model_len": 1024},
        {"hf_overrides": {"rms_norm_eps": 1e-5}},
    ],
)
def test_hash_changes_with_what_affects_the_computation(tiny_model, kw):
    assert config(tiny_model, **kw).compute_hash() != config(tiny_model).compute_hash()


@pytest.mark.parametrize(
    "kw",
    [
        {"seed": 7},
        {"served_model_name": ["other"]},
        {"gpu_memory_utilization": 0.5},
        {"enable_prefix_caching": False},
        {"scheduling_policy": "priority"},
        {"max_logprobs": 5},
        {"kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}},
        {"shutdown_timeout": 30},
    ],
)
def test_hash_ignores_serving_only_settings(tiny_model, kw):
    assert config(tiny_model, **kw).compute_hash() == config(tiny_model).compute_hash()


def test_compat_hash_tracks_what_kv_exchange_needs(tiny_model, tiny_model_factory):
    base = config(tiny_model).compat_hash()
    assert config(tiny_model, max_num_seqs=8, gpu_memory_utilization=0.5).compat_hash() == base
    for kw in (
        {"block_size": 32},
        {"dtype": "float16"},
        {"kv_cache_dtype": "float32"},
        {"revision": "v2"},
        {"served_model_name": ["x"]},
    ):
        assert config(tiny_model, **kw).compat_hash() != base, kw
    other = tiny_model_factory("llama", num_hidden_layers=3)
    assert config(other, served_model_name=[tiny_model]).compat_hash() != base
