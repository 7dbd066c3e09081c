"""Model settings derived from a local Hugging Face directory."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from pdfleet.engine.config import EngineArgs


def resolve(model, device="cpu", **kw):
    return EngineArgs(model=model, device=device, **kw).create_engine_config("server")


def test_shapes_and_lengths_from_config_json(tiny_model):
    m = resolve(tiny_model).model_config
    assert m.architecture == "LlamaForCausalLM"
    assert (m.num_hidden_layers, m.hidden_size, m.num_attention_heads) == (2, 64, 4)
    assert (m.num_key_value_heads, m.head_dim) == (2, 16)
    assert m.max_model_len == 4096 and not m.max_model_len_auto
    assert m.name == tiny_model


def test_explicit_head_dim_of_qwen3(tiny_model_factory):
    m = resolve(tiny_model_factory("qwen3")).model_config
    assert m.architecture == "Qwen3ForCausalLM"
    assert m.head_dim == 32 != m.hidden_size // m.num_attention_heads


def test_max_model_len_user_value_is_validated(tiny_model):
    assert resolve(tiny_model, max_model_len=1000).model_config.max_model_len == 1000
    with pytest.raises(
        ValueError,
        match=r"max_model_len \(5000\) is greater than the model's limit"
        r" \(4096, from max_position_embeddings",
    ):
        resolve(tiny_model, max_model_len=5000)
    auto = resolve(tiny_model, max_model_len=-1).model_config
    assert auto.max_model_len == 4096 and auto.max_model_len_auto


@pytest.mark.parametrize(
    ("stored", "device", "requested", "expected"),
    [
        ("float32", "cpu", "auto", "float32"),
        ("float32", "cuda", "auto", "bfloat16"),
        ("bfloat16", "cpu", "auto", "bfloat16"),
        ("float16", "cuda", "auto", "float16"),
        ("float32", "cpu", "half", "float16"),
        ("bfloat16", "cuda", "float", "float32"),
    ],
)
def test_dtype_resolution(tiny_model_factory, stored, device, requested, expected):
    model = tiny_model_factory("llama", dtype=stored)
    assert resolve(model, device=device, dtype=requested).model_config.dtype == expected


def test_sliding_window_and_disable_sliding_window(tiny_model_factory):
    model = tiny_model_factory("mistral", sliding_window=64)
    m = resolve(model).model_config
    assert m.sliding_window == 64
    assert resolve(model).cache_config.sliding_window == 64
    m = resolve(model, disable_sliding_window=True).model_config
    assert m.sliding_window is None and m.max_model_len == 64


def test_unsupported_architecture_and_rope(tmp_path, tiny_model):
    bad = tmp_path / "gpt2"
    shutil.copytree(tiny_model, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel' is not supported"):
        resolve(str(bad))
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        resolve(tiny_model, hf_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_hf_overrides_change_derived_values(tiny_model):
    m = resolve(
        tiny_model, hf_overrides={"max_position_embeddings": 8192}, max_model_len=6000
    ).model_config
    assert m.max_model_len == 6000


@pytest.mark.parametrize("case", ["missing", "file", "no_config"])
def test_model_path_errors(tmp_path, case):
    path = tmp_path / "m"
    if case == "file":
        path.write_text("x")
    elif case == "no_config":
        os.makedirs(path)
    with pytest.raises(ValueError, match=r"not a local directory|no config\.json"):
        resolve(str(path))


def test_no_model_is_an_error():
    with pytest.raises(ValueError, match="no model given"):
        EngineArgs().create_engine_config()
