"""The built-in tiny model loads offline in transformers, deterministically."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from pdfleet.engine.contracts.launch import python_module
from pdfleet.engine.tiny.builder import ARCHS, TinyModelSpec, build_tiny_model


def digest(path: str) -> str:
    return hashlib.sha256(Path(path, "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_each_family_offline(tiny_model_factory, arch, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tiny_model_factory(arch)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    expected = {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }[arch]
    assert type(model).__name__ == expected
    assert json.loads(Path(path, "config.json").read_text())["architectures"] == [expected]
    assert model.config.vocab_size == len(tok)
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert os.path.exists(os.path.join(path, name)), name


def test_weights_are_a_function_of_the_seed(tmp_path):
    a = build_tiny_model(str(tmp_path / "a"), TinyModelSpec(seed=1))
    b = build_tiny_model(str(tmp_path / "b"), TinyModelSpec(seed=1))
    c = build_tiny_model(str(tmp_path / "c"), TinyModelSpec(seed=2))
    assert digest(a) == digest(b) != digest(c)
    assert Path(a, "tokenizer.json").read_text() == Path(b, "tokenizer.json").read_text()


def test_tokenizer_round_trips_any_utf8_and_has_a_chat_template(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert 1500 <= len(tok) <= 8192
    for text in [
        "Hello, world!",
        "naïve café 東京 🙂🚀",
        "def f(x):\n    return x * 2\n",
        "ꙮ unseen glyphs ∰ ‱",
    ]:
        ids = tok(text, add_special_tokens=False).input_ids
        assert tok.decode(ids) == text
    assert tok("hi").input_ids[0] == tok.bos_token_id
    chat = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert (
        chat == "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    gen = json.loads(Path(tiny_model, "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids("<|im_end|>") in gen["eos_token_id"]


def test_cli_writes_a_model_directory(tmp_path):
    out = subprocess.run(
        [
            *python_module("pdfleet.engine.cli"),
            "tiny-model",
            str(tmp_path / "m"),
            "--arch",
            "qwen3",
            "--num-hidden-layers",
            "1",
            "--seed",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["num_hidden_layers"] == 1


def test_invalid_sizes_are_rejected():
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        TinyModelSpec(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="arch must be one of"):
        TinyModelSpec(arch="gpt2")
