"""compute_hash is stable across processes and tracks only what shapes the computation."""

from __future__ import annotations

import shutil
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


def test_the_resume_identity_tracks_what_makes_the_tokens_and_not_the_kv_layout(
    tiny_model, tmp_path, monkeypatch
):
    base = config(tiny_model, max_model_len=256)
    ident = base.resume_identity()
    # Another KV layout or scheduling: another compat hash, the same tokens.
    for kw in ({"block_size": 32}, {"max_num_seqs": 7}):
        other = config(tiny_model, max_model_len=256, **kw)
        assert other.resume_identity() == ident, kw
    assert config(tiny_model, max_model_len=256, block_size=32).compat_hash() != base.compat_hash()
    # An image of another pdfleet version resumes the same requests.
    monkeypatch.setattr("pdfleet.engine.config.engine.pdfleet_version", lambda: "9.9.9")
    assert base.resume_identity() == ident and base.compat_hash() != ident
    # What changes the tokens or their text changes it.
    for kw in (
        {"dtype": "float16"},
        {"max_model_len": 128},
        {"override_generation_config": {"temperature": 0.5}},
        {"kv_cache_dtype": "float16"},
    ):
        changed = config(tiny_model, **{"max_model_len": 256, **kw})
        assert changed.resume_identity() != ident, kw
    assert base.resume_identity({"chat_template": "{{ messages }}"}) != ident
    # The tokenizer by its files' content, not its path: a copy is the same one.
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)
    assert (
        config(str(copy), max_model_len=256).resume_factors()["tokenizer"]
        == (base.resume_factors()["tokenizer"])
    )
    changed_copy = tmp_path / "changed"
    shutil.copytree(tiny_model, changed_copy)
    config_file = changed_copy / "tokenizer_config.json"
    config_file.write_text(config_file.read_text().replace("{", '{"x_changed": 1, ', 1))
    assert config(str(changed_copy), max_model_len=256).resume_identity() != ident
